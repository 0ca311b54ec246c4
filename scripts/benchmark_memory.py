"""Memory of GPTlite's two pipeline builds, per rank: the list of nn.Modules vs LayerSpecs.

    python scripts/benchmark_memory.py                      # 1, 2, 4, 8 stages, both builds
    python scripts/benchmark_memory.py --stages 2 4 --micro-batches 4 --out runs/memory

For each stage count and build, launches one rank per stage (local_launch.py) and each rank
measures:
- base RSS:    process RSS just before `get_model(...)` (torch + deepspeed + gloo),
- build RSS:   what `get_model(...)` adds to RSS. The list build (`GPTlite(config).to_layers()`)
               keeps every layer alive on every rank although `parameters()` shows only the
               rank's own stage; the LayerSpec build creates only the rank's own layers,
- build peak:  the RSS high-water mark during `get_model(...)` above base RSS (transients),
- params:      bytes of the parameters of the rank's own stage,
- peak saved:  peak bytes autograd holds for backward during one `engine.train_batch()` over
               `--micro-batches` micro-batches (schedules.observe.memory.SavedTensorTracker: each storage
               once, parameters excluded, live count falls as backward frees the graph),
- peak RSS:    the rank's RSS high-water mark over its whole life (model, optimizer state,
               gradients, activations, communication buffers).
Prints a table per rank, a summary per (stages, build) with the LayerSpec build's saving, and
writes memory.json (raw), memory.txt (the tables) and memory.png to --out.

RSS honesty: before each RSS reading the worker runs gc.collect() and glibc malloc_trim(0)
(schedules.observe.memory.release_free_memory), so freed tensors that glibc kept in its heap do not
count; RSS deltas then measure live memory, not the allocator's history. (The JSON also keeps
`build_rss_untrimmed`: with `type:Block` the build only allocates and the two agree; with
`parameters`, untrimmed RSS kept 0.3-17 MiB of freed layers per rank on the reference machine.)

Partition method (both builds use the same): default `type:Block`, which balances the
transformer blocks, so with n_layer=8 every one of 8 stages gets one block and the embedding
(stage 0) and LM head (last stage) ride along. DeepSpeed's default `parameters` balances
parameter counts, which GPTlite's 50257-token embedding and head dominate: they get stages of
their own, and at 8 stages the middle stages hold 1-2 blocks each. `parameters` also builds
every LayerSpec once, one at a time, to count its parameters (PipelineModule._count_layer_params);
the layers are freed again, so after malloc_trim the retained build RSS is unchanged, but the
build peak of every rank grows by about the largest layer (embedding / head, 74 MiB for medium):
measured at 8 stages, LayerSpec build, 10.7 MiB retained vs 83-91 MiB peak on a one-block rank.
`--partition-method parameters` shows it.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from schedules.observe.memory import MiB, machine_info, machine_line

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ROOT = Path(common.ROOT)

BUILDS = {False: "list", True: "LayerSpec"}


def parse_args(argv=None):
    p = common.parser(__doc__)
    common.add(p, "model-size", "n-layer", "block-size", "stages", model_size=dict(
        default="medium", help="gptlite.MODEL_SIZES key (default medium)"),
        n_layer=dict(default=8, help="transformer blocks (>= largest --stages)"),
        block_size=dict(default=128, help="context length (medium's 256 halved for speed)"),
        stages=dict(nargs="+", default=[1, 2, 4, 8], help="pipeline stage counts"))
    p.add_argument("--builds", nargs="+", choices=["list", "spec"], default=["list", "spec"])
    common.add(p, "micro-batches", "micro-batch-size", micro_batch_size=2,
               micro_batches=dict(nargs=None, default=8, help="micro-batches in the measured step"))
    p.add_argument("--partition-method", default="type:Block", help="same for both builds")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="AdamW is torch's (torch_adam)")
    common.add(p, "out", "docs", "timeout", out=dict(default=str(ROOT / "runs" / "memory"),
                                                     help="directory for memory.json and memory.png"),
               docs="memory",
               timeout=dict(type=float, default=600))
    # worker mode (one rank; started by the parent through local_launch)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-stages", type=int, default=1, help=argparse.SUPPRESS)
    return common.add(p, "worker-out").parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one configuration
# ---------------------------------------------------------------------------------------------
def ds_config(args) -> dict:
    """ds_config.json with what this benchmark needs: fp32, ZeRO stage 0, one step."""
    with open(ROOT / "ds_config.json") as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    cfg["gradient_accumulation_steps"] = args.micro_batches
    cfg["train_batch_size"] = args.micro_batch_size * args.micro_batches  # data-parallel degree 1
    cfg["bf16"] = {"enabled": False}
    cfg.pop("fp16", None)
    # ZeRO-1 at data-parallel degree 1 shards nothing; it only adds flat fp32 copies of the
    # parameters. Stage 0 keeps the memory model plain: params + grads + optimizer state.
    cfg["zero_optimization"] = {"stage": 0}
    cfg.pop("scheduler", None)
    if args.optimizer == "sgd":
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    else:
        cfg["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW, no JIT-compiled op
    return cfg


def worker(args):
    import deepspeed
    import torch

    import gptlite
    from schedules.observe import memory

    rank, _, _ = common.init_rank(timeout=args.timeout)
    torch.manual_seed(0)
    peaks = []  # RSS high-water marks of the phases between resets; the lifetime peak is their max

    memory.release_free_memory()
    base_rss = memory.rss_bytes()
    peaks.append(memory.peak_rss_bytes())
    can_reset = memory.reset_peak_rss()
    model = gptlite.get_model(pipeline_num_stages=args.num_stages, pipeline_spec_layers=args.spec,
                              model_size=args.model_size, partition_method=args.partition_method,
                              n_layer=args.n_layer, block_size=args.block_size)
    build_peak = memory.peak_rss_bytes()
    build_rss_untrimmed = memory.rss_bytes() - base_rss  # for comparison: before gc + malloc_trim
    memory.release_free_memory()
    build_rss = memory.rss_bytes() - base_rss

    peaks.append(build_peak)
    memory.reset_peak_rss()
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = [type(f).__name__ for f in model.forward_funcs]

    cfg = ds_config(args)
    client_optimizer = None
    if cfg["optimizer"]["type"] == "SGD":  # DeepSpeed has no SGD: a torch optimizer, as train.py does
        client_optimizer = torch.optim.SGD(params, **cfg.pop("optimizer")["params"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer, model_parameters=params,
                                           config=cfg)

    g = torch.Generator().manual_seed(1234)
    vocab, T = gptlite.MODEL_SIZES[args.model_size].vocab_size, args.block_size
    batches = [(torch.randint(vocab, (args.micro_batch_size, T), generator=g),
                torch.randint(vocab, (args.micro_batch_size, T), generator=g)) for _ in range(args.micro_batches)]

    tracker = memory.SavedTensorTracker(ignore=model.parameters())
    t0 = time.perf_counter()
    with tracker:
        loss = engine.train_batch(iter(batches))
    step_s = time.perf_counter() - t0
    peaks.append(memory.peak_rss_bytes())
    memory.release_free_memory()
    after_step_rss = memory.rss_bytes()

    result = dict(rank=rank, stage=engine.stage_id, stages=args.num_stages, build=BUILDS[args.spec],
                  layers=layers, first_layer=int(model._local_start), base_rss=base_rss, build_rss=build_rss,
                  build_rss_untrimmed=build_rss_untrimmed,
                  build_peak=build_peak - base_rss if can_reset else None, param_bytes=param_bytes,
                  peak_saved=tracker.peak_bytes, saved_left_after_step=tracker.live_bytes,
                  total_saved=tracker.total_bytes, after_step_rss=after_step_rss, peak_rss=max(peaks),
                  step_peak_rss=peaks[-1] if can_reset else None, step_s=step_s,
                  loss=float(loss) if engine.is_last_stage() else None)
    common.finish_rank(args, rank, result)


# ---------------------------------------------------------------------------------------------
# Parent: launch every configuration, collect, report
# ---------------------------------------------------------------------------------------------
def mib(n):
    return "-" if n is None else f"{n / MiB:.1f}"


def table(headers, rows) -> str:
    """Right-aligned plain-text table."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


