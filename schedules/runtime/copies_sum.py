"""The mirror placement's gradient sum: ranks r and p-1-r each hold a copy of stage r, and each copy's gradients are
summed with the other's once a step so the two stay equal. Started as early as the step allows, as Megatron's
`--overlap-grad-reduce` starts data-parallel buckets:

- a chunk's share starts once its last backward of the step is done (a fused backward, alone or paired, or a W;
  counted from the step's instruction stream, `gradient_ends`);
- within that last backward, where its weight gradients are deferred works (weight_grad.py) computed one at a time
  (an overlapped pair's or a lone backward's fill, a W), each work's large gradients start as soon as it has added
  them: that backward's waits for its all-to-alls, and the W, then carry the sum's bytes over the link;
- ReduceGrads sums what has not started and waits for everything.

The sums share one communicator, where collectives match by the order they are issued, so both copies must issue
them in one order: they finish their stages' gradients in the same order (`gradient_order`, checked from the
schedule's streams), and within a chunk's last backward the works come in autograd's order of the stage's layers,
which is the same in both copies; each work's sums are issued in that order whether a wait or the W computes it.
Summing two ranks' values is the same in any grouping, bit for bit.
"""
from collections import Counter

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import BackwardWeightPass, ForwardBackwardPass

SMALL_GRADIENT_BYTES = 1 << 20  # below this, gradients are summed together in one flat buffer


class CopiesSum:
    """One rank's share of the copies' gradient sum over `group`, step by step. `gradients(chunks)`: (parameters,
    gradients) of those chunks that the copies sum, in a fixed order."""

    def __init__(self, group, gradients):
        self.group, self._gradients = group, gradients
        self._left = Counter()  # chunk -> instructions still to end its gradients this step (empty: none early)
        self._final = set()  # chunks whose last gradient-ending instruction is running
        self._flying = {}  # chunk -> [finish function] of its sums in flight
        self._started = {}  # chunk -> ids of the parameters whose sum is in flight
        self._summed = {}  # chunk -> ids of the parameters the copies sum (kept: the module does not change)

    def new_step(self, counts):
        """A step whose chunks end their gradients in `counts` instructions each ({}: nothing starts early)."""
        self._left, self._final, self._flying, self._started = Counter(counts), set(), {}, {}

    def ending(self, chunk):
        """Before an instruction that ends a backward of `chunk` (or a B whose own W comes next): if it is the
        chunk's last, the works it adds are final (`work_added`). Whether it is."""
        if self._left.get(chunk) == 1:
            self._final.add(chunk)
        return chunk in self._final

    def work_added(self, chunk, work):
        """After a deferred weight-gradient work of `chunk` added its gradients: in the chunk's last backward, the
        sums of its large ones start."""
        if chunk not in self._final:
            return
        summed = self._summed_ids(chunk)
        large = [(p, p.grad) for p, _ in work.gradients()
                 if id(p) in summed and p.grad is not None and _bytes(p.grad) >= SMALL_GRADIENT_BYTES]
        if large and summable_in_place([g for _, g in large]):
            self._started.setdefault(chunk, set()).update(id(p) for p, _ in large)
            self._flying.setdefault(chunk, []).append(start_sum([g for _, g in large], self.group))

    def ended(self, chunk):
        """After an instruction that ends a backward of `chunk`: with its last of the step, the rest of its sum
        starts (where the gradients are fp32 tensors of their own; else ReduceGrads sums them)."""
        if chunk not in self._left:
            return
        self._left[chunk] -= 1
        if self._left[chunk] == 0:
            self._final.discard(chunk)
            params, grads = self._rest(chunk)
            if summable_in_place(grads):
                self._flying.setdefault(chunk, []).append(start_sum(grads, self.group))
                self._left.pop(chunk)

    def finish(self, chunks):
        """ReduceGrads: the gradients of `chunks` (in the order both copies list them) whose sum has not started,
        summed now, then every sum waited for."""
        rest = [c for c in chunks if c in self._left or c not in self._flying]
        params, grads = [], []
        for c in rest:
            p, g = self._rest(c)
            params += p
            grads += g
        if params:
            if summable_in_place(grads):
                start_sum(grads, self.group)()
            else:
                sum_flat(params, grads, self.group)
        for finishes in self._flying.values():
            for finish in finishes:
                finish()
        self.new_step({})

    def _rest(self, chunk):
        started = self._started.get(chunk, ())
        params, grads = self._gradients([chunk])
        kept = [(p, g) for p, g in zip(params, grads) if id(p) not in started]
        return [p for p, _ in kept], [g for _, g in kept]

    def _summed_ids(self, chunk):
        if chunk not in self._summed:
            self._summed[chunk] = {id(p) for p in self._gradients([chunk])[0]}
        return self._summed[chunk]


def gradient_ends(pipe_schedule):
    """The chunk of each instruction of a step's stream that ends a backward's gradients (a fused backward, alone or
    paired, or a W), in order."""
    ends = []
    for step in pipe_schedule:
        for cmd in step:
            kind, kw = type(cmd), cmd.kwargs
            if kind in (ds.BackwardPass, BackwardWeightPass):
                ends.append(kw.get('chunk', 0))
            elif kind is ForwardBackwardPass and kw['fused']:
                ends.append(kw['bwd_chunk'])
    return ends


def gradient_order(schedule_cls, placement, rank, stages, micro_batches):
    """The model stages `rank` holds, in the order its step's stream ends their gradients (their last backward)."""
    ends = gradient_ends(schedule_cls(micro_batches=micro_batches, stages=stages, stage_id=rank))
    last = {c: i for i, c in enumerate(ends)}
    return [placement.stage(rank, c) for c in sorted(last, key=last.get)]


def _bytes(t):
    return t.numel() * t.element_size()


def summable_in_place(grads):
    """Whether `start_sum` can sum these where they lie: every one an fp32 tensor of its own layout (else
    `sum_flat`)."""
    return all(g is not None and g.dtype == torch.float32 and g.is_contiguous() for g in grads)


def start_sum(grads, group):
    """Every fp32 gradient summed over `group`, all in flight at once; returns what waits for them. Those of 1 MiB
    or more where they lie, one all-reduce each (no flat copy made and copied back: 64 MiB of DualPipe's deep-model
    gradients took 110 ms that way against 56 for the all-reduce alone), the smaller ones through one flat copy,
    since gloo's cost per all-reduce outweighs their copy (GPTlite small's 146 gradients, 59 MB: 60-121 ms one each,
    35-45 ms so; loopback, AMD EPYC)."""
    small, large = [], []
    for g in grads:
        (small if _bytes(g) < SMALL_GRADIENT_BYTES else large).append(g)
    works = [dist.all_reduce(g, group=group, async_op=True) for g in large]
    flat = None
    if small:
        flat = torch.cat([g.reshape(-1) for g in small])
        works.append(dist.all_reduce(flat, group=group, async_op=True))

    def finish():
        for work in works:
            work.wait()
        offset = 0
        for g in small:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return finish


def sum_flat(params, grads, group):
    """The gradients summed over `group` through one flat fp32 copy: for bf16 gradients and those not yet made."""
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p, g in zip(params, grads)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):  # the BF16 optimizer's fp32 gradients may be flat views
        summed = flat[offset:offset + p.numel()]
        offset += p.numel()
        if g is None:
            p.grad = summed.view_as(p).to(p.dtype)
        else:
            g.copy_(summed.view(g.shape))
