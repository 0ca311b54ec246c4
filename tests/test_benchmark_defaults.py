"""scripts/benchmark_defaults.py: the shipped configuration against the fastest exact alternatives through train.py.
A dry run (tiny models) launches every configuration of the deep model; the page's block is rendered from the
record and replaced in place, never duplicated."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "benchmark_defaults.py"


def load_script():
    spec = importlib.util.spec_from_file_location("benchmark_defaults", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(bench):
    """A record as main() writes it, with made-up figures."""
    def row(config, what, median, diff=0.0):
        return {"config": config, "what": what, "flags": [], "ds_config": "ds_config.json", "median_s": median,
                "launch_medians_s": [median], "loss_max_diff": diff, "final_loss": 1.0, "launches": [],
                "vs_fastest": median / 0.100}
    deep = {"flags": ["--model", "deep"], "steps": 20, "rounds": 4, "fastest": "zero0", "shipped_vs_fastest": 1.03,
            "within": True, "rows": [row("shipped", "as shipped", 0.103), row("zero0", "ZeRO 0", 0.100, 2e-7),
                                     row("auto", "auto", 0.105)],
            "chooser": {"pick": "zb-h2", "cut": "uniform", "predicted_s": 0.098, "predicted_s_by_schedule": {}}}
    gpt = {"flags": ["--model", "gptlite"], "steps": 8, "rounds": 3, "fastest": "1f1b-lean", "shipped_vs_fastest": 1.2,
           "within": False, "rows": [row("shipped", "as shipped", 0.120), row("1f1b-lean", "lean", 0.100)],
           "chooser": None}
    machine = {"cpu": "a CPU", "cores": 2, "ram_bytes": 8 << 30, "torch": "2", "deepspeed": "0.19"}
    return {"machine": machine, "load_average": [0.1, 0.1, 0.1], "load_end": [0.2, 0.1, 0.1], "ranks": 2,
            "warmup": 2, "dry": False, "command": "python scripts/benchmark_defaults.py", "models":
            {"deep": deep, "gptlite": gpt}}


def test_the_block_is_rendered_from_the_record_and_replaced_in_place(tmp_path):
    bench = load_script()
    doc, out = tmp_path / "choosing.md", tmp_path / "defaults.json"
    doc.write_text("# Choosing\n\ntext before\n")
    rec = record(bench)
    bench.publish(rec, doc=doc, out=out)
    first = doc.read_text()
    assert first.startswith("# Choosing\n\ntext before\n\n" + bench.BEGIN) and first.rstrip().endswith(bench.END)
    assert "| as shipped | 103.0 | 1.030 | 0.0e+00 |" in first and "| ZeRO 0 | 100.0 | 1.000 | 2.0e-07 |" in first
    assert "1.030 of the fastest (zero0): within 5%" in first
    assert "1.200 of the fastest (1f1b-lean): NOT within" in first
    assert "chose zb-h2 (uniform cut) and predicted 98.0 ms per step; it ran at 105.0 ms (+7.1%)" in first
    doc.write_text(first + "text after\n")
    rec["models"]["deep"]["rows"][0]["median_s"] = 0.101
    bench.publish(rec, doc=doc, out=out)
    second = doc.read_text()
    assert second.count(bench.BEGIN) == 1 and second.endswith("text after\n") and "| as shipped | 101.0 |" in second
    assert json.loads(out.read_text())["models"]["deep"]["rows"][0]["median_s"] == 0.101


def test_the_chooser_line_is_read_from_train_py_output():
    bench = load_script()
    stdout = ("auto: predicted per candidate, fastest first (the simulator on the layers measured here)\n"
              "  # schedule             cut                           step ms  span ms  ...\n"
              "  1 zb-h2                uniform=parameters=profile       59.7     58.0  1.0% 1.0%\n"
              "  2 zb-h1                uniform=parameters=profile       61.2     60.1  2.0% 2.0%\n"
              " 12 interleaved v=3      uniform=parameters=profile      106.7    104.9  61.7% 61.4%\n"
              "auto: chose zb-h2 with the uniform cut (layers [0, 6, 12]) at p = 2, m = 6: predicted 59.7 ms per "
              "step, 2.6% faster than the next schedule (zb-h1); profiling and choosing took 3.0 s\n")
    line = bench.chooser_line(stdout)
    assert line["pick"] == "zb-h2" and line["cut"] == "uniform" and line["predicted_s"] == pytest.approx(0.0597)
    assert line["predicted_s_by_schedule"] == pytest.approx({"zb-h2": 0.0597, "zb-h1": 0.0612,
                                                             "interleaved v=3": 0.1067})
    assert bench.chooser_line("no choice here") is None


@pytest.mark.multiprocess
def test_a_dry_run_launches_every_configuration_of_the_deep_model(tmp_path, capsys):
    bench = load_script()
    rec = bench.main(["--dry", "--models", "deep", "--warmup", "1", "--out", str(tmp_path / "defaults.json")])
    result = rec["models"]["deep"]
    assert [row["config"] for row in result["rows"]] == ["shipped", "zero0", "auto"]
    for row in result["rows"]:
        assert len(row["launches"]) == 1 and len(row["launches"][0]["iter_s"]) == 3 and row["median_s"] > 0
        assert row["loss_max_diff"] < 1e-5, row["config"]  # the same model, trained exactly
    assert result["chooser"]["pick"] and result["chooser"]["predicted_s"] > 0
    assert json.loads((tmp_path / "defaults.json").read_text())["models"]["deep"]["steps"] == 3
    assert bench.BEGIN in capsys.readouterr().out


def test_the_promise_is_ours_as_shipped_against_the_same_flags_with_another_config():
    """Item 0's verdict: ds_config.json as shipped on our engines against every configuration of the same flags
    (another ds_config.json), pooled and round by round; DeepSpeed's own engine (other flags) is not its peer."""
    bench = load_script()

    def row(config, flags, launches):
        return {"config": config, "flags": flags, "launch_medians_s": launches,
                "median_s": sorted(launches)[len(launches) // 2]}
    lean = ["--pipeline-schedule", "1f1b-lean"]
    rows = [row("shipped", [], [2.27, 2.29, 2.16]), row("1f1b-lean", lean, [2.05, 2.06, 2.03]),
            row("1f1b-lean-zero0", lean, [2.11, 2.16, 2.09])]
    kept = bench.promise(rows, "1f1b-lean")
    assert kept["ours_best_peer"] == "1f1b-lean" and kept["ours_vs_best_peer"] == 1.0 and kept["ours_within"]
    rows[2]["launch_medians_s"] = [1.80, 1.85, 2.30]  # ZeRO 0 faster in two rounds of three: 1.11 paired
    rows[2]["median_s"] = 1.85
    broken = bench.promise(rows, "1f1b-lean")
    assert broken["ours_best_peer"] == "1f1b-lean-zero0" and not broken["ours_within"]
    assert broken["ours_vs_best_peer_paired"] == pytest.approx(2.06 / 1.85)  # the median round
    result = {"flags": [], "steps": 8, "rounds": 3, "fastest": "1f1b-lean-zero0", "shipped_vs_fastest": 1.2,
              "within": False, "chooser": None, "rows": [{**r, "what": r["config"], "vs_fastest": 1.0,
                                                           "loss_max_diff": 0.0} for r in rows], **broken}
    text = bench.render({**record(bench), "models": {"gptlite": result}})
    assert ("**ds_config.json as shipped on our engines** (`--pipeline-schedule 1f1b-lean`) runs at 1.108 of the "
            "fastest configuration of the same flags (1f1b-lean-zero0), 1.114 round by round" in text)
    assert "NOT within 5%." in text
