"""Start `python train.py ...` (or another script) as N ranks on this machine, the way a launcher would,
with a deadline. Used by the tests and the benchmark scripts.

A deadlocked pipeline must fail the test quickly instead of hanging CI: every rank is killed
when the deadline passes. Whatever happens to the ranks (exit, error, kill, deadline, an
interrupted test), the launch leaves nothing behind: no process, and none of the shared-memory
all-reduce buffers DeepSpeed's CPU op creates under /dev/shm for the launch's port.

After `preload()` (the tests call it) ranks are forked from a server process that imported torch and
deepspeed once, instead of each starting an interpreter that imports them again (3-5 s of CPU per
rank, most of a small test launch). A forked rank runs the script as `python script args` would: its own
environment, arguments, working folder, output files, `__main__`, exit status and exit handlers.
The benchmarks keep fresh interpreters.
"""
import atexit
import glob
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
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


_preload = None  # the modules ranks are forked with (preload()), or None: fresh interpreters
_preloaded = None  # the forkserver context, once started


def preload(modules=("torch", "deepspeed")):
    """From now on, fork ranks from a server process that has imported `modules` (Python's forkserver),
    started at the first launch."""
    global _preload
    _preload = tuple(modules)


def _forkserver():
    """The forkserver context, started on first use with one thread per process, as the ranks get."""
    global _preloaded
    if _preloaded is not None:
        return _preloaded
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_preload))
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # torch reads it when the server imports it
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    _preloaded = context
    return context


def _run_forked(script, args, env, stdout, stderr):
    """A rank forked from the preloaded server: `python script args` in this process, then exit as it would."""
    _die_with_parent()  # the server's child: the server itself ends with the launching process
    for fd, path in ((1, stdout), (2, stderr)):
        handle = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    path = str(ROOT / script)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class _Forked:
    """The part of subprocess.Popen that Ranks uses, for a rank forked from the preloaded server."""

    def __init__(self, script, args, env, stdout, stderr):
        self._process = _forkserver().Process(target=_run_forked, args=(script, args, env, stdout, stderr))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig):
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


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
                out, err = tempfile.NamedTemporaryFile("w+"), tempfile.NamedTemporaryFile("w+")
                self.logs.append((out, err))
                if _preload is not None:
                    self.procs.append(_Forked(script, list(map(str, args)), rank_env, out.name, err.name))
                else:
                    self.procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)],
                                                       cwd=ROOT, env=rank_env, stdout=out, stderr=err,
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
