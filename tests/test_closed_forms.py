"""Every schedule is the published one: the simulator, reading the very classes the engines run,
meets each schedule's closed forms (idle time, peak activation memory, parameters per rank) at
F = B = W = 1 (a fused backward 2) for p = 2..8. All closed-form checks live here.

(tests/test_chunk_orders.py checks the multi-chunk orders against the same figures with a second,
independent model on purpose.)
"""
import pytest
from deepspeed.runtime.pipe import schedule as ds

from schedules.simulator.simulate import simulate
from test_simulator import check_causality

P = range(2, 9)


# --- 1F1B (DeepSpeed's TrainSchedule) --------------------------------------------------------

@pytest.mark.parametrize('p', range(2, 9))
@pytest.mark.parametrize('m', [1, 2, 3, 5, 8, 16])
def test_1f1b_closed_forms(p, m):
    r = simulate('1f1b', p, m, iterations=1)
    # unit costs: F = 1, BW = 2; 1F1B idles (p-1)(F+B) on every rank, whatever M
    assert r.makespan == 3 * (m + p - 1)
    for row in r.per_rank:
        assert row['busy'] == 3 * m
        assert row['idle_synced'] == 3 * (p - 1)
        assert row['params'] == 1
    assert r.per_rank[0]['peak_activation_memory'] == min(p, m)
    assert r.worst('peak_activation_memory') == min(p, m)
    check_causality(r.timeline, p)


def test_1f1b_interlocked_and_inference():
    # 1F1B: rank 0 both starts and ends an iteration, so chaining iterations gains nothing.
    r = simulate('1f1b', 4, 8, iterations=5)
    assert r.period == r.makespan == 33
    assert all(row['idle_interlocked'] == 9 for row in r.per_rank)
    assert r.chained.iterations() == [0, 1, 2, 3, 4]
    check_causality(r.chained, 4)
    # Forward-only pipelining: the drain of one batch overlaps the fill of the next.
    r = simulate(ds.InferenceSchedule, 4, 8, forward_only=True)
    assert r.makespan == 8 + 3 and r.period == 8
    assert all(row['idle_synced'] == 3 and row['idle_interlocked'] == 0 for row in r.per_rank)


# --- ZB-H1, ZB-H2 ---------------------------------------------------------------------------

@pytest.mark.parametrize("p", P)
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_memory(p, extra):
    m = p + extra
    zb, stock = simulate("zb-h1", p, m), simulate("1f1b", p, m)
    for row, ref in zip(zb.per_rank, stock.per_rank):
        assert row["idle_synced"] == (p - 1) * (1 + 1 - 1)  # (p-1)(F + B - W)
        assert ref["idle_synced"] == 3 * (p - 1)
        assert row["busy"] == ref["busy"] == 3 * m
    assert zb.per_rank[0]["peak_activation_memory"] == stock.per_rank[0]["peak_activation_memory"] == p
    assert zb.worst("peak_activation_memory") == p


@pytest.mark.parametrize("p", P)
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_zb_h2_interlocks_with_zero_bubble(p, extra):
    m = 2 * p - 1 + extra
    zb = simulate("zb-h2", p, m)
    for row in zb.per_rank:
        assert row["idle_interlocked"] == 0
        assert row["idle_synced"] == p - 1  # the parallelogram's slant, paid only when the step synchronises
    assert zb.per_rank[0]["peak_activation_memory"] == 2 * p - 1  # up to 2p-1 micro-batches in flight
    assert zb.period == 3 * m


# --- Interleaved 1F1B, ZB-V, DualPipeV, DualPipe ---------------------------------------------

