"""scripts/benchmark_overlap.py without nodes: the published table from a record, and the parameter bytes per rank of
DualPipe's two expert layouts counted on the deep MoE model."""
import sys

import pytest

from local_launch import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_overlap as bo  # noqa: E402


def test_the_table_shows_overlapped_beside_sequential_and_the_exposed_communication():
    cell = lambda step, exposed, *guess: {"step_s": step, "comm": {"0": [exposed, 0.5], "1": [exposed, 0.6]},  # noqa
                                          **({"predicted": [guess[0]], "auto": [guess[1]]} if guess else {})}
    record = {"machine": "2-core test machine", "rates": ["1gbit"], "measured_rate": {"1gbit": "990 Mbit/s"},
              "results": {"deep": {"1gbit": {"overlapped": cell(0.9, 0.2, 0.95, 0.85),
                                             "sequential": cell(1.2, 0.7, 1.1, 1.3),
                                             "duplicate": cell(0.4, 0.0), "ratio": [1.04],
                                             "wire_ratio": [0.55]}}},
              "parameter_bytes": {"deep": {"shard": 3 << 20, "duplicate": 5 << 20, "dense": 1 << 20,
                                           "experts": 4 << 20}}}
    parts = {"pairs": 0.5, "passes alone": 0.2, "receives": 0.1, "sends": 0.0, "gradient sum": 0.05, "optimizer": 0.05,
             "rest": 0.0, "step": 0.9}
    record["results"]["deep"]["1gbit"]["overlapped"]["runs"] = [
        {"step_s": 0.9, "parts": {"0": parts, "1": {**parts, "receives": 0.3, "step": 1.1}}}]
    text = "\n".join(bo.table(record))
    assert "| 1gbit | 1.04 (wire 0.55) | 900 / 950 / 850 | 1200 / 1100 / 1300 | 1.33x | 200 / 500, 200 / 600 | " \
        "700 / 500, 700 / 600 | 400 / - / - |" in text
    assert "| 1gbit | 1000 | 500 | 200 | 200 | 0 | 50 | 50 | 0 |" in text
    assert "experts shared by the copies 3.0 MiB, duplicated 5.0 MiB" in text


def test_sharing_the_experts_halves_their_bytes_per_rank():
    sizes = bo.parameter_bytes("deep")
    width, depth, experts = 1024, 8, 4
    dense = depth * (width * width + width + width * experts) * 4  # each block's dense layer and gate
    assert sizes["dense"] == dense and sizes["experts"] == depth * experts * (width * width + width) * 4
    assert sizes["duplicate"] - sizes["shard"] == pytest.approx(sizes["experts"] / 2)


def traced_run(path, compute, comm, m=4):
    """A trace file of DualPipe at 2 ranks whose passes took `compute` and then waited for `comm` (per kind), one
    collective at the end of each pass, as a run with --overlap off writes it; and that run's makespan."""
    from types import SimpleNamespace

    from schedules.observe.trace import write_chrome_trace
    from schedules.placement import MirrorPlacement
    from schedules.simulator.simulate import simulate
    costs = {(r, c): dict(compute) for r in range(2) for c in range(2)}
    run = simulate("dualpipe", 2, m, costs=costs, comm={k: dict(comm) for k in costs}, overlap=False, iterations=1)
    tracers = []
    for rank, row in enumerate(run.timeline.ranks):
        waits = [("all_to_all", p.end - c, p.end - c, p.end, 0, 0, None) for p in row  # a BW waits for its B's
                 for c in [comm.get(p.kind, comm.get("B", 0.0) if p.kind == "BW" else 0.0)] if c]
        tracers.append(SimpleNamespace(rank=rank, passes=row, placement=MirrorPlacement(2), memory_samples=[],
                                       peak_bytes={}, p2p=[], other=[], comm=waits))
    write_chrome_trace(tracers, str(path), {"schedule": "dualpipe", "stages": 2, "micro_batches": m})
    return run.makespan


