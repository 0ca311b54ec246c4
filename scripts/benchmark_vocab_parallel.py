"""GPTlite with its vocabulary head split over the pipeline ranks (`train.py --vocab-parallel`), against every
schedule with the head whole and against one process: through train.py, side by side in one run.

    python scripts/benchmark_vocab_parallel.py                  # GPTlite small, 2 ranks, 4 micro-batches of 4
    python scripts/benchmark_vocab_parallel.py --model-size gpt2 --block-size 64 --micro-batch-size 2
    python scripts/benchmark_vocab_parallel.py --docs           # also docs/bench/vocab-parallel[-SIZE].json

Each configuration is one launch of train.py with the shipped ds_config.json (AdamW): one process with one
thread (`OMP_NUM_THREADS=1`, no pipeline); every trainable schedule on p ranks, its stages balanced on the
layers' measured costs (`--partition-method profile`); and every schedule that runs a split head, with
`--vocab-parallel` (its trunk cut the same way). A round launches every configuration once, the order
rotating from round to round, so drift on this noisy machine hits all of them alike.

Per configuration: the median step time over the steps after `--warmup` and before the traced ones, its
speed-up over one process; from the last `--trace-steps` steps, traced with `--trace-memory`: each rank's
busy time (the sum of its passes) and its peak bytes saved for backward (activation memory), and the
simulator's prediction of the traced step from the pass costs the trace measured (schedules.observe.trace.
predict: mean F / B / W per rank and chunk, the time a send and a receive take on their own rank, the
engine's time between instructions), against the traced step's measured span (first pass to last).
States the machine it ran on.

`--profile FILE` (a profile saved by `scripts/choose_schedule.py --save`) predicts instead, at each of
`--stages` and `--micro-batches`: the chooser's best schedule with the head whole and with it split, and the
bound no route can beat, every rank busy with 1/p of the whole model's work (its head whole or split, whichever
costs less) and 1/p of its optimizer step (the paper's route with free collectives could at best reach it).
"""
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root: local_launch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ONE_PROCESS = "one process"


def parse_args(argv=None):
    p = common.parser(__doc__)
    common.add(p, "model-size", "block-size", "n-layer", "stages", "micro-batch-size", "micro-batches",
               block_size=dict(help="override the size's context (e.g. gpt2 at 64)"),
               stages=dict(nargs="+", default=[2]), micro_batch_size=4, micro_batches=[4])
    p.add_argument("--profile", default=None, help="predict from this saved profile instead of measuring")
    p.add_argument("--vocab-layouts", nargs="+", default=["auto"], choices=["auto", "balanced", "even"],
                   help="train.py --vocab-layout of each split configuration (auto: fitted to the schedule on the "
                        "measured profile; the others are named in the row)")
    p.add_argument("--steps", type=int, default=12, help="steps per launch")
    common.add(p, "warmup", warmup=dict(help="first steps left out of the median"))
    p.add_argument("--trace-steps", type=int, default=2, help="last steps traced (left out of the median)")
    return common.add(p, "rounds", "schedules", "out", "docs", "timeout", rounds=1, out="runs/vocab-parallel",
                      docs=dict(help="also write docs/bench/vocab-parallel[-SIZE].json"),
                      timeout=dict(help="seconds per launch")).parse_args(argv)


def configurations(args):
    """[(name, ranks, train.py flags, environment)]: one process, then each schedule whole and split."""
    from schedules.registry import schedule_spec, splitting_schedules, trainable_schedules
    p, m = args.stages[0], args.micro_batches[0]
    out = [(ONE_PROCESS, 1, ["--pipeline-parallel-size", "0"], {"OMP_NUM_THREADS": "1"})]
    split = splitting_schedules(p)
    for name in args.schedules or trainable_schedules():
        try:
            schedule_spec(name).factory(micro_batches=m, stages=p, stage_id=0)
        except ValueError as e:
            print(f"{name} skipped: {e}", flush=True)
            continue
        flags = ["--pipeline-parallel-size", str(p), "--pipeline-schedule", name, "--partition-method", "profile"]
        out.append((name, p, flags, None))
        for layout in args.vocab_layouts if name in split else ():
            out.append((f"{name} +vocab" + ("" if layout == "auto" else f" ({layout})"), p,
                        flags + ["--vocab-parallel", "--vocab-layout", layout], None))
    return out


