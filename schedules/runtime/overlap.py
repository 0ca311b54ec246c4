"""Two passes of one rank that take turns at their communication: DualPipe's overlapped forward-backward pair.

`run_pair(first, second)` runs two passes (the backward of one micro-batch and the forward of another) as one
unit: `first` in a worker thread (one per process, reused by every pair), `second` in the calling thread, and
only one of them computes at any moment.
Each hands the other the turn when it has started a collective and has nothing to compute until it ends
(`exchange`: the experts' all-to-all, dispatch and combine, forward and backward), so the other's computation
fills the time the link takes: DeepSeek-V3's overlap (report, Sec. 3.2.1), where one micro-batch's attention
and MLP run while the other's dispatch or combine is in flight. Per Mixture-of-Experts layer and pair:

    communication:  combine_bwd  | dispatch_fwd  | dispatch_bwd | combine_fwd  | ...
    computation:    attn+gate_fwd | experts_bwd  | experts_fwd  | attn_bwd     | ...

Why turns and not two threads computing at once: the arithmetic is the same as one pass after the other (each pass
runs its own operations in its own order, on its own micro-batch), so an overlapped pair gives bit for bit the
sequential pair's results; and every rank issues its collectives in the same order (the turns alternate at each
collective, the same way on every rank of a group that runs the same stream), which gloo and NCCL need.

Where both passes wait for their collectives, the core would idle: a backward whose weight gradients are deferred
(`fill_with`, the engine's fused backward in a pair) fills that time with them, one layer's at a time, the rest
computed when the pair ends (Megatron's `mlp_dW` in the order above, but taken where the link holds both passes
up, not at a fixed place). Each is the same arithmetic, added into its `.grad` in the order the backward queued it,
so the results stay those of one pass after the other, to the bit.

Outside a pair, `exchange` waits for its collective at once. A pass with no collective runs through in one turn:
the pair is then the two passes one after the other, `first` first.
"""
import os
import queue
import threading
import time

import torch
import torch.distributed as dist

from schedules.runtime.all_to_all import post_all_to_all

_local = threading.local()  # .turns, .me: the pair this thread's pass belongs to, and which of its two it is


class _Turns:
    """Which of two parties may compute; a party that has ended gives the turn up for good."""

    def __init__(self):
        self._cond = threading.Condition()
        self._turn = 0
        self._ended = [False, False]
        self.filler = None  # weight-gradient works either party computes while its collective is in flight

    def wait(self, me):
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me or self._ended[1 - me])

    def hand_over(self, me):
        """Give the other party the turn (if it is still running) and wait until it is ours again."""
        with self._cond:
            if not self._ended[1 - me]:
                self._turn = 1 - me
                self._cond.notify_all()
        self.wait(me)

    def end(self, me):
        with self._cond:
            self._ended[me] = True
            self._turn = 1 - me
            self._cond.notify_all()


def run_pair(first, second):
    """`first()` and `second()` as one unit, taking turns at their collectives (see the module docstring); `first`
    starts. An exception in either is raised here once both have ended."""
    turns = _Turns()
    failure = []

    def party(me, fn):
        _local.turns, _local.me = turns, me
        try:
            turns.wait(me)
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            failure.append(e)
        finally:
            _local.turns = None
            turns.end(me)

    done = _worker().submit(lambda: party(0, first))
    party(1, second)
    done.wait()
    if failure:
        raise failure[0]
    _fill(turns, None)  # what no wait took: computed now, before anything reads the gradients


def run_alone(fn, rest=True):
    """`fn()`, a pass with no other to pair with, as a pair of one: its waits for its collectives are filled as a
    pair's are (`fill_with`), the rest computed when it ends (`rest`; else left in the queue, for a W to compute)."""
    turns = _Turns()
    turns._ended[1] = True  # no other party: the turn never leaves
    _local.turns, _local.me = turns, 0
    try:
        fn()
    finally:
        _local.turns = None
    if rest:
        _fill(turns, None)


