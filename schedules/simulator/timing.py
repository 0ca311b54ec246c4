"""Timing: a structure's timing nodes given their times at a call's costs (`_replay`), the passes and their columns
read back (`_Replayed`), and the peaks of activation memory per rank (`_peaks`).
"""
from operator import itemgetter

import numpy as np

from schedules.passes import own_weight_next
from schedules.simulator.pairs import alone_ends, pair_ends, scaled
from schedules.simulator.structure import _RECV_CPU, _SEND_CPU, _WAIT, _ZERO, _slots
from schedules.simulator.timeline import Pass

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
            memo=None, send_wait=None, wire=0.0, comm=None, overlap=True, comm_cpu=None, comm_shape=None,
            comm_fill=None):
    """The times of `segments`, [(program, its first run), ...] one after the other (each starting where the last
    ended), at these costs. A pass's iteration is its run's (`run_iteration`); `wasted`: the runs whose step rolls
    back (`rollback` seconds). `memo` keeps the first segment's times for a next call with the same params.
    `send_wait`: from a message's rendezvous to its send's completion (None: its arrival, `latency`); `wire`: how
    long it holds its link. `comm(rank, chunk, kind)`: the seconds a pass waits for collectives of its own (the
    experts' all-to-alls), run after its computation, or (`overlap`) beside its pair's other pass (_with_comm);
    `comm_cpu(rank, chunk, kind)`: the part of those that keeps the rank's core busy (None: none);
    `comm_shape(rank, chunk, kind)`: how a pass's computation and collectives alternate (None: unknown);
    `comm_fill(rank, chunk, kind, size)`: the seconds of a fused backward's computation that are weight gradients it
    computes while its pair, or it alone, waits for collectives (overlap.fill_with; None: none)."""
    first = segments[0][0]
    p = first.ranks
    out = _Replayed(p)
    out.run_iteration = run_iteration
    send_cpu, recv_cpu = p2p_cpu
    parts = [step_parts(r) for r in range(p)]
    dispatches = [dispatch.get(r, 0.0) for r in range(p)]
    head = ([0.0, latency, send_cpu, recv_cpu, latency if send_wait is None else send_wait, wire] + [0.0] * p
            + dispatches + [b for b, _ in parts]
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
        if comm is not None:
            costs = _with_comm(prog, costs, comm, overlap, comm_cpu, comm_shape, comm_fill)
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


def _partners(prog):
    """Per pass of `prog`, the index of the other pass of its instruction's pair (a forward and a backward run as
    one unit, DualPipe's), or -1. Kept with the program."""
    found = prog.variants.get('partners')
    if found is None:
        found = np.full(len(prog.passes), -1, dtype=np.int64)
        units = {}
        for i, t in enumerate(prog.passes):
            if t[7]:  # paired: its instruction's pair id
                units.setdefault((t[0], t[6]), []).append(i)
        for members in units.values():
            if len(members) == 2:
                found[members[0]], found[members[1]] = members[1], members[0]
        prog.variants['partners'] = found
    return found


def _own_weights(prog):
    """(B, its W) of each B pass of `prog` whose own W is its rank's next pass (passes.own_weight_next). Kept with
    the program."""
    found = prog.variants.get('own weights')
    if found is None:
        rows = {}  # rank -> [(index, its item)] in the rank's order
        for i, t in enumerate(prog.passes):
            rows.setdefault(t[0], []).append((i, None if t[7] else (t[1], t[4], t[3])))  # (kind, mb, chunk)
        found = prog.variants['own weights'] = [
            (row[k][0], row[k + 1][0]) for row in rows.values() for k in own_weight_next([x for _, x in row])]
    return found


def _with_comm(prog, costs, comm, overlap, cpu=None, shape=None, fill=None):
    """The passes' times with their collectives: a pass alone waits for its own after its computation (a + c); the
    two passes of an overlapped pair take turns on the core, each computing while the other's collective is in
    flight, so the pair costs max(a1 + k1, c2) + max(a2 + k2, c1) (computation a, collectives c, of which k keeps
    the core busy: copying, the kernel's work, which no turn hides; both the sums when either side has nothing in
    flight, all of it hidden when each computation outlasts the other's collective). Where `shape` gives both
    passes' shapes (how computation and collectives alternate in each), the pair takes what its turns take
    (pairs.pair_ends, the backward's weight gradients filling the waits where `fill` gives them), split between its
    passes as the closed form splits it."""
    def per_pass(f):
        return np.array([f(rank, chunk, kind) for rank, chunk, kind, _ in prog.keys], dtype=np.float64)[prog.key_of]
    extra = per_pass(comm)
    if not overlap:
        return costs + extra
    kept = per_pass(cpu) if cpu is not None else np.zeros_like(costs)
    busy = costs + kept
    partner = _partners(prog)
    paired = partner >= 0
    out = np.where(paired, np.maximum(busy, extra[np.where(paired, partner, 0)]), costs + extra)
    if shape is None:
        return out
    if fill is not None:  # a fused backward alone fills its own waits with its weight gradients (overlap.run_alone)
        for i in np.nonzero(~paired)[0].tolist():
            key = prog.keys[prog.key_of[i]]
            s = shape(*key[:3]) if key[2] == 'BW' else None
            if s is not None:
                out[i] = sum(alone_ends(scaled(s, costs[i], extra[i], kept[i]), fill=fill(*key)))  # the rest too
        for i, w in _own_weights(prog):  # and a B whose own W comes next with its W's works, the W doing the rest
            s = shape(*prog.keys[prog.key_of[i]][:3])
            if s is not None:
                out[i], out[w] = alone_ends(scaled(s, costs[i] + costs[w], extra[i], kept[i]), fill=costs[w])
    for i in np.nonzero(paired)[0].tolist():
        j = int(partner[i])
        if j < i:
            continue
        # the backward starts (overlap.run_pair(backward, forward))
        members = (i, j) if prog.keys[prog.key_of[i]][2] != 'F' else (j, i)
        shapes = [shape(*prog.keys[prog.key_of[k]][:3]) for k in members]
        if None in shapes:
            continue
        backward = prog.keys[prog.key_of[members[0]]]
        took = max(pair_ends(*(scaled(s, costs[k], extra[k], kept[k]) for s, k in zip(shapes, members)),
                             fill=fill(*backward) if fill is not None else 0.0))
        closed = out[i] + out[j]
        if closed > 0:
            out[i], out[j] = out[i] * took / closed, out[j] * took / closed
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
