"""Every pipeline schedule on the same model, data and ranks: throughput, bubble and activation memory,
measured side by side and held against the simulator's prediction from the costs measured in the run.

    python scripts/benchmark_schedules.py                      # 2 ranks, 4 and 8 micro-batches
    python scripts/benchmark_schedules.py --what memory        # peak activation bytes per schedule

Throughput: for each micro-batch count, ONE launch of 2 ranks (one thread each: 4 ranks on 2
cores would measure the OS scheduler) builds an engine per schedule, each with its own copy of the
model, and runs them in rounds (the order rotating every round), so drift on this noisy machine
hits all schedules alike. Per schedule: median step time, samples/s, the ratio to stock 1F1B; from
a traced step per round, the measured bubble fraction per rank; and the simulator's synchronised
prediction of the same figures, step by traced step, from the F, B, W, BW times measured in that
step, the p2p latency measured by ping-pong, the time a send and a receive take on their own rank
measured in the traces (trace.measured_p2p_cpu), and the engine's own time between instructions
per pass (trace.measured_dispatch). Memory: one launch per schedule, peak bytes
saved for backward (deferred W work included) and peak RSS per rank, beside the simulator's
activation units and its peak from the per-pass bytes measured in the run.
Writes JSON, text and a plot under --out; states the machine it ran on.

`--device cuda`: one GPU per rank over NCCL; passes are timed after a device synchronize (so a
pass ends when its kernels do), and the memory figures add torch.cuda.max_memory_allocated: per
step above what is resident (throughput), and per rank for the whole step (memory).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--what", choices=["throughput", "memory", "both"], default="throughput")
    common.add(p, "stages", "micro-batches", "schedules", "model", "model-size", "partition-weights", "deep-width",
               "deep-depth", "micro-batch-size", "rounds", "steps-per-round", "out", "docs", "timeout", "device",
               out="runs/schedules", timeout=900,
               schedules=dict(help="default: every trainable schedule; NAME:V@CUT for v chunks per rank and a "
                                   "partition method"),
               model=dict(help="gptlite: its stages balanced by measured per-layer cost"),
               docs="{deep,gptlite}",
               device=dict(help="cuda: one GPU per rank, nccl, passes timed after a device synchronize, CUDA peak "
                                "memory"))
    p.add_argument("--worker", choices=["throughput", "memory"], default=None, help=argparse.SUPPRESS)
    return common.add(p, "worker-out").parse_args(argv)


# --------------------------------------------------------------------------------------------
# Worker: one rank
# --------------------------------------------------------------------------------------------
def candidate(key):
    """'NAME[:V][@CUT]' -> (schedule, chunks per rank or None, partition method or None): a schedule as the
    chooser names its candidates (scripts/benchmark_chooser.py); a plain name is the schedule as registered,
    on the model's usual cut (the deep model: uniform; GPTlite: balanced on measured layer costs)."""
    name, _, cut = key.partition("@")
    name, _, v = name.partition(":")
    return name, int(v) if v else None, cut or None


def schedule_names(wanted, m, stages):
    """The schedules of `wanted` (default: every trainable one) that run at m micro-batches on `stages` ranks,
    1F1B first (the reference), and (name, why) of those that do not."""
    from schedules.registry import available_schedules
    names, skipped = [], []
    for name in wanted or [n for n, s in available_schedules().items() if s.trains]:
        try:
            spec_of(name).factory(micro_batches=m, stages=stages, stage_id=0)
            names.append(name)
        except ValueError as e:
            skipped.append((name, e))
    return sorted(names, key=lambda n: n != "1f1b"), skipped


def spec_of(key):
    from schedules.registry import schedule_spec
    name, v, _ = candidate(key)
    return schedule_spec(name, v)


def build_engine(key, args, m):
    import deep_model
    import gptlite
    import schedules
    name, v, cut = candidate(key)
    pipe = dict(pipeline_num_stages=args.stages, pipeline_spec_layers=True,
                pipe_module=schedules.pipe_module(name, v))
    if args.model == "gptlite":
        weights = args.partition_weights if cut in (None, "profile") else None
        model = gptlite.get_model(model_size=args.model_size, partition_weights=weights,
                                  partition_method=cut if cut not in (None, "profile") else "parameters", **pipe)
    else:
        weights = args.partition_weights if cut == "profile" else None
        model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, partition_weights=weights,
                                     partition_method=cut if cut not in (None, "profile") else "uniform", **pipe)
    engine, *_ = schedules.initialize(name, virtual_stages=v, model=model, model_parameters=list(model.parameters()),
                                      config=common.engine_config(args.micro_batch_size, m), trace=True)
    return engine