def common_flags(args):
    flags = ["--model", "gptlite", "--model-size", args.model_size, "--micro-batch-size", str(args.micro_batch_size),
             "--gradient-accumulation-steps", str(args.micro_batches[0]), "--steps", str(args.steps),
             "--log-interval", str(args.steps), "--dist-timeout", str(args.timeout)]
    if args.block_size:
        flags += ["--block-size", str(args.block_size)]
    if args.n_layer:
        flags += ["--n-layer", str(args.n_layer)]
    return flags


_MATMUL = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
times = []
for _ in range(12):
    t = time.perf_counter(); a @ b; times.append(time.perf_counter() - t)
print(sorted(times)[6])
"""


def two_busy_ranks():
    """How fast each of two single-threaded processes computing at once runs, against one alone (a 1024 x 1024
    matmul, median of 12): what two busy pipeline ranks get from this machine's cores."""
    import subprocess

    def start():
        return subprocess.Popen([sys.executable, "-c", _MATMUL], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    alone = float(start().communicate()[0])
    pair = [start(), start()]
    together = [float(p.communicate()[0]) for p in pair]
    return {"alone_s": alone, "together_s": together, "speed_each": alone / statistics.mean(together)}


def run_once(args, name, ranks, flags, env, folder):
    """One launch: {'steps': [seconds of each untraced step after warm-up], ...trace figures}."""
    from local_launch import launch
    tag = name.replace(" ", "").replace("+", "-")
    metrics, trace = os.path.join(folder, f"{tag}.jsonl"), os.path.join(folder, f"{tag}.trace.json")
    extra = ["--metrics-file", metrics]
    if ranks > 1:
        extra += ["--trace", trace, "--trace-steps", str(args.trace_steps), "--trace-memory"]
    run = launch(ranks, [*common_flags(args), *flags, *extra], timeout=args.timeout, env=env)
    if not run.ok:
        raise SystemExit(f"{name}: train.py failed\n{run.explain()}")
    records = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    last = len(records) - (args.trace_steps if ranks > 1 else 0)
    result = {"steps": [r["iter_s"] for r in records[args.warmup:last]], "loss": records[-1]["loss"]}
    if ranks > 1:
        result.update(trace_figures(trace))
    return result


def trace_figures(path):
    """Per traced step: its span, each rank's busy seconds and the simulator's span; per rank the peak saved bytes."""
    from schedules.observe.trace import (
        load_chrome_trace,
        load_p2p_events,
        measured_overheads,
        one_iteration,
        peak_saved_bytes,
        predict,
    )
    timeline, _ = load_chrome_trace(path)
    p2p_cpu, dispatch = measured_overheads(timeline, load_p2p_events(path))
    spans, busy, predicted = [], [], []
    for i in timeline.iterations():
        step = one_iteration(timeline, i)
        t0, t1 = step.span()
        spans.append(t1 - t0)
        busy.append([step.busy(r) for r in range(len(step.ranks))])
        predicted.append(predict(step, 0.0, p2p_cpu, dispatch).makespan)
    peaks = peak_saved_bytes(path)
    return {"span_s": spans, "busy_s": busy, "predicted_span_s": predicted,
            "peak_saved_bytes": [peaks.get(r, 0) for r in range(len(timeline.ranks))]}


def summarise(runs):
    """One row per configuration from its launches (one per round)."""
    rows = {}
    for name, results in runs.items():
        steps = [s for r in results for s in r["steps"]]
        row = {"iter_s": statistics.median(steps), "rounds": len(results), "loss": results[-1]["loss"]}
        if "span_s" in results[0]:
            spans = [s for r in results for s in r["span_s"]]
            predicted = [s for r in results for s in r["predicted_span_s"]]
            busy = [b for r in results for b in r["busy_s"]]
            row.update(span_s=statistics.median(spans), predicted_span_s=statistics.median(predicted),
                       busy_s=[statistics.median(b[k] for b in busy) for k in range(len(busy[0]))],
                       peak_saved_bytes=[max(r["peak_saved_bytes"][k] for r in results)
                                         for k in range(len(results[0]["peak_saved_bytes"]))])
        rows[name] = row
    one = rows[ONE_PROCESS]["iter_s"]
    whole = [r["iter_s"] for n, r in rows.items() if n != ONE_PROCESS and "+vocab" not in n]
    for name, row in rows.items():
        row["speedup_vs_one_process"] = one / row["iter_s"]
        if whole:
            row["speedup_vs_best_whole"] = min(whole) / row["iter_s"]
    return rows


LOSS_TOLERANCE = 1e-4  # fp32: a pipeline sums its micro-batches in another order than one process, ~1e-6 apart


def loss_line(rows):
    """Every configuration's last loss against one process's, in one line: a configuration that trains differently
    (a lost or doubled gradient) ends elsewhere, and says so here instead of in a JSON nobody compares."""
    ref = rows[ONE_PROCESS]["loss"]
    off = {name: r["loss"] for name, r in rows.items() if abs(r["loss"] - ref) > LOSS_TOLERANCE}
    if not off:
        return f"every configuration ends at one process's loss ({ref:.6f}, within {LOSS_TOLERANCE:g})"
    return ("warning: " + ", ".join(f"{name} {loss:.6f}" for name, loss in off.items())
            + f" end at other losses than one process ({ref:.6f}): they train differently")


def table(rows, args, machine):
    context = f", context {args.block_size}" if args.block_size else ""
    lines = [machine, f"GPTlite {args.model_size}{context}, {args.stages[0]} ranks, {args.micro_batches[0]} "
             f"micro-batches of {args.micro_batch_size} sequences, train.py with the shipped ds_config.json; one "
             "process: one thread",
             f"{'configuration':22} {'step ms':>8} {'x 1 proc':>8} {'x best whole':>12} {'busy ms per rank':>18} "
             f"{'span ms':>8} {'pred ms':>8} {'pred/meas':>9} {'saved MiB per rank':>19}"]
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["iter_s"]):
        busy = " ".join(f"{b * 1e3:.0f}" for b in r.get("busy_s", []))
        peaks = " ".join(f"{b / 2**20:.0f}" for b in r.get("peak_saved_bytes", []))
        span = f"{r['span_s'] * 1e3:8.0f} {r['predicted_span_s'] * 1e3:8.0f} " \
               f"{r['predicted_span_s'] / r['span_s']:9.3f}" if "span_s" in r else f"{'':8} {'':8} {'':9}"
        lines.append(f"{name:22} {r['iter_s'] * 1e3:8.0f} {r['speedup_vs_one_process']:8.2f} "
                     f"{r.get('speedup_vs_best_whole', 1):12.2f} {busy:>18} {span} {peaks:>19}")
    return lines


