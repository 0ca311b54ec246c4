"""Schedules with several model chunks per rank train exactly like the non-pipelined model:
Interleaved 1F1B, ZB-V, V-Half, V-Min, DualPipeV (V placement) and DualPipe (mirror placement), at 2 and 4
ranks, several micro-batch counts, both builds, activation checkpointing for each, data
parallelism beside each placement (see tests/training.py for what "exactly" means); and
DeepSpeed's own DualPipeV over the same model, for comparison.
DualPipe's two copies of each stage stay equal after every step."""
import json

import pytest
import torch

from local_launch import launch
from training import TINY_CHUNKED, TOL, assert_same_training, train, write_config

pytestmark = pytest.mark.multiprocess  # every test here starts processes

PP2, PP4 = ["--pipeline-parallel-size", "2"], ["--pipeline-parallel-size", "4"]
SPEC, CKPT = ["--pipeline-spec-layers"], ["--activation-checkpoint-interval", "1"]
CASES = {  # name: (ranks, flags, micro-batches per step)
    "interleaved-pp2-m4-ckpt": (2, PP2 + CKPT, 4),
    "interleaved-pp4-m8-spec": (4, PP4 + SPEC, 8),
    "interleaved-v3-pp2-m6-spec": (2, PP2 + SPEC + ["--virtual-stages", "3"], 6),
    "interleaved-pp2xdp2-m8-spec": (4, PP2 + SPEC, 8),
    "zb-v-pp2-m4-spec-ckpt": (2, PP2 + SPEC + CKPT, 4),
    "zb-v-pp4-m8": (4, PP4, 8),
    "zb-v-pp2xdp2-m8-spec": (4, PP2 + SPEC, 8),
    "dualpipev-pp2-m4-ckpt": (2, PP2 + CKPT, 4),
    "dualpipev-pp4-m8-spec": (4, PP4 + SPEC, 8),
    "v-half-pp2-m4-ckpt": (2, PP2 + CKPT, 4),
    "v-half-pp4-m8-spec": (4, PP4 + SPEC, 8),
    "v-min-pp2-m4-spec": (2, PP2 + SPEC, 4),
    "v-min-pp4-m8": (4, PP4, 8),
    "dualpipe-pp2-m4-ckpt": (2, PP2 + CKPT, 4),
    "dualpipe-pp4-m8-spec": (4, PP4 + SPEC, 8),
    "dualpipe-pp2xdp2-m8-spec": (4, PP2 + SPEC, 8),
    "dualpipev-deepspeed-pp2-m4-spec": (2, PP2 + SPEC, 4),  # DeepSpeed's own, for comparison
}


# ZeRO 0 in fp32: weight gradients added into .grad by their multiply (fused and deferred backwards, with and
# without data parallelism); the other cases run ZeRO 1, where autograd accumulates them.
ZERO_0 = {"interleaved-pp4-m8-spec", "zb-v-pp4-m8", "zb-v-pp2xdp2-m8-spec", "dualpipev-pp4-m8-spec"}


def schedule_of(case):
    return next(s for s in ("interleaved", "zb-v", "v-half", "v-min", "dualpipev-deepspeed", "dualpipev", "dualpipe")
                if case.startswith(s + "-"))


@pytest.mark.parametrize("case", CASES)
def test_chunked_schedule_matches_non_pipelined(case, sgd_config, references, tmp_path):
    ranks, flags, micro_batches = CASES[case]
    dp = ranks // int(flags[1])
    zero = 0 if case in ZERO_0 else 1
    result = train(tmp_path, ranks, flags + ["--pipeline-schedule", schedule_of(case)], sgd_config(zero=zero),
                   micro_batches, dp=dp, model=TINY_CHUNKED)
    if schedule_of(case) == "dualpipe":
        assert any(k.startswith("mirror:") for k in result[2])
    assert_same_training(result, references(micro_batches, TINY_CHUNKED, zero=zero))


def test_dualpipe_clipping_counts_each_parameter_once(sgd_config, references, tmp_path):
    """With gradient clipping on (and biting: the clip is far below the gradient norm), DualPipe's two
    copies of each stage must not count twice in the global norm: same weights as one rank."""
    result = train(tmp_path, 2, PP2 + ["--pipeline-schedule", "dualpipe"], sgd_config(clip=0.05), 4,
                   model=TINY_CHUNKED)
    clipped = references(4, TINY_CHUNKED, clip=0.05)
    assert_same_training(result, clipped)
    unclipped = references(4, TINY_CHUNKED)
    assert max((clipped[2][k] - unclipped[2][k]).abs().max().item() for k in unclipped[2]) > 1e-3


