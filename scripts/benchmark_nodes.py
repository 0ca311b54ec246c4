"""What a slow link between nodes costs each schedule: two emulated nodes (emulated_nodes.py), one rank each,
joined unthrottled and at 1 Gbit/s, 200 Mbit/s and 50 Mbit/s; every schedule on the deep model and on GPTlite
small (the head whole, and zb-v with the head split), the median step and its slowdown over the unthrottled
link, beside `--pipeline-schedule auto`'s prediction and which schedule auto picks at each speed.

    python scripts/benchmark_nodes.py [--docs]      # about 30 minutes on 2 cores; needs root (namespaces)

Per link speed and model: ONE launch of benchmark_schedules.py's workers across the two nodes builds an engine
per schedule and runs them in rotating rounds (so drift hits all alike: the ratios are side by side), and
gives the simulator's figure from the costs that launch measured; then `train.py --pipeline-schedule auto`
across the same nodes profiles the layers and the link, prints its predicted step for every candidate, trains
with its pick and says what the pick ran; GPTlite's split head (zb-v --vocab-parallel) is one train.py run.
The speeds are visited in an order rotating each round. Writes runs/nodes/nodes.json and .txt; with --docs
docs/bench/nodes.json and the table in docs/nodes.md.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
import bench_common as common  # noqa: E402

RATES = ["off", "1gbit", "200mbit", "50mbit"]
MODELS = {  # as the issue that asked for this measured them (deep) and as docs/vocab-parallel.md does (GPTlite)
    "deep": {"flags": ["--model", "deep", "--deep-width", "1024", "--deep-depth", "16"], "micro_batch_size": 32,
             "micro_batches": 8},
    "gptlite": {"flags": ["--model", "gptlite", "--model-size", "small"], "micro_batch_size": 4, "micro_batches": 4},
}


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--rates", nargs="+", default=RATES, help="link speeds (off: unthrottled)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--schedules", nargs="+", default=None, help="default: every trainable schedule")
    p.add_argument("--rounds", type=int, default=1, help="visits of every speed (each launch rotates schedules too)")
    p.add_argument("--worker-rounds", type=int, default=2, help="rounds of each schedule launch")
    p.add_argument("--steps", type=int, default=10, help="steps of each train.py run (auto, the split head)")
    p.add_argument("--no-auto", action="store_true", help="skip the auto runs")
    common.add(p, "out", "docs", "timeout", out="runs/nodes", docs="nodes", timeout=1200)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tiny models: the plumbing
    return p.parse_args(argv)


def schedule_launch(nodes, args, model, names, weights):
    """benchmark_schedules.py's throughput workers across the nodes: its analysed rows, by schedule."""
    import benchmark_schedules as bs
    spec = MODELS[model]
    wargs = bs.parse_args([*spec["flags"], "--micro-batch-size", str(spec["micro_batch_size"]), "--rounds",
                           str(args.worker_rounds), "--steps-per-round", "2", "--stages", "2"])
    wargs.partition_weights = weights
    wargs.out = os.path.join(args.out, "plots", f"{model}-{nodes.rate or 'off'}")  # its plots
    os.makedirs(wargs.out, exist_ok=True)
    m = spec["micro_batches"]
    with tempfile.TemporaryDirectory(prefix="nodes-") as folder:
        common.launch_across(nodes, ["scripts/benchmark_schedules.py", *common.argv(
            wargs, worker="throughput", micro_batches=[m], schedules=names, worker_out=folder)], args.timeout)
        ranks = [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(2)]
    return bs.analyse_throughput(ranks, wargs, m)["schedules"]


AUTO_ROW = re.compile(r"^\s*\d+ (\S+)( v=\d+)?( \+vocab)?\s+(\S.*?)\s+([\d.]+)\s+([\d.]+)\s")
AUTO_RAN = re.compile(r"auto: predicted ([\d.]+) ms per step, ran ([\d.]+) ms")
AUTO_PICK = re.compile(r"auto: chose (\S+(?: v=\d+)?(?: \+vocab)?) with")


def train_across(nodes, args, model, extra):
    """train.py across the nodes, on the engines' config of the schedule launches (torch's fused AdamW: what auto
    profiles is then what those measured): (its stdout, the median step in seconds after the first two)."""
    spec = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="nodes-train-") as folder:
        metrics, config = os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "ds_config.json")
        with open(config, "w") as f:
            json.dump(common.engine_config(spec["micro_batch_size"], spec["micro_batches"]), f)
        results = common.launch_across(nodes, ["train.py", *spec["flags"], "--pipeline-parallel-size", "2",
                                        "--deepspeed_config", config,
                                        "--micro-batch-size", str(spec["micro_batch_size"]),
                                        "--gradient-accumulation-steps", str(spec["micro_batches"]),
                                        "--steps", str(args.steps), "--log-interval", "1", "--eval-interval", "0",
                                        "--metrics-file", metrics, *extra], args.timeout)
        times = [e["iter_s"] for e in map(json.loads, open(metrics)) if "iter_s" in e][2:]
    return results[0][1], statistics.median(times)


