"""The engine of a model that is not pipelined (schedules/runtime/lean_engine.py): with one data-parallel rank in fp32,
LeanEngine drops ZeRO 1's hooks, reduction and weight copy and accumulates weight gradients in place, and trains
as DeepSpeed's own engine does (tests/lean_engine_probe.py trains both from the same weights and micro-batches)."""
import json

import pytest

from local_launch import launch

CASES = [  # (ZeRO stage, clipping, model, a step with non-finite gradients)
    (1, 0.05, "gptlite", False),  # the shipped config's stage, clipping that bites
    (1, 1e3, "plain", False),  # plain torch layers, made deferrable by the engine
    (1, 1e3, "gptlite", True),  # a non-finite norm: the step is skipped, as DeepSpeed's ZeRO-1 step skips it
    (0, 0.05, "gptlite", False),
    (0, 0.05, "plain", False),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero,clip,model,nan", CASES)
def test_lean_engine_trains_as_deepspeeds_own(zero, clip, model, nan):
    """Three steps of 4 micro-batches: with the weight gradients handed to autograd, LeanEngine ends with DeepSpeed's
    weights and optimizer state bit for bit (same losses, same skipped step); added in place, within 1e-6. At ZeRO 1
    its step is ours, DeepSpeed's hooks are gone and the weights are the optimizer's fp32 master partition."""
    run = launch(1, [zero, clip, model] + (["nan"] if nan else []), script="tests/lean_engine_probe.py", timeout=240)
    assert run.ok, run.explain()
    seen = json.loads([line for line in run.stdout[0].splitlines() if line.startswith("{")][-1])
    reference, exact, lean = seen["deepspeed"], seen["lean-not-in-place"], seen["lean"]
    assert reference["engine"] == "DeepSpeedEngine" and exact["engine"] == lean["engine"] == "LeanEngine"
    assert lean["in_place"] and not exact["in_place"]
    if zero == 1:
        assert reference["hooks"] > 0 and not reference["weights_are_master"]
        assert lean["our_step"] and lean["hooks"] == 0 and lean["weights_are_master"]
        assert (reference["norm"] > clip) == (clip < 1)  # the clipping bites, or not
    else:
        assert (lean["norm"] > clip) == (clip < 1)
    assert exact["weights_equal"] and exact["moments_equal"] and exact["losses"] == reference["losses"]
    assert lean["weights_diff"] < 1e-6
    assert lean["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert reference["skipped"] == exact["skipped"] == lean["skipped"] == (1 if nan else 0)
    assert reference["steps"] == lean["steps"] == 3
