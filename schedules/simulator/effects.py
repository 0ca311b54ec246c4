"""What an instruction does to a rank, for the simulator: the effects (compute a pass, load data, send or
receive a tensor, take the optimizer step, launch queued p2p) and the registry of handlers that turn an instruction
(found by its exact type, as DeepSpeed's engine finds it) into effects. `register_instruction` teaches it a new type.
"""
from dataclasses import dataclass
from typing import Optional

from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import PASS_KIND, ForwardBackwardPass
from schedules.placement import Placement

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
_WHEN_CHANGED = []  # what to forget when a handler changes (structure.py's kept structures)


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
    for forget in _WHEN_CHANGED:  # what was made with the handler it replaces
        forget()
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
