"""Bad input ends with one clear line from rank 0 (exit status 2), never a traceback or a hang.

Every case of the table is refused by train.py's `validate()` (or the data loading) before any
rank waits on another, on every rank alike: the table runs each in this process as rank 0 of the
case's world, in well under a second. A few real launches check the same end to end, on every
rank; `python train.py` alone is a one-rank run.
"""
import json
import os
import subprocess
import sys

import pytest

from local_launch import ROOT, launch
from training import assert_one_error_line, run_in_process

TINY = ["--model-size", "tiny"]
DEADLINE_S = 20  # per case, in this process (the first one imports DeepSpeed)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Configs DeepSpeed refuses, by name: their paths."""
    folder = tmp_path_factory.mktemp("configs")
    base = json.loads((ROOT / "ds_config.json").read_text())
    variants = {
        "zero2": {**base, "zero_optimization": {"stage": 2}},
        "zero3": {**base, "zero_optimization": {"stage": 3}},
        "fp16": {**base, "fp16": {"enabled": True}},
        "fp16-bf16": {**base, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "zero0": {**base, "zero_optimization": {"stage": 0}},
        "no-micro-batch": {k: v for k, v in base.items() if k != "train_micro_batch_size_per_gpu"},
        "sgd-untested": {**{k: v for k, v in base.items() if k != "zero_allow_untested_optimizer"},
                         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        "warmup-0": {**base, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0}}},
    }
    paths = {name: folder / f"{name}.json" for name in variants}
    for name, cfg in variants.items():
        paths[name].write_text(json.dumps(cfg))
    (folder / "broken.json").write_text('{"train_micro_batch_size_per_gpu": 8,')
    paths["broken"] = folder / "broken.json"
    return paths


