"""How a run of train.py fails: in one line from rank 0, never a traceback, and never with a rank left
waiting on a peer that is gone.

- `UsageError`: bad input (a flag, the config, the launch, a checkpoint), exit status 2; `Fault`: a
  failure that is not bad input, already said in one line, exit status 1; `one_line(e)` for the rest.
- `Peers`: what the ranks tell each other outside the collectives, through the rendezvous store: the
  run's first failure (so that rank 0 prints the cause, not a peer's "connection closed"), and a
  heartbeat per rank (so that a killed or stopped rank ends the run within --dist-timeout).
"""
import json
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta


class UsageError(Exception):
    """Bad flags, config, launch or checkpoint: printed as one line by rank 0, exit status 2."""


class Fault(Exception):
    """A failure that is not bad input, already said in one line: printed by rank 0, exit status 1."""


class Peers:
    """What the ranks tell each other outside the collectives, through the rendezvous store (TCPStore
    clients of their own, with a short timeout): the run's failures in the order they happened, each
    a rank, an exit status and a one-line reason; and a heartbeat per rank.

    The first failure is the cause: a rank posts its reason before it exits, so before its peers see
    the connection close. A watcher thread beats, ends this rank as soon as another rank failed
    (whatever collective or store wait it is in), and on rank 0 ends the run when a rank has been
    silent for --dist-timeout seconds (killed, stopped, or stuck where no timeout applies).

    Across nodes, a rank can lose rank 0 itself (its node died, or this node's link was cut): the store is
    then first probed with a plain socket, so that no store client retries against it (each retry is a
    screenful of c10d warnings), and the rank ends with its own line, naming what it lost."""
    PREFIX, PERIOD, SILENT_S = "train.py/", 1.0, 3.0

    def __init__(self, rank, world, timeout_s):
        from torch.distributed import TCPStore
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._address = (host, port)
        self._stores = threading.local()  # a client per thread: the main thread's and the watcher's
        self._connect = lambda: TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        self._ending, self._stop = threading.Lock(), threading.Event()
        self._heard = {}  # rank 0: rank -> (its last heartbeat, when that changed)
        self._heard_from_store = time.monotonic()  # when the watcher's store calls last returned
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        # A store call never returns once this node's link is cut (the client's timeout does not cover a
        # connection whose peer went silent): a second thread, which makes no store calls, ends the rank then.
        threading.Thread(target=self._deadline, daemon=True).start()

    @property
    def store(self):
        if not hasattr(self._stores, "client"):
            self._stores.client = self._connect()
        return self._stores.client

    def close(self):
        """Stop watching (the run ended well): rank 0 no longer expects this rank's heartbeat."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(f"{self.PREFIX}beat/{self.rank}", "done")
        except Exception:
            pass

    def fail(self, status, reason, cause_unknown=False):
        """Post this rank's failure, then end the rank (rank 0 first prints the run's first failure).
        `cause_unknown`: the failure may be a peer's fault (a closed connection, a timeout)."""
        if self.rank != 0 and not self.reachable():
            self._lost(status, f"this rank saw {reason}")
        try:
            n = self.store.add(f"{self.PREFIX}failures", 1)
            self.store.set(f"{self.PREFIX}failure/{n}", json.dumps([self.rank, status, reason]))
            first = json.loads(self.store.get(f"{self.PREFIX}failure/1"))
        except Exception:  # the store went with rank 0
            first = [self.rank, status, reason]
        if first[0] == self.rank == 0 and cause_unknown:  # e.g. "connection closed by peer": whose fault?
            silent = self._silent(wait_s=self.SILENT_S + 1)
            if silent:
                first[2] = (f"rank {silent} stopped responding (killed, crashed, stopped or cut off); "
                            f"rank 0 saw {reason}")
        self._end(*first, own_reason=reason)

    def _end(self, rank, status, reason, own_reason=None):
        with self._ending:  # the watcher and the main thread may both end the rank: one does
            if self.rank == 0:
                prefix = f"rank {rank}: " if rank != 0 and reason != own_reason else ""
                print(f"error: {prefix}{reason}", file=sys.stderr, flush=True)
                self._linger()
            else:
                try:
                    self.store.add(f"{self.PREFIX}read", 1)
                except Exception:
                    pass
            sys.stdout.flush()
            os._exit(status)

    def reachable(self, timeout_s=2.0):
        """Whether rank 0's store still accepts connections (a plain socket: no c10d retries, no warnings)."""
        try:
            with socket.create_connection(self._address, timeout=timeout_s):
                return True
        except OSError:
            return False

    def _lost(self, status, what):
        """This rank cannot reach rank 0 (its node died, or this node was cut off): say so here, since no
        one else can, and end."""
        # another thread may hold the lock while it waits on the lost store: end without it then
        self._ending.acquire(timeout=2.0)
        host, port = self._address
        print(f"error: rank {self.rank} lost rank 0: its store at {host}:{port} cannot be reached (rank 0's "
              f"node died, or this node's link is down); {what}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status)

    def _deadline(self):
        """End this rank once the watcher's store calls have failed or hung for --dist-timeout and rank 0's store
        no longer accepts connections."""
        while not self._stop.wait(self.PERIOD):
            if time.monotonic() - self._heard_from_store > self.timeout_s and not self.reachable():
                self._lost(1, f"nothing heard from it for --dist-timeout {self.timeout_s} s")

    def _linger(self, wait_s=5.0):
        """Rank 0 hosts the store: keep it up until the other ranks have read the failure."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(f"{self.PREFIX}read", 0) >= self.world - 1 - len(self._silent(as_list=True)):
                    return
            except Exception:
                return
            time.sleep(0.1)

    def _silent(self, wait_s=0.0, silent_s=None, as_list=False):
        """Rank 0: the ranks whose heartbeat has not changed for `silent_s` seconds, as "1, 3" (or a list),
        waiting up to `wait_s` seconds for one."""
        silent_s = self.SILENT_S if silent_s is None else silent_s
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            silent = sorted(r for r, (beat, since) in list(self._heard.items()) if beat != b"done" and
                            now - since >= silent_s)
            if silent or now >= deadline:
                return silent if as_list else ", ".join(map(str, silent))
            time.sleep(0.2)

    def _watch(self):
        try:
            self.store.set(f"{self.PREFIX}beat/{self.rank}", "0")
        except Exception:  # no store to reach as a client: failures end as this rank's own errors
            return
        beat = 0
        keys = [f"{self.PREFIX}beat/{r}" for r in range(self.world)]
        while not self._stop.wait(self.PERIOD if beat else 0):
            try:
                beat += 1
                self.store.set(keys[self.rank], str(beat))
                if self.store.add(f"{self.PREFIX}failures", 0):  # another rank failed: end this one too
                    first = json.loads(self.store.get(f"{self.PREFIX}failure/1"))
                    if first[0] != self.rank:
                        self._end(*first)
                if self.rank == 0 and self.store.check(keys):  # every rank beats: who went silent?
                    now = time.monotonic()
                    for r, value in enumerate(self.store.multi_get(keys)):
                        if r and (r not in self._heard or self._heard[r][0] != value):
                            self._heard[r] = (value, now)
                    stalled = self._silent(silent_s=self.timeout_s)
                    if stalled:
                        self.fail(1, f"rank {stalled} stopped responding for --dist-timeout {self.timeout_s} s "
                                     "(killed, stopped, cut off, or stuck), so the run ends")
                self._heard_from_store = time.monotonic()
            except Exception:
                # rank 0, the store's host, may be gone: wait for it with a plain socket, not the store client (whose
                # retries flood the log); _deadline ends this rank if it stays gone
                while not self.reachable() and not self._stop.is_set():
                    self._stop.wait(self.PERIOD)


def one_line(e):
    """An exception as one line: its type and the first line of its message, without a C++ source location
    (gloo's `[.../pair.cc:553] Connection closed by peer [127.0.0.1]:49859. This is typically ...` ->
    `Connection closed by peer [127.0.0.1]:49859`)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\][\s.]*", "", lines[0] if lines else "")
    if text != (lines[0] if lines else ""):  # a message from C++ code: its first sentence says it
        text = text.split(". ")[0].rstrip(".")
    return f"{type(e).__name__}: {text}".rstrip(": ")
