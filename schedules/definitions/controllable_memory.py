"""V-Half and V-Min: V-placement schedules with a half and a third of 1F1B's peak activation memory.

Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory", NeurIPS 2024
(https://arxiv.org/abs/2405.15362). The paper builds a schedule from one *building block* -- where the
passes of a single micro-batch sit on every rank -- repeated once per micro-batch at a fixed interval,
then squeezed and reordered. The peak activation memory of a rank is the time its block keeps
activations alive (the block's lifespan there) over the repeat interval, so a block whose passes follow
one another closely holds few micro-batches at once. On the V placement (chunk 0 of rank r runs stage
r, chunk 1 runs stage 2p-1-r; see schedules/definitions/vshape.py) each rank runs four critical passes
per micro-batch, F0 F1 B1 B0 (the digit is the chunk), plus two weight passes W1 W0, each half a 1F1B
stage: six passes, so the block repeats every 6 chunk-pass slots and the steady state has no idle time.

Published figures (F = B = W, in micro-batches through 1/p of the model; 1F1B: p and a bubble rate of
about p/m): V-Half holds (p+2)//2 with a bubble rate of about p/(2m); V-Min holds (p+4)//3 with about
2p/(3m) (the authors' summary table). tests/test_closed_forms.py checks the exact figures of these
orders in the simulator for p = 2..8.

The construction, in slots of one chunk pass (time t on rank r):

1. The building block (`building_block`): the slots of F0, F1, B1, B0 of micro-batch 0 on each rank.
       V-Min   F0 at r, F1 at 2p-1-r, B1 at 2p+g+r, B0 at 4p+g-1-r
               each pass starts the slot after the one it waits for: a lifespan of about 4p slots per
               block (2p chunk activations, 2p/6 ~ p/3 micro-batches at once)
       V-Half  F0 at 2r, F1 at 3p-2-r, B1 at 3p-1+g+2r, B0 at 6p-2+g-r
               one free slot per hop on the way down (F0, B1): about 6p slots, p/2 micro-batches
   g is the smallest gap that keeps the four slots of every rank apart modulo 6, so that the repeated
   blocks never collide (V-Min: 2 when 3 divides p, else 0; V-Half: 3 when p is even, else 0).
2. Repeat: micro-batch j's passes sit 6j slots after micro-batch 0's.
3. Weight passes: each free slot of a rank takes a W the rank owes (one for each B before that slot);
   the rest follow the rank's last pass.
4. Warm-up reorder, W included: taking passes in slot order, each pass of the warm-up (before rank 0's
   first B0) moves to the earliest free slot its inputs allow (the pass it follows on the neighbouring
   rank or on this rank, its predecessor of the same kind) where its rank's peak memory stays within
   the largest peak any rank had before; the steady state, from rank 0's first B0 to rank 0's F0 of the
   last micro-batch, stays as built. Then squeeze: every pass as early as its inputs and its rank's
   order allow.
5. Cool-down reorder, without W: the same move for every pass after the steady state, with the weight
   passes taken out (the memory check then frees an activation at each free slot that owes a W), then
   W placed again as in 3 and squeezed.
6. The rank's order is its passes in slot order after the W passes are placed once more, W1 before W0.

The orders so built are the authors' (compared pass for pass with their reference implementation
for p = 2..10, m = 1..3p+2, 4p and 5p+1). The steady state must exist: rank 0 must still have forwards
left when its first B0 comes, which sets the minimum m (`min_micro_batches`): V-Half 2*floor(p/2) + 2,
V-Min floor(2p/3) + 2. Below it the warm-up and cool-down overlap and the published figures do not hold.
"""
from functools import lru_cache

from schedules.lowering import OrderedSchedule
from schedules.passes import Action, B, F, W
from schedules.placement import VPlacement

__all__ = ["VHalfSchedule", "VMinSchedule", "building_block", "controllable_memory_order", "min_micro_batches",
           "check_controllable_memory"]

HALF, MIN = "v-half", "v-min"
NAMES = {HALF: "V-Half", MIN: "V-Min"}
PERIOD = 6  # slots per micro-batch on every rank: F0 F1 B1 B0 W1 W0

