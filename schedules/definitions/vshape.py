"""Schedules on the V placement: ZB-V (Zero Bubble) and DualPipeV (DeepSeek's DualPipe cut in half).

Placement ("V"): the model is cut into 2p stages for p ranks. Chunk 0 of rank r runs global
stage r and chunk 1 runs global stage 2p-1-r: a micro-batch goes down the ranks in chunk 0,
turns on rank p-1 (locally: chunk 0 there feeds chunk 1 on the same rank) and comes back up
in chunk 1, so rank 0 holds both the first stage (loads the data) and the last (the loss).
A chunk is half a stage of the p-stage 1F1B pipeline: its passes take half as long and its
activations take half the memory.

Passes (schedules/passes.py): Action(kind, mb, chunk) with kinds F, B (weights deferred), W
and BW (fused); DualPipeV also pairs a forward with a full backward as one unit, Paired.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 6). Backwards split
into B and W. The warm-up brings every rank to 2p-1 chunk forwards in flight, one more makes
2p chunk activations, p stages' worth, and from then on every forward is matched by a B and a
W: the same peak activation memory as 1F1B (p, on every rank, not only the first). When
F = B = W, its steady state has no idle time and the W passes fill the warm-up/cool-down slopes, so when
consecutive iterations interlock (no synchronisation at the optimizer step) the pipeline runs
with zero bubble. Needs m >= 2p-1 (rank 0 warms up with 2p-1 forwards of chunk 0); with
fewer the steady state is empty and it is another, worse schedule (PyTorch's
ScheduleZBVZeroBubble pads to 2p-1 and drops the passes of micro-batches that do not exist;
that stays executable, but we ask for the real schedule).

DualPipeV (DeepSeek, https://github.com/deepseek-ai/DualPipe `dualpipev.py`; also DeepSpeed's
DualPipeVSchedule and PyTorch's ScheduleDualPipeV). In DualPipe on 2p ranks, rank r < p holds
stage r of copy 0 and stage 2p-1-r of copy 1. Cut the pipeline in half: keep ranks 0..p-1 and
one model, whose micro-batches run stages 0..p-1 on chunk 0 of ranks 0..p-1 and then stages
p..2p-1 on chunk 1 of ranks p-1..0 -- the V placement. Each kept rank runs its DualPipe order
unchanged, phase = chunk, so the 8 steps are `dualpipe_steps` of schedules/definitions/dualpipe.py with
num_half_ranks = p, half_rank = r and m micro-batches per phase; rank p-1, at the turn of the
V, plays DualPipe's middle rank. Published (DualPipe README): bubble (PP/2 - 1)(F&B + B - 3W)
with PP = 2p chunk-stages, activation PP + 1 = 2p + 1 chunk activations, on PP/2 = p devices.
Needs m >= 2p (the reference asserts num_chunks >= num_ranks * 2; the steps would still account
for every micro-batch down to m = 2p-1, but we keep the published minimum). Weight passes are
deferred where DeepSeek's steps use `enable_zb` (Step 3, the second half of Step 6, Step 7) and
run at the W slots of Steps 3, 7 and 8, oldest first; DeepSpeed's DualPipeVSchedule runs every
backward fused instead.
"""
from schedules.definitions.dualpipe import dualpipe_steps
from schedules.lowering import OrderedSchedule
from schedules.passes import Action, B, F, W
from schedules.placement import VPlacement

__all__ = ["ZBVSchedule", "DualPipeVSchedule", "zbv_order", "dualpipev_order", "check_zbv", "check_dualpipev"]


def _check_ranks(name, p, rank):
    if p < 2:
        raise ValueError(f"{name} needs --pipeline-parallel-size >= 2, got {p}")
    if rank is not None and not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside 0..{p - 1}")


def check_zbv(p, m, rank=None):
    """Raise ValueError (naming the flag) unless ZB-V can run p ranks and m micro-batches."""
    _check_ranks("ZB-V", p, rank)
    if m < 2 * p - 1:
        raise ValueError(f"ZB-V with {p} ranks needs --gradient-accumulation-steps >= 2 * {p} - 1 = {2 * p - 1} "
                         f"(the first rank warms up with that many forwards), got {m}")


def check_dualpipev(p, m, rank=None):
    """Raise ValueError (naming the flag) unless DualPipeV can run p ranks and m micro-batches."""
    _check_ranks("DualPipeV", p, rank)
    if m < 2 * p:
        raise ValueError(f"DualPipeV with {p} ranks needs --gradient-accumulation-steps >= 2 * {p} = {2 * p} "
                         f"(one micro-batch per stage of the V), got {m}")


