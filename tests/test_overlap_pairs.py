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


class _Collective:
    """A collective in flight until `done` is set (is_completed / wait, as torch's Work)."""

    def __init__(self):
        self.done = threading.Event()

    def is_completed(self):
        return self.done.is_set()

    def wait(self):
        assert self.done.wait(10), "the collective never ended"


def test_a_backward_s_queued_weight_gradients_fill_the_wait_and_the_rest_run_when_the_pair_ends():
    """The backward queues works and issues a collective; the forward issues one too, so both wait: the pass given
    the turn computes queued works, oldest first, until its collective ends (here after two of them), and the pair
    computes the rest, each exactly once, before run_pair returns."""
    log, queue = [], []
    backward_comm, forward_comm = _Collective(), _Collective()

    def compute(work):
        log.append(("filled", work, "waiting" if not backward_comm.is_completed() else "after"))
        if work == 1:
            backward_comm.done.set()  # the link frees up while the second work computes

    def backward():
        overlap.fill_with(queue, compute)
        queue.extend([0, 1, 2])  # B of the first layer, its weight-gradient works queued
        overlap.wait_for(backward_comm)  # the forward computes; then the turn comes back with this still in flight
        log.append("backward resumed")
        queue.append(3)

    def forward():
        log.append("forward computes")
        forward_comm.done.set()
        overlap.wait_for(forward_comm)
        log.append("forward resumed")

    overlap.run_pair(backward, forward)
    assert log[:4] == ["forward computes", ("filled", 0, "waiting"), ("filled", 1, "waiting"), "backward resumed"]
    assert sorted(w for entry in log if entry[0] == "filled" for w in [entry[1]]) == [0, 1, 2, 3]
    assert log[-2:] == [("filled", 2, "after"), ("filled", 3, "after")] and queue == []


def test_without_a_filler_a_pair_waits_as_before():
    comm = _Collective()
    comm.done.set()
    got = []
    overlap.run_pair(lambda: (overlap.wait_for(comm), got.append("first")), lambda: got.append("second"))
    assert got == ["second", "first"]


@pytest.mark.parametrize("rest", [True, False])
def test_a_pass_alone_fills_its_own_waits(rest):
    """run_alone: a backward with no partner computes its queued weight gradients while its collective is in flight,
    and the rest when it ends; with rest=False (a B whose own W comes next, ChunkedEngine._run_backward_input_pass)
    what is left stays queued, in order, for the W."""
    log, queue, comm = [], [], _Collective()

    def compute(work):
        log.append((work, "waiting" if not comm.is_completed() else "after"))
        comm.done.set()

    def backward():
        overlap.fill_with(queue, compute)
        queue.extend([0, 1])
        overlap.wait_for(comm)
        queue.append(2)
    overlap.run_alone(backward, rest=rest)
    if rest:
        assert log == [(0, "waiting"), (1, "after"), (2, "after")] and queue == []
    else:
        assert log == [(0, "waiting")] and queue == [1, 2]
