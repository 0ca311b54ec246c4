"""train.py --trace records what each rank really executed, in the simulator's timeline schema, as a
Chrome trace; the renderer draws it beside the simulator's prediction from its own costs."""
import json

import pytest

from local_launch import ROOT, launch
from schedules.observe.trace import (
    held_messages,
    load_chrome_trace,
    measured_costs,
    measured_dispatch,
    measured_latency,
    measured_p2p_cpu,
    one_iteration,
    p2p_cpu_samples,
    paired_messages,
    predict,
)
from schedules.simulator.simulate import simulate
from schedules.simulator.timeline import Pass, Timeline


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v", "dualpipe"])
def test_trace_matches_the_schedule(schedule, tmp_path):
    trace = tmp_path / "trace.json"
    run = launch(2, ["--model", "deep", "--deep-depth", "8", "--deep-width", "32", "--steps", "3",
                     "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule, "--gradient-accumulation-steps",
                     "4", "--micro-batch-size", "2", "--trace", trace, "--trace-steps", "2", "--dist-timeout", "60"],
                 timeout=120)
    assert run.ok, run.explain()
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e.get("cat") == "p2p" for e in events)
    timeline, p2p = load_chrome_trace(trace)
    assert timeline.iterations() == [0, 1] and timeline.units == "s"
    expected = simulate(schedule, 2, 4, iterations=1).timeline
    for rank in range(2):
        for it in (0, 1):
            got = [(p.kind, p.micro_batch, p.chunk) for p in timeline.ranks[rank] if p.iteration == it]
            assert got == [(p.kind, p.micro_batch, p.chunk) for p in expected.ranks[rank]]
            assert p2p[(rank, it)] > 0
        row = timeline.ranks[rank]
        assert all(a.end <= b.start + 1e-6 for a, b in zip(row, row[1:]))  # one pass at a time, in order
    step = one_iteration(timeline, 1)
    assert min(p.start for _, p in step.passes()) == 0.0


def test_prediction_keeps_each_ranks_measured_busy_time():
    """Costs are means per (rank, chunk, kind): a step's slow first W stays in the prediction."""
    def timed(rank):  # a traced ZB-H1 step, W of micro-batch 0 three times slower than the others
        order = simulate("zb-h1", 2, 4, iterations=1).timeline.ranks[rank]
        clock, row = 0.0, []
        for p in order:
            d = {"F": 1.0, "B": 1.0, "W": 3.0 if p.micro_batch == 0 else 1.0}[p.kind] * (1 + rank)
            row.append(Pass(p.kind, p.stage, p.chunk, p.micro_batch, clock, clock + d))
            clock += d + 0.5
        return row
    traced = Timeline([timed(0), timed(1)], "s", {"schedule": "zb-h1", "stages": 2, "micro_batches": 4})
    assert measured_costs(traced)[(1, 0)] == {"F": 2.0, "B": 2.0, "W": 3.0}
    predicted = predict(traced)
    for rank in range(2):
        assert predicted.per_rank[rank]["busy"] == pytest.approx(traced.busy(rank))


def test_engine_time_measured_from_the_trace():
    """Between traced instructions a rank runs the engine's own code: per pass. A send's time is its
    instruction's; a receive's, when its data had been sent before it began."""
    row = [Pass("F", 0, 0, 0, 0.0, 1.0), Pass("F", 0, 0, 1, 1.5, 2.5)]
    p2p = [("SendActivation", 1.1, 1.4, 0), ("SendActivation", 2.6, 2.8, 0)]
    assert measured_dispatch(Timeline([row], "s"), [p2p]) == {0: pytest.approx(0.15)}  # 3 gaps of 0.1, 2 passes
    # the first found its data, the second waited
    peer = [("RecvActivation", 1.5, 1.6, 0), ("RecvActivation", 2.7, 3.5, 0)]
    send, recv = measured_p2p_cpu([p2p, peer])
    assert send == pytest.approx(0.25) and recv == pytest.approx(0.1)