def auto_said(out):
    """What train.py --pipeline-schedule auto printed: its predicted step per candidate (label -> s; a label's
    best cut, and also under the schedule's name alone its best v), its pick, the pick's predicted and run step."""
    predicted = {}
    for line in out.split("auto: predicted per candidate", 1)[-1].splitlines()[2:]:
        m = AUTO_ROW.match(line)
        if not m:
            break
        step = float(m.group(5)) / 1e3
        predicted.setdefault(m.group(1) + (m.group(2) or "") + (m.group(3) or ""), step)
        predicted.setdefault(m.group(1) + (m.group(3) or ""), step)
    pick, ran = AUTO_PICK.search(out), AUTO_RAN.search(out)
    return {"predicted": predicted, "pick": pick.group(1) if pick else None,
            "pick_predicted_s": float(ran.group(1)) / 1e3 if ran else None,
            "pick_ran_s": float(ran.group(2)) / 1e3 if ran else None}


def auto_run(nodes, args, model):
    """auto across the nodes: what it said (auto_said); the run's median step where it said none."""
    out, median = train_across(nodes, args, model, ["--pipeline-schedule", "auto"])
    said = auto_said(out)
    said["pick_ran_s"] = said["pick_ran_s"] or median
    return said


def over_rounds(rounds):
    """auto's figures of one speed over its rounds (each an auto_said with its fastest_ran): each candidate's median
    prediction; the pick most rounds made (the earlier on a tie) with its median prediction and the median of its
    runs; the median train.py run of each schedule that ran as the launch's fastest."""
    predicted = {}
    for said in rounds:
        for label, step in said["predicted"].items():
            predicted.setdefault(label, []).append(step)
    picks = [said["pick"] for said in rounds]
    pick = max(picks, key=lambda p: (picks.count(p), -picks.index(p)))
    ran = [said["pick_ran_s"] for said in rounds if said["pick"] == pick and said["pick_ran_s"]]
    mine = [said["pick_predicted_s"] for said in rounds if said["pick"] == pick and said["pick_predicted_s"]]
    fastest = {}
    for said in rounds:
        f = said.get("fastest_ran")
        if f:
            fastest.setdefault(f["name"], []).append(f["step_s"])
    return {"predicted": {k: statistics.median(v) for k, v in predicted.items()}, "pick": pick,
            "picks": picks, "pick_predicted_s": statistics.median(mine) if mine else None,
            "pick_ran_s": statistics.median(ran) if ran else None,
            "ran_as_fastest": {k: statistics.median(v) for k, v in fastest.items()}}


def _without_v(label):
    """An auto label's schedule and head, its chunks per rank left out ("interleaved v=2" -> "interleaved"): the
    launch's rows name a schedule so."""
    return re.sub(r" v=\d+", "", label or "")


def fastest_run(nodes, args, model, rows, rate, said):
    """The schedule this round's launch measured fastest, run by train.py as auto's pick was, so that the two are
    set side by side by one harness (the workers run most schedules 5-10% slower than train.py): its name and
    median step. The pick itself, and the split head (already a train.py run), are not run again."""
    measured = {n: c[rate]["runs"][-1]["step_s"] for n, c in rows.items() if rate in c}
    fastest = min(measured, key=measured.get)
    if fastest in (said["pick"], _without_v(said["pick"])):
        return {"name": fastest, "step_s": said["pick_ran_s"]}
    if fastest.endswith(" +vocab"):
        return {"name": fastest, "step_s": measured[fastest]}
    method = ["--partition-method", "profile"] if model == "gptlite" else []
    return {"name": fastest, "step_s": train_across(nodes, args, model, ["--pipeline-schedule", fastest, *method])[1]}


