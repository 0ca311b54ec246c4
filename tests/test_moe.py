"""GPTlite as a Mixture of Experts (schedules/runtime/moe.py, train.py --moe-experts): DeepSpeed's gate and experts,
the aux loss trained where it is made, experts sharded over a stage's data-parallel ranks.

In one process: the aux loss's attached gradient equals adding `coef x aux` to the loss; expert e starts from the
same weights whichever rank holds it; exports name experts by their global index. Launched: two plain-SGD steps of
every schedule equal the non-pipelined model's (losses and every weight within 1e-5), with experts sharded over 2
data-parallel ranks too; a layout where a rank holds no experts, and a resume under another layout, are refused in
one line.
"""
import pytest
import torch
import torch.nn as nn

from local_launch import launch
from schedules.runtime import moe
from training import TINY, assert_same_training, run_in_process, train, write_config, write_sgd_config

MOE = ("--n-layer", "6", "--partition-method", "uniform", "--moe-experts", "4", "--moe-top-k", "2",
       "--moe-capacity-factor", "0")


def _layer(coef=0.1, seed=5):
    torch.manual_seed(seed)
    return moe.ExpertLayer(8, lambda e: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=4,
                           k=2, capacity_factor=0, aux_loss_coef=coef)


def test_the_attached_aux_loss_trains_as_if_added_to_the_loss():
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    layer = _layer()
    layer.aux_scale = 0.25  # the engine's 1 / micro-batches
    (layer(x).pow(2).mean() * 0.25).backward()
    attached = {n: p.grad.clone() for n, p in layer.named_parameters()}
    explicit = _layer(coef=0.0)
    out, aux, _ = explicit.moe(x)
    ((out.pow(2).mean() + 0.1 * aux) * 0.25).backward()
    plain = _layer(coef=0.0)
    (plain(x).pow(2).mean() * 0.25).backward()
    gate = "moe.deepspeed_moe.gate.wg.weight"
    for name, p in explicit.named_parameters():
        assert torch.allclose(attached[name], p.grad, atol=1e-7, rtol=0), name
    moved = (attached[gate] - dict(plain.named_parameters())[gate].grad).abs().max().item()
    assert moved > 1e-4  # the aux loss does reach the gate


def test_each_expert_starts_the_same_whichever_rank_holds_it(monkeypatch):
    whole = _layer()
    experts = whole.moe.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0][0].weight, experts[1][0].weight)  # each its own weights
    monkeypatch.setattr(moe, "expert_parallel_rank", lambda ep: 1)  # the second of 2 expert-parallel ranks
    torch.manual_seed(5)
    half = moe.ExpertLayer(8, lambda e: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=4,
                           ep_size=2, k=2, capacity_factor=0)
    assert half.first_expert == 2
    for local, expert in enumerate(half.moe.deepspeed_moe.experts.deepspeed_experts):
        assert torch.equal(expert[0].weight, experts[2 + local][0].weight)
    assert torch.equal(half.moe.deepspeed_moe.gate.wg.weight, whole.moe.deepspeed_moe.gate.wg.weight)
    name = moe.EXPERTS_PREFIX + "1.0.weight"
    assert moe.global_expert_name(half, name) == moe.EXPERTS_PREFIX + "3.0.weight"
    assert moe.global_expert_name(half, "moe.deepspeed_moe.gate.wg.weight") == "moe.deepspeed_moe.gate.wg.weight"


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_sgd_config(tmp_path_factory.mktemp("moe") / "sgd.json")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, config):
    return train(tmp_path_factory.mktemp("one"), 1, [*MOE, "--pipeline-parallel-size", "0"], config, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [
    ["--pipeline-schedule", "1f1b"],
    ["--pipeline-schedule", "1f1b-lean"],
    ["--pipeline-schedule", "zb-h1", "--activation-checkpoint-interval", "1"],
    ["--pipeline-schedule", "zb-h2"],
    ["--pipeline-schedule", "zb-v", "--vocab-parallel"],
    ["--pipeline-schedule", "interleaved"],
    ["--pipeline-schedule", "v-half"],
    ["--pipeline-schedule", "v-min"],
    ["--pipeline-schedule", "dualpipev"],
    ["--pipeline-schedule", "dualpipe"],
    ["--pipeline-schedule", "dualpipev-deepspeed"],
], ids=lambda f: " ".join(f[1:]))
def test_every_schedule_trains_the_moe_model_as_one_process(flags, tmp_path, config, one_process):
    result = train(tmp_path, 2, [*MOE, "--pipeline-parallel-size", "2", *flags], config, 4)
    assert_same_training(result, one_process)
    assert result[1][1] < result[1][0] - 0.1  # it did train


