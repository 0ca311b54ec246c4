"""Every schedule on the Mixture-of-Experts models, measured against the simulator: the MoE GPTlite and the MoE deep
model at 2 pipeline ranks with expert-parallel size 1 (2 ranks, every expert on each stage's rank) and 2 (4 ranks:
each stage's two data-parallel replicas share its experts and exchange tokens by all-to-all), on one machine and
across two emulated nodes at two link speeds. Per configuration: the median step beside the simulator's from the
run's own trace (forecast.traced_forecast), the peak bytes saved for backward and the parameter bytes per rank.

    sudo python scripts/benchmark_moe.py [--docs]      # about an hour on 2 cores; needs root (namespaces)

Each configuration is one train.py launch, traced. On 2 cores, 2 ranks run one per core and 4 ranks two per core.
Across the nodes, expert-parallel size 1 puts one rank on each node (the pipeline's messages cross the link);
size 2 deals the ranks round (node k holds ranks k and k+2: each stage's replicas on different nodes), so the
experts' all-to-all and the replicas' gradient all-reduce cross the link and the pipeline's messages stay inside
a node. Where a schedule overlaps its forward-backward pairs with the all-to-all in flight (DualPipe, DualPipeV at
size 2), a second run with --overlap off gives the costs both are predicted from, as in benchmark_overlap.py.
Writes runs/moe/moe.json and .txt; with --docs docs/bench/moe.json and the table in docs/moe.md.
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

LOCAL = "one machine"
RATES = ["1gbit", "250mbit"]
MODELS = {  # micro-batches: the global batch's, split over the data-parallel replicas
    "gptlite": {"flags": ["--model", "gptlite", "--model-size", "small", "--moe-experts", "4", "--moe-top-k", "2",
                          "--moe-capacity-factor", "1", "--partition-method", "uniform"],
                "micro_batch_size": 4, "micro_batches": 8},
    "deep": {"flags": ["--model", "deep", "--deep-width", "1024", "--deep-depth", "8", "--moe-experts", "4",
                       "--moe-top-k", "1", "--moe-capacity-factor", "1"],
             "micro_batch_size": 64, "micro_batches": 8},
}
EXPERT_PARALLEL = [1, 2]
PAIRED = {"dualpipe", "dualpipev"}  # their pairs overlap the all-to-all in flight (with one to overlap: size 2)
WITHIN = 0.15  # the bound on |measured / predicted - 1|


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--rates", nargs="+", default=RATES, help="link speeds across the two nodes")
    p.add_argument("--no-local", action="store_true", help="skip the one-machine runs")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--expert-parallel", type=int, nargs="+", default=EXPERT_PARALLEL, choices=EXPERT_PARALLEL)
    p.add_argument("--schedules", nargs="+", default=None, help="default: every trainable schedule")
    p.add_argument("--steps", type=int, default=4, help="steps of each run: the median of those after the first 2")
    common.add(p, "out", "docs", "timeout", out="runs/moe", docs="moe", timeout=600)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny models: the plumbing
    return p.parse_args(argv)


def train_argv(args, model, ep, schedule, trace, metrics, config, overlap=None):
    spec = MODELS[model]
    return ["train.py", *spec["flags"], "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule,
            "--expert-parallel-size", str(ep), "--micro-batch-size", str(spec["micro_batch_size"]),
            "--gradient-accumulation-steps", str(spec["micro_batches"] // ep), "--deepspeed_config", config,
            "--steps", str(args.steps), "--trace", trace, "--trace-steps", str(args.steps - 2), "--trace-memory",
            "--log-interval", "1", "--eval-interval", "0", "--metrics-file", metrics,
            *(["--overlap", overlap] if overlap else [])]


def run(args, nodes, model, ep, schedule, trace, overlap=None):
    """One traced train.py launch, on this machine (`nodes` None) or across the nodes: its median step (s)."""
    spec = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="moe-") as folder:
        metrics, config = os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "ds_config.json")
        with open(config, "w") as f:
            json.dump(common.engine_config(spec["micro_batch_size"], spec["micro_batches"] // ep), f)
        argv = train_argv(args, model, ep, schedule, trace, metrics, config, overlap)
        if nodes is None:
            from local_launch import launch
            done = launch(2 * ep, argv[1:], timeout=args.timeout)
            if not done.ok:
                raise SystemExit(f"{model} {schedule} ep {ep} on one machine failed:\n{done.explain()}")
        else:
            common.launch_across(nodes, argv, args.timeout, ranks_per_node=ep, interleave=True)
        times = [e["iter_s"] for e in map(json.loads, open(metrics)) if "iter_s" in e][2:]
    return statistics.median(times)


def measure(args, nodes, setting, model, ep, schedule, rates, comm_cpu):
    """One configuration's cell: the run (and with PAIRED at size 2 its sequential twin), each beside the
    simulator's step; the memory and parameter bytes per rank from the trace. `comm_cpu`: {(model, schedule):
    the one-machine sequential run's all-to-alls} (set here on one machine), what no overlap hides."""
    from schedules.observe.forecast import traced_forecast
    from schedules.observe.trace import communication_costs, parameter_bytes, peak_saved_bytes
    folder = os.path.join(args.out, "traces")
    os.makedirs(folder, exist_ok=True)
    name = f"{model}-ep{ep}-{schedule}-{setting.replace(' ', '-')}"
    # the pipeline's messages cross the link with one rank per node; at size 2 they stay inside a node
    link = rates["off"] if nodes is None or ep > 1 else rates[setting]
    spec = MODELS[model]  # one micro-batch's activation (or its gradient) on the link
    wire = spec["micro_batch_size"] * common.sample_elements(spec["flags"]) * 4 * 8 / link
    trace = os.path.join(folder, f"{name}.json")
    paired = schedule in PAIRED and ep > 1
    cell = {"step_s": run(args, nodes, model, ep, schedule, trace)}
    if paired:  # predicted from the twin with its pairs one pass after the other
        twin = os.path.join(folder, f"{name}-sequential.json")
        cell["sequential_step_s"] = run(args, nodes, model, ep, schedule, twin, overlap="off")
        if nodes is None:
            comm_cpu[(model, schedule)] = communication_costs(twin, own=True)[1]
        cpu = comm_cpu.get((model, schedule))
        cell["predicted_s"] = traced_forecast(twin, cell["sequential_step_s"], wire, overlap=True, comm_cpu=cpu)
        cell["sequential_predicted_s"] = traced_forecast(twin, cell["sequential_step_s"], wire)
    else:
        cell["predicted_s"] = traced_forecast(trace, cell["step_s"], wire)
    cell["peak_saved_bytes"] = {str(r): b for r, b in sorted(peak_saved_bytes(trace).items())}
    cell["param_bytes"] = {str(r): b for r, b in sorted(parameter_bytes(trace).items())}
    return cell