@pytest.fixture(scope="module")
def bf16_stock(sgd_config, tmp_path_factory):
    return train(tmp_path_factory.mktemp("bf16"), 2, PP2 + ["--bf16"], sgd_config(), 4, model=TINY_CHUNKED)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe", "interleaved", "dualpipev"])
def test_bf16_matches_stock_1f1b(schedule, bf16_stock, sgd_config, tmp_path):
    """bf16 weights, fp32 gradient accumulation in DeepSpeed's BF16 optimizer: deferred W, fused
    backwards, local hand-overs and DualPipe's mirrored gradient sum (on the optimizer's fp32
    gradients) lose nothing."""
    result = train(tmp_path, 2, PP2 + ["--bf16", "--pipeline-schedule", schedule], sgd_config(), 4, model=TINY_CHUNKED)
    # bf16 losses: DualPipe adds two ranks' partial sums, so they may round one bf16 step apart
    assert result[0] == pytest.approx(bf16_stock[0], rel=1e-2)
    for name, ref in bf16_stock[2].items():
        assert ref.dtype == torch.bfloat16 and torch.equal(result[2][name], ref), name


@pytest.fixture(scope="module")
def zero0_config(tmp_path_factory):
    """ds_config.json (AdamW, warm-up LR schedule, clipping 1.0) with ZeRO 0: what --interlock needs."""
    return write_config(tmp_path_factory.mktemp("cfg") / "zero0.json", zero=0)


@pytest.mark.parametrize("schedule, interlock", [("zb-v", "zero0"), ("zb-v", "zero1"), ("zb-v", "zero1-bf16"),
                                               ("dualpipe", None)])
def test_resume_gives_the_same_next_losses(schedule, interlock, zero0_config, tmp_path):
    """Checkpoints hold each chunk's layers (DualPipe: one copy of each stage, loaded into both). ZB-V runs
    `--interlock 2` (AdamW, LR schedule, clipping; ZeRO 0, or ZeRO 1 in fp32 or bf16: DeepSpeed's ZeRO and BF16
    optimizers' steps post-validated): a checkpoint is taken at the end of a call, nothing pending, and resuming
    there continues with the same losses and validation losses."""
    extra = []
    if interlock:
        extra = ["--interlock", "2", "--eval-interval", "2", "--eval-batches", "1"]
        extra += ["--deepspeed_config", zero0_config] if interlock == "zero0" else []  # else ds_config.json: ZeRO 1
        extra += ["--bf16"] if interlock.endswith("bf16") else []
    flags = [*TINY_CHUNKED, "--steps", "4", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4",
             *PP2, "--pipeline-schedule", schedule, "--save-dir", tmp_path / "ckpt", "--save-interval", "2",
             "--dist-timeout", "120", *extra]
    full = launch(2, flags + ["--metrics-file", tmp_path / "full.jsonl"])
    assert full.ok, full.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step2")  # roll back to the step-2 checkpoint
    resumed = launch(2, flags + ["--resume", "--metrics-file", tmp_path / "resumed.jsonl"])
    assert resumed.ok, resumed.explain()
    def records(name, key):
        lines = (json.loads(line) for line in (tmp_path / name).read_text().splitlines())
        return {r["step"]: r[key] for r in lines if key in r}
    full_losses, resumed_losses = records("full.jsonl", "loss"), records("resumed.jsonl", "loss")
    assert list(full_losses) == [1, 2, 3, 4] and list(resumed_losses) == [3, 4]
    assert [resumed_losses[s] for s in (3, 4)] == pytest.approx([full_losses[s] for s in (3, 4)], abs=TOL)
    if interlock:  # validation at steps 0, 2 and 4 (the resumed run: 4)
        assert records("resumed.jsonl", "val_loss")[4] == pytest.approx(records("full.jsonl", "val_loss")[4], abs=TOL)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipe_copies_end_their_stages_gradients_in_one_order(p):
    """What lets the copies' gradient sum start chunk by chunk (copies_sum.CopiesSum): in DualPipe's streams
    every rank and its mirror end the gradients of the two stages they share in the same order, and each chunk's
    gradient-ending instructions (fused backwards, alone or paired, and Ws) number its micro-batches, so the count
    reaches zero at its last."""
    from schedules.placement import MirrorPlacement
    from schedules.registry import schedule_spec
    from schedules.runtime.copies_sum import gradient_ends, gradient_order
    cls, placement, m = schedule_spec("dualpipe").factory, MirrorPlacement(p), 2 * p
    for r in range(p):
        assert gradient_order(cls, placement, r, p, m) == gradient_order(cls, placement, p - 1 - r, p, m)
        assert sorted(gradient_order(cls, placement, r, p, m)) == sorted({r, p - 1 - r})
        ends = gradient_ends(cls(micro_batches=m, stages=p, stage_id=r))
        assert ends.count(0) == ends.count(1) == m // 2
