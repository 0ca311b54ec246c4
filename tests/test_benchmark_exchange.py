"""Smoke test of scripts/benchmark_exchange.py across two emulated nodes: both ways of exchanging deliver the right
data, and the record names each link's two times and the bytes' wire time."""
import json
import subprocess
import sys

import pytest

from emulated_nodes import can_make_namespaces
from local_launch import ROOT

WHY_NOT = can_make_namespaces()
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated nodes here: {WHY_NOT}")]


def test_benchmark_exchange_times_both_ways_over_a_link(tmp_path):
    run = subprocess.run([sys.executable, "scripts/benchmark_exchange.py", "--rates", "250mbit", "--rounds", "2",
                          "--exchanges", "4", "--kib", "64", "--compute-ms", "2", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "receives first" in run.stdout
    cell = json.loads((tmp_path / "exchange.json").read_text())["results"]["250mbit"]
    assert cell["wrong"] == 0
    assert set(cell["median_s"]) == {"torch", "receives first"} and all(t > 0 for t in cell["median_s"].values())
    assert cell["wire_s"] == pytest.approx(64 * 512 * 8 / 250e6, rel=0.15)