# name: (world size, flags, what the line names); "{name}" in flags: a config of the fixture above,
# "{tmp}": the test's temporary folder
CASES = {
    # flags and their values
    "unknown-schedule": (1, ["--pipeline-schedule", "nope"], "--pipeline-schedule"),
    "unknown-model": (1, ["--model", "nope"], "--model"),
    "unknown-size": (1, ["--model-size", "huge"], "--model-size"),
    "micro-batch-size-0": (1, ["--micro-batch-size", "0"], "--micro-batch-size"),
    "micro-batch-size-negative": (1, ["--micro-batch-size", "-2"], "--micro-batch-size"),
    "accumulation-0": (1, ["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps"),
    "accumulation-negative": (1, ["--gradient-accumulation-steps", "-1"], "--gradient-accumulation-steps"),
    "steps-0": (1, ["--steps", "0", "--save-dir", "{tmp}/ckpt"], "--steps"),
    "steps-negative": (1, ["--steps", "-3"], "--steps"),
    "eval-batches-0": (1, ["--eval-interval", "1", "--eval-batches", "0"], "--eval-batches"),
    "eval-interval-negative": (1, ["--eval-interval", "-1"], "--eval-interval"),
    "log-interval-0": (1, ["--log-interval", "0"], "--log-interval"),
    "save-interval-negative": (1, ["--save-interval", "-1", "--save-dir", "{tmp}/ckpt"], "--save-interval"),
    "trace-steps-0": (2, ["--pipeline-parallel-size", "2", "--trace", "{tmp}/t.json", "--trace-steps", "0"],
                      "--trace-steps"),
    "dist-timeout-0": (1, ["--dist-timeout", "0"], "--dist-timeout"),
    "n-layer-0": (1, ["--n-layer", "0"], "--n-layer"),
    "deep-depth-0": (1, ["--model", "deep", "--deep-depth", "0"], "--deep-depth"),
    "dropout-1": (1, ["--dropout", "1"], "--dropout"),
    "lr-negative": (1, ["--lr", "-0.1"], "--lr"),
    "checkpoint-interval-negative": (1, ["--activation-checkpoint-interval", "-1"],
                                     "--activation-checkpoint-interval"),
    "stages-negative": (1, ["--pipeline-parallel-size", "-2"], "--pipeline-parallel-size"),
    "stages-do-not-divide": (2, ["--pipeline-parallel-size", "3"], "--pipeline-parallel-size"),
    "virtual-stages-not-interleaved": (2, ["--pipeline-parallel-size", "2", "--virtual-stages", "2"],
                                       "--virtual-stages"),
    "trace-without-pipeline": (1, ["--trace", "{tmp}/t.json"], "--pipeline-parallel-size"),
    "resume-without-dir": (1, ["--resume"], "--save-dir"),
    "resume-empty-dir": (1, ["--resume", "--save-dir", "{tmp}"], "--save-dir"),
    "metrics-file-is-a-folder": (1, ["--metrics-file", "{tmp}"], "--metrics-file"),
    "save-dir-is-a-file": (1, ["--save-dir", "{broken}"], "--save-dir"),
    # schedules and stages
    "schedule-without-pipeline": (1, ["--pipeline-schedule", "zb-h1"], "--pipeline-parallel-size"),
    "zb-h2-too-few-micro-batches": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h2",
                                        "--gradient-accumulation-steps", "2"], "--gradient-accumulation-steps >= 3"),
    "interleaved-v1": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "interleaved",
                           "--virtual-stages", "1"], "--virtual-stages"),
    "interleaved-v4-too-few-layers": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "interleaved",
                                          "--virtual-stages", "4", "--gradient-accumulation-steps", "4"],
                                      "--n-layer 13"),
    "zb-v-too-few-layers": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-v",
                                "--gradient-accumulation-steps", "8"], "--n-layer 5"),
    "deep-too-few-layers": (4, ["--model", "deep", "--deep-depth", "3", "--pipeline-parallel-size", "4"],
                            "--deep-depth 4"),
    "auto-one-stage": (1, ["--pipeline-schedule", "auto"], "--pipeline-parallel-size >= 2"),
    "auto-one-pipeline-stage": (1, ["--pipeline-parallel-size", "1", "--pipeline-schedule", "auto"],
                                "--pipeline-parallel-size >= 2"),
    "auto-virtual-stages": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "auto", "--virtual-stages",
                                "2"], "--virtual-stages"),
    "auto-resume": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "auto", "--resume", "--save-dir",
                        "{tmp}"], "--resume"),
    "max-memory-without-auto": (2, ["--pipeline-parallel-size", "2", "--max-activation-memory", "10"],
                                "--max-activation-memory"),
    "max-memory-negative": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "auto",
                                "--max-activation-memory", "-1"], "--max-activation-memory"),
    "partition-method-unknown": (1, ["--pipeline-parallel-size", "1", "--partition-method", "balanced"],
                                 "--partition-method"),
    "partition-type-matches-nothing": (1, ["--pipeline-parallel-size", "1", "--partition-method", "type:Conv"],
                                       "--partition-method"),
    # Mixture of Experts
    "experts-negative": (1, ["--moe-experts", "-1"], "--moe-experts"),
    "expert-parallel-without-experts": (2, ["--expert-parallel-size", "2"], "--moe-experts"),
    "expert-parallel-over-stages": (2, ["--moe-experts", "4", "--pipeline-parallel-size", "2",
                                        "--expert-parallel-size", "2"], "--expert-parallel-size 2"),
    "expert-parallel-does-not-divide": (2, ["--moe-experts", "3", "--expert-parallel-size", "2"],
                                        "--expert-parallel-size 2 must divide --moe-experts 3"),
    "top-k-above-experts": (1, ["--moe-experts", "1", "--moe-top-k", "2"], "--moe-top-k"),
    "moe-blocks-out-of-range": (1, ["--moe-experts", "4", "--moe-blocks", "9"], "--moe-blocks 9"),
    "moe-blocks-every-0": (1, ["--moe-experts", "4", "--moe-blocks", "every:0"], "--moe-blocks every:0"),
    "dualpipe-experts-also-over-replicas": (4, ["--moe-experts", "4", "--pipeline-parallel-size", "2",
                                                "--pipeline-schedule", "dualpipe", "--expert-parallel-size", "2",
                                                "--gradient-accumulation-steps", "4", "--dualpipe-experts", "shard"],
                                            "--dualpipe-experts duplicate"),
    "dualpipe-experts-odd": (2, ["--moe-experts", "3", "--pipeline-parallel-size", "2", "--pipeline-schedule",
                                 "dualpipe", "--gradient-accumulation-steps", "4", "--dualpipe-experts", "shard"],
                             "--moe-experts 3 with dualpipe"),
    "deep-moe-blocks-out-of-range": (1, ["--model", "deep", "--deep-depth", "4", "--moe-experts", "4", "--moe-blocks",
                                         "5"], "--moe-blocks 5"),
    "capacity-negative": (1, ["--moe-experts", "4", "--moe-capacity-factor", "-1"], "--moe-capacity-factor"),
    # the config DeepSpeed would refuse on every rank with an assertion
    "zero-2-with-pipeline": (1, ["--pipeline-parallel-size", "1", "--deepspeed_config", "{zero2}"],
                             "zero_optimization.stage"),
    "zero-3-with-pipeline": (2, ["--pipeline-parallel-size", "2", "--deepspeed_config", "{zero3}"],
                             "zero_optimization.stage"),
    "fp16-on-cpu": (1, ["--deepspeed_config", "{fp16}"], "fp16.enabled"),
    "fp16-and-bf16": (1, ["--deepspeed_config", "{fp16-bf16}"], "fp16.enabled"),
    "bf16-at-zero-0": (2, ["--pipeline-parallel-size", "2", "--bf16", "--deepspeed_config", "{zero0}"],
                       "zero_optimization.stage 1"),
    "config-missing": (1, ["--deepspeed_config", "/no/such/config.json"], "--deepspeed_config"),
    "config-not-json": (1, ["--deepspeed_config", "{broken}"], "--deepspeed_config"),
    "config-without-micro-batch": (1, ["--deepspeed_config", "{no-micro-batch}"], "--micro-batch-size"),
    "sgd-with-zero-untested": (1, ["--deepspeed_config", "{sgd-untested}"], "zero_allow_untested_optimizer"),
    "warmup-0": (1, ["--deepspeed_config", "{warmup-0}"], "warmup_num_steps"),
    # data
    "missing-data-file": (1, ["--data-file", "/no/such/file.txt"], "--data-file"),
    "offline-hub": (1, ["--dataset", "karpathy/tiny_shakespeare"], "--data-file"),
    "dataset-and-data-file": (1, ["--dataset", "x/y", "--data-file", "{broken}"], "--data-file"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line(case, configs, tmp_path, monkeypatch, capsys):
    world, flags, expected = CASES[case]
    flags = [f.format(tmp=tmp_path, **configs) for f in flags]
    if "--model-size" not in flags and "deep" not in flags:
        flags += TINY
    status, stderr, seconds = run_in_process(flags, monkeypatch, capsys, world, env={"HF_HUB_OFFLINE": "1"})
    assert_one_error_line(status, stderr, expected)
    assert "Traceback" not in stderr and seconds < DEADLINE_S


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks,flags,expected", [
    (1, ["--micro-batch-size", "0"], "--micro-batch-size"),
    (2, ["--pipeline-parallel-size", "3"], "--pipeline-parallel-size"),
    (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipev", "--gradient-accumulation-steps", "3"],
     "--gradient-accumulation-steps"),
    (3, ["--pipeline-parallel-size", "3", "--pipeline-schedule", "dualpipe", "--gradient-accumulation-steps", "6"],
     "--pipeline-parallel-size"),
    (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-v", "--gradient-accumulation-steps", "8"],
     "--n-layer"),
], ids=["one-rank", "stages-divide", "dualpipev-m", "dualpipe-odd-p", "zb-v-layers"])
def test_real_ranks_print_one_line(ranks, flags, expected):
    """Launched: every rank exits 2, rank 0 prints the line, the others nothing, DeepSpeed adds nothing."""
    run = launch(ranks, flags + TINY, timeout=90)
    for out, err in zip(run.stdout, run.stderr):
        assert "Traceback" not in out + err
    assert set(run.returncodes) == {2}, run.explain()
    assert_one_error_line(2, run.stderr[0], expected, others=run.stderr[1:])


