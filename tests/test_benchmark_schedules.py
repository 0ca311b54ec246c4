"""Smoke test of scripts/benchmark_schedules.py: a tiny run produces every figure it reports."""
import json
import subprocess
import sys

import pytest

from local_launch import ROOT

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def test_tiny_benchmark_reports_every_figure(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/benchmark_schedules.py"), "--what", "both",
                          "--rounds", "1", "--steps-per-round", "2", "--deep-width", "64", "--deep-depth", "16",
                          "--micro-batch-size", "4", "--micro-batches", "4",
                          "--schedules", "1f1b", "zb-h1", "zb-v", "interleaved",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "both.json").read_text())
    assert "Xeon" in report["machine"] or "cores" in report["machine"]
    rows = report["throughput"]["4"]["schedules"]
    assert list(rows) == ["1f1b", "zb-h1", "zb-v", "interleaved"]
    for row in rows.values():
        assert row["iter_s"] > 0 and row["samples_per_s"] > 0 and row["predicted_span_s"] > 0
        assert len(row["bubble"]) == len(row["predicted_bubble"]) == 2
        assert all(0 <= b < 1 for b in row["bubble"] + row["predicted_bubble"])
        assert row["held_messages"] >= 0 and row["held_s"] >= 0.0  # messages held past what the link explains
    assert rows["1f1b"]["speedup"] == 1.0
    memory = report["memory"]["4"]
    assert memory["zb-v"]["units"] == [2.0, 2.0]  # ZB-V: 1F1B's p on every rank
    assert all(b > 0 for row in memory.values() for b in row["peak_saved_bytes"])
    # the simulator, fed each pass's measured change of the saved bytes, finds each rank's peak
    for name, row in memory.items():
        assert all(abs(r - 1) < 0.1 for r in row["measured_over_predicted"]), (name, row["measured_over_predicted"])
    assert len(report["throughput"]["4"]["p2p_cpu_s"]) == 2 and report["throughput"]["4"]["p2p_cpu_s"][0] > 0
    assert (tmp_path / "throughput.png").exists()


def test_gptlite_layer_costs_time_every_layer_the_chunked_head_with_its_loss():
    """The weights that balance GPTlite's stages: one per layer, the head's (projected inside its loss) the largest."""
    import argparse
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark_schedules as bs
    costs = bs.gptlite_layer_costs(argparse.Namespace(model_size="tiny", micro_batch_size=2, device="cpu"), repeats=3)
    assert len(costs) == 4 + 3 and min(costs) > 0
    assert costs[-1] == max(costs)