# The passes of one micro-batch on one rank. The order of this tuple breaks ties between ranks'
# passes in the same slot, as the paper's implementation does.
F0, F1, B1, B0 = (F, 0), (F, 1), (B, 1), (B, 0)
CRITICAL = (F0, F1, B1, B0)
W_ANY, W1, W0 = (W, None), (W, 1), (W, 0)  # one weight-pass stream (steps 3-5) or one per chunk (step 6)
_RANK_IN_KIND = {F0: 0, F1: 1, B1: 2, B0: 3, W_ANY: 4, W1: 4, W0: 5}
# Inputs of a critical pass besides its predecessor of the same kind: the same pass one rank
# upstream (+1: from rank r-1; -1: from rank r+1), and the pass before it on this rank.
_FLOW = {F0: +1, F1: -1, B1: +1, B0: -1}
_AFTER = {F1: F0, B1: F1, B0: B1}
_MEMORY = {F: 1, B: 0, W: -1}  # chunk activations a pass adds (the paper's accounting: W frees them)


def _gap(offsets, p):
    """The smallest gap g for which offsets(r, g) keeps each rank's four slots apart modulo PERIOD."""
    for g in range(PERIOD):
        if all(len({t % PERIOD for t in offsets(r, g)}) == 4 for r in range(p)):
            return g
    raise AssertionError(f"no collision-free gap for p={p}")  # cannot happen for the two blocks below


def building_block(variant, p):
    """{rank: {F0, F1, B1, B0: slot}}: where micro-batch 0's passes sit (step 1 of the module docstring)."""
    if variant == MIN:
        def offsets(r, g):
            return r, 2 * p - 1 - r, 2 * p + g + r, 4 * p + g - 1 - r
    elif variant == HALF:
        def offsets(r, g):
            return 2 * r, 3 * p - 2 - r, 3 * p - 1 + g + 2 * r, 6 * p - 2 + g - r
    else:
        raise ValueError(f"unknown controllable-memory schedule {variant!r}")
    g = _gap(offsets, p)
    return {r: dict(zip(CRITICAL, offsets(r, g))) for r in range(p)}


def min_micro_batches(variant, p):
    """Fewest micro-batches with a steady state: rank 0 still has a forward left at its first B0."""
    block = building_block(variant, p)[0]
    return (block[B0] - block[F0]) // PERIOD + 2


def check_controllable_memory(variant, p, m, rank=None):
    """Raise ValueError (naming the flag) unless `variant` can run p ranks and m micro-batches."""
    name = NAMES[variant]
    if p < 2:
        raise ValueError(f"{name} needs --pipeline-parallel-size >= 2, got {p}")
    if rank is not None and not 0 <= rank < p:
        raise ValueError(f"rank {rank} outside 0..{p - 1}")
    least = min_micro_batches(variant, p)
    if m < least:
        raise ValueError(f"{name} with {p} ranks needs --gradient-accumulation-steps >= {least} "
                         f"(its steady state needs that many micro-batches), got {m}")


# --- the construction: slots[rank][kind] = [slot of micro-batch 0, of micro-batch 1, ...] -------

def _events(slots):
    """A rank's passes as (slot, kind, micro_batch), in slot order."""
    return sorted((t, kind, mb) for kind, ts in slots.items() for mb, t in enumerate(ts))


def _place_w(slots, split):
    """Give each free slot of the rank the oldest weight pass it owes (step 3); the rest follow its
    last pass. split: one stream per chunk, chunk 1 first; else one stream W_ANY."""
    events = {t: kind for t, kind, _ in _events({k: slots[k] for k in CRITICAL})}
    owed = {1: 0, 0: 0}
    placed = {W1: [], W0: []} if split else {W_ANY: []}

    def place(t):
        chunk = 1 if owed[1] else 0
        owed[chunk] -= 1
        placed[(W, chunk) if split else W_ANY].append(t)

    last = max(events)
    for t in range(last + 1):
        if t in events:
            kind = events[t]
            if kind[0] == B:
                owed[kind[1]] += 1
        elif owed[0] + owed[1]:
            place(t)
    while owed[0] + owed[1]:
        last += 1
        place(last)
    return {**{k: list(slots[k]) for k in CRITICAL}, **placed}


def _peak(slots):
    """Peak chunk activations alive on a rank. Without weight passes in `slots`, each free slot that
    owes a W frees one activation (as W would there)."""
    with_w = any(kind[0] == W for kind in slots)
    events = {}  # slot -> kind; of two passes in one slot the greater kind counts, as in slot order the last
    for kind, ts in slots.items():
        for t in ts:
            other = events.get(t)
            if other is None or kind > other:
                events[t] = kind
    alive = peak = owed = 0
    last = -1
    for t in sorted(events):  # the slots between two passes are free: each frees an owed W's activation
        if owed and not with_w and t - last > 1:
            freed = min(owed, t - last - 1)
            alive, owed = alive - freed, owed - freed
        kind = events[t][0]
        alive += _MEMORY[kind]
        owed += kind == B
        if alive > peak:
            peak = alive
        last = t
    return peak


