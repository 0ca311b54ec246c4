"""schedules/runtime/overlap.py's pair in one process: `first` starts, the two take turns at each collective, an
exception in either is raised in the caller, and every pair's first pass runs on one long-lived worker thread
(a new thread per pair cost the MoE GPTlite up to 30% of a step in malloc arenas), a forked child its own."""
import os
import signal
import threading

import pytest

from schedules.runtime import overlap


def test_first_starts_and_every_pair_reuses_one_worker_thread():
    order, threads = [], []

    def first():
        order.append("first")
        threads.append(threading.get_ident())

    for _ in range(3):
        overlap.run_pair(first, lambda: order.append("second"))
    assert order == ["first", "second"] * 3
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_an_exception_in_the_worker_s_pass_is_raised_in_the_caller():
    def first():
        raise RuntimeError("rank 0, step 3: broken")
    with pytest.raises(RuntimeError, match="broken"):
        overlap.run_pair(first, lambda: None)
    done = []
    overlap.run_pair(lambda: done.append(1), lambda: done.append(2))  # the worker survives it
    assert done == [1, 2]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_makes_its_own_worker():
    overlap.run_pair(lambda: None, lambda: None)  # the parent's worker exists
    pid = os.fork()
    if pid == 0:  # the child has no thread of its parent's: reusing its worker would wait forever
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the deadline: a hung child ends by SIGALRM
        signal.alarm(20)
        got = []
        overlap.run_pair(lambda: got.append("first"), lambda: got.append("second"))
        os._exit(0 if got == ["first", "second"] else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
