"""The shipped configuration against the fastest exact alternatives: `train.py` as a user runs it, side by side.

    python scripts/benchmark_defaults.py            # the deep model and GPTlite small, 2 ranks, 3 rounds
    python scripts/benchmark_defaults.py --docs     # also docs/bench/defaults.json and the table in docs/choosing.md

Per model, each configuration is one launch of `train.py` per round (2 ranks, one thread each, fresh
interpreters), the order rotating every round, with the same seed, data and steps; its step time is the median
of `iter_s` (--metrics-file) over its launches' steps, the first `--warmup` of each launch left out. The
configurations train the same model exactly (fp32, the whole model's gradient norm clipped at 1.0); the JSON
keeps each launch's losses and the largest difference from the shipped configuration's.

- deep (768 x 12, micro-batches of 16, 6 per step, `--pipeline-schedule zb-h1`): the shipped ds_config.json
  (ZeRO 1, torch's fused AdamW), the same at ZeRO 0, and `--pipeline-schedule auto` with the shipped config,
  whose predicted step (the chooser's line) is held against its measured one;
- gptlite (small, the README's command: `--pipeline-schedule` left at its default): the shipped config, the same
  order on our engine (`1f1b-lean`) with the shipped config and at ZeRO 0. DeepSpeed's own engine at ZeRO 0 is
  left out: it clips every stage by the first stage's norm, so it does not train the same model.

`--dry` runs a tiny version of each (the tests): seconds, not figures.
"""
import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "ds_config.json")
OUT = os.path.join(ROOT, "docs", "bench", "defaults.json")
DOC = os.path.join(ROOT, "docs", "choosing.md")
BEGIN, END = "<!-- benchmark_defaults: begin -->", "<!-- benchmark_defaults: end -->"

# model -> (train.py flags, [(configuration, what it is, extra flags, ds_config overrides or None: as shipped)])
MODELS = {
    "deep": (["--model", "deep", "--deep-width", "768", "--deep-depth", "12", "--micro-batch-size", "16",
              "--gradient-accumulation-steps", "6", "--pipeline-parallel-size", "2"],
             [("shipped", "ds_config.json as shipped (ZeRO 1, fused AdamW), zb-h1",
               ["--pipeline-schedule", "zb-h1"], None),
              ("zero0", "the same at ZeRO 0, zb-h1", ["--pipeline-schedule", "zb-h1"],
               {"zero_optimization": {"stage": 0}}),
              ("auto", "ds_config.json as shipped, --pipeline-schedule auto", ["--pipeline-schedule", "auto"], None)]),
    "gptlite": (["--model", "gptlite", "--model-size", "small", "--pipeline-parallel-size", "2"],
                [("shipped", "ds_config.json as shipped, the default --pipeline-schedule (1f1b: DeepSpeed's engine)",
                  [], None),
                 ("1f1b-lean", "ds_config.json as shipped, the same order on our engine (--pipeline-schedule "
                  "1f1b-lean)", ["--pipeline-schedule", "1f1b-lean"], None),
                 ("1f1b-lean-zero0", "the same at ZeRO 0", ["--pipeline-schedule", "1f1b-lean"],
                  {"zero_optimization": {"stage": 0}})]),
}
DRY = {"deep": ["--deep-width", "64", "--deep-depth", "4", "--micro-batch-size", "4"],
       "gptlite": ["--model-size", "tiny", "--micro-batch-size", "2"]}
WITHIN = 0.05  # the shipped configuration's promise: within 5% of the fastest exact one
# per model, the configuration that is ds_config.json as shipped on our engines: the promise is kept when it runs
# within WITHIN of every configuration of the same flags (the same schedule, another ds_config.json)
OURS = {"deep": "shipped", "gptlite": "1f1b-lean"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rounds", type=int, nargs=2, default=[4, 3], metavar=("DEEP", "GPTLITE"),
                   help="launches of each configuration of each model")
    p.add_argument("--steps", type=int, nargs=2, default=[20, 8], metavar=("DEEP", "GPTLITE"),
                   help="steps per launch of each model")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each launch left out")
    p.add_argument("--ranks", type=int, default=2)
    common.add(p, "timeout", "out", "docs", timeout=300, out=os.path.join("runs", "defaults.json"),
               docs=dict(help=f"write {os.path.relpath(OUT, ROOT)} and the table in {os.path.relpath(DOC, ROOT)}"))
    p.add_argument("--dry", action="store_true", help="tiny models, for a test: seconds, not figures")
    return p.parse_args(argv)


