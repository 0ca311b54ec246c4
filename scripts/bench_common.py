"""What the benchmark scripts share: their common flags, their ranks launched side by side, and what they write.

    import bench_common as common    # beside the scripts (a script loaded from elsewhere puts scripts/ on the path)

    p = common.add(common.parser(__doc__), "stages", "micro-batches", "out", "docs", "timeout", "worker-out",
                   out="runs/x", docs="x", micro_batches=dict(default=[4], help="..."))
    ...
    ranks = common.launch_ranks("benchmark_x.py", args.stages, args, micro_batches=[m])  # the parent: each rank's
    ...
    rank, device, sync = common.init_rank(args.device)                                  # a rank (--worker-out set)
    common.finish_rank(args, rank, result)
    ...
    common.save(args, "x", record, lines)  # the parent: --out/x.json and x.txt; --docs: docs/bench/x.json, the page

Standard library only at import: a script's --help starts no torch.
"""
import argparse
import json
import os
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "docs", "bench")  # what the benchmarks publish (docs/benchmarks.md renders it)

# The flags several benchmarks take, as most of them take it; `add` gives a script those it names, each with the
# default or the argparse keywords the script changes.
FLAGS = {
    "stages": dict(type=int, default=2),
    "micro-batches": dict(type=int, nargs="+", default=[4, 8]),
    "schedules": dict(nargs="+", default=None, help="default: every trainable schedule"),
    "model": dict(choices=["deep", "gptlite"], default="deep"),
    "model-size": dict(default="small", help="GPTlite size"),
    "n-layer": dict(type=int, default=None, help="override the size's number of blocks"),
    "block-size": dict(type=int, default=None, help="override the size's context"),
    "deep-width": dict(type=int, default=1024),
    "deep-depth": dict(type=int, default=16),
    "micro-batch-size": dict(type=int, default=32),
    "rounds": dict(type=int, default=6),
    "steps-per-round": dict(type=int, default=3),
    "warmup": dict(type=int, default=3, help="rounds run first and discarded"),
    "device": dict(choices=["cpu", "cuda"], default="cpu"),
    "out": dict(default=None),
    "docs": dict(action="store_true", help="also publish the record in docs/bench/ and docs/benchmarks.md"),
    "timeout": dict(type=int, default=1200, help="seconds per launch before its ranks are killed"),
    # the parent's to its ranks
    "partition-weights": dict(type=float, nargs="+", default=None, help=argparse.SUPPRESS),
    "worker-out": dict(default=None, help=argparse.SUPPRESS),
}

# The tiny Mixture-of-Experts models of the MoE benchmarks' --smoke runs (their plumbing): train.py's flags
SMOKE_MOE = {
    "deep": ["--model", "deep", "--deep-width", "32", "--deep-depth", "4", "--moe-experts", "4", "--moe-top-k", "1",
             "--moe-capacity-factor", "0"],
    "gptlite": ["--model", "gptlite", "--model-size", "tiny", "--moe-experts", "4", "--moe-capacity-factor", "0",
                "--partition-method", "uniform"],
}


def sample_elements(flags):
    """Elements of one sample's activation (or its gradient) that a pipeline stage sends the next, for the model
    train.py builds from `flags` (its --model, --deep-width or --model-size; GPTlite's context)."""
    given = dict(zip(flags[::2], flags[1::2]))
    if given.get("--model") == "deep":
        return int(given["--deep-width"])
    import gptlite
    size = gptlite.MODEL_SIZES[given["--model-size"]]
    return size.n_embd * size.block_size


def parser(doc):
    """An ArgumentParser described by the first line of the script's docstring."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def add(p, *names, **changes):
    """FLAGS[name] for each name, in this order. `changes` by name (dashes as underscores): a dict updates the
    flag's argparse keywords, anything else is its default; for --docs, the name of what it publishes."""
    for name in names:
        flag, change = dict(FLAGS[name]), changes.get(name.replace("-", "_"), {})
        if name == "docs" and isinstance(change, str):
            flag["help"] = f"also publish docs/bench/{change}.json and docs/benchmarks.md"
        else:
            flag.update(change if isinstance(change, dict) else {"default": change})
        p.add_argument("--" + name, **flag)
    return p


def add_point(p):
    """--stages P and --micro-batches M, both required, and --latency: the one (P, M) a simulator tool draws or
    tabulates."""
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches per iteration M")
    p.add_argument("--latency", type=float, default=0.0, help="cost of one p2p message, in forward units")
    return p


def argv(args, **changes):
    """The command line that parses back to `args` (a script's parsed flags) with `changes`: a list is spread, True
    is the flag alone, None and False are left out, and so is --docs (ranks publish nothing)."""
    out = []
    for key, value in {**vars(args), **changes}.items():
        flag = "--" + key.replace("_", "-")
        if key == "docs" or value is None or value is False:
            continue
        out += [flag] if value is True else [flag, *value] if isinstance(value, (list, tuple)) else [flag, value]
    return [str(a) for a in out]


def launch_ranks(script, ranks, args, env=None, what="benchmark ranks", **changes):
    """`ranks` ranks of scripts/SCRIPT, given the parent's flags with `changes` and --worker-out FOLDER, a
    temporary folder where each rank writes what it measured (`finish_rank`): their records, by rank."""
    from local_launch import launch
    with tempfile.TemporaryDirectory(prefix=os.path.splitext(script)[0] + "-") as folder:
        run = launch(ranks, argv(args, **changes, worker_out=folder), timeout=args.timeout,
                     script=f"scripts/{script}", env=env)
        if not run.ok:
            raise SystemExit(f"{what} failed:\n{run.explain()}")
        records = []
        for r in range(ranks):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                records.append(json.load(f))
        return records


