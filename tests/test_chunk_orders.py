"""The compute orders of the multi-chunk schedules: Interleaved 1F1B, ZB-V, DualPipeV, DualPipe.

Independent of schedules/simulator on purpose: the orders are checked here by a second, much
simpler model (list scheduling with dependencies, no instructions, no communication), written
apart from the simulator so that a bug in one cannot hide a bug in the other.

1. Completeness: every (micro-batch, chunk) has one F and one backward (B then W, or fused) on
   its rank, F before B before W.
2. Executability and published figures: a list-scheduling simulation of all ranks (each runs its
   list in order, a pass starts once its inputs are done, no communication time) must finish
   without deadlock; with F = B = W = 1 per stage it gives each rank's idle time and, counted
   along the order, its peak activation memory, which we hold to the published figures.
3. Equality with PyTorch's orders (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
   ScheduleDualPipeV), built on fake stage objects without a process group.
"""
from fractions import Fraction
from types import SimpleNamespace

import pytest

from schedules.definitions.dualpipe import dualpipe_order
from schedules.definitions.interleaved import interleaved_1f1b_order, interleaved_round_size
from schedules.definitions.vshape import dualpipev_order, zbv_order
from schedules.passes import Action, Paired, actions, paired

PS = range(2, 9)


# --- placements: (rank, chunk) -> (pipeline, stage); a micro-batch of a pipeline visits its stages in order


def interleaved_placement(p, v):
    return dict(stage=lambda r, c: (0, c * p + r), stages=v * p, size=Fraction(1, v))


def v_placement(p):
    return dict(stage=lambda r, c: (0, r if c == 0 else 2 * p - 1 - r), stages=2 * p, size=Fraction(1, 2))


def mirror_placement(p):
    # two copies of a p-stage model: pipeline = direction = chunk; a chunk is a whole stage
    return dict(stage=lambda r, c: (c, r if c == 0 else p - 1 - r), stages=p, size=Fraction(1))


# --- passes


def parts(unit):
    """The (kind, mb, chunk) parts of a compute unit; a fused backward 'BW' stays one part."""
    assert isinstance(unit, (Action, Paired)), unit
    return list(actions([unit]))


def check_complete(orders, p, chunks, m_per_chunk):
    """Every (micro-batch, chunk) once: F, then B and W (or BW); micro-batches of a kind in order."""
    for r, order in orders.items():
        seen = {}
        for unit in order:
            for kind, mb, c in parts(unit):
                assert kind in ('F', 'B', 'W', 'BW') and 0 <= c < chunks and 0 <= mb < m_per_chunk, (r, unit)
                seen.setdefault((mb, c), []).append(kind)
        assert set(seen) == {(mb, c) for mb in range(m_per_chunk) for c in range(chunks)}, r
        for key, kinds in seen.items():
            assert kinds in (['F', 'B', 'W'], ['F', 'BW']), (r, key, kinds)
        for kind in ('F', 'B', 'W', 'BW'):  # so per-chunk buffers can be reused round robin
            for c in range(chunks):
                mbs = [mb for unit in order for k, mb, cc in parts(unit) if cc == c and (k == kind or
                       kind in ('B', 'W') and k == 'BW')]
                assert mbs == sorted(mbs), (r, kind, c)


# --- the simulation


