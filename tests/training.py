"""Run train.py as real ranks and compare what it trained: the helpers of the equivalence tests.

Each configuration trains for two plain-SGD steps (no LR schedule, no clipping: both would hide
a wrong gradient scale, as Adam would) and exports its weights keyed by layer index. With SGD
the update is lr x gradient, so equal weights after the steps mean equal gradients.
"""
import json

import pytest
import torch

from local_launch import ROOT, launch

TOL = 1e-5
TINY = ("--model", "gptlite", "--model-size", "tiny")
# 6 blocks: 9 layers, enough for 8 model stages (4 ranks x 2 chunks), cut uniformly
TINY_CHUNKED = TINY + ("--n-layer", "6", "--partition-method", "uniform")
COMMON = ["--steps", "2", "--seed", "3", "--optimizer", "sgd", "--lr", "0.5", "--micro-batch-size", "2",
          "--dist-timeout", "120", "--eval-interval", "2", "--eval-batches", "1"]


def write_config(path, zero=1, clip=None, scheduler=True):
    """ds_config.json with ZeRO stage `zero`, clipping `clip` (None: as it is there), its LR schedule or none."""
    cfg = json.loads((ROOT / "ds_config.json").read_text())
    if not scheduler:
        cfg.pop("scheduler")
    if clip is not None:
        cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["stage"] = zero
    path.write_text(json.dumps(cfg))
    return path


def write_sgd_config(path, zero=1, clip=0.0):
    return write_config(path, zero, clip, scheduler=False)


def train(tmp_path, nprocs, flags, config, micro_batches, dp=1, model=TINY, timeout=240):
    """(per-step losses, validation losses, exported weights) of one run."""
    metrics, export = tmp_path / "metrics.jsonl", tmp_path / "weights.pt"  # train.py creates the folder
    run = launch(nprocs, [*model, *COMMON, "--deepspeed_config", config, "--gradient-accumulation-steps",
                          micro_batches // dp, "--metrics-file", metrics, "--export", export, *flags], timeout=timeout)
    assert run.ok, run.explain()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return ([r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r],
            torch.load(export))


def assert_same_training(result, reference):
    (losses, val, weights), (ref_losses, ref_val, ref_weights) = result, reference
    assert len(losses) == len(ref_losses) == 2
    assert losses == pytest.approx(ref_losses, abs=TOL)
    assert len(val) == len(ref_val) == 2 and val == pytest.approx(ref_val, abs=TOL)
    mirror = {k[len("mirror:"):]: v for k, v in weights.items() if k.startswith("mirror:")}
    weights = {k: v for k, v in weights.items() if not k.startswith("mirror:")}
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        diff = (weights[name] - ref).abs().max().item()
        assert diff < TOL, f"{name}: differs from the non-pipelined run by {diff:.2e}"
    for name, copy in mirror.items():  # DualPipe: the two copies of each stage stay equal
        assert torch.equal(copy, weights[name]), f"{name}: the mirrored copies differ"


def run_in_process(argv, monkeypatch, capsys, world=1, env=None):
    """`train.py ARGV` as rank 0 of `world` ranks, in this process, up to where ranks would start
    waiting on each other: (exit status, what it printed on stderr, seconds).

    Bad input is refused before `init_distributed`, on every rank alike, so one process sees what
    each rank of a real launch would; reaching `init_distributed` fails the test.
    """
    import time

    import train
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), **(env or {})}.items():
        monkeypatch.setenv(key, value)

    def refuse(*args, **kwargs):
        raise AssertionError(f"train.py {' '.join(map(str, argv))}: passed validation")
    monkeypatch.setattr(train, "init_distributed", refuse)
    capsys.readouterr()
    began = time.monotonic()
    with pytest.raises(SystemExit) as exit:
        train.run([str(a) for a in argv])
    return exit.value.code, capsys.readouterr().err, time.monotonic() - began


def assert_one_error_line(status, stderr, expected, others=()):
    """Exit status 2, exactly one line on rank 0's stderr, `error: ...` containing `expected`, no
    traceback; `others`: the other ranks' stderr, silent."""
    assert status == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], stderr
    for err in others:
        assert "error" not in err and "Traceback" not in err, err
