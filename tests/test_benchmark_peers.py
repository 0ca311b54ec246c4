"""Smoke test of scripts/benchmark_peers.py: a tiny run against torch.distributed.pipelining reports every
figure, and both sides train the same thing (the same first loss from the same weights and data)."""
import json
import subprocess
import sys

import pytest

from local_launch import ROOT

pytestmark = pytest.mark.multiprocess  # starts processes


def test_tiny_peer_benchmark_reports_both_sides(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/benchmark_peers.py"), "--deep-width", "64",
                          "--micro-batch-size", "4", "--micro-batches", "4", "--clip", "on", "--rounds", "1",
                          "--steps-per-round", "2", "--schedules", "1f1b", "zb-v", "1f1b-lean",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "peers.json").read_text())
    run = report["runs"]["m4-clip-on"]
    assert set(run["rows"]) == {"ours:1f1b", "ours:zb-v", "ours:1f1b-lean", "torch:1f1b", "torch:zb-v"}
    for key, row in run["rows"].items():
        assert row["step_s"] > 0 and len(row["span_s"]) == len(row["outside_s"]) == 2, key
        assert all(0 < s < row["step_s"] * 1.5 for s in row["span_s"]), key
    ours = run["rows"]["ours:zb-v"]["outside_parts_s"][0]
    assert {"before", "ReduceGrads", "OptimizerStep", "after"} <= set(ours)
    assert set(run["rows"]["torch:zb-v"]["outside_parts_s"][0]) == {"clip", "optimizer", "zero_grad"}
    for name in ("1f1b", "zb-v"):  # the same seeded weights, micro-batches and loss on both sides
        assert run["compare"][name]["loss_diff"] < 1e-6, name
    assert run["compare"]["best"]["ours"] in ("1f1b", "zb-v", "1f1b-lean")


def test_cuda_without_a_gpu_per_rank_is_refused_in_one_line(tmp_path):
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/benchmark_peers.py"), "--device", "cuda",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("benchmark_peers: --device cuda needs one GPU per rank (--stages 2)"), out.stderr
    assert "Traceback" not in out.stderr
