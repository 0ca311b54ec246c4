"""Tracing real runs: which pass each rank executed when, in the simulator's Timeline schema.

`traced(engine_cls)` returns a subclass of any pipeline engine (DeepSpeed's own PipelineEngine
and DualPipeVEngine included) whose instruction map wraps every handler with a clock reading;
the engine's behaviour is unchanged, and an untraced run uses the plain class, so its
instruction loop does no timing work at all.

A rank's `Tracer` turns the executed instructions into Timeline passes (kind, global stage,
chunk, micro-batch, start, end, on a clock shared by all ranks) plus the time spent in
point-to-point instructions. Stock instructions carry only a buffer id, so micro-batches are
recovered as the simulator does: forwards are counted per chunk, a backward belongs to the
forward that filled its buffer. `write_chrome_trace` gathers every rank's records on rank 0 into
one Chrome trace event file (opens in Perfetto or chrome://tracing); `load_chrome_trace` reads
it back into a Timeline, which schedules/observe/plot.py draws like a simulated one.

`RunTrace` is what a training loop uses: `with trace.step(step):` around each step traces the
steps asked for (one clock for all ranks, read after a barrier), and `trace.save()` writes the file.
"""
import contextlib
import json
import os
import statistics
import time

from schedules.instructions import P2P, PASS_KIND, ForwardBackwardPass, paired_kinds
from schedules.placement import DualPipeVPlacement, StockPlacement
from schedules.registry import available_schedules
from schedules.runtime import overlap
from schedules.simulator.simulate import simulate
from schedules.simulator.timeline import Pass, Timeline


class Tracer:

    def __init__(self, rank, placement, sync=None):
        self.rank, self.placement = rank, placement
        self.sync = sync  # e.g. torch.cuda.synchronize: on a GPU a pass ends when its kernels do
        self.origin = None  # clock reading of step 0 of the trace, taken right after a barrier
        self.passes, self.p2p = [], []  # Pass records; (name, start, end, iteration) of p2p
        self.other = []  # (name, start, end, iteration) of the rest: loads, ReduceGrads, OptimizerStep, ...
        self.memory = None  # optional: a SavedTensorTracker whose live bytes each pass changes
        self.memory_deltas = []  # (chunk, kind, bytes) per pass, when `memory` is set
        self.memory_samples = []  # (seconds, live bytes) at the end of each pass, when `memory` is set
        self.peak_bytes = {}  # iteration -> the memory tracker's peak within it (RunTrace with memory=True)
        self.param_bytes = None  # bytes of the parameters this rank holds (RunTrace sets it)
        self.comm = []  # (name, issued, resumed, done, iteration, bytes sent, (rank, group's ranks)) inside passes
        self.iteration = 0
        self.active = False
        self._pair = 0
        self._observing = False

    def start_iteration(self, iteration):
        self.iteration, self.active = iteration, True
        self._forwards, self._buffer_mb = {}, {}
        if not self._observing:  # the experts' all-to-alls (schedules/runtime/overlap.py)
            overlap.observe(self.record_comm)
            self._observing = True

    def stop(self):
        self.active = False
        if self._observing:
            overlap.unobserve(self.record_comm)
            self._observing = False

    def _micro_batch(self, kind, chunk, buffer_id):
        if kind == 'F':
            mb = self._forwards.get(chunk, 0)
            self._forwards[chunk] = mb + 1
            self._buffer_mb[(chunk, buffer_id)] = mb
            return mb
        return self._buffer_mb[(chunk, buffer_id)]

    def now(self):
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def live_bytes(self):
        return None if self.memory is None else self.memory.live_bytes

    def record(self, kind, chunk, buffer_id, start, end, pair=None, live=(None, None)):
        if live[0] is not None:
            self.memory_deltas.append((chunk, kind, live[1] - live[0]))
            self.memory_samples.append((end - self.origin, live[1]))
        mb = self._micro_batch(kind, chunk, buffer_id)
        self.passes.append(Pass(kind, self.placement.stage(self.rank, chunk), chunk, mb, start - self.origin,
                                end - self.origin, self.placement.direction(chunk), pair, self.iteration))

    def record_p2p(self, name, start, end):
        self.p2p.append((name, start - self.origin, end - self.origin, self.iteration))

    def record_comm(self, name, issued, resumed, done, sent=0, group=None):
        """A collective inside a pass: in flight from `issued` to `done`, the rank waiting for it (exposed) from
        `resumed`, `sent` bytes to other ranks; `group`: (this rank, the group's ranks), global (overlap.observe)."""
        if self.active:
            self.comm.append((name, issued - self.origin, resumed - self.origin, done - self.origin, self.iteration,
                              sent, group))

    def record_other(self, name, start, end):
        self.other.append((name, start - self.origin, end - self.origin, self.iteration))

    def next_pair(self):
        self._pair += 1
        return self._pair