def simulate(orders, placement, cost=None):
    """Run every rank's list in order; a pass starts when its rank is free and its inputs are done:
    F of stage s needs F of stage s-1; B needs B of stage s+1, or the F on the last stage; W needs
    the B. A paired unit starts when both parts can and ends after both. Unit costs per stage
    (F = B = W = 1) scaled by the chunk size. Raises AssertionError on deadlock.
    Returns (finish time per rank, busy time per rank, makespan)."""
    stage_of, last, size = placement['stage'], placement['stages'] - 1, placement['size']
    cost = cost or {'F': 1, 'B': 1, 'W': 1}
    done = {}  # (pipe, stage, kind, mb) -> finish time

    def needs(kind, mb, r, c):
        pipe, s = stage_of(r, c)
        if kind == 'F':
            return [(pipe, s - 1, 'F', mb)] if s > 0 else []
        if kind in ('B', 'BW'):
            return [(pipe, s, 'F', mb), (pipe, s + 1, 'B', mb) if s < last else (pipe, s, 'F', mb)]
        return [(pipe, s, 'B', mb)]

    def duration(kind):
        return size * (cost['B'] + cost['W'] if kind == 'BW' else cost[kind])

    pos = {r: 0 for r in orders}
    free = {r: Fraction(0) for r in orders}
    busy = {r: Fraction(0) for r in orders}
    while any(pos[r] < len(orders[r]) for r in orders):
        progressed = False
        for r in orders:
            while pos[r] < len(orders[r]):
                unit_parts = parts(orders[r][pos[r]])
                deps = [d for kind, mb, c in unit_parts for d in needs(kind, mb, r, c)]
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + sum(duration(kind) for kind, _, _ in unit_parts)
                for kind, mb, c in unit_parts:
                    pipe, s = stage_of(r, c)
                    for k in (('B', 'W') if kind == 'BW' else (kind, )):
                        done[(pipe, s, k, mb)] = end
                free[r] = end
                busy[r] += end - start
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])}
            raise AssertionError(f"deadlock: each rank waits at {stuck}")
    return free, busy, max(free.values())


def idle(orders, placement):
    """Idle time per rank in a synchronised step: all ranks start together, the step ends when the
    last rank finishes (an optimizer step that synchronises the ranks)."""
    _, busy, makespan = simulate(orders, placement)
    return {r: makespan - busy[r] for r in orders}


def peak_memory(order, size):
    """Peak activation memory along one rank's order, in stage-activations of a micro-batch: F adds a
    chunk's activations (size), B and W each release half, a fused backward all. In a paired unit
    the forward counts first."""
    live = peak = Fraction(0)
    for unit in order:
        for kind, _, _ in parts(unit):
            live += {'F': size, 'B': -size / 2, 'W': -size / 2, 'BW': -size}[kind]
            peak = max(peak, live)
    assert live == 0
    return peak


def interlocked_period(make_order, p, m, placement, iterations=4):
    """Time each extra iteration adds when the ranks run iteration after iteration without
    synchronising (micro-batches renumbered per iteration): the steady cost of one iteration."""
    def orders(k):
        out = {}
        for r in range(p):
            out[r] = []
            for it in range(k):
                for unit in make_order(r):
                    later = [a._replace(micro_batch=a.micro_batch + it * m) for a in parts(unit)]
                    out[r].append(Paired(*later) if isinstance(unit, Paired) else later[0])
        return out

    spans = [simulate(orders(k), placement)[2] for k in (iterations, iterations + 1)]
    return spans[1] - spans[0]


# --- schedule tables


def interleaved_ms(p):
    return [m for m in (1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 2, 3 * p, 3 * p + 3, 4 * p)
            if m >= 1 and interleaved_round_size(p, m)]


def all_orders(fn, p, *args):
    return {r: fn(p, *args, r) for r in range(p)}


# --- 1. completeness and 2. executability


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_complete_and_executable(p, v):
    for m in interleaved_ms(p):
        orders = {r: interleaved_1f1b_order(p, m, v, r) for r in range(p)}
        check_complete(orders, p, v, m)
        simulate(orders, interleaved_placement(p, v))


@pytest.mark.parametrize("p", PS)
def test_zbv_complete_and_executable(p):
    for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p + 2):
        orders = all_orders(zbv_order, p, m)
        check_complete(orders, p, 2, m)
        simulate(orders, v_placement(p))


