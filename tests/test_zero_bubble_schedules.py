"""ZB-H1 and ZB-H2 are the published schedules: the simulator, reading the very classes the engine
runs, meets the paper's closed forms at F = B = W = 1 for p = 2..8."""
import pytest

from schedules.simulate import simulate
from schedules.zero_bubble import ZBH1Schedule, ZBH2Schedule

P = range(2, 9)


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


@pytest.mark.parametrize("cls,minimum", [(ZBH1Schedule, lambda p: p), (ZBH2Schedule, lambda p: 2 * p - 1)])
def test_too_few_micro_batches_is_a_clear_error(cls, minimum):
    for p in (2, 4, 8):
        with pytest.raises(ValueError, match=f"--gradient-accumulation-steps >= {minimum(p)}"):
            cls(micro_batches=minimum(p) - 1, stages=p, stage_id=0)
    with pytest.raises(ValueError, match="--pipeline-parallel-size >= 2"):
        cls(micro_batches=8, stages=1, stage_id=0)


def test_every_stage_runs_each_pass_once_in_order():
    for cls in (ZBH1Schedule, ZBH2Schedule):
        for stage in range(4):
            order = cls(micro_batches=9, stages=4, stage_id=stage).compute_order()
            for kind in "FBW":
                assert [mb for k, mb in order if k == kind] == list(range(9))
            for mb in range(9):  # F before B before W of each micro-batch
                assert order.index(("F", mb)) < order.index(("B", mb)) < order.index(("W", mb))
