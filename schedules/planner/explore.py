"""The schedule explorer: a local page that draws the simulator's timelines of several schedules on one time axis.

    python scripts/explore.py [--port 0] [--host 127.0.0.1] [--no-browser]      (docs/explore.md)

A standard-library HTTP server (`serve`) with a JSON API and the static page in `explore_static/` (HTML, CSS and
one hand-written JavaScript file drawing SVG; nothing fetched from elsewhere). Every figure the page shows comes
from here, and everything here from the project's own functions: the timelines, idle times and peaks from
`simulate`, the ranked table from the chooser (`choose`), a traced run and its prediction from
`schedules.observe.trace` (as scripts/plot_trace.py does), the Perfetto export from its Chrome-trace writer. No
schedule and no simulation is written a second time, in Python or in JavaScript: the page only draws.

It lives with the planner because it serves the chooser's table, and the planner is the one role that may
read the simulator, the observation tools and itself (tests/test_architecture.py).

    POST /api/simulate  {schedule, p, m, v, F, B, W, BW, split, comm, chained}  -> one schedule's figures
    POST /api/choose    {p, m, F, B, W, comm, memory_limit, profile?}           -> the chooser's ranked table
    POST /api/trace     {trace: Chrome-trace JSON text, iteration?, latency?}   -> measured and predicted steps
    POST /api/perfetto  {runs: [simulate request, ...]}                          -> a Chrome trace of them
    GET  /api/meta                                                               -> schedules, presets, definitions

Bubble rate (one definition, the Zero Bubble and Controllable Memory papers'): 1 - busy / T, the share of the
step T a rank is idle, busy = the rank's own passes (m(F + B + W) on a 1F1B stage); the page shows the worst
rank's, T the synchronised step (every rank starts together, as DeepSpeed's train_batch) or, chained, the
interlocked period.
"""
import functools
import gc
import json
import mimetypes
import os
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from schedules.errors import ScheduleError
from schedules.observe.trace import (
    Tracer,
    load_chrome_trace,
    load_p2p_events,
    measured_overheads,
    one_iteration,
    predict,
    write_chrome_trace,
)
from schedules.planner.candidate import simulator_inputs
from schedules.planner.choose import MiB, choose, table, to_json
from schedules.planner.compose import compose, split_head
from schedules.planner.profile import Profile
from schedules.registry import available_schedules, schedule_spec
from schedules.simulator.simulate import _memory_function, _within_function, simulate
from schedules.simulator.timeline import Pass, Timeline

STATIC = Path(__file__).with_name('explore_static')
KIND_CODES = ('F', 'B', 'W', 'BW')  # a pass's kind, sent as its index
MAX_RANKS, MAX_MICRO_BATCHES = 64, 1024  # what one request may ask (the page answers fast up to 16 and 64)

BUBBLE = {
    'name': 'bubble rate',
    'formula': '1 − busy / T',
    'text': ("the share of the step a rank idles: T the step (synchronised: every rank starts together, as "
             "DeepSpeed's train_batch; chained: the interlocked period), busy the rank's own passes (m(F + B + W) "
             "on a 1F1B stage). The worst rank's is shown. This is the Zero Bubble and Controllable Memory papers' "
             "definition (1 − m(F+B+W) / T). Not T / T_ideal − 1, nor (p − 1) / m (1F1B's bubble over its "
             "ideal time, Megatron-LM's)."),
}
MEMORY_BASIS = ("activations saved for backward, in micro-batches through 1/p of the model (one 1F1B stage): a "
                "forward adds its chunk's share, B frees half of it, W the other half, a fused backward all")

# The closed forms of docs/schedules.md (idle synchronised, peak activation memory) at F = B = W = 1: text to show
# where a figure comes from, never evaluated here (the simulator's figures are the ones shown).
CLOSED_FORMS = {
    '1f1b': ('3(p−1)', 'p'), '1f1b-lean': ('3(p−1)', 'p'), 'zb-h1': ('p−1', 'p'),
    'zb-h2': ('p−1 (0 interlocked)', '2p−1'), 'interleaved': ('3(p−1)/v', 'p + (p−1)/v'),
    'zb-v': ('(p−1)/2 (0 interlocked)', 'p'), 'dualpipev': ('p−1', 'p + 1/2'),
    'v-half': ('3⌊(p−1)/2⌋ − 1/2', '⌊p/2⌋ + 1'), 'v-min': ('2p − 5/2 (− 1 when 3 divides p)', '⌊(p+4)/3⌋'),
    'dualpipe': ('p−2', 'p + 1'), 'dualpipev-deepspeed': ('7 at p=4, m=8', 'p + 1/2'),
}