def predictions(args):
    """{(p, m): the best whole and split candidates' predicted steps and the balanced bound} from a profile."""
    from schedules.planner.choose import choose
    from schedules.planner.compose import split_head
    from schedules.planner.profile import Profile
    profile = Profile.load(args.profile)

    def work_of(model):  # seconds of one micro-batch through the whole model
        return sum(c.F + c.BW for c in model.layers + ([model.loss] if model.loss is not None else []))
    work = work_of(profile)
    optimizer = sum(c.optimizer for c in profile.layers)
    rows = []
    for p in args.stages:
        # the split head measured as train.py builds it can be cheaper than the whole head and its loss: the bound
        # takes the cheaper of the two models
        least = min(work, work_of(split_head(profile, p, recompute=False)))  # nothing recomputed: the least work
        for m in args.micro_batches:
            try:
                fit = "auto" in getattr(args, "vocab_layouts", ["auto"])
                ranked = choose(profile, p, m, split=True, fit_layouts=fit).ranked
            except ValueError as e:
                rows.append({"stages": p, "micro_batches": m, "error": str(e)})
                continue
            whole = min((c for c in ranked if not c.vocab_parallel), key=lambda c: c.step, default=None)
            # DualPipe holds two copies of the model: the best of the schedules that hold one, beside it
            single = min((c for c in ranked if not c.vocab_parallel and c.schedule != "dualpipe"),
                         key=lambda c: c.step, default=None)
            split = min((c for c in ranked if c.vocab_parallel), key=lambda c: c.step, default=None)
            # every rank pays the engine's own step work whole (Profile.step_overhead)
            row = {"stages": p, "micro_batches": m, "bound_s": (least * m + optimizer) / p + profile.step_overhead}
            for key, c in (("whole", whole), ("whole_one_copy", single), ("split", split)):
                if c is not None:
                    row[key] = {"schedule": c.label, "cut": c.cut, "step_s": c.step, "bubble": c.bubble,
                                "peak_bytes": c.peak}
            if whole and split:
                row["split_over_whole"] = whole.step / split.step
            if single and split:
                row["split_over_one_copy"] = single.step / split.step
            rows.append(row)
    lines = [f"predicted from {args.profile} ({profile.meta.get('model')} {profile.meta.get('model_size')}, "
             f"micro-batches of {profile.meta.get('micro_batch_size')}): one micro-batch through the model "
             f"{work * 1e3:.0f} ms, the optimizer step {optimizer * 1e3:.0f} ms",
             f"{'p':>3} {'m':>3}  {'best whole':22} {'step s':>7}  {'best one-copy whole':22} {'step s':>7}  "
             f"{'best split':24} {'step s':>7} {'x whole':>7} {'x 1-copy':>8} {'bound s':>7} {'bound/split':>11}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['stages']:>3} {r['micro_batches']:>3}  {r['error']}")
            continue
        w, o, s = (r.get(k) or {} for k in ("whole", "whole_one_copy", "split"))
        nan = float("nan")
        lines.append(f"{r['stages']:>3} {r['micro_batches']:>3}  {w.get('schedule', '-'):22} "
                     f"{w.get('step_s', nan):7.2f}  {o.get('schedule', '-'):22} {o.get('step_s', nan):7.2f}  "
                     f"{s.get('schedule', '-'):24} {s.get('step_s', nan):7.2f} {r.get('split_over_whole', nan):7.2f} "
                     f"{r.get('split_over_one_copy', nan):8.2f} {r['bound_s']:7.2f} "
                     f"{r['bound_s'] / s['step_s'] if s else nan:11.2f}")
    return rows, lines