METRICS = ["build_rss", "param_bytes", "peak_saved", "peak_rss"]


def summarize(results):
    """Per (stages, build): max and mean over ranks of each metric, and the rank of the max."""
    summary = []
    for stages in sorted({r["stages"] for r in results}):
        for build in BUILDS.values():
            ranks = [r for r in results if r["stages"] == stages and r["build"] == build]
            if not ranks:
                continue
            row = {"stages": stages, "build": build}
            for m in METRICS:
                values = [r[m] for r in ranks]
                row[m] = {"max": max(values), "mean": sum(values) / len(values),
                          "max_rank": max(ranks, key=lambda r: r[m])["rank"]}
            summary.append(row)
    return summary


def savings(summary):
    """LayerSpec vs list, in % of the list build, per stage count and metric (max and mean rank)."""
    out = []
    for stages in sorted({s["stages"] for s in summary}):
        pair = {s["build"]: s for s in summary if s["stages"] == stages}
        if set(pair) != set(BUILDS.values()):
            continue
        row = {"stages": stages}
        for m in METRICS:
            for agg in ("max", "mean"):
                base = pair["list"][m][agg]
                row[f"{m}_{agg}"] = 100.0 * (base - pair["LayerSpec"][m][agg]) / base if base else 0.0
        out.append(row)
    return out