def init_rank(device="cpu", timeout=300):
    """Join the launch's process group (gloo; nccl with one GPU per rank, NCCL refusing two ranks on one device):
    (rank, torch.device, its synchronize)."""
    from datetime import timedelta

    import deepspeed
    import torch
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        here, sync = torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize
    else:
        here, sync = torch.device("cpu"), (lambda: None)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), here, sync


def ping_pong_latency(rank, nbytes, device="cpu", sync=lambda: None, repeats=50):
    """One-way time of a point-to-point message of `nbytes` between ranks 0 and 1 (half a round trip)."""
    import torch
    import torch.distributed as dist
    x = torch.zeros(nbytes // 4, device=device)
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
    sync()
    return (time.perf_counter() - t0) / repeats / 2


def finish_rank(args, rank, result):
    """A rank's record to the parent (rank{R}.json in --worker-out); then the process group is closed, gloo's
    threads joined now rather than in the interpreter's teardown."""
    import torch.distributed as dist
    with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def engine_config(micro_batch_size, micro_batches, **more):
    """The benchmark engines' DeepSpeed config: torch's fused AdamW (about 4x faster on CPU than its default, so
    less of each step is not the schedule), no progress lines; `more` added."""
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": micro_batches,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
            "steps_per_print": 10**9, **more}


def rotated(items, r):
    """`items` in round r's order: each round starts one later, so that drift on a shared machine hits all alike."""
    k = r % len(items)
    return items[k:] + items[:k]


def machine(script, args):
    """The machine a benchmark runs on, in one line; with --device cuda its GPUs, one per rank, or SystemExit."""
    from schedules.observe.memory import machine_line
    line = machine_line()
    if args.device == "cuda":
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.stages:
            raise SystemExit(f"{script}: --device cuda needs one GPU per rank (--stages {args.stages}); this machine "
                             f"has {gpus}: run it on a machine with {args.stages} GPUs or pass --device cpu")
        line += f", {gpus} x {torch.cuda.get_device_name(0)}, nccl"
    return line


def save(args, name, record, lines=None, publish=None, published=None):
    """`record` as --out/NAME.json (and `lines` as NAME.txt); with --docs (where a script has it), `published`
    (default: the record) as docs/bench/PUBLISH.json (default: NAME), and docs/benchmarks.md rendered anew."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    if lines is not None:
        with open(os.path.join(args.out, f"{name}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if getattr(args, "docs", False):
        import benchmark_docs  # beside this module
        benchmark_docs.publish(record if published is None else published, publish or name)


def write_marked(page, name, lines):
    """`lines` in docs/PAGE between its markers <!-- NAME --> and <!-- /NAME --> (a table a benchmark re-writes)."""
    path = os.path.join(ROOT, "docs", page)
    with open(path) as f:
        text = f.read()
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"docs/{page} has no {start} ... {end} to write the table between")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    with open(path, "w") as f:
        f.write(head + start + "\n" + "\n".join(lines) + "\n" + end + tail)


def open_emulated_nodes(count):
    """`count` emulated nodes (emulated_nodes.py), made; SystemExit in one line where namespaces cannot be made. A
    SIGTERM then ends the script through its `finally` (where the caller closes them), so the namespaces go."""
    import signal
    import sys

    from emulated_nodes import EmulatedNodes, NoRights
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        nodes = EmulatedNodes(count)
        nodes.open()
    except NoRights as e:
        raise SystemExit(f"error: {e}")
    return nodes


_PORTS = iter(range(29600, 30600))  # a fresh port each launch across emulated nodes: the last one's may linger


def launch_across(nodes, argv, timeout, threads=1, ranks_per_node=1, interleave=False):
    """`python ARGV` as `ranks_per_node` ranks on each emulated node (one: RANK = node; more: placed as
    `EmulatedNodes.rank_nodes` says; the process group's store on node 0): every rank's (exit status, stdout,
    stderr); SystemExit naming the failure when a rank failed or the deadline passed."""
    results = nodes.run_ranks(argv, next(_PORTS), timeout, threads, cwd=ROOT, ranks_per_node=ranks_per_node,
                              interleave=interleave)
    if any(code != 0 for code, _, _ in results):
        raise SystemExit(f"{' '.join(argv[:2])} across the nodes failed:\n" + "\n".join(
            f"--- rank {k} rc={code}\n{err[-2500:]}" for k, (code, _, err) in enumerate(results)))
    return results


def visit_rates(nodes, rates, rounds, measured, started):
    """(round, rate) for each link speed of each round, in an order rotating each round, the nodes' links set to it;
    what a transfer then gets is written to `measured[rate]` and printed."""
    import time

    from emulated_nodes import format_rate, parse_rate
    for rnd in range(rounds):
        for rate in rotated(rates, rnd):
            nodes.set_rate(parse_rate(rate))
            measured[rate] = format_rate(nodes.measure())
            print(f"[{time.time() - started:.0f} s] link {rate}: a transfer gets {measured[rate]}", flush=True)
            yield rnd, rate