_NONE = -(1 << 60)  # minus infinity in _PeakTree's integer arithmetic


class _PeakTree:
    """What `_peak` computes for one rank, kept up to date as single passes move (a segment tree over the slots),
    so that step 4 and 5 test each candidate slot in O(log slots) rather than rescanning the rank.

    A run of slots maps the state (alive, owed) on entry to the state on exit, and its highest `alive`, by five
    numbers: owed' = max(owed + c, k); alive' = alive + e + max(c, k - owed); highest = alive + max(x, y - owed).
    A pass adds its activations (e = its memory, and a B owes one W: c = 1); without weight passes in the rank's
    slots a free slot frees one owed W (c = -1, k = 0, x = -1, y = 0), else it changes nothing. Two runs compose
    into one (`_join`), so the root answers for the whole rank, as `_peak` from its first slot to its last.
    Only for a rank whose passes sit in distinct slots (`exact`); `_reorder` falls back to `_peak` otherwise."""

    def __init__(self, rank_slots):
        with_w = any(kind[0] == W for kind in rank_slots)
        self.free = (0, -1, 0, -1, 0) if not with_w else (0, 0, _NONE, 0, _NONE)  # (e, c, k, x, y)
        self.exact = True
        self.kind_at = {}
        for kind, ts in rank_slots.items():
            for t in ts:
                if t in self.kind_at:
                    self.exact = False
                self.kind_at[t] = kind
        size = 1
        while size < max(self.kind_at) + 2:
            size *= 2
        self.size = size
        node = self.node = [self.free] * (2 * size)
        for t, kind in self.kind_at.items():
            node[size + t] = self._leaf(kind)
        join = self._join
        for i in range(size - 1, 0, -1):
            node[i] = join(node[2 * i], node[2 * i + 1])

    @staticmethod
    def _leaf(kind):
        d, owes = _MEMORY[kind[0]], int(kind[0] == B)
        return d - owes, owes, _NONE, d, _NONE

    @staticmethod
    def _join(a, b):
        e1, c1, k1, x1, y1 = a
        e2, c2, k2, x2, y2 = b
        kb = k1 + c2
        xb = e1 + c1 + x2
        yb = e1 + k1 + x2
        y2 += e1
        return e1 + e2, c1 + c2, kb if kb > k2 else k2, xb if xb > x1 else x1, max(y1, y2, yb)

    def _set(self, t, leaf):
        i = self.size + t
        node = self.node
        node[i] = leaf
        while i > 1:  # _join, inlined: this is the hot loop of steps 4 and 5
            e1, c1, k1, x1, y1 = node[i & ~1]
            e2, c2, k2, x2, y2 = node[i | 1]
            i //= 2
            kb, xb, yb = k1 + c2, e1 + c1 + x2, e1 + k1 + x2
            y2 += e1
            if y1 > y2:
                y2 = y1
            node[i] = (e1 + e2, c1 + c2, kb if kb > k2 else k2, xb if xb > x1 else x1, yb if yb > y2 else y2)

    def move(self, old, new):
        """The pass in slot `old` now sits in slot `new` (a free one)."""
        if old == new:
            return
        kind = self.kind_at.pop(old)
        self.kind_at[new] = kind
        self._set(old, self.free)
        self._set(new, self._leaf(kind))

    def peak(self):
        """_peak of the rank's slots: from alive = owed = 0, the highest alive, at least 0."""
        _, _, _, x, y = self.node[1]
        return max(0, x, y)


def _earliest(slots, rank, kind, mb):
    """The first slot where pass (kind, mb) of `rank` has its inputs (each pass takes one slot)."""
    p = len(slots)
    ready = -1
    if kind in _FLOW:
        src = rank - _FLOW[kind]
        if 0 <= src < p:
            ready = max(ready, slots[src][kind][mb])
    if kind in _AFTER:
        ready = max(ready, slots[rank][_AFTER[kind]][mb])
    if kind == W_ANY:  # the mb-th weight pass follows the mb-th backward of either chunk
        ready = max(ready, sorted(slots[rank][B1] + slots[rank][B0])[mb])
    if mb > 0:
        ready = max(ready, slots[rank][kind][mb - 1])
    return ready + 1