PRESETS = [
    {'id': 'table', 'label': 'Schedule table, p = 4, m = 8',
     'what': 'what scripts/schedule_table.py --stages 4 --micro-batches 8 prints (docs/schedules.md)',
     'inputs': {'p': 4, 'm': 8, 'v': 2, 'F': 1, 'B': 1, 'W': 1, 'comm': 0, 'chained': True, 'split': True,
                'schedules': 'all'}},
    {'id': 'zero-bubble', 'label': 'Zero Bubble (Qi et al. 2023): 1F1B, ZB-H1, ZB-H2, ZB-V',
     'what': ("the handcrafted schedules' figures at p = 4, m = 8, F = B = W: ZB-H1's bubble a third of 1F1B's "
              "(3 against 9), ZB-H2 and ZB-V without a bubble when steps interlock (the paper's "
              "post-validation), ZB-V at 1F1B's memory"),
     'inputs': {'p': 4, 'm': 8, 'v': 2, 'F': 1, 'B': 1, 'W': 1, 'comm': 0, 'chained': True, 'split': True,
                'schedules': ['1f1b', 'zb-h1', 'zb-h2', 'zb-v']}},
    {'id': 'controllable-memory', 'label': 'Controllable Memory (Qi et al. 2024): V-Min, V-Half, ZB-V, 1F1B',
     'what': ("the paper's table of peak activation memory per stage at p = 4, m = 8, F = B = W: 1F1B p, V-Half "
              "(p+2)//2, V-Min (p+4)//3, its V-ZB (ZB-V here) p; and their bubbles"),
     'inputs': {'p': 4, 'm': 8, 'v': 2, 'F': 1, 'B': 1, 'W': 1, 'comm': 0, 'chained': False, 'split': True,
                'schedules': ['1f1b', 'v-min', 'v-half', 'zb-v']}},
    {'id': 'dualpipe', 'label': 'DualPipe (DeepSeek-V3): 8 ranks, 20 micro-batches',
     'what': ("DualPipe's figure: 8 PP ranks and 20 micro-batches in two directions (10 each way), beside 1F1B "
              "and ZB-H1 at the same p and m"),
     'inputs': {'p': 8, 'm': 20, 'v': 2, 'F': 1, 'B': 1, 'W': 1, 'comm': 0, 'chained': False, 'split': True,
                'schedules': ['1f1b', 'zb-h1', 'dualpipe']}},
    {'id': 'dualpipev', 'label': 'DualPipeV: 4 ranks (8 stages), 10 micro-batches',
     'what': "DualPipeV's figure: 4 PP ranks holding 8 stages, 10 micro-batches; ours and DeepSpeed's own",
     'inputs': {'p': 4, 'm': 10, 'v': 2, 'F': 1, 'B': 1, 'W': 1, 'comm': 0, 'chained': False, 'split': True,
                'schedules': ['dualpipev', 'dualpipev-deepspeed', 'zb-v']}},
]


class BadRequest(ValueError):
    """A request the page should not have sent (a field missing or out of range): HTTP 400 with the reason."""


def _number(req, key, default, low=0.0, high=1e9, integer=False):
    value = req.get(key, default)
    try:
        value = int(value) if integer else float(value)
    except (TypeError, ValueError):
        raise BadRequest(f'{key} {value!r}: not a number') from None
    if not low <= value <= high:
        raise BadRequest(f'{key} {value:g}: outside {low:g} .. {high:g}')
    return value


def simulation_inputs(req):
    """The normalised inputs of one simulation (a tuple, hashable: the cache's key)."""
    name = req.get('schedule')
    if name not in available_schedules():
        raise BadRequest(f'schedule {name!r}: choose from {", ".join(available_schedules())}')
    p = _number(req, 'p', 4, 1, MAX_RANKS, True)
    m = _number(req, 'm', 8, 1, MAX_MICRO_BATCHES, True)
    v = _number(req, 'v', 2, 2, 64, True) if hasattr(available_schedules()[name].factory, 'with_virtual_stages') \
        else None
    F = _number(req, 'F', 1.0, 1e-9)
    if req.get('split', True):
        B, W = _number(req, 'B', 1.0, 1e-9), _number(req, 'W', 1.0, 0.0)
    else:  # B and W as one: the fused backward's cost, split in halves where a schedule splits it
        B = W = _number(req, 'BW', 2.0, 2e-9) / 2
    comm = _number(req, 'comm', 0.0, 0.0)
    return name, p, m, v, F, B, W, comm, bool(req.get('chained', False))