def _chunk_of(kwargs, key='chunk'):
    return kwargs.get(key, kwargs.get('phase', 0))


def _wrap(instr_type, handler):
    """The handler, timed: compute passes become Timeline passes, p2p instructions waits."""
    kind = PASS_KIND.get(instr_type)

    def traced_handler(self, **kwargs):
        tracer = self.tracer
        if tracer is None or not tracer.active:
            return handler(self, **kwargs)
        before = tracer.live_bytes()
        start = tracer.now()
        out = handler(self, **kwargs)
        end = tracer.now()
        if kind is not None:
            tracer.record(kind, _chunk_of(kwargs), kwargs['buffer_id'], start, end, live=(before, tracer.live_bytes()))
        elif instr_type in P2P:
            tracer.record_p2p(instr_type.__name__, start, end)
        else:  # loads, the gradient reduction, the optimizer step, ...
            tracer.record_other(instr_type.__name__, start, end)
        return out

    def traced_pair(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused):
        # ChunkedEngine's paired unit, timed part by part: one after the other, or overlapped (their spans then
        # overlap: each runs from its start to its end, the other's computation in between)
        tracer = self.tracer
        if tracer is None or not tracer.active:
            return handler(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused)
        pair = tracer.next_pair()
        spans = {}

        def timed(part, run):
            def timed_run():
                live, start = tracer.live_bytes(), tracer.now()
                run()
                spans[part] = (start, tracer.now(), live, tracer.live_bytes())
            return timed_run

        forward, backward = self._pair_parts(fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused)
        self._run_pair(timed('F', forward), timed('B', backward))
        if fused and self.fills_pairs():  # the weight gradients no wait took, computed as the pair ends
            tracer.record_other('PairWeightGrads', max(spans['F'][1], spans['B'][1]), tracer.now())
        self._pair_done(bwd_chunk, fused)
        fwd_kind, bwd_kind = paired_kinds(fused)
        for (kind, chunk, buffer_id), (start, end, m0, m1) in sorted(
                zip(((fwd_kind, fwd_chunk, fwd_buffer), (bwd_kind, bwd_chunk, bwd_buffer)), (spans['F'], spans['B'])),
                key=lambda item: item[1][0]):  # in the order they started, as the memory samples go
            tracer.record(kind, chunk, buffer_id, start, end, pair, live=(m0, m1))

    return traced_pair if instr_type is ForwardBackwardPass else traced_handler


def traced(engine_cls):
    """`engine_cls` with every instruction handler timed (see the module docstring)."""
    return type(f"Traced{engine_cls.__name__}", (engine_cls, ), {
        "tracer": None,
        "_INSTRUCTION_MAP": {t: _wrap(t, h) for t, h in engine_cls._INSTRUCTION_MAP.items()},
    })


def engine_placement(engine):
    """The placement of the chunks an engine runs, for stage numbers: its own, or one stage per rank."""
    module = engine.module
    if hasattr(module, 'placement'):
        return module.placement
    return (DualPipeVPlacement if hasattr(module, 'phase_funcs') else StockPlacement)(engine.num_stages)


