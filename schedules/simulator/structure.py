"""A schedule's structure: every rank's compiled stream run together, checked (protocol, buffers, deadlocks) and
written down as a program of timing nodes (`_Simulation`), kept per schedule for later calls at other costs
(`_structure`), and the steady program of the chained iterations (`_steady`). Communication follows the real
engine on gloo: see simulate.py.
"""
from collections import OrderedDict, deque
from itertools import chain, count
from operator import itemgetter

import numpy as np

from schedules.errors import ScheduleError
from schedules.simulator.effects import _WHEN_CHANGED, ACTIVATION, META
from schedules.simulator.streams import (
    _COMMIT,
    _COMPUTE,
    _LOAD,
    _P2P,
    _PAIRED,
    _RAISE,
    _STEP,
    _lazy,
    _program_key,
    _programs,
    _replayable,
)

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
                 'wpos', 'wclock', 'count', 'constants', 'ahead', 'run_clock')

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
        # receives posted ahead (Placement.receives_ahead): channel -> the node where its next receive is posted,
        # when the one before it was taken; a channel's first receive of a run is posted at the run's start
        self.ahead, self.run_clock = {}, rank

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

_STRUCTURES = OrderedDict()  # (factory, placement, handlers, p, m, forward_only, validation) -> {runs: _Program}
_STRUCTURES_KEPT = 4_000_000  # nodes and passes kept (every schedule at p = 16, m = 64 many times over), the least
# recently used dropped first
_WHEN_CHANGED.append(lambda: _STRUCTURES.clear())  # made with a handler that register_instruction replaced
VALIDATIONS = (None, 'ahead', 'wait')  # simulate(validation=...)
# param slots; _WAIT + rank: 0.0, a rank waiting. _LATENCY: from a message's rendezvous (both sides posted) to its
# arrival; _SEND_WAIT: from the rendezvous to the send's completion (the data handed to the transport)
# _WIRE: how long a message holds its link (messages from one rank to another cross it one after the other)
_ZERO, _LATENCY, _SEND_CPU, _RECV_CPU, _SEND_WAIT, _WIRE, _WAIT = range(7)


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

    def __init__(self, factory, placement, ranks, micro_batches, runs, forward_only, validation=None, messages=True,
                 lanes=False):
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
        # with `lanes`, the link from a rank to another carries one message at a time, in the order they met:
        # (src, dst, run) -> the node where the last one left it
        self.lanes = {} if lanes else None
        self.next_pair = 0
        # what _advance reads on every call, in one tuple
        self.constants = (forward_only, placement.batched_p2p, placement.async_sends, placement.tensor_meta,
                          placement.single_grad_slot, self.channels, messages, self.nodes, ranks - 1,
                          self.program.passes, self.cost_slot, self.program.fetch, self.program.meta_waits,
                          self.program.folds, placement.receives_ahead, self.lanes)
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
         fetch, meta_waits, folds, ahead, lanes) = self.constants
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
                    if ahead and not w[_IS_SEND] and w[_MSG][0] is not META:  # the channel's next receive: now
                        rk.ahead[w[_CHANNEL]] = self._notice(rank, w[_PEER], clock, it)
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
                new[_POSTED] = clock if is_send else rk.ahead.get(e[9], rk.run_clock) if ahead else \
                    self._notice(rank, peer, clock, it)
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
                if lanes is not None:
                    self._meet(s, r)
                else:
                    node((s[_POSTED], r[_POSTED], _SEND_WAIT))
                    s[_DONE] = len(nodes) + off
                    node((s[_POSTED], r[_POSTED], _LATENCY))
                    arrived = len(nodes) + off
                    node((arrived, arrived, _RECV_CPU))
                    r[_DONE] = arrived + 1
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
        if run != it:  # a new run: its counts start again; the engine posts each channel's first receive now
            rk.counts, rk.forwards, rk.backwards = {}, set(), set()
            rk.ahead, rk.run_clock = {}, rk.clock
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
            behind = {}  # peer: the rank's sends to it posted so far in this batch (their bytes go first)
            for q in rk.queued:
                if q[_IS_SEND]:
                    if q[_MSG][0] is not META:
                        behind[q[_PEER]] = behind.get(q[_PEER], 0) + 1
                    self._post(rk, q)
                else:
                    self._post(rk, q, behind.get(q[_PEER], 0) if self.placement.notice_behind_sends else 0)
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

    def _notice(self, rank, peer, clock, run):
        """The node where a receive posted at `clock` counts as posted: with `Placement.notice_behind_sends` and
        links, once the bytes this rank is sending `peer` (the messages that met so far) have held the link, gloo
        writing the receive's ready-notice behind them."""
        if self.lanes is None or not self.placement.notice_behind_sends:
            return clock
        last = self.lanes.get((rank, peer, run))
        return clock if last is None else self._node(clock, last, _ZERO)

    def _post(self, rk, op, behind=0):
        """`op` posted; a receive whose ready-notice leaves behind `behind` messages of this rank's to the same
        peer (`Placement.notice_behind_sends`) counts as posted once they held the link. Where the peer posted
        later than those took, it is exact; where the two posted closer, the later one's bytes really go first
        and this charges it up to one message's wire more, which a steady exchange's lag (one message) removes."""
        if op[_IS_SEND] or op[_MSG][0] is META:
            op[_POSTED] = rk.clock
        elif self.placement.receives_ahead:
            op[_POSTED] = rk.ahead.get(op[_CHANNEL], rk.run_clock)
        else:
            op[_POSTED] = rk.clock if self.placement.batched_p2p else self._notice(rk.rank, op[_PEER], rk.clock, rk.it)
        if behind and self.lanes is not None and op[_MSG][0] is not META:
            for _ in range(behind):
                op[_POSTED] = self._node(op[_POSTED], op[_POSTED], _WIRE)
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
        self._meet(s, r)
        if r[_MATCH]:
            self._matched(r)

    def _meet(self, s, r):
        """The nodes of a send and its receive that met: the send done `send_wait` after both were posted (and its
        link was free, with lanes), the message there `latency` after, the receive its own time later."""
        a, b = s[_POSTED], r[_POSTED]
        if self.lanes is not None and s[_MSG][0] is not META:  # (a tensor-shape message is a few bytes)
            key = (s[0], s[_PEER], s[_MSG][4])
            last = self.lanes.get(key)
            if last is not None:
                a, b = self._node(a, b, _ZERO), last
            self.lanes[key] = self._node(a, b, _WIRE)
        s[_DONE] = self._node(a, b, _SEND_WAIT)
        # a tensor-shape message is a few bytes: there a send's wait (a small message's latency) once one is given
        arrived = self._node(a, b, _SEND_WAIT if s[_MSG][0] is META else _LATENCY)
        r[_DONE] = self._node(arrived, arrived, _RECV_CPU)

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


def _structure(factory, placement, stages, micro_batches, runs, forward_only, validation, lanes=False):
    """The `_Program` of `runs` runs of the schedule's streams: kept from an earlier call, else simulated (and kept
    when the streams are a function of the schedule, p and m alone)."""
    kept = _replayable(factory)
    key = _program_key(factory, placement, stages, micro_batches) + (forward_only, validation, lanes)
    programs = _STRUCTURES.get(key) if kept else None
    if programs is not None and runs in programs:
        _STRUCTURES.move_to_end(key)
        return programs[runs]
    prog = _Simulation(factory, placement, stages, micro_batches, runs, forward_only, validation,
                       messages=runs == 1, lanes=lanes).run()
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