def simulated(req):
    """One schedule's figures for the page (dict, JSON-ready); the schedule's own refusal as `error`. Without
    `dependencies` (true by default) the answer leaves them out (the page asks for them when it draws arrows)."""
    key = simulation_inputs(req)
    started = time.perf_counter()
    out = _simulated(*key, bool(req.get('dependencies', True)))
    return dict(out, seconds=time.perf_counter() - started)


def simulated_json(req, pools=None):
    """`simulated` as the JSON bytes the server sends, serialised once per input (a cached answer is then sent at
    once; `seconds` is the time this answer took). With `pools` (one process each) a new input is simulated in the
    one of its schedule, so that the schedules the page asks for together are simulated side by side on the
    machine's cores, and a schedule's structure, kept by the simulator, is there when its costs change."""
    key = (simulation_inputs(req), bool(req.get('dependencies', True)))
    started = time.perf_counter()
    with _answers_lock:
        body = _answers.get(key)
    if body is None:
        if pools:
            pool = pools[list(available_schedules()).index(key[0][0]) % len(pools)]
            body = pool.submit(_serialised, *key).result()
        else:
            body = _serialised(*key)
        with _answers_lock:
            _answers[key] = body
            while sum(map(len, _answers.values())) > ANSWERS_BYTES and len(_answers) > 1:
                _answers.pop(next(iter(_answers)))
    return b'{"seconds":%r,' % (time.perf_counter() - started) + body[1:]


_answers, _answers_lock = {}, threading.Lock()  # (inputs, with dependencies) -> JSON bytes, oldest first
ANSWERS_BYTES = 256 << 20  # what the kept answers may hold


def _collector_paused(function):
    """`function` run with Python's cyclic garbage collector off (as `simulate` runs), on again after: an answer
    makes many objects that all go when it is sent, and a sweep of the collector while they live would move them
    to its oldest generation, whose full sweeps then cost a page 100-200 ms now and then."""
    @functools.wraps(function)
    def paused(*args, **kwargs):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()
    return paused


@_collector_paused
def _serialised(key, with_dependencies):
    # made anew (not from `_simulated`'s cache): what the server keeps is the JSON, and many live lists would make
    # each of the collector's full sweeps longer
    return json.dumps(_simulated.__wrapped__(*key, with_dependencies), separators=(',', ':')).encode()


@functools.lru_cache(maxsize=16)  # (the answers the server keeps are its JSON, above)
def _simulated(name, p, m, v, F, B, W, comm, chained, with_dependencies=True):
    spec = schedule_spec(name, v)
    head = {'schedule': name, 'label': name + (f' v={v}' if v else ''), 'p': p, 'm': m, 'v': v,
            'closed_form': CLOSED_FORMS.get(name), 'description': spec.description}
    try:
        if p < 2 and name != '1f1b':  # as train.py and schedule_table.py: one stage is DeepSpeed's 1F1B
            raise ValueError(f'{name} needs p >= 2')
        result, place = _run(spec, p, m, F, B, W, comm, chained)
    except (ValueError, ScheduleError) as e:
        return dict(head, error=str(e))
    units = 'F' if (F, B, W) == (1.0, 1.0, 1.0) else 'time'  # the page's own units, not seconds
    return dict(head, error=None, **figures(result, place, chained, units=units, with_dependencies=with_dependencies))


def _run(spec, p, m, F, B, W, comm, chained):
    """simulate() of a registry row at these costs: unit costs (the simulator's own, units 'F') when F = B = W = 1,
    else each pass costs its kind's figure times its chunk's size, as unit costs do."""
    place = spec.placement(p)
    costs = None
    if (F, B, W) != (1.0, 1.0, 1.0):  # as a table: the simulator looks each figure up once
        per_kind = {'F': F, 'B': B, 'W': W, 'BW': B + W}
        costs = {(rank, chunk): {kind: cost * place.chunk_size(rank, chunk) for kind, cost in per_kind.items()}
                 for rank in range(p) for chunk in range(place.chunks)}
    return simulate(spec.factory, p, m, placement=spec.placement, costs=costs, latency=comm,
                    iterations=5 if chained else 1), place


