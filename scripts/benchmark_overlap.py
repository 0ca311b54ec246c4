"""What overlapping DualPipe's forward-backward pairs gains when the experts' all-to-all crosses a slow link: two
emulated nodes (emulated_nodes.py), one rank each (one per core), DualPipe at 2 ranks with the MoE deep model (and
the MoE GPTlite with --models), its two copies of each stage holding half the experts each, so every micro-batch's
dispatch and combine go over the link. Per link speed: the median step with the pairs overlapped (--overlap on,
the default) and run one pass after the other (--overlap off), the communication each rank waited for (exposed)
and had in flight, from the run's own trace; and DualPipe with every expert on both copies (--dualpipe-experts
duplicate: no all-to-all, the experts' gradients summed across the copies once a step), with each layout's
parameter bytes per rank.

    sudo python scripts/benchmark_overlap.py [--docs]     # about 15 minutes on 2 cores; needs root (namespaces)

Every configuration at one speed is a train.py launch across the two nodes; the configurations take turns in an
order rotating each round, so drift hits all alike. Writes runs/overlap/overlap.json and .txt; with --docs
docs/bench/overlap.json and the table in docs/moe.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
import bench_common as common  # noqa: E402

RATES = ["off", "1gbit", "500mbit", "250mbit"]  # the all-to-all about 0.5x, 1x and 2x the computation (deep)
MODELS = {  # the deep model's blocks each a dense layer and 4 experts (top-1); GPTlite small with 4 experts (top-2)
    # Wide enough that a micro-batch's computation matches its all-to-all at a link this host's kernel carries
    # without spending the cores on it (about 500 Mbit/s; at width 256 it was near 2 Gbit/s). Capacity factor 1,
    # DeepSpeed's default: each expert takes an even share of the micro-batch, so an all-to-all carries its tokens
    # once (none dropped pads every expert to the largest load, up to 4x the bytes with an untrained gate).
    "deep": {"flags": ["--model", "deep", "--deep-width", "1024", "--deep-depth", "8", "--moe-experts", "4",
                       "--moe-top-k", "1", "--moe-capacity-factor", "1"],
             "micro_batch_size": 256, "micro_batches": 16},
    "gptlite": {"flags": ["--model", "gptlite", "--model-size", "small", "--moe-experts", "4", "--moe-top-k", "2",
                          "--moe-capacity-factor", "1", "--partition-method", "uniform"],
                "micro_batch_size": 8, "micro_batches": 16},
}
CONFIGS = {  # label -> train.py flags
    "overlapped": ["--dualpipe-experts", "shard", "--overlap", "on"],
    "sequential": ["--dualpipe-experts", "shard", "--overlap", "off"],
    "duplicate": ["--dualpipe-experts", "duplicate"],
}


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--rates", nargs="+", default=RATES, help="link speeds (off: unthrottled)")
    p.add_argument("--models", nargs="+", default=["deep"], choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=1, help="visits of every speed")
    p.add_argument("--steps", type=int, default=4, help="steps of each run: the median of those after the first 2")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches a step (default: the model's, 16): "
                   "more leave fewer of DualPipe's passes outside its pairs")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="what runs at each speed")
    p.add_argument("--no-auto", action="store_true", help="skip auto's predictions (a profile across the nodes)")
    p.add_argument("--repredict", metavar="FOLDER", help="run nothing: recompute the simulator's figures of a saved "
                   "run (FOLDER/overlap.json and its traces) with the simulator as it is now, written to --out")
    common.add(p, "out", "docs", "timeout", out="runs/overlap", docs="overlap", timeout=900)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny models: the plumbing
    return p.parse_args(argv)


def run_across(nodes, args, model, flags, predict=False, name="run", comm_cpu=None):
    """train.py (DualPipe, 2 ranks) across the nodes, traced: (median step s, {rank: (exposed, in flight) s}, and
    with `predict` the simulator's steps from this run's trace (predicted; `comm_cpu` as there, None: this run's
    own where unthrottled) and its ratios of all-to-all to computation (communication_ratio: as run, and its bytes
    alone over the link), else None and None; and, unthrottled with `predict`, this run's all-to-alls per pass (the
    core's part at every speed), else None; and where each rank's step went (step_parts)).
    The trace is kept as OUT/traces/NAME.json (chrome://tracing, Perfetto)."""
    from schedules.observe.step_parts import step_parts
    from schedules.observe.trace import communication_costs, exposed_communication
    spec = MODELS[model]
    os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
    trace = os.path.join(args.out, "traces", f"{name}.json")
    with tempfile.TemporaryDirectory(prefix="overlap-") as folder:
        metrics = os.path.join(folder, "metrics.jsonl")
        argv = ["train.py", *spec["flags"], *flags, "--pipeline-parallel-size", "2", "--pipeline-schedule",
                "dualpipe", "--micro-batch-size", str(spec["micro_batch_size"]), "--gradient-accumulation-steps",
                str(spec["micro_batches"]), "--steps", str(args.steps), "--trace", trace, "--trace-steps",
                str(args.steps - 2), "--log-interval", "1", "--eval-interval", "0", "--metrics-file", metrics]
        common.launch_across(nodes, argv, args.timeout)
        times = [e["iter_s"] for e in map(json.loads, open(metrics)) if "iter_s" in e][2:]
        comm = exposed_communication(trace)
        forecast = ratio = None
        own_cpu = None
        if predict:  # unthrottled, the link is what the host's kernel carries between namespaces (2-20 Gbit/s)
            if not nodes.rate:  # an unthrottled run's all-to-alls, once every rank is in them, are the core's work
                own_cpu = communication_costs(trace, own=True)[1]
            rate = nodes.rate or nodes.measure()
            forecast = predicted(trace, model, rate, statistics.median(times),
                                 own_cpu if comm_cpu is None else comm_cpu)
            ratio = communication_ratio(trace, comm, rate)
        parts = {str(r): p for r, p in step_parts(trace).items()}
    return (statistics.median(times), {str(r): comm.get(r, (0.0, 0.0)) for r in range(2)}, forecast, ratio, own_cpu,
            parts)


def communication_ratio(trace, comm, rate):
    """A traced step's all-to-all time over its computation, from a run of the pairs one pass after the other
    (every all-to-all waited for), the larger rank's: (as run: the exposed time over the rest of the passes' span;
    on the wire: the bytes each rank sent in them over the link's `rate`, bits per second, over the same). The first
    also counts each rank waiting for the other to reach the all-to-all."""
    from schedules.observe.trace import communication_bytes, load_chrome_trace
    timeline, _ = load_chrome_trace(trace)
    span = statistics.median(t1 - t0 for t0, t1 in (timeline.span(i) for i in timeline.iterations()))
    sent = communication_bytes(trace)
    return (max(exposed / (span - exposed) for exposed, _ in comm.values()),
            max(sent.get(r, 0) * 8 / rate / (span - exposed) for r, (exposed, _) in comm.items()))


def auto_predicted(nodes, args, model):
    """What `--pipeline-schedule auto` predicts for DualPipe with the experts shared (overlapped, sequential) and
    duplicated, from a profile measured across the nodes as train.py's auto measures it (choose_schedule.py's
    worker: the layers, their exchanged bytes, the link): {label: seconds per step}, the best cut of each."""
    from dataclasses import replace

    from schedules.planner.choose import choose
    from schedules.planner.profile import Profile
    spec = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="overlap-profile-") as folder:
        path = os.path.join(folder, "profile.json")
        argv = ["scripts/choose_schedule.py", "--worker", "--save", path, *spec["flags"], "--micro-batch-size",
                str(spec["micro_batch_size"]), "--gradient-accumulation-steps", str(spec["micro_batches"])]
        common.launch_across(nodes, argv, args.timeout)
        profile = Profile.load(path)
    layouts = {"overlapped": ("shard", True), "sequential": ("shard", False), "duplicate": ("duplicate", True)}
    return {label: choose(replace(profile, meta=dict(profile.meta, dualpipe_experts=experts, overlap=overlap)), 2,
                          spec["micro_batches"], schedules=["dualpipe"]).pick.step
            for label, (experts, overlap) in layouts.items()}