def test_a_receive_counts_as_taking_its_data_in_only_once_the_data_could_have_crossed_the_link():
    """Over a slow link a message whose send ended before its receive began may still be crossing: given the
    link's latency, only a receive that began that long after its send ended measures the receive's own time."""
    sends = [("SendActivation", 0.0, 0.01, 0), ("SendActivation", 1.0, 1.01, 0)]
    # the first receive began 0.05 after its send and took 0.2 (it waited for the bytes); the second 0.5 after
    receives = [("RecvActivation", 0.06, 0.26, 0), ("RecvActivation", 1.51, 1.52, 0)]
    assert p2p_cpu_samples([sends, receives])[1] == [pytest.approx(0.2), pytest.approx(0.01)]
    assert p2p_cpu_samples([sends, receives], latency=0.25) == ([pytest.approx(0.01)] * 2, [pytest.approx(0.01)])
    assert measured_p2p_cpu([sends, receives], latency=0.25) == (pytest.approx(0.01), pytest.approx(0.01))


def test_messages_held_beyond_what_their_link_takes_are_listed():
    """A receiver that waited for its message past the send's end plus the bar waited that long for something the
    link does not explain: held, for the time from the later of the bar and the receive's start. One that got its
    message within the bar, or began after the message was there, is not."""
    sends = [("SendGrad", 0.0, 0.01, 0), ("SendGrad", 1.0, 1.01, 0), ("SendGrad", 2.0, 2.01, 0),
             ("SendGrad", 3.0, 3.01, 0)]
    receives = [("RecvGrad", 0.02, 0.05, 0),  # within the bar
                ("RecvGrad", 1.02, 1.2, 0),  # waiting from before the bar (1.11) to 1.2
                ("RecvGrad", 2.5, 2.51, 0),  # began long after, the data there: its own 10 ms
                ("RecvGrad", 3.5, 3.6, 0)]  # began after the bar and still waited 0.1
    held = held_messages([sends, receives], bar=0.1, slack=0.02)
    assert [(s, r) for s, r, _ in held] == [(sends[1], receives[1]), (sends[3], receives[3])]
    assert [t for _, _, t in held] == [pytest.approx(0.09), pytest.approx(0.1)]
    assert held_messages([sends, receives], bar=0.2, slack=0.02) == [(sends[3], receives[3], pytest.approx(0.1))]


def test_receives_are_paired_with_their_sends_by_the_schedules_own_streams_at_any_rank_count():
    """3 ranks of 1F1B, m = 2: the simulator says who sends to whom, in each rank's stream order; the traced
    records pair by it (rank 1 receives activations from rank 0 and gradients from rank 2). A receive that
    began after its send ended took the data in (its time is the receive's own); one that began before
    waited, and from the send's end to its end is the message's latency plus that receive time."""
    messages = simulate("1f1b", 3, 2, iterations=1).messages
    assert messages[1] == [(False, "activation", 0), (True, "activation", 2), (False, "activation", 0),
                           (False, "gradient", 2), (True, "activation", 2), (True, "gradient", 0),
                           (False, "gradient", 2), (True, "gradient", 0)]
    for rank, row in enumerate(messages):  # every send has its receive on the peer
        for is_send, kind, peer in row:
            assert abs(peer - rank) == 1
        sent = [(kind, peer) for is_send, kind, peer in row if is_send]
        for kind, peer in set(sent):
            received = [(k, q) for s, k, q in messages[peer] if not s]
            assert sent.count((kind, peer)) == received.count((kind, rank))

    v = simulate("zb-v", 4, 8, iterations=1).messages  # V-shape: chunk 1 runs back from rank 3 to rank 0
    assert {peer for s, kind, peer in v[0] if kind == "activation" and not s} == {1}
    assert {peer for s, kind, peer in v[1] if kind == "activation" and not s} == {0, 2}
    assert {peer for s, kind, peer in v[3] if kind == "activation" and not s} == {2}

    def records(rank, times):  # one record per message of the rank's stream, at the given (start, end)
        names = {(True, "activation"): "SendActivation", (False, "activation"): "RecvActivation",
                 (True, "gradient"): "SendGrad", (False, "gradient"): "RecvGrad"}
        return [(names[m[:2]], s, e, 0) for m, (s, e) in zip(messages[rank], times)]

    # sends take 0.1; rank 1's two activation receives: the first found its data (0.05 to take in), the second
    # waited from 2.0 to 3.3 for a send that ended at 3.0 (latency 0.3 - 0.05); the rest found theirs too
    rank0 = records(0, [(0.0, 0.1), (1.0, 1.1), (5.0, 5.05), (8.0, 8.05)])
    rank1 = records(1, [(0.2, 0.25), (0.5, 0.6), (2.0, 3.3), (4.0, 4.05), (4.5, 4.6), (4.7, 4.8), (7.0, 7.05),
                        (7.5, 7.6)])
    rank2 = records(2, [(0.7, 0.75), (3.5, 3.6), (4.9, 4.95), (6.0, 6.1)])
    rank0[1] = ("SendActivation", 2.9, 3.0, 0)
    pairs = paired_messages([rank0, rank1, rank2], messages)
    assert len(pairs) == 8 and all(s[0].startswith("Send") and r[0].startswith("Recv") for s, r in pairs)
    assert (("SendActivation", 2.9, 3.0, 0), ("RecvActivation", 2.0, 3.3, 0)) in pairs
    send, recv = measured_p2p_cpu([rank0, rank1, rank2], messages)
    assert send == pytest.approx(0.1) and recv == pytest.approx(0.05)
    assert measured_latency([rank0, rank1, rank2], messages, recv) == pytest.approx(0.25)
    # without the streams only two ranks pair
    assert paired_messages([rank0, rank1, rank2]) == [] and measured_p2p_cpu([rank0, rank1, rank2]) == (0.0, 0.0)
    assert measured_latency([rank0, rank1, rank2]) is None
    # an iteration whose records are not the simulated stream is left out, not mispaired
    assert paired_messages([rank0[:-1], rank1, rank2], messages) == [
        (s, r) for s, r in pairs if s not in rank0 and r not in rank0]