@pytest.mark.multiprocess
def test_experts_sharded_over_two_data_parallel_ranks(tmp_path, config):
    """Expert-parallel 2 without a pipeline, with 1F1B and ZB-V over 2 stages of 2 replicas each: the same
    training, and the same as every replica holding every expert (the experts' gradients scaled alike)."""
    sharded = ["--expert-parallel-size", "2"]
    reference = train(tmp_path / "ref", 2, [*MOE, "--pipeline-parallel-size", "0", *sharded], config, 8, dp=2)
    whole = train(tmp_path / "whole", 2, [*MOE, "--pipeline-parallel-size", "0"], config, 8, dp=2)
    assert_same_training(whole, reference)
    for schedule in ("1f1b", "zb-v"):
        result = train(tmp_path / schedule, 4, [*MOE, "--pipeline-parallel-size", "2", "--pipeline-schedule",
                                                schedule, *sharded], config, 8, dp=2)
        assert_same_training(result, reference)


@pytest.mark.multiprocess
def test_a_rank_without_experts_is_refused_in_one_line():
    """ZB-V at 2 ranks by parameters: rank 0 holds the embedding and the head only."""
    run = launch(2, [*TINY, "--moe-experts", "4", "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v",
                     "--gradient-accumulation-steps", "4", "--steps", "1", "--dist-timeout", "60"], timeout=120)
    assert set(run.returncodes) == {2}, run.explain()
    lines = [line for line in run.stderr[0].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rank 0 holds no layer with experts" in lines[0] and "--partition-method" in lines[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1f1b over replicas", "dualpipe shared by copies"])
def test_a_checkpoint_resumes_the_experts_exactly(layout, tmp_path):
    """Three AdamW steps saved after each; resumed from step 1, steps 2 and 3 are the uninterrupted run's: every
    rank's experts and their optimizer state come back, the experts sharded over replicas or shared by DualPipe's
    copies."""
    import json
    ranks, flags = (4, ["--pipeline-schedule", "1f1b", "--expert-parallel-size", "2"]) if layout.startswith("1f1b") \
        else (2, ["--pipeline-schedule", "dualpipe", "--dualpipe-experts", "shard"])
    common = [*TINY, *MOE, "--pipeline-parallel-size", "2", "--micro-batch-size", "2", "--gradient-accumulation-steps",
              "4", "--eval-interval", "0", "--dist-timeout", "60", "--save-dir", tmp_path / "ckpt", *flags]

    def losses(path):
        return [json.loads(line)["loss"] for line in path.read_text().splitlines() if "loss" in json.loads(line)]
    run = launch(ranks, [*common, "--steps", "3", "--save-interval", "1", "--metrics-file", tmp_path / "full.jsonl"],
                 timeout=240)
    assert run.ok, run.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    run = launch(ranks, [*common, "--steps", "3", "--resume", "--metrics-file", tmp_path / "resumed.jsonl"],
                 timeout=240)
    assert run.ok, run.explain()
    full = losses(tmp_path / "full.jsonl")
    assert len(full) == 3 and losses(tmp_path / "resumed.jsonl") == pytest.approx(full[1:], abs=1e-6)


@pytest.mark.multiprocess
def test_resume_under_another_layout_is_refused_in_one_line(tmp_path, config, monkeypatch, capsys):
    saved = tmp_path / "ckpt"
    run = launch(2, [*TINY, *MOE, "--pipeline-parallel-size", "2", "--steps", "1", "--gradient-accumulation-steps",
                     "4", "--save-dir", saved, "--deepspeed_config", config], timeout=120)
    assert run.ok, run.explain()
    status, stderr, _ = run_in_process([*TINY, *MOE, "--steps", "2", "--gradient-accumulation-steps", "4",
                                        "--deepspeed_config", str(config), "--resume-from", str(saved),
                                        "--save-dir", str(tmp_path / "other")], monkeypatch, capsys)
    assert status == 2 and "Mixture of Experts" in stderr and "--pipeline-parallel-size 2" in stderr, stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "dualpipe --dualpipe-experts shard"])
