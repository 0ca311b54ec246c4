"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021, Sec. 2.2.2), the "depth-first" schedule with fused backward.

Placement ("interleaved"): the model is cut into v*p stages for p ranks (v "virtual stages",
default 2); chunk c of rank r runs global stage c*p + r, so a micro-batch goes round the ranks
v times. A chunk holds 1/v of a 1F1B stage: its passes take 1/v as long, its activations 1/v
of the memory.

Order. Each rank walks through "virtual micro-batches": slot k of its forwards and slot k of
its backwards each name a (micro-batch, chunk). The micro-batches go in rounds of g: a round
runs g micro-batches through chunk 0, then the same g through chunk 1, ..., chunk v-1 (forwards)
and chunk v-1, ..., chunk 0 (backwards), then the next g micro-batches. Rank r first runs
(v-1)g + 2(p-1-r) forwards (warm-up), then alternates one forward and one backward (steady
1F1B), then runs the remaining backwards (cool-down).

Published properties, with F and B the forward and (fused) backward of a whole stage: bubble
(p-1)(F+B)/v per rank (1F1B's divided by v), at the price of v times as many point-to-point
messages; the first rank holds the activations of up to (v-1)g + 2(p-1) + 1 chunks, with g = p
that is p(1 + (p-1)/(pv)) stages' worth (1F1B: p). With unit costs the bubble is exactly
(p-1)(F+B)/v for every accepted m >= p, multiple of p or not (tests/test_chunk_orders.py); the
memory grows with the round size g (rank r: (v-1)g + 2(p-1-r) + 1 chunk activations).

Micro-batches per step. Megatron-LM asks m to be a multiple of p (round size g = p). As PyTorch's
ScheduleInterleaved1F1B does, we relax this with rounds: rounds = max(1, m // p), g = m / rounds,
which must be a whole number (then p <= g <= 2p-1 for m >= p). So any m < 2p works (one round of
m), and beyond that the m that m // p rounds split evenly: for p = 4, m = 1..8, 10, 12, 15, 16,
20, 24, 28, ...; m = 9 (2 rounds of 4.5) or 14 (3 rounds of 4.67) are rejected. Every accepted
(p, m) is checked executable by the dependency simulation in tests/test_chunk_orders.py.

Passes (schedules/passes.py): Action(F, mb, chunk) forwards and Action(BW, mb, chunk) fused
backwards.
"""
import functools

from schedules.lowering import OrderedSchedule
from schedules.passes import BW, Action, F
from schedules.placement import InterleavedPlacement

__all__ = ["Interleaved1F1BSchedule", "interleaved_1f1b_order", "check_interleaved", "interleaved_round_size",
           "DEFAULT_VIRTUAL_STAGES"]

DEFAULT_VIRTUAL_STAGES = 2


def interleaved_round_size(p, m):
    """g, the micro-batches per round: m for m < 2p, else m / (m // p) (None when not whole)."""
    rounds = max(1, m // p)
    return m // rounds if m % rounds == 0 else None


def check_interleaved(p, m, v):
    """Raise ValueError (naming the flag) unless Interleaved 1F1B can run (p, m, v)."""
    if p < 2:
        raise ValueError(f"Interleaved 1F1B needs --pipeline-parallel-size >= 2, got {p}")
    if v < 2:
        raise ValueError(f"Interleaved 1F1B needs --virtual-stages >= 2 model chunks per rank "
                         f"(with one it is plain 1F1B), got {v}")
    if m < 1:
        raise ValueError(f"Interleaved 1F1B needs --gradient-accumulation-steps >= 1, got {m}")
    if interleaved_round_size(p, m) is None:
        rounds = m // p
        below = next(x for x in range(m - 1, 0, -1) if interleaved_round_size(p, x) is not None)
        above = next(x for x in range(m + 1, 2 * m + 2 * p) if interleaved_round_size(p, x) is not None)
        raise ValueError(f"Interleaved 1F1B with {p} ranks runs the micro-batches in equal rounds of {p} to "
                         f"{2 * p - 1}, so --gradient-accumulation-steps must be below {2 * p} (one round) or a "
                         f"multiple of its number of rounds, --gradient-accumulation-steps // {p}; {m} is not a "
                         f"multiple of {m} // {p} = {rounds}: use {below} or {above}")


def interleaved_1f1b_order(p, m, v, rank):
    """Rank `rank`'s order of compute passes for Interleaved 1F1B: p ranks, m micro-batches,
    v chunks per rank (global stage of chunk c on rank r: c*p + r)."""
    check_interleaved(p, m, v)
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside 0..{p - 1}")
    g = interleaved_round_size(p, m)
    total = m * v  # forwards (and backwards) of this rank

    def slot(k, backward):
        """(micro-batch, chunk) of the k-th forward or backward of this rank."""
        round_, within = divmod(k, g * v)
        chunk, offset = divmod(within, g)
        return round_ * g + offset, (v - 1 - chunk if backward else chunk)

    # Warm-up: the forwards before the first backward can arrive. The last rank needs (v-1)g:
    # its first backward (chunk v-1, micro-batch 0) comes right after the forward of that
    # micro-batch in its last chunk; each hop upstream adds two (one forward down, one backward
    # up). Capped at all the forwards when m is small.
    warmup = min((v - 1) * g + 2 * (p - 1 - rank), total)
    order = [Action(F, *slot(k, False)) for k in range(warmup)]
    # Steady state (1F1B): the next forward, then the oldest backward.
    for k in range(total - warmup):
        order.append(Action(F, *slot(warmup + k, False)))
        order.append(Action(BW, *slot(k, True)))
    # Cool-down: the backwards left.
    order += [Action(BW, *slot(k, True)) for k in range(total - warmup, total)]
    return order


# --- the DeepSpeed schedule ---------------------------------------------------------------------
class Interleaved1F1BSchedule(OrderedSchedule):
    """Interleaved 1F1B with v = `virtual_stages` chunks per rank (`with_virtual_stages(v)` for others)."""
    name = "interleaved"
    virtual_stages = DEFAULT_VIRTUAL_STAGES
    placement_cls = InterleavedPlacement.with_chunks(DEFAULT_VIRTUAL_STAGES)

    @classmethod
    @functools.cache
    def with_virtual_stages(cls, v):
        """The same schedule with v chunks per rank (one class per v, so engines and simulator share it)."""
        return type(f"Interleaved1F1BSchedule{v}", (cls, ), {"virtual_stages": v,
                                                               "placement_cls": InterleavedPlacement.with_chunks(v)})

    @classmethod
    def check(cls, micro_batches, stages):
        check_interleaved(stages, micro_batches, cls.virtual_stages)

    def compute_order(self):
        return interleaved_1f1b_order(self.stages, self.micro_batches, self.virtual_stages, self.stage_id)

