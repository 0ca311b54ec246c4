"""Does `--pipeline-schedule auto` pick the fastest schedule? Profile and choose, then measure every schedule
side by side (scripts/benchmark_schedules.py) and compare: the regret of the pick (its measured step time
over the best measured one) and the rank correlation between the predicted and the measured order, per model
and micro-batch count; a memory budget below the unconstrained pick's predicted peak, and one below 1F1B's,
with the pick's measured peak activation memory; and what profiling and choosing add to a 100-step run.

    python scripts/benchmark_chooser.py [--docs]        # about 20 minutes on 2 cores
    python scripts/benchmark_chooser.py --budgets-only --memory-stages 4 --memory-micro-batches 8 --docs

The second measures only the memory budgets, at p = 4 (4 ranks: V-Half and V-Min need more than 2 to hold
fewer micro-batches than 1F1B), and with --docs merges its rows into docs/bench/chooser.json, keeping the rest.

Every measurement holds /tmp/bench.lock (the lock `flock /tmp/bench.lock CMD` takes), so benchmarks of
others on this machine do not run at the same time. Writes runs/chooser/chooser.json; with --docs,
docs/bench/chooser.json and docs/benchmarks.md.
"""
import argparse
import contextlib
import fcntl
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

LOCK = "/tmp/bench.lock"
MODELS = {  # the models of docs/benchmarks.md, sized as there
    "deep": {"flags": ["--model", "deep", "--deep-width", "1024", "--deep-depth", "16"], "micro_batch_size": 32,
             "usual_cut": "uniform", "rounds": 4, "steps_per_round": 3},
    "gptlite": {"flags": ["--model", "gptlite", "--model-size", "small"], "micro_batch_size": 4,
                "usual_cut": "profile", "rounds": 3, "steps_per_round": 2},
}


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["deep", "gptlite"], choices=list(MODELS))
    p.add_argument("--deep-micro-batches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--gptlite-micro-batches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--memory-micro-batches", type=int, nargs="+", default=[4], help="m of the budget checks")
    p.add_argument("--memory-stages", type=int, nargs="+", default=[2], help="p of the budget checks (ranks)")
    p.add_argument("--budgets-only", action="store_true",
                   help="profile and check the budgets only (no side-by-side, no demo); --docs merges the rows")
    p.add_argument("--demo-steps", type=int, default=100, help="steps of the demo run (0: skip it)")
    common.add(p, "out", "docs", "timeout", out="runs/chooser", docs="chooser", timeout=1500)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny models, one round: the plumbing
    args = p.parse_args(argv)
    if args.smoke:
        MODELS["deep"].update(flags=["--model", "deep", "--deep-width", "64", "--deep-depth", "8"], micro_batch_size=4)
        MODELS["gptlite"].update(flags=["--model", "gptlite", "--model-size", "tiny"], micro_batch_size=2)
        for spec in MODELS.values():
            spec.update(rounds=1, steps_per_round=2)
    return args


