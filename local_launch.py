"""Start `python train.py ...` (or another script) as N ranks on this machine, the way a launcher would,
with a deadline. Used by the tests and the benchmark scripts.

A deadlocked pipeline must fail the test quickly instead of hanging CI: every rank is killed
when the deadline passes.
"""
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass
class Run:
    returncodes: list
    stdout: list
    stderr: list

    @property
    def ok(self):
        return all(rc == 0 for rc in self.returncodes)

    def explain(self):
        return "\n".join(f"--- rank {r} rc={rc}\n{err[-3000:]}" for r, (rc, err) in
                         enumerate(zip(self.returncodes, self.stderr)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nprocs: int, args, timeout: float = 240, script: str = "train.py", env=None) -> Run:
    port = free_port()
    procs, logs = [], []
    for rank in range(nprocs):
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                        LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        out = tempfile.TemporaryFile("w+")
        err = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT,
                                      env=rank_env, stdout=out, stderr=err))
        logs.append((out, err))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        timed_out = True
    else:
        timed_out = False

    def read(f):
        f.seek(0)
        return f.read()

    run = Run([p.returncode for p in procs], [read(o) for o, _ in logs], [read(e) for _, e in logs])
    if timed_out:
        raise TimeoutError(f"ranks still running after {timeout}s (deadlock?):\n{run.explain()}")
    return run