def figures(result, place, chained, memory=None, units=None, with_dependencies=True):
    """What the page draws of a SimResult: the timeline, per-rank figures, the bubble, memory over time and the
    passes' dependencies. `units`: 'F' (forward units), 'time' (the page's own costs) or 's' (seconds: a profile, a
    trace); default the timeline's. Chained, the drawing is the window of the middle iteration of the chained run
    (as scripts/plot_schedules.py draws it), its neighbours' passes that reach into it marked by their iteration.
    `with_dependencies` False leaves the dependencies out (the page asks for them when it draws its arrows)."""
    step = result.period if chained else result.makespan
    idle_key = 'idle_interlocked' if chained else 'idle_synced'
    per_rank = [dict(row, bubble=row[idle_key] / step if step else 0.0) for row in result.per_rank]
    worst = max(per_rank, key=lambda row: (row['bubble'], -row['rank']))
    peak = max(row['peak_activation_memory'] for row in per_rank)
    drawn = None if with_dependencies else drawn_from_columns(result, place, chained, memory, units)
    if drawn is not None:  # the same, without a Pass object per pass
        encoded, memory_points, focus = drawn
    elif chained and result.chained is not None:  # (the synchronised timeline is not drawn: it is not built)
        focus = len(result.chained.iterations()) // 2
        until = result.chained.span(focus)[1]  # what ends later is not in the window
        timeline, memory_points = window(result.chained, focus, memory_over_time(result.chained, place, memory, until))
        encoded = encode(timeline, units)
    else:
        focus, timeline = None, result.timeline
        memory_points = memory_over_time(timeline, place, memory)
        encoded = encode(timeline, units)
    out = {
        'units': encoded['units'],
        'memory_units': 'micro-batches' if memory is None else 'bytes',  # of one 1F1B stage; bytes: a profile's
        'makespan': result.makespan, 'period': result.period, 'step': step, 'chained': chained, 'focus': focus,
        'idle_synced': result.worst('idle_synced'), 'idle_interlocked': result.worst('idle_interlocked'),
        'busy': worst['busy'], 'bubble': worst['bubble'], 'bubble_rank': worst['rank'],
        'peak_activation_memory': peak,
        'peak_rank': next(row['rank'] for row in per_rank if row['peak_activation_memory'] == peak),
        'params_per_rank': result.worst('params'), 'per_rank': per_rank,
        'timeline': encoded,
        'memory': memory_points,
    }
    if with_dependencies:
        out['dependencies'] = dependencies(timeline, place)
    return out


def drawn_from_columns(result, place, chained, memory=None, units=None):
    """(encode(timeline), its memory over time, focus) as `figures` makes them from the timeline (chained: the window
    of its middle iteration), read from the result's columns of passes (SimResult.pass_columns) instead of its Pass
    objects: a tenth of the time. None for a result without them."""
    made = result.pass_columns(chained)
    if made is None:
        return None
    c, meta = made
    rank, start, end, iteration = c['rank'], c['start'], c['end'], c['iteration']
    delta, within = _memory_function(memory), _within_function(memory)
    change = np.array([delta(r, chunk, kind, place.chunk_size(r, chunk)) for r, chunk, kind, _ in c['keys']],
                      dtype=np.float64)[c['key']]
    held = np.array([within(r, chunk, kind) for r, chunk, kind, _ in c['keys']], dtype=np.float64)[c['key']]
    bounds = np.searchsorted(rank, np.arange(place.ranks + 1)).tolist()
    focus, t0, t1 = None, 0.0, None
    if chained:
        focus = len(np.unique(iteration)) // 2
        mine = iteration == focus
        if mine.any():
            t0, t1 = float(start[mine].min()), float(end[mine].max())
        else:
            t0 = t1 = 0.0
        meta = dict(meta, focus=focus)
    shown = (end > t0) & (start < t1) if chained else np.ones(len(rank), dtype=bool)
    kinds = {kind: i for i, kind in enumerate(KIND_CODES)}
    columns = [c['kind'], c['stage'], c['chunk'], c['micro_batch'], c['direction'], c['pair']]
    rows, points = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        picked = np.flatnonzero(shown[lo:hi]) + lo
        first = float(start[lo]) if hi > lo else 0.0
        starts, ends = start[picked], end[picked]
        if chained:
            starts, ends = np.maximum(starts, t0) - t0, np.minimum(ends, t1) - t0
        at = c['at'][picked].tolist()
        kind, stage, chunk, mb, direction, pair = ([column[i] for i in at] for column in columns)
        rows.append([[kinds[k], st, ch, b, s0, s1, d, pa, it] for k, st, ch, b, s0, s1, d, pa, it in zip(
            kind, stage, chunk, mb, starts.tolist(), ends.tolist(), direction, pair, iteration[picked].tolist())])
        # memory over time: 0 from the rank's first start, then after each pass (chained: up to the first that ends
        # after the window, then the window's part of it, opening with what was live at its start)
        times, live = end[lo:hi], np.cumsum(np.concatenate([[0.0], change[lo:hi]]))[1:]  # 0.0 + the first, as a sum
        inside_pass = np.flatnonzero(held[lo:hi] > 0)  # a pass holding more while it runs: that level, at its end
        if len(inside_pass):
            spikes = (live - change[lo:hi] + held[lo:hi])[inside_pass]
            times, live = np.insert(times, inside_pass, times[inside_pass]), np.insert(live, inside_pass, spikes)
        if not chained:
            points.append([[first, 0.0]] + [[t, x] for t, x in zip(times.tolist(), live.tolist())])
            continue
        late = np.flatnonzero(times > t1)
        n = int(late[0]) if len(late) else hi - lo
        times, live = np.concatenate([[first], times[:n]]), np.concatenate([[0.0], live[:n]])
        before = live[times <= t0]
        inside = (times > t0) & (times <= t1)
        points.append([[0.0, float(before[-1]) if len(before) else 0.0]]
                      + [[t - t0, x] for t, x in zip(times[inside].tolist(), live[inside].tolist())])
    return {'units': units or result.units, 'meta': meta, 'ranks': rows}, points, focus


