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

Every compute instruction is understood through `schedules.instructions.PASS_KIND`; an
instruction type from elsewhere is taught once with `register_instruction`. Schedules are looked
up by name in schedules/registry.py. The simulator reads the vocabulary and the definitions,
never an engine.
"""

import itertools
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Optional

from deepspeed.runtime.pipe import schedule as ds

from schedules.errors import ScheduleError
from schedules.instructions import PASS_KIND, ForwardBackwardPass
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
# The simulation.

def _unit_cost(kind, size):
    return size * {'F': 1, 'B': 1, 'W': 1, 'BW': 2}[kind]


def _describe(msg):
    kind, src, dst, direction, it, mb = msg
    what = f'{kind} of stage {src}->{dst}'
    if mb is not None:
        what += f' for micro-batch {mb}' + (f' (iteration {it})' if it else '')
    return what + ('' if direction is None else f' direction {direction}')


class _Op:
    """One posted (or queued) point-to-point operation."""
    __slots__ = ('rank', 'peer', 'is_send', 'msg', 'where', 'posted', 'done', 'on_match')

    def __init__(self, rank, peer, is_send, msg, where, on_match=None):
        self.rank, self.peer, self.is_send, self.msg, self.where = rank, peer, is_send, msg, where
        self.posted = self.done = None
        self.on_match = on_match

    def describe(self):
        verb = f'send {_describe(self.msg)} to' if self.is_send else f'receive {_describe(self.msg)} from'
        return f'{verb} rank {self.peer}'


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
    def __init__(self, rank, steps):
        self.rank, self.steps = rank, steps  # steps: iterator of (iteration, step, instruction)
        self.clock = 0.0
        self.where = None  # (iteration, step, instruction) being executed
        self.effects, self.waiting, self.queued = deque(), [], []
        self.finished = False
        self.buffers = {}
        self.counts = Counter()
        self.forwards, self.backwards = set(), set()  # (iteration, chunk, direction, micro-batch)
        self.pending_w = []  # (chunk, buffer) in B order
        self.meta_done = set()  # (is_send, chunk) once the activation shapes went through
        self.grad_slot = None  # stock engine: gradient received but not yet used
        self.in_flight = []  # asynchronous sends not yet known to be complete
        self.memory = self.peak = 0.0
        self.passes, self.iteration_end = [], {}
        self.messages = []  # (iteration, is_send, kind, peer rank) of each data send / receive, in stream order
        self.validated_through = -1  # post-validation: the last iteration whose norm this rank waited for
        self.validation_waits = {}  # iteration -> how long this rank waited for its norm before the next one

    def at(self):
        it, step, instr = self.where
        return f'rank {self.rank} (iteration {it}, step {step}: {instr!r})'

    def buffer(self, chunk, buffer_id):
        return self.buffers.setdefault((chunk, buffer_id), _Buffer())


class _Simulation:
    def __init__(self, factory, placement, ranks, micro_batches, iterations, cost, latency, forward_only, memory,
                 p2p_cpu=(0.0, 0.0), dispatch=0.0, step_cost=0.0, validation=None, replayed=(), rollback_cost=0.0):
        self.step_cost = step_cost if isinstance(step_cost, dict) else {r: step_cost for r in range(ranks)}
        self.rollback_cost = (rollback_cost if isinstance(rollback_cost, dict)
                              else {r: rollback_cost for r in range(ranks)})
        # the runs of the iterations' streams: a replayed iteration runs twice, the first run wasted
        self.run_iteration, self.wasted = [], set()
        for it in range(iterations):
            if it in replayed:
                self.wasted.add(len(self.run_iteration))
                self.run_iteration.append(it)
            self.run_iteration.append(it)
        if validation not in VALIDATIONS:
            raise ValueError(f"validation {validation!r}: choose from {', '.join(map(str, VALIDATIONS))}")
        self.validation = validation
        self.norm_started = {}  # iteration -> {rank: when it reached its OptimizerStep (started the norm)}
        self.placement, self.cost, self.latency, self.forward_only = placement, cost, latency, forward_only
        self.send_cpu, self.recv_cpu = p2p_cpu  # a send's / a receive's own time on its rank
        self.dispatch = dispatch if isinstance(dispatch, dict) else {r: dispatch for r in range(ranks)}
        self.memory = memory  # (rank, chunk, kind, size) -> activation-memory delta of that pass
        # Build every rank's schedule up front so a constraint violation (ValueError) surfaces first.
        first = [factory(micro_batches=micro_batches, stages=ranks, stage_id=r) for r in range(ranks)]

        def stream(r):
            for run in range(len(self.run_iteration)):  # a run of a replayed iteration counts as an iteration here
                sched = first[r] if run == 0 else factory(micro_batches=micro_batches, stages=ranks, stage_id=r)
                for step, cmds in enumerate(sched.steps()):
                    for instr in cmds:
                        yield run, step, instr

        self.ranks = [_Rank(r, stream(r)) for r in range(ranks)]
        self.channels = {}  # (src, dst) -> (deque of sends, deque of receives), in posting order
        self.next_pair = 0

    # -- driving ------------------------------------------------------------------------------
    def run(self):
        # Matching depends only on each rank's posting order, never on which rank runs first, so
        # sweeping the ranks until none moves gives the same answer as an event queue.
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                progress |= self._advance(rank)
        if not all(r.finished for r in self.ranks):
            raise ScheduleError(self._stuck_report())
        self._final_checks()

    def _advance(self, rk):
        moved = False
        while not rk.finished:
            if rk.waiting:
                if any(op.done is None for op in rk.waiting):
                    return moved
                rk.clock = max([rk.clock] + [op.done for op in rk.waiting])
                rk.waiting = []
            if not rk.effects:
                nxt = next(rk.steps, None)
                if rk.in_flight and (nxt is None or nxt[0] != rk.where[0]):
                    # an engine with asynchronous sends waits for them before its batch ends
                    rk.steps = itertools.chain([nxt] if nxt is not None else [], rk.steps)
                    rk.waiting, rk.in_flight = rk.in_flight, []
                    continue
                if rk.where is not None and (nxt is None or nxt[0] != rk.where[0]):
                    rk.iteration_end[rk.where[0]] = rk.clock
                    if self.validation and not self._validated(rk, rk.where[0]):
                        # its next iteration (or, after its last, the end of the run) waits for the norm
                        rk.steps = itertools.chain([nxt] if nxt is not None else [], rk.steps)
                        return moved
                if nxt is None:
                    if rk.queued:
                        raise ScheduleError(f'{rk.at()} is the end of the stream of rank {rk.rank}, but its queued '
                                            f'p2p was never launched by a CommitP2P: '
                                            + '; '.join(op.describe() for op in rk.queued))
                    rk.finished = True
                    return True
                rk.where = nxt
                rk.effects.extend(self._effects_of(rk, nxt[2]))
                continue  # the instruction may have no effect at all
            self._apply(rk, rk.effects.popleft())
            moved = True
        return moved

    def _effects_of(self, rk, instr):
        handler = self.placement.handlers.get(type(instr)) or _HANDLERS.get(type(instr))
        if handler is None:
            raise ScheduleError(f'{rk.at()}: the simulator does not understand {type(instr).__name__} '
                                f'(teach it with register_instruction)')
        effects = list(handler(instr, Context(rk.rank, self.placement, self.placement.chunk_of(rk.rank, instr))))
        if any(isinstance(e, Compute) and e.pair is True for e in effects):
            self.next_pair += 1  # the paired computes of this instruction share one id
            effects = [replace(e, pair=self.next_pair) if isinstance(e, Compute) and e.pair is True else e
                       for e in effects]
        return effects

    def _apply(self, rk, e):
        if isinstance(e, Compute):
            self._compute(rk, e)
        elif isinstance(e, Load):
            rk.buffer(e.chunk, e.buffer).loaded = True
        elif isinstance(e, (Send, Recv)):
            self._p2p(rk, e)
        elif isinstance(e, StepWork):
            before, after = self._step_parts(rk.rank)
            rk.clock += before
            self.norm_started.setdefault(rk.where[0], {}).setdefault(rk.rank, rk.clock)
            if self.validation != 'wait':  # (waiting, the rank steps once the norm is in: _validated)
                rk.clock += after
            if rk.where[0] in self.wasted:  # its step redoes the one before (a rollback), its own is not taken
                rk.clock += self.rollback_cost.get(rk.rank, 0.0)
        elif isinstance(e, Commit):
            if not self.placement.batched_p2p:
                raise ScheduleError(f'{rk.at()}: {type(self.placement).__name__} has no CommitP2P '
                                    f'(its sends and receives are blocking)')
            for op in rk.queued:
                self._post(rk, op)
            rk.waiting, rk.queued = rk.queued, []
        else:
            raise ScheduleError(f'{rk.at()}: unknown effect {e!r}')

    def _validated(self, rk, it):
        """Post-validation (`validation`): whether the model's norm of iteration `it` is known, every rank having
        started its part at its OptimizerStep; then the rank's clock moves to its arrival (an all-reduce: one
        latency after the last rank started it), and under 'wait' the rank takes its step only then."""
        started = self.norm_started.get(it, {})
        if len(started) < len(self.ranks):
            return False
        arrived = max(started.values()) + self.latency
        if rk.validated_through < it:
            rk.validated_through = it
            rk.validation_waits[it] = max(0.0, arrived - rk.clock)
            rk.clock = max(rk.clock, arrived)
            if self.validation == 'wait':
                rk.clock += self._step_parts(rk.rank)[1]
        return True

    def _step_parts(self, rank):
        """(before, after): a rank's step_cost before its norm is started and after (all after for a number)."""
        cost = self.step_cost.get(rank, 0.0)
        return tuple(cost) if isinstance(cost, (tuple, list)) else (0.0, cost)

    # -- compute and the ordering rules it checks ------------------------------------------------
    def _compute(self, rk, e):
        pl, it = self.placement, rk.where[0]
        size = pl.chunk_size(rk.rank, e.chunk)
        up = pl.neighbour(rk.rank, e.chunk, -1, e.direction)
        down = pl.neighbour(rk.rank, e.chunk, +1, e.direction)
        buf = rk.buffer(e.chunk, e.buffer) if e.buffer is not None else None
        fail = lambda why: ScheduleError(f'{rk.at()}: {why}')  # noqa: E731
        if e.kind == 'F':
            mb = e.micro_batch
            if mb is None:
                mb = rk.counts[(it, e.chunk, e.direction, 'F')]
            rk.counts[(it, e.chunk, e.direction, 'F')] += 1
            if buf is not None:
                if buf.act is not None:
                    raise fail(f'buffer misuse: forward of micro-batch {mb} overwrites the live '
                               f'activations of micro-batch {buf.act[1]} in buffer {e.buffer}')
                if up is None and not buf.loaded:
                    raise fail(f'forward of the first stage on buffer {e.buffer} without a LoadMicroBatch')
                if up is not None and up[0] != rk.rank and buf.inp != (it, mb):
                    got = 'nothing' if buf.inp is None else f'micro-batch {buf.inp[1]}'
                    raise fail(f'forward of micro-batch {mb} but buffer {e.buffer} holds {got} received '
                               f'from rank {up[0]} (missing or unfinished RecvActivation?)')
                buf.loaded, buf.inp, buf.out = False, None, (it, mb)
                if not self.forward_only:  # without autograd nothing is kept for a backward
                    buf.act = (it, mb)
            if up is not None and up[0] == rk.rank and (it, up[1], e.direction, mb) not in rk.forwards:
                raise fail(f'forward of micro-batch {mb} before its forward on the local upstream chunk {up[1]}')
            rk.forwards.add((it, e.chunk, e.direction, mb))
            delta = 0.0 if self.forward_only else self.memory(rk.rank, e.chunk, 'F', size)
        elif self.forward_only:
            raise fail(f'a {e.kind} pass in a forward-only run')
        elif e.kind in ('B', 'BW'):
            if buf is None or buf.act is None or buf.b_done:
                raise fail(f'backward before its forward: buffer {e.buffer} of chunk {e.chunk} holds no '
                           f'activations awaiting a backward')
            mb = buf.act[1] if e.micro_batch is None else e.micro_batch
            if down is not None and down[0] != rk.rank:
                if buf.grad != buf.act:
                    raise fail(f'backward of micro-batch {mb} without its gradient from rank {down[0]} '
                               f'(missing or unfinished RecvGrad?)')
                if pl.single_grad_slot:
                    rk.grad_slot = None
            if down is not None and down[0] == rk.rank and (it, down[1], e.direction, mb) not in rk.backwards:
                raise fail(f'backward of micro-batch {mb} before its backward on the local downstream chunk {down[1]}')
            rk.backwards.add((it, e.chunk, e.direction, mb))
            buf.grad, buf.out, buf.bwd = None, None, (it, mb)
            delta = self.memory(rk.rank, e.chunk, e.kind, size)
            if e.kind == 'BW':
                buf.act = None
            else:
                buf.b_done = True
                rk.pending_w.append((e.chunk, e.buffer))
        elif e.kind == 'W':
            key = (e.chunk, e.buffer) if e.buffer is not None else next(
                (k for k in rk.pending_w if k[0] == e.chunk), None)
            if key not in rk.pending_w:
                raise fail(f'weight pass on chunk {e.chunk} buffer {e.buffer} with no pending input (B) pass')
            rk.pending_w.remove(key)
            buf = rk.buffer(*key)
            mb = buf.act[1] if e.micro_batch is None else e.micro_batch
            buf.act, buf.b_done, delta = None, False, self.memory(rk.rank, e.chunk, 'W', size)
        else:
            raise fail(f'unknown pass kind {e.kind!r}')

        start = rk.clock = rk.clock + self.dispatch.get(rk.rank, 0.0)
        rk.clock += self.cost(rk.rank, e.chunk, e.kind, size)
        rk.memory += delta if e.memory is None else e.memory
        rk.peak = max(rk.peak, rk.memory)
        rk.passes.append(Pass(e.kind, pl.stage(rk.rank, e.chunk), e.chunk, mb, start, rk.clock, e.direction,
                              None if e.pair is False else e.pair, it))

    # -- communication ---------------------------------------------------------------------------
    def _p2p(self, rk, e):
        pl, it = self.placement, rk.where[0]
        is_send = isinstance(e, Send)
        # activations travel downstream, gradients upstream
        step = +1 if (e.kind == ACTIVATION) == is_send else -1
        peer = pl.neighbour(rk.rank, e.chunk, step, e.direction)
        here = pl.stage(rk.rank, e.chunk)
        if peer is None or peer[0] == rk.rank:
            where = 'no such stage' if peer is None else 'it is on this rank'
            raise ScheduleError(f'{rk.at()}: {e.kind} {"send" if is_send else "receive"} of stage {here} '
                                f'has no peer rank ({where})')
        there = pl.stage(*peer)
        src, dst = (here, there) if is_send else (there, here)

        # The engines send the activation shapes once, with a blocking send/recv at the first
        # activation instruction of each chunk, even when the data itself is only queued (DualPipeV).
        # Modelling it keeps its place in the FIFO order exact rather than argued.
        if pl.tensor_meta and e.kind == ACTIVATION and (is_send, e.chunk) not in rk.meta_done:
            rk.meta_done.add((is_send, e.chunk))
            op = _Op(rk.rank, peer[0], is_send, (META, src, dst, e.direction, it, None), rk.at())
            rk.effects.appendleft(e)  # the data follows once the shapes are through
            self._post(rk, op)
            if is_send and pl.async_sends:
                rk.in_flight.append(op)
            else:
                rk.waiting = [op]
            return

        buf = rk.buffer(e.chunk, e.buffer)
        on_match = None
        if is_send and e.kind == ACTIVATION:
            if buf.out is None:
                raise ScheduleError(f'{rk.at()}: sends buffer {e.buffer}, which holds no forward output')
            mb = buf.out
        elif is_send:
            if buf.bwd is None:
                raise ScheduleError(f'{rk.at()}: sends the gradient of buffer {e.buffer}, whose backward has not run')
            mb, buf.bwd = buf.bwd, None
        elif e.kind == ACTIVATION:
            key = (it, e.chunk, e.direction, 'recv')
            mb = (it, rk.counts[key])
            rk.counts[key] += 1

            def on_match(buf=buf, mb=mb, at=rk.at()):
                if buf.inp is not None:
                    raise ScheduleError(f'{at}: buffer misuse: receives micro-batch {mb[1]} over the '
                                        f'unused input of micro-batch {buf.inp[1]}')
                buf.inp = mb
        else:
            if buf.out is None:
                raise ScheduleError(f'{rk.at()}: receives a gradient for buffer {e.buffer}, which holds no forward '
                                    f'output')
            mb = buf.out

            def on_match(buf=buf, mb=mb, rk=rk, at=rk.at()):
                if self.placement.single_grad_slot and rk.grad_slot is not None:
                    raise ScheduleError(f'{at}: buffer misuse: the engine keeps one received gradient and this '
                                        f'one overwrites the unused gradient of micro-batch {rk.grad_slot[1]}')
                buf.grad = rk.grad_slot = mb
        op = _Op(rk.rank, peer[0], is_send, (e.kind, src, dst, e.direction, mb[0], mb[1]), rk.at(), on_match)
        rk.messages.append((it, is_send, e.kind, peer[0]))
        if is_send:
            rk.clock += self.send_cpu
        if pl.batched_p2p:
            rk.queued.append(op)
        else:
            self._post(rk, op)
            if is_send and pl.async_sends:
                rk.in_flight.append(op)
            else:
                rk.waiting = [op]

    def _post(self, rk, op):
        op.posted = rk.clock
        key = (op.rank, op.peer) if op.is_send else (op.peer, op.rank)
        if self.placement.channels_by_kind:  # the shape message goes first on the activations' channel
            key += (GRADIENT if op.msg[0] == GRADIENT else ACTIVATION, )
        sends, recvs = self.channels.setdefault(key, (deque(), deque()))
        (sends if op.is_send else recvs).append(op)
        while sends and recvs:
            s, r = sends.popleft(), recvs.popleft()
            if s.msg != r.msg:
                raise ScheduleError(f'protocol error between rank {s.rank} and rank {r.rank}: {r.where} waits to '
                                    f'{r.describe()}, but the next message on that channel is {s.where} '
                                    f'trying to {s.describe()}')
            s.done = r.done = max(s.posted, r.posted) + self.latency
            r.done += self.recv_cpu
            if r.on_match:
                r.on_match()

    # -- diagnosis -------------------------------------------------------------------------------
    def _stuck_report(self):
        stuck = [r for r in self.ranks if not r.finished]
        lines, orphan = [], True
        for rk in stuck:
            for op in (op for op in rk.waiting if op.done is None):
                peer = self.ranks[op.peer]
                if peer.finished:
                    state = 'which has finished its stream'
                else:
                    orphan = False
                    state = f'which is itself blocked at {peer.at()}'
                lines.append(f'  {rk.at()} waits to {op.describe()}, {state}')
        if orphan and lines:
            kinds = {('send with no matching receive' if op.is_send else 'receive without send')
                     for rk in stuck for op in rk.waiting if op.done is None}
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

    def worst(self, key):
        return max(row[key] for row in self.per_rank)


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
    frees half, W the other half), else measured deltas per (rank, chunk), see _memory_function.
    Raises ValueError when the schedule rejects (stages, micro_batches), ScheduleError when it is broken.
    """
    if any(not 0 < it < iterations for it in replayed):
        raise ValueError(f"replayed {sorted(replayed)}: an iteration replayed follows a redone one, so it is one of "
                         f"1 .. {iterations - 1}")
    if replayed and validation is not None:
        raise ValueError(f"replayed iterations are what speculating past the validation costs; validation "
                         f"{validation!r} validates before the next iteration, so nothing is replayed")
    name = schedule if isinstance(schedule, str) else getattr(schedule, '__name__', repr(schedule))
    if isinstance(schedule, str):
        spec = available_schedules()[schedule]
        schedule, placement = spec.factory, placement or spec.placement
    place = (placement or StockPlacement)(stages)
    units = _cost_function(costs)[1]
    meta = {'schedule': name, 'stages': stages, 'micro_batches': micro_batches}

    def run(n, replays=()):
        cost = _cost_function(costs)[0]  # per run: listed costs start from their first again
        sim = _Simulation(schedule, place, stages, micro_batches, n, cost, latency, forward_only,
                          _memory_function(memory), p2p_cpu, dispatch, step_cost, validation, replays, rollback_cost)
        sim.run()
        if replays:  # a run of a replayed iteration is numbered by its iteration, its end the last run's
            for r in sim.ranks:
                r.passes = [replace(p, iteration=sim.run_iteration[p.iteration]) for p in r.passes]
                r.iteration_end = {sim.run_iteration[run]: end for run, end in sorted(r.iteration_end.items())}
        return sim.ranks

    one = run(1)
    makespan = max(r.clock for r in one)
    timeline = Timeline([r.passes for r in one], units, dict(meta, iterations=1))
    chained, period, waits = None, makespan, [0.0] * stages
    if iterations >= 3:
        many = run(iterations, frozenset(replayed))
        chained = Timeline([r.passes for r in many], units, dict(meta, iterations=iterations))
        # The chained run settles into a periodic regime after a short transient; averaging the
        # last two iterations also covers a regime that alternates between two lengths.
        n = iterations - 1
        period = max((r.iteration_end[n] - r.iteration_end[n - 2]) / 2 for r in many)
        waits = [r.validation_waits.get(n - 1, 0.0) for r in many]  # at the last boundary: the steady state
    per_rank = []
    for r in one:
        busy = timeline.busy(r.rank)
        per_rank.append({'rank': r.rank, 'busy': busy, 'idle_synced': makespan - busy,
                         'idle_interlocked': period - busy, 'validation_wait': waits[r.rank],
                         'peak_activation_memory': r.peak,
                         'params': sum(place.chunk_size(r.rank, c) for c in range(place.chunks))})
    messages = [[m[1:] for m in r.messages] for r in one]
    return SimResult(timeline, chained, makespan, period, per_rank, units, messages)

