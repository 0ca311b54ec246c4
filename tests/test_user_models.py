"""Every schedule on models a DeepSpeed user writes (tests/user_models.py: plain torch.nn.Linear layers, a
tied input/output embedding, a tuple with an int64 mask between stages, a sequence length that changes
between micro-batches), built with `schedules.pipeline_module` and trained with
`schedules.initialize`: two plain-SGD steps equal a single-process reference (losses and every weight
within 1e-5), and where a schedule splits the backward, W passes compute a share of the nn.Linear
weight gradients (the layers were not rewritten: initialize made them deferrable)."""
import json

import pytest

from local_launch import launch

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TOL = 1e-5
ALL = ["1f1b", "zb-h1", "zb-h2", "interleaved", "zb-v", "dualpipev", "dualpipe", "dualpipev-deepspeed"]
SPLITS = {"zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe"}  # schedules with B and W passes
OURS_FUSED = {"interleaved"}  # our engine, every backward fused


def run(ranks, model, schedules, micro_batches=8, clip=0.0, checkpoint=0, save=None, zero=1):
    done = launch(ranks, [model, micro_batches, *schedules, "--clip", clip, "--checkpoint", checkpoint,
                          "--zero", zero, *(["--save", save] if save else [])],
                  script="tests/user_model_probe.py", timeout=400)
    assert done.ok, done.explain()
    results = [json.loads(line) for line in done.stdout[0].splitlines() if line.startswith("{")]
    assert [r["schedule"] for r in results] == list(schedules)
    return results, done.stderr


def check(results, linear_on_every_rank=True):
    for r in results:
        name = r["schedule"]
        assert r["missing"] == [], (name, r["missing"])
        assert r["moved"] > 100 * TOL, name  # the weights did change: equal means the same gradients
        assert r["loss_diff"] < TOL and r["weight_diff"] < TOL, (name, r["loss_diff"], r["weight_diff"])
        assert r["val_loss_diff"] < TOL, (name, r["val_loss_diff"])  # eval_batch on the trained weights
        if name in SPLITS and linear_on_every_rank:
            assert all(share > 0 for share in r["shares"]), (name, r["shares"])
        elif name in OURS_FUSED:  # 0, or None on a rank with nothing deferrable
            assert all(not share for share in r["shares"]), (name, r["shares"])


@pytest.mark.parametrize("model,schedules", [
    ("mlp", ALL),
    ("tied", ALL),
    ("tied-chunked", ALL),  # the library's chunked head and loss (schedules/runtime/chunked_head.py)
    ("masked", ALL),
    ("dynamic", [s for s in ALL if s != "dualpipev-deepspeed"]),  # DeepSpeed's DualPipeV refuses dynamic shapes
    ("conv", ALL),
    ("experts", ALL),  # the library's ExpertLayer: its aux loss trained where it is made, no pipeline message
])
def test_schedules_at_2_ranks(model, schedules):
    results, stderr = run(2, model, schedules)
    check(results, linear_on_every_rank=model != "conv")  # the conv net's one Linear is on one rank
    assert any("deferrable to W passes" in err for err in stderr)  # initialize says what W can take on
    if model == "conv":  # the stages without a Linear are told that their W passes do nothing
        assert any("has no torch.nn.Linear (or nn.Embedding) to defer" in err for err in stderr)


@pytest.mark.parametrize("model,schedules", [("tied", ["interleaved", "zb-v", "dualpipe"]),
                                              ("masked", ["zb-h1", "dualpipev"])])
def test_selected_schedules_at_4_ranks(model, schedules, tmp_path):
    """At 4 ranks; each trained model is also saved and loaded into a fresh engine (tied modules, both of
    DualPipe's copies): every layer comes back as trained."""
    results = run(4, model, schedules, save=tmp_path)[0]
    check(results)
    for r in results:
        assert r["reloaded"] and r["reload_diff"] == 0, (r["schedule"], r["reloaded"], r["reload_diff"])


def test_tied_model_with_clipping_biting_and_checkpointing_by_class_name():
    """Clipping by the global norm counts a tied weight once; `checkpointable_layers=["Block"]` (DeepSpeed's
    rule) is honoured on every placement, chunks included."""
    results, _ = run(2, "tied", ["1f1b", "interleaved", "zb-v", "dualpipe"], clip=0.05, checkpoint=2)
    check(results)
    for r in results:
        assert all(norm > 0.05 for norm in r["grad_norms"]), r["schedule"]  # the clipping changed both steps
        assert all(n > 0 for n in r["checkpointed"]), (r["schedule"], r["checkpointed"])


DEEPSPEED_OWN = {"1f1b", "dualpipev-deepspeed"}  # DeepSpeed's engines, ours not involved


@pytest.mark.parametrize("model,clip", [("tied", 0.05), ("masked", 0.0)])
def test_zero_0_adds_weight_gradients_in_place(model, clip):
    """At ZeRO 0 in fp32 our engines add each weight gradient into .grad by its multiply (in-place
    accumulation, spare gradient tensors between steps): on the user's models, a tied weight that gets its
    gradient from two layers and clipping that bites (post-validated) included, training is still exact.

    With clipping, DeepSpeed's own engines at ZeRO 0 clip by the first stage's norm (DeepSpeed 0.19.8's
    clip_grad_norm_ counts model-parallel rank 0's parameters only), so they are not exact there: initialize
    warns, and the stock 1F1B run shows the difference (when a DeepSpeed upgrade fixes it, this fails and the
    warning goes)."""
    schedules = [s for s in ALL if not (clip and s in DEEPSPEED_OWN)] + (["1f1b"] if clip else [])
    results, stderr = run(2, model, schedules, clip=clip, zero=0)
    check([r for r in results if not (clip and r["schedule"] in DEEPSPEED_OWN)])
    assert any("added into .grad by their multiply" in err for err in stderr)
    if clip:
        for r in results:
            assert all(norm > clip for norm in r["grad_norms"]), r["schedule"]
        stock = results[-1]
        assert stock["loss_diff"] > 1e3 * TOL, stock  # clipped by the first stage's norm
        assert any("clips every stage by the first stage's gradient norm" in err for err in stderr)
    else:
        assert not any("first stage's gradient norm" in err for err in stderr)


def test_the_readme_example_trains():
    """examples/own_model.py, the README's library section, runs and learns (2 ranks, ZB-V)."""
    done = launch(2, ["--schedule", "zb-v", "--steps", "10"], script="examples/own_model.py", timeout=300)
    assert done.ok, done.explain()
    losses = [float(line.rsplit(" ", 1)[1]) for line in done.stdout[0].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], losses
