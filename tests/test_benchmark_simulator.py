"""scripts/benchmark_simulator.py without its long runs: what `simulate` counts as instructions simulated, a scaling
row, the synthetic profile's cuts, and the record's report and page section. Fast: p = 2 to 4, no process."""
import importlib.util
import os

from deepspeed.runtime.pipe import schedule as ds

from schedules.planner.compose import cut
from schedules.simulator.simulate import simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instructions_simulated_are_every_rank_s_stream_once_per_run():
    p, m = 2, 4
    stream = sum(len(cmds) for r in range(p) for cmds in ds.TrainSchedule(m, p, r).steps())
    assert simulate("1f1b", p, m).instructions == (1 + 5) * stream  # one synchronised iteration, 5 chained
    assert simulate("1f1b", p, m, iterations=1).instructions == stream
    assert simulate("1f1b", p, m, replayed={2}).instructions == (1 + 6) * stream  # iteration 2 ran twice


def test_a_scaling_row_and_the_synthetic_profile():
    bench = script("benchmark_simulator")
    row = bench.scaling_row("zb-v", 2)
    assert (row["schedule"], row["stages"], row["micro_batches"]) == ("zb-v", 2, 8)
    assert row["instructions"] == simulate("zb-v", 2, 8).instructions > 0
    assert row["per_second"] == row["instructions"] / row["cpu_s"]
    profile = bench.synthetic_profile(4)
    assert len(profile.layers) == 10
    cuts = {tuple(cut(profile, method, 4)) for method in ("uniform", "parameters", "profile")}
    assert len(cuts) == 3  # the three cuts differ, so the chooser simulates each


def test_the_record_renders_in_the_report_and_the_page():
    record = {"machine": "AMD EPYC, 2 cores, Python 3.11.7", "load_average": [1.5, 1.0, 1.0],
              "load_end": [2.0, 1.0, 1.0], "args": {"stages": [4, 8], "schedules": ["1f1b", "zb-v"], "table": [8],
                                                    "choose": [8]},
              "scaling": [{"schedule": s, "stages": p, "micro_batches": 4 * p, "instructions": 1000 * p,
                           "seconds": 0.01 * p, "cpu_s": 0.01 * p, "per_second": 1e5} for s in ("1f1b", "zb-v")
                          for p in (4, 8)],
              "table": [{"stages": 8, "micro_batches": 32, "command_s": 5.0, "command_cpu_s": 4.5, "rows_s": 0.5,
                         "rows_cpu_s": 0.4, "schedules": 11, "simulated": 11}],
              "choose": [{"stages": 8, "micro_batches": 32, "layers": 18, "command_s": 4.0, "command_cpu_s": 3.5,
                          "choose_s": 0.7, "choose_cpu_s": 0.6, "candidates": 33, "pick": "dualpipe", "summary": ""}]}
    text = script("benchmark_simulator").report(record)
    assert "100k   0.04s" in text and "schedule table p = 8, m = 32: 5.0 s" in text
    page = script("benchmark_docs").simulator_section(record)
    assert "| 8 | 32 | 8000 | 100k (0.08 s) | 100k (0.08 s) |" in page
    assert "| `schedule_table.py` | 8 | 32 | 5.0 / 4.5 | 0.5 / 0.4 |" in page