def report(doc) -> str:
    results, summary, saving = doc["results"], doc["summary"], doc["savings"]
    c = doc["config"]
    lines = [f"GPTlite {c['model_size']} (n_layer={c['n_layer']}, block_size={c['block_size']}), fp32, "
             f"{c['micro_batches']} micro-batches x {c['micro_batch_size']}, partition {c['partition_method']}, "
             f"optimizer {c['optimizer']}, ZeRO 0",
             f"machine: {machine_line(doc['machine'])}", "", "Per rank (MiB):"]
    lines.append(table(["stages", "build", "rank", "layers", "base RSS", "build RSS", "build peak", "params",
                        "peak saved", "peak RSS"],
                       [[r["stages"], r["build"], r["rank"],
                         f"{r['first_layer']}-{r['first_layer'] + len(r['layers']) - 1}",
                         mib(r["base_rss"]), mib(r["build_rss"]), mib(r["build_peak"]), mib(r["param_bytes"]),
                         mib(r["peak_saved"]), mib(r["peak_rss"])] for r in results]))
    lines += ["", "Per configuration, max (rank) / mean over ranks (MiB):"]
    lines.append(table(["stages", "build"] + ["build RSS", "params", "peak saved", "peak RSS"],
                       [[s["stages"], s["build"]] +
                        [f"{mib(s[m]['max'])} (r{s[m]['max_rank']}) / {mib(s[m]['mean'])}" for m in METRICS]
                        for s in summary]))
    lines += ["", "LayerSpec build's saving vs the list build, % (max rank / mean over ranks):"]
    lines.append(table(["stages", "build RSS", "peak RSS", "params", "peak saved"],
                       [[s["stages"]] + [f"{s[m + '_max']:.1f} / {s[m + '_mean']:.1f}"
                                         for m in ("build_rss", "peak_rss", "param_bytes", "peak_saved")]
                        for s in saving]))
    lines += ["", f"wall time {doc['runtime_s']:.0f} s"]
    return "\n".join(lines)


def plot(doc, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summary = doc["summary"]
    titles = {"build_rss": "RSS added by the model build", "param_bytes": "parameters of the rank's stage",
              "peak_saved": "peak bytes saved for backward", "peak_rss": "peak RSS of the rank"}
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, m in zip(axes.flat, METRICS):
        for build, color in (("list", "tab:red"), ("LayerSpec", "tab:blue")):
            rows = [s for s in summary if s["build"] == build]
            if not rows:
                continue
            x = [s["stages"] for s in rows]
            ax.plot(x, [s[m]["max"] / MiB for s in rows], "o-", color=color, label=f"{build}: max over ranks")
            ax.plot(x, [s[m]["mean"] / MiB for s in rows], "s--", color=color, alpha=0.6, label=f"{build}: mean")
            per_rank = [(r["stages"], r[m] / MiB) for r in doc["results"] if r["build"] == build]
            ax.scatter(*zip(*per_rank), color=color, s=10, alpha=0.4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s["stages"] for s in summary}))
        ax.set_xticklabels(sorted({s["stages"] for s in summary}))
        ax.set_xlabel("pipeline stages")
        ax.set_ylabel("MiB")
        ax.set_title(titles[m])
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    c = doc["config"]
    fig.suptitle(f"GPTlite {c['model_size']} (n_layer={c['n_layer']}, T={c['block_size']}) pipeline builds, "
                 f"per rank; dots = single ranks\n{machine_line(doc['machine'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parent(args):
    if max(args.stages) > args.n_layer:
        sys.exit(f"error: --n-layer {args.n_layer} must be >= the largest --stages {max(args.stages)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = []
    for stages in args.stages:
        for spec in [b == "spec" for b in args.builds]:
            t0 = time.perf_counter()
            results += common.launch_ranks("benchmark_memory.py", stages, args, worker=True, num_stages=stages,
                                           spec=spec, what=f"error: {stages} stages, {BUILDS[spec]} build")
            print(f"{stages} stage(s), {BUILDS[spec]} build: {time.perf_counter() - t0:.0f} s", flush=True)
    summary = summarize(results)
    doc = {"machine": machine_info(), "config": {k: getattr(args, k) for k in (
        "model_size", "n_layer", "block_size", "stages", "micro_batches", "micro_batch_size", "partition_method",
        "optimizer")}, "results": results, "summary": summary, "savings": savings(summary),
           "runtime_s": time.perf_counter() - start}
    plot(doc, out / "memory.png")
    text = report(doc)
    print()
    print(text)
    common.save(args, "memory", doc, [text])
    print(f"\nwrote {out / 'memory.json'}, {out / 'memory.png'}, {out / 'memory.txt'}")


def main(argv=None):
    args = parse_args(argv)
    worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    main()
