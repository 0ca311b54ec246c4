"""F, fused backward, and the split backward B + W, timed side by side on one pipeline stage's layers.

    python scripts/benchmark_split.py                        # GPTlite middle + last stage, deep model (~1 min)
    python scripts/benchmark_split.py --workloads deep --rounds 100 --threads 2

Per workload, one micro-batch through one stage's layers:
- F:  forward (for the last stage: through the loss),
- BW: fused backward, `out.backward(grad)` / `loss.backward()` with no deferral,
- B:  the same backward inside `defer_weight_grads()`: input gradients + non-linear parameters,
- W:  `apply_weight_grads(queue)`: the queued linear weight gradients.
Reports F : B : W (F = 1), BW / F and the split's overhead (B + W) / BW - 1 as medians with
interquartile ranges over rounds, and the FLOPs that FlopCounterMode counts for B, W and BW.
Writes split.json (raw times) and split.txt (the tables) to --out.
"""
import gc
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
from torch.utils.flop_counter import FlopCounterMode

import deep_model
import gptlite
from schedules.observe.memory import machine_info, machine_line
from schedules.runtime.weight_grad import apply_weight_grads, defer_weight_grads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

PHASES = ("F", "BW", "B", "W")
WORKLOADS = ("gpt-middle", "gpt-last", "deep")


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    common.add(p, "model-size", "stages", "micro-batch-size", "block-size", "deep-width",
               model_size=dict(help="gptlite.MODEL_SIZES key (default small)"),
               stages=dict(help="GPTlite stages: a stage holds n_layer // stages blocks"),
               micro_batch_size=dict(default=8, help="both models (ds_config.json's value)"),
               block_size=dict(default=64, help="GPTlite context length"))
    p.add_argument("--deep-blocks", type=int, default=4, help="DeepBlocks in the stage")
    common.add(p, "rounds", rounds=dict(default=30, help="at least this many measured rounds (each F, BW, B, W once)"))
    p.add_argument("--seconds", type=float, default=10,
                   help="and measure each workload for at least this long (more rounds for the fast ones)")
    common.add(p, "warmup")
    p.add_argument("--threads", type=int, default=1, help="torch threads (pipeline ranks here run 1)")
    return common.add(p, "out", "docs", out=dict(default=os.path.join(common.ROOT, "runs", "split"),
                                                 help="directory for split.json and split.txt"),
                      docs="split").parse_args(argv)


def make_workload(name, args):
    """(description, stage: x -> output or loss, input x, whether stage returns a loss).

    GPTlite: any K blocks cost the same, so gpt-middle takes the first K (a stage that holds only
    blocks); gpt-last adds what only the last stage has: final LayerNorm, head and loss."""
    torch.manual_seed(0)
    mb = args.micro_batch_size
    if name == "deep":
        stage = torch.nn.Sequential(*deep_model.DeepModel(deep_model.DeepConfig(
            width=args.deep_width, depth=args.deep_blocks)).to_layers())
        desc = f"{args.deep_blocks} DeepBlocks, width {args.deep_width}, micro-batch {mb}"
        return desc, stage, torch.randn(mb, args.deep_width, requires_grad=True), False
    config = replace(gptlite.MODEL_SIZES[args.model_size], block_size=args.block_size)
    model = gptlite.GPTlite(config)
    k = config.n_layer // args.stages
    desc = f"{k} Blocks of {args.model_size} (C={config.n_embd}), micro-batch {mb} x T={config.block_size}"
    x = torch.randn(mb, config.block_size, config.n_embd, requires_grad=True)  # activation from the previous stage
    if name == "gpt-middle":
        return desc, torch.nn.Sequential(*model.blocks[:k]), x, False
    layers = torch.nn.Sequential(*model.blocks[-k:], model.ln_f, model.lm_head)
    labels = torch.randint(config.vocab_size, (mb, config.block_size))
    loss = lambda x: gptlite.CrossEntropyLoss_FlatView(layers(x), labels)  # noqa: E731
    return desc + f" + LayerNorm + head (V={config.vocab_size}) + loss", loss, x, True


def backward_fn(stage, x, is_loss):
    """A fresh forward (not timed), and the backward to time: a middle stage's is driven by a
    random output gradient, as the next stage would send it; the last stage's by its loss."""
    x.grad = None  # a pipeline stage receives a fresh input per micro-batch
    out = stage(x)
    grad = None if is_loss else torch.randn_like(out)
    return lambda: out.backward(grad)


