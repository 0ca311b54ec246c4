"""Choose a pipeline schedule for a run from a per-layer profile: every registered trainable schedule
(interleaved with each valid v), on every cut of the layers, simulated with the costs composed from the
profile; those whose predicted peak activation memory on some rank exceeds the budget dropped; the rest
ranked by predicted step time. The first is the pick.

    choice = choose(profile, stages=2, micro_batches=8, max_activation_memory=None)
    choice.pick.schedule, choice.pick.virtual_stages, choice.pick.cut    # what to train with
    print("\\n".join(table(choice)))

A predicted step is the simulator's synchronised step (train_batch's: every rank starts together) plus
the time outside the schedule: the step of the rank that holds the most (its parameters at the profile's rate,
and the engine's own work per step) and the mirror placement's gradient all-reduce. The wait for the other
ranks' gradient norm is left out: a rank's step overlaps the others' last passes.

Interlocked (`interlock=K` > 1, train.py --interlock K): a schedule our engines run chains its K steps without a
barrier (schedules/runtime/interlock.py), so its predicted step is the simulator's interlocked period of K
chained iterations, each rank's optimizer step in its own stream (`step_cost`) and the step validated as the
post-validation policy does (`validation`: 'wait' or 'ahead' before the next step's passes, None when
speculating past it). That favours the schedules whose bubble only interlocking removes (ZB-H2, ZB-V).
DeepSpeed's own engines (stock 1F1B, its DualPipeV) still synchronise every step: their synchronised step.
"""
from dataclasses import dataclass
from typing import Optional

from schedules.errors import ScheduleError
from schedules.planner.candidate import simulated
from schedules.planner.compose import CUTS, cut, split_head
from schedules.registry import schedule_spec, splitting_schedules, trainable_schedules

MiB = 1 << 20


class NoScheduleFits(ValueError):
    """No candidate's predicted peak activation memory is within the budget."""


@dataclass
class Choice:
    stages: int
    micro_batches: int
    budget: Optional[float]  # MiB
    ranked: list  # Candidates within the budget, fastest first
    dropped: list  # Candidates over the budget, least memory first
    skipped: list  # (label, reason): what the schedule's constraints or the layer count exclude
    interlock: int = 1  # steps per call: above 1, our engines' candidates are ranked by the interlocked period

    @property
    def pick(self):
        return self.ranked[0]


