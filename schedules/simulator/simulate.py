"""Run every rank's DeepSpeed `PipeSchedule` instruction stream together, without a model.

The simulator instantiates the schedule class once per stage_id and consumes its steps(), so
there is no second description of any schedule. Each instruction becomes a few *effects*
(compute a pass, load data, send/receive a tensor, launch queued p2p) through a handler looked
up by the instruction's exact type, as DeepSpeed's engine does. Which chunk an instruction
touches and which rank it talks to depend on the engine, not the schedule: a `Placement`
answers that.

Communication follows the real engine on gloo: a message moves only once both its send and its
receive are posted (rendezvous; measured across emulated nodes: a receive posted 300 ms late still
took the message's whole wire time after it was posted); messages between an ordered pair of ranks
match first-in first-out whatever their kind; engines with CommitP2P queue their sends/receives
and post them together at the CommitP2P (dist.batch_isend_irecv), which waits for all of them;
engines that post receives ahead (Placement.receives_ahead: ours on gloo) post each channel's
next receive when the one before it is taken, so a message crosses the link while its receiver
computes. A message arrives `latency` after the rendezvous; its send completes `send_wait` after
it (the sockets' buffers take the bytes at once); with `wire` > 0 the link from one rank to
another carries one message at a time, so two chunks' messages on one link share its rate. A mismatch at
the head of a channel, a wait that can never end, or a buffer used out of order raises
ScheduleError naming rank, step and instruction: schedules are checked, not trusted.

A call is two steps: the streams run together once give the schedule's structure (the checks, the
matching, the waits), written down as timing nodes, kept for a registered schedule; the nodes are
then timed at the call's costs, the chained iterations by replaying the first one's (see "The
simulation" below).

Every compute instruction is understood through `schedules.instructions.PASS_KIND`; an
instruction type from elsewhere is taught once with `register_instruction`. Schedules are looked
up by name in schedules/registry.py. The simulator reads the vocabulary and the definitions,
never an engine.
"""

import gc
from dataclasses import dataclass
from typing import Optional

from schedules.placement import StockPlacement
from schedules.registry import available_schedules
from schedules.simulator.effects import Compute, register_instruction  # noqa: F401 (the API's)
from schedules.simulator.streams import _replayable
from schedules.simulator.structure import _STRUCTURES, VALIDATIONS, _steady, _structure, _unit_cost  # noqa: F401
from schedules.simulator.timeline import Timeline
from schedules.simulator.timing import _peaks, _replay

# ----------------------------------------------------------------------------------------------
# Public API.

@dataclass
class SimResult:
    timeline: Timeline  # one iteration, every rank starting at 0 (synchronised)
    chained: Optional[Timeline]  # `iterations` iterations back to back, no barrier in between
    makespan: float  # one synchronised iteration
    period: float  # steady-state time per iteration when chained (= makespan when iterations < 3)
    per_rank: list  # dicts: rank, busy, idle_synced, idle_interlocked, peak_activation_memory, params
    units: str
    # per rank, each data send / receive of one iteration in its stream's order: (is_send, kind, peer rank), what
    # pairs a traced run's p2p records with each other (trace.measured_p2p_cpu)
    messages: list = None
    instructions: int = 0  # instructions simulated, every rank's, in the synchronised and the chained run

    def worst(self, key):
        return max(row[key] for row in self.per_rank)

    def pass_columns(self, chained=False):
        """The passes of `timeline` (or `chained`) as columns (see _Replayed.columns) and that timeline's meta,
        without building it: what draws many passes reads (the explorer). None for a result made elsewhere."""
        made = getattr(self, '_replays', {}).get('chained' if chained else 'timeline')
        if made is None:
            return None
        columns = made[0].columns()
        return None if columns is None else (columns, made[1])


