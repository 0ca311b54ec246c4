"""Smoke test of scripts/benchmark_p2p.py: both ways of receiving deliver the right data."""
import json
import subprocess
import sys

import pytest

from local_launch import ROOT

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def test_benchmark_p2p_receives_late_and_ahead(tmp_path):
    run = subprocess.run([sys.executable, "scripts/benchmark_p2p.py", "--rounds", "3", "--compute-ms", "2",
                          "--kib", "16", "--out", str(tmp_path), "--port", "29571"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "late" in run.stdout and "ahead" in run.stdout
    record = json.loads((tmp_path / "p2p.json").read_text())
    assert record["wrong_messages"] == 0
    for mode in ("late", "ahead"):
        waits = record["waits_s"][mode]
        assert len(waits) == 3 and all(w >= 0 for w in waits), mode