@pytest.mark.multiprocess
def test_python_train_py_is_a_one_rank_run(tmp_path):
    """No launcher: one rank. Progress lines for people on stdout, the JSON objects in --metrics-file,
    and the first step trains at the warm-up's first rate, not 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    metrics = tmp_path / "m.jsonl"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "--steps", "3", "--micro-batch-size", "2",
                          "--gradient-accumulation-steps", "1", "--eval-interval", "2", "--eval-batches", "1",
                          "--log-interval", "2", "--metrics-file", str(metrics)],
                         cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0/3", "step 1/3", "step 2/3", "step 2/3", "step 3/3",
                                                      "step 3/3"], out.stdout
    assert lines[1].startswith("step 1/3: loss ") and " tok/s, " in lines[1] and lines[1].endswith(" left")
    assert lines[0].startswith("step 0/3: validation loss ") and "validation loss" in lines[3]
    assert not any(line.startswith("{") for line in out.stdout.splitlines())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [set(r) for r in records] == [{"step", "val_loss"}] + [
        {"step", "loss", "lr", "iter_s", "samples_per_s", "tokens_per_s"} | ({"val_loss"} if s in (2, 3) else set())
        for s in (1, 2, 3)]
    config = json.loads((ROOT / "ds_config.json").read_text())
    first_rate = config["optimizer"]["params"]["lr"] * config["scheduler"]["params"]["warmup_min_ratio"]
    assert records[1]["lr"] == pytest.approx(first_rate) and records[2]["lr"] > first_rate


def schedule_table():
    import importlib.util
    spec = importlib.util.spec_from_file_location("schedule_table", ROOT / "scripts" / "schedule_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,expected", [
    (["--stages", "0", "--micro-batches", "4"], "--stages"),
    (["--stages", "-2", "--micro-batches", "4"], "--stages"),
    (["--stages", "2", "--micro-batches", "-1"], "--micro-batches"),
    (["--stages", "2", "--micro-batches", "0"], "--micro-batches"),
    (["--stages", "2", "--micro-batches", "4", "--latency", "-1"], "--latency"),
])
def test_schedule_table_refuses_bad_input_in_one_line(flags, expected, monkeypatch, capsys):
    table = schedule_table()
    monkeypatch.setattr(sys, "argv", ["schedule_table.py", *flags])
    with pytest.raises(SystemExit) as exit:
        table.main()
    assert_one_error_line(exit.value.code, capsys.readouterr().err, expected)


def test_schedule_table_at_one_stage_lists_only_1f1b():
    """As train.py: at one stage only DeepSpeed's 1F1B runs (every other schedule needs two)."""
    rows = {row["schedule"]: row for row in schedule_table().rows(1, 4)}
    assert rows["1f1b"]["error"] is None
    assert all(row["error"] and "--stages >= 2" in row["error"] for name, row in rows.items() if name != "1f1b")