def test_four_stages_train_the_moe_model_as_one_process(schedule, tmp_path, config):
    """DualPipe: ranks r and 3-r each hold half of the experts of stages r and 3-r, exchanging tokens."""
    nine = [*MOE, "--n-layer", "9"]  # 12 layers cut uniformly: every stage, the last too, holds blocks with experts
    reference = train(tmp_path / "ref", 1, [*nine, "--pipeline-parallel-size", "0"], config, 8)
    result = train(tmp_path / "p4", 4, [*nine, "--pipeline-parallel-size", "4", "--pipeline-schedule",
                                        *schedule.split()], config, 8)
    assert_same_training(result, reference)


@pytest.mark.multiprocess
def test_four_stages_of_two_replicas_with_their_experts_sharded(tmp_path, config):
    """p = 4 and expert-parallel size 2 (8 ranks): each stage's experts halved over its two replicas, the same
    training as the non-pipelined model with its experts sharded the same way."""
    nine, sharded = [*MOE, "--n-layer", "9"], ["--expert-parallel-size", "2"]
    reference = train(tmp_path / "ref", 2, [*nine, "--pipeline-parallel-size", "0", *sharded], config, 8, dp=2)
    result = train(tmp_path / "p4", 8, [*nine, "--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-h1",
                                        *sharded], config, 8, dp=2, timeout=480)
    assert_same_training(result, reference)


def _bitwise_equal(result, reference):
    (losses, val, weights), (ref_losses, ref_val, ref_weights) = result, reference
    assert losses == ref_losses and val == ref_val
    assert weights.keys() == ref_weights.keys()
    different = [name for name in weights if not torch.equal(weights[name], ref_weights[name])]
    assert not different, f"differ: {different}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dualpipe shared by copies", "dualpipev over replicas"])
def test_overlapped_pairs_equal_sequential_pairs_bit_for_bit(layout, tmp_path, config):
    """DualPipe's and DualPipeV's forward-backward pairs with the experts' all-to-alls in flight while the other
    pass computes (schedules/runtime/overlap.py): the same losses and weights as the pairs run one pass after the
    other, to the bit, and as no pipeline. DualPipe at 2 ranks: the two copies of each stage hold half its experts
    each (--dualpipe-experts shard, the default); DualPipeV: 2 stages x 2 replicas, experts sharded over the
    replicas."""
    if layout.startswith("dualpipe "):
        ranks, dp, flags = 2, 1, ["--pipeline-schedule", "dualpipe", "--dualpipe-experts", "shard"]
    else:
        ranks, dp, flags = 4, 2, ["--pipeline-schedule", "dualpipev", "--expert-parallel-size", "2"]
    flags = [*MOE, "--pipeline-parallel-size", "2", *flags]
    overlapped = train(tmp_path / "on", ranks, [*flags, "--overlap", "on"], config, 8, dp=dp)
    sequential = train(tmp_path / "off", ranks, [*flags, "--overlap", "off"], config, 8, dp=dp)
    _bitwise_equal(overlapped, sequential)
    if dp > 1:  # DualPipe's shared experts against no pipeline: test_four_stages_..., test_clipping_...
        reference = train(tmp_path / "ref", dp, [*MOE, "--pipeline-parallel-size", "0", "--expert-parallel-size", "2"],
                          config, 8, dp=dp)
        assert_same_training(overlapped, reference)


