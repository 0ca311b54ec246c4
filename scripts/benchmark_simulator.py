"""How fast the schedule simulator is: instructions simulated per second from p = 4 to 64 (m = 4p), the whole
schedule table, the chooser on a synthetic profile, and the explorer's answer to a change of inputs.

    python scripts/benchmark_simulator.py [--stages 4 8 16 32 64] [--schedules 1f1b zb-h1 interleaved zb-v v-min]
        [--table 16 32 64] [--choose 64] [--page 16] [--rounds 5] [--out runs/simulator] [--docs]

Each figure but the replays is measured cold, as a first call pays it: the structures and streams kept by the
simulator and the orders the definitions keep are dropped before it. Instructions simulated: every rank's
instructions in both runs that `simulate` makes (one synchronised iteration and `iterations` = 5 chained ones).
A replay: the same call again at other costs (the schedule's structure kept, its timing replayed). The table:
`schedule_table.py --stages P --micro-batches 4P` as a command (its process start and imports included), then its
rows in this process. The chooser: `choose_schedule.py --profile FILE --stages P --micro-batches 4P` as a command,
on a synthetic profile of 2P + 2 layers (an embedding with most of the parameters, a head three times a block's
cost, so that the three cuts differ). The page: the explorer's server (`serve()`, its worker processes) asked for
every registered schedule at p = P, m = 4P at once, as the page asks when all are ticked, one synchronised step
and chained: the time until every answer is in, for inputs it has not seen at that p and m (first), then for
`--rounds` changes of the costs. Writes JSON; states the machine.
"""
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "zb-h1", "interleaved", "zb-v", "v-min")


def parse_args(argv=None):
    p = common.add(common.parser(__doc__), "schedules", "out", "docs", out="runs/simulator", docs="simulator",
                   schedules=list(SCHEDULES))
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="p of the scaling table")
    p.add_argument("--table", type=int, nargs="*", default=[16, 32, 64], help="p of the timed schedule tables")
    p.add_argument("--choose", type=int, nargs="*", default=[64], help="p of the timed chooser runs")
    p.add_argument("--page", type=int, nargs="*", default=[16], help="p of the timed explorer answers")
    p.add_argument("--rounds", type=int, default=5, help="changes of the costs timed on the explorer")
    return p.parse_args(argv)


def machine():
    """'CPU model, N cores, Python X' (the CPU as `lscpu` names it, where /proc/cpuinfo has it)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def load_average():
    """The machine's 1, 5 and 15 minute load averages (other work on its cores slows every figure)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def forget():
    """Drop what earlier calls left for later ones: the simulator's structures, the definitions' orders, balanced
    cuts."""
    from schedules.definitions.controllable_memory import _orders
    from schedules.planner import compose
    from schedules.simulator import simulate
    simulate._STRUCTURES.clear()
    _orders.cache_clear()
    compose._BALANCED.clear()


def scaling_row(name, stages):
    """A cold call of `simulate` at p = stages, m = 4p, then the same at other costs (a replay)."""
    from schedules.simulator.simulate import simulate
    forget()
    started, cpu = time.perf_counter(), time.process_time()
    result = simulate(name, stages, 4 * stages)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    costs = {(r, c): {"F": 1.0 + 0.01 * r, "B": 1.5, "W": 0.5} for r in range(stages) for c in range(2)}
    replay = time.process_time()
    simulate(name, stages, 4 * stages, costs=costs, latency=0.1)
    replay = time.process_time() - replay
    return {"schedule": name, "stages": stages, "micro_batches": 4 * stages, "instructions": result.instructions,
            "seconds": seconds, "cpu_s": cpu, "per_second": result.instructions / cpu, "replay_cpu_s": replay}


def synthetic_profile(stages):
    """2p + 2 layers: an embedding with ten times a block's parameters, 2p blocks, a head of three blocks' cost."""
    from schedules.planner.profile import Profile
    layers = 2 * stages + 2
    profile = Profile.synthetic(layers, F=1e-3, B=1e-3, W=1e-3, saved=1 << 20, params=1000, optimizer=1e-4,
                                latency=5e-5)
    embed, head = profile.layers[0], profile.layers[-1]
    embed.params, embed.param_bytes = 10 * embed.params, 10 * embed.param_bytes
    head.F, head.B, head.W, head.BW = 3 * head.F, 3 * head.B, 3 * head.W, 3 * head.BW
    return profile


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def command(args):
    """(seconds, CPU seconds) a command of this repository takes, and its last output line."""
    started, cpu = time.perf_counter(), children_cpu()
    run = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    seconds, cpu = time.perf_counter() - started, children_cpu() - cpu
    if run.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{run.stderr[-2000:]}")
    return seconds, cpu, run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""


def table_row(stages):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import schedule_table
    cli, cli_cpu, _ = command(["scripts/schedule_table.py", "--stages", str(stages), "--micro-batches",
                               str(4 * stages)])
    forget()
    started, cpu = time.perf_counter(), time.process_time()
    rows = schedule_table.rows(stages, 4 * stages)
    return {"stages": stages, "micro_batches": 4 * stages, "command_s": cli, "command_cpu_s": cli_cpu,
            "rows_s": time.perf_counter() - started, "rows_cpu_s": time.process_time() - cpu, "schedules": len(rows),
            "simulated": sum(1 for r in rows if not r["error"])}