def _built_when_read(name):
    """SimResult.timeline and .chained: a Timeline, or a function that builds it, called when it is first read (the
    table and the chooser read only the figures, and a timeline is many objects)."""
    def read(result):
        value = result.__dict__[name]
        if callable(value):
            value = result.__dict__[name] = value()
        return value

    def write(result, value):
        result.__dict__[name] = value
    return property(read, write)


SimResult.timeline, SimResult.chained = _built_when_read('timeline'), _built_when_read('chained')


def _cost_function(costs):
    """None: unit costs (chunk size x F 1, B 1, W 1, BW 2). Else {(rank, chunk): {kind: s}} or f(rank, chunk, kind).
    In the table a kind's value may be a list of seconds: its passes take them in turn, in the rank's order (a
    traced run's own durations replayed, trace.replayed_costs); call once per simulated run, which starts them
    from the first again. A list shorter than the run's passes starts over."""
    if costs is None:
        return lambda rank, chunk, kind, size: _unit_cost(kind, size), 'F'
    if callable(costs):
        return lambda rank, chunk, kind, size: costs(rank, chunk, kind), 's'
    taken = {}  # (rank, chunk, kind) -> passes costed so far, for the listed kinds

    def listed(rank, chunk, kind, durations):
        n = taken.get((rank, chunk, kind), 0)
        taken[(rank, chunk, kind)] = n + 1
        return durations[n % len(durations)]

    def table(rank, chunk, kind, size):
        c = costs[(rank, chunk)]
        value = c[kind] if kind in c else None
        if isinstance(value, list):
            return listed(rank, chunk, kind, value)
        if value is not None:
            return value
        if 'BW' not in c and not ('B' in c and 'W' in c):  # (else each would be asked of the other, forever)
            raise ValueError(f"costs of rank {rank}, chunk {chunk}: {kind!r} asked for; give 'BW' or both 'B' and 'W' "
                             f"(a fused backward is B + W, a B or W alone half a BW); given: {sorted(c)}")
        return table(rank, chunk, 'B', size) + table(rank, chunk, 'W', size) if kind == 'BW' else \
            table(rank, chunk, 'BW', size) / 2
    return table, 's'


def _comm_function(comm):
    """None, or (rank, chunk, kind) -> seconds of a pass's collectives (simulate's `comm`); 0 where not listed."""
    if comm is None or callable(comm):
        return comm

    def table(rank, chunk, kind):
        c = comm.get((rank, chunk), {})
        if kind in c:
            return c[kind]
        return c.get('B', 0.0) + c.get('W', 0.0) if kind == 'BW' else 0.0
    return table


def _shape_function(shape):
    """None, or (rank, chunk, kind) -> a pass's (computes, collectives) (simulate's `comm_shape`); None where not
    listed (a BW without its own: its B's then its W's, joined)."""
    if shape is None or callable(shape):
        return shape

    def table(rank, chunk, kind):
        s = shape.get((rank, chunk), {})
        if kind in s:
            return s[kind]
        if kind == 'BW' and 'B' in s:
            (ba, bc), (wa, _) = s['B'], s.get('W', ([0.0], []))
            return [*ba[:-1], ba[-1] + sum(wa)], bc
        return None
    return table


def _fill_function(costs):
    """(rank, chunk, kind, size) -> the seconds of a fused backward's (BW's) computation that are its weight
    gradients, which an overlapped pair computes while both its passes wait (overlap.fill_with): the table's W where
    it has one (a list: its mean), else the BW times W's share of a split backward of the rank's other chunks, else
    half the BW (the simulator's B = W = BW / 2); 0 for other kinds."""
    def mean(value):
        return sum(value) / len(value) if isinstance(value, list) else value

    shares = {}  # rank -> W's share of its split backwards (DualPipe's last ones), from a table
    if isinstance(costs, dict):
        split = {}
        for (rank, _), c in costs.items():
            if 'B' in c and 'W' in c:
                b, w = split.get(rank, (0.0, 0.0))
                split[rank] = (b + mean(c['B']), w + mean(c['W']))
        shares = {rank: w / (b + w) for rank, (b, w) in split.items() if b + w > 0}

    def fill(rank, chunk, kind, size):
        if kind != 'BW':
            return 0.0
        if costs is None:
            return _unit_cost('W', size)
        if callable(costs):
            return costs(rank, chunk, 'W')
        c = costs[(rank, chunk)]
        if 'W' in c:
            return mean(c['W'])
        return mean(c['BW']) * shares.get(rank, 0.5) if 'BW' in c else 0.0
    return fill