def model_width(args):
    from gptlite import MODEL_SIZES
    return MODEL_SIZES[args.model_size].n_embd


def gptlite_layer_costs(args, repeats=5):
    """Seconds of forward + backward of each GPTlite layer on one micro-batch (one thread, or one
    GPU): the weights that balance the stages (the 50257-token head would otherwise make one
    stage dominate)."""
    import torch

    import gptlite
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = gptlite.MODEL_SIZES[args.model_size]
    layers = [layer.to(device) for layer in gptlite.GPTlite(config).to_layers()]
    x = torch.randint(0, config.vocab_size, (args.micro_batch_size, config.block_size), device=device)
    labels = torch.randint(0, config.vocab_size, x.shape, device=device)
    loss_fn = gptlite.head_loss(config.head)
    costs = []
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x if not x.is_floating_point() else x.detach().requires_grad_()
            sync()
            t0 = time.perf_counter()
            out = layer(inp)
            if isinstance(out, tuple):  # the chunked head: its projection runs in the loss, timed with it
                loss_fn(out, labels).backward()
            else:
                out.backward(torch.ones_like(out))
            sync()
            times.append(time.perf_counter() - t0)
        costs.append(sorted(times)[len(times) // 2])
        x = out.detach() if torch.is_tensor(out) else None  # the head is last
    return costs


def synthetic_batches(args, m, device=None):
    """m micro-batches of the benchmarked model, the same on every rank and run (the schedules, not the data, are
    measured): GPTlite's random tokens, or the deep model's synthetic_micro_batch; moved to `device` if given."""
    import torch
    if args.model == "gptlite":
        from gptlite import MODEL_SIZES
        g = torch.Generator().manual_seed(0)
        shape = (args.micro_batch_size, MODEL_SIZES[args.model_size].block_size)
        batches = [(torch.randint(0, 50257, shape, generator=g), torch.randint(0, 50257, shape, generator=g))
                   for _ in range(m)]
    else:
        from deep_model import synthetic_micro_batch
        batches = [synthetic_micro_batch(i, args.micro_batch_size, args.deep_width, 0) for i in range(m)]
    return batches if device is None else [(x.to(device), y.to(device)) for x, y in batches]


def worker(args):
    import torch
    import torch.distributed as dist

    from schedules.observe.memory import SavedTensorTracker, peak_rss_bytes, reset_peak_rss
    from schedules.observe.trace import Tracer, engine_placement

    cuda = args.device == "cuda"
    rank, device, sync = common.init_rank(args.device)
    m = args.micro_batches[0]
    batches = synthetic_batches(args, m)  # on the CPU: the engine moves them
    result = {"rank": rank, "schedules": {}}
    names = args.schedules
    engines = {name: build_engine(name, args, m) for name in names}
    for engine in engines.values():
        engine.tracer = Tracer(engine.stage_id, engine_placement(engine),
                               sync=torch.cuda.synchronize if cuda else None)
    if args.worker == "memory":
        for name, engine in engines.items():
            engine.train_batch(iter(batches))  # warm-up: buffers, shapes
            reset_peak_rss()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with SavedTensorTracker(ignore=list(engine.module.parameters())) as tracker:
                engine.tracer.memory, engine.tracer.origin = tracker, time.perf_counter()
                engine.tracer.start_iteration(0)  # each pass's change of the saved bytes: the simulator's table
                engine.train_batch(iter(batches))
                engine.tracer.stop()
            result["schedules"][name] = {"peak_saved_bytes": tracker.peak_bytes, "peak_rss_bytes": peak_rss_bytes(),
                                         "param_bytes": sum(p.numel() * p.element_size()
                                                            for p in engine.module.parameters()),
                                         "memory_deltas": engine.tracer.memory_deltas}
            if cuda:  # everything the step held on the device: parameters, gradients, optimizer state too
                result["schedules"][name]["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    else:
        activation = args.micro_batch_size * args.deep_width if args.model == "deep" else \
            batches[0][0].numel() * model_width(args)  # elements of what one stage sends
        result["latency_s"] = common.ping_pong_latency(rank, activation * 4, device, sync)
        result["small_latency_s"] = common.ping_pong_latency(rank, 4, device, sync)  # the link's own, wire time aside
        steps = {name: [] for name in names}
        cuda_peak = {name: 0 for name in names}  # device bytes a step adds above what is resident
        dist.barrier()
        origin = time.perf_counter()
        for name in names:
            engines[name].tracer.origin = origin
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in common.rotated(names, r):
                engine = engines[name]
                for s in range(args.steps_per_round):
                    traced = r > 0 and s == args.steps_per_round - 1
                    if traced:
                        engine.tracer.start_iteration(r - 1)
                    dist.barrier()
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                        resident = torch.cuda.memory_allocated()
                    sync()
                    t0 = time.perf_counter()
                    engine.train_batch(iter(batches))
                    sync()
                    dt = time.perf_counter() - t0
                    if cuda:
                        cuda_peak[name] = max(cuda_peak[name], torch.cuda.max_memory_allocated() - resident)
                    engine.tracer.stop()
                    if r > 0:
                        steps[name].append((dt, traced))
        for name in names:
            t = engines[name].tracer
            result["schedules"][name] = {"steps": steps[name], "passes": [p.__dict__ for p in t.passes],
                                         "p2p": t.p2p}
            if cuda:
                result["schedules"][name]["step_cuda_bytes"] = cuda_peak[name]
    common.finish_rank(args, rank, result)


# --------------------------------------------------------------------------------------------
# Parent: launch, collect, compare with the simulator
# --------------------------------------------------------------------------------------------
def launch_worker(args, what, m, names):
    """Every rank's record of one launch measuring `what` on m micro-batches for the schedules `names`."""
    return common.launch_ranks("benchmark_schedules.py", args.stages, args, worker=what, micro_batches=[m],
                               schedules=names)


def analyse_throughput(ranks, args, m):
    from schedules.observe.plot import plot_measured_vs_predicted
    from schedules.observe.trace import (
        held_messages,
        measured_costs,
        measured_dispatch,
        one_iteration,
        p2p_cpu_samples,
        stream_messages,
    )
    from schedules.simulator.simulate import simulate
    from schedules.simulator.timeline import Pass, Timeline
    latency = statistics.median(r["latency_s"] for r in ranks[:2])  # ranks 0 and 1 ping-pong, the others idle
    # a message holds its link for its wire time (the one-way time less a small message's), and its send returns
    # once the sockets took it (the messages here fit their buffers): simulate's `wire` and `send_wait`
    small = statistics.median(r.get("small_latency_s", latency) for r in ranks[:2])
    links = {"wire": max(latency - small, 0.0), "send_wait": small}
    traces = {name: [r["schedules"][name]["p2p"] for r in ranks] for name in ranks[0]["schedules"]}
    streams = {name: stream_messages(spec_of(name).factory, args.stages, m, spec_of(name).placement)
               for name in traces}  # who sends whom what, to pair the traced records
    # a send's and a receive's own time: the medians over every schedule with asynchronous sends (some receive
    # nothing that arrived before they asked for it: 1F1B's lean engine over a slow link). A receive whose data had
    # surely arrived began two latencies after its send ended: a message may queue behind one other on its link
    # (two emulated nodes at 50 Mbit/s: receives begun 1-2 latencies after took 5-7 ms at the median, those
    # begun later 0.2, as at 200 Mbit/s)
    sends, receives = [], []
    for name, t in traces.items():
        if spec_of(name).placement.async_sends:
            s, r = p2p_cpu_samples(t, streams[name], 2 * latency)
            sends += s
            receives += r
    p2p_cpu = tuple(statistics.median(v) if v else 0.0 for v in (sends, receives))
    rows = {}
    for name in ranks[0]["schedules"]:
        untimed = [dt for dt, traced in ranks[0]["schedules"][name]["steps"] if not traced]
        it = statistics.median(untimed)
        timeline = Timeline([[Pass(**p) for p in r["schedules"][name]["passes"]] for r in ranks], "s",
                            {"schedule": name, "stages": args.stages, "micro_batches": m})
        dispatch = measured_dispatch(timeline, traces[name])
        spans, predicted, bubbles, predicted_bubbles = [], [], [[] for _ in ranks], [[] for _ in ranks]
        for i in timeline.iterations():  # each traced step against its prediction from its own costs
            step = one_iteration(timeline, i)
            spec = spec_of(name)
            pred = simulate(spec.factory, args.stages, m, placement=spec.placement, costs=measured_costs(step),
                            latency=latency, p2p_cpu=p2p_cpu, dispatch=dispatch, iterations=1, **links)
            t0, t1 = timeline.span(i)
            spans.append(t1 - t0)
            predicted.append(pred.makespan)
            for r in range(len(ranks)):
                bubbles[r].append(1 - timeline.busy(r, i) / (t1 - t0))
                predicted_bubbles[r].append(pred.per_rank[r]["idle_synced"] / pred.makespan)
        plot_measured_vs_predicted(step, pred, os.path.join(args.out, f"{name}-m{m}.png"),
                                   title=f"{name}, {args.stages} ranks, {m} micro-batches, ")
        span, predicted_span = statistics.median(spans), statistics.median(predicted)
        p2p = [statistics.median(sum(e - s for _, s, e, it in r["schedules"][name]["p2p"] if it == i)
                                 for i in timeline.iterations()) for r in ranks]
        overhead = it - span  # optimizer step, loss broadcast, Python around the schedule
        tokens = 1 if args.model == "deep" else __import__("gptlite").MODEL_SIZES[args.model_size].block_size
        rows[name] = {"iter_s": it, "samples_per_s": args.micro_batch_size * m / it,
                      "tokens_per_s": args.micro_batch_size * m * tokens / it, "span_s": span,
                      "bubble": [statistics.median(b) for b in bubbles], "predicted_span_s": predicted_span,
                      "p2p_s": p2p, "dispatch_s": [dispatch[r] for r in range(len(ranks))],
                      "predicted_iter_s": predicted_span + overhead,
                      "predicted_bubble": [statistics.median(b) for b in predicted_bubbles]}
        # the traced steps' messages held beyond their own crossing and one queued ahead (+10 ms), and the seconds
        # their receivers waited past that: what the simulator does not model (trace.held_messages)
        held = held_messages(traces[name], streams[name], 2 * latency + 0.01)
        rows[name]["held_messages"] = len(held)
        rows[name]["held_s"] = sum(t for _, _, t in held)
        if "step_cuda_bytes" in ranks[0]["schedules"][name]:  # the step's peak above the resident memory
            rows[name]["step_cuda_bytes"] = [r["schedules"][name]["step_cuda_bytes"] for r in ranks]
    base = rows.get("1f1b")
    for row in rows.values():
        if base:
            row["speedup"] = base["iter_s"] / row["iter_s"]
            row["predicted_speedup"] = base["predicted_iter_s"] / row["predicted_iter_s"]
    return {"latency_s": latency, "p2p_cpu_s": p2p_cpu, "schedules": rows}


def analyse_memory(ranks, args, m):
    """Per schedule and rank: measured peak saved bytes beside two simulator figures: its
    activation units (chunk sizes, B frees half) and its peak in bytes when each pass's change of
    the saved bytes is the one measured in the run (`measured_memory`), which checks that the
    schedule holds the micro-batches the simulator says it holds, whatever one of them weighs."""
    from schedules.observe.trace import measured_memory
    from schedules.simulator.simulate import simulate
    rows = {}
    for name in ranks[0]["schedules"]:
        spec = spec_of(name)

        def run(**kw):
            return simulate(spec.factory, args.stages, m, placement=spec.placement, iterations=1, **kw)
        units = [row["peak_activation_memory"] for row in run().per_rank]
        table = measured_memory([r["schedules"][name]["memory_deltas"] for r in ranks])
        predicted = [row["peak_activation_memory"] for row in run(memory=table).per_rank]
        saved = [r["schedules"][name]["peak_saved_bytes"] for r in ranks]
        rows[name] = {"peak_saved_bytes": saved,
                      "peak_rss_bytes": [r["schedules"][name]["peak_rss_bytes"] for r in ranks],
                      "param_bytes": [r["schedules"][name]["param_bytes"] for r in ranks], "units": units,
                      "bytes_per_unit": [s / u for s, u in zip(saved, units)], "predicted_bytes": predicted,
                      "measured_over_predicted": [s / q for s, q in zip(saved, predicted)],
                      "pass_bytes": {f"{r},{c}": kinds for (r, c), kinds in table.items()}}
        if "peak_cuda_bytes" in ranks[0]["schedules"][name]:
            rows[name]["peak_cuda_bytes"] = [r["schedules"][name]["peak_cuda_bytes"] for r in ranks]
    return rows


def table_throughput(res, m):
    lines = [f"m = {m}, p2p latency {res['latency_s'] * 1e6:.0f} us (ping-pong); a send / a receive takes "
             f"{res['p2p_cpu_s'][0] * 1e6:.0f} / {res['p2p_cpu_s'][1] * 1e6:.0f} us on its rank (traced)",
             f"{'schedule':20} {'step ms':>8} {'samples/s':>9} {'tokens/s':>9} {'x 1F1B':>7} {'pred x':>7} "
             f"{'span ms':>8} {'pred ms':>8}  bubble per rank: measured / predicted; p2p ms per rank"]
    for name, r in res["schedules"].items():
        bub = "  ".join(f"{b:5.1%}/{q:5.1%}" for b, q in zip(r["bubble"], r["predicted_bubble"]))
        lines.append(f"{name:20} {r['iter_s'] * 1e3:8.1f} {r['samples_per_s']:9.0f} {r['tokens_per_s']:9.0f} "
                     f"{r.get('speedup', 1):7.2f} "
                     f"{r.get('predicted_speedup', 1):7.2f} {r['span_s'] * 1e3:8.1f} "
                     f"{r['predicted_span_s'] * 1e3:8.1f}"
                     f"  {bub}; " + " ".join(f"{t * 1e3:.1f}" for t in r["p2p_s"])
                     + ("; step's CUDA peak MiB " + " ".join(f"{b / 2**20:.0f}" for b in r["step_cuda_bytes"])
                        if "step_cuda_bytes" in r else ""))
    return lines


def table_memory(rows, m):
    lines = [f"m = {m}: peak activation bytes per rank (MiB); simulator units and MiB per unit; the simulator's "
             f"peak from the per-pass bytes of the run (MiB) and measured / that; peak RSS (MiB); parameters (MiB)",
             f"{'schedule':20} {'saved MiB':>12} {'units':>10} {'MiB/unit':>11} {'pred MiB':>12} "
             f"{'meas/pred':>11} {'peak RSS':>11} {'params':>11}"]
    for name, r in rows.items():
        fmt = lambda xs, f: " ".join(f(x) for x in xs)  # noqa: E731
        mib = lambda x: f"{x / 2**20:5.1f}"  # noqa: E731
        lines.append(f"{name:20} {fmt(r['peak_saved_bytes'], mib):>12} {fmt(r['units'], lambda x: f'{x:4.1f}'):>10} "
                     f"{fmt(r['bytes_per_unit'], lambda x: f'{x / 2**20:5.2f}'):>11} "
                     f"{fmt(r['predicted_bytes'], mib):>12} "
                     f"{fmt(r['measured_over_predicted'], lambda x: f'{x:5.2f}'):>11} "
                     f"{fmt(r['peak_rss_bytes'], lambda x: f'{x / 2**20:5.0f}'):>11} "
                     f"{fmt(r['param_bytes'], mib):>11}"
                     + (f"  CUDA peak MiB {fmt(r['peak_cuda_bytes'], lambda x: f'{x / 2**20:.0f}')}"
                        if "peak_cuda_bytes" in r else ""))
    return lines


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (m, res) in zip(axes[0], results.items()):
        names = list(res["schedules"])
        measured = [res["schedules"][n].get("speedup", 1) for n in names]
        predicted = [res["schedules"][n].get("predicted_speedup", 1) for n in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], predicted, 0.4, label="predicted")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), names, rotation=40, ha="right")
        ax.set_title(f"speed-up over stock 1F1B, {m} micro-batches")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        args.micro_batches = args.micro_batches[:1]
        return worker(args)
    machine = common.machine("benchmark_schedules", args)
    os.makedirs(args.out, exist_ok=True)  # the plots of each launch
    started = time.time()
    report, lines = {"machine": machine, "args": vars(args)}, [machine]
    if args.model == "gptlite" and not args.partition_weights:
        args.partition_weights = gptlite_layer_costs(args)
        lines.append("GPTlite " + args.model_size + ", stages balanced by measured layer cost (ms): " +
                     " ".join(f"{c * 1e3:.1f}" for c in args.partition_weights))
    for m in args.micro_batches:
        names, skipped = schedule_names(args.schedules, m, args.stages)
        lines += [f"m = {m}: {name} skipped: {why}" for name, why in skipped]
        if args.what in ("throughput", "both"):
            res = analyse_throughput(launch_worker(args, "throughput", m, names), args, m)
            report.setdefault("throughput", {})[m] = res
            lines += table_throughput(res, m)
        if args.what in ("memory", "both"):  # one launch per schedule: peak RSS is per process
            per_schedule = [launch_worker(args, "memory", m, [name]) for name in names]
            ranks = [{"schedules": {k: v for run in per_schedule for k, v in run[r]["schedules"].items()}}
                     for r in range(args.stages)]
            rows = analyse_memory(ranks, args, m)
            report.setdefault("memory", {})[m] = rows
            lines += table_memory(rows, m)
    lines.append(f"took {time.time() - started:.0f} s")
    print("\n".join(lines))
    if "throughput" in report:
        plot(report["throughput"], os.path.join(args.out, "throughput.png"))
    common.save(args, args.what, report, lines, publish=args.model)


if __name__ == "__main__":
    main()