def choose_row(stages, folder):
    path = os.path.join(folder, f"profile-p{stages}.json")
    profile = synthetic_profile(stages)
    profile.save(path)
    cli, cli_cpu, last = command(["scripts/choose_schedule.py", "--profile", path, "--stages", str(stages),
                                  "--micro-batches", str(4 * stages), "--limit", "3"])
    from schedules.planner.choose import choose
    forget()
    started, cpu = time.perf_counter(), time.process_time()
    choice = choose(profile, stages, 4 * stages)
    return {"stages": stages, "micro_batches": 4 * stages, "layers": len(profile.layers), "command_s": cli,
            "command_cpu_s": cli_cpu, "choose_s": time.perf_counter() - started,
            "choose_cpu_s": time.process_time() - cpu,
            "candidates": len(choice.ranked) + len(choice.dropped), "pick": choice.pick.label, "summary": last}


PAGE_CLIENT = """
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, asks = sys.argv[1], json.loads(sys.argv[2])

def post(body):  # the answer's bytes, not parsed: a browser parses it in its own time
    req = urllib.request.Request(url + 'api/simulate', json.dumps(body).encode(), {'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=600) as answer:
        return answer.read()

with ThreadPoolExecutor(6) as pool:  # a browser's connections to one server
    started = time.perf_counter()
    answers = list(pool.map(post, asks))
    print(json.dumps([time.perf_counter() - started, sum(b'"error":null' in a for a in answers)]))
"""


def page_row(stages, chained, rounds):
    """The explorer's server asked for every schedule at once (p = stages, m = 4p), as the page asks, from a process
    of its own (as a browser, with 6 connections): seconds until every answer is in, for inputs it has not seen at
    this p and m, then for `rounds` changes of the costs (F)."""
    from schedules.planner import explore
    from schedules.registry import available_schedules
    names = list(available_schedules())
    forget()
    server, url = explore.serve()

    def ask(f):
        asks = [{"schedule": n, "p": stages, "m": 4 * stages, "v": 2, "F": f, "B": 1.0, "W": 1.0, "comm": 0.0,
                 "chained": chained, "split": True, "dependencies": False} for n in names]
        run = subprocess.run([sys.executable, "-c", PAGE_CLIENT, url, json.dumps(asks)], capture_output=True,
                             text=True, timeout=900, check=True)
        return json.loads(run.stdout)

    try:
        first, simulated = ask(1.0)
        changes = [ask(1.0 + 0.25 * (i + 1))[0] for i in range(rounds)]
    finally:
        server.shutdown()
        server.server_close()
    return {"stages": stages, "micro_batches": 4 * stages, "chained": chained, "schedules": len(names),
            "simulated": simulated, "workers": len(server.pools or ()), "first_s": first, "changes_s": changes,
            "median_s": sorted(changes)[len(changes) // 2], "slowest_s": max(changes)}


def report(record):
    lines = [f"{record['machine']}; load average {record['load_average'][0]} at the start, "
             f"{record['load_end'][0]} at the end",
             "instructions simulated per CPU second, and CPU seconds (m = 4p; cold: streams compiled, orders built):",
             f"{'schedule':12} " + " ".join(f"{'p = ' + str(p):>16}" for p in record["args"]["stages"])]
    by = {(r["schedule"], r["stages"]): r for r in record["scaling"]}
    for name in record["args"]["schedules"]:
        cells = []
        for p in record["args"]["stages"]:
            r = by.get((name, p))
            cells.append(f"{r['per_second'] / 1e3:7.0f}k {r['cpu_s']:6.2f}s" if r else f"{'-':>16}")
        lines.append(f"{name:12} " + " ".join(cells))
    if any("replay_cpu_s" in r for r in record["scaling"]):
        lines.append("the same call at other costs, its structure kept (CPU seconds):")
        for name in record["args"]["schedules"]:
            cells = [f"{by[(name, p)]['replay_cpu_s']:16.3f}" if (name, p) in by else f"{'-':>16}"
                     for p in record["args"]["stages"]]
            lines.append(f"{name:12} " + " ".join(cells))
    for t in record["table"]:
        lines.append(f"schedule table p = {t['stages']}, m = {t['micro_batches']}: {t['command_s']:.1f} s as a "
                     f"command ({t['command_cpu_s']:.1f} s CPU), {t['rows_s']:.1f} s its rows "
                     f"({t['rows_cpu_s']:.1f} s CPU; {t['simulated']} of {t['schedules']} schedules run)")
    for c in record["choose"]:
        lines.append(f"choose_schedule p = {c['stages']}, m = {c['micro_batches']} ({c['layers']} layers): "
                     f"{c['command_s']:.1f} s as a command ({c['command_cpu_s']:.1f} s CPU), {c['choose_s']:.1f} s "
                     f"choose() ({c['choose_cpu_s']:.1f} s CPU; {c['candidates']} candidates, pick {c['pick']})")
    for g in record.get("page", []):
        lines.append(f"explorer p = {g['stages']}, m = {g['micro_batches']}, {g['schedules']} schedules"
                     f"{', chained' if g['chained'] else ''}: {g['first_s'] * 1e3:.0f} ms new p and m, a change of "
                     f"inputs {g['median_s'] * 1e3:.0f} ms median, {g['slowest_s'] * 1e3:.0f} ms slowest of "
                     f"{len(g['changes_s'])} ({g['workers']} workers)")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import notice
        import schedules.simulator.simulate  # noqa: F401
    started = time.perf_counter()
    record = {"machine": machine(), "load_average": load_average(), "args": vars(args), "scaling": [], "table": [],
              "choose": []}
    for p in args.stages:
        for name in args.schedules:
            record["scaling"].append(scaling_row(name, p))
    for p in args.table:
        record["table"].append(table_row(p))
    with tempfile.TemporaryDirectory(prefix="simulator-bench-") as folder:
        for p in args.choose:
            record["choose"].append(choose_row(p, folder))
    record["page"] = [page_row(p, chained, args.rounds) for p in args.page for chained in (False, True)]
    record["took_s"] = time.perf_counter() - started
    record["load_end"] = load_average()
    print(report(record))
    common.save(args, "simulator", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