def _in_slot_order(slots):
    """Every pass of every rank as (slot, rank, kind rank, micro_batch, kind), in slot order."""
    return sorted((t, rank, _RANK_IN_KIND[kind], mb, kind) for rank, rank_slots in enumerate(slots)
                  for kind, ts in rank_slots.items() for mb, t in enumerate(ts))


def _squeeze(slots):
    """Run every pass as early as its inputs and its rank's order allow (unit costs, free messages)."""
    start = [{kind: [None] * len(ts) for kind, ts in rank_slots.items()} for rank_slots in slots]
    free_at = [0] * len(slots)
    for _, rank, _, mb, kind in _in_slot_order(slots):
        t = free_at[rank]
        if kind in _FLOW and 0 <= rank - _FLOW[kind] < len(slots):
            t = max(t, start[rank - _FLOW[kind]][kind][mb] + 1)
        if kind in _AFTER:
            t = max(t, start[rank][_AFTER[kind]][mb] + 1)
        if mb > 0:
            t = max(t, start[rank][kind][mb - 1] + 1)
        start[rank][kind][mb] = t
        free_at[rank] = t + 1
    return start


def _reorder(slots, with_w, m):
    """Steps 4 (with_w) and 5: move warm-up (with_w) or cool-down passes to earlier free slots within the
    block's peak memory; then place W (step 5) and squeeze."""
    slots = [dict(s) for s in slots]
    if with_w:
        slots = [_place_w(s, split=False) for s in slots]
    limit = max(_peak(s) for s in slots)
    trees = [_PeakTree(s) for s in slots]
    taken = [set() for _ in slots]
    phase = "warm-up"
    for t, rank, _, mb, kind in _in_slot_order(slots):
        if phase == "warm-up" and kind == B0 and rank == 0:
            phase = "steady"
        if phase == "steady":  # kept as built; the last micro-batch's first forward ends it
            if kind == F0 and mb == m - 1:
                phase = "cool-down"
            taken[rank].add(t)
            continue
        if phase == "warm-up" and not with_w:  # step 5 leaves the warm-up as step 4 made it
            taken[rank].add(t)
            continue
        times = slots[rank][kind] = list(slots[rank][kind])
        tree = trees[rank]
        for earlier in range(_earliest(slots, rank, kind, mb), t):
            if earlier not in taken[rank]:
                if tree.exact:
                    tree.move(times[mb], earlier)
                times[mb] = earlier
                if (tree.peak() if tree.exact else _peak(slots[rank])) <= limit:
                    break
        else:
            if tree.exact:
                tree.move(times[mb], t)
            times[mb] = t
        taken[rank].add(times[mb])
    if not with_w:
        slots = [_place_w(s, split=False) for s in slots]
    return _squeeze(slots)


@lru_cache(maxsize=64)
def _orders(variant, p, m):
    block = building_block(variant, p)
    slots = [{kind: [block[r][kind] + PERIOD * j for j in range(m)] for kind in CRITICAL} for r in range(p)]  # 1-2
    slots = _reorder(slots, with_w=True, m=m)  # 3-4
    slots = _reorder([{k: s[k] for k in CRITICAL} for s in slots], with_w=False, m=m)  # 5
    slots = [_place_w({k: s[k] for k in CRITICAL}, split=True) for s in slots]  # 6
    return tuple(tuple(Action(kind[0], mb, kind[1]) for _, kind, mb in _events(s)) for s in slots)


def controllable_memory_order(variant, p, m, rank):
    """Rank `rank`'s order of compute passes for V-Half or V-Min on p ranks with m micro-batches."""
    check_controllable_memory(variant, p, m, rank)
    return list(_orders(variant, p, m)[rank])


# --- the DeepSpeed schedules --------------------------------------------------------------------
class VHalfSchedule(OrderedSchedule):
    """V-Half on the V placement: split backward, about half of 1F1B's peak activation memory."""
    name = HALF
    placement_cls = VPlacement

    @classmethod
    def check(cls, micro_batches, stages):
        check_controllable_memory(cls.name, stages, micro_batches)

    def compute_order(self):
        return controllable_memory_order(self.name, self.stages, self.micro_batches, self.stage_id)


class VMinSchedule(VHalfSchedule):
    """V-Min on the V placement: split backward, about a third of 1F1B's peak activation memory."""
    name = MIN