def write_chrome_trace(tracers, path, meta):
    """Rank 0 writes the gathered tracers' records as Chrome trace events (times in microseconds)."""
    events = []
    for t in tracers:
        events.append({"name": "process_name", "ph": "M", "pid": t.rank, "args": {"name": f"rank {t.rank}"}})
        for tid, name in ((0, "compute"), (1, "p2p"), (2, "other"), (3, "in flight"), (4, "exposed")):
            events.append({"name": "thread_name", "ph": "M", "pid": t.rank, "tid": tid, "args": {"name": name}})
        for p in t.passes:
            label = f"{p.kind}{p.micro_batch}" + (f" c{p.chunk}" if t.placement.chunks > 1 else "")
            events.append({"name": label, "cat": p.kind, "ph": "X", "pid": t.rank, "tid": 0, "ts": p.start * 1e6,
                           "dur": p.duration * 1e6, "args": {"kind": p.kind, "stage": p.stage, "chunk": p.chunk,
                                                              "micro_batch": p.micro_batch, "direction": p.direction,
                                                              "pair": p.pair, "iteration": p.iteration}})
        for seconds, live in t.memory_samples:  # a counter track per rank: what autograd keeps for backward
            events.append({"name": "saved for backward", "ph": "C", "pid": t.rank, "ts": seconds * 1e6,
                           "args": {"MiB": live / 2**20}})
        if getattr(t, "param_bytes", None) is not None:
            events.append({"name": "param_bytes", "ph": "M", "pid": t.rank, "args": {"bytes": t.param_bytes}})
        if t.peak_bytes:
            events.append({"name": "peak_saved_bytes", "ph": "M", "pid": t.rank,
                           "args": {str(i): b for i, b in sorted(t.peak_bytes.items())}})
        for tid, cat, records in ((1, "p2p", t.p2p), (2, "other", t.other)):
            for name, start, end, iteration in records:
                events.append({"name": name, "cat": cat, "ph": "X", "pid": t.rank, "tid": tid, "ts": start * 1e6,
                               "dur": (end - start) * 1e6, "args": {"iteration": iteration}})
        # a pass's collectives: in flight (with the bytes sent and the group's ranks), and waited for
        for name, issued, resumed, done, iteration, sent, group in t.comm:
            for tid, start in ((3, issued), (4, resumed)):
                flight = {"bytes": sent, **({"rank": group[0], "group": list(group[1])} if group else {})
                          } if tid == 3 else {}
                events.append({"name": name, "cat": "comm" if tid == 3 else "exposed", "ph": "X", "pid": t.rank,
                               "tid": tid, "ts": start * 1e6, "dur": (done - start) * 1e6,
                               "args": {"iteration": iteration, **flight}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}, f)


class RunTrace:
    """The passes of some steps of a training run, written as one Chrome trace by rank 0.

    `engine` must be built traced (`schedules.initialize(..., trace=True)`); with `path` None
    nothing is traced and `step()` costs nothing. `meta` goes into the file (schedule, stages, ...).
    `memory=True` also counts the bytes autograd saves for backward during the traced steps (a
    SavedTensorTracker: the parameters left out): a counter track per rank, and each step's peak
    (`peak_saved_bytes(path)`); the hooks slow the traced steps a little.
    """

    def __init__(self, engine, path, steps, meta, memory=False):
        self.engine, self.path, self.steps, self.meta = engine, path, range(0) if path is None else steps, meta
        self.tracer = None
        if path is not None:
            import torch
            sync = torch.cuda.synchronize if engine.device.type == "cuda" else None  # time kernels, not launches
            engine.tracer = self.tracer = Tracer(engine.stage_id, engine_placement(engine), sync=sync)
            self.tracer.param_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
            if memory:
                from schedules.observe.memory import SavedTensorTracker
                self.tracer.memory = SavedTensorTracker(ignore=list(engine.module.parameters()))

    @contextlib.contextmanager
    def step(self, step):
        """Trace training step `step` if it is one of `steps`."""
        if step not in self.steps:
            yield
            return
        if self.tracer.origin is None:  # one clock for all ranks: read it right after a barrier
            import torch.distributed as dist
            dist.barrier()
            self.tracer.origin = time.perf_counter()
        self.tracer.start_iteration(step - self.steps[0])
        memory = self.tracer.memory
        if memory is not None:
            memory.__enter__()
            memory.peak_bytes = memory.live_bytes
        try:
            yield
        finally:
            self.tracer.stop()
            if memory is not None:
                memory.__exit__(None, None, None)
                self.tracer.peak_bytes[step - self.steps[0]] = memory.peak_bytes

    def save(self):
        """Gather the first data-parallel replica's traces on rank 0 and write them as one Chrome trace."""
        if self.tracer is None:
            return
        import torch.distributed as dist
        self.tracer.memory = None  # the tracker holds a lock and hooks: what is gathered is the records
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, self.tracer if self.engine.grid.get_data_parallel_rank() == 0 else None)
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            meta = dict(self.meta, micro_batches=self.engine.micro_batches)
            write_chrome_trace(sorted((t for t in parts if t is not None), key=lambda t: t.rank), self.path, meta)


