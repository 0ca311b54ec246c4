"""DeepSpeed pipelines of GPTlite, stock 1F1B and the zero-bubble schedules, train exactly like
the non-pipelined model: same losses, validation losses and weights after two plain-SGD steps
over the same micro-batches (see tests/training.py)."""
import json

import pytest
import torch

from local_launch import launch
from training import TOL, assert_same_training, train

pytestmark = pytest.mark.multiprocess  # every test here starts processes

MICRO_BATCHES = 8  # per optimizer step, over all data-parallel ranks


@pytest.fixture(scope="module")
def reference(references):
    return references(MICRO_BATCHES)


def initial_weights():
    import gptlite
    from layers import layer_state_dict
    return layer_state_dict(gptlite.get_model(model_size="tiny", seed=3).to_layers())


def test_reference_really_trains(reference):
    """Guards the comparisons below: the weights moved, by far more than the tolerance."""
    losses, _, weights = reference
    start = initial_weights()
    moved = max((weights[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2
    assert losses[1] < losses[0] + 1.0


@pytest.mark.parametrize("nprocs,flags", [
    (2, ["--pipeline-parallel-size", "2"]),
    (2, ["--pipeline-parallel-size", "2", "--pipeline-spec-layers", "--activation-checkpoint-interval", "1"]),
    (4, ["--pipeline-parallel-size", "4", "--pipeline-spec-layers"]),
    (4, ["--pipeline-parallel-size", "4", "--activation-checkpoint-interval", "2", "--partition-method", "uniform"]),
    (4, ["--pipeline-parallel-size", "2", "--pipeline-spec-layers"]),  # 2 stages x 2 data-parallel
    (2, ["--pipeline-parallel-size", "0"]),  # data parallel only
],
                         ids=["pp2", "pp2-spec-ckpt1", "pp4-spec", "pp4-ckpt2-uniform", "pp2xdp2-spec", "dp2"])
def test_pipeline_matches_non_pipelined(nprocs, flags, sgd_config, reference, tmp_path):
    pp = int(flags[1])
    dp = nprocs // max(pp, 1)
    assert_same_training(train(tmp_path, nprocs, flags, sgd_config(), MICRO_BATCHES, dp=dp), reference)


# Zero-bubble schedules (split backward), and 1F1B on our engine (1f1b-lean), against the same non-pipelined
# runs, which stock 1F1B matches above: p = 2 and 4, several micro-batch counts, both builds, activation
# checkpointing, ZeRO 0 and 1, data parallelism beside the pipeline.
ZB_CASES = {
    "zb-h1-pp2-m8": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h1"], 8, 1),
    "1f1b-lean-pp2-m4-zero0": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "1f1b-lean"], 4, 0),
    "zb-h1-pp2-m4-spec-zero0": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                    "--pipeline-spec-layers"], 4, 0),
    "zb-h1-pp4-m8-spec-ckpt1": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-h1",
                                    "--pipeline-spec-layers", "--activation-checkpoint-interval", "1"], 8, 1),
    "zb-h2-pp2-m4-ckpt2-zero0": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h2",
                                     "--activation-checkpoint-interval", "2"], 4, 0),
    "zb-h2-pp4-m8-spec": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-h2",
                              "--pipeline-spec-layers", "--partition-method", "uniform"], 8, 1),
    "zb-h2-pp2xdp2-m8": (4, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h2",
                             "--pipeline-spec-layers"], 8, 1),
}


@pytest.mark.parametrize("case", ZB_CASES)
def test_zero_bubble_matches_non_pipelined(case, sgd_config, references, tmp_path):
    nprocs, flags, micro_batches, zero = ZB_CASES[case]
    dp = nprocs // int(flags[1])
    result = train(tmp_path, nprocs, flags, sgd_config(zero), micro_batches, dp=dp)
    assert_same_training(result, references(micro_batches))


def test_zero_bubble_bf16_matches_stock_1f1b(sgd_config, tmp_path):
    """bf16 with DeepSpeed's BF16 optimizer, which moves gradients to fp32 after every backward
    pass: gradients that W writes later must reach it too. Same arithmetic, so equal weights."""
    flags = ["--pipeline-parallel-size", "2", "--bf16"]
    stock = train(tmp_path / "1f1b", 2, flags, sgd_config(1), 4)
    split = train(tmp_path / "zb", 2, flags + ["--pipeline-schedule", "zb-h1"], sgd_config(1), 4)
    assert split[0] == stock[0]
    for name, ref in stock[2].items():
        assert ref.dtype == torch.bfloat16
        assert torch.equal(split[2][name], ref), name


def test_resume_gives_the_same_next_losses(tmp_path):
    """AdamW with the warm-up/cosine schedule: a resumed run restores optimizer and LR state too."""
    flags = ["--model", "gptlite", "--model-size", "tiny", "--steps", "4", "--micro-batch-size", "2",
             "--gradient-accumulation-steps", "2", "--pipeline-parallel-size", "2", "--pipeline-spec-layers",
             "--save-dir", tmp_path / "ckpt", "--save-interval", "2", "--dist-timeout", "120"]
    full = launch(2, flags + ["--metrics-file", tmp_path / "full.jsonl"])
    assert full.ok, full.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step2")  # roll back to the step-2 checkpoint
    resumed = launch(2, flags + ["--resume", "--metrics-file", tmp_path / "resumed.jsonl"])
    assert resumed.ok, resumed.explain()
    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]
    full_losses, resumed_losses = losses("full.jsonl"), losses("resumed.jsonl")
    assert len(full_losses) == 4 and len(resumed_losses) == 2
    assert resumed_losses == pytest.approx(full_losses[2:], abs=TOL)
    assert full_losses[2] != pytest.approx(full_losses[1], abs=1e-3)  # the steps really differ