def _variants(name, stages, layers):
    """(virtual stages, registry row) of schedule `name`: each valid v for a schedule that takes one."""
    spec = schedule_spec(name)
    if not hasattr(spec.factory, 'with_virtual_stages'):
        return [(None, spec)]
    return [(v, schedule_spec(name, v)) for v in range(2, max(2, layers // stages) + 1)]


def candidates(profile, stages, micro_batches, cuts=CUTS, schedules=None, interlock=1, validation="wait",
               split=False, vocab_recompute=True):
    """([Candidate] simulated, [(label, reason)] excluded) for every schedule, v and distinct cut; with `split`,
    also every schedule that runs it with the profile's last layer (the vocabulary head) split over the ranks,
    laid out as train.py --vocab-parallel builds it (`vocab_recompute`: gptlite.layer_specs' flag, compose.split_head's
    `recompute`; False: even slices that keep their logits)."""
    out, skipped = _candidates(profile, stages, micro_batches, cuts, schedules, interlock, validation)
    if split:
        names = [n for n in splitting_schedules(stages) if schedules is None or n in schedules]
        more, why = _candidates(split_head(profile, stages, recompute=vocab_recompute), stages, micro_batches, cuts,
                                names, interlock, validation, slices=stages)
        out, skipped = out + more, skipped + why
    return out, skipped


def _candidates(profile, stages, micro_batches, cuts, schedules, interlock, validation, slices=0):
    out, skipped = [], []
    n = len(profile.layers)
    for name in schedules or trainable_schedules():
        for v, spec in _variants(name, stages, n - slices + (stages if slices else 0)):  # slices: one chunk more
            label = name + (f" v={v}" if v else "") + (" +vocab" if slices else "")
            try:
                spec.factory(micro_batches=micro_batches, stages=stages, stage_id=0)
            except ValueError as e:
                skipped.append((label, str(e)))
                continue
            placement = spec.placement(stages)
            if placement.num_stages > n:
                skipped.append((label, f"cuts the model into {placement.num_stages} stages; it has {n} layers"))
                continue
            by_parts = {}
            for method in cuts:
                parts = cut(profile, method, placement.num_stages, slices)
                if any(a == b for a, b in zip(parts, parts[1:])):
                    skipped.append((f"{label} ({method})", "a model stage gets no layer"))
                    continue
                bare = _rank_without_experts(profile, placement, parts)
                if bare is not None:  # train.py refuses it (schedules.initialize): its optimizer would hang
                    skipped.append((f"{label} ({method})", f"rank {bare} holds no layer with experts"))
                    continue
                by_parts.setdefault(tuple(parts), []).append(method)
            for parts, methods in by_parts.items():
                try:
                    found = simulated(profile, spec, v, '='.join(methods), list(parts), placement, micro_batches,
                                      interlock, validation)
                    found.vocab_parallel = bool(slices)
                    out.append(found)
                except (ValueError, ScheduleError) as e:
                    skipped.append((label, str(e).splitlines()[0]))
    return out, skipped


def _rank_without_experts(profile, placement, parts):
    """A rank whose stages hold no layer with experts, in a model that has some (None if every rank holds one, or
    the model none): DeepSpeed's optimizer reduces the experts' parameter group across the stages, so such a layout
    is refused before training (schedules.initialize) and cannot be a candidate."""
    experts = [c.expert_param_bytes > 0 for c in profile.layers]
    if not any(experts):
        return None
    for r in range(placement.ranks):
        stages = [placement.stage(r, c) for c in range(placement.chunks)]
        if not any(experts[i] for s in stages for i in range(parts[s], min(parts[s + 1], len(experts)))):
            return r
    return None


FITTED = 3  # the fastest split candidates whose slices' layout `choose(fit_layouts=True)` fits


def _fit_layouts(profile, stages, micro_batches, found, budget, interlock, validation):
    """`found` with its FITTED fastest split candidates each in the layout fitted to it (planner.layout.fit_slices:
    never predicted slower than slice_layout's)."""
    from schedules.planner.layout import fit_slices
    split = sorted((c for c in found if c.vocab_parallel), key=lambda c: c.step)[:FITTED]
    fitted = {}
    for c in split:
        try:
            fit = fit_slices(profile, c.schedule, stages, micro_batches, method=c.method, budget=budget,
                             virtual_stages=c.virtual_stages, interlock=interlock, validation=validation)
        except ValueError:  # the profile does not tell the head's rows: slice_layout's stays
            continue
        fitted[id(c)] = fit.candidate_of(c.cut)
    return [fitted.get(id(c), c) for c in found]


def choose(profile, stages, micro_batches, max_activation_memory=None, cuts=CUTS, schedules=None, interlock=1,
           validation="wait", split=False, vocab_recompute=True, fit_layouts=False):
    """The ranked Choice for `stages` pipeline ranks and `micro_batches` per step; `max_activation_memory`
    in MiB per rank (None: no limit); `interlock` steps per call, their validation (see above); `split`: the
    profile's last layer is a vocabulary head, which the schedules that can may split over the ranks, laid out as
    `gptlite.layer_specs(vocab_recompute=...)` lays it out (train.py: the default, True); `fit_layouts`: the
    fastest split candidates in the layout fitted to each (train.py --vocab-layout auto, `_fit_layouts`). Raises
    ValueError for p < 2, NoScheduleFits when nothing is within the budget (naming the least memory any
    candidate needs)."""
    if stages < 2:
        raise ValueError(f"choosing a pipeline schedule needs at least 2 pipeline stages, not {stages}")
    if micro_batches < 1:
        raise ValueError(f"{micro_batches} micro-batches: need at least 1")
    found, skipped = candidates(profile, stages, micro_batches, cuts, schedules, interlock, validation, split,
                                vocab_recompute)
    if split and fit_layouts and vocab_recompute:
        found = _fit_layouts(profile, stages, micro_batches, found,
                             None if max_activation_memory is None else max_activation_memory * MiB, interlock,
                             validation)
    if not found:
        raise ValueError(f"no schedule runs at p = {stages}, m = {micro_batches}: "
                         + "; ".join(f"{label}: {why}" for label, why in skipped[:3]))
    budget = None if max_activation_memory is None else max_activation_memory * MiB
    fits = [c for c in found if budget is None or max(c.peak) <= budget]
    over = sorted((c for c in found if c not in fits), key=lambda c: (max(c.peak), c.step))
    if not fits:
        least = over[0]
        raise NoScheduleFits(f"--max-activation-memory {max_activation_memory:g} MiB: no schedule fits at "
                             f"p = {stages}, m = {micro_batches}; the least predicted peak is "
                             f"{max(least.peak) / MiB:.3g} MiB ({least.label}, {least.method} cut): raise the "
                             f"budget to at least that, or use fewer micro-batches per step")
    ranked = sorted(fits, key=lambda c: (c.step, max(c.peak), c.label, c.cut))
    return Choice(stages, micro_batches, max_activation_memory, ranked, over, skipped, interlock)


def table(choice, limit=None):
    """The ranked table as lines: one per candidate kept (the first is the pick), then what was dropped."""
    lines = [f"{'#':>3} {'schedule':20} {'cut':28} {'step ms':>8} {'span ms':>8}  {'bubble per rank':18}  "
             f"{'peak MiB per rank':18}  params (M) per rank"]
    for i, c in enumerate(choice.ranked[:limit]):
        bubble = " ".join(f"{b:5.1%}" for b in c.bubble)
        peak = " ".join(f"{b / MiB:.1f}" for b in c.peak)
        params = " ".join(f"{n / 1e6:.2f}" for n in c.params)
        lines.append(f"{i + 1:>3} {c.label:20} {c.cut:28} {c.step * 1e3:8.1f} {c.span * 1e3:8.1f}  {bubble:18}  "
                     f"{peak:18}  {params}")
    if limit is not None and len(choice.ranked) > limit:
        lines.append(f"    ... {len(choice.ranked) - limit} more")
    if choice.dropped:
        lines.append(f"    dropped {len(choice.dropped)} over --max-activation-memory {choice.budget:g} MiB "
                     f"(least: {choice.dropped[0].label}, {max(choice.dropped[0].peak) / MiB:.1f} MiB)")
    return lines


def summary(choice):
    """One line: what was chosen and why."""
    pick = choice.pick
    other = next((c for c in choice.ranked[1:] if c.label != pick.label), None)
    why = (f"{other.step / pick.step - 1:.1%} faster than the next schedule ({other.label})" if other
           else "the only schedule that fits")
    budget = "" if choice.budget is None else \
        f", peak {max(pick.peak) / MiB:.1f} MiB within --max-activation-memory {choice.budget:g} MiB"
    fit = pick.vocab_layout
    layout = "" if fit is None else \
        f", its slices' rows {' '.join(map(str, fit.rows))} ({' '.join(f'{q:.0%}' for q in fit.recompute)} recomputed)"
    return (f"chose {pick.label} with the {pick.method} cut (layers {pick.parts}) at p = {choice.stages}, "
            f"m = {choice.micro_batches}: predicted {pick.step * 1e3:.1f} ms per step{_interlocked(choice)}, "
            f"{why}{budget}{layout}")


def _interlocked(choice):
    """What --interlock K buys the pick: its interlocked period against its own synchronised step."""
    if choice.interlock <= 1:
        return ""
    pick, k = choice.pick, choice.interlock
    gain = pick.synchronised / pick.step - 1
    return (f" interlocked ({k} steps per call; {pick.synchronised * 1e3:.1f} ms synchronised: "
            + (f"--interlock {k} is {gain:.1%} faster)" if gain > 5e-4 else f"--interlock {k} gains nothing here)"))


def to_json(choice):
    """The Choice as plain data: every candidate kept (ranked) and dropped, with its figures."""
    def row(c):
        return {'schedule': c.schedule, 'virtual_stages': c.virtual_stages, 'cut': c.cut, 'parts': c.parts,
                'step_s': c.step, 'span_s': c.span, 'outside_s': c.outside, 'bubble': c.bubble,
                'peak_bytes': c.peak, 'params': c.params, 'synchronised_s': c.synchronised,
                'vocab_parallel': c.vocab_parallel,
                **({'vocab_rows': c.vocab_layout.rows, 'vocab_recompute': c.vocab_layout.recompute}
                   if c.vocab_layout else {})}
    return {'stages': choice.stages, 'micro_batches': choice.micro_batches, 'budget_mib': choice.budget,
            'interlock': choice.interlock,
            'ranked': [row(c) for c in choice.ranked], 'dropped': [row(c) for c in choice.dropped],
            'skipped': [list(s) for s in choice.skipped]}