def load_chrome_trace(path):
    """(Timeline in seconds, {rank: seconds spent in p2p instructions per iteration}) of a trace file."""
    with open(path) as f:
        data = json.load(f)
    ranks, p2p = {}, {}
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        rank = e["pid"]
        if e["cat"] == "p2p":
            key = (rank, e["args"]["iteration"])
            p2p[key] = p2p.get(key, 0.0) + e["dur"] / 1e6
            continue
        if e["cat"] in ("other", "comm", "exposed"):  # loads, reduction, step; collectives inside passes
            continue
        a = e["args"]
        ranks.setdefault(rank, []).append(Pass(a["kind"], a["stage"], a["chunk"], a["micro_batch"], e["ts"] / 1e6,
                                               (e["ts"] + e["dur"]) / 1e6, a["direction"], a["pair"], a["iteration"]))
    rows = [sorted(ranks.get(r, []), key=lambda p: p.start) for r in range(max(ranks) + 1 if ranks else 0)]
    return Timeline(rows, 's', dict(data.get("otherData", {}))), p2p


def exposed_communication(path):
    """{rank: seconds per traced step that it waited for collectives inside its passes (the experts' all-to-alls), and
    that those were in flight} of a trace file: {rank: (exposed, in_flight)}."""
    with open(path) as f:
        data = json.load(f)
    totals, steps = {}, {}
    for e in data["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("comm", "exposed"):
            exposed, flight = totals.get(e["pid"], (0.0, 0.0))
            seconds = e["dur"] / 1e6
            totals[e["pid"]] = (exposed + seconds, flight) if e["cat"] == "exposed" else (exposed, flight + seconds)
            steps.setdefault(e["pid"], set()).add(e["args"]["iteration"])
    return {rank: (exposed / len(steps[rank]), flight / len(steps[rank]))
            for rank, (exposed, flight) in totals.items()}


def communication_bytes(path):
    """{rank: bytes per traced step that it sent to other ranks in the collectives inside its passes} of a trace file
    (the all-to-alls' payload less each rank's own share): over a link's rate, their time on the wire alone, where
    exposed_communication's in-flight time also counts waiting for the other ranks to reach them."""
    with open(path) as f:
        data = json.load(f)
    totals, steps = {}, {}
    for e in data["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "comm":
            totals[e["pid"]] = totals.get(e["pid"], 0) + e["args"].get("bytes", 0)
            steps.setdefault(e["pid"], set()).add(e["args"]["iteration"])
    return {rank: total / len(steps[rank]) for rank, total in totals.items()}


def peak_saved_bytes(path):
    """{rank: the largest per-step peak of bytes saved for backward} of a trace written with memory=True."""
    with open(path) as f:
        data = json.load(f)
    return {e["pid"]: max(e["args"].values()) for e in data["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "peak_saved_bytes" and e["args"]}


def parameter_bytes(path):
    """{rank: bytes of the parameters it holds} of a trace written by train.py (RunTrace)."""
    with open(path) as f:
        data = json.load(f)
    return {e["pid"]: e["args"]["bytes"] for e in data["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "param_bytes"}


def load_p2p_events(path):
    """Each rank's traced p2p instructions in a trace file: [(name, start s, end s, iteration)]."""
    with open(path) as f:
        data = json.load(f)
    ranks = {}
    for e in data["traceEvents"]:
        if e.get("ph") == "X" and e["cat"] == "p2p":
            ranks.setdefault(e["pid"], []).append((e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                                                   e["args"]["iteration"]))
    return [sorted(ranks.get(r, []), key=lambda e: e[1]) for r in range(max(ranks) + 1 if ranks else 0)]


def one_iteration(timeline, iteration):
    """The passes of one traced step, on a clock starting at that step's first pass."""
    t0, _ = timeline.span(iteration)
    rows = [[Pass(**{**p.__dict__, 'start': p.start - t0, 'end': p.end - t0}) for p in row if p.iteration == iteration]
            for row in timeline.ranks]
    return Timeline(rows, timeline.units, dict(timeline.meta, iteration=iteration))


def measured_costs(timeline):
    """Mean seconds per (rank, chunk) and pass kind, in the simulator's cost-table format.

    Means, not medians: a rank's predicted busy time is then its measured busy time, so the
    prediction differs from the run only in how the passes were placed in time. (A step's first
    pass of a kind is systematically slower, e.g. it allocates the gradients; a median would drop
    that from the prediction altogether.)
    A paired unit's parts are timed apart; a kind never run (F/BW only on 1F1B) is left out, and
    the simulator derives it (BW = B + W, or B = W = BW / 2)."""
    return _means(((rank, p.chunk), p.kind, p.duration) for rank, p in timeline.passes())


def _collectives_in_passes(path, iteration=None, own=False):
    """(timeline, {(rank, pass index, cat): [(start, seconds), ...]}) of a trace file: each collective's spans, 'comm'
    (issued to done, or with `own` its own time: `_own_seconds`) and 'exposed' (waited for), under the pass it
    started in, in the file's order, of one traced step or all."""
    timeline, _ = load_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("comm", "exposed")]
    seconds = _own_seconds(events) if own else {}
    inside = {}
    for k, e in enumerate(events):
        if iteration is not None and e["args"]["iteration"] != iteration:
            continue
        at = e["ts"] / 1e6
        row = timeline.ranks[e["pid"]]
        for i, p in enumerate(row):
            if p.start <= at <= p.end:
                inside.setdefault((e["pid"], i, e["cat"]), []).append((at, seconds.get(k, e["dur"] / 1e6)))
                break
    return timeline, inside


def _own_seconds(events):
    """{index in `events`: seconds} of each collective ('comm' event) whose group the trace names: its time once
    every rank of the group was in it, the shortest of the group's ranks' times for it (the rank that came last
    waited for no one; they all end together). The n-th collective of a group on one rank is its n-th on every
    other, as collectives are issued; a group of which a rank traced a different number of them, or none (a
    data-parallel replica other than the first: not traced), is left as traced."""
    mine = {}  # (group, rank) -> indices of its collectives, in the order issued
    for k, e in enumerate(events):
        group = e["cat"] == "comm" and e["args"].get("group")
        if group:
            mine.setdefault((tuple(group), e["args"]["rank"]), []).append(k)
    seconds = {}
    for group in {g for g, _ in mine}:
        rows = [sorted(mine.get((group, r), ()), key=lambda k: events[k]["ts"]) for r in group]
        if len({len(row) for row in rows}) != 1:
            continue
        for column in zip(*rows):
            shortest = min(events[k]["dur"] for k in column) / 1e6
            seconds.update((k, shortest) for k in column)
    return seconds


def communication_costs(path, iteration=None, own=False):
    """(costs, comm) of a trace file of a run whose passes ran one at a time (no overlapped pairs: --overlap off):
    the simulator's cost table of each pass's computation (its duration less what it waited for its collectives),
    and of the collectives a pass had in flight (its `comm`), both means per (rank, chunk) and kind, of one traced
    step or all. What predicts the same steps overlapped: simulate(..., costs=costs, comm=comm, overlap=True).
    `own`: each collective counted from when the last rank of its group reached it (`_own_seconds`): over a free
    link, the part of it that keeps the core busy (simulate's comm_cpu), without the wait for a late peer."""
    timeline, inside = _collectives_in_passes(path, iteration, own)

    def total(rank, i, cat):
        return sum((seconds for _, seconds in inside.get((rank, i, cat), ())), 0.0)
    compute, comm = [], []
    for rank, row in enumerate(timeline.ranks):
        for i, p in enumerate(row):
            if iteration is None or p.iteration == iteration:
                compute.append(((rank, p.chunk), p.kind, p.duration - total(rank, i, "exposed")))
                comm.append(((rank, p.chunk), p.kind, total(rank, i, "comm")))
    return _means(compute), _means(comm)


def communication_shapes(path, iteration=None):
    """How each pass of a trace file's run (passes one at a time, as communication_costs) alternates computation and
    collectives: {(rank, chunk): {kind: (computes, collectives)}}, seconds, means over the passes of each kind with
    its most common number of collectives: the computation before the first collective, between each one's end and
    the next's start, after the last; each collective from its start to its end. What simulate's `comm_shape`
    takes, so that an overlapped pair is priced turn by turn."""
    timeline, inside = _collectives_in_passes(path, iteration)
    found = {}  # (rank, chunk, kind) -> [(computes, collectives) of each pass]
    for rank, row in enumerate(timeline.ranks):
        for i, p in enumerate(row):
            if iteration is not None and p.iteration != iteration:
                continue
            computes, collectives, clock = [], [], p.start
            for at, seconds in sorted(inside.get((rank, i, "comm"), ())):
                computes.append(max(0.0, at - clock))
                collectives.append(seconds)
                clock = at + seconds
            computes.append(max(0.0, p.end - clock))
            found.setdefault((rank, p.chunk, p.kind), []).append((computes, collectives))
    table = {}
    for (rank, chunk, kind), shapes in found.items():
        counts = [len(c) for _, c in shapes]
        n = max(set(counts), key=counts.count)
        alike = [s for s in shapes if len(s[1]) == n]
        table.setdefault((rank, chunk), {})[kind] = tuple(
            [sum(column) / len(alike) for column in zip(*(s[i] for s in alike))] for i in (0, 1))
    return table


def replayed_costs(timeline):
    """Each traced pass's own duration, in each rank's order, per (rank, chunk) and kind: the simulator's cost
    table with lists (its passes take them in turn; each simulated run starts from the first again). Replayed,
    the prediction keeps what means average away: a slow pass on the critical path delays everything behind
    it, while a fast one gains nothing when the next pass waits for a message anyway."""
    table = {}
    for rank, row in enumerate(timeline.ranks):
        for p in sorted(row, key=lambda p: p.start):
            table.setdefault((rank, p.chunk), {}).setdefault(p.kind, []).append(p.duration)
    return table


def measured_memory(deltas_by_rank):
    """Mean activation-memory change per (rank, chunk) and pass kind, from each rank's
    `Tracer.memory_deltas`: the simulator's `memory` table (means keep a micro-batch's F, B and
    W summing to what it really frees)."""
    return _means(((rank, chunk), kind, delta) for rank, deltas in enumerate(deltas_by_rank)
                  for chunk, kind, delta in deltas)


def _means(entries):
    """{(rank, chunk): {kind: mean value}} of (key, kind, value) entries."""
    table = {}
    for key, kind, value in entries:
        table.setdefault(key, {}).setdefault(kind, []).append(value)
    return {key: {kind: sum(v) / len(v) for kind, v in kinds.items()} for key, kinds in table.items()}


_DATA_P2P = {'SendActivation': (True, 'activation'), 'RecvActivation': (False, 'activation'),
             'SendGrad': (True, 'gradient'), 'RecvGrad': (False, 'gradient')}  # traced name: (is_send, kind)


def stream_messages(schedule, stages, micro_batches, placement=None):
    """Each rank's data sends and receives of one iteration, in stream order, with their peer ranks: what
    `paired_messages` pairs a traced run's records by (`simulate(...).messages`, at unit costs)."""
    return simulate(schedule, stages, micro_batches, placement=placement, iterations=1).messages


def paired_messages(p2p_by_rank, messages=None):
    """[(send record, receive record)] of each data message of a traced run, from its ranks' p2p records
    ((name, start, end, iteration)). A receive is paired with its send by its peer: `messages` gives each
    rank's peers, per rank the data sends and receives of one iteration in stream order as the simulator
    runs them (`simulate(...).messages`); then the n-th send on a channel (from, to, kind, iteration) is
    the n-th receive. Without `messages`, a 2-rank run pairs with the other rank, and other rank counts
    give no pairs. An iteration whose records are not the simulated stream (cut off) is left out."""
    if messages is None and len(p2p_by_rank) != 2:
        return []
    channels = {}  # (from, to, kind, iteration) -> ([send records], [receive records]) in order
    for rank, events in enumerate(p2p_by_rank):
        by_iteration = {}
        for e in events:
            if e[0] in _DATA_P2P:
                by_iteration.setdefault(e[3], []).append(e)
        for it, records in by_iteration.items():
            expected = messages[rank] if messages is not None else [(*_DATA_P2P[e[0]], 1 - rank) for e in records]
            if [_DATA_P2P[e[0]] for e in records] != [m[:2] for m in expected]:
                continue
            for e, (is_send, kind, peer) in zip(records, expected):
                key = (rank, peer, kind, it) if is_send else (peer, rank, kind, it)
                channels.setdefault(key, ([], []))[0 if is_send else 1].append(e)
    return [pair for sent, received in channels.values() for pair in zip(sent, received)]


def _median(values):
    return statistics.median(values) if values else 0.0


def p2p_cpu_samples(p2p_by_rank, messages=None, latency=0.0):
    """([send], [receive]) seconds each data send / receive instruction took on its own rank, from the traced p2p
    records of a run of engines with asynchronous sends: every send (posting it), and every receive whose data had
    arrived before the receive began (so it did not wait: taking the data in), that is one that began at least
    `latency` (the link's one-way time for a message) after its send ended. Over a slow link a message sent before
    its receive began is still crossing it (128 KiB at 50 Mbit/s: 21 ms): counting those as taking the data in put
    up to 5 ms in each receive, where the run's own took 0.3. Receives are paired with their sends by
    `paired_messages`; with no pairs (more than 2 ranks and no `messages`), nothing."""
    pairs = paired_messages(p2p_by_rank, messages)
    if not pairs:
        return [], []
    sends = [end - start for events in p2p_by_rank for name, start, end, _ in events if name.startswith('Send')]
    return sends, [r[2] - r[1] for s, r in pairs if s[2] + latency <= r[1]]


def measured_p2p_cpu(p2p_by_rank, messages=None, latency=0.0):
    """(send, receive): the medians of `p2p_cpu_samples` (0 where it has none)."""
    sends, receives = p2p_cpu_samples(p2p_by_rank, messages, latency)
    return _median(sends), _median(receives)


def held_messages(p2p_by_rank, messages=None, bar=0.0, slack=0.001):
    """[(send record, receive record, seconds held)] of the data messages a receiver waited for past the time its
    link explains: `bar` after the send ended (with the longest a message can take on its link, its own crossing
    and one queued ahead of it). Seconds held: from the later of the bar and the receive's start to the receive's
    end; listed where more than `slack` (a receive's own time to take its data in is a fraction of a millisecond).
    These are messages held up by something the simulator does not model: across two emulated nodes, unthrottled
    too, a few messages of the schedules that keep several in flight on a link took 40-100 ms where the link takes
    under 1 (AMD EPYC, 2 cores, 2026-12-07)."""
    held = [(s, r, r[2] - max(r[1], s[2] + bar)) for s, r in paired_messages(p2p_by_rank, messages)]
    return [h for h in held if h[2] > slack]


def measured_latency(p2p_by_rank, messages=None, recv_cpu=0.0):
    """A message's latency as the run had it (ranks sharing cores wait for one to take a message in): the
    median, over receives that began before their data was sent (so they waited for it), of the time from
    the send's end to the receive's end, less `recv_cpu` (the simulator adds it to every receive); None
    with no such receive. Beside a ping-pong's latency, measured with every other rank idle."""
    waited = [r[2] - s[2] for s, r in paired_messages(p2p_by_rank, messages) if r[1] < s[2]]
    return max(0.0, _median(waited) - recv_cpu) if waited else None


def measured_overheads(timeline, p2p_by_rank):
    """(a send's and a receive's own time, {rank: dispatch per pass}) a traced run measured: what `predict`
    takes besides the pass costs. Receives are paired with their sends by the traced schedule's own streams
    where the trace names a registered schedule (its meta), else by position."""
    meta, messages = timeline.meta, None
    if meta.get('schedule') in available_schedules() and 'stages' in meta and 'micro_batches' in meta:
        messages = stream_messages(meta['schedule'], meta['stages'], meta['micro_batches'])
    return measured_p2p_cpu(p2p_by_rank, messages), measured_dispatch(timeline, p2p_by_rank)


def measured_dispatch(timeline, p2p_by_rank):
    """{rank: seconds per pass} the rank spent between traced instructions (neither computing nor in
    a p2p instruction: the engine's instruction loop, loading micro-batches), per compute pass:
    the median over the traced steps."""
    out = {}
    for rank, (passes, p2p) in enumerate(zip(timeline.ranks, p2p_by_rank)):
        per_pass = []
        for step in {p.iteration for p in passes}:
            mine = [(p.start, p.end) for p in passes if p.iteration == step]
            spans = sorted(mine + [(start, end) for _, start, end, it in p2p if it == step])
            gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
            per_pass.append(gaps / len(mine))
        out[rank] = statistics.median(per_pass) if per_pass else 0.0
    return out


def predict(timeline, latency=0.0, p2p_cpu=(0.0, 0.0), dispatch=0.0):
    """The simulator's synchronised prediction of a traced run's schedule, from the costs it measured."""
    meta = timeline.meta
    return simulate(meta['schedule'], meta['stages'], meta['micro_batches'], costs=measured_costs(timeline),
                    latency=latency, p2p_cpu=p2p_cpu, dispatch=dispatch, iterations=1)
