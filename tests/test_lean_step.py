"""The lean end of our engines' step (schedules/runtime/lean_step.py): with one data-parallel rank, ReduceGrads
does no flatten / all-reduce / copy (ZeRO 0, and ZeRO 1 in fp32, the shipped config, where it hands DeepSpeed's
ZeRO-1 optimizer its gradients itself), weight gradients accumulate in place, and clipping uses the whole model's
gradient norm; what is trained stays the non-pipelined model's."""
import math

import pytest
import torch

from local_launch import launch
from schedules.runtime import lean_step
from training import TINY, TINY_CHUNKED, assert_same_training, train


def _params(*grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_clip_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    grads = [torch.randn(7, 5), torch.randn(5), torch.randn(3, 3).double()]
    ours, theirs = _params(*grads), _params(*grads)
    norm = lean_step.clip_grads_(ours, 0.5, group=None)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert float(norm) == pytest.approx(float(ref), rel=1e-6)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert float(lean_step.global_grad_norm(ours, None)) == pytest.approx(0.5, rel=1e-5)


def test_clip_below_the_threshold_leaves_gradients_untouched():
    params = _params(torch.tensor([3.0, 4.0]))
    norm = lean_step.clip_grads_(params, 10.0, group=None)
    assert float(norm) == 5.0 and params[0].grad.tolist() == [3.0, 4.0]


def test_replicated_parameters_count_once_but_are_scaled():
    params = _params(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0]))
    params[1].ds_pipe_replicated = True  # DualPipe's second copy, a tied copy
    assert float(lean_step.global_grad_norm(params, None)) == 5.0
    lean_step.clip_grads_(params, 1.0, group=None)
    assert params[0].grad.tolist() == params[1].grad.tolist() == pytest.approx([0.6, 0.8], rel=1e-5)


def test_non_finite_norm_scales_as_deepspeed_does():
    params = _params(torch.tensor([float("inf"), 1.0]))
    norm = lean_step.clip_grads_(params, 1.0, group=None)
    assert math.isinf(float(norm))
    assert params[0].grad[1].item() == 0.0  # 1 * (1 / inf): DeepSpeed's coefficient, applied


def test_zero_missing_grads_gives_trainable_parameters_a_zero_gradient():
    layer = torch.nn.Linear(2, 2)
    layer.bias.requires_grad_(False)
    lean_step.zero_missing_grads(layer)
    assert torch.equal(layer.weight.grad, torch.zeros(2, 2)) and layer.bias.grad is None


class _Engine:
    def __init__(self, zero=0, bf16=False, dp=1, moe=False, fp16=False, module=None):
        self._zero, self.using_bf16_optimizer, self.dp_world_size, self.has_moe_layers = zero, bf16, dp, moe
        self._fp16, self.module = fp16, module or torch.nn.Linear(2, 2)
        self.optimizer = None  # not DeepSpeed's ZeRO-1 optimizer (tests below build the real one)

    def zero_optimization_stage(self):
        return self._zero

    def fp16_enabled(self):
        return self._fp16

    def bfloat16_enabled(self):
        return self.using_bf16_optimizer


def _hooked(post_accumulate):
    layer = torch.nn.Linear(2, 2)
    if post_accumulate:
        layer.weight.register_post_accumulate_grad_hook(lambda p: None)
    else:
        layer.bias.register_hook(lambda g: g)
    return layer


@pytest.mark.parametrize("engine, in_place", [(_Engine(), True), (_Engine(dp=2), True), (_Engine(zero=1), False),
                                              (_Engine(bf16=True), False), (_Engine(fp16=True), False),
                                              (_Engine(module=_hooked(True)), False),
                                              (_Engine(module=_hooked(False)), False)])
def test_gradients_accumulate_in_place_only_where_nothing_watches_them(engine, in_place):
    assert lean_step.accumulates_in_place(engine) is in_place


@pytest.mark.parametrize("engine, lean", [(_Engine(), True), (_Engine(zero=1), False), (_Engine(bf16=True), False),
                                          (_Engine(dp=2), False), (_Engine(moe=True), False)])
def test_only_zero_0_with_one_data_parallel_rank_skips_the_reduction(engine, lean):
    assert lean_step.needs_no_reduction(engine) is lean


