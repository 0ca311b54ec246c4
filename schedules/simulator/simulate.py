"""Run every rank's DeepSpeed `PipeSchedule` instruction stream together, without a model.

The simulator instantiates the schedule class once per stage_id and consumes its steps(), so
there is no second description of any schedule. Each instruction becomes a few *effects*
(compute a pass, load data, send/receive a tensor, launch queued p2p) through a handler looked
up by the instruction's exact type, as DeepSpeed's engine does. Which chunk an instruction
touches and which rank it talks to depend on the engine, not the schedule: a `Placement`
answers that.

Communication follows the real engine on gloo: a send completes only once the peer has posted
the matching receive (rendezvous); messages between an ordered pair of ranks match first-in
first-out whatever their kind; engines with CommitP2P queue their sends/receives and post them
together at the CommitP2P (dist.batch_isend_irecv), which waits for all of them. A mismatch at
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
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import chain, count
from operator import itemgetter
from typing import Optional

import numpy as np
from deepspeed.runtime.pipe import schedule as ds

from schedules.errors import ScheduleError
from schedules.instructions import PASS_KIND, ForwardBackwardPass
from schedules.lowering import OrderedSchedule
from schedules.placement import Placement, StockPlacement
from schedules.registry import available_schedules
from schedules.simulator.timeline import Pass, Timeline

ACTIVATION, GRADIENT, META = 'activation', 'gradient', 'tensor-meta'


# ----------------------------------------------------------------------------------------------
# Effects: the vocabulary instruction handlers answer in.

@dataclass(frozen=True)
class Compute:
    """Run pass `kind` ('F', 'B', 'W' or 'BW') of `chunk` on the micro-batch held in `buffer`.

    A forward's micro-batch is recovered by counting forwards per (chunk, direction), a backward's
    from the forward that filled its buffer; pass `micro_batch` to override. `pair=True` on
    several computes of one instruction draws them as one unit. `memory` overrides the
    activation-memory delta (default: the simulation's memory table, see `simulate`).
    A 'W' without a buffer takes the oldest pending 'B' of its chunk.
    """
    kind: str
    chunk: int
    buffer: Optional[int] = None
    micro_batch: Optional[int] = None
    direction: Optional[int] = None
    pair: object = False  # True: paired with the other computes of this instruction (the simulator numbers it)
    memory: Optional[float] = None


@dataclass(frozen=True)
class Send:
    """Send the output activation (or the input gradient) held in `buffer` to the chunk downstream (upstream)."""
    kind: str  # ACTIVATION or GRADIENT
    chunk: int
    buffer: int
    direction: Optional[int] = None


@dataclass(frozen=True)
class Recv:
    """Receive an input activation (from upstream) or an output gradient (from downstream) into `buffer`."""
    kind: str
    chunk: int
    buffer: int
    direction: Optional[int] = None


@dataclass(frozen=True)
class Load:
    """Load a micro-batch (costs nothing): the first stage's forward needs it."""
    chunk: int
    buffer: int


@dataclass(frozen=True)
class StepWork:
    """The optimizer step's own time on its rank (`simulate(step_cost=...)`); no pass, no barrier."""


@dataclass(frozen=True)
class Commit:
    """Post every queued send/receive as one batch and wait for all of them."""


# ----------------------------------------------------------------------------------------------
# Instruction registry: exact type -> handler(instr, ctx) -> list of effects.

_HANDLERS = {}
_STRUCTURES = OrderedDict()  # (factory, placement, handlers, p, m, forward_only, validation) -> {runs: _Program}
_STRUCTURES_KEPT = 4_000_000  # nodes and passes kept (every schedule at p = 16, m = 64 many times over), the least
# recently used dropped first


@dataclass
class Context:
    """What a handler may ask about the rank running the instruction."""
    rank: int
    placement: 'Placement'
    chunk: int  # placement.chunk_of(rank, instr)


def register_instruction(instr_type, handler=None):
    """Teach the simulator an instruction type; usable as a decorator.

    The handler gets (instr, ctx) and returns a list of effects; it is found by the exact type
    of the instruction (subclasses are not matched, as in DeepSpeed's _INSTRUCTION_MAP).
    A Placement may override a type for its engine in its `handlers` dict.
    """
    if handler is None:
        return lambda h: register_instruction(instr_type, h) or h
    _HANDLERS[instr_type] = handler
    _STRUCTURES.clear()  # made with the handler it replaces
    return handler


register_instruction(ds.LoadMicroBatch, lambda i, c: [Load(c.chunk, i.buffer_id)])
for _t, _kind in PASS_KIND.items():
    register_instruction(_t, lambda i, c, kind=_kind: [Compute(kind, c.chunk, i.buffer_id)])
register_instruction(ForwardBackwardPass, lambda i, c: [Compute(kind, chunk, buf, pair=True) for kind, chunk, buf in
                                                        zip(i.kinds(), (i.fwd_chunk, i.bwd_chunk),
                                                            (i.fwd_buffer, i.bwd_buffer))])
register_instruction(ds.SendActivation, lambda i, c: [Send(ACTIVATION, c.chunk, i.buffer_id)])
register_instruction(ds.RecvActivation, lambda i, c: [Recv(ACTIVATION, c.chunk, i.buffer_id)])
register_instruction(ds.SendGrad, lambda i, c: [Send(GRADIENT, c.chunk, i.buffer_id)])
register_instruction(ds.RecvGrad, lambda i, c: [Recv(GRADIENT, c.chunk, i.buffer_id)])
register_instruction(ds.CommitP2P, lambda i, c: [Commit()])
for _t in (ds.ReduceGrads, ds.ReduceTiedGrads):  # no barrier, no cost here
    register_instruction(_t, lambda i, c: [])
register_instruction(ds.OptimizerStep, lambda i, c: [StepWork()])  # its time: step_cost (default none)


# ----------------------------------------------------------------------------------------------
# Streams, compiled: each instruction's effects worked out once per rank.
#
# A rank's stream becomes a list of entries (step, instruction, effects, paired), each effect a tuple whose first
# item says what it is (_COMPUTE, _P2P, ...), followed by what the rank and the placement fix beforehand (the
# chunk's stage and neighbours, the peer rank, the channel), so that the simulation only keeps state and times.
# The streams of a schedule that DeepSpeed or schedules/lowering.py builds depend on (schedule, p, m, stage_id)
# alone: those are compiled once and shared by every run of the stream (the iterations). Any other factory is
# called once per run and its stream pulled as the rank reaches it.

_COMPUTE, _P2P, _LOAD, _STEP, _COMMIT, _OTHER, _RAISE = range(7)
_PAIRED = object()  # a compute paired with the others of its instruction, numbered when the rank reaches it


def _compute_effect(rank, placement, kind, chunk, buffer, micro_batch=None, direction=None, pair=None, memory=None):
    up = placement.neighbour(rank, chunk, -1, direction)
    down = placement.neighbour(rank, chunk, +1, direction)
    return (_COMPUTE, kind, chunk, None if buffer is None else (chunk, buffer), micro_batch, direction, pair, memory,
            placement.chunk_size(rank, chunk), placement.stage(rank, chunk), up, down, (chunk, kind),
            (chunk, direction),
            # 14-17: the upstream chunk on another rank, the upstream chunk on this rank (or None); the same downstream
            up is not None and up[0] != rank, up[1] if up is not None and up[0] == rank else None,
            down is not None and down[0] != rank, down[1] if down is not None and down[0] == rank else None)


def _p2p_effect(rank, placement, is_send, kind, chunk, buffer, direction=None):
    # activations travel downstream, gradients upstream
    peer = placement.neighbour(rank, chunk, +1 if (kind == ACTIVATION) == is_send else -1, direction)
    here = placement.stage(rank, chunk)
    if peer is None or peer[0] == rank:
        where = 'no such stage' if peer is None else 'it is on this rank'
        return (_RAISE, f'{kind} {"send" if is_send else "receive"} of stage {here} has no peer rank ({where})')
    there = placement.stage(*peer)
    src, dst = (here, there) if is_send else (there, here)
    channel = (rank, peer[0]) if is_send else (peer[0], rank)
    if placement.channels_by_kind:  # the shape message goes first on the activations' channel
        channel += (GRADIENT if kind == GRADIENT else ACTIVATION, )
    return (_P2P, is_send, kind, chunk, (chunk, buffer), direction, peer[0], src, dst, channel, (is_send, chunk),
            buffer, (chunk, direction, 'recv'))


def _compile_effect(e, rank, placement):
    if isinstance(e, Compute):
        pair = None if e.pair is False else (_PAIRED if e.pair is True else e.pair)
        return _compute_effect(rank, placement, e.kind, e.chunk, e.buffer, e.micro_batch, e.direction, pair, e.memory)
    if isinstance(e, Load):
        return (_LOAD, (e.chunk, e.buffer))
    if isinstance(e, (Send, Recv)):
        return _p2p_effect(rank, placement, isinstance(e, Send), e.kind, e.chunk, e.buffer, e.direction)
    if isinstance(e, StepWork):
        return (_STEP, )
    if isinstance(e, Commit):
        return (_COMMIT, )
    return (_OTHER, e)


class _Compiler:
    """Compiles one rank's instructions. The instruction types whose handler is still the one this module
    registers are compiled directly (what their handler's effects would compile to, memoised per chunk);
    any other goes through its handler."""

    def __init__(self, placement, rank):
        self.placement, self.rank = placement, rank
        self.memo = {}
        self.chunk_of = None if type(placement).chunk_of is not Placement.chunk_of else True
        # the types compiled directly here: those whose handler is still this module's, the chunk from the kwargs
        self.direct = {t: fast for t, fast in _FAST.items()
                       if self.chunk_of and (placement.handlers.get(t) or _HANDLERS.get(t)) is _BUILT_IN.get(t)}

    def compile(self, step, instr):
        """The entry of one instruction: (step, instr, effects, paired). A handler's error is raised when the rank
        reaches the instruction, as the engine would."""
        t = type(instr)
        fast = self.direct.get(t)
        if fast is not None:
            kw = instr.kwargs
            try:
                return step, instr, fast(self, instr, kw.get('chunk', kw.get('phase', 0))), t is ForwardBackwardPass
            except Exception as error:  # noqa: BLE001 -- as below
                return step, instr, ((_RAISE, error), ), False
        pl = self.placement
        handler = pl.handlers.get(t) or _HANDLERS.get(t)
        if handler is None:
            return step, instr, ((_RAISE, f'the simulator does not understand {t.__name__} '
                                          f'(teach it with register_instruction)'), ), False
        try:
            if self.chunk_of:
                kw = instr.kwargs
                chunk = kw.get('chunk', kw.get('phase', 0))
            else:
                chunk = pl.chunk_of(self.rank, instr)
            fast = _FAST.get(t) if handler is _BUILT_IN.get(t) else None
            if fast is not None:
                return step, instr, fast(self, instr, chunk), t is ForwardBackwardPass
            effects = list(handler(instr, Context(self.rank, pl, chunk)))
        except Exception as error:  # noqa: BLE001 -- raised again where the rank reaches the instruction
            return step, instr, ((_RAISE, error), ), False
        paired = any(isinstance(e, Compute) and e.pair is True for e in effects)
        return step, instr, tuple(_compile_effect(e, self.rank, pl) for e in effects), paired

    def compute(self, kind, chunk, buffer, pair=None):
        key = (kind, chunk, pair)
        head = self.memo.get(key)
        if head is None:
            head = self.memo[key] = _compute_effect(self.rank, self.placement, kind, chunk, None, pair=pair)
        return head[:3] + (None if buffer is None else (chunk, buffer), ) + head[4:]

    def p2p(self, is_send, kind, chunk, buffer):
        key = (is_send, kind, chunk)
        head = self.memo.get(key)
        if head is None:
            head = self.memo[key] = _p2p_effect(self.rank, self.placement, is_send, kind, chunk, None)
        if head[0] is _RAISE:
            return head
        return head[:4] + ((chunk, buffer), ) + head[5:11] + (buffer, ) + head[12:]


_FAST = {
    ds.LoadMicroBatch: lambda c, i, chunk: ((_LOAD, (chunk, i.buffer_id)), ),
    ForwardBackwardPass: lambda c, i, chunk: tuple(
        c.compute(kind, ch, buf, _PAIRED)
        for kind, ch, buf in zip(i.kinds(), (i.fwd_chunk, i.bwd_chunk), (i.fwd_buffer, i.bwd_buffer))),
    ds.SendActivation: lambda c, i, chunk: (c.p2p(True, ACTIVATION, chunk, i.buffer_id), ),
    ds.RecvActivation: lambda c, i, chunk: (c.p2p(False, ACTIVATION, chunk, i.buffer_id), ),
    ds.SendGrad: lambda c, i, chunk: (c.p2p(True, GRADIENT, chunk, i.buffer_id), ),
    ds.RecvGrad: lambda c, i, chunk: (c.p2p(False, GRADIENT, chunk, i.buffer_id), ),
    ds.CommitP2P: lambda c, i, chunk: ((_COMMIT, ), ),
    ds.ReduceGrads: lambda c, i, chunk: (),
    ds.ReduceTiedGrads: lambda c, i, chunk: (),
    ds.OptimizerStep: lambda c, i, chunk: ((_STEP, ), ),
}
for _t, _kind in PASS_KIND.items():
    _FAST[_t] = lambda c, i, chunk, kind=_kind: (c.compute(kind, chunk, i.buffer_id), )
_BUILT_IN = dict(_HANDLERS)  # the handlers registered above: their instructions compile directly


def _lazy(placement, rank, sched):
    compiler = _Compiler(placement, rank)
    for step, cmds in enumerate(sched.steps()):
        for instr in cmds:
            yield compiler.compile(step, instr)


def _replayable(factory):
    """Whether the streams `factory` builds are a function of (micro_batches, stages, stage_id) alone, so that
    one compiled copy serves every run and every simulation: DeepSpeed's TrainSchedule and DualPipeVSchedule,
    and the OrderedSchedule classes whose lowering is the base's (every registered schedule)."""
    if factory is ds.TrainSchedule or factory is ds.DualPipeVSchedule:
        return True
    return (isinstance(factory, type) and issubclass(factory, OrderedSchedule)
            and all(getattr(factory, name) is getattr(OrderedSchedule, name) for name in _LOWERING))


_LOWERING = ('__init__', 'steps', '_lower', '_before', '_after', '_instr', '_remote', '_at_end', '_neighbour',
             '_check_order')


def _program_key(factory, placement, stages, micro_batches):
    return factory, type(placement), tuple(placement.handlers.items()), stages, micro_batches


def _programs(placement, stages, first):
    """Every rank's compiled stream, from `first` (the schedule objects). (What a simulation of them makes is kept,
    _STRUCTURES, not the streams.)"""
    programs = []
    for r in range(stages):
        compile_ = _Compiler(placement, r).compile
        programs.append([compile_(step, instr) for step, cmds in enumerate(first[r].steps()) for instr in cmds])
    return programs


# ----------------------------------------------------------------------------------------------
# The simulation's pieces.

def _unit_cost(kind, size):
    return size * {'F': 1, 'B': 1, 'W': 1, 'BW': 2}[kind]


def _describe(msg):
    kind, src, dst, direction, it, mb = msg
    what = f'{kind} of stage {src}->{dst}'
    if mb is not None:
        what += f' for micro-batch {mb}' + (f' (iteration {it})' if it else '')
    return what + ('' if direction is None else f' direction {direction}')


def _at(where):
    rank, it, step, instr = where
    return f'rank {rank} (iteration {it}, step {step}: {instr!r})'


# A posted (or queued) point-to-point operation is a list: [rank, peer, is_send, msg, where (rank, iteration,
# step, instruction), channel, posted, done, match, buffer, owner]; `match` says what a receive does to its
# buffer when it matches (1: an input activation, 2: an output gradient, 0: nothing), `owner` is its _Rank.
_PEER, _IS_SEND, _MSG, _WHERE, _CHANNEL, _POSTED, _DONE, _MATCH, _BUF, _OWNER = range(1, 11)


def _op_describe(op):
    verb = f'send {_describe(op[_MSG])} to' if op[_IS_SEND] else f'receive {_describe(op[_MSG])} from'
    return f'{verb} rank {op[_PEER]}'


class _Buffer:
    """What the engine's pipe buffer holds, as far as ordering checks need."""
    __slots__ = ('loaded', 'inp', 'out', 'act', 'b_done', 'grad', 'bwd')

    def __init__(self):
        self.loaded = False  # a LoadMicroBatch filled it
        self.inp = None  # micro-batch of a received, not yet consumed input activation
        self.out = None  # micro-batch whose output activation it holds (until its backward)
        self.act = None  # micro-batch whose activations are live (F done, W/BW not yet)
        self.b_done = False  # input-gradient pass done, weight pass pending
        self.grad = None  # micro-batch of a received output gradient
        self.bwd = None  # micro-batch whose input gradient is ready to send


class _Rank:
    __slots__ = ('rank', 'programs', 'run', 'runs', 'prog', 'pos', 'source', 'source_of', 'it', 'step', 'instr',
                 'effects', 'epos', 'pair', 'clock', 'waiting', 'queued', 'finished', 'buffers', 'counts', 'forwards',
                 'backwards', 'pending_w', 'meta_done', 'grad_slot', 'in_flight', 'messages', 'validated_through',
                 'wpos', 'wclock', 'count', 'constants')

    def __init__(self, rank, runs, program, source_of=None):
        self.rank = rank
        self.runs = runs  # runs of the stream
        self.programs = program  # the compiled stream of one run (shared by all), or None: `source_of(run)` per run
        self.source_of = source_of  # run -> iterator of its compiled entries, pulled as the rank reaches them
        self.source = None
        self.run, self.prog, self.pos = -1, (), 0  # entries of run `run`, the next one at `pos`
        self.it = None  # the run of the instruction being executed (None before the first)
        self.step = self.instr = None
        self.effects, self.epos = (), 0  # its effects, the next one at `epos`
        self.pair = None  # the pair id of its paired computes
        self.clock = rank  # the node of its time: at first its clock when the program starts
        self.waiting, self.queued = (), []
        self.wpos, self.wclock = 0, None  # the ops of `waiting` before wpos are done, the latest ending at wclock
        self.count = 0  # instructions of the runs it has finished
        self.finished = False
        self.buffers = {}
        self.counts = {}  # (chunk, direction, 'F' or 'recv') -> passes of the current run so far
        self.forwards, self.backwards = set(), set()  # (chunk, direction, micro-batch) of the current run
        self.pending_w = []  # (chunk, buffer) in B order
        self.meta_done = set()  # (is_send, chunk) once the activation shapes went through
        self.grad_slot = None  # stock engine: gradient received but not yet used
        self.in_flight = []  # asynchronous sends not yet known to be complete
        self.messages = []  # (iteration, is_send, kind, peer rank) of each data send / receive, in stream order
        self.validated_through = -1  # post-validation: the last iteration whose norm this rank waited for

    def peek(self):
        """(run, entry) of the next instruction, or None at the end of the last run; moves on to the next run
        (building its stream) when this one is done."""
        while self.pos >= len(self.prog):
            if self.source is not None:
                entry = next(self.source, None)
                if entry is not None:
                    self.prog.append(entry)
                    break
            if self.run + 1 >= self.runs:
                return None
            self.count += len(self.prog)
            self.run, self.pos = self.run + 1, 0
            if self.programs is not None:
                self.prog = self.programs
            else:
                self.prog, self.source = [], self.source_of(self.run)
        return self.run, self.prog[self.pos]

    def at(self):
        return _at((self.rank, self.it, self.step, self.instr))


# ----------------------------------------------------------------------------------------------
# The simulation: a schedule's structure, then its timing.
#
# What the streams alone decide (every check, which send meets which receive, what each rank waits for) does not
# depend on the costs. `_Simulation` works it out by running the streams together and writes it down as a
# program of timing nodes: node i's time is max(t[A[i]], t[B[i]]) + params[K[i]], nodes 0 .. p-1 being the
# ranks' clocks when the program starts, the params a call's costs (a pass's cost, the latency, a send's or
# receive's own time, dispatch, the optimizer step, a rollback). `_replay` then gives every node its time. The
# structure of a registered schedule is kept (_STRUCTURES) for the next call at other costs; the chained
# iterations replay one iteration's program (`_steady`) instead of running the streams again.

_ZERO, _LATENCY, _SEND_CPU, _RECV_CPU, _WAIT = range(5)  # param slots; _WAIT + rank: 0.0, a rank waiting


def _slots(ranks, runs):
    """First param slot of each per-rank block: dispatch, step before / after the norm, rollback (one block per
    run of the program), and of the passes' costs (one slot per pass)."""
    dispatch = _WAIT + ranks
    return dispatch, dispatch + ranks, dispatch + 2 * ranks, dispatch + 3 * ranks, dispatch + (3 + runs) * ranks


class _Program:
    """The structure of `runs` runs of every rank's stream, as timing nodes (see above).

    passes: (rank, kind, stage, chunk, micro-batch, direction, pair, paired, run, start node, end node, chunk size,
    memory override) in the order the simulation ran them (each rank's in its order); `paired`: its pair is the
    simulation's number of its instruction, renumbered when runs are replayed. ends: each rank's clock at the end;
    iteration_end, validation: (run, rank, node[, clock node]); fetch: (clock node, run) of each paired instruction
    when its rank reached it, in that order; meta_waits: the nodes where a rank waited for a tensor-shape message;
    folds: the waits for an op posted just before (never later than the op's end while no cost is below zero);
    clean: the streams could run again from the state they ended in and do the same (see `_steady`)."""
    __slots__ = ('ranks', 'runs', 'A', 'B', 'K', 'passes', 'ends', 'iteration_end', 'validation', 'fetch',
                 'meta_waits', 'folds', 'messages', 'instructions', 'clean', 'keys', 'key_of', 'rank_of', 'starts',
                 'stops', 'later', 'variants')

    def __init__(self, ranks, runs):
        self.ranks, self.runs = ranks, runs
        self.A = self.B = self.K = None  # numpy arrays, one item per node after the ranks' first clocks
        self.passes, self.ends, self.iteration_end, self.validation = [], [], [], []
        self.fetch, self.meta_waits, self.folds = [], [], []
        self.messages, self.instructions, self.clean = None, 0, False
        self.keys = None  # the distinct (rank, chunk, kind, size) of its passes
        self.key_of = self.rank_of = self.starts = self.stops = None  # per pass: its key's index, rank, nodes
        self.later = None  # the program of a later run (`_steady`), once asked for
        self.variants = {}  # what its timings reuse: _Variants (by the params known 0.0), pair numbers

    def finish(self, nodes):
        table = np.fromiter(chain.from_iterable(nodes), dtype=np.int64, count=3 * len(nodes)).reshape(-1, 3)
        self.A, self.B, self.K = (np.ascontiguousarray(table[:, i]) for i in range(3))
        index, n = {}, len(self.passes)
        keys = list(map(itemgetter(0, 3, 1), self.passes))  # (rank, chunk, kind)
        self.key_of = np.fromiter(map(index.setdefault, keys, count()), dtype=np.int64, count=n)
        self.key_of = np.unique(self.key_of, return_inverse=True)[1]  # numbered in order of first use
        sizes = dict(zip(keys, map(itemgetter(11), self.passes)))
        self.keys = [(rank, chunk, kind, sizes[rank, chunk, kind]) for rank, chunk, kind in index]
        self.rank_of = np.fromiter(map(itemgetter(0), self.passes), dtype=np.int64, count=n)
        self.starts = np.fromiter(map(itemgetter(9), self.passes), dtype=np.int64, count=n)
        self.stops = np.fromiter(map(itemgetter(10), self.passes), dtype=np.int64, count=n)
        return self

    def size(self):
        return len(self.A) * (1 + len(self.variants)) + 4 * len(self.passes)


class _Simulation:
    """Every rank's stream run together for `runs` runs: the checks, the matching, and the `_Program` of timing
    nodes they make (`self.program`)."""

    def __init__(self, factory, placement, ranks, micro_batches, runs, forward_only, validation=None, messages=True):
        if validation not in VALIDATIONS:
            raise ValueError(f"validation {validation!r}: choose from {', '.join(map(str, VALIDATIONS))}")
        self.validation = validation
        self.norm_started = {}  # run -> {rank: node where it reached its OptimizerStep (started the norm)}
        self.arrived = {}  # run -> node where the model's norm is known
        self.placement, self.forward_only = placement, forward_only
        self.record_messages = messages  # whether the ranks list their sends and receives (`SimResult.messages`)
        self.p = ranks
        self.dispatch_slot, self.before_slot, self.after_slot, self.rollback_slot, self.cost_slot = \
            _slots(ranks, runs)
        self.program = _Program(ranks, runs)
        self.nodes = []  # (a, b, k) of node p + i
        if _replayable(factory):
            # Build every rank's schedule up front so a constraint violation (ValueError) surfaces first.
            first = [factory(micro_batches=micro_batches, stages=ranks, stage_id=r) for r in range(ranks)]
            programs = _programs(placement, ranks, first)
            self.ranks = [_Rank(r, runs, programs[r]) for r in range(ranks)]
        else:
            first = [factory(micro_batches=micro_batches, stages=ranks, stage_id=r) for r in range(ranks)]

            def source_of(r):  # a rank's runs: its first schedule object, then a new one per run, as before
                return lambda run: _lazy(placement, r, first[r] if run == 0 else factory(
                    micro_batches=micro_batches, stages=ranks, stage_id=r))
            self.ranks = [_Rank(r, runs, None, source_of(r)) for r in range(ranks)]
        self.channels = {}  # (src, dst[, kind]) -> (deque of sends, deque of receives), in posting order
        self.next_pair = 0
        # what _advance reads on every call, in one tuple
        self.constants = (forward_only, placement.batched_p2p, placement.async_sends, placement.tensor_meta,
                          placement.single_grad_slot, self.channels, messages, self.nodes, ranks - 1,
                          self.program.passes, self.cost_slot, self.program.fetch, self.program.meta_waits,
                          self.program.folds)
        for rk in self.ranks:
            rk.constants = (rk.rank, rk.buffers, rk.messages, rk.pending_w, rk.meta_done, _WAIT + rk.rank,
                            self.dispatch_slot + rk.rank)

    def _node(self, a, b, k):
        self.nodes.append((a, b, k))
        return len(self.nodes) + self.p - 1

    # -- driving ------------------------------------------------------------------------------
    def run(self):
        # Matching depends only on each rank's posting order, never on which rank runs first, so
        # sweeping the ranks until none moves gives the same answer as an event queue.
        progress = True
        advance = self._advance
        while progress:
            progress = False
            for rank in self.ranks:
                waiting = rank.waiting
                if waiting and waiting[rank.wpos][_DONE] is None:
                    continue  # still waiting: it would not move
                if advance(rank):
                    progress = True
        if not all(r.finished for r in self.ranks):
            raise ScheduleError(self._stuck_report())
        self._final_checks()
        prog = self.program
        prog.ends = [rk.clock for rk in self.ranks]
        prog.instructions = sum(rk.count for rk in self.ranks)
        if self.record_messages:
            prog.messages = [[m[1:] for m in rk.messages] for rk in self.ranks]
        prog.clean = all(self._clean(rk) for rk in self.ranks)
        for rk in self.ranks:  # its ops name their rank: no cycle left for the collector
            rk.waiting, rk.in_flight, rk.queued, rk.source = (), [], [], None
        self.channels.clear()
        return prog.finish(self.nodes)

    def _clean(self, rk):
        """Whether the rank's state at the end holds nothing that a next run of its stream could read before
        writing it (the received input, the live activations, a B awaiting its W, the one received gradient): then
        the run again does the same, without its tensor-shape messages (sent once per chunk)."""
        if rk.pending_w or rk.queued or rk.in_flight or (self.placement.single_grad_slot and rk.grad_slot is not None):
            return False
        return all(b.inp is None and b.act is None and not b.b_done for b in rk.buffers.values())

    def _advance(self, rk):
        """Run rank `rk` until it waits for a message (or the norm) or its stream ends; whether it moved.

        The hot path: the instructions of a run and their usual effects, with the rank's state in local variables
        (written back before anything else reads it). Whatever is unusual (the first instruction of a run, the end of
        the stream, a tensor-shape message, a check that fails, any other effect) goes through the methods below,
        which do the same with every check and error message. `clock` is the node of the rank's time."""
        if rk.finished:
            return False
        moved = False
        (forward_only, batched, async_sends, tensor_meta, single_slot, channels, record, nodes, off, passes, cost_slot,
         fetch, meta_waits, folds) = self.constants
        rank, buffers, messages, pending_w, meta_done, wait_slot, dispatch_slot = rk.constants
        node = nodes.append
        clock = rk.clock
        counts, forwards, backwards, in_flight = rk.counts, rk.forwards, rk.backwards, rk.in_flight
        effects, epos, prog, pos, it, run = rk.effects, rk.epos, rk.prog, rk.pos, rk.it, rk.run
        step, instr, pair_id = rk.step, rk.instr, rk.pair
        while True:
            waiting = rk.waiting
            if waiting:
                # it goes on once every op it waits for is done, at the latest of their ends; the ops found done
                # are not looked at again (at a batch's end it waits for every asynchronous send of the batch)
                if len(waiting) == 1:
                    w = waiting[0]
                    done = w[_DONE]
                    if done is None:
                        rk.clock, rk.epos, rk.pos = clock, epos, pos
                        rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                        return moved
                    node((clock, done, wait_slot))
                    if clock == w[_POSTED]:  # waited for at once: it cannot end before its op
                        folds.append(len(nodes) - 1)
                    clock = len(nodes) + off
                    if w[_MSG][0] is META:
                        meta_waits.append(clock)
                    rk.waiting = ()
                    waiting = ()
            if waiting:
                latest = rk.wclock if rk.wpos else clock
                for i in range(rk.wpos, len(waiting)):
                    w = waiting[i]
                    done = w[_DONE]
                    if done is None:
                        rk.wpos, rk.wclock = i, latest
                        rk.clock, rk.epos, rk.pos = clock, epos, pos
                        rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                        return moved
                    node((latest, done, wait_slot))
                    if latest == w[_POSTED]:
                        folds.append(len(nodes) - 1)
                    latest = len(nodes) + off
                    if w[_MSG][0] is META:
                        meta_waits.append(latest)
                clock = latest
                rk.waiting, rk.wpos = (), 0
            if epos >= len(effects):  # the instruction is done: the next one
                if pos < len(prog) and it == run:  # within the run
                    step, instr, effects, paired = prog[pos]
                    pos += 1
                    epos = 0
                    if paired:
                        self.next_pair += 1  # the paired computes of this instruction share one id
                        pair_id = self.next_pair
                        fetch.append((clock, it))
                    if not effects:
                        continue
                else:
                    rk.clock, rk.epos, rk.pos = clock, epos, pos
                    rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                    done = self._next_instruction(rk)
                    clock, effects, epos, prog, pos = rk.clock, rk.effects, rk.epos, rk.prog, rk.pos
                    it, run, step, instr, pair_id = rk.it, rk.run, rk.step, rk.instr, rk.pair
                    counts, forwards, backwards, in_flight = rk.counts, rk.forwards, rk.backwards, rk.in_flight
                    if done is not None:
                        return done or moved
                    continue
            e = effects[epos]
            epos += 1
            moved = True
            op = e[0]
            if op is _COMPUTE:
                kind, chunk, bkey, mb, direction = e[1], e[2], e[3], e[4], e[5]
                if bkey is not None:
                    buf = buffers.get(bkey)
                    if buf is None:
                        buf = buffers[bkey] = _Buffer()
                    usual = True
                else:
                    usual = False
                if usual:
                    if kind == 'F':
                        n = counts.get(e[13], 0)
                        if mb is None:
                            mb = n
                        up_local = e[15]
                        usual = buf.act is None and (
                            buf.loaded if e[10] is None else
                            buf.inp == (it, mb) if e[14] else (up_local, direction, mb) in forwards)
                        if usual:
                            counts[e[13]] = n + 1
                            buf.loaded, buf.inp, buf.out = False, None, (it, mb)
                            if not forward_only:  # without autograd nothing is kept for a backward
                                buf.act = buf.out
                            forwards.add((chunk, direction, mb))
                    elif forward_only:
                        usual = False
                    elif kind == 'W':
                        usual = bkey in pending_w
                        if usual:
                            pending_w.remove(bkey)
                            if mb is None:
                                mb = buf.act[1]
                            buf.act, buf.b_done = None, False
                    elif kind == 'B' or kind == 'BW':
                        act = buf.act
                        usual = act is not None and not buf.b_done
                        if usual:
                            if mb is None:
                                mb = act[1]
                            if e[16]:  # downstream on another rank
                                usual = buf.grad == act
                            elif e[17] is not None:  # downstream on this rank
                                usual = (e[17], direction, mb) in backwards
                        if usual:
                            if e[16] and single_slot:
                                rk.grad_slot = None
                            backwards.add((chunk, direction, mb))
                            buf.grad, buf.out, buf.bwd = None, None, (it, mb)
                            if kind == 'BW':
                                buf.act = None
                            else:
                                buf.b_done = True
                                pending_w.append(bkey)
                    else:
                        usual = False
                if not usual:  # the full method: it creates the buffer, checks everything and raises
                    rk.clock, rk.epos, rk.pos = clock, epos, pos
                    rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                    self._compute(rk, e)
                    clock = rk.clock
                    continue
                node((clock, clock, dispatch_slot))
                start = len(nodes) + off
                node((start, start, cost_slot + len(passes)))
                clock = start + 1
                pair = e[6]
                passes.append((rank, kind, e[9], chunk, mb, direction, pair_id if pair is _PAIRED else pair,
                               pair is _PAIRED, it, start, clock, e[8], e[7]))
            elif op is _P2P:
                is_send, kind, bkey = e[1], e[2], e[4]
                buf = buffers.get(bkey)
                if buf is None:
                    buf = buffers[bkey] = _Buffer()
                match = 0
                if kind == ACTIVATION:
                    if tensor_meta and e[10] not in meta_done:
                        buf = None  # the shapes first: the method
                    else:
                        if is_send:
                            mb = buf.out
                            if mb is None:
                                buf = None
                        else:
                            n = counts.get(e[12], 0)
                            mb = (it, n)
                            counts[e[12]] = n + 1
                            match = 1
                else:
                    if is_send:
                        mb = buf.bwd
                        if mb is None:
                            buf = None
                        else:
                            buf.bwd = None
                    else:
                        mb = buf.out
                        if mb is None:
                            buf = None
                        match = 2
                if buf is None:  # the full method: the shapes, or an error
                    rk.clock, rk.epos, rk.pos = clock, epos, pos
                    rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                    self._p2p(rk, e)
                    clock, epos = rk.clock, rk.epos
                    continue
                peer = e[6]
                new = [rank, peer, is_send, (kind, e[7], e[8], e[5], mb[0], mb[1]), (rank, it, step, instr), e[9],
                       None, None, match, buf, rk]
                if record:
                    messages.append((it, is_send, kind, peer))
                if is_send:
                    node((clock, clock, _SEND_CPU))
                    clock = len(nodes) + off
                if batched:
                    rk.queued.append(new)
                    continue
                # post it (as _post)
                new[_POSTED] = clock
                queues = channels.get(e[9])
                if queues is None:
                    queues = channels[e[9]] = (deque(), deque())
                if is_send:
                    if async_sends:
                        in_flight.append(new)
                    else:
                        rk.waiting = [new]
                    if not queues[1]:
                        queues[0].append(new)
                        continue
                    s, r = new, queues[1].popleft()
                else:
                    rk.waiting = [new]
                    if not queues[0]:
                        queues[1].append(new)
                        continue
                    s, r = queues[0].popleft(), new
                if s[_MSG] != r[_MSG]:
                    self._protocol_error(s, r)
                node((s[_POSTED], r[_POSTED], _LATENCY))
                done = s[_DONE] = len(nodes) + off
                node((done, done, _RECV_CPU))
                r[_DONE] = done + 1
                if r[_MATCH]:
                    self._matched(r)
            else:
                rk.clock, rk.epos, rk.pos = clock, epos, pos
                rk.effects, rk.step, rk.instr, rk.pair = effects, step, instr, pair_id
                self._apply(rk, e)
                clock = rk.clock
                in_flight = rk.in_flight

    def _next_instruction(self, rk):
        """At the end of an instruction, when the next is not one of the same run: the end of a run (a batch) and
        of the stream. None when the rank goes on, False when it waits for the norm, True when it finished."""
        nxt = rk.peek()
        it = rk.it
        if it is not None and (nxt is None or nxt[0] != it):
            if rk.in_flight:
                # an engine with asynchronous sends waits for them before its batch ends
                rk.waiting, rk.in_flight = rk.in_flight, []
                return None
            self.program.iteration_end.append((it, rk.rank, rk.clock))
            if self.validation and not self._validated(rk, it):
                # its next iteration (or, after its last, the end of the run) waits for the norm
                return False
        if nxt is None:
            if rk.queued:
                raise ScheduleError(f'{rk.at()} is the end of the stream of rank {rk.rank}, but its queued '
                                    f'p2p was never launched by a CommitP2P: '
                                    + '; '.join(_op_describe(op) for op in rk.queued))
            rk.finished = True
            rk.count += len(rk.prog)
            return True
        run, (step, instr, effects, paired) = nxt
        rk.pos += 1
        if run != it:  # a new run: its counts start again
            rk.counts, rk.forwards, rk.backwards = {}, set(), set()
        rk.it, rk.step, rk.instr, rk.effects, rk.epos = run, step, instr, effects, 0
        if paired:
            self.next_pair += 1
            rk.pair = self.next_pair
            self.program.fetch.append((rk.clock, run))
        return None

    def _apply(self, rk, e):
        op = e[0]
        if op is _LOAD:
            buf = rk.buffers.get(e[1])
            if buf is None:
                buf = rk.buffers[e[1]] = _Buffer()
            buf.loaded = True
        elif op is _STEP:  # its time (step_cost) before the norm is started and after; a rollback's in a replay
            r = rk.rank
            rk.clock = self._node(rk.clock, rk.clock, self.before_slot + r)
            self.norm_started.setdefault(rk.it, {}).setdefault(r, rk.clock)
            if self.validation != 'wait':  # (waiting, the rank steps once the norm is in: _validated)
                rk.clock = self._node(rk.clock, rk.clock, self.after_slot + r)
            rk.clock = self._node(rk.clock, rk.clock, self.rollback_slot + rk.it * self.p + r)
        elif op is _COMMIT:
            if not self.placement.batched_p2p:
                raise ScheduleError(f'{rk.at()}: {type(self.placement).__name__} has no CommitP2P '
                                    f'(its sends and receives are blocking)')
            for q in rk.queued:
                self._post(rk, q)
            rk.waiting, rk.queued = rk.queued, []
        elif op is _RAISE:
            if isinstance(e[1], Exception):
                raise e[1]
            raise ScheduleError(f'{rk.at()}: {e[1]}')
        else:
            raise ScheduleError(f'{rk.at()}: unknown effect {e[1]!r}')

    def _validated(self, rk, it):
        """Post-validation (`validation`): whether the model's norm of iteration `it` is known, every rank having
        started its part at its OptimizerStep; then the rank's clock moves to its arrival (an all-reduce: one
        latency after the last rank started it), and under 'wait' the rank takes its step only then."""
        started = self.norm_started.get(it, {})
        if len(started) < len(self.ranks):
            return False
        arrived = self.arrived.get(it)
        if arrived is None:  # max(started) + latency
            nodes = list(started.values())
            latest = nodes[0]
            for n in nodes[1:]:
                latest = self._node(latest, n, _ZERO)
            arrived = self.arrived[it] = self._node(latest, latest, _LATENCY)
        if rk.validated_through < it:
            rk.validated_through = it
            self.program.validation.append((it, rk.rank, arrived, rk.clock))  # its wait: max(0, arrived - clock)
            rk.clock = self._node(rk.clock, arrived, _WAIT + rk.rank)
            if self.validation == 'wait':
                rk.clock = self._node(rk.clock, rk.clock, self.after_slot + rk.rank)
        return True

    # -- compute and the ordering rules it checks ------------------------------------------------
    def _compute(self, rk, e):
        _, kind, chunk, bkey, mb, direction, pair, memory, size, stage, up, down, ck, fkey = e[:14]
        it = rk.it
        if bkey is not None:
            buf = rk.buffers.get(bkey)
            if buf is None:
                buf = rk.buffers[bkey] = _Buffer()
        else:
            buf = None
        if kind == 'F':
            counts = rk.counts
            n = counts.get(fkey, 0)
            if mb is None:
                mb = n
            counts[fkey] = n + 1
            if buf is not None:
                if buf.act is not None:
                    raise self._fail(rk, f'buffer misuse: forward of micro-batch {mb} overwrites the live '
                                         f'activations of micro-batch {buf.act[1]} in buffer {bkey[1]}')
                if up is None:
                    if not buf.loaded:
                        raise self._fail(rk, f'forward of the first stage on buffer {bkey[1]} without a '
                                             f'LoadMicroBatch')
                elif up[0] != rk.rank and buf.inp != (it, mb):
                    got = 'nothing' if buf.inp is None else f'micro-batch {buf.inp[1]}'
                    raise self._fail(rk, f'forward of micro-batch {mb} but buffer {bkey[1]} holds {got} received '
                                         f'from rank {up[0]} (missing or unfinished RecvActivation?)')
                buf.loaded, buf.inp, buf.out = False, None, (it, mb)
                if not self.forward_only:  # without autograd nothing is kept for a backward
                    buf.act = buf.out
            if up is not None and up[0] == rk.rank and (up[1], direction, mb) not in rk.forwards:
                raise self._fail(rk, f'forward of micro-batch {mb} before its forward on the local upstream chunk '
                                     f'{up[1]}')
            rk.forwards.add((chunk, direction, mb))
        elif self.forward_only:
            raise self._fail(rk, f'a {kind} pass in a forward-only run')
        elif kind == 'B' or kind == 'BW':
            if buf is None or buf.act is None or buf.b_done:
                raise self._fail(rk, f'backward before its forward: buffer {None if bkey is None else bkey[1]} of '
                                     f'chunk {chunk} holds no activations awaiting a backward')
            if mb is None:
                mb = buf.act[1]
            if down is not None:
                if down[0] != rk.rank:
                    if buf.grad != buf.act:
                        raise self._fail(rk, f'backward of micro-batch {mb} without its gradient from rank '
                                             f'{down[0]} (missing or unfinished RecvGrad?)')
                    if self.placement.single_grad_slot:
                        rk.grad_slot = None
                elif (down[1], direction, mb) not in rk.backwards:
                    raise self._fail(rk, f'backward of micro-batch {mb} before its backward on the local downstream '
                                         f'chunk {down[1]}')
            rk.backwards.add((chunk, direction, mb))
            buf.grad, buf.out, buf.bwd = None, None, (it, mb)
            if kind == 'BW':
                buf.act = None
            else:
                buf.b_done = True
                rk.pending_w.append(bkey)
        elif kind == 'W':
            pending = rk.pending_w
            key = bkey if bkey is not None else next((k for k in pending if k[0] == chunk), None)
            if key not in pending:
                raise self._fail(rk, f'weight pass on chunk {chunk} buffer {None if bkey is None else bkey[1]} with '
                                     f'no pending input (B) pass')
            pending.remove(key)
            buf = rk.buffers.get(key)
            if buf is None:
                buf = rk.buffers[key] = _Buffer()
            if mb is None:
                mb = buf.act[1]
            buf.act, buf.b_done = None, False
        else:
            raise self._fail(rk, f'unknown pass kind {kind!r}')

        start = self._node(rk.clock, rk.clock, self.dispatch_slot + rk.rank)
        passes = self.program.passes
        rk.clock = self._node(start, start, self.cost_slot + len(passes))
        passes.append((rk.rank, kind, stage, chunk, mb, direction, rk.pair if pair is _PAIRED else pair,
                       pair is _PAIRED, it, start, rk.clock, size, memory))

    @staticmethod
    def _fail(rk, why):
        return ScheduleError(f'{rk.at()}: {why}')

    # -- communication ---------------------------------------------------------------------------
    def _p2p(self, rk, e):
        _, is_send, kind, chunk, bkey, direction, peer, src, dst, channel, meta_key, buffer_id, recv_key = e
        pl, it = self.placement, rk.it

        # The engines send the activation shapes once, with a blocking send/recv at the first
        # activation instruction of each chunk, even when the data itself is only queued (DualPipeV).
        # Modelling it keeps its place in the FIFO order exact rather than argued.
        if kind == ACTIVATION and meta_key not in rk.meta_done and pl.tensor_meta:
            rk.meta_done.add(meta_key)
            op = [rk.rank, peer, is_send, (META, src, dst, direction, it, None), (rk.rank, it, rk.step, rk.instr),
                  channel, None, None, 0, None, rk]
            rk.epos -= 1  # the data follows once the shapes are through
            self._post(rk, op)
            if is_send and pl.async_sends:
                rk.in_flight.append(op)
            else:
                rk.waiting = [op]
            return

        buf = rk.buffers.get(bkey)
        if buf is None:
            buf = rk.buffers[bkey] = _Buffer()
        match = 0
        if is_send:
            if kind == ACTIVATION:
                if buf.out is None:
                    raise self._fail(rk, f'sends buffer {buffer_id}, which holds no forward output')
                mb = buf.out
            else:
                if buf.bwd is None:
                    raise self._fail(rk, f'sends the gradient of buffer {buffer_id}, whose backward has not run')
                mb, buf.bwd = buf.bwd, None
        elif kind == ACTIVATION:
            n = rk.counts.get(recv_key, 0)
            mb = (it, n)
            rk.counts[recv_key] = n + 1
            match = 1
        else:
            if buf.out is None:
                raise self._fail(rk, f'receives a gradient for buffer {buffer_id}, which holds no forward output')
            mb = buf.out
            match = 2
        op = [rk.rank, peer, is_send, (kind, src, dst, direction, mb[0], mb[1]), (rk.rank, it, rk.step, rk.instr),
              channel, None, None, match, buf, rk]
        if self.record_messages:
            rk.messages.append((it, is_send, kind, peer))
        if is_send:
            rk.clock = self._node(rk.clock, rk.clock, _SEND_CPU)
        if pl.batched_p2p:
            rk.queued.append(op)
        else:
            self._post(rk, op)
            if is_send and pl.async_sends:
                rk.in_flight.append(op)
            else:
                rk.waiting = [op]

    def _post(self, rk, op):
        op[_POSTED] = rk.clock
        queues = self.channels.get(op[_CHANNEL])
        if queues is None:
            queues = self.channels[op[_CHANNEL]] = (deque(), deque())
        sends, recvs = queues
        if op[_IS_SEND]:
            if not recvs:
                sends.append(op)
                return
            s, r = op, recvs.popleft()
        else:
            if not sends:
                recvs.append(op)
                return
            s, r = sends.popleft(), op
        # the heads of the channel meet (one side was empty before this op came): done one latency after the later
        # of the two was posted, the receive its own time after that
        if s[_MSG] != r[_MSG]:
            self._protocol_error(s, r)
        s[_DONE] = done = self._node(s[_POSTED], r[_POSTED], _LATENCY)
        r[_DONE] = self._node(done, done, _RECV_CPU)
        if r[_MATCH]:
            self._matched(r)

    @staticmethod
    def _protocol_error(s, r):
        raise ScheduleError(f'protocol error between rank {s[0]} and rank {r[0]}: {_at(r[_WHERE])} waits to '
                            f'{_op_describe(r)}, but the next message on that channel is {_at(s[_WHERE])} '
                            f'trying to {_op_describe(s)}')

    def _matched(self, r):
        buf, msg = r[_BUF], r[_MSG]
        mb = (msg[4], msg[5])
        if r[_MATCH] == 1:
            if buf.inp is not None:
                raise ScheduleError(f'{_at(r[_WHERE])}: buffer misuse: receives micro-batch {mb[1]} over the '
                                    f'unused input of micro-batch {buf.inp[1]}')
            buf.inp = mb
        else:
            rk = r[_OWNER]
            if self.placement.single_grad_slot and rk.grad_slot is not None:
                raise ScheduleError(f'{_at(r[_WHERE])}: buffer misuse: the engine keeps one received gradient and '
                                    f'this one overwrites the unused gradient of micro-batch {rk.grad_slot[1]}')
            buf.grad = rk.grad_slot = mb

    # -- diagnosis -------------------------------------------------------------------------------
    def _stuck_report(self):
        stuck = [r for r in self.ranks if not r.finished]
        lines, orphan = [], True
        for rk in stuck:
            for op in (op for op in rk.waiting if op[_DONE] is None):
                peer = self.ranks[op[_PEER]]
                if peer.finished:
                    state = 'which has finished its stream'
                else:
                    orphan = False
                    state = f'which is itself blocked at {peer.at()}'
                lines.append(f'  {rk.at()} waits to {_op_describe(op)}, {state}')
        if orphan and lines:
            kinds = {('send with no matching receive' if op[_IS_SEND] else 'receive without send')
                     for rk in stuck for op in rk.waiting if op[_DONE] is None}
            head = ' and '.join(sorted(kinds)).capitalize() + ':'
        else:
            head = f'Deadlock: ranks {[r.rank for r in stuck]} cannot make progress:'
        return '\n'.join([head] + lines)

    def _final_checks(self):
        for rk in self.ranks:
            if rk.pending_w:
                raise ScheduleError(f'rank {rk.rank} ended with input (B) passes whose weight (W) pass never ran: '
                                    f'(chunk, buffer) {rk.pending_w}')
            live = sorted(k for k, b in rk.buffers.items() if b.act is not None)
            if live:
                raise ScheduleError(f'rank {rk.rank} ended with forwards never followed by a backward: '
                                    f'(chunk, buffer) {live}')


# ----------------------------------------------------------------------------------------------
# Structures kept, and the chained iterations from one iteration's.


def _structure(factory, placement, stages, micro_batches, runs, forward_only, validation):
    """The `_Program` of `runs` runs of the schedule's streams: kept from an earlier call, else simulated (and kept
    when the streams are a function of the schedule, p and m alone)."""
    kept = _replayable(factory)
    key = _program_key(factory, placement, stages, micro_batches) + (forward_only, validation)
    programs = _STRUCTURES.get(key) if kept else None
    if programs is not None and runs in programs:
        _STRUCTURES.move_to_end(key)
        return programs[runs]
    prog = _Simulation(factory, placement, stages, micro_batches, runs, forward_only, validation,
                       messages=runs == 1).run()
    if kept:
        _STRUCTURES.setdefault(key, {})[runs] = prog
        _STRUCTURES.move_to_end(key)
        _keep_within()
    return prog


def _keep_within():
    size = sum(p.size() for programs in _STRUCTURES.values() for p in programs.values())
    while size > _STRUCTURES_KEPT and len(_STRUCTURES) > 1:
        size -= sum(p.size() for p in _STRUCTURES.popitem(last=False)[1].values())


def _steady(first):
    """The program of a later run of the streams whose first run is `first` (a one-run program that ended clean):
    the same nodes, but a tensor-shape message is no longer waited for (the engines send the shapes once)."""
    if first.later is None:
        steady = _Program(first.ranks, 1)
        for name in _Program.__slots__:
            setattr(steady, name, getattr(first, name))
        steady.B, steady.K = first.B.copy(), first.K.copy()
        waits = np.array(first.meta_waits, dtype=np.int64) - first.ranks
        steady.B[waits], steady.K[waits] = first.A[waits], _ZERO  # the time it had: no wait
        steady.meta_waits, steady.later, steady.variants = [], None, {}
        first.later = steady
    return first.later


# ----------------------------------------------------------------------------------------------
# Timing: the programs' nodes given their times.

class _Variant:
    """A program's nodes less those whose time is another's: `same` (a boolean per node) those whose time is their
    first input's, `ends` those whose time is their second's. `where[n]`: the node here that has node n's time."""
    __slots__ = ('A', 'B', 'K', 'where')

    def __init__(self, prog, same, ends=None):
        p, n = prog.ranks, len(prog.A)
        A, B, K = prog.A, prog.B, prog.K
        parent = np.arange(p + n, dtype=np.int64)
        parent[p:][same] = A[same]
        gone = same
        if ends is not None:
            ends = ends & ~same
            parent[p:][ends] = B[ends]
            gone = same | ends
        while True:  # each node to the first one kept before it (its time)
            up = parent[parent]
            if np.array_equal(up, parent):
                break
            parent = up
        kept = ~gone
        number = np.arange(p + n, dtype=np.int64)
        number[p:][kept] = p + np.arange(int(kept.sum()), dtype=np.int64)
        self.where = number[parent]
        self.A, self.B, self.K = self.where[A[kept]], self.where[B[kept]], K[kept]


def _timing_variant(prog, zero, nonneg):
    """`prog` timed at costs whose params `zero` (dispatch, send, receive, step before, after, rollback: all 0.0 or
    not) says are 0.0: without the nodes that add such a param to one time (x + 0.0 is x), and, when no latency or
    receive time is below zero, the waits for an op posted just before (they end with their op). Kept per `zero`."""
    key = (zero, nonneg)
    found = prog.variants.get(key)
    if found is None:
        p = prog.ranks
        dispatch, before, after, rollback, costs = _slots(p, prog.runs)
        known = np.zeros(costs + 1, dtype=bool)  # the params that are 0.0 (the passes' costs are not looked at)
        known[_ZERO] = True
        for (lo, hi), is_zero in zip(((dispatch, dispatch + p), (_SEND_CPU, _SEND_CPU + 1), (_RECV_CPU, _RECV_CPU + 1),
                                      (before, before + p), (after, after + p), (rollback, costs)), zero):
            known[lo:hi] = is_zero
        ends = None
        if nonneg and prog.folds:
            ends = np.zeros(len(prog.A), dtype=bool)
            ends[prog.folds] = True
        found = prog.variants[key] = _Variant(prog, (prog.A == prog.B) & known[np.minimum(prog.K, costs)], ends)
    return found


def _evaluate(A, B, add, carry):
    """The time of every node: max(t[a], t[b]) + its param, the ranks starting at `carry`."""
    t = list(carry)
    push = t.append
    for a, b, c in zip(A, B, add):
        x = t[a]
        y = t[b]
        push((x if x > y else y) + c)
    return t


def _visits(prog, carry, lists):
    """For every node of `prog` (its `where`), the visit of the simulation's sweep (round * p + rank) in which it was
    made, the ranks' first at `carry`: a wait ends at its rank's first visit at or after the one that matched its
    op; any other node is made when the later of its inputs was. What numbers paired passes in a replayed run as the
    simulation would have."""
    p = prog.ranks
    var = prog.variants.get('visits')
    if var is None:  # a node adding to one time is made with it
        var = prog.variants['visits'] = _Variant(prog, (prog.A == prog.B) & ((prog.K < _WAIT) | (prog.K >= _WAIT + p)))
    if var not in lists:  # (the steady runs share theirs)
        waiter = np.where((var.K >= _WAIT) & (var.K < _WAIT + p), var.K - _WAIT + 1, 0)  # its rank + 1, for a wait
        lists[var] = var.A.tolist(), var.B.tolist(), waiter.tolist()
    v = list(carry)
    push = v.append
    for a, b, r in zip(*lists[var]):
        x = v[a]
        y = v[b]
        if r:
            y += (r - 1 - y) % p
        push(x if x > y else y)
    return np.array(v, dtype=np.int64)[var.where]


def _pair_numbers(segments):
    """Per segment, {its simulation's pair id: the id the simulation of all the segments' runs at once gives}. Kept
    with the first program, per number of segments (the steady ones being its `later`)."""
    first = segments[0][0]
    key = ('pairs', len(segments))
    if key not in first.variants:
        order, carry, lists = [], list(range(first.ranks)), {}
        for n, (prog, _) in enumerate(segments):
            v = _visits(prog, carry, lists).tolist()
            order += [(v[node], n, g) for g, (node, _) in enumerate(prog.fetch)]
            carry = [v[node] for node in prog.ends]
        out = [{} for _ in segments]
        for i, (_, n, g) in enumerate(sorted(order)):
            out[n][g + 1] = i + 1
        first.variants[key] = out
    return first.variants[key]


class _Replayed:
    """The times of a replay: each rank's clock at the end, iteration ends and validation waits (by run), and its
    passes, built when asked for (`passes()`) from each segment's start and end times."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.clocks = [0.0] * ranks
        self.iteration_end = [{} for _ in range(ranks)]
        self.validation_waits = [{} for _ in range(ranks)]
        self.segments = []  # (program, first run, starts, stops)
        self.run_iteration = None
        self.instructions = 0

    def passes(self):
        rows = [[] for _ in range(self.ranks)]
        its = self.run_iteration
        programs = [(prog, run0) for prog, run0, _, _ in self.segments]
        renumber = _pair_numbers(programs) if len(programs) > 1 and programs[0][0].fetch else None
        for n, (prog, run0, starts, stops) in enumerate(self.segments):
            order, bounds, kind, stage, chunk, mb, direction, pair, paired, run = _columns(prog)
            if renumber:
                pair = [renumber[n][x] if y else x for x, y in zip(pair, paired)]
            made = list(map(Pass, kind, stage, chunk, mb, starts[order].tolist(), stops[order].tolist(), direction,
                            pair, [its[run0 + r] for r in run]))
            for r, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                rows[r] += made[lo:hi]
        return rows

    def columns(self):
        """The passes as columns in the timeline's order (rank by rank, each in its order), without a Pass object
        each: numpy arrays `rank`, `start`, `end`, `iteration`, `key` (of (rank, chunk, kind, chunk size) in
        `keys`), and the lists `kind`, `stage`, `chunk`, `micro_batch`, `direction`, `pair` in another order,
        `at[i]` being the timeline's pass i there. None when the segments count their passes differently."""
        keys = self.segments[0][0].keys
        if any(prog.keys is not keys for prog, _, _, _ in self.segments):
            return None
        programs = [(prog, run0) for prog, run0, _, _ in self.segments]
        renumber = _pair_numbers(programs) if len(programs) > 1 and programs[0][0].fetch else None
        out = {name: [] for name in ('rank', 'start', 'end', 'iteration', 'key')}
        lists = {name: [] for name in ('kind', 'stage', 'chunk', 'micro_batch', 'direction', 'pair')}
        its = np.array(self.run_iteration, dtype=np.int64)
        for n, (prog, run0, starts, stops) in enumerate(self.segments):
            order, _, kind, stage, chunk, mb, direction, pair, paired, run = _columns(prog)
            if renumber:
                pair = [renumber[n][x] if y else x for x, y in zip(pair, paired)]
            for name, column in zip(('rank', 'start', 'end', 'iteration', 'key'),
                                    (prog.rank_of[order], starts[order], stops[order], its[run0 + np.array(run)],
                                     prog.key_of[order])):
                out[name].append(column)
            for name, column in zip(lists, (kind, stage, chunk, mb, direction, pair)):
                lists[name] += column
        out = {name: np.concatenate(columns) for name, columns in out.items()}
        at = np.argsort(out['rank'], kind='stable')  # each segment rank by rank: the segments' blocks of a rank
        return dict({name: column[at] for name, column in out.items()}, at=at, keys=keys, **lists)

    def busy(self):
        """Each rank's passes' time, summed as Timeline.busy sums it (in its order)."""
        prog, _, starts, stops = self.segments[0]
        durations = stops - starts
        return [sum(durations[prog.rank_of == r].tolist()) for r in range(self.ranks)]


def _columns(prog):
    """The passes of `prog` rank by rank (each in its order): that order, where each rank's start, and their
    kind, stage, chunk, micro-batch, direction, pair, paired, run as lists. Kept with the program."""
    found = prog.variants.get('columns')
    if found is None:
        order = np.argsort(prog.rank_of, kind='stable')
        bounds = np.searchsorted(prog.rank_of[order], np.arange(prog.ranks + 1)).tolist()
        ranked = [prog.passes[i] for i in order.tolist()]
        found = prog.variants['columns'] = (order, bounds, *(list(map(itemgetter(i), ranked)) for i in range(1, 9)))
    return found


def _replay(segments, cost, fixed, latency, p2p_cpu, dispatch, step_parts, rollback, run_iteration, wasted,
            memo=None):
    """The times of `segments`, [(program, its first run), ...] one after the other (each starting where the last
    ended), at these costs. A pass's iteration is its run's (`run_iteration`); `wasted`: the runs whose step rolls
    back (`rollback` seconds). `memo` keeps the first segment's times for a next call with the same params."""
    first = segments[0][0]
    p = first.ranks
    out = _Replayed(p)
    out.run_iteration = run_iteration
    send_cpu, recv_cpu = p2p_cpu
    parts = [step_parts(r) for r in range(p)]
    dispatches = [dispatch.get(r, 0.0) for r in range(p)]
    head = ([0.0, latency, send_cpu, recv_cpu] + [0.0] * p + dispatches + [b for b, _ in parts]
            + [a for _, a in parts])
    nonneg = latency >= 0 and recv_cpu >= 0
    common = (all(x == 0 for x in dispatches), send_cpu == 0, recv_cpu == 0, all(b == 0 for b, _ in parts),
              all(a == 0 for _, a in parts))
    carry = [0.0] * p
    lists = {}  # a variant's nodes as lists, and the params of its last replay with them (the steady runs share them)
    for n, (prog, run0) in enumerate(segments):
        blocks = [rollback.get(r, 0.0) if run0 + run in wasted else 0.0
                  for run in range(prog.runs) for r in range(p)]
        if fixed:
            costs = np.array([cost(*key) for key in prog.keys], dtype=np.float64)[prog.key_of]
        else:  # taken in turn: in each rank's order
            costs = np.array([cost(t[0], t[3], t[1], t[11]) for t in prog.passes], dtype=np.float64)
        params = np.concatenate([np.array(head + blocks, dtype=np.float64), costs])
        var = _timing_variant(prog, common + (all(x == 0 for x in blocks), ), nonneg)
        kept = memo.get('first') if memo is not None and n == 0 else None
        if kept is not None and kept[0] is var and np.array_equal(kept[1], params):
            t = kept[2]
        else:
            if var not in lists:
                lists[var] = [var.A.tolist(), var.B.tolist(), None, None]
            nodes = lists[var]
            if nodes[2] is None or not np.array_equal(nodes[2], params):
                nodes[2:] = params, params[var.K].tolist()
            t = np.array(_evaluate(nodes[0], nodes[1], nodes[3], carry))
            if memo is not None and n == 0:
                memo['first'] = (var, params, t)
        where = var.where
        for run, r, node in prog.iteration_end:
            out.iteration_end[r][run0 + run] = float(t[where[node]])
        for run, r, arrived, clock in prog.validation:
            out.validation_waits[r][run0 + run] = max(0.0, float(t[where[arrived]]) - float(t[where[clock]]))
        out.segments.append((prog, run0, t[where[prog.starts]], t[where[prog.stops]]))
        carry = t[where[np.array(prog.ends, dtype=np.int64)]].tolist()
    out.clocks = carry
    out.instructions = sum(prog.instructions for prog, _ in segments)
    return out


def _peaks(prog, memory_of, forward_only, within_of=lambda rank, chunk, kind: 0.0):
    """Each rank's peak activation memory over `prog`'s passes, in its order: after each pass, and within it where
    the pass holds more while it runs (`within_of`: bytes above its start)."""
    deltas = [0.0 if forward_only and kind == 'F' else memory_of(rank, chunk, kind, size)
              for rank, chunk, kind, size in prog.keys]
    within = [0.0 if forward_only and kind == 'F' else within_of(rank, chunk, kind)
              for rank, chunk, kind, _ in prog.keys]
    memory = [0.0] * prog.ranks
    peak = [0.0] * prog.ranks
    for t, i in zip(prog.passes, prog.key_of.tolist()):
        r = t[0]
        inside = memory[r] + within[i]
        m = memory[r] = memory[r] + (deltas[i] if t[12] is None else t[12])
        m = max(m, inside)
        if m > peak[r]:
            peak[r] = m
    return peak


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
        return table(rank, chunk, 'B', size) + table(rank, chunk, 'W', size) if kind == 'BW' else \
            table(rank, chunk, 'BW', size) / 2
    return table, 's'


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


VALIDATIONS = (None, 'ahead', 'wait')  # simulate(validation=...)
def simulate(schedule, stages, micro_batches, placement=None, costs=None, latency=0.0, iterations=5,
             forward_only=False, memory=None, p2p_cpu=(0.0, 0.0), dispatch=0.0, step_cost=0.0, validation=None,
             replayed=(), rollback_cost=0.0):
    """Simulate `schedule` on `stages` pipeline ranks with `micro_batches` micro-batches per iteration.

    schedule: a registered name, or a PipeSchedule class / factory(micro_batches, stages, stage_id).
    placement: a Placement subclass (default: the registered one, else StockPlacement).
    costs: None for unit costs (units 'F'), else seconds per (rank, chunk) (units 's'), or per pass in turn
    (a list per kind: durations replayed), see _cost_function.
    latency: cost of every p2p message, from its send (or its receive, if later) to its arrival.
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
        first = _structure(schedule, place, stages, micro_batches, 1, forward_only, validation)
        if runs == 1:
            segments = [(first, 0)]
        elif first.clean and _replayable(schedule):  # every later run is the first one again, without its shapes
            segments = [(first, 0)] + [(_steady(first), run) for run in range(1, runs)]
        else:
            segments = [(_structure(schedule, place, stages, micro_batches, runs, forward_only, validation), 0)]
        cost = _cost_function(costs)[0]  # per run: listed costs start from their first again
        out = _replay(segments, cost, fixed, latency, p2p_cpu, dispatch, step_parts, rollback_cost, run_iteration,
                      wasted, memo)
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