@contextlib.contextmanager
def bench_lock():
    """/tmp/bench.lock held, as `flock /tmp/bench.lock CMD` holds it."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def spearman(xs, ys):
    """Rank correlation of two equally long lists (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    a, b = ranks(xs), ranks(ys)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else 1.0


def key_of(candidate, usual_cut):
    """The benchmark's name for a candidate: NAME[:V][@CUT], the plain name on the usual v and cut."""
    from schedules.definitions.interleaved import DEFAULT_VIRTUAL_STAGES
    key = candidate.schedule
    if candidate.virtual_stages and candidate.virtual_stages != DEFAULT_VIRTUAL_STAGES:
        key += f":{candidate.virtual_stages}"
    if usual_cut not in candidate.cut.split("="):
        key += f"@{candidate.method}"
    return key


def config_file(folder, mbs, m):
    """The benchmark engines' config (torch's fused AdamW), for the profile to time the same optimizer."""
    path = os.path.join(folder, f"ds-{mbs}-{m}.json")
    with open(path, "w") as f:
        json.dump(common.engine_config(mbs, m), f)
    return path


def profile_model(name, folder, timeout):
    import choose_schedule
    spec = MODELS[name]
    rest = spec["flags"] + ["--micro-batch-size", str(spec["micro_batch_size"]), "--deepspeed_config",
                            config_file(folder, spec["micro_batch_size"], 4)]
    opts, _ = choose_schedule.parse_args(["--save", os.path.join(folder, f"{name}-profile.json"),
                                          "--timeout", str(timeout)])
    with bench_lock():
        return choose_schedule.measure(opts, rest)


def measure_schedules(name, m, keys, weights, folder, what, timeout, stages=2):
    import benchmark_schedules as bench
    spec = MODELS[name]
    flags = ["--what", what, "--stages", str(stages), "--micro-batches", str(m), "--schedules", *keys,
             "--micro-batch-size", str(spec["micro_batch_size"]), "--rounds", str(spec["rounds"]),
             "--steps-per-round", str(spec["steps_per_round"]),
             "--out", os.path.join(folder, f"{name}-p{stages}-m{m}"),
             "--timeout", str(timeout), "--partition-weights", *map(str, weights)]
    flags += spec["flags"]
    args = bench.parse_args(flags)
    os.makedirs(args.out, exist_ok=True)
    with bench_lock():
        ranks = bench.launch_worker(args, what, m, keys)
    return bench.analyse_throughput(ranks, args, m) if what == "throughput" else bench.analyse_memory(ranks, args, m)


def compare(name, m, profile, folder, timeout):
    """Choose at (2, m), measure every schedule and the pick: regret and rank correlation."""
    from schedules.planner.choose import choose, table
    from schedules.planner.compose import layer_weights
    usual = MODELS[name]["usual_cut"]
    choice = choose(profile, 2, m)
    predicted = {}
    for c in choice.ranked:  # the best predicted of each key (a key may name several equal cuts)
        predicted.setdefault(key_of(c, usual), c)
    usual_keys = [k for k in predicted if "@" not in k and ":" not in k]
    pick = key_of(choice.pick, usual)
    keys = sorted(set(usual_keys) | {pick}, key=lambda k: (k != "1f1b", k))
    res = measure_schedules(name, m, keys, layer_weights(profile, "profile"), folder, "throughput", timeout)
    measured = {k: r["iter_s"] for k, r in res["schedules"].items()}
    best = min(measured, key=measured.get)
    order = list(measured)
    return {"micro_batches": m, "pick": pick, "best": best, "regret": measured[pick] / measured[best] - 1,
            "spearman": spearman([predicted[k].step for k in order], [measured[k] for k in order]),
            "predicted_s": {k: predicted[k].step for k in order}, "measured_s": measured,
            "predicted_span_s": {k: predicted[k].span for k in order},
            "measured_span_s": {k: r["span_s"] for k, r in res["schedules"].items()},
            "table": table(choice, 12)}


def pass_bytes(name, profile, key, stages):
    """Bytes saved for backward after each pass (F, B, W; the change a pass makes) of rank 0's chunks and the last
    rank's, composed from the profile on the candidate's cut: why a schedule's peak is what it is."""
    import benchmark_schedules as bench

    from schedules.planner.compose import compose, cut
    from schedules.registry import schedule_spec
    schedule, v, method = bench.candidate(key)
    placement = schedule_spec(schedule, v).placement(stages)
    parts = cut(profile, method or MODELS[name]["usual_cut"], placement.num_stages)
    memory = compose(profile, placement, parts)["memory"]
    return {f"{r},{c}": {"layers": parts[placement.stage(r, c):placement.stage(r, c) + 2],
                         **{k: memory[(r, c)][k] for k in ("F", "B", "W")}}
            for (r, c) in sorted(memory) if r in (0, stages - 1)}


def budgets(name, m, profile, folder, timeout, stages=2):
    """Budgets at (stages, m): 95% of the unconstrained pick's predicted peak, 90% of 1F1B's, and (where a
    schedule fits below 1F1B) 90% of the least peak any candidate needs; the pick under each (or the chooser's
    refusal). One launch then measures the peak activation memory of every pick, of 1F1B and of V-Half and
    V-Min (the schedules made to hold less), in one `train_batch` each under the saved-tensor tracker.
    Returns (rows, {key: predicted and measured peaks per rank, per-pass bytes})."""
    from schedules.planner.choose import MiB, NoScheduleFits, choose
    from schedules.planner.compose import layer_weights
    usual = MODELS[name]["usual_cut"]
    free = choose(profile, stages, m)
    predicted = {}
    for c in free.ranked:  # each key's best predicted candidate
        predicted.setdefault(key_of(c, usual), c)
    one_f_one_b = next(c for c in free.ranked if c.schedule == "1f1b" and usual in c.cut.split("="))
    least = min(free.ranked, key=lambda c: (max(c.peak), c.step))
    asks = [("95% of the unconstrained pick's predicted peak", 0.95 * max(free.pick.peak) / MiB),
            ("90% of 1F1B's predicted peak", 0.9 * max(one_f_one_b.peak) / MiB)]
    if max(least.peak) < 0.9 * max(one_f_one_b.peak):  # something fits below 1F1B: then a budget below everything
        asks.append(("90% of the least predicted peak of any candidate", 0.9 * max(least.peak) / MiB))
    rows, picks = [], {}
    for label, budget in asks:
        row = {"stages": stages, "micro_batches": m, "budget": label, "budget_mib": budget,
               "one_f_one_b_predicted_peak_mib": [b / MiB for b in one_f_one_b.peak]}
        try:
            choice = choose(profile, stages, m, max_activation_memory=budget)
        except NoScheduleFits as e:
            rows.append({**row, "refusal": str(e)})
            continue
        key = key_of(choice.pick, usual)
        picks[key] = choice.pick
        rows.append({**row, "pick": key, "predicted_peak_mib": [b / MiB for b in choice.pick.peak],
                     "dropped": len(choice.dropped)})
    keys = list(picks) + [k for k in ("1f1b", "v-half", "v-min") if k in predicted and k not in picks]
    measured = measure_schedules(name, m, keys, layer_weights(profile, "profile"), folder, "memory", timeout,
                                 stages)
    for row in rows:
        if "pick" in row:
            row["measured_peak_mib"] = [b / MiB for b in measured[row["pick"]]["peak_saved_bytes"]]
        row["one_f_one_b_measured_peak_mib"] = [b / MiB for b in measured["1f1b"]["peak_saved_bytes"]]
    schedules = {k: {"predicted_peak_mib": [b / MiB for b in (picks.get(k) or predicted[k]).peak],
                     "measured_peak_mib": [b / MiB for b in measured[k]["peak_saved_bytes"]],
                     "units": measured[k]["units"], "pass_bytes": pass_bytes(name, profile, k, stages)} for k in keys}
    return rows, {"stages": stages, "micro_batches": m, "schedules": schedules}


def merge_budgets(report, path):
    """The published record with this run's budget rows in place of those of the same (p, m); the rest kept."""
    with open(path) as f:
        doc = json.load(f)
    for name, entry in report["models"].items():
        old = doc["models"].setdefault(name, {"configs": [], "budgets": []})
        done = {(b["stages"], b["micro_batches"]) for b in entry["budgets"]}
        old["budgets"] = [b for b in old["budgets"] if (b.get("stages", 2), b["micro_batches"]) not in done] + \
            entry["budgets"]
        old["budget_memory"] = [x for x in old.get("budget_memory", [])
                                if (x["stages"], x["micro_batches"]) not in done] + entry["budget_memory"]
        old["budget_profile"] = {k: entry[k] for k in ("profile_launch_s", "profile_s", "layers", "profile")}
    doc["budgets_run"] = {"machine": report["machine"], "args": report["args"], "took_s": report["took_s"]}
    return doc


def demo_overhead(steps, timeout):
    """The README's demo (GPTlite small, 2 stages) for `steps` steps with auto: the launch's wall time and the
    seconds train.py reports for profiling and choosing."""
    from local_launch import launch
    flags = ["--pipeline-parallel-size", "2", "--model-size", "small", "--steps", str(steps), "--pipeline-schedule",
             "auto", "--log-interval", str(steps)]
    with bench_lock():
        started = time.perf_counter()
        run = launch(2, flags, timeout=timeout)
        wall = time.perf_counter() - started
    if not run.ok:
        raise SystemExit(f"demo run failed:\n{run.explain()}")
    line = next(line for line in run.stdout[0].splitlines() if line.startswith("auto: chose "))
    took = float(re.search(r"profiling and choosing took ([0-9.]+) s", line).group(1))
    return {"steps": steps, "flags": flags, "wall_s": wall, "plan_s": took, "added": took / (wall - took),
            "chose": line}


def main(argv=None):
    args = parse_args(argv)
    from schedules.observe.memory import machine_info
    os.makedirs(args.out, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="chooser-", dir=args.out)
    started = time.time()
    report = {"machine": machine_info(), "args": vars(args), "models": {}}
    for name in args.models:
        profile, launch_s = profile_model(name, folder, args.timeout)
        entry = {"profile_launch_s": launch_s, "profile_s": profile.meta.get("seconds"), "layers": len(profile.layers),
                 "profile": profile.to_json(), "configs": [], "budgets": [], "budget_memory": []}
        report["models"][name] = entry
        for m in [] if args.budgets_only else getattr(args, f"{name}_micro_batches"):
            row = compare(name, m, profile, folder, args.timeout)
            entry["configs"].append(row)
            print(f"{name} m = {m}: pick {row['pick']}, best measured {row['best']}, regret {row['regret']:.1%}, "
                  f"rank correlation {row['spearman']:.2f}", flush=True)
        for p in args.memory_stages:
            for m in args.memory_micro_batches:
                rows, memory = budgets(name, m, profile, folder, args.timeout, p)
                entry["budgets"] += rows
                entry["budget_memory"].append(memory)
                print(json.dumps(rows), flush=True)
                print(json.dumps({k: [v["predicted_peak_mib"], v["measured_peak_mib"]]
                                  for k, v in memory["schedules"].items()}), flush=True)
        with open(os.path.join(args.out, "chooser.json"), "w") as f:
            json.dump(report, f, indent=1)
    if args.demo_steps and not args.budgets_only:
        report["demo"] = demo_overhead(args.demo_steps, args.timeout)
        print(f"demo: profiling and choosing {report['demo']['plan_s']:.1f} s of {report['demo']['wall_s']:.0f} s "
              f"({report['demo']['added']:.1%} added)", flush=True)
    report["took_s"] = time.time() - started
    merged = None  # --budgets-only --docs: the published record keeps the rest
    if args.docs and args.budgets_only:
        merged = merge_budgets(report, os.path.join(common.BENCH_DIR, "chooser.json"))
    common.save(args, "chooser", report, published=merged)


if __name__ == "__main__":
    main()
