"""scripts/benchmark_moe.py: the published tables from a record, where its ranks go across the nodes, and one real
configuration across two emulated nodes (expert-parallel size 2: the all-to-all crosses the link)."""
import json
import sys

import pytest

from emulated_nodes import EmulatedNodes, can_make_namespaces
from local_launch import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_moe as bm  # noqa: E402


def test_expert_parallel_ranks_are_dealt_round_the_nodes():
    nodes = EmulatedNodes(2)  # not opened: placement only
    assert nodes.rank_nodes() == [0, 1]
    assert nodes.rank_nodes(2) == [0, 0, 1, 1]  # DeepSpeed's launcher: a stage's replicas on one node
    assert nodes.rank_nodes(2, interleave=True) == [0, 1, 0, 1]  # a stage's replicas (0 and 1) on two nodes


def test_the_tables_show_measured_beside_predicted_and_count_the_runs_within_bounds():
    mib = 2**20

    def cell(step, predicted, **more):
        return {"step_s": step, "predicted_s": predicted, "peak_saved_bytes": {"0": 3 * mib, "1": 5 * mib},
                "param_bytes": {"0": 2 * mib, "1": 4 * mib}, **more}
    record = {"machine": "2-core test machine", "settings": ["one machine", "250mbit"],
              "measured_rate": {"off": "6 Gbit/s", "250mbit": "249 Mbit/s"}, "args": {"expert_parallel": [1, 2]},
              "results": {"deep": {
                  "1f1b": {"one machine ep1": cell(1.0, 0.95), "one machine ep2": cell(1.2, 1.25),
                           "250mbit ep1": cell(1.5, 1.0), "250mbit ep2": cell(2.0, 1.9)},
                  "dualpipe": {"one machine ep2": cell(1.1, 1.0, sequential_step_s=1.3,
                                                       sequential_predicted_s=1.25)}}}}
    text = "\n".join(bm.table(record))
    assert "| schedule | one machine ep1 | one machine ep2 | 250mbit ep1 | 250mbit ep2 |" in text
    assert "| 1f1b | 1000 / 950 | 1200 / 1250 | 1500 / 1000 | 2000 / 1900 |" in text
    assert "| dualpipe |  | 1100 / 1000 |  |  |" in text
    assert "| dualpipe --overlap off |  | 1300 / 1250 |  |  |" in text
    assert "| 1f1b | 5.0 / 4.0 | 5.0 / 4.0 |" in text  # the larger rank's saved bytes / parameters
    # 6 runs (a twin is one); 250mbit ep1 is 1.5x its prediction
    assert "Measured / predicted: 0.96-1.50, 5 of 6 runs within 15%; the farthest: deep 1f1b 250mbit ep1 " \
        "(1.50)." in text


@pytest.mark.skipif(can_make_namespaces() is not None, reason="no emulated nodes here")
@pytest.mark.multiprocess
def test_dualpipev_with_experts_over_two_nodes_is_measured_against_its_forecast(tmp_path):
    """DualPipeV at expert-parallel size 2 across two nodes at 250 Mbit/s, the tiny deep MoE model: the run and its
    sequential twin each beside a forecast from the twin's trace; the trace holds every rank's parameter bytes."""
    bm.main(["--smoke", "--no-local", "--rates", "250mbit", "--models", "deep", "--expert-parallel", "2",
             "--schedules", "dualpipev", "--steps", "4", "--out", str(tmp_path), "--timeout", "240"])
    record = json.loads((tmp_path / "moe.json").read_text())
    c = record["results"]["deep"]["dualpipev"]["250mbit ep2"]
    for step, predicted in ((c["step_s"], c["predicted_s"]), (c["sequential_step_s"], c["sequential_predicted_s"])):
        assert 0.5 < step / predicted < 2.0, c  # tiny passes: a loose bound, the plumbing is what is checked
    assert set(c["param_bytes"]) == {"0", "1"} and all(b > 0 for b in c["param_bytes"].values())
    assert all(b > 0 for b in c["peak_saved_bytes"].values())
