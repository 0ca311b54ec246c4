"""scripts/benchmark_nodes.py without nodes: it reads auto's ranked table as train.py prints it (the real
`choose.table`, so a change of its columns fails here), and renders the published table from a record."""
import sys

import pytest

from local_launch import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_nodes as bn  # noqa: E402

from schedules.planner.candidate import Candidate  # noqa: E402
from schedules.planner.choose import Choice, summary, table  # noqa: E402


def candidate(schedule, step, v=None, vocab=False, cut="profile"):
    return Candidate(schedule, v, cut, [0, 3, 7], step, step * 0.9, step * 0.1, [0.1, 0.2], [2**20, 2**21], [1e6, 2e6],
                     step, vocab)


def test_auto_s_table_and_pick_are_read_as_printed():
    choice = Choice(2, 8, None, [candidate("zb-h2", 0.2143), candidate("interleaved", 0.25, v=2),
                                 candidate("zb-v", 0.26, vocab=True),
                                 candidate("1f1b", 0.3881, cut="uniform=parameters"),
                                 candidate("interleaved", 0.31, v=3)], [], [])
    out = "\n".join(["noise", "auto: predicted per candidate, fastest first (the simulator ...)", *table(choice),
                     f"auto: {summary(choice)}; profiling and choosing took 3.0 s",
                     "step 1/10: loss 9.1", "auto: predicted 214.3 ms per step, ran 219.0 ms (+2%; the median ...)"])
    said = bn.auto_said(out)
    assert said["predicted"] == pytest.approx({"zb-h2": 0.2143, "interleaved v=2": 0.25, "interleaved": 0.25,
                                               "zb-v +vocab": 0.26, "1f1b": 0.3881, "interleaved v=3": 0.31})
    assert (said["pick"], said["pick_predicted_s"], said["pick_ran_s"]) == ("zb-h2", pytest.approx(0.2143), 0.219)


def test_the_table_shows_each_speed_beside_the_unthrottled_link_and_auto():
    record = {"machine": "2-core test machine", "rates": ["off", "200mbit"],
              "measured_rate": {"off": "12 Gbit/s", "200mbit": "191 Mbit/s"},
              "results": {"deep": {"1f1b": {"off": {"step_s": 0.2, "auto_s": 0.21},
                                            "200mbit": {"step_s": 0.3, "auto_s": 0.39}},
                                   "zb-h1": {"off": {"step_s": 0.15, "auto_s": None}}}},
              "auto": {"deep": {"200mbit": {"pick": "1f1b", "pick_predicted_s": 0.39, "pick_ran_s": 0.31,
                                            "fastest": "1f1b", "fastest_s": 0.3, "pick_measured_s": 0.3}}}}
    text = "\n".join(bn.table(record))
    assert "| 1f1b | 200 / 210 | 300 (x1.50) / 390 |" in text
    assert "| zb-h1 | 150 |  |" in text
    assert "200mbit: 1f1b (predicted 390 ms, ran 310; fastest measured 1f1b 300 ms, the pick's own 300 ms)" in text


def test_the_fastest_schedule_is_run_by_train_py_beside_auto_s_pick(monkeypatch):
    """The launch's fastest schedule, when auto picked another, runs by train.py too (so pick and fastest are
    timed by one harness) and the table says how the pick compares; the pick itself is not run again."""
    ran = []
    monkeypatch.setattr(bn, "train_across", lambda nodes, args, model, extra: (ran.append(extra) or "", 0.40))
    rows = {"zb-h2": {"1gbit": {"runs": [{"step_s": 0.44}]}}, "interleaved": {"1gbit": {"runs": [{"step_s": 0.53}]}}}
    said = {"pick": "interleaved v=2", "pick_predicted_s": 0.39, "pick_ran_s": 0.41}
    assert bn.fastest_run(None, None, "deep", rows, "1gbit", said) == {"name": "zb-h2", "step_s": 0.40}
    assert ran == [["--pipeline-schedule", "zb-h2"]]
    said.update(fastest="zb-h2", fastest_s=0.44, pick_measured_s=0.53, ran_as_fastest={"zb-h2": 0.40})
    record = {"machine": "m", "rates": ["1gbit"], "measured_rate": {"1gbit": "1 Gbit/s"},
              "results": {"deep": {n: {"1gbit": {"step_s": c["1gbit"]["runs"][0]["step_s"]}}
                                   for n, c in rows.items()}},
              "auto": {"deep": {"1gbit": said}}}
    assert "the pick's own 530 ms; by train.py: zb-h2 400 ms, the pick 1.02x it)" in "\n".join(bn.table(record))
    said["pick"] = "zb-h2"
    assert bn.fastest_run(None, None, "deep", rows, "1gbit", said) == {"name": "zb-h2", "step_s": 0.41}
    assert len(ran) == 1


def test_auto_s_figures_over_rounds_are_medians_of_each_round_s_own_launch():
    # a launch's profile moves as its steps do (this machine: 10-20% launch to launch): one auto launch per round,
    # and the table's prediction and run are the medians over the rounds, as its measured steps are
    rounds = [{"predicted": {"zb-v +vocab": 0.61, "dualpipe": 0.70}, "pick": "zb-v +vocab", "pick_predicted_s": 0.61,
               "pick_ran_s": 0.68, "fastest_ran": {"name": "zb-v +vocab", "step_s": 0.68}},
              {"predicted": {"zb-v +vocab": 0.86, "dualpipe": 0.66}, "pick": "dualpipe", "pick_predicted_s": 0.66,
               "pick_ran_s": 0.65, "fastest_ran": {"name": "zb-v +vocab", "step_s": 0.64}},
              {"predicted": {"zb-v +vocab": 0.63}, "pick": "zb-v +vocab", "pick_predicted_s": 0.63, "pick_ran_s": 0.66,
               "fastest_ran": {"name": "dualpipe", "step_s": 0.62}}]
    a = bn.over_rounds(rounds)
    assert a["predicted"] == pytest.approx({"zb-v +vocab": 0.63, "dualpipe": 0.68})
    assert (a["pick"], a["picks"]) == ("zb-v +vocab", ["zb-v +vocab", "dualpipe", "zb-v +vocab"])
    assert (a["pick_predicted_s"], a["pick_ran_s"]) == pytest.approx((0.62, 0.67))
    assert a["ran_as_fastest"] == pytest.approx({"zb-v +vocab": 0.66, "dualpipe": 0.62})
    a.update(fastest="dualpipe", fastest_s=0.60, pick_measured_s=0.63)
    assert bn._by_train(a) == "; by train.py: dualpipe 620 ms, the pick 1.08x it"
    assert bn.over_rounds(rounds[1:2])["pick"] == "dualpipe"