def test_a_traced_sequential_run_predicts_itself_and_its_overlap(tmp_path, monkeypatch):
    """predicted(): each pass's computation and collectives read back from the trace (trace.communication_costs)
    give the sequential run's step again, and the overlapped pairs' shorter one."""
    from schedules.observe.trace import communication_costs
    compute, comm = {"F": 0.010, "B": 0.012, "W": 0.005}, {"F": 0.008, "B": 0.008}
    span = traced_run(tmp_path / "trace.json", compute, comm)
    costs, comms = communication_costs(str(tmp_path / "trace.json"))
    assert costs[(0, 0)]["F"] == pytest.approx(0.010) and comms[(1, 1)]["B"] == pytest.approx(0.008)
    assert comms[(0, 0)]["W"] == 0.0
    monkeypatch.setitem(bo.MODELS["deep"], "micro_batches", 4)
    from schedules.observe import forecast
    monkeypatch.setattr(forecast, "LINK_LATENCY", 0.0)
    step = span + 0.05  # the optimizer step and the rest outside the passes
    got = bo.predicted(str(tmp_path / "trace.json"), "deep", 1e15, step)  # a link of no cost: the p2p free
    assert got["sequential"] == pytest.approx(step, rel=1e-3)
    from schedules.observe.trace import communication_shapes
    from schedules.simulator.simulate import simulate
    shapes = communication_shapes(str(tmp_path / "trace.json"))  # each pass: its computation, then its collective
    assert shapes[(0, 0)]["F"] == (pytest.approx([0.010, 0.0], abs=1e-9), pytest.approx([0.008]))
    costs = {(r, c): dict(compute) for r in range(2) for c in range(2)}

    def overlapped(shape, fill=True):
        return simulate("dualpipe", 2, 4, costs=costs, comm={k: dict(comm) for k in costs}, iterations=1,
                        comm_shape=shape, fill=fill).makespan
    turns = overlapped(shapes)
    assert got["overlapped"] == pytest.approx(turns + 0.05, rel=1e-3) and turns < span - 0.005
    # a collective issued at its pass's end has no computation of its own pass to hide behind, only what the other
    # pass computes after it: the turns hide less than the closed form of the totals says, unless the backward's
    # weight gradients fill the time both wait: each rank's three fused backwards (two alone, waiting for their own
    # 8 ms collective at their end, and one paired, whose forward's collective, issued once the backward has ended,
    # holds the pair) and its last B, whose own W comes next (passes.own_weight_next), each compute their W (5 ms)
    # under a collective instead of before or after it
    assert overlapped(shapes, fill=False) > overlapped(None) + 0.005
    assert turns == pytest.approx(overlapped(shapes, fill=False) - 4 * 0.005, abs=5e-4)
    # the all-to-alls all the core's own work (as over an unthrottled link): no turn hides them
    busy = bo.predicted(str(tmp_path / "trace.json"), "deep", 1e15, step, comms)
    assert busy["overlapped"] == pytest.approx(busy["sequential"], rel=1e-3)


def test_a_saved_run_is_predicted_again_from_its_traces(tmp_path, monkeypatch):
    """--repredict FOLDER: the simulator's figures of a saved run recomputed from its traces, each round's from its
    own sequential trace, with the core's part of the all-to-alls from that round's unthrottled one; the rest of
    the record as it was."""
    import json
    monkeypatch.setitem(bo.MODELS["deep"], "micro_batches", 4)
    compute = {"F": 0.010, "B": 0.012, "W": 0.005}
    folder = tmp_path / "run"
    (folder / "traces").mkdir(parents=True)
    spans = {}
    for rate, comm in (("off", 0.001), ("250mbit", 0.008)):
        spans[rate] = traced_run(folder / "traces" / f"deep-{rate}-sequential-0.json", compute, {"F": comm, "B": comm})
    def config(step):  # one run, and its medians as the table reads them
        return {"runs": [{"step_s": step}], "step_s": step, "comm": {"0": [0.0, 0.0], "1": [0.0, 0.0]},
                "predicted": [0.0]}
    cell = {rate: {"sequential": config(spans[rate] + 0.05), "overlapped": config(1.0), "ratio": [1.0],
                   "wire_ratio": [1.0]} for rate in spans}
    record = {"machine": "2-core test machine", "parameter_bytes": {"deep": None}, "rates": ["off", "250mbit"],
              "measured_rate": {"off": "10 Gbit/s", "250mbit": "250 Mbit/s"}, "results": {"deep": cell},
              "args": {"rounds": 1, "micro_batches": 4, "smoke": False}}
    (folder / "overlap.json").write_text(json.dumps(record))
    got = bo.main(["--repredict", str(folder), "--out", str(tmp_path / "again")])
    from schedules.observe.trace import communication_costs
    cpu = communication_costs(str(folder / "traces" / "deep-off-sequential-0.json"), own=True)[1]
    expected = bo.predicted(str(folder / "traces" / "deep-250mbit-sequential-0.json"), "deep", 250e6,
                            spans["250mbit"] + 0.05, cpu)
    row = got["results"]["deep"]["250mbit"]
    assert row["overlapped"]["predicted"] == [pytest.approx(expected["overlapped"])]
    assert row["sequential"]["predicted"] == [pytest.approx(expected["sequential"])]
    assert row["overlapped"]["predicted"][0] < row["sequential"]["predicted"][0]
    assert row["overlapped"]["runs"] == [{"step_s": 1.0}]
    assert json.loads((tmp_path / "again" / "overlap.json").read_text())["results"]["deep"]["250mbit"] == row
