"""W really is deferred in the running engine: it executes its schedule's stream in order, and
weight gradients appear only with the W passes."""
import json

import pytest

from local_launch import launch

pytestmark = pytest.mark.multiprocess  # every test here starts processes


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2"])
def test_engine_executes_the_stream_and_defers_weight_gradients(schedule):
    run = launch(2, [schedule], script="tests/split_engine_probe.py", timeout=120)
    assert run.ok, run.explain()
    for out in run.stdout:
        seen = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])  # logs may follow
        assert seen["executed"] == [list(x) for x in seen["stream"]]
        assert [k for k, _ in seen["executed"]].count("W") == 4
        linear_b, other_b = seen["after_first_b"]
        linear_w, other_w = seen["after_first_w"]
        assert linear_b and not any(linear_b), "a linear weight got its gradient in B"
        assert other_b and all(other_b), "LayerNorm gradients belong to B"
        assert all(linear_w) and all(other_w)


def test_no_forward_output_outlives_its_backward():
    """DeepSpeed's backward keeps the last stage's output (the logits) until its buffer is reused. Stock 1F1B has
    two buffers there; our schedules have one per micro-batch in flight, and held every micro-batch's logits to
    the end of the step and between steps (GPTlite small at 32 x 64 tokens: 412 MB each). Our engines drop each
    output with its backward; DeepSpeed's own engine (1f1b) shows what the check catches."""
    ours = ["zb-h1", "zb-v", "dualpipe", "1f1b-lean"]
    run = launch(2, ["1f1b", *ours], script="tests/held_outputs_probe.py", timeout=180)
    assert run.ok, run.explain()
    for out in run.stdout:
        seen = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        for name in ours:
            assert seen[name]["held"] == 0, f"{name}: {seen[name]}"
        stock = seen["1f1b"]
        assert (stock["held"] > 0) == stock["last_stage"], stock
