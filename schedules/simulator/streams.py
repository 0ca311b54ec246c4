"""Every rank's instruction stream compiled once into effects with what the rank and the placement fix beforehand
(the chunk's stage and neighbours, the peer rank, the channel), so that the simulation only keeps state and times.
"""

from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import PASS_KIND, ForwardBackwardPass
from schedules.lowering import OrderedSchedule
from schedules.placement import Placement
from schedules.simulator.effects import (
    _HANDLERS,
    ACTIVATION,
    GRADIENT,
    Commit,
    Compute,
    Context,
    Load,
    Recv,
    Send,
    StepWork,
)

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
