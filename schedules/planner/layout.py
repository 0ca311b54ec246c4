"""The split head's layout fitted to one schedule on a measured profile: how many vocabulary rows each slice holds
and what share of them its backward recomputes (`VocabSlice(rows=..., recompute=...)`).

`slice_layout` (schedules/runtime/vocab_parallel.py) lays the slices out from the slices alone: the same time and
the same peak for every slice, as if nothing else ran on their ranks. But a rank also runs its share of the
trunk and its optimizer step: on GPTlite small at p = 2 the rank holding the embedding does 60 ms more a step,
and the first stage of the trunk holds the most micro-batches. `fit_slices` searches the layout with the
simulator instead: the fastest predicted step whose ranks' peak activation memories stay within `balance` of each
other (and under `budget`, where given), starting from `slice_layout`'s. Near its fastest a layout's step is flat:
of layouts alike in time the one whose ranks are busy alike is kept (BUSY_WEIGHT). It moves rows between slices
and changes each slice's recomputed share, in steps that halve (a pattern search; every point one simulation,
under a millisecond at p = 2), and keeps a move only where it scores better and stays within the bounds. Where
`slice_layout`'s layout is itself outside them, its own ratio and peak are the bounds: a fitted layout is never
predicted slower, less even or larger than it.
"""
from dataclasses import dataclass, field, replace

from schedules.planner.candidate import simulated
from schedules.planner.compose import _vocab_size, cut, split_head
from schedules.registry import schedule_spec

BALANCE = 1.2  # the most the ranks' predicted peaks may differ (max / min) in a fitted layout
BUSY_WEIGHT = 0.25  # what the ranks' predicted busy times being apart (max / min - 1) weighs against the step: near
# its fastest a layout's step is flat, and of layouts alike in time the one whose ranks work alike is kept
SHARE_STEPS = (0.04, 0.02, 0.01, 0.005)  # rows moved between two slices, as shares of the vocabulary
RECOMPUTE_STEPS = (0.2, 0.1, 0.05, 0.025)  # changes of a slice's recomputed share
MAX_POINTS = 2000  # simulations at most


@dataclass
class Fitted:
    rows: list  # per slice
    recompute: list  # per slice: the share of its rows its backward computes again
    step: float  # predicted seconds per step
    peak: list  # predicted peak activation bytes per rank
    start: tuple  # (step, peak) of slice_layout's layout, where the search began
    points: int = 0  # layouts simulated
    candidate: object = field(default=None, repr=False)  # the chooser's Candidate of this layout (candidate.Candidate)

    @property
    def layout(self):
        return self.rows, self.recompute

    def candidate_of(self, cut):
        """The chooser's Candidate of this layout, its cut named `cut` (the partition methods that give it)."""
        return replace(self.candidate, cut=cut, vocab_parallel=True, vocab_layout=self)


def fit_slices(profile, schedule, stages, micro_batches, method="uniform", virtual_stages=None, balance=BALANCE,
               budget=None, interlock=1, validation="wait", vocab_size=None, rows=None):
    """The Fitted layout of `stages` slices for `schedule` (a registry name that runs a split head) at
    `micro_batches`, the trunk cut by `method`; `budget`: bytes of activation memory per rank, or None. Raises
    ValueError where the schedule does not run a split head at this p or the profile does not tell the head's rows
    (its parameters, V x h, and its output, V / h of its input's). `rows`: every slice's row count, kept (e.g. a
    checkpoint's); then only the recomputed shares are fitted."""
    from schedules.runtime.vocab_parallel import slice_layout, vocab_rows
    vocab = vocab_size or _vocab_size(profile)
    if not vocab:
        raise ValueError("fitting the split head's layout needs the head's row count: the profile's last layer does "
                         "not tell it")
    spec = schedule_spec(schedule, virtual_stages)
    placement = spec.placement(stages)
    seen = {}

    def predicted(shares, q):
        rows = vocab_rows(vocab, shares)
        key = (tuple(rows), tuple(round(x, 6) for x in q))
        if key not in seen:
            split = split_head(profile, stages, layout=(rows, q), vocab_size=vocab)
            parts = cut(split, method, placement.num_stages, slices=stages)
            found = simulated(split, spec, virtual_stages, method, parts, placement, micro_batches, interlock,
                              validation)
            seen[key] = (rows, list(q), found.step, found.peak, found, _ratio(_busy(found)))
        return seen[key]

    kept = rows is not None
    balanced, q = slice_layout(vocab, stages)
    if kept and (len(rows) != stages or sum(rows) != vocab):
        raise ValueError(f"rows {list(rows)}: {stages} slices of {vocab} rows in all")
    shares, q = [r / vocab for r in (rows if kept else balanced)], list(q)
    best = start = predicted(shares, q)
    # the bounds: the start's own where it is outside them (a layout no less even, no larger, only faster)
    ratio = max(balance, _ratio(start[3]))
    ceiling = None if budget is None else max(budget, max(start[3]))

    def score(point):
        return point[2] * (1 + BUSY_WEIGHT * (point[5] - 1))
    for share_step, q_step in zip(SHARE_STEPS, RECOMPUTE_STEPS):
        improved = True
        while improved and len(seen) < MAX_POINTS:
            improved = False
            for moved_shares, moved_q in _moves(shares, q, 0 if kept else share_step, q_step):
                point = predicted(moved_shares, moved_q)
                if score(point) < score(best) and point[2] <= start[2] and _ratio(point[3]) <= ratio and \
                        (ceiling is None or max(point[3]) <= ceiling):
                    best, shares, q, improved = point, moved_shares, moved_q, True
    rows, q, step, peak, found, _ = best
    return Fitted(rows, q, step, peak, (start[2], start[3]), len(seen), found)


def _ratio(values):
    return max(values) / max(min(values), 1e-12)


def _busy(candidate):
    """Each rank's predicted seconds of passes in the step: the span less its idle share."""
    return [candidate.span * (1 - idle) for idle in candidate.bubble]


def _moves(shares, q, share_step, q_step):
    """Every neighbouring layout: `share_step` of the vocabulary from one slice to another, or one slice's
    recomputed share `q_step` up or down (within 0 and 1)."""
    parts = len(shares)
    for i in range(parts if share_step else 0):
        for j in range(parts):
            if i != j and shares[i] > share_step:
                moved = list(shares)
                moved[i] -= share_step
                moved[j] += share_step
                yield moved, q
    for k in range(parts):
        for change in (q_step, -q_step):
            value = min(1.0, max(0.0, q[k] + change))
            if value != q[k]:
                yield shares, [*q[:k], value, *q[k + 1:]]