def errors(record):
    """Every (configuration, measured / predicted) of the record: each run and each sequential twin."""
    out = []
    for model, rows in record["results"].items():
        for schedule, cells in rows.items():
            for column, c in cells.items():
                out.append((f"{model} {schedule} {column}", c["step_s"] / c["predicted_s"]))
                if "sequential_step_s" in c:
                    out.append((f"{model} {schedule} {column} sequential",
                                c["sequential_step_s"] / c["sequential_predicted_s"]))
    return out


def columns(record):
    return [f"{s} ep{ep}" for s in record["settings"] for ep in record["args"]["expert_parallel"]]


def table(record):
    lines = [record["machine"], ""]
    got = "; ".join(f"{r}: {record['measured_rate'][r]}" for r in record["measured_rate"])
    lines.append(f"What a transfer got between the nodes (TCP, 8 MiB, best of 3): {got}.")
    cols = columns(record)
    for model, rows in record["results"].items():
        spec = MODELS[model]
        lines += ["", f"**{model}** ({' '.join(spec['flags'][1::2][:1])}, micro-batch {spec['micro_batch_size']}, "
                      f"{spec['micro_batches']} micro-batches a step, split over the replicas): median step ms / the "
                      f"simulator's from the run's own trace", "",
                  "| schedule | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for schedule, cells in rows.items():
            def cell(c, seq=False):
                step, pred = (c["sequential_step_s"], c["sequential_predicted_s"]) if seq else \
                    (c["step_s"], c["predicted_s"])
                return f"{step * 1e3:.0f} / {pred * 1e3:.0f}"
            lines.append(f"| {schedule} | " + " | ".join(cell(cells[c]) if c in cells else "" for c in cols) + " |")
            if any("sequential_step_s" in c for c in cells.values()):
                lines.append(f"| {schedule} --overlap off | " + " | ".join(
                    cell(cells[c], True) if "sequential_step_s" in cells.get(c, {}) else "" for c in cols) + " |")
        lines += ["", f"**{model}**, memory per rank (the larger rank's): MiB saved for backward at the peak / MiB of "
                      "parameters", "", "| schedule | " + " | ".join(f"ep{ep}" for ep in record["args"]
                                                                       ["expert_parallel"]) + " |",
                  "|---" * (len(record["args"]["expert_parallel"]) + 1) + "|"]
        for schedule, cells in rows.items():
            out = []
            for ep in record["args"]["expert_parallel"]:
                c = next((cells[k] for k in cols if k.endswith(f"ep{ep}") and k in cells), None)
                out.append(f"{max(c['peak_saved_bytes'].values()) / 2**20:.1f} / "
                           f"{max(c['param_bytes'].values()) / 2**20:.1f}" if c and c["peak_saved_bytes"] else "")
            lines.append(f"| {schedule} | " + " | ".join(out) + " |")
    ratios = errors(record)
    if ratios:
        worst = max(ratios, key=lambda e: abs(e[1] - 1))
        inside = sum(abs(r - 1) <= WITHIN for _, r in ratios)
        lines += ["", f"Measured / predicted: {min(r for _, r in ratios):.2f}-{max(r for _, r in ratios):.2f}, "
                      f"{inside} of {len(ratios)} runs within {WITHIN:.0%}; the farthest: {worst[0]} "
                      f"({worst[1]:.2f})."]
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        MODELS["deep"].update(micro_batch_size=8, micro_batches=8, flags=common.SMOKE_MOE["deep"])
        MODELS["gptlite"].update(micro_batch_size=2, micro_batches=8, flags=common.SMOKE_MOE["gptlite"])
    from schedules.registry import trainable_schedules
    names = args.schedules or trainable_schedules()
    machine = common.machine("benchmark_moe", argparse.Namespace(device="cpu", stages=2))
    settings = ([] if args.no_local else [LOCAL]) + args.rates
    record = {"machine": machine + "; across the nodes: 2 emulated nodes (network namespaces, tc htb links)",
              "settings": settings, "measured_rate": {}, "results": {m: {} for m in args.models},
              "args": vars(args)}
    comm_cpu, rates = {}, {}
    started = time.time()
    nodes = common.open_emulated_nodes(2)
    try:
        rates["off"] = nodes.measure()  # the kernel's own rate between two sockets: the one-machine link
        from emulated_nodes import format_rate
        record["measured_rate"]["off"] = format_rate(rates["off"])
        visits = iter(common.visit_rates(nodes, args.rates, 1, record["measured_rate"], started))
        for k, setting in enumerate(settings):
            if setting != LOCAL:
                _, rate = next(visits)
                from emulated_nodes import parse_rate
                rates[setting] = min(parse_rate(rate), rates["off"])
            where = None if setting == LOCAL else nodes
            for model in args.models:
                for ep in args.expert_parallel:
                    for schedule in common.rotated(list(names), k):
                        cell = measure(args, where, setting, model, ep, schedule, rates, comm_cpu)
                        record["results"][model].setdefault(schedule, {})[f"{setting} ep{ep}"] = cell
                        print(f"[{time.time() - started:.0f} s] {setting} {model} ep{ep} {schedule}: step "
                              f"{cell['step_s'] * 1e3:.0f} ms, predicted {cell['predicted_s'] * 1e3:.0f}", flush=True)
    finally:
        nodes.close()
    lines = table(record)
    lines.append(f"took {time.time() - started:.0f} s")
    print("\n".join(lines))
    common.save(args, "moe", record, lines)
    if args.docs:
        common.write_marked("moe.md", "moe-table", lines)


if __name__ == "__main__":
    main()