def zbv_order(p, m, rank):
    """Rank `rank`'s order of compute passes for ZB-V on p ranks with m micro-batches."""
    check_zbv(p, m, rank)
    r = rank
    order = []
    nxt = {}  # (kind, chunk) -> next micro-batch; every kind visits a chunk's micro-batches in order

    def run(kind, chunk):
        mb = nxt.get((kind, chunk), 0)
        nxt[(kind, chunk)] = mb + 1
        order.append(Action(kind, mb, chunk))

    def done(kind, chunk):
        return nxt.get((kind, chunk), 0)

    # Warm-up 1: 2(p-r)-1 forwards of chunk 0 -- what it takes for the first micro-batch to go
    # down to rank p-1 and come back up to this rank's chunk 1.
    for _ in range(2 * (p - r) - 1):
        run(F, 0)
    # Warm-up 2: r pairs F1 F0 -- chunk 1 starts while chunk 0 keeps filling (2p-1 chunk
    # activations alive after this phase on every rank).
    for _ in range(r):
        run(F, 1)
        run(F, 0)
    # Warm-up 3: p-r triples F1 B1 W1 -- chunk 1's backwards start (the loss is on rank 0, so
    # B of chunk 1 can follow its F at once there); W right after B keeps memory at p.
    for _ in range(p - r):
        run(F, 1)
        run(B, 1)
        run(W, 1)
    # Steady state: F0 B0 W0 F1 B1 W1 -- one of each per chunk, no idle time when F = B = W;
    # once chunk 0 has no forwards left, the same without F0.
    while done(F, 1) < m:
        if done(F, 0) < m:
            run(F, 0)
        run(B, 0)
        run(W, 0)
        run(F, 1)
        run(B, 1)
        run(W, 1)
    # Cool-down 1: r pairs B0 B1 -- backwards on the critical path first, their W held back.
    for _ in range(r):
        run(B, 0)
        run(B, 1)
    # Cool-down 2: p-r pairs B0 W0 -- the last backwards of chunk 0, each followed by the oldest
    # W of chunk 0 still outstanding.
    for _ in range(p - r):
        run(B, 0)
        run(W, 0)
    # Cool-down 3: the held-back W passes fill the tail: chunk 1's, then chunk 0's.
    while done(W, 1) < m:
        run(W, 1)
    while done(W, 0) < m:
        run(W, 0)
    return order


def dualpipev_order(p, m, rank):
    """Rank `rank`'s order of compute passes for DualPipeV on p ranks with m micro-batches.

    The 8 steps of DualPipe (schedules/definitions/dualpipe.py, `dualpipe_steps`), phase = chunk:
        Step 1: nF0        2(p-r-1) forwards of chunk 0
        Step 2: nF0F1      r+1 pairs F0 F1
        Step 3: nB1W1F1    p-r-1 times B1 (split), its W1, F1
        Step 4: nF0B1F1B0  m-2p+r+1 times: F0 with B1 overlapped, F1 with B0 overlapped
                           (on rank p-1 the first F0 and B1 run apart)
        Step 5: nB1F1B0    p-r-1 times: B1, then F1 with B0 overlapped
        Step 6: nB1B0      r+1 pairs B1 B0, split from the middle of the step on
        Step 7: nWB0       p-r-1 times a deferred W, then B0 (split)
        Step 8: nW         r+1 deferred W
    """
    check_dualpipev(p, m, rank)
    return dualpipe_steps(p, rank, m)


# --- the DeepSpeed schedules --------------------------------------------------------------------
class ZBVSchedule(OrderedSchedule):
    """ZB-V on the V placement: split backward, 1F1B's peak memory on every rank."""
    name = "zb-v"
    placement_cls = VPlacement

    @classmethod
    def check(cls, micro_batches, stages):
        check_zbv(stages, micro_batches)

    def compute_order(self):
        return zbv_order(self.stages, self.micro_batches, self.stage_id)


class DualPipeVSchedule(OrderedSchedule):
    """DualPipeV on the V placement, with W deferred where DeepSeek's steps defer it."""
    name = "dualpipev"
    placement_cls = VPlacement

    @classmethod
    def check(cls, micro_batches, stages):
        check_dualpipev(stages, micro_batches)

    def compute_order(self):
        return dualpipev_order(self.stages, self.micro_batches, self.stage_id)