def config_file(overrides, folder, name):
    """ds_config.json with `overrides` (top-level keys replaced), or the shipped file itself (None)."""
    if overrides is None:
        return None
    with open(CONFIG) as f:
        cfg = json.load(f)
    cfg.update(copy.deepcopy(overrides))
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def launch(args, model, config, flags, overrides, folder, steps):
    """One launch of train.py on `args.ranks` ranks: (per-step records, rank 0's stdout)."""
    from local_launch import launch as run_ranks
    metrics = os.path.join(folder, f"{model}-{config}.jsonl")
    argv = [*MODELS[model][0], *flags, *(DRY[model] if args.dry else []), "--steps", str(steps), "--seed", "0",
            "--log-interval", str(steps), "--metrics-file", metrics, "--dist-timeout", str(args.timeout)]
    cfg = config_file(overrides, folder, f"{model}-{config}")
    if cfg:
        argv += ["--deepspeed_config", cfg]
    run = run_ranks(args.ranks, argv, timeout=args.timeout)
    if not run.ok:
        raise SystemExit(f"{model} {config}: train.py {' '.join(argv)} failed\n{run.explain()}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "loss" in r], run.stdout[0]


PICK = re.compile(r"^auto: chose (\S+) with the (\S+) cut .*?: predicted ([\d.]+) ms per step", re.M)
ROW = re.compile(r"^\s*\d+ (\S+(?: v=\d+)?)\s+(\S+)\s+([\d.]+)\s", re.M)


def chooser_line(stdout):
    """What --pipeline-schedule auto printed: {'pick', 'cut', 'predicted_s', 'predicted_s_by_schedule'} (each
    schedule's best cut), or None."""
    found = PICK.search(stdout)
    if not found:
        return None
    table = {}
    for label, _, step in ROW.findall(stdout):
        table.setdefault(label, float(step) / 1e3)
    return {"pick": found.group(1), "cut": found.group(2), "predicted_s": float(found.group(3)) / 1e3,
            "predicted_s_by_schedule": table}


def measure(args, model, folder):
    flags, configs = MODELS[model]
    which = list(MODELS).index(model)
    steps, rounds = (args.steps[which], args.rounds[which]) if not args.dry else (args.warmup + 2, 1)
    runs = {name: [] for name, *_ in configs}
    order = list(configs)
    for r in range(rounds):
        for name, _, extra, overrides in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            records, stdout = launch(args, model, name, extra, overrides, folder, steps)
            runs[name].append({"iter_s": [rec["iter_s"] for rec in records], "loss": [rec["loss"] for rec in records],
                               "chooser": chooser_line(stdout), "launch_s": time.perf_counter() - t0})
            kept = runs[name][-1]["iter_s"][args.warmup:]
            print(f"round {r + 1}/{rounds} {model} {name}: median step "
                  f"{statistics.median(kept) * 1e3:.1f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
    shipped = runs["shipped"][0]["loss"]
    rows = []
    for name, what, extra, overrides in configs:
        launches = runs[name]
        kept = [s for one in launches for s in one["iter_s"][args.warmup:]]
        rows.append({"config": name, "what": what, "flags": extra, "ds_config": overrides or "ds_config.json",
                     "median_s": statistics.median(kept),
                     "launch_medians_s": [statistics.median(one["iter_s"][args.warmup:]) for one in launches],
                     "loss_max_diff": max(abs(a - b) for one in launches for a, b in zip(one["loss"], shipped)),
                     "final_loss": launches[0]["loss"][-1], "launches": launches})
    fastest = min(rows, key=lambda row: row["median_s"])
    for row in rows:
        row["vs_fastest"] = row["median_s"] / fastest["median_s"]
        row["shipped_vs_this_paired"] = paired(rows[0], row)
    chooser = next((launch_["chooser"] for row in rows for launch_ in row["launches"] if launch_["chooser"]), None)
    result = {"flags": flags + (DRY[model] if args.dry else []), "steps": steps, "rounds": rounds, "rows": rows,
              "fastest": fastest["config"],
              "shipped_vs_fastest": rows[0]["vs_fastest"], "within": rows[0]["vs_fastest"] <= 1 + WITHIN,
              "chooser": chooser}
    return {**result, **promise(rows, OURS[model])}


def paired(row, other):
    """The median over rounds of `row`'s launch against `other`'s of the same round. The same round's launches ran
    minutes apart at most: their ratio is what a slow phase of the machine moves least (it can last a launch or
    more, and falls on whichever configuration runs then)."""
    return statistics.median(a / b for a, b in zip(row["launch_medians_s"], other["launch_medians_s"]))


def promise(rows, ours):
    """Item 0's verdict: `ours` (ds_config.json as shipped, on our engines) against the configurations of the same
    flags (another ds_config.json), pooled and round by round."""
    mine = next(row for row in rows if row["config"] == ours)
    peers = [row for row in rows if row["flags"] == mine["flags"]]
    best = min(peers, key=lambda row: row["median_s"])
    by_round = max(paired(mine, row) for row in peers)
    ratio = mine["median_s"] / best["median_s"]
    return {"ours": ours, "ours_best_peer": best["config"], "ours_vs_best_peer": ratio,
            "ours_vs_best_peer_paired": by_round, "ours_within": max(ratio, by_round) <= 1 + WITHIN}


def machine():
    from schedules.observe.memory import machine_info
    return machine_info()


def render(record):
    """The markdown block docs/choosing.md shows between its markers."""
    from schedules.observe.memory import machine_line
    lines = [BEGIN, "", f"Measured by `{record['command']}` ({record['ranks']} ranks, load average "
             f"{record['load_average'][0]:.2f} at the start, {record['load_end'][0]:.2f} at the end; "
             f"{machine_line(record['machine'])}; each configuration's median step over its launches, the first "
             f"{record['warmup']} steps of each left out):", ""]
    for model, result in record["models"].items():
        lines += [f"**{model}** (`train.py {' '.join(result['flags'])}`, {result['rounds']} launches of "
                  f"{result['steps']} steps per configuration, rotating):", "",
                  "| configuration | median step (ms) | vs the fastest | largest loss difference |",
                  "|---|---|---|---|"]
        for row in result["rows"]:
            lines.append(f"| {row['what']} | {row['median_s'] * 1e3:.1f} | {row['vs_fastest']:.3f} | "
                         f"{row['loss_max_diff']:.1e} |")
        verdict = "within" if result["within"] else "NOT within"
        paired = max(row.get("shipped_vs_this_paired", 0.0) for row in result["rows"])
        lines += [""]
        if "ours" in result:
            mine = next(row for row in result["rows"] if row["config"] == result["ours"])
            lines.append(f"**ds_config.json as shipped on our engines** (`{' '.join(mine['flags'])}`) runs at "
                         f"{result['ours_vs_best_peer']:.3f} of the fastest configuration of the same flags "
                         f"({result['ours_best_peer']}), {result['ours_vs_best_peer_paired']:.3f} round by round "
                         f"(each launch against the same round's): "
                         f"{'within' if result['ours_within'] else 'NOT within'} {WITHIN:.0%}.")
        lines.append(f"Over every configuration here, the first row runs at {result['shipped_vs_fastest']:.3f} of "
                     f"the fastest ({result['fastest']}): {verdict} {WITHIN:.0%}; round by round (each launch against "
                     f"the first row's launch of its round, the median over rounds) at {paired:.3f}.")
        chooser = result.get("chooser")
        if chooser:
            auto = next(row for row in result["rows"] if row["config"] == "auto")
            lines.append(f"`--pipeline-schedule auto` chose {chooser['pick']} ({chooser['cut']} cut) and predicted "
                         f"{chooser['predicted_s'] * 1e3:.1f} ms per step; it ran at {auto['median_s'] * 1e3:.1f} ms "
                         f"({auto['median_s'] / chooser['predicted_s'] - 1:+.1%}).")
        lines.append("")
    return "\n".join(lines + [END])


def publish(record, doc=DOC, out=OUT):
    """Write the JSON and replace the block between the markers in docs/choosing.md (appended if absent)."""
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    with open(doc) as f:
        text = f.read()
    block = render(record)
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(text)


def main(argv=None):
    args = parse_args(argv)
    command = " ".join(["python scripts/benchmark_defaults.py", *(argv if argv is not None else sys.argv[1:])])
    record = {"machine": machine(), "load_average": list(os.getloadavg()), "ranks": args.ranks,
              "warmup": args.warmup, "dry": args.dry, "command": command,
              "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(), "models": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models:
            record["models"][model] = measure(args, model, folder)
    record["load_end"] = list(os.getloadavg())
    record["seconds"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(render(record))
    if args.docs:
        publish(record)
    return record


if __name__ == "__main__":
    main()