class _Worker:
    """One long-lived thread that runs every pair's `first` pass. Why not a new thread per pair: glibc gives each
    new thread a malloc arena in turn, so threads made per pair spread the passes' buffers over many arenas, and
    the next pair's thread does not reuse what the last one freed. On the MoE GPTlite (a large head and logits) that
    cost up to 30% of a step, in spikes; one worker faults in 13-25% fewer pages a run (measured, one machine)."""

    def __init__(self):
        self.pid = os.getpid()
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="overlapped-pass", daemon=True).start()

    def _serve(self):
        while True:
            job, done = self._jobs.get()
            try:
                job()
            finally:
                done.set()

    def submit(self, job):
        done = threading.Event()
        self._jobs.put((job, done))
        return done


_the_worker = None
_worker_lock = threading.Lock()


def _worker():
    """This process's worker (made on first use; a forked child, which has no thread of its parent's, makes its
    own)."""
    global _the_worker
    with _worker_lock:
        if _the_worker is None or _the_worker.pid != os.getpid():
            _the_worker = _Worker()
        return _the_worker


def fill_with(queue, compute):
    """Within a pair: `queue` (a list the pass appends weight-gradient works to, weight_grad.py) is what either pass
    computes, by `compute(work)`, when it has the turn back and its collective is still in flight, oldest first; what
    is left is computed when the pair ends, before `run_pair` returns."""
    _local.turns.filler = (queue, compute)


def _fill(turns, work):
    """Compute the pair's queued weight gradients, one work at a time, until `work` is done (None: all of them)."""
    if not turns.filler:
        return
    queue, compute = turns.filler
    while queue and (work is None or not work.is_completed()):
        compute(queue.pop(0))


def in_pair():
    return getattr(_local, 'turns', None) is not None


_observers = []  # called with (name, issued, resumed, done, sent, group) of each exchange (the tracer)


def observe(observer):
    """`observer(name, issued, resumed, done, sent, group)` after every collective waited for here: when it was
    issued, when this pass had the turn again (from then on the rank waited for it: exposed), when it was done, the
    bytes this rank sent to others in it, and (this rank, the group's ranks), global ranks (None outside a process
    group)."""
    _observers.append(observer)


def unobserve(observer):
    _observers.remove(observer)


def wait_for(work, name="all-to-all", issued=None, sent=0, group=None):
    """Wait for `work` (an asynchronous collective over `group` that sent `sent` bytes to other ranks); inside a
    pair, the other pass computes meanwhile."""
    turns = getattr(_local, 'turns', None)
    if turns is not None:
        turns.hand_over(_local.me)
        _fill(turns, work)
    resumed = time.perf_counter() if _observers else None
    work.wait()
    if _observers:
        done = time.perf_counter()
        ranks = _group_ranks(group)
        for observer in _observers:
            observer(name, resumed if issued is None else issued, resumed, done, sent, ranks)


def _group_ranks(group):
    """(this rank, the ranks of `group` (None: the default group), a tuple), global ranks; None outside a process
    group."""
    if not dist.is_initialized():
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return dist.get_rank(), tuple(ranks)


def all_to_all(x, group):
    """`torch.distributed.all_to_all_single` of `x` over `group` (equal splits), asynchronous (its receives posted
    before its sends on gloo: all_to_all.py): `wait_for` it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    issued = time.perf_counter() if _observers else None
    ranks = dist.get_world_size(group)  # equal splits: all but this rank's share leaves it
    wait_for(post_all_to_all(out, x, group), issued=issued,
             sent=x.numel() * x.element_size() * (ranks - 1) // ranks, group=group)
    return out


def all_reduce_max(x, group, name="capacity"):
    """The largest of every rank's `x` (a tensor) over `group`, asynchronous like `all_to_all`: inside a pair the
    other pass computes while it is in flight, where a blocking all-reduce would hold the turn until every rank of
    the group reached it."""
    x = x.clone()
    issued = time.perf_counter() if _observers else None
    wait_for(dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group, async_op=True), name=name, issued=issued,
             group=group)
    return x


class _Exchange(torch.autograd.Function):
    """An all-to-all of equal splits whose backward is the same all-to-all of the gradient (DeepSpeed's _AllToAll),
    both through `all_to_all`, so that an overlapped pair hands the turn over while either is in flight."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return None, all_to_all(grad, ctx.group)


def exchange(x, group):
    return _Exchange.apply(group, x)
