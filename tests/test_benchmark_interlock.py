"""scripts/benchmark_interlock.py's contention figures: the share of each pass during which the other rank computed,
the pass time of the interlocked run over the synchronised one's, and the cores the ranks kept busy. Fast:
synthetic traces, no process started."""
import importlib.util
import os
import statistics
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script():
    spec = importlib.util.spec_from_file_location("benchmark_interlock",
                                                  os.path.join(ROOT, "scripts", "benchmark_interlock.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def p(kind, start, end, chunk=0):
    return SimpleNamespace(kind=kind, chunk=chunk, start=start, end=end, duration=end - start)


def test_overlap_counts_the_other_ranks_passes_and_step_work():
    bench = script()
    timeline = SimpleNamespace(ranks=[[p("F", 0.0, 1.0), p("B", 2.0, 4.0)],
                                      [p("F", 0.5, 1.5)]])
    # rank 1's optimizer step (traced as 'other') computes during rank 0's B from 3.0 to 3.5; its wait does not
    ranks = [{"runs": {"x": {"sync": [{"other": []}]}}},
             {"runs": {"x": {"sync": [{"other": [["OptimizerStep", 3.0, 3.5, None],
                                                 ["ValidateStep", 2.0, 3.0, None]]}]}}}]
    got = bench._overlaps(ranks, "x", "sync", 0, timeline)
    assert got == [(0, "F", 0, 1.0, 0.5), (0, "B", 0, 2.0, 0.25), (1, "F", 0, 1.0, 0.5)]


def test_contention_compares_the_overlap_and_the_pass_time_of_the_two_runs():
    bench = script()
    # the interlocked run overlaps 3 passes in 4 with the other rank's compute, the synchronised one 1 in 4;
    # its F passes took 1.2 where the synchronised run's took 1.0, its B passes the same
    def passes(f, shared):  # 4 F passes taking f (rank 0), 4 B passes taking 2.0 (rank 1); `shared` of each overlapped
        return [(0, "F", 0, f, 1.0 if i < shared else 0.0) for i in range(4)] + \
            [(1, "B", 0, 2.0, 1.0 if i < shared else 0.0) for i in range(4)]

    sync, inter = passes(1.0, 1), passes(1.2, 3)
    c = bench.contention({"sync": sync, "interlocked": inter})
    assert c["overlap"]["sync"] == pytest.approx(0.25)
    assert c["overlap"]["interlocked"] == pytest.approx((3.6 + 6.0) / (4.8 + 8.0))
    assert c["cost_ratio_measured"] == pytest.approx((1.2 + 2.0) / (1.0 + 2.0))


def test_cores_in_use_sums_every_ranks_cpu_time_over_the_slowest_ranks_wall_time():
    bench = script()

    def rank(*runs):  # (cpu_s, wall_s) per round
        return {"runs": {"x": {"sync": [{"cpu_s": c, "wall_s": w} for c, w in runs]}}}

    ranks = [rank((1.0, 4.0), (3.0, 2.0)), rank((2.0, 5.0), (1.0, 2.0))]
    assert bench.cores_in_use(ranks, "x", "sync", 2) == pytest.approx(statistics.median([3.0 / 5.0, 4.0 / 2.0]))
    old = [{"runs": {"x": {"sync": [{}]}}}] * 2  # a record from before the CPU time was kept
    assert bench.cores_in_use(old, "x", "sync", 1) is None


def test_rounds_are_paired_and_the_interval_says_whether_they_tell_measurement_from_prediction():
    bench = script()
    predicted = [1.05, 0.95, 1.10, 1.00, 1.02, 0.98]  # the rounds drift; each round's prediction follows it
    on_time = bench.ratio_interval([x * 1.0 for x in predicted], predicted)
    assert on_time == [1.0, 1.0, 1.0]
    short = bench.ratio_interval([x * f for x, f in zip(predicted, (0.97, 0.98, 0.99, 0.98, 0.97, 0.99))], predicted)
    assert short[0] == pytest.approx(0.98) and short[1] <= short[0] <= short[2] < 1  # every round short: not 1
    noisy = bench.ratio_interval([x * f for x, f in zip(predicted, (0.95, 1.04, 0.97, 1.05, 0.99, 1.02))], predicted)
    assert noisy[1] < 1 < noisy[2]  # the rounds cannot tell
    assert noisy == bench.ratio_interval([x * f for x, f in zip(predicted, (0.95, 1.04, 0.97, 1.05, 0.99, 1.02))],
                                         predicted)  # seeded: the same rounds give the same figures
    assert bench.quartiles([1.0, 2.0, 3.0]) == (1.0, 3.0)
    assert bench.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)


def test_a_run_publishes_where_its_kind_of_run_belongs():
    bench = script()
    assert bench.published_name(bench.parse_args([])) == "interlock"
    assert bench.published_name(bench.parse_args(["--clipping-off"])) == "interlock-clipping-off"
    assert bench.published_name(bench.parse_args(["--stages", "4", "--pass-ms", "1", "1", "1"])) == \
        "interlock-timed-p4"
    assert bench.published_name(bench.parse_args(["--stages", "4", "--pass-ms", "1", "1", "1", "--zero", "1"])) == \
        "interlock-timed-p4-zero1"
    assert bench.published_name(bench.parse_args(["--stages", "4", "--pass-ms", "1", "1", "1", "--zero", "1",
                                                  "--bf16"])) == "interlock-timed-p4-zero1-bf16"


def test_clipping_is_set_where_deepspeeds_optimizers_read_it():
    from types import SimpleNamespace
    bench = script()
    zero = SimpleNamespace(_config=SimpleNamespace(gradient_clipping=0.0), optimizer=SimpleNamespace(clip_grad=0.0))
    bench.set_clipping(zero, 0.5)
    assert zero._config.gradient_clipping == zero.optimizer.clip_grad == 0.5
    torch_opt = SimpleNamespace(_config=SimpleNamespace(gradient_clipping=0.0), optimizer=SimpleNamespace())
    bench.set_clipping(torch_opt, 0.5)
    assert torch_opt._config.gradient_clipping == 0.5 and not hasattr(torch_opt.optimizer, "clip_grad")


def test_an_interlocked_run_is_predicted_validated_as_it_validated():
    bench = script()

    def ranks(**counters):
        return [{"runs": {"zb-h2": {"interlocked": [counters]}}}]
    assert bench.validation_of(ranks(), "zb-h2", "interlocked", 0) is None  # no counters: nothing validated
    assert bench.validation_of(ranks(validations=0), "zb-h2", "interlocked", 0) is None  # ZeRO 0, clipping off
    assert bench.validation_of(ranks(validations=10, speculated=10), "zb-h2", "interlocked", 0) is None
    assert bench.validation_of(ranks(validations=10, waited=9), "zb-h2", "interlocked", 0) == "wait"
    assert bench.validation_of(ranks(validations=10, waited=2), "zb-h2", "interlocked", 0) == "ahead"
