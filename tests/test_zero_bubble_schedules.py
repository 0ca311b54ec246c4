"""ZB-H1 and ZB-H2's definitions: constraints and the order of passes on every stage (their closed
forms are in test_closed_forms.py)."""
import pytest

from schedules.definitions.zero_bubble import ZBH1Schedule, ZBH2Schedule


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
                assert [mb for k, mb, _ in order if k == kind] == list(range(9))
            for mb in range(9):  # F before B before W of each micro-batch
                assert order.index(("F", mb, 0)) < order.index(("B", mb, 0)) < order.index(("W", mb, 0))