PP2 = ["--pipeline-parallel-size", "2"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipe"])
def test_zero_0_clipping_by_the_global_norm_matches_non_pipelined(schedule, sgd_config, references, tmp_path):
    """ZeRO 0, clipping far below the gradient norm (so it bites on every step): the lean step clips by the
    norm of the whole model, each parameter once (DualPipe's copies), like the non-pipelined ZeRO-0 run.
    DeepSpeed's own ZeRO-0 clipping in a pipeline uses each stage's norm (here about 0.44 and 0.94 against
    the model's 1.04 on the first step) and would differ by far more than the tolerance. (DeepSpeed's ZeRO 1
    clips the non-pipelined model slightly differently from its ZeRO 0, by ~1e-5 after two steps: the
    reference is ZeRO 0.)"""
    result = train(tmp_path, 2, PP2 + ["--pipeline-schedule", schedule], sgd_config(zero=0, clip=0.05), 4,
                   model=TINY_CHUNKED)
    clipped = references(4, TINY_CHUNKED, clip=0.05, zero=0)
    assert_same_training(result, clipped)
    unclipped = references(4, TINY_CHUNKED, zero=0)
    assert max((clipped[2][k] - unclipped[2][k]).abs().max().item() for k in unclipped[2]) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_zero_1_with_one_replica_hands_deepspeed_its_gradients_itself(clip):
    """ZeRO 1 in fp32 with one data-parallel rank (the shipped config's optimizer; clipping that bites, or not): our
    engine hands DeepSpeed's ZeRO-1 optimizer the gradients its reduction would (tests/zero1_probe.py), removes its
    gradient hooks, accumulates in place and keeps the weights in the optimizer's fp32 master partition. Three steps
    end with the same fp32 master weights and Adam moments, bit for bit, as DeepSpeed's own reduction gives (with
    and without in-place accumulation), the same losses and norm."""
    run = launch(2, [clip], script="tests/zero1_probe.py", timeout=240)
    assert run.ok, run.explain()
    for out in run.stdout:
        seen = __import__("json").loads([line for line in out.splitlines() if line.startswith("{")][-1])
        reference = seen["deepspeed"]
        assert not reference["lean"] and not reference["in_place"] and reference["hooks"] > 0
        assert seen["lean"]["lean"] and seen["lean"]["in_place"] and seen["lean"]["hooks"] == 0
        assert seen["lean"]["weights_are_master"] and not reference["weights_are_master"]
        assert seen["lean-not-in-place"]["lean"] and not seen["lean-not-in-place"]["in_place"]
        assert (reference["norm"] > clip) == (clip < 1)  # the clipping bites, or not
        exact = seen["lean-not-in-place"]
        assert exact["master_equal"] and exact["moments_equal"] and exact["losses"] == reference["losses"]
        assert seen["lean"]["master_diff"] < 1e-6
        assert seen["lean"]["losses"] == pytest.approx(reference["losses"], abs=1e-6)
        assert seen["lean"]["norm"] == pytest.approx(reference["norm"], rel=1e-6)


@pytest.mark.multiprocess
def test_zero_1_clipping_by_the_global_norm_matches_non_pipelined(sgd_config, references, tmp_path):
    """ZeRO 1 (the shipped config's stage) with one data-parallel rank, clipping that bites: the lean hand-over and
    in-place accumulation train as the non-pipelined ZeRO-1 run does, by the whole model's norm."""
    result = train(tmp_path, 2, PP2 + ["--pipeline-schedule", "zb-h1"], sgd_config(zero=1, clip=0.05), 4,
                   model=TINY_CHUNKED)
    clipped = references(4, TINY_CHUNKED, clip=0.05, zero=1)
    assert_same_training(result, clipped)
    unclipped = references(4, TINY_CHUNKED, zero=1)
    assert max((clipped[2][k] - unclipped[2][k]).abs().max().item() for k in unclipped[2]) > 1e-3


@pytest.mark.multiprocess
def test_the_shipped_config_accumulates_in_place_on_our_engines(tmp_path):
    """train.py with ds_config.json as shipped (ZeRO 1, fp32, no --deepspeed_config) on one of our engines with one
    data-parallel rank: every stage adds its weight gradients into .grad by their multiply."""
    run = launch(2, [*TINY, *PP2, "--pipeline-schedule", "zb-h1", "--steps", "1", "--micro-batch-size", "2",
                     "--dist-timeout", "120"], timeout=240)
    assert run.ok, run.explain()
    lines = [line for err in run.stderr for line in err.splitlines() if "deferrable to W passes" in line]
    assert len(lines) == 2 and all("added into .grad by their multiply" in line for line in lines), lines


@pytest.mark.multiprocess
def test_a_checkpoint_of_the_lean_zero_1_path_resumes_on_deepspeeds_own_engine(tmp_path):
    """The lean ZeRO-1 path keeps DeepSpeed's optimizer and its checkpoint files: zb-h1's checkpoint of step 1
    (the shipped config, our engine), resumed by DeepSpeed's own 1F1B engine, trains step 2 as zb-h1 did."""
    flags = [*TINY_CHUNKED, *PP2, "--micro-batch-size", "2", "--gradient-accumulation-steps", "4",
             "--dist-timeout", "120", "--steps", "2", "--save-dir", tmp_path / "ckpt"]
    run = launch(2, [*flags, "--pipeline-schedule", "zb-h1", "--save-interval", "1",
                     "--metrics-file", tmp_path / "full.jsonl"], timeout=240)
    assert run.ok, run.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    run = launch(2, [*flags, "--pipeline-schedule", "1f1b", "--resume", "--metrics-file", tmp_path / "resumed.jsonl"],
                 timeout=240)
    assert run.ok, run.explain()
    full, resumed = ([__import__("json").loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]
                     for name in ("full.jsonl", "resumed.jsonl"))
    assert len(resumed) == 1 and resumed[0] == pytest.approx(full[1], abs=1e-6)