def window(timeline, focus, memory_points):
    """The passes of `timeline` that overlap iteration `focus`'s span, on a clock starting there (cut at its ends),
    and the memory over time in that window (starting from what was live when it opens)."""
    t0, t1 = timeline.span(focus)
    rows = [[Pass(q.kind, q.stage, q.chunk, q.micro_batch, max(q.start, t0) - t0, min(q.end, t1) - t0, q.direction,
                  q.pair, q.iteration) for q in row if q.end > t0 and q.start < t1] for row in timeline.ranks]
    points = []
    for rank_points in memory_points:
        before = [live for t, live in rank_points if t <= t0]
        inside = [[t - t0, live] for t, live in rank_points if t0 < t <= t1]
        points.append([[0.0, before[-1] if before else 0.0]] + inside)
    return Timeline(rows, timeline.units, dict(timeline.meta, focus=focus)), points


def encode(timeline, units=None):
    """A Timeline as compact rows: per rank [kind index, stage, chunk, micro-batch, start, end, direction, pair,
    iteration] per pass, in start order."""
    return {'units': units or timeline.units, 'meta': timeline.meta,
            'ranks': [[[KIND_CODES.index(q.kind), q.stage, q.chunk, q.micro_batch, q.start, q.end, q.direction,
                        q.pair, q.iteration] for q in row] for row in timeline.ranks]}


def memory_over_time(timeline, place, memory=None, until=None):
    """Per rank, [[time, activation memory after the pass that ended then], ...]: each pass's change as the
    simulator's own memory table gives it (`_memory_function`), in the rank's order of passes, and before it, at
    the same time, what the pass held while it ran where more (the table's `within`); with `until`, up to the first
    pass that ends after it (a rank's passes end in their order)."""
    delta, deltas, within = _memory_function(memory), {}, _within_function(memory)
    out = []
    for rank, row in enumerate(timeline.ranks):
        live, points = 0.0, [[row[0].start if row else 0.0, 0.0]]
        for q in row:
            if until is not None and q.end > until:
                break
            change = deltas.get((rank, q.chunk, q.kind))
            if change is None:
                change = deltas[rank, q.chunk, q.kind] = delta(rank, q.chunk, q.kind, place.chunk_size(rank, q.chunk))
            held = within(rank, q.chunk, q.kind)
            if held > 0:
                points.append([q.end, live + held])
            live += change
            points.append([q.end, live])
        out.append(points)
    return out