def timed(fn):
    """Seconds fn() took; what it returns (a forward's graph) is freed after the clock stops."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(stage, x, is_loss, rounds, warmup, seconds):
    """{phase: [seconds per round]} over at least `rounds` rounds and `seconds` seconds.

    Rounds run the units F, BW and (B then W) in rotating order, so drift on a noisy machine
    (other processes, clock changes) hits all phases alike. W follows its B at once (it needs
    B's queue), so it finds B's data in cache, which a real schedule's later W may not."""
    def unit_f():
        return {"F": timed(lambda: stage(x))}

    def unit_bw():
        return {"BW": timed(backward_fn(stage, x, is_loss))}

    def unit_split():
        backward = backward_fn(stage, x, is_loss)
        with defer_weight_grads() as queue:
            b = timed(backward)
        return {"B": b, "W": timed(lambda: apply_weight_grads(queue))}

    units, times = [unit_f, unit_bw, unit_split], {p: [] for p in PHASES}
    # A garbage collection inside a timed call would land on whichever phase it hit: collect
    # between rounds instead, and freeze what exists now (torch, deepspeed) so that is cheap.
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        r, start = 0, time.perf_counter()
        while r < warmup + rounds or time.perf_counter() - start < seconds:
            gc.collect()
            got = {}
            for unit in units[r % 3:] + units[:r % 3]:
                got.update(unit())
            if r >= warmup:
                for p in PHASES:
                    times[p].append(got[p])
            r += 1
    finally:
        gc.enable()
        gc.unfreeze()
    return times


def flops(stage, x, is_loss):
    """FLOPs FlopCounterMode counts (matmuls; on CPU not the fused attention kernel) per phase."""
    def count(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    out = {"F": count(lambda: stage(x)), "BW": count(backward_fn(stage, x, is_loss))}
    backward = backward_fn(stage, x, is_loss)
    with defer_weight_grads() as queue:
        out["B"] = count(backward)
    out["W"] = count(lambda: apply_weight_grads(queue))
    return out


def spread(values):
    """(median, 25th percentile, 75th percentile)."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def summarize(times):
    """Medians and IQRs of the times (ms) and of the per-round ratios (phases of one round are
    measured moments apart, so their ratio cancels slow drift better than a ratio of medians)."""
    t = {p: torch.tensor(times[p], dtype=torch.float64) for p in PHASES}
    ratios = {"B/F": t["B"] / t["F"], "W/F": t["W"] / t["F"], "BW/F": t["BW"] / t["F"],
              "overhead": (t["B"] + t["W"]) / t["BW"] - 1}
    return {"ms": {p: spread([v * 1e3 for v in times[p]]) for p in PHASES},
            "ratios": {k: spread(v.tolist()) for k, v in ratios.items()}}


def tables(results):
    fmt = lambda m, lo, hi, d=2: f"{m:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"  # noqa: E731
    lines = ["Time per micro-batch, ms: median [25th, 75th percentile]",
             f"{'workload':<11}{'rounds':>7}" + "".join(f"{p:>24}" for p in PHASES)]
    for name, r in results.items():
        ms = r["summary"]["ms"]
        lines.append(f"{name:<11}{len(r['times_s']['F']):>7}" + "".join(f"{fmt(*ms[p]):>24}" for p in PHASES))
    lines += ["", "Ratios of the phases of one round: median [25th, 75th percentile]",
              f"{'workload':<11}{'F : B : W':>17}{'B / F':>19}{'W / F':>19}{'BW / F':>19}{'(B+W)/BW - 1, %':>21}"]
    for name, r in results.items():
        q = r["summary"]["ratios"]
        fbw = f"1 : {q['B/F'][0]:.2f} : {q['W/F'][0]:.2f}"
        over = fmt(*(100 * v for v in q["overhead"]), d=1)
        cols = "".join(f"{fmt(*q[k]):>19}" for k in ("B/F", "W/F", "BW/F"))
        lines.append(f"{name:<11}{fbw:>17}{cols}{over:>21}")
    lines += ["", "FLOPs counted by FlopCounterMode, GFLOP (matmuls; not CPU fused attention, softmax, loss)",
              f"{'workload':<11}" + "".join(f"{p:>9}" for p in PHASES) + f"{'B / BW':>9}{'W / BW':>9}"]
    for name, r in results.items():
        fl = r["flops"]
        lines.append(f"{name:<11}" + "".join(f"{fl[p] / 1e9:>9.3f}" for p in PHASES) +
                     f"{fl['B'] / fl['BW']:>9.0%}{fl['W'] / fl['BW']:>9.0%}")
    lines += [""] + [f"{name:<11}{r['description']}" for name, r in results.items()]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.workloads:
        desc, stage, x, is_loss = make_workload(name, args)
        times = measure(stage, x, is_loss, args.rounds, args.warmup, args.seconds)
        results[name] = {"description": desc, "times_s": times, "summary": summarize(times),
                         "flops": flops(stage, x, is_loss)}
    elapsed = time.perf_counter() - start
    info = machine_info()
    text = (f"{tables(results)}\n\n{machine_line(info)}; {args.threads} thread(s), {args.warmup} warm-up "
            f"rounds discarded; took {elapsed:.0f} s")
    print(text)
    record = {"args": vars(args), "machine": info, "machine_line": machine_line(info), "elapsed_s": elapsed,
              "workloads": results}
    common.save(args, "split", record, [text])
    return record


if __name__ == "__main__":
    main()
