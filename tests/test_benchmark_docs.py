"""docs/benchmarks.md is what scripts/benchmark_docs.py renders from docs/bench/*.json, and its tables
print the JSON's numbers. Fast: reads files only, starts no process, imports no torch."""
import importlib.util
import json
import os
import shutil
import statistics

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "docs", "bench")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")


def renderer():
    spec = importlib.util.spec_from_file_location("benchmark_docs", os.path.join(ROOT, "scripts", "benchmark_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(name):
    with open(os.path.join(BENCH, name)) as f:
        return json.load(f)


def row(text, after, first_cell):
    """The cells of the first table row starting with `first_cell` below the line starting with `after`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    line = next(line for line in lines[start:] if line.startswith(f"| {first_cell} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_committed_page_is_what_the_json_renders():
    with open(DOC) as f:
        committed = f.read()
    assert committed == renderer().render(BENCH), \
        "docs/benchmarks.md is stale: run `python scripts/benchmark_docs.py`"
    assert renderer().main(["--check"]) == 0


def test_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "benchmarks.md"
    stale.write_text(renderer().render(BENCH).replace("| 1f1b |", "| 1f1b (edited) |", 1))
    assert renderer().main(["--check", "--doc", str(stale)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_table_rows_print_the_json_values():
    text = open(DOC).read()
    # the deep model's 1F1B row at 4 micro-batches
    r = bench("deep.json")["throughput"]["4"]["schedules"]["1f1b"]
    cells = row(text, "4 micro-batches (", "1f1b")
    assert cells[1] == f"{r['iter_s'] * 1e3:.1f}" == "169.2"
    assert cells[2] == f"{r['samples_per_s']:.0f}"
    assert cells[3:5] == [f"{r['speedup']:.2f}", f"{r['predicted_speedup']:.2f}"]
    assert cells[5:7] == [f"{r['span_s'] * 1e3:.1f}", f"{r['predicted_span_s'] * 1e3:.1f}"]
    assert cells[7] == f"{r['bubble'][0]:.1%} / {r['predicted_bubble'][0]:.1%}"
    assert cells[9] == ", ".join(f"{t * 1e3:.1f}" for t in r["p2p_s"])
    # GPTlite's DualPipe row, the deep model's activation memory, the builds, the split, the late receive
    g = bench("gptlite.json")["throughput"]["4"]["schedules"]["dualpipe"]
    assert row(text, "### GPTlite", "dualpipe")[1:3] == [f"{g['iter_s'] * 1e3:.1f}", f"{g['tokens_per_s']:.0f}"]
    m = bench("deep.json")["memory"]["4"]["zb-h2"]
    saved = " / ".join(f"{b / 2**20:.1f}" for b in m["peak_saved_bytes"])
    assert row(text, "## Activation memory", "zb-h2")[1] == saved
    builds = {(s["stages"], s["build"]): s for s in bench("memory.json")["summary"]}
    build = [builds[(8, b)]["build_rss"]["max"] / 2**20 for b in ("list", "LayerSpec")]
    assert row(text, "## Memory of the two", "8")[1] == f"{build[0]:.1f} -> {build[1]:.1f}"
    q = bench("split.json")["workloads"]["deep"]["summary"]["ratios"]
    deep_stage = row(text, "## Cost of splitting", "deep model (4 x Linear 1024 + ReLU, micro-batch 8)")
    assert deep_stage[3] == f"1 : {q['B/F'][0]:.2f} : {q['W/F'][0]:.2f}"
    late = bench("p2p.json")["waits_s"]["late"]
    assert row(text, "## A late receive", "128 KiB")[2] == f"{statistics.median(late) * 1e3:.2f}"


def test_a_missing_json_leaves_its_section_saying_how_to_make_it(tmp_path):
    shutil.copy(os.path.join(BENCH, "p2p.json"), tmp_path / "p2p.json")
    text = renderer().render(str(tmp_path))
    assert "_No `bench/deep.json` yet: run `python scripts/benchmark_schedules.py --what both`._" in text
    assert "| 128 KiB | 40 |" in text and "512 KiB" not in text


def test_a_gain_is_measured_over_predicted_unless_the_prediction_gains_under_one_percent():
    docs = renderer()
    assert docs.gain_ratio(1.03, 1.06) == pytest.approx(0.5) and docs.gain_ratio(1.03, 1.005) is None
    assert docs.gain_cell(1.03, 1.06) == "50%" and docs.gain_cell(1.03, 1.005) == "-"


def test_an_interlock_run_is_titled_by_its_file_name():
    docs = renderer()
    assert docs.interlock_title("interlock-clipping-off.json") == \
        "## Interlocked steps, clipping off, paired round by round"
    assert docs.interlock_title("interlock-timed-p4-zero1-bf16-clipping-off.json") == \
        "## Interlocked steps at p = 4, ZeRO 1, bf16, passes of set times, clipping off, paired round by round"
    assert set(docs.INTERLOCK_RUNS) <= set(docs.INPUTS)


def test_publishing_a_rerun_keeps_the_run_history_in_the_file(tmp_path, monkeypatch):
    docs = renderer()
    monkeypatch.setattr(docs, "BENCH_DIR", str(tmp_path))
    monkeypatch.setattr(docs, "main", lambda argv: 0)  # the page itself is rendered by the test above
    (tmp_path / "x.json").write_text(json.dumps({"table": ["old"], "notes": {"first_run": {"table": ["older"]}}}))
    docs.publish({"table": ["new"], "notes": {"this_run": "why"}}, "x")
    written = json.loads((tmp_path / "x.json").read_text())
    assert written["table"] == ["new"]
    assert written["notes"] == {"first_run": {"table": ["older"]}, "this_run": "why"}
    (tmp_path / "z.json").write_text(json.dumps({"table": ["old"], "notes": "the first run: 1.2x"}))
    docs.publish({"table": ["new"]}, "z")  # notes as a text: kept whole
    assert json.loads((tmp_path / "z.json").read_text()) == {"table": ["new"], "notes": "the first run: 1.2x"}
    docs.publish({"table": ["newer"]}, "y")  # no file before: the record as it is
    assert json.loads((tmp_path / "y.json").read_text()) == {"table": ["newer"]}