@pytest.mark.multiprocess
def test_plot_trace_draws_measured_and_predicted(tmp_path):
    trace = tmp_path / "trace.json"
    run = launch(2, ["--model", "deep", "--deep-depth", "4", "--deep-width", "32", "--steps", "2",
                     "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--gradient-accumulation-steps",
                     "4", "--micro-batch-size", "2", "--trace", trace, "--dist-timeout", "60"], timeout=120)
    assert run.ok, run.explain()
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(ROOT / "scripts/plot_trace.py"), str(trace), "--out",
                          str(tmp_path / "t.png")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t.png").stat().st_size > 10_000 and "predicted" in out.stdout


def test_untraced_engines_do_no_timing_work():
    from schedules.observe.trace import traced
    from schedules.runtime.split_engine import SplitBackwardEngine
    plain, timed = SplitBackwardEngine._INSTRUCTION_MAP, traced(SplitBackwardEngine)._INSTRUCTION_MAP
    assert plain.keys() == timed.keys()
    assert all(plain[t] is not timed[t] for t in plain)  # only the traced class wraps its handlers
    assert not any(f.__name__.startswith("traced") for f in plain.values())


@pytest.mark.multiprocess
def test_traced_steps_train_as_untraced_ones(tmp_path):
    """Tracing changes nothing in training: with `--trace-memory` (saved-tensor hooks) on steps 2-3, the split-head
    GPTlite on zb-v (linear, embedding and vocabulary-slice weight gradients deferred and added in place) gives the
    losses of the same untraced run. The hooks once made every deferrable layer lose its weight gradient."""
    flags = ["--model-size", "tiny", "--steps", "3", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4",
             "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-parallel",
             "--dist-timeout", "120"]
    losses = {}
    for name, extra in (("plain", []), ("traced", ["--trace", tmp_path / "t.json", "--trace-steps", "2",
                                                   "--trace-memory"])):
        run = launch(2, flags + extra + ["--metrics-file", tmp_path / f"{name}.jsonl"], timeout=240)
        assert run.ok, run.explain()
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert len(losses["plain"]) == 3 and losses["plain"][2] < losses["plain"][0]
    assert losses["traced"] == pytest.approx(losses["plain"], abs=1e-6)


