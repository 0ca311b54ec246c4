"""Start `python train.py ...` (or another script) as N ranks on this machine, the way a launcher would,
with a deadline. Used by the tests and the benchmark scripts.

A deadlocked pipeline must fail the test quickly instead of hanging CI: every rank is killed
when the deadline passes. Whatever happens to the ranks (exit, error, kill, deadline, an
interrupted test), the launch leaves nothing behind: no process, and none of the shared-memory
all-reduce buffers DeepSpeed's CPU op creates under /dev/shm for the launch's port.
"""
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MASTER_ADDR = "127.0.0.1"
PORTS = []  # the master port of every launch of this process (the tests check none left anything behind)


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
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child, before exec: SIGKILL it when the launching process dies (a test killed by its runner
    or an interrupted benchmark leaves no rank behind). Linux; elsewhere a no-op."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def shm_buffers(port, addr=MASTER_ADDR):
    """DeepSpeed's CPU all-reduce buffers of the launch on `port` (csrc/cpu/comm/shm.cpp names them
    deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank})."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*")


class Ranks:
    """The processes of one launch: `wait()` for them with a deadline, or signal one meanwhile."""

    def __init__(self, nprocs, args, script="train.py", env=None):
        self.port = free_port()
        PORTS.append(self.port)
        self.procs, self.logs = [], []
        try:
            for rank in range(nprocs):
                rank_env = {**os.environ, "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(self.port),
                            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                            "LOCAL_WORLD_SIZE": str(nprocs), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                            **(env or {})}
                out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                self.logs.append((out, err))
                self.procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT,
                                                   env=rank_env, stdout=out, stderr=err,
                                                   preexec_fn=_die_with_parent))
        except BaseException:
            self.close()
            raise

    def stdout(self, rank):
        """What rank `rank` printed so far (read without moving the offset the rank writes at)."""
        fd = self.logs[rank][0].fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def signal(self, rank, sig=signal.SIGKILL):
        self.procs[rank].send_signal(sig)

    def wait(self, timeout=240) -> Run:
        """Every rank's exit status and output; TimeoutError (every rank killed) past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        else:
            timed_out = False
        finally:
            self.close()
        run = Run([p.returncode for p in self.procs], [self._read(o) for o, _ in self.logs],
                  [self._read(e) for _, e in self.logs])
        for f in (f for pair in self.logs for f in pair):
            f.close()
        if timed_out:
            raise TimeoutError(f"ranks still running after {timeout}s (deadlock?):\n{run.explain()}")
        return run

    def close(self):
        """Kill what still runs (a stopped rank too), then remove the launch's shared-memory buffers."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        for path in shm_buffers(self.port):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @staticmethod
    def _read(f):
        f.seek(0)
        return f.read()


def start(nprocs: int, args, script: str = "train.py", env=None) -> Ranks:
    """Start the ranks and return at once (tests that kill or stop a rank mid-run)."""
    return Ranks(nprocs, args, script, env)


def launch(nprocs: int, args, timeout: float = 240, script: str = "train.py", env=None) -> Run:
    return start(nprocs, args, script, env).wait(timeout)