def table(record):
    """The published table: per model, a row per schedule, a column per speed."""
    lines = [record["machine"], ""]
    rates = record["rates"]
    got = "; ".join(f"{r}: {record['measured_rate'][r]}" for r in rates)
    lines.append(f"What a transfer got on each link (TCP, 8 MiB, best of 3): {got}.")
    for model, rows in record["results"].items():
        lines += ["", f"**{model}** (m = {MODELS[model]['micro_batches']}, micro-batch "
                      f"{MODELS[model]['micro_batch_size']}): median step ms (x the unthrottled step) / auto's "
                      f"prediction ms", "",
                  "| schedule | " + " | ".join(rates) + " |", "|---" * (len(rates) + 1) + "|"]
        for name, per_rate in rows.items():
            cells = []
            for r in rates:
                c = per_rate.get(r)
                if not c:
                    cells.append("")
                    continue
                base = per_rate.get(rates[0], {}).get("step_s")
                slow = f" (x{c['step_s'] / base:.2f})" if base and r != rates[0] else ""
                pred = f" / {c['auto_s'] * 1e3:.0f}" if c.get("auto_s") else ""
                cells.append(f"{c['step_s'] * 1e3:.0f}{slow}{pred}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        picks = record["auto"].get(model, {})
        if picks:
            lines += ["", "auto's pick: " + "; ".join(
                f"{r}: {a['pick']}{_other_picks(a)} (predicted {a['pick_predicted_s'] * 1e3:.0f} ms, ran "
                f"{a['pick_ran_s'] * 1e3:.0f}; "
                f"fastest measured {a['fastest']} {a['fastest_s'] * 1e3:.0f} ms, the pick's own "
                f"{a['pick_measured_s'] * 1e3:.0f} ms{_by_train(a)})"
                if a.get("pick_measured_s") else f"{r}: {a['pick']}"
                for r, a in picks.items())]
    return lines


def _other_picks(a):
    """The picks of the rounds, where they differ (as text for the table)."""
    picks = a.get("picks", [])
    return f" (rounds: {', '.join(picks)})" if len(set(picks)) > 1 else ""


def _by_train(a):
    """The pick against the launch's fastest, both run by train.py (fastest_run; over rounds, the median of the
    rounds in which that schedule was the launch's fastest), as text for the table."""
    name, step = a["fastest"], a.get("ran_as_fastest", {}).get(a["fastest"])
    if not step or name in (a["pick"], _without_v(a["pick"])) or not a.get("pick_ran_s"):  # the fastest is the pick
        return ""
    return f"; by train.py: {name} {step * 1e3:.0f} ms, the pick {a['pick_ran_s'] / step:.2f}x it"


def main(argv=None):
    args = parse_args(argv)
    import benchmark_schedules as bs

    if args.smoke:
        MODELS["deep"].update(flags=["--model", "deep", "--deep-width", "64", "--deep-depth", "4"],
                              micro_batch_size=4)
        MODELS["gptlite"].update(flags=["--model", "gptlite", "--model-size", "tiny"], micro_batch_size=2)
    machine = common.machine("benchmark_nodes", argparse.Namespace(device="cpu", stages=2))
    started = time.time()
    weights = {}
    if "gptlite" in args.models:  # GPTlite's stages balanced on its measured layer costs, as benchmark_schedules
        weights["gptlite"] = bs.gptlite_layer_costs(argparse.Namespace(
            model_size=MODELS["gptlite"]["flags"][3], micro_batch_size=MODELS["gptlite"]["micro_batch_size"],
            device="cpu"))
    record = {"machine": machine + ", 2 emulated nodes (network namespaces, tc htb links), one rank each",
              "rates": args.rates, "measured_rate": {}, "results": {m: {} for m in args.models},
              "auto": {m: {} for m in args.models}, "args": vars(args)}
    nodes = common.open_emulated_nodes(2)
    try:
        for rnd, rate in common.visit_rates(nodes, args.rates, args.rounds, record["measured_rate"], started):
            for model in args.models:
                names = bs.schedule_names(args.schedules, MODELS[model]["micro_batches"], 2)[0]
                rows = schedule_launch(nodes, args, model, names, weights.get(model))
                for name, row in rows.items():
                    cell = record["results"][model].setdefault(name, {}).setdefault(rate, {"runs": []})
                    cell["runs"].append({"step_s": row["iter_s"], "simulated_s": row["predicted_iter_s"],
                                         "held_messages": row["held_messages"], "held_s": row["held_s"]})
                if model == "gptlite":
                    _, split = train_across(nodes, args, model, ["--pipeline-schedule", "zb-v", "--vocab-parallel",
                                                                 "--partition-method", "profile"])
                    cell = record["results"][model].setdefault("zb-v +vocab", {}).setdefault(rate, {"runs": []})
                    cell["runs"].append({"step_s": split})
                if not args.no_auto:  # a round's own auto run: its profile varies from launch to launch as steps do
                    said = auto_run(nodes, args, model)
                    said["fastest_ran"] = fastest_run(nodes, args, model, record["results"][model], rate, said)
                    record["auto"][model].setdefault(rate, {"rounds": []})["rounds"].append(said)
                print(f"[{time.time() - started:.0f} s] {rate} {model}: " + ", ".join(
                    f"{n} {c[rate]['runs'][-1]['step_s'] * 1e3:.0f}" for n, c in record["results"][model].items()
                    if rate in c), flush=True)
    finally:
        nodes.close()
    for model, rows in record["results"].items():  # medians over rounds; auto's prediction beside each
        for rate, a in record["auto"][model].items():
            a.update(over_rounds(a["rounds"]))
        for name, per_rate in rows.items():
            for rate, cell in per_rate.items():
                cell["step_s"] = statistics.median(r["step_s"] for r in cell["runs"])
                auto = record["auto"][model].get(rate, {}).get("predicted", {})
                cell["auto_s"] = auto.get(name)
        for rate, a in record["auto"][model].items():
            measured = {n: c[rate]["step_s"] for n, c in rows.items() if rate in c}
            a["fastest"] = min(measured, key=measured.get)
            a["fastest_s"] = measured[a["fastest"]]
            a["pick_measured_s"] = measured.get(a["pick"], measured.get(_without_v(a["pick"])))
    lines = table(record)
    lines.append(f"took {time.time() - started:.0f} s")
    print("\n".join(lines))
    common.save(args, "nodes", record, lines)  # with --docs, the earlier runs' notes kept
    if args.docs:
        common.write_marked("nodes.md", "nodes-table", lines)


if __name__ == "__main__":
    main()