DEEP_MOE = ("--model", "deep", "--deep-width", "16", "--deep-depth", "4", "--micro-batch-size", "8",
            "--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "0")


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipe --dualpipe-experts shard"])
def test_the_moe_deep_model_trains_as_one_process(schedule, tmp_path, config):
    """The deep model's blocks with experts (--model deep --moe-experts): ZB-H1; DualPipe's copies sharing them, at
    width 512, where each dense layer's weight gradient (1 MiB) is summed between the copies as soon as the stage's
    last backward (the last B filling its waits with its own W's works, or a lone fused backward) has added it
    (copies_sum.py): summed out of order, two ranks' sums would pair different layers."""
    model = (*DEEP_MOE, "--deep-width", "512") if schedule.startswith("dualpipe") else DEEP_MOE
    reference = train(tmp_path / "ref", 1, ["--pipeline-parallel-size", "0"], config, 4, model=model)
    result = train(tmp_path / "p2", 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", *schedule.split()],
                   config, 4, model=model)
    assert_same_training(result, reference)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dualpipe shared by copies", "1f1b over replicas"])
def test_clipping_counts_every_expert_once(layout, tmp_path):
    """Clipping by the global gradient norm (0.05: every step clips) with experts held once across the ranks: by one
    of DualPipe's two copies each, or by one of two replicas each; the same training as no pipeline."""
    clipped = write_config(tmp_path / "clip.json", clip=0.05, scheduler=False)
    if layout.startswith("dualpipe"):
        ranks, dp, flags = 2, 1, ["--pipeline-schedule", "dualpipe", "--dualpipe-experts", "shard"]
    else:
        ranks, dp, flags = 4, 2, ["--pipeline-schedule", "1f1b", "--expert-parallel-size", "2"]
    reference = train(tmp_path / "ref", dp, [*MOE, "--pipeline-parallel-size", "0",
                                             *(["--expert-parallel-size", "2"] if dp > 1 else [])], clipped, 8, dp=dp)
    result = train(tmp_path / "pp", ranks, [*MOE, "--pipeline-parallel-size", "2", *flags], clipped, 8, dp=dp)
    assert_same_training(result, reference)


@pytest.mark.multiprocess
def test_overlapped_pairs_with_activation_checkpointing(tmp_path, config):
    """Each pass recomputes its own chunk's layers although the other pass of its pair activated another chunk (the
    active chunk is per thread)."""
    flags = [*MOE, "--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe", "--dualpipe-experts", "shard",
             "--activation-checkpoint-interval", "1"]
    overlapped = train(tmp_path / "on", 2, flags, config, 8)
    sequential = train(tmp_path / "off", 2, [*flags, "--overlap", "off"], config, 8)
    _bitwise_equal(overlapped, sequential)


@pytest.mark.multiprocess
def test_bf16_trains_the_moe_model_as_one_process(tmp_path, config):
    """--bf16 (DeepSpeed's BF16 optimizer: bf16 weights and activations, fp32 master weights and gradients) with
    DualPipe's copies sharing the experts and its pairs overlapped, against the one-process bf16 run: the weights
    after two SGD steps within 5% of the second step's update, all of them and the experts alone (measured: 1.2%
    and 1.5%; a gradient off by a factor of two would be a whole update off), the losses within 0.1%, the two copies
    of each stage equal. Not tensor by tensor: an expert's batch differs between the layouts (tokens of both copies'
    micro-batches), bf16 rounds its products differently, and a token whose top-2 experts nearly tie can flip."""
    flags = [*MOE, "--bf16"]
    first = train(tmp_path / "first", 1, [*flags, "--pipeline-parallel-size", "0", "--steps", "1"], config, 8)[2]
    reference = train(tmp_path / "ref", 1, [*flags, "--pipeline-parallel-size", "0"], config, 8)
    result = train(tmp_path / "pp", 2, [*flags, "--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe",
                                        "--dualpipe-experts", "shard", "--overlap", "on"], config, 8)
    assert result[0] == pytest.approx(reference[0], rel=1e-3) and result[0][1] < result[0][0] - 0.1
    weights, ref_weights = result[2], reference[2]
    assert {k for k in weights if not k.startswith("mirror:")} == ref_weights.keys()

    def off(names):  # |weights - reference| over |the reference's second step|, over these tensors together
        diff = sum(((weights[n] - ref_weights[n]).float().norm() ** 2).item() for n in names)
        step = sum(((ref_weights[n] - first[n]).float().norm() ** 2).item() for n in names)
        return (diff / step) ** 0.5
    experts = [n for n in ref_weights if ".deepspeed_experts." in n]
    assert experts and off(ref_weights) < 0.05 and off(experts) < 0.05, (off(ref_weights), off(experts))
    for name in ref_weights:
        if f"mirror:{name}" in weights:
            assert torch.equal(weights[f"mirror:{name}"], weights[name]), f"{name}: the mirrored copies differ"
