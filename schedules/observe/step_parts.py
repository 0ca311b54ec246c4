"""Where a traced step's time goes, rank by rank: what to look at when a step is slower than the simulator or another
run says it should be (the overlap benchmark sets one over the link beside one without it).

    from schedules.observe.step_parts import step_parts
    step_parts("run.json")   # {rank: {"pairs": 6.52, "passes alone": 1.46, "receives": 0.58, ...}}, seconds a step

Each part is the time the rank's engine thread spent in it, a median over the traced steps:

- pairs: a forward-backward pair, from its first pass's start to its last one's end, and the weight gradients no
  wait took, computed as it ends (PairWeightGrads);
- passes alone: the passes outside pairs (F, B, W, BW);
- receives / sends: the pipeline's point-to-point instructions (a receive's time is mostly waiting for its message);
- gradient sum: ReduceGrads and ReduceTiedGrads (the copies' or replicas' gradients summed);
- optimizer: OptimizerStep;
- rest: the step's span less all of the above (micro-batch loads, the engine's own work between instructions).
"""
import json
import statistics

PARTS = ("pairs", "passes alone", "receives", "sends", "gradient sum", "optimizer", "rest")
_OTHER = {"PairWeightGrads": "pairs", "ReduceGrads": "gradient sum", "ReduceTiedGrads": "gradient sum",
          "OptimizerStep": "optimizer"}


def step_parts(path):
    """{rank: {part: seconds}} of a trace file (train.py --trace), medians over its traced steps; parts as the
    module docstring says, and "step": the span from the step's first instruction to its last one's end."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    spans = {}  # (rank, iteration) -> [(part, start, end)]
    pairs = {}  # (rank, iteration, pair) -> [start, end]
    for e in events:
        cat, a = e.get("cat"), e.get("args", {})
        if cat in ("comm", "exposed"):  # inside passes: already counted by them
            continue
        key, start, end = (e["pid"], a["iteration"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        if cat == "p2p":
            part = "receives" if e["name"].startswith("Recv") else "sends"
        elif cat == "other":
            part = _OTHER.get(e["name"], "rest")
        elif a.get("pair") is not None:
            span = pairs.setdefault((*key, a["pair"]), [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            continue
        else:
            part = "passes alone"
        spans.setdefault(key, []).append((part, start, end))
    for (rank, iteration, _), (start, end) in pairs.items():
        spans.setdefault((rank, iteration), []).append(("pairs", start, end))
    steps = {}  # rank -> [{part: seconds} of each step]
    for (rank, _), parts in sorted(spans.items()):
        step = max(end for _, _, end in parts) - min(start for _, start, _ in parts)
        totals = dict.fromkeys(PARTS, 0.0)
        for part, start, end in parts:
            totals[part] += end - start
        totals["rest"] += step - sum(totals.values())
        steps.setdefault(rank, []).append({**totals, "step": step})
    return {rank: {part: statistics.median(s[part] for s in rows) for part in (*PARTS, "step")}
            for rank, rows in steps.items()}


def format_parts(parts, ranks=None):
    """One line per rank: each part's seconds, e.g. 'rank 0: step 9.42 s = pairs 6.52 + passes alone 1.46 + ...'."""
    lines = []
    for rank in ranks if ranks is not None else sorted(parts):
        p = parts[rank]
        lines.append(f"rank {rank}: step {p['step']:.2f} s = " + " + ".join(f"{k} {p[k]:.2f}" for k in PARTS))
    return "\n".join(lines)