def dependencies(timeline, place):
    """[[rank, index, rank, index], ...]: each pass after the pass whose output it needs (producer first). A forward
    needs the forward of the stage before; a backward (B or BW) the backward of the stage after, or on the last
    stage its own forward; a W its B. Keyed by iteration, direction (the pass's, else its chunk's in `place`: the
    mirror placement's two streams), micro-batch and model stage."""
    def direction(q):
        return q.direction if q.direction is not None else place.direction(q.chunk)

    last = max((q.stage for row in timeline.ranks for q in row), default=0)
    where = {}
    for r, row in enumerate(timeline.ranks):
        for i, q in enumerate(row):
            kind = 'B' if q.kind in ('B', 'BW') else q.kind
            where[(kind, q.iteration, direction(q), q.micro_batch, q.stage)] = (r, i)
    edges = []
    for r, row in enumerate(timeline.ranks):
        for i, q in enumerate(row):
            k = (q.iteration, direction(q), q.micro_batch)
            if q.kind == 'F':
                src = where.get(('F', *k, q.stage - 1))
            elif q.kind == 'W':
                src = where.get(('B', *k, q.stage))
            else:
                src = where.get(('F', *k, q.stage)) if q.stage == last else where.get(('B', *k, q.stage + 1))
            if src is not None:
                edges.append([*src, r, i])
    return edges


# ----------------------------------------------------------------------------------------------
# The chooser: a saved profile, or the page's costs as identical layers

def synthetic_profile(p, F, B, W, comm):
    """The page's costs as a profile: 2 identical layers per rank (so V and mirror placements get one layer per
    chunk), each half a 1F1B stage: F / 2, B / 2, W / 2, saving half a micro-batch's activations. The chooser's
    seconds are then forward units and its bytes micro-batches through one 1F1B stage."""
    return Profile.synthetic(2 * p, F=F / 2, B=B / 2, W=W / 2, saved=0.5, latency=comm)


def chosen(req):
    """The chooser's ranked Choice as JSON, its printed table, and the figures of its best candidates."""
    p = _number(req, 'p', 4, 2, MAX_RANKS, True)
    m = _number(req, 'm', 8, 1, MAX_MICRO_BATCHES, True)
    limit = req.get('memory_limit')
    limit = None if limit in (None, '') else _number(req, 'memory_limit', 0, 1e-12)
    draw = _number(req, 'draw', 4, 0, 32, True)
    if req.get('profile'):
        try:
            profile = Profile.from_json(req['profile'])
        except (ValueError, KeyError, TypeError) as e:
            raise BadRequest(f'not a profile saved by scripts/choose_schedule.py --save: {e}') from None
        units, budget = 's', limit  # MiB
    else:
        split = req.get('split', True)
        F = _number(req, 'F', 1.0, 1e-9)
        B, W = ((_number(req, 'B', 1.0, 1e-9), _number(req, 'W', 1.0, 0.0)) if split
                else (_number(req, 'BW', 2.0, 2e-9) / 2, ) * 2)
        profile = synthetic_profile(p, F, B, W, _number(req, 'comm', 0.0, 0.0))
        units, budget = 'F', None if limit is None else limit / MiB  # units of activation: the chooser's bytes
    started = time.perf_counter()
    try:
        # a GPTlite profile: its vocabulary head split over the ranks too (train.py --vocab-parallel)
        choice = choose(profile, p, m, budget, split=profile.meta.get('model') == 'gptlite')
    except ValueError as e:
        return {'error': str(e), 'units': units}
    out = {'error': None, 'units': units, 'choice': to_json(choice), 'table': table(choice),
           'seconds': time.perf_counter() - started, 'runs': []}
    seen = set()
    for c in choice.ranked:  # the best cut of each of the first `draw` schedules
        if c.label in seen or len(seen) >= draw:
            continue
        seen.add(c.label)
        result, place, figures_memory = candidate_run(profile, c, p, m)
        run = figures(result, place, False, figures_memory, units='s' if units == 's' else 'time')
        out['runs'].append(dict(run, schedule=c.schedule, label=f'{c.label} ({c.method} cut)', p=p, m=m,
                                v=c.virtual_stages, error=None, closed_form=None, predicted_step=c.step))
    return out


def candidate_run(profile, candidate, stages, micro_batches):
    """(SimResult, placement, memory table) of a chooser's candidate: its costs composed from the profile and
    simulated with the arguments the chooser gives (schedules/planner/candidate.py, `simulated`)."""
    spec = schedule_spec(candidate.schedule, candidate.virtual_stages)
    place = spec.placement(stages)
    if candidate.vocab_parallel:  # its parts cut the model with the head split into a slice per rank
        profile = split_head(profile, stages)
    composed = compose(profile, place, candidate.parts)
    result = simulate(spec.factory, stages, micro_batches, placement=spec.placement, iterations=1,
                      **simulator_inputs(profile, composed))
    return result, place, composed['memory']


# ----------------------------------------------------------------------------------------------
# A traced run over its prediction (as scripts/plot_trace.py draws it)

