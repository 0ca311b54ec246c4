"""scripts/gpu_benchmark.py on CPU: the no-GPU exit, the dry run's JSON, and which stage each chunk holds.

CUDA_VISIBLE_DEVICES is emptied so that the no-GPU path is taken on a GPU machine too (where the
script without flags would start the real benchmark).
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_benchmark.py"
PHASES = ("F", "B", "W", "BW")


def run(*flags):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, env=env, timeout=120)


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
def test_without_gpu_prints_one_line_and_exits_0_or_2_when_required():
    plain = run()
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip().splitlines() == [load_script().NO_GPU]
    required = run("--require-gpu")
    assert required.returncode == 2 and "no CUDA device" in required.stdout


@pytest.mark.multiprocess
def test_dry_run_on_cpu_writes_stage_costs_and_predictions(tmp_path):
    done = run("--device", "cpu", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "predicted iteration" in done.stdout and (tmp_path / "gpu_benchmark.txt").read_text().strip()
    record = json.loads((tmp_path / "gpu_benchmark.json").read_text())
    assert {"args", "machine", "device", "peak_tflops", "notes", "sizes", "wall_s"} <= record.keys()
    assert {"gpu_count", "gpus", "torch", "deepspeed"} <= record["machine"].keys()
    tiny = record["sizes"]["tiny"]
    assert {"config", "p2p_latency_s", "stages", "predictions"} <= tiny.keys() and tiny["p2p_latency_s"] > 0
    assert {k.split("-")[0] for k in tiny["stages"]} == {"first", "middle", "last"}
    for key, stage in tiny["stages"].items():
        assert set(stage["s"]) == set(PHASES), key
        if stage.get("empty"):
            continue
        assert stage["rounds"] == 2 and all(stage["s"][k] > 0 for k in ("F", "B", "BW")), key
        assert stage["split_overhead"] > -1 and stage["flops"]["BW"] > 0, key
    from schedules.registry import available_schedules
    assert set(tiny["predictions"]) == {"p4_m8", "p4_m16", "p8_m16", "p8_m32"}
    for column, row in tiny["predictions"].items():
        assert set(row) == set(available_schedules()), column
        for name, got in row.items():
            assert "error" in got or (got["iteration_s"] > 0 and 0 <= got["bubble"] < 1), (column, name, got)


def test_chunks_give_each_placement_its_stages():
    from schedules.registry import available_schedules
    bench, schedules = load_script(), available_schedules()
    for name, p in [("1f1b", 8), ("dualpipe", 4), ("zb-v", 4), ("interleaved", 8)]:
        got = {(r, c): key for r, c, key in bench.chunks(schedules[name], p, 12)}  # GPT-2 small: 12 blocks
        copies = 2 if name == "dualpipe" else 1  # DualPipe's mirror: two full copies of the model
        assert sum(int(key.split("-")[1]) for key in got.values()) == 12 * copies, (name, got)
        assert sorted(key.split("-")[0] for key in got.values()).count("first") == copies, (name, got)
    assert bench.chunks(schedules["1f1b"], 8, 12)[0][2] == "first-2"  # DeepSpeed's partition_uniform: 2,2,2,2,1,...
    mirror = {(r, c): key for r, c, key in bench.chunks(schedules["dualpipe"], 4, 12)}
    assert mirror[0, 0] == "first-3" and mirror[0, 1] == "last-3"  # full-size stages at both ends of rank 0
    v = {(r, c): key for r, c, key in bench.chunks(schedules["zb-v"], 4, 12)}
    assert v[0, 0] == "first-2" and v[0, 1] == "last-1" and v[3, 0] == "middle-2"  # half-size chunks


@pytest.mark.multiprocess
def test_several_gpus_run_the_schedule_benchmark(tmp_path, monkeypatch):
    """The multi-GPU glue, exercised on CPU: the command it builds is run with `--device cpu` and
    tiny sizes in place of the GPU ones, and its results land in the record."""
    import subprocess as sp
    bench = load_script()
    real_run, seen = sp.run, []

    def on_cpu(cmd, **kwargs):
        seen.append(list(cmd))
        cmd = [{"cuda": "cpu", "4096": "64", "16": "8", "256": "4"}.get(a, a) for a in cmd]
        cmd += ["--schedules", "1f1b", "zb-h1"]
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(sp, "run", on_cpu)
    got = bench.run_distributed(bench.parse_args(["--out", str(tmp_path)]), 2, bench.time.perf_counter() + 200)
    assert "error" not in got, got.get("error")
    assert seen and seen[0][seen[0].index("--device") + 1] == "cuda" and got["stages"] == 2
    rows = got["throughput"]["4"]["schedules"]
    assert set(rows) == {"1f1b", "zb-h1"} and rows["zb-h1"]["iter_s"] > 0
    assert any("zb-h1" in line for line in got["lines"])


def test_several_gpus_failure_is_reported_not_raised(tmp_path, monkeypatch):
    import subprocess as sp
    bench = load_script()
    monkeypatch.setattr(sp, "run", lambda cmd, **kw: sp.CompletedProcess(cmd, 1, "", "NCCL error: boom"))
    got = bench.run_distributed(bench.parse_args(["--out", str(tmp_path)]), 4, bench.time.perf_counter() + 10)
    assert got["stages"] == 4 and "NCCL error: boom" in got["error"]