def _within_function(memory):
    """(rank, chunk, kind) -> bytes a pass holds above its start while it runs beyond what it leaves (a memory
    table's optional 'within': {kind: bytes} per (rank, chunk)); 0 for units and where the table says nothing."""
    if memory is None:
        return lambda rank, chunk, kind: 0.0
    return lambda rank, chunk, kind: memory[(rank, chunk)].get('within', {}).get(kind, 0.0)


def _memory_function(memory):
    """None: units (F adds the chunk size, BW frees it, B and W free half each). Else a table
    {(rank, chunk): {kind: delta}} of what a pass of each kind changes (e.g. bytes measured in a
    run); a kind it lacks is derived: BW = -F, B = W = -F / 2 (or B = BW - W, W = BW - B)."""
    if memory is None:
        return lambda rank, chunk, kind, size: {'F': size, 'BW': -size, 'B': -size / 2, 'W': -size / 2}[kind]

    def table(rank, chunk, kind, size):
        m = memory[(rank, chunk)]
        if kind in m:
            return m[kind]
        bw = m.get('BW', -m['F'])
        other = {'B': 'W', 'W': 'B'}.get(kind)
        return bw if kind == 'BW' else bw - m[other] if other in m else bw / 2
    return table


def simulate(schedule, stages, micro_batches, placement=None, costs=None, latency=0.0, iterations=5,
             forward_only=False, memory=None, p2p_cpu=(0.0, 0.0), dispatch=0.0, step_cost=0.0, validation=None,
             replayed=(), rollback_cost=0.0, send_wait=None, wire=0.0, comm=None, overlap=True, comm_cpu=None,
             comm_shape=None, fill=True):
    """Simulate `schedule` on `stages` pipeline ranks with `micro_batches` micro-batches per iteration.

    schedule: a registered name, or a PipeSchedule class / factory(micro_batches, stages, stage_id).
    placement: a Placement subclass (default: the registered one, else StockPlacement).
    costs: None for unit costs (units 'F'), else seconds per (rank, chunk) (units 's'), or per pass in turn
    (a list per kind: durations replayed), see _cost_function.
    latency: cost of every p2p message, from its send (or its receive, if later) to its arrival.
    send_wait: from that moment to the send's completion (its data handed to the transport: on gloo the socket's
    buffers take a message of up to a few hundred KiB at once, and the wire time goes on after it); None: the
    message's arrival (`latency`). A blocking send holds its rank that long; an asynchronous one is waited for at
    the step's end.
    wire: the part of `latency` during which a message holds the link from its rank to its peer (its bytes over the
    link's rate): messages between two ranks then cross one after the other, in the order they met, so two chunks'
    messages on one link share it. 0.0: every message priced alone.
    comm: the communication lane of the passes: seconds a pass waits for collectives of its own (the experts'
    all-to-alls of a MoE layer, priced by their bytes over the link), {(rank, chunk): {kind: s}} (a BW without its
    own: B + W) or f(rank, chunk, kind). A pass alone computes, then waits; with `overlap` the forward and the
    backward of one pair (DualPipe's ForwardBackwardPass, run as one unit) compute while the other's collectives
    are in flight: the pair costs max(F, cB) + max(B, cF) (F, B their computation, cF, cB their collectives)
    where one after the other it costs F + cF + B + cB.
    comm_cpu: the part of `comm` that keeps the rank's own core busy (copying, the kernel's work: e.g. the
    collectives' time over an unthrottled link), in `comm`'s form: no turn hides it, so an overlapped pass costs
    max(F + kF, cB). None: none.
    comm_shape: how each pass's computation and collectives alternate, {(rank, chunk): {kind: (computes,
    collectives)}} in seconds at any scale (trace.communication_shapes) or f(rank, chunk, kind); an overlapped pair
    whose two passes both have one takes what its turns take (simulator/pairs.py) instead of the closed form.
    fill: with `comm_shape`, a fused backward's weight gradients (_fill_function) fill the time its pair, or it alone,
    waits for collectives, as the engines do (overlap.fill_with); False: not (the engines under the BF16 optimizer).
    p2p_cpu: (send, receive) seconds that each data send / receive also takes on its own rank
    (posting it, copying the data in), e.g. measured in a traced run (trace.measured_p2p_cpu).
    dispatch: seconds (or {rank: seconds}) of the engine's own work before each pass (running the
    instruction loop, loading a micro-batch), e.g. trace.measured_dispatch.
    iterations: how many to chain without barrier for the interlocked figures (< 3 skips that run).
    step_cost: seconds (or {rank: seconds}) of each rank's optimizer step (its OptimizerStep instruction, and
    what it does around it: gradient reduction, validation), e.g. measured in a traced run; busy time counts
    passes only, so it shows as idle. A rank's value may be a pair (before, after): the work before it starts
    the model's norm (gradient reduction, its own norm) and after (with validation 'wait', once the norm is in).
    validation: chained iterations with optimizer post-validation (schedules/runtime/interlock.py): a rank
    starts iteration i+1 only once the model's norm of iteration i is known (every rank reached its
    OptimizerStep, plus one latency); 'ahead': its step (step_cost) taken at its OptimizerStep, before the
    norm; 'wait': its step taken after the norm arrives. None: nothing validated (clipping off, or
    speculating past the validation).
    replayed: speculating past the validation (validation None), the chained iterations that ran twice because
    the step before was redone: every rank runs the iteration's stream to its end (wasted; its OptimizerStep
    redoes the step before, taking rollback_cost, seconds or {rank: seconds}, besides step_cost), then again.
    The chained timeline numbers both runs' passes by their iteration, as a traced run does.
    forward_only: an inference run (nothing kept for backward).
    memory: None for activation memory in units of the chunk size (the published convention: B
    frees half, W the other half), else measured deltas per (rank, chunk), see _memory_function; with an
    optional 'within': {kind: bytes} per (rank, chunk), what a pass holds above its start while it runs, where
    more than it leaves (a split head's recomputed logits inside its backward): peaks count it.
    Raises ValueError when the schedule rejects (stages, micro_batches), ScheduleError when it is broken.
    """
    if any(not 0 < it < iterations for it in replayed):
        raise ValueError(f"replayed {sorted(replayed)}: an iteration replayed follows a redone one, so it is one of "
                         f"1 .. {iterations - 1}")
    if replayed and validation is not None:
        raise ValueError(f"replayed iterations are what speculating past the validation costs; validation "
                         f"{validation!r} validates before the next iteration, so nothing is replayed")
    if validation not in VALIDATIONS:
        raise ValueError(f"validation {validation!r}: choose from {', '.join(map(str, VALIDATIONS))}")
    name = schedule if isinstance(schedule, str) else getattr(schedule, '__name__', repr(schedule))
    if isinstance(schedule, str):
        spec = available_schedules()[schedule]
        schedule, placement = spec.factory, placement or spec.placement
    place = (placement or StockPlacement)(stages)
    units = _cost_function(costs)[1]
    # a pass's cost is a function of (rank, chunk, kind) alone, looked up once per simulation, unless a function
    # gives it or a kind lists durations taken in turn
    fixed = costs is None or isinstance(costs, dict) and not any(
        isinstance(v, list) for c in costs.values() for v in c.values())
    meta = {'schedule': name, 'stages': stages, 'micro_batches': micro_batches}
    per_rank = lambda value: value if isinstance(value, dict) else {r: value for r in range(stages)}  # noqa: E731
    step_cost, rollback_cost, dispatch = per_rank(step_cost), per_rank(rollback_cost), per_rank(dispatch)

    def step_parts(rank):
        """(before, after): a rank's step_cost before its norm is started and after (all after for a number)."""
        cost = step_cost.get(rank, 0.0)
        return tuple(cost) if isinstance(cost, (tuple, list)) else (0.0, cost)

    memo = {}  # the synchronised iteration's times, which the chained run's first iteration shares

    def run(n, replays=()):
        # the runs of the iterations' streams: a replayed iteration runs twice, the first run wasted
        run_iteration, wasted = [], set()
        for it in range(n):
            if it in replays:
                wasted.add(len(run_iteration))
                run_iteration.append(it)
            run_iteration.append(it)
        runs = len(run_iteration)
        first = _structure(schedule, place, stages, micro_batches, 1, forward_only, validation, wire > 0)
        if runs == 1:
            segments = [(first, 0)]
        elif first.clean and _replayable(schedule):  # every later run is the first one again, without its shapes
            segments = [(first, 0)] + [(_steady(first), run) for run in range(1, runs)]
        else:
            segments = [(_structure(schedule, place, stages, micro_batches, runs, forward_only, validation, wire > 0),
                         0)]
        cost = _cost_function(costs)[0]  # per run: listed costs start from their first again
        out = _replay(segments, cost, fixed, latency, p2p_cpu, dispatch, step_parts, rollback_cost, run_iteration,
                      wasted, memo, send_wait, wire, _comm_function(comm), overlap,
                      _comm_function(comm_cpu), _shape_function(comm_shape),
                      _fill_function(costs) if fill else None)
        if n == 1:
            out.peak = _peaks(first, _memory_function(memory), forward_only, _within_function(memory))
            out.messages = first.messages
        if replays:  # a run of a replayed iteration is numbered by its iteration, its end the last run's
            out.iteration_end = [{run_iteration[run]: end for run, end in sorted(ends.items())}
                                 for ends in out.iteration_end]
        return out

    collecting = gc.isenabled()
    gc.disable()  # a simulation makes many objects and frees few: the collector's sweeps would double its time
    try:
        return _simulate(run, iterations, replayed, stages, units, meta, place)
    finally:
        if collecting:
            gc.enable()


