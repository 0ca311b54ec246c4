"""DualPipe, the bidirectional pipeline schedule of DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, Sec. 3.2.1; reference code https://github.com/deepseek-ai/DualPipe).

Placement ("mirror"): two copies of a p-stage model. Rank r holds stage r of copy 0 (chunk 0,
direction 0: its micro-batches enter at rank 0 and flow to rank p-1) and stage p-1-r of copy 1
(chunk 1, direction 1: its micro-batches enter at rank p-1 and flow to rank 0). Half of the m
micro-batches of a step go each way; micro-batches are numbered 0..m/2-1 within a direction,
and the direction is the chunk. Both copies' gradients are summed before the optimizer step.

Every rank runs the same 8 steps, written for its two *phases*: phase 0 is the direction whose
micro-batches enter at the rank's own end of the pipeline, phase 1 the other one. So a rank of
the first half (r < p/2) has phase = chunk, a rank of the second half has phase = 1 - chunk, and
rank r and rank p-1-r run mirror images of one order. `half_rank` = min(r, p-1-r) is the
distance from the rank's end; the two middle ranks (half_rank = p/2-1) are where the two
directions cross.

Published properties (DeepSeek-V3 report, Table 2; DualPipe README), with F a forward chunk, B
a full backward chunk, W a weight-gradient chunk and F&B a forward and a backward overlapped:

- bubble (p/2 - 1)(F&B + B - 3W), against 1F1B's (p-1)(F+B) and ZB1P's (p-1)(F+B-2W);
- 2x parameters (two copies of every stage), activation memory p+1 micro-batches of a stage;
- neither the bubble nor the activation memory grows with m; p and m must both be even.

The unit of the main step is a pair: the forward of one direction overlapped with the backward
of the other (the reference code computes them as one call so that one's communication hides
behind the other's computation). In the reference the backward inside a pair is a *full*
backward (its weight gradients are not deferred), so pairs are Paired(F, BW) here. Backwards
that run alone are either full (BW) or, where DeepSeek sets `enable_zb`, split: B now and
its W pushed on a FIFO (DeepSeek's WeightGradStore) that each `_weight_chunk()` pops.

Constraint on m (reasoned from the reference code): `num_chunks` there is the number of
micro-batches of a step over both directions, and the reference asserts it is even and
>= 2 * num_ranks, i.e. m >= 2p: at least p micro-batches per direction. With fewer, the main
step (Step 4) of the outermost ranks, m/2 - p + 1 iterations, would be empty (m = 2p-2: the order
still works out, but it is not the published schedule) or negative (then the step counts no
longer account for every micro-batch). The paper's "only requires that the pipeline stages and
micro-batches be divisible by 2" is the evenness half of this; m need not be a multiple of p.

Passes (schedules/passes.py): Action(kind, mb, chunk) with kinds F, B (weights deferred), W
and BW (fused), and Paired(forward, backward) for a forward overlapped with a full backward.
`mb` is the index within the chunk's direction. `dualpipe_steps` also serves DualPipeV
(schedules/definitions/vshape.py), which is this schedule cut in half.
"""
from collections import deque

from schedules.lowering import OrderedSchedule
from schedules.passes import BW, Action, B, F, Paired, W
from schedules.placement import MirrorPlacement

__all__ = ["DualPipeSchedule", "dualpipe_order", "dualpipe_steps", "check_dualpipe"]


def check_dualpipe(p, m):
    """Raise ValueError (naming the flag) unless DualPipe can run p ranks and m micro-batches."""
    if p < 2 or p % 2:
        raise ValueError(f"DualPipe needs an even --pipeline-parallel-size >= 2 (the two directions cross in "
                         f"the middle), got {p}")
    if m % 2 or m < 2 * p:
        raise ValueError(f"DualPipe with {p} ranks needs an even --gradient-accumulation-steps >= 2 * {p} = {2 * p} "
                         f"(half of the micro-batches go each way, at least one per stage), got {m}")


class _RankOrder:
    """One rank's order being written: the next micro-batch of each (kind, chunk) and the FIFO of
    deferred weight passes, as DeepSeek's WeightGradStore queue."""

    def __init__(self, chunk_of_phase):
        self.chunk_of_phase = chunk_of_phase
        self.order = []
        self._next = {}
        self._deferred = deque()

    def _take(self, kind, phase):
        chunk = self.chunk_of_phase(phase)
        mb = self._next.get((kind, chunk), 0)
        self._next[(kind, chunk)] = mb + 1
        return mb, chunk

    def forward(self, phase):
        self.order.append(Action(F, *self._take(F, phase)))

    def backward(self, phase, enable_zb=False):
        """A backward running alone: split (B, W deferred) with enable_zb, else fused (BW)."""
        mb, chunk = self._take(B, phase)
        if enable_zb:
            self._deferred.append((mb, chunk))
        self.order.append(Action(B if enable_zb else BW, mb, chunk))

    def weight(self):
        """The oldest deferred weight pass."""
        if not self._deferred:
            raise AssertionError("a weight pass with no deferred backward")  # the step counts are wrong
        self.order.append(Action(W, *self._deferred.popleft()))

    def forward_backward(self, phase_f, phase_b):
        """Forward of phase_f overlapped with the (full) backward of phase_b."""
        self.order.append(Paired(Action(F, *self._take(F, phase_f)), Action(BW, *self._take(B, phase_b))))