@pytest.mark.parametrize("p", PS)
def test_dualpipev_complete_and_executable(p):
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 2):
        orders = all_orders(dualpipev_order, p, m)
        check_complete(orders, p, 2, m)
        simulate(orders, v_placement(p))


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dualpipe_complete_and_executable(p):
    for m in (2 * p, 2 * p + 2, 3 * p, 4 * p + 2):
        if m % 2:
            continue
        orders = all_orders(dualpipe_order, p, m)
        check_complete(orders, p, 2, m // 2)
        simulate(orders, mirror_placement(p))


def test_a_deadlock_is_detected():
    orders = {r: interleaved_1f1b_order(4, 8, 2, r) for r in range(4)}
    orders[3] = [orders[3][1], orders[3][0]] + orders[3][2:]  # F of micro-batch 1 before 0: fine
    simulate(orders, interleaved_placement(4, 2))
    bw = [u for u in orders[0] if u[0] == 'BW']
    orders[0] = [bw[0]] + [u for u in orders[0] if u != bw[0]]  # a backward before any forward
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(orders, interleaved_placement(4, 2))


# --- constraints


@pytest.mark.parametrize("call, flag", [
    (lambda: interleaved_1f1b_order(4, 9, 2, 0), "--gradient-accumulation-steps"),
    (lambda: interleaved_1f1b_order(4, 14, 2, 0), "--gradient-accumulation-steps"),
    (lambda: interleaved_1f1b_order(4, 8, 1, 0), "--virtual-stages"),
    (lambda: interleaved_1f1b_order(1, 8, 2, 0), "--pipeline-parallel-size"),
    (lambda: zbv_order(4, 6, 0), "--gradient-accumulation-steps"),
    (lambda: dualpipev_order(4, 7, 0), "--gradient-accumulation-steps"),
    (lambda: dualpipe_order(4, 6, 0), "--gradient-accumulation-steps"),
    (lambda: dualpipe_order(4, 9, 0), "--gradient-accumulation-steps"),
    (lambda: dualpipe_order(3, 12, 0), "--pipeline-parallel-size"),
])
def test_constraints_name_the_flag(call, flag):
    with pytest.raises(ValueError, match=flag):
        call()


def test_interleaved_names_valid_neighbours():
    with pytest.raises(ValueError, match="use 8 or 10"):
        interleaved_1f1b_order(4, 9, 2, 0)


# --- published figures (F = B = W = 1 per stage; a fused backward B+W = 2)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_1f1b_over_v(p, v):
    """(p-1)(F + B)/v on every rank with F = 1 and the fused backward B = 2, for every accepted m >= p
    (multiples of p or not); below p the steady state is short of micro-batches and the bubble grows."""
    for m in interleaved_ms(p):
        orders = {r: interleaved_1f1b_order(p, m, v, r) for r in range(p)}
        got = set(idle(orders, interleaved_placement(p, v)).values())
        if m >= p:
            assert got == {Fraction(3 * (p - 1), v)}, m
        else:
            assert len(got) == 1 and got.pop() > Fraction(3 * (p - 1), v), m


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_memory(p, v):
    """Rank r holds up to (v-1)g + 2(p-1-r) + 1 chunk activations (g = micro-batches per round): with
    g = p the first rank holds p + (p-1)/v stages, p(1 + (p-1)/(pv)) as published."""
    for m in interleaved_ms(p):
        g = interleaved_round_size(p, m)
        for r in range(p):
            chunks = min((v - 1) * g + 2 * (p - 1 - r) + 1, v * m)
            assert peak_memory(interleaved_1f1b_order(p, m, v, r), Fraction(1, v)) == Fraction(chunks, v), (m, r)
    assert peak_memory(interleaved_1f1b_order(p, 4 * p, v, 0), Fraction(1, v)) == p + Fraction(p - 1, v)


@pytest.mark.parametrize("p", PS)
def test_zbv_memory_is_1f1b(p):
    """Peak activation memory p stages (1F1B's first stage) on every rank."""
    for m in (2 * p - 1, 3 * p, 4 * p):
        assert {peak_memory(zbv_order(p, m, r), Fraction(1, 2)) for r in range(p)} == {p}


@pytest.mark.parametrize("p", PS)
def test_zbv_zero_bubble_when_iterations_interlock(p):
    """Run iteration after iteration: each adds exactly the work of a rank (no bubble): 2 chunks x m
    micro-batches x (F + B + W) x 1/2 = 3m, as 1F1B's stage."""
    for m in (2 * p - 1, 2 * p, 3 * p):
        assert interlocked_period(lambda r: zbv_order(p, m, r), p, m, v_placement(p)) == 3 * m


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dualpipe_bubble(p):
    """(p/2 - 1)(F&B + B - 3W) with chunk costs F = W = 1, full backward B = 2, F&B = F + B = 3."""
    for m in (2 * p, 3 * p, 4 * p):
        if m % 2:
            continue
        got = idle(all_orders(dualpipe_order, p, m), mirror_placement(p))
        assert set(got.values()) == {(p // 2 - 1) * (3 + 2 - 3)}, (m, got)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dualpipe_memory(p):
    """Activation memory p + 1 stages (a chunk is a whole stage) on every rank."""
    for m in (2 * p, 4 * p):
        assert {peak_memory(dualpipe_order(p, m, r), Fraction(1)) for r in range(p)} == {p + 1}


@pytest.mark.parametrize("p", PS)
def test_dualpipev_memory(p):
    """Activation memory PP + 1 chunk-stages with PP = 2p: p + 1/2 stages on every rank."""
    for m in (2 * p, 4 * p):
        assert {peak_memory(dualpipev_order(p, m, r), Fraction(1, 2)) for r in range(p)} == {p + Fraction(1, 2)}


@pytest.mark.parametrize("p", PS)
def test_zbv_synchronised_bubble(p):
    """In a synchronised step ZB-V idles (p-1)/2 per rank: (p-1) chunk forwards, the time the first
    micro-batch takes to reach the last rank (the interlocked run above hides it)."""
    for m in (2 * p - 1, 3 * p):
        assert set(idle(all_orders(zbv_order, p, m), v_placement(p)).values()) == {Fraction(p - 1, 2)}


@pytest.mark.parametrize("p", PS)
def test_dualpipev_bubble(p):
    """DualPipe's formula over the 2p half-size chunks: (2p/2 - 1)(F&B + B - 3W) with F = W = 1/2,
    B = 1, F&B = 3/2: p - 1 stage-passes."""
    for m in (2 * p, 3 * p, 4 * p):
        got = idle(all_orders(dualpipev_order, p, m), v_placement(p))
        assert set(got.values()) == {p - 1}, (m, got)


# --- DualPipeV is DualPipe cut in half


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dualpipev_is_half_of_dualpipe(n):
    """Rank r < n of DualPipe on 2n ranks with 2m micro-batches runs DualPipeV's rank r (phase = chunk);
    rank 2n-1-r runs its mirror image (chunks swapped)."""
    swap = {0: 1, 1: 0}

    def mirrored(unit):
        if isinstance(unit, Paired):
            return Paired(*(mirrored(a) for a in unit))
        return Action(unit.kind, unit.micro_batch, swap[unit.chunk])

    for m in (2 * n, 3 * n + 1, 4 * n):
        for r in range(n):
            assert dualpipe_order(2 * n, 2 * m, r) == dualpipev_order(n, m, r)
            assert dualpipe_order(2 * n, 2 * m, 2 * n - 1 - r) == [mirrored(u) for u in dualpipev_order(n, m, r)]


def test_dualpipev_defers_weights():
    """DeepSeek's WeightGradStore: the split backwards ('B') of Steps 3, 6 and 7 and their W later,
    oldest first; the rest fused. p = 4, rank 1: Step 3 has 2 split B1, Step 6 splits its second
    pair, Step 7 has 2 split B0."""
    order = dualpipev_order(4, 8, 1)
    split = [(u[1], u[2]) for u in order if u[0] == 'B']
    weights = [(u[1], u[2]) for u in order if u[0] == 'W']
    assert split == weights == [(0, 1), (1, 1), (7, 1), (5, 0), (6, 0), (7, 0)]
    assert [u[0] for u in order[-6:]] == ['W', 'B', 'W', 'B', 'W', 'W']  # Step 7: 2 x W B0, Step 8: 2 x W


def test_dualpipev_fused_is_deepspeeds():
    """Without the W deferral (each split B fused where it runs, W dropped) and with the pairs taken
    apart, DualPipeV is DeepSpeed's DualPipeVSchedule: its ForwardPass/BackwardPass in order, buffer
    phase * m + micro-batch, phase = chunk."""
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p + 1):
            for r in range(p):
                ours = []
                for unit in dualpipev_order(p, m, r):
                    for kind, mb, c in parts(unit):
                        if kind != 'W':
                            ours.append(('F' if kind == 'F' else 'BW', mb, c))
                theirs = [('F' if type(cmd).__name__ == 'ForwardPass' else 'BW', cmd.buffer_id % m, cmd.phase)
                          for step in ds.DualPipeVSchedule(m, p, r).steps() for cmd in step
                          if type(cmd).__name__ in ('ForwardPass', 'BackwardPass')]
                assert ours == theirs, (p, m, r)


# --- messages between ranks, for whoever turns the orders into instruction streams


def messages(orders, placement):
    """Per ordered pair of ranks (src, dst), the messages src sends (right after each pass, in its
    order) and those dst receives (right before each pass that needs them, in its order): an
    activation into stage s+1 after F of stage s, a gradient into stage s-1 after B (or BW) of stage
    s; none when the neighbour stage is on the same rank. A paired unit receives both inputs before
    it and sends both outputs after it, forward part first."""
    stage_of, last = placement['stage'], placement['stages'] - 1
    rank_of = {stage_of(r, c): r for r in orders for unit in orders[r] for _, _, c in parts(unit)}
    sends, recvs = {}, {}
    for r, order in orders.items():
        for unit in order:
            for kind, mb, c in parts(unit):
                pipe, s = stage_of(r, c)
                if kind == 'F' and s > 0 and rank_of[(pipe, s - 1)] != r:
                    recvs.setdefault((rank_of[(pipe, s - 1)], r), []).append(('act', pipe, s, mb))
                if kind in ('B', 'BW') and s < last and rank_of[(pipe, s + 1)] != r:
                    recvs.setdefault((rank_of[(pipe, s + 1)], r), []).append(('grad', pipe, s, mb))
            for kind, mb, c in parts(unit):
                pipe, s = stage_of(r, c)
                if kind == 'F' and s < last and rank_of[(pipe, s + 1)] != r:
                    sends.setdefault((r, rank_of[(pipe, s + 1)]), []).append(('act', pipe, s + 1, mb))
                if kind in ('B', 'BW') and s > 0 and rank_of[(pipe, s - 1)] != r:
                    sends.setdefault((r, rank_of[(pipe, s - 1)]), []).append(('grad', pipe, s - 1, mb))
    assert sends.keys() == recvs.keys()
    return {pair: (sends[pair], recvs[pair]) for pair in sends}


def _cases():
    for p in (2, 3, 4, 8):
        for m in (2 * p, 3 * p + 2):
            if interleaved_round_size(p, m):
                orders = {r: interleaved_1f1b_order(p, m, 2, r) for r in range(p)}
                yield "interleaved", orders, interleaved_placement(p, 2)
            yield "zbv", all_orders(zbv_order, p, m), v_placement(p)
            yield "dualpipev", all_orders(dualpipev_order, p, m), v_placement(p)
            if p % 2 == 0:
                yield "dualpipe", all_orders(dualpipe_order, p, m), mirror_placement(p)


def test_messages_match_per_kind():
    """Between two ranks, the activations arrive in the order they are sent, and so do the gradients:
    one FIFO channel per (src, dst, kind) pairs sends and receives without tags."""
    for name, orders, placement in _cases():
        for pair, (sent, received) in messages(orders, placement).items():
            for kind in ('act', 'grad'):
                assert [x for x in sent if x[0] == kind] == [x for x in received if x[0] == kind], (name, pair)


def test_one_channel_per_pair_only_for_interleaved():
    """With a single FIFO channel per (src, dst) (NCCL matches a pair's sends and receives in the order
    they are posted and ignores tags), Interleaved 1F1B still matches, but on the V and mirror
    placements a channel carries activations of one chunk and gradients of the other in the same
    direction, and "receive right before use" posts them in another order than they are sent, for some
    (p, m) of each (ZB-V and DualPipeV from p = 3 on, DualPipe at p = 8)."""
    broken = set()
    for name, orders, placement in _cases():
        mismatched = [pair for pair, (sent, received) in messages(orders, placement).items() if sent != received]
        if name == "interleaved":
            assert mismatched == [], (len(orders), mismatched)
        elif mismatched:
            broken.add((name, len(orders)))
    assert {name for name, _ in broken} == {"zbv", "dualpipev", "dualpipe"}
    assert ("dualpipe", 8) in broken and all((name, 3) in broken for name in ("zbv", "dualpipev"))


# --- 3. equality with PyTorch's orders


def _torch_orders(cls, p, m, stages_of_rank, num_stages):
    """PyTorch's pipeline_order for every rank, built on fake stages (no process group)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    stages = [SimpleNamespace(group_size=p, group_rank=0, stage_index=s, num_stages=num_stages, submod=None)
              for s in stages_of_rank(0)]
    return getattr(sched, cls)(stages, m).pipeline_order  # the constructor computes every rank's order


def _to_tuples(actions, chunk_of_stage):
    kinds = {'F': 'F', 'I': 'B', 'W': 'W', 'B': 'BW'}

    def one(a):
        return kinds[a.computation_type.value], a.microbatch_index, chunk_of_stage(a.stage_index)

    out = []
    for a in actions:
        if a is None:
            continue  # an idle slot of PyTorch's lock-step table
        if a.computation_type.value == 'OVERLAP_F_B':
            f, b = (one(x) for x in a.sub_actions)
            assert f[0] == 'F' and b[0] in ('B', 'BW')
            out.append(paired(f[1:], b[1:], fused=b[0] == 'BW'))
        else:
            out.append(one(a))
    return out


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_equals_pytorch(p, v):
    for m in interleaved_ms(p):
        torch_orders = _torch_orders("ScheduleInterleaved1F1B", p, m, lambda r: [c * p + r for c in range(v)], v * p)
        for r in range(p):
            assert _to_tuples(torch_orders[r], lambda s: s // p) == interleaved_1f1b_order(p, m, v, r), (m, r)


def test_interleaved_accepts_what_pytorch_accepts():
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    for p in (2, 3, 4):
        for m in range(1, 5 * p):
            ours = interleaved_round_size(p, m) is not None
            stages = [SimpleNamespace(group_size=p, group_rank=0, stage_index=s, num_stages=2 * p, submod=None)
                      for s in (0, p)]
            try:
                sched.ScheduleInterleaved1F1B(stages, m)
                theirs = True
            except ValueError:
                theirs = False
            assert ours == theirs, (p, m)


def _v_chunk(p):
    return lambda s: 0 if s < p else 1


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_equals_pytorch(p):
    for m in (2 * p - 1, 2 * p, 3 * p + 1, 4 * p):
        torch_orders = _torch_orders("ScheduleZBVZeroBubble", p, m, lambda r: [r, 2 * p - 1 - r], 2 * p)
        for r in range(p):
            assert _to_tuples(torch_orders[r], _v_chunk(p)) == zbv_order(p, m, r), (m, r)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipev_equals_pytorch(p):
    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
        torch_orders = _torch_orders("ScheduleDualPipeV", p, m, lambda r: [r, 2 * p - 1 - r], 2 * p)
        for r in range(p):
            assert _to_tuples(torch_orders[r], _v_chunk(p)) == dualpipev_order(p, m, r), (m, r)


def test_own_weight_next_finds_a_b_whose_w_follows_it():
    """passes.own_weight_next: a B whose next item is its own W (same micro-batch and chunk), and no other: DualPipe's
    last B on each rank's first stage at p = 2 (its last Ws follow their Bs there), mirrored on the other rank."""
    from schedules.passes import own_weight_next
    order = [Action('B', 3), Action('W', 3), Action('B', 4, 1), paired((1, 0), (2, 1)), Action('B', 5), Action('W', 6),
             ('B', 7, 0), ('W', 7, 0), Action('B', 8), Action('F', 8), Action('W', 8)]
    assert own_weight_next(order) == {0, 6}
    for rank, chunk in ((0, 0), (1, 1)):
        o = dualpipe_order(2, 8, rank)
        assert [o[i] for i in sorted(own_weight_next(o))] == [Action('B', 3, chunk)]
        assert o[-2:] == [Action('B', 3, chunk), Action('W', 3, chunk)]
