"""scripts/benchmark_one_process.py: DeepSpeed's engine against ours without a pipeline, side by side."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_process_benchmark_runs_every_configuration_to_the_same_loss(tmp_path):
    """A tiny run: six configurations (DeepSpeed's engine and ours, ZeRO 1 and 0, with the chunked head; ours at
    ZeRO 1 with the recomputing head and torch's), each the engine and head it names, all ending at the same loss,
    and the lines that say so; the recomputing head's peak activation memory below torch's head's."""
    out = subprocess.run([sys.executable, "scripts/benchmark_one_process.py", "--models", "tiny:2", "--steps", "2",
                          "--warmup", "1", "--rounds", "1", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((tmp_path / "one-process.json").read_text())
    rows = record["models"][0]["rows"]
    assert [(r["engine"], r["zero"], r["head"]) for r in rows.values()] == [
        ("DeepSpeedEngine", 1, "chunked"), ("LeanEngine", 1, "chunked"), ("DeepSpeedEngine", 0, "chunked"),
        ("LeanEngine", 0, "chunked"), ("LeanEngine", 1, "recompute"), ("LeanEngine", 1, "linear")]
    memory = record["models"][0]["memory"]
    assert 0 < memory["recompute"]["head"] < memory["linear"]["head"] <= memory["linear"]["model"]
    assert memory["chunked"]["head"] <= 1.01 * memory["linear"]["head"]  # its exponentials, a few numbers per token
    losses = [r["loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-4 and all(r["step_s"] > 0 for r in rows.values())
    assert "every configuration ends at the same loss" in out.stdout