def dualpipe_steps(num_half_ranks, half_rank, chunks_per_phase, chunk_of_phase=lambda phase: phase):
    """The 8 steps of DeepSeek's DualPipe for one rank, as a list of passes.

    num_half_ranks: ranks from one end of the pipeline to the middle (p/2 for DualPipe, p for
    DualPipeV); half_rank: this rank's distance from its end (0 .. num_half_ranks-1);
    chunks_per_phase: micro-batches per phase (m/2 for DualPipe, m for DualPipeV);
    chunk_of_phase: the chunk that runs a phase on this rank.
    Needs chunks_per_phase >= 2 * num_half_ranks - half_rank - 1 (Step 4 not negative); the
    callers ask for the published minimum, one more for the outermost ranks.
    """
    n, h, k = num_half_ranks, half_rank, chunks_per_phase
    is_middle = h == n - 1  # where the phases meet: the rank at the turn of the V, or a middle rank
    rank = _RankOrder(chunk_of_phase)

    # Step 1: nF0 -- fill: forwards of this rank's own direction, 2 per hop from the middle.
    for _ in range(2 * (n - h - 1)):
        rank.forward(0)

    # Step 2: nF0F1 -- the other direction's first micro-batches arrive: alternate.
    for _ in range(h + 1):
        rank.forward(0)
        rank.forward(1)

    # Step 3: nB1W1F1 -- first backwards of phase 1 (split: W right after B, zero bubble).
    for _ in range(n - h - 1):
        rank.backward(1, enable_zb=True)
        rank.weight()
        rank.forward(1)

    # Step 4 (main step): nF0B1F1B0 -- two overlapped pairs per iteration: F0 with B1, F1 with B0.
    for i in range(k - 2 * n + h + 1):
        if i == 0 and is_middle:
            # The reference runs the middle rank's first F0 and B1 apart, not overlapped ("to
            # further reduce bubble size": F0's output can leave before B1 runs). With unit costs
            # and free communication the simulated timeline is the same either way.
            rank.forward(0)
            rank.backward(1)
        else:
            rank.forward_backward(0, 1)
        rank.forward_backward(1, 0)

    # Step 5: nB1F1B0 -- phase 0 has no forwards left: a lone B1, then F1 overlapped with B0.
    for _ in range(n - h - 1):
        rank.backward(1)
        rank.forward_backward(1, 0)

    # Step 6: nB1B0 -- drain both phases; from the middle of the step on (the second half of the
    # backwards) weight passes are deferred to fill the cool-down.
    enable_zb = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            enable_zb = True
        rank.backward(1, enable_zb=enable_zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            enable_zb = True
        rank.backward(0, enable_zb=enable_zb)

    # Step 7: nWB0 -- a deferred W, then one of the last B0 (split).
    for _ in range(n - h - 1):
        rank.weight()
        rank.backward(0, enable_zb=True)

    # Step 8: nW -- the remaining deferred weight passes.
    for _ in range(h + 1):
        rank.weight()

    if rank._deferred:
        raise AssertionError("deferred weight passes left at the end of the step")
    return rank.order


def dualpipe_order(p, m, rank):
    """Rank `rank`'s order of compute passes for DualPipe on p ranks with m micro-batches
    (m/2 per direction). See the module docstring for the vocabulary."""
    check_dualpipe(p, m)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside 0..{p - 1}")
    second_half = rank >= p // 2
    # phase 0 is the direction entering at this rank's end: direction 0 for the first half.
    return dualpipe_steps(p // 2, min(rank, p - 1 - rank), m // 2, lambda phase: phase ^ second_half)


# --- the DeepSpeed schedule ---------------------------------------------------------------------
class DualPipeSchedule(OrderedSchedule):
    """DualPipe on the mirror placement, with W deferred where DeepSeek's steps defer it."""
    name = "dualpipe"
    placement_cls = MirrorPlacement

    @classmethod
    def check(cls, micro_batches, stages):
        check_dualpipe(stages, micro_batches)

    def compute_order(self):
        return dualpipe_order(self.stages, self.micro_batches, self.stage_id)