def traced(req):
    text = req.get('trace')
    if not text:
        raise BadRequest('trace: the text of a Chrome trace written by train.py --trace')
    with tempfile.TemporaryDirectory(prefix='explore-') as tmp:
        path = os.path.join(tmp, 'trace.json')
        with open(path, 'w') as f:
            f.write(text if isinstance(text, str) else json.dumps(text))
        try:
            timeline, _ = load_chrome_trace(path)
            events = load_p2p_events(path)
        except (ValueError, KeyError, TypeError) as e:
            raise BadRequest(f'not a trace written by train.py --trace: {e!r}') from None
    if not timeline.iterations():
        raise BadRequest('the trace holds no pass')
    iteration = req.get('iteration')
    iteration = timeline.iterations()[-1] if iteration in (None, '') else int(iteration)
    if iteration not in timeline.iterations():
        raise BadRequest(f'iteration {iteration}: the trace has {timeline.iterations()}')
    measured = one_iteration(timeline, iteration)
    meta = timeline.meta
    if meta.get('schedule') not in available_schedules() or 'stages' not in meta or 'micro_batches' not in meta:
        raise BadRequest(f"the trace's schedule {meta.get('schedule')!r} is not a registered one: nothing to predict")
    p2p_cpu, dispatch = measured_overheads(timeline, events)
    latency = _number(req, 'latency', 0.0, 0.0)
    predicted = predict(measured, latency, p2p_cpu, dispatch)
    place = available_schedules()[meta['schedule']].placement(meta['stages'])
    measured_span = measured.span()[1]
    return {'schedule': meta['schedule'], 'p': meta['stages'], 'm': meta['micro_batches'],
            'iteration': iteration, 'iterations': timeline.iterations(), 'units': 's',
            'measured': {'timeline': encode(measured), 'span': measured_span,
                         'busy': [measured.busy(r) for r in range(measured.num_ranks)]},
            'predicted': dict(figures(predicted, place, False), schedule='predicted',
                              label=f"{meta['schedule']} predicted"),
            'p2p_cpu': list(p2p_cpu), 'dispatch': dispatch, 'latency': latency}


# ----------------------------------------------------------------------------------------------
# Perfetto: the Chrome trace writer of traced runs, plus memory counters and dependency flows

def perfetto(req):
    """One Chrome trace of the simulated schedules: a process per schedule and rank (its passes as complete
    events, written by schedules.observe.trace.write_chrome_trace), a memory counter per rank, and flow arrows
    for the dependencies. Times: one unit of the page's time is one second of the trace."""
    runs = req.get('runs') or []
    if not runs:
        raise BadRequest('runs: a list of simulate requests')
    events, names = [], []
    for n, run_req in enumerate(runs):
        run = simulated(dict(run_req, dependencies=True))
        if run['error']:
            continue
        events += _trace_events(run, base=100 * n)
        names.append(run['label'])
    return {'traceEvents': events, 'displayTimeUnit': 'ms',
            'otherData': {'schedules': names, 'units': 'one time unit of the explorer = 1 s',
                          'written_by': 'schedules.planner.explore'}}


def _trace_events(run, base):
    ranks = run['timeline']['ranks']
    place = schedule_spec(run['schedule'], run['v']).placement(run['p'])
    tracers = []
    for r, row in enumerate(ranks):
        tracer = Tracer(r, place)  # what a traced rank gathers, holding the simulated passes
        tracer.passes = [Pass(KIND_CODES[q[0]], *q[1:]) for q in row]
        tracers.append(tracer)
    with tempfile.TemporaryDirectory(prefix='explore-') as tmp:
        path = os.path.join(tmp, 'trace.json')
        write_chrome_trace(tracers, path, {})
        with open(path) as f:
            events = json.load(f)['traceEvents']
    for e in events:
        e['pid'] += base
        if e.get('name') == 'process_name':
            e['args']['name'] = f"{run['label']}: {e['args']['name']}"
    for r, points in enumerate(run['memory']):
        events += [{'name': 'activation memory', 'ph': 'C', 'pid': base + r, 'ts': t * 1e6, 'args': {'live': live}}
                   for t, live in points]
    for n, (r0, i0, r1, i1) in enumerate(run['dependencies']):
        a, b = ranks[r0][i0], ranks[r1][i1]
        flow = {'name': 'needs', 'cat': 'dependency', 'id': base * 100000 + n}
        events.append(dict(flow, ph='s', pid=base + r0, tid=0, ts=(a[4] + a[5]) / 2 * 1e6))
        events.append(dict(flow, ph='f', bp='e', pid=base + r1, tid=0, ts=(b[4] + b[5]) / 2 * 1e6))
    return events