def _simulate(run, iterations, replayed, stages, units, meta, place):
    one = run(1)
    makespan = max(one.clocks)
    timeline = lambda: Timeline(one.passes(), units, dict(meta, iterations=1))  # noqa: E731
    chained, period, waits, instructions = None, makespan, [0.0] * stages, one.instructions
    if iterations >= 3:
        many = run(iterations, frozenset(replayed))
        instructions += many.instructions
        chained = lambda: Timeline(many.passes(), units, dict(meta, iterations=iterations))  # noqa: E731
        # The chained run settles into a periodic regime after a short transient; averaging the
        # last two iterations also covers a regime that alternates between two lengths.
        n = iterations - 1
        period = max((ends[n] - ends[n - 2]) / 2 for ends in many.iteration_end)
        waits = [w.get(n - 1, 0.0) for w in many.validation_waits]  # at the last boundary: the steady state
    per_rank = []
    for r, busy in enumerate(one.busy()):
        per_rank.append({'rank': r, 'busy': busy, 'idle_synced': makespan - busy,
                         'idle_interlocked': period - busy, 'validation_wait': waits[r],
                         'peak_activation_memory': one.peak[r],
                         'params': sum(place.chunk_size(r, c) for c in range(place.chunks))})
    messages = [list(m) for m in one.messages]
    result = SimResult(timeline, chained, makespan, period, per_rank, units, messages, instructions)
    result._replays = {'timeline': (one, dict(meta, iterations=1))}
    if iterations >= 3:
        result._replays['chained'] = (many, dict(meta, iterations=iterations))
    return result