def main(argv=None):
    args = parse_args(argv)
    if args.profile:
        rows, lines = predictions(args)
        print("\n".join(lines))
        name = os.path.splitext(os.path.basename(args.profile))[0]
        common.save(args, f"vocab-parallel-predicted-{name}", {"args": vars(args), "rows": rows, "table": lines})
        return
    from schedules.observe.memory import machine_line
    machine = machine_line()
    configs = configurations(args)
    contention = two_busy_ranks()
    print(f"two busy processes each compute at {contention['speed_each']:.2f} of one alone (a 1024 x 1024 "
          "matmul, one thread each)", flush=True)
    folder = tempfile.mkdtemp(prefix="vocab-bench-")
    runs, started = {name: [] for name, *_ in configs}, time.time()
    for r in range(args.rounds):
        for name, ranks, flags, env in common.rotated(configs, r):
            t0 = time.time()
            runs[name].append(run_once(args, name, ranks, flags, env, folder))
            print(f"round {r + 1}: {name}: {statistics.median(runs[name][-1]['steps']) * 1e3:.0f} ms per step "
                  f"({time.time() - t0:.0f} s)", flush=True)
    rows = summarise(runs)
    lines = table(rows, args, machine) + [
        loss_line(rows), f"two busy processes each computed at {contention['speed_each']:.2f} of one alone",
        f"took {time.time() - started:.0f} s"]
    print("\n".join(lines))
    report = {"machine": machine, "args": vars(args), "rows": rows, "runs": runs, "two_busy_ranks": contention}
    name = "vocab-parallel" + ("" if args.model_size == "small" and not args.block_size else
                               f"-{args.model_size}" + (f"-ctx{args.block_size}" if args.block_size else ""))
    common.save(args, "vocab-parallel", report, publish=name, published={**report, "table": lines})


if __name__ == "__main__":
    main()