@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("rounds", [1, 2])
def test_interleaved_divides_the_1f1b_bubble_by_v(p, rounds):
    m = rounds * p
    result = simulate("interleaved", p, m)
    for row in result.per_rank:
        assert row["idle_synced"] == pytest.approx(3 * (p - 1) / 2)  # (p-1)(F+B)/v, v = 2
        assert row["busy"] == pytest.approx(3 * m)


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("extra", [0, 3])
def test_zb_v_has_zero_interlocked_bubble_at_1f1b_memory(p, extra):
    result = simulate("zb-v", p, 2 * p - 1 + extra)
    for row in result.per_rank:
        assert row["idle_interlocked"] == pytest.approx(0)
        assert row["peak_activation_memory"] == pytest.approx(p)  # 1F1B's, on every rank


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipev_bubble(p):
    # DualPipe's (p'/2 - 1)(F&B + B - 3W) over the 2p half-size chunks of the V (p' = 2p ranks' worth):
    # F&B = F + BW = 1.5, B (fused) = 1, W = 0.5 per half chunk -> (p - 1)(1.5 + 1 - 1.5) = p - 1
    result = simulate("dualpipev", p, 2 * p + 2)
    assert result.worst("idle_synced") == pytest.approx(p - 1)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_dualpipe_bubble_and_memory(p):
    # (p/2 - 1)(F&B + B - 3W) with F&B = F + BW = 3, B (fused) = 2, W = 1 -> p - 2
    result = simulate("dualpipe", p, 2 * p + 4)
    assert result.worst("idle_synced") == pytest.approx(p - 2)
    assert result.worst("peak_activation_memory") == pytest.approx(p + 1)
    assert all(row["params"] == 2 for row in result.per_rank)  # two copies of a 1/p stage


# --- V-Half, V-Min (Pipeline Parallelism with Controllable Memory) ----------------------------
# The authors' summary table (F = B = W, activations in micro-batches through 1/p of the model):
#   V-Half: memory (p+2)//2, bubble rate ~ p/(2m);  V-Min: memory (p+4)//3, bubble rate ~ 2p/(3m);
#   1F1B: p and ~ p/m. Memory is counted as the paper counts it (an activation is freed by its W); the
# simulator's default also frees half of it at B, which only lowers V-Min at p = 2 (1.5 for 2).
# Exactly, the synchronised idle per rank (the same on every rank, 3m + idle the step) is, in forward units,
#   V-Half: 3 floor((p-1)/2) - 1/2 for p >= 3 (1/2 at p = 2)   ~ 3p/2 = p/(2m) of 3m
#   V-Min:  2p - 5/2, or 2p - 7/2 when 3 divides p               ~ 2p   = 2p/(3m) of 3m
# (the block's gap: V-Min's B1 waits 2 more slots when 3 divides p, which the reorder then recovers).

def _v_half_idle(p):
    return 0.5 if p == 2 else 3 * ((p - 1) // 2) - 0.5


def _v_min_idle(p):
    return 2 * p - 2.5 - (p % 3 == 0)


CONTROLLABLE = {"v-half": (lambda p: (p + 2) // 2, _v_half_idle), "v-min": (lambda p: (p + 4) // 3, _v_min_idle)}


def _paper_memory(p):
    """The paper's accounting on the V placement: F adds a half-stage activation, W frees it, B frees nothing."""
    return {(r, c): {"F": 0.5, "B": 0.0, "W": -0.5} for r in range(p) for c in range(2)}


@pytest.mark.parametrize("p", P)
@pytest.mark.parametrize("name", CONTROLLABLE)
def test_controllable_memory_closed_forms(name, p):
    from schedules.definitions.controllable_memory import min_micro_batches
    memory, idle = CONTROLLABLE[name]
    least = min_micro_batches(name, p)
    for m in sorted({least, least + 3, 3 * p}):
        result = simulate(name, p, m, iterations=1)
        for row in result.per_rank:
            assert row["busy"] == pytest.approx(3 * m)
            assert row["idle_synced"] == pytest.approx(idle(p)), (m, row)
            assert row["params"] == 1
        assert simulate(name, p, m, iterations=1, memory=_paper_memory(p)).worst("peak_activation_memory") == memory(p)
        default = result.worst("peak_activation_memory")
        assert default == (1.5 if (name, p) == ("v-min", 2) else memory(p)), m
        check_causality(result.timeline, p)


@pytest.mark.parametrize("p", [16, 24])
def test_controllable_memory_is_a_half_and_a_third_of_1f1b(p):
    """For large p the peaks approach p/2 and p/3 of 1F1B's p, and the idle the published bubble rates
    (p/(2m) and 2p/(3m) of the 3m step) give."""
    from schedules.definitions.controllable_memory import min_micro_batches
    stock = simulate("1f1b", p, p, iterations=1).worst("peak_activation_memory")
    assert stock == p
    for name, share, idle in [("v-half", 1 / 2, 3 * p / 2), ("v-min", 1 / 3, 2 * p)]:
        result = simulate(name, p, min_micro_batches(name, p), iterations=1)
        ratio = result.worst("peak_activation_memory") / stock
        assert abs(ratio - share) <= 4 / (3 * p), (name, ratio)
        assert abs(result.worst("idle_synced") / idle - 1) <= 4 / p, (name, result.worst("idle_synced"))