def predicted(trace, model, rate, step, comm_cpu=None):
    """The simulator's step for DualPipe's pairs run one pass after the other and overlapped, from the trace of a
    run of them one after the other (`step` its median step; forecast.traced_forecast): the pipeline's messages
    priced by their bytes over the link's `rate` (bits per second). `comm_cpu`: the part of each pass's
    all-to-alls that keeps its core busy, which no turn hides (simulate's comm_cpu): the same run's over the
    unthrottled link, where the wire takes almost nothing (None: all of it hideable)."""
    from schedules.observe.forecast import traced_forecast
    spec = MODELS[model]
    wire = spec["micro_batch_size"] * common.sample_elements(spec["flags"]) * 4 * 8 / rate
    return {label: traced_forecast(trace, step, wire, overlap=label == "overlapped", comm_cpu=comm_cpu)
            for label in ("sequential", "overlapped")}


def parameter_bytes(model):
    """Parameter bytes per rank of DualPipe at 2 ranks (each rank holds a copy of every stage) for each layout:
    counted on the model's layers, built here without a pipeline."""
    spec = MODELS[model]
    if model != "deep":
        return None
    import deep_model
    from validation import moe_blocks
    flags = dict(zip(spec["flags"][::2], spec["flags"][1::2]))
    width, depth, experts = int(flags["--deep-width"]), int(flags["--deep-depth"]), int(flags["--moe-experts"])
    net = deep_model.DeepModel(deep_model.DeepConfig(width=width, depth=depth, moe_experts=experts,
                                                     moe_blocks=moe_blocks("all", depth)))
    expert = sum(p.numel() * p.element_size() for n, p in net.named_parameters() if "deepspeed_experts" in n)
    dense = sum(p.numel() * p.element_size() for n, p in net.named_parameters() if "deepspeed_experts" not in n)
    # rank r holds stage r of one direction and stage 1-r of the other: the whole model's dense layers, and its
    # experts whole (duplicate) or half of them (shard)
    return {"duplicate": dense + expert, "shard": dense + expert // 2, "dense": dense, "experts": expert}


def table(record):
    lines = [record["machine"], ""]
    got = "; ".join(f"{r}: {record['measured_rate'][r]}" for r in record["rates"])
    lines.append(f"What a transfer got on each link (TCP, 8 MiB, best of 3): {got}.")
    for model, per_rate in record["results"].items():
        spec = MODELS[model]
        lines += ["", f"**{model}** (DualPipe, 2 ranks, m = {spec['micro_batches']}, micro-batch "
                      f"{spec['micro_batch_size']}): median step ms / the simulator's from the sequential run's "
                      f"trace / "
                      f"auto's from its profile across the nodes; communication exposed / in flight per step, ms "
                      f"(rank 0, rank 1)", "",
                  "| link | all-to-all : computation | overlapped | sequential | speed-up | exposed overlapped | "
                  "exposed sequential | duplicate experts |", "|---|---|---|---|---|---|---|---|"]
        for rate in record["rates"]:
            c = per_rate.get(rate)
            if not c or "overlapped" not in c:
                continue
            on, off, dup = c["overlapped"], c["sequential"], c.get("duplicate")

            def comm(cell):
                return ", ".join(f"{cell['comm'][r][0] * 1e3:.0f} / {cell['comm'][r][1] * 1e3:.0f}" for r in "01")

            def step(cell):
                guess = "".join(f" / {statistics.median(cell[key]) * 1e3:.0f}" if cell.get(key) else " / -"
                                for key in ("predicted", "auto"))
                return f"{cell['step_s'] * 1e3:.0f}{guess}"
            ratio = f"{statistics.median(c['ratio']):.2f}" if c.get("ratio") else "-"
            if c.get("wire_ratio"):
                ratio += f" (wire {statistics.median(c['wire_ratio']):.2f})"
            lines.append(f"| {rate} | {ratio} | {step(on)} | {step(off)} | "
                         f"{off['step_s'] / on['step_s']:.2f}x | {comm(on)} | {comm(off)} | "
                         + (f"{step(dup)} |" if dup else "|"))
        lines += parts_table(per_rate, record["rates"])
        sizes = record["parameter_bytes"].get(model)
        if sizes:
            lines += ["", f"Parameter bytes per rank: experts shared by the copies {sizes['shard'] / 2**20:.1f} MiB, "
                          f"duplicated {sizes['duplicate'] / 2**20:.1f} MiB (dense {sizes['dense'] / 2**20:.1f}, "
                          f"experts {sizes['experts'] / 2**20:.1f})."]
    return lines


def parts_table(per_rate, rates):
    """Where the overlapped step went at each speed (step_parts, both ranks' mean, the median run's)."""
    from schedules.observe.step_parts import PARTS
    rows = []
    for rate in rates:
        runs = [r for r in per_rate.get(rate, {}).get("overlapped", {}).get("runs", []) if r.get("parts")]
        if not runs:
            continue
        run = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
        mean = {k: statistics.mean(p[k] for p in run["parts"].values()) for k in (*PARTS, "step")}
        rows.append(f"| {rate} | {mean['step'] * 1e3:.0f} | " + " | ".join(f"{mean[k] * 1e3:.0f}" for k in PARTS)
                    + " |")
    if not rows:
        return []
    return ["", "Where the overlapped step goes (schedules/observe/step_parts.py; ms a step, the ranks' mean, the "
                "median run):", "", "| link | step | " + " | ".join(PARTS) + " |",
            "|---" * (len(PARTS) + 2) + "|", *rows]


def configure(smoke, micro_batches):
    """The models as a run with these options trains them (--smoke, --micro-batches)."""
    if smoke:
        MODELS["deep"].update(micro_batch_size=16, micro_batches=4, flags=common.SMOKE_MOE["deep"])
        MODELS["gptlite"].update(micro_batch_size=2, micro_batches=4, flags=common.SMOKE_MOE["gptlite"])
    for spec in MODELS.values():
        spec["micro_batches"] = micro_batches or spec["micro_batches"]


def repredict(folder):
    """The record of a saved run (FOLDER/overlap.json) with its simulator figures recomputed from its traces
    (FOLDER/traces) by the simulator as it is now, as the run computed them: each round's steps from its sequential
    trace at each speed, the core's part of the all-to-alls from that round's unthrottled sequential run (the
    last round's before it where the round has none; none where the run had no unthrottled speed)."""
    from emulated_nodes import parse_rate
    from schedules.observe.trace import communication_costs
    with open(os.path.join(folder, "overlap.json")) as f:
        record = json.load(f)
    saved = record["args"]
    configure(saved.get("smoke"), saved.get("micro_batches"))
    for model, per_rate in record["results"].items():
        cpu = None
        for rnd in range(saved["rounds"]):
            unthrottled = os.path.join(folder, "traces", f"{model}-off-sequential-{rnd}.json")
            if os.path.exists(unthrottled):
                cpu = communication_costs(unthrottled, own=True)[1]
            for rate in record["rates"]:
                trace = os.path.join(folder, "traces", f"{model}-{rate}-sequential-{rnd}.json")
                cell = per_rate.get(rate, {})
                if not os.path.exists(trace) or len(cell.get("sequential", {}).get("runs", [])) <= rnd:
                    continue
                bits = parse_rate(rate) or parse_rate(record["measured_rate"][rate])  # off: what a transfer got
                step = cell["sequential"]["runs"][rnd]["step_s"]
                for label, figure in predicted(trace, model, bits, step, cpu).items():
                    cell[label]["predicted"][rnd] = figure
    return record


def main(argv=None):
    args = parse_args(argv)
    if args.repredict:
        record = repredict(args.repredict)
        lines = table(record)
        common.save(args, "overlap", record, lines)
        print("\n".join(lines))
        return record
    configure(args.smoke, args.micro_batches)
    machine = common.machine("benchmark_overlap", argparse.Namespace(device="cpu", stages=2))
    record = {"machine": machine + ", 2 emulated nodes (network namespaces, tc htb links), one rank each",
              "rates": args.rates, "measured_rate": {}, "results": {m: {} for m in args.models},
              "parameter_bytes": {m: parameter_bytes(m) for m in args.models}, "args": vars(args)}
    cpu = {}  # model -> the unthrottled sequential run's all-to-all time per pass, once both ranks are in it
    #           (predicted's comm_cpu)
    started = time.time()
    nodes = common.open_emulated_nodes(2)
    try:
        for rnd, rate in common.visit_rates(nodes, args.rates, args.rounds, record["measured_rate"], started):
            for model in args.models:
                for label in common.rotated(args.configs, rnd):
                    if label == args.configs[-1] and not args.no_auto:  # auto's figures for this speed, once a round
                        for other, figure in auto_predicted(nodes, args, model).items():
                            record["results"][model].setdefault(rate, {}).setdefault(other, {"runs": []}).setdefault(
                                "auto", []).append(figure)
                    name = f"{model}-{rate}-{label}-{rnd}"
                    step, comm, forecast, ratio, own_cpu, parts = run_across(
                        nodes, args, model, CONFIGS[label], label == "sequential", name, cpu.get(model))
                    if own_cpu is not None:  # the all-to-alls' own work, unthrottled: priced at every speed
                        cpu[model] = own_cpu
                    cell = record["results"][model].setdefault(rate, {}).setdefault(label, {"runs": []})
                    cell["runs"].append({"step_s": step, "comm": comm, "parts": parts})
                    if forecast:  # the simulator's figures from the sequential run's trace, beside each
                        record["results"][model][rate].setdefault("ratio", []).append(ratio[0])
                        record["results"][model][rate].setdefault("wire_ratio", []).append(ratio[1])
                        for other, figure in forecast.items():
                            record["results"][model][rate].setdefault(other, {"runs": []}).setdefault(
                                "predicted", []).append(figure)
                    cell["step_s"] = statistics.median(r["step_s"] for r in cell["runs"])
                    cell["comm"] = {r: [statistics.median(run["comm"][r][i] for run in cell["runs"])
                                        for i in range(2)] for r in "01"}
                    print(f"[{time.time() - started:.0f} s] {model} {rate} {label}: step {step * 1e3:.0f} ms, "
                          f"exposed {comm['0'][0] * 1e3:.0f} / {comm['1'][0] * 1e3:.0f} ms", flush=True)
    finally:
        nodes.close()
    common.save(args, "overlap", record, table(record))


if __name__ == "__main__":
    main()
