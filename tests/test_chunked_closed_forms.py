"""The schedules with several chunks per rank, run by the simulator (the same classes the engine runs),
meet their published figures at F = B = W = 1 for p = 2..8."""
import pytest

from schedules.simulate import simulate


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