def meta():
    return {'schedules': [{'name': name, 'description': spec.description,
                           'virtual': hasattr(spec.factory, 'with_virtual_stages'),
                           'closed_form': CLOSED_FORMS.get(name)} for name, spec in available_schedules().items()],
            'presets': PRESETS, 'bubble': BUBBLE, 'memory_basis': MEMORY_BASIS, 'kinds': KIND_CODES,
            'limits': {'p': MAX_RANKS, 'm': MAX_MICRO_BATCHES}}


# ----------------------------------------------------------------------------------------------
# The server

API = {'/api/simulate': simulated_json, '/api/choose': chosen, '/api/trace': traced, '/api/perfetto': perfetto}


class Handler(BaseHTTPRequestHandler):
    server_version = 'explore/1'
    quiet = True

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's name)
        if not self.quiet:
            super().log_message(format, *args)

    def _send(self, status, body, content_type='application/json'):
        if isinstance(body, (dict, list)):
            body = json.dumps(body, separators=(',', ':')).encode()
        self.send_response(status)
        self.send_header('Content-Type', content_type)
        self.send_header('Content-Length', str(len(body)))
        self.send_header('Cache-Control', 'no-store')
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the page dropped a request a newer change made stale
            pass

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path.split('?')[0]
        if path == '/api/meta':
            return self._send(200, meta())
        if path == '/favicon.ico':
            return self._send(204, b'', 'image/x-icon')
        name = 'index.html' if path in ('/', '/index.html') else path.lstrip('/')
        file = (STATIC / name).resolve()
        if STATIC.resolve() not in file.parents or not file.is_file():
            return self._send(404, {'error': f'{path}: no such page'})
        kind = mimetypes.guess_type(file.name)[0] or 'application/octet-stream'
        self._send(200, file.read_bytes(), kind + ('; charset=utf-8' if kind.startswith('text/') or
                                                   kind.endswith('javascript') else ''))

    def do_POST(self):  # noqa: N802
        path = self.path.split('?')[0]
        handler = (lambda req: simulated_json(req, self.server.pools)) if path == '/api/simulate' else API.get(path)
        if handler is None:
            return self._send(404, {'error': f'{self.path}: no such API'})
        try:
            length = int(self.headers.get('Content-Length', 0))
            req = json.loads(self.rfile.read(length) or b'{}')
            if not isinstance(req, dict):
                raise BadRequest('send a JSON object')
            return self._send(200, handler(req))
        except (BadRequest, json.JSONDecodeError) as e:
            return self._send(400, {'error': str(e)})


def _pid(_):
    return os.getpid()


def _follow_parent(parent):
    """In a worker: end when the server's process has ended, however it ended (killed, too). What it inherited
    (torch, DeepSpeed, the registry: about a million objects, frozen by `serve`) stays: the collector's full sweeps
    leave it alone, which keeps them from pausing an answer by 0.1-0.3 s."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name='explore-parent', daemon=True).start()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # requests for every schedule at once: the default backlog (5) refuses some of them
    pools = None  # processes simulating new inputs (a pool of one each), or None: in the server's own threads

    def server_close(self):
        super().server_close()
        for pool in self.pools or ():
            pool.shutdown(wait=True, cancel_futures=True)


def serve(host='127.0.0.1', port=0, workers=None):
    """A started server (in a daemon thread) and its address, `http://HOST:PORT/`; `server.shutdown()` and
    `server.server_close()` stop it. `workers`: processes simulating side by side (default: the machine's cores, at
    most 4; 0: none, every simulation in the server's threads, one at a time under Python's lock). They are forked
    here, before any thread of the server starts, and inherit the registry as it is now."""
    server = Server((host, port), Handler)
    workers = min(os.cpu_count() or 1, 4) if workers is None else workers
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        gc.freeze()  # this process only serves from here on: see _follow_parent
        server.pools = [ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('fork'),
                                            initializer=_follow_parent, initargs=(os.getpid(), ))
                        for _ in range(workers)]
        for pool in server.pools:  # start them all now
            pool.submit(_pid, 0).result()
    threading.Thread(target=server.serve_forever, name='explore', daemon=True).start()
    shown = f'[{host}]' if ':' in host else host
    return server, f'http://{shown}:{server.server_address[1]}/'