def test_step_parts_split_a_traced_step_and_the_bytes_its_collectives_sent(tmp_path):
    """observe/step_parts.py: a lone forward, a receive, an overlapped pair and the weight gradients it left, the
    gradient sum and the optimizer step, and what none of them covers; trace.communication_bytes: the bytes the
    pair's all-to-all sent, per step."""
    from types import SimpleNamespace

    from schedules.observe.step_parts import step_parts
    from schedules.observe.trace import communication_bytes, write_chrome_trace
    from schedules.placement import MirrorPlacement
    passes = [Pass('F', 0, 0, 0, 0.0, 0.9), Pass('BW', 0, 0, 0, 1.5, 3.0, pair=1),
              Pass('F', 0, 0, 1, 1.6, 3.2, pair=1)]
    tracer = SimpleNamespace(rank=0, passes=passes, placement=MirrorPlacement(2), memory_samples=[], peak_bytes={},
                             p2p=[("RecvGrad", 1.0, 1.5, 0)],
                             other=[("PairWeightGrads", 3.2, 3.5, 0), ("ReduceGrads", 3.5, 4.0, 0),
                                    ("OptimizerStep", 4.0, 4.2, 0)],
                             comm=[("all-to-all", 2.0, 2.5, 2.6, 0, 1000, None)])
    path = tmp_path / "trace.json"
    write_chrome_trace([tracer], str(path), {"schedule": "dualpipe", "stages": 2, "micro_batches": 2})
    parts = step_parts(str(path))[0]
    expected = {"pairs": 2.0, "passes alone": 0.9, "receives": 0.5, "sends": 0.0, "gradient sum": 0.5,
                "optimizer": 0.2, "rest": 0.1, "step": 4.2}
    assert parts == pytest.approx(expected)
    assert communication_bytes(str(path)) == {0: 1000}


def test_a_collective_s_own_time_leaves_out_the_wait_for_a_late_peer(tmp_path):
    """trace.communication_costs(own=True): each all-to-all counted from when the last rank of its group reached
    it (the shortest of the group's times for it: they end together), what keeps a core busy over a free link;
    a group a rank traced fewer of (or another replica's, not traced) stays as traced."""
    from types import SimpleNamespace

    from schedules.observe.trace import communication_costs, write_chrome_trace
    from schedules.placement import MirrorPlacement
    tracers = []
    # two ranks, each a forward (0-10 ms) with two all-to-alls over group (0, 1): rank 1 reaches the first 2 ms
    # after rank 0 and the second 1 ms before it; each ends together on both, 1 ms after the later one came
    arrivals = {0: (0.002, 0.006), 1: (0.004, 0.005)}
    for rank in (0, 1):
        comm = [("all-to-all", at, at, end, 0, 0, (rank, (0, 1)))
                for at, end in zip(arrivals[rank], (0.005, 0.007))]
        comm.append(("capacity", 0.008, 0.008, 0.009, 0, 0, (rank, (0, 1, 2, 3))))  # ranks 2 and 3 not traced
        tracers.append(SimpleNamespace(rank=rank, passes=[Pass('F', rank, 0, 0, 0.0, 0.010)],
                                       placement=MirrorPlacement(2), memory_samples=[], peak_bytes={}, p2p=[],
                                       other=[], comm=comm))
    path = tmp_path / "trace.json"
    write_chrome_trace(tracers, str(path), {"schedule": "dualpipe", "stages": 2, "micro_batches": 1})
    traced = communication_costs(str(path))[1]
    own = communication_costs(str(path), own=True)[1]
    assert traced[(0, 0)]["F"] == pytest.approx(0.003 + 0.001 + 0.001)
    assert traced[(1, 0)]["F"] == pytest.approx(0.001 + 0.002 + 0.001)
    # the first: rank 0 waited 2 ms for rank 1 (own 1 ms); the second: rank 1 waited 1 ms for rank 0 (own 1 ms)
    assert own[(0, 0)]["F"] == pytest.approx(0.001 + 0.001 + 0.001)
    assert own[(1, 0)]["F"] == pytest.approx(0.001 + 0.001 + 0.001)
