"""Smoke test of scripts/benchmark_split.py: tiny sizes, few rounds, into a temporary directory."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark_split.py"


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark_split", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_split_writes_times_ratios_and_flop_split(tmp_path, capsys):
    bench = load_script()
    bench.main(["--model-size", "tiny", "--stages", "2", "--micro-batch-size", "2", "--block-size", "16",
                "--deep-width", "64", "--deep-blocks", "2", "--rounds", "4", "--warmup", "1", "--seconds", "0",
                "--out", str(tmp_path)])
    assert "F : B : W" in capsys.readouterr().out
    assert (tmp_path / "split.txt").read_text().strip()
    record = json.loads((tmp_path / "split.json").read_text())
    assert {"args", "machine", "machine_line", "elapsed_s", "workloads"} <= record.keys()
    assert set(record["workloads"]) == {"gpt-middle", "gpt-last", "deep"}
    for name, result in record["workloads"].items():
        assert {"description", "times_s", "summary", "flops"} <= result.keys(), name
        for phase in ("F", "BW", "B", "W"):
            times = result["times_s"][phase]
            assert len(times) == 4 and all(t > 0 for t in times), (name, phase)
            assert result["summary"]["ms"][phase][0] > 0, (name, phase)
        assert {"B/F", "W/F", "BW/F", "overhead"} <= result["summary"]["ratios"].keys()
        flops = result["flops"]
        assert flops["B"] + flops["W"] == flops["BW"] > 0, (name, flops)
        assert 0.4 <= flops["B"] / flops["BW"] <= 0.6 and 0.4 <= flops["W"] / flops["BW"] <= 0.6, (name, flops)
