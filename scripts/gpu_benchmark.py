"""One prepared GPU run: GPTlite pipeline stages' F, B, W, BW, MFU, memory, and each schedule's predicted iteration.

    python scripts/gpu_benchmark.py                          # small, medium, gpt2 on cuda:0, under 5 minutes
    python scripts/gpu_benchmark.py --device cpu --dry-run   # the same logic on CPU, tiny size (the test)

Per model size, every distinct stage that the registered schedules' placements hold at p = 4 and 8
(p stages, 2p half-size chunks, or DualPipe's two full p-stage copies): the n_layer blocks split
as DeepSpeed's partition_uniform does (extra blocks to the first stages), the first stage adding
the embedding, the last LayerNorm + head + loss. One micro-batch per pass, timed with CUDA events,
each pass started on an idle device; medians over rounds that rotate F, BW, B+W as
scripts/benchmark_split.py does. Weights and activations are bf16, as DeepSpeed's bf16 mode holds
them (not autocast: the deferred-weight Linear's backward runs outside autocast and would multiply
a bf16 gradient by an fp32 weight). The simulator then predicts every schedule's iteration from
these costs and a p2p latency. Writes gpu_benchmark.json and .txt to --out. Without CUDA it says
so and exits 0 (2 with --require-gpu). With several GPUs it first runs the schedule benchmark
itself (scripts/benchmark_schedules.py --device cuda: every schedule trained side by side, one GPU
per rank over NCCL, measured bubbles against the simulator's, CUDA memory per step) on 2 or 4 of
them, within a share of the budget; the per-stage measurements then run on cuda:0 (cuda:1 times
the p2p copy).
"""
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

START = time.perf_counter()  # the budget counts imports and model builds too

import torch  # noqa: E402 (after START: the budget counts the import)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ROOT = Path(common.ROOT)

NO_GPU = "gpu_benchmark: no CUDA device here; run it on a GPU machine (see README); nothing measured"
PHASES = ("F", "B", "W", "BW")
DTYPE = torch.bfloat16  # weights and activations (see above)
ROLES = ("first", "middle", "last")
# Dense bf16 tensor-core peaks, TFLOP/s (datasheets); the first name found in the device name wins.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0))


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--sizes", nargs="+", default=["small", "medium", "gpt2"],
                   help="gptlite.MODEL_SIZES keys, in order (the last are skipped when the budget runs out)")
    p.add_argument("--ranks", nargs="+", type=int, default=[4, 8], help="pipeline ranks p to predict")
    p.add_argument("--m-per-rank", nargs="+", type=int, default=[2, 4], help="micro-batches m = k * p, per k")
    common.add(p, "micro-batch-size", "block-size", "rounds", "warmup", "device",
               micro_batch_size=dict(default=8, help="ds_config.json's value"),
               block_size=dict(help="context length (default: the size's own; gpt2: 1024)"),
               rounds=dict(default=50, help="measured rounds per stage (F, BW, B, W once each)"), warmup=5,
               device=dict(choices=["auto", "cuda", "cpu"], default="auto", help="cpu: to exercise the logic"))
    p.add_argument("--dry-run", action="store_true", help="tiny size, 2 rounds, micro-batch 2 x T=16")
    p.add_argument("--require-gpu", action="store_true", help="exit 2, not 0, where there is no CUDA device")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: from the GPU's name)")
    p.add_argument("--p2p-latency-us", type=float, help="cost of one p2p message (default: measured, see below)")
    p.add_argument("--p2p-overhead-us", type=float, default=15.0,
                   help="added to the measured activation copy: a send/recv's launch and handshake")
    p.add_argument("--budget-s", type=float, default=270, help="no new measurement after this many seconds")
    common.add(p, "out", out=dict(default=str(ROOT / "runs" / "gpu"), help="directory for gpu_benchmark.json, .txt"))
    args = p.parse_args(argv)
    if args.dry_run:
        args.sizes, args.rounds, args.warmup, args.micro_batch_size, args.block_size = ["tiny"], 2, 1, 2, 16
    return args


def chunks(spec, p, n_layer):
    """(rank, chunk, 'role-blocks') of every chunk a schedule's placement puts on p ranks."""
    place, out = spec.placement(p), []
    for r in range(p):
        for c in range(place.chunks):
            n, s = place.num_stages, place.stage(r, c)  # stage s of a model (copy) cut into n stages
            role = ROLES[0] if s == 0 else ROLES[2] if s == n - 1 else ROLES[1]
            out.append((r, c, f"{role}-{n_layer // n + (s < n_layer % n)}"))
    return out


def build_stage(model, key, args, device):
    """(stage: x -> output or loss, input x, whether it returns a loss): a bf16 copy on `device`."""
    role, blocks = key.split("-")
    cfg, mb = model.config, args.micro_batch_size
    mods = [model.emb] * (role == "first") + list(model.blocks[:int(blocks)])  # any k blocks cost the same
    mods += [model.ln_f, model.lm_head] * (role == "last")
    layers = copy.deepcopy(torch.nn.Sequential(*mods)).to(device=device, dtype=DTYPE)
    if role == "first":
        x = torch.randint(cfg.vocab_size, (mb, cfg.block_size), device=device)
    else:  # the activation the previous stage sends
        x = torch.randn(mb, cfg.block_size, cfg.n_embd, device=device, dtype=DTYPE, requires_grad=True)
    if role != "last":
        return layers, x, False
    labels = torch.randint(cfg.vocab_size, (mb, cfg.block_size), device=device)
    return (lambda x: gptlite.CrossEntropyLoss_FlatView(layers(x), labels)), x, True


def make_clock(device):
    """fn -> seconds: CUDA events on a GPU (the CPU returns before the kernels end), else the wall clock."""
    if device.type != "cuda":
        return bench.timed

    def clock(fn):
        torch.cuda.synchronize(device)  # start idle, so no kernel queued earlier is counted in this pass
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return clock


def measure(stage, x, is_loss, args, clock, deadline):
    """{phase: [seconds per round]}: benchmark_split.measure's rotation of F, BW and B then W, but
    timed by `clock`, and cut short at the deadline (keeping at least one measured round)."""
    def unit_split():
        backward = bench.backward_fn(stage, x, is_loss)
        with defer_weight_grads() as queue:
            b = clock(backward)
        return {"B": b, "W": clock(lambda: apply_weight_grads(queue))}

    units = [lambda: {"F": clock(lambda: stage(x))},
             lambda: {"BW": clock(bench.backward_fn(stage, x, is_loss))}, unit_split]
    times = {k: [] for k in PHASES}
    gc.collect()
    gc.disable()  # a collection inside a timed pass would land on whichever pass it hit
    try:
        for r in range(args.warmup + args.rounds):
            if r > args.warmup and time.perf_counter() > deadline:
                break
            gc.collect()
            got = {}
            for unit in units[r % 3:] + units[:r % 3]:
                got.update(unit())
            for k in PHASES if r >= args.warmup else ():
                times[k].append(got[k])
    finally:
        gc.enable()
    return times


def measure_stage(model, key, args, device, peak_flops, deadline):
    if key == "middle-0":  # more stages than blocks: an empty stage costs nothing
        return {"s": dict.fromkeys(PHASES, 0.0), "empty": True}
    cuda = device.type == "cuda"
    if cuda:  # peak memory of this stage alone: its weights, gradients and one micro-batch's activations
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    stage, x, is_loss = build_stage(model, key, args, device)
    times = measure(stage, x, is_loss, args, make_clock(device), deadline)
    fl = bench.flops(stage, x, is_loss)  # matmuls (and on GPU the fused attention) FlopCounterMode counts
    med = {k: statistics.median(v) for k, v in times.items()}
    mfu = {k: fl[k] / med[k] / peak_flops if med[k] else 0.0 for k in PHASES} if peak_flops else None
    if mfu:
        mfu["F+BW"] = (fl["F"] + fl["BW"]) / (med["F"] + med["BW"]) / peak_flops
    return {"s": med, "rounds": len(times["F"]), "times_s": times, "flops": fl, "mfu": mfu,
            "split_overhead": statistics.median((b + w) / bw - 1  # per round: phases moments apart
                                                for b, w, bw in zip(times["B"], times["W"], times["BW"])),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def p2p_latency(cfg, args, device):
    """(seconds per p2p message, how it was found): one activation copied, plus a fixed overhead."""
    if args.p2p_latency_us is not None:
        return args.p2p_latency_us * 1e-6, "--p2p-latency-us"
    two = device.type == "cuda" and torch.cuda.device_count() > 1
    dst = torch.device("cuda", 1) if two else device
    src = torch.randn(args.micro_batch_size, cfg.block_size, cfg.n_embd, device=device, dtype=DTYPE)

    def sync():  # wall clock, not events: a copy between GPUs involves both, an event belongs to one
        for d in {device, dst} if device.type == "cuda" else ():
            torch.cuda.synchronize(d)

    copies = []
    for _ in range(23):
        sync()
        copies.append(bench.timed(lambda: (src.to(dst, copy=True), sync())))
    copy_s = statistics.median(copies[3:])  # after 3 warm-up copies
    where = f"{device} -> {dst}" if two else f"within {device}, a lower bound for a link"
    return (copy_s + args.p2p_overhead_us * 1e-6,
            f"{src.numel() * src.element_size() / 2**20:.1f} MiB copy {where}: {copy_s * 1e6:.0f} us "
            f"+ {args.p2p_overhead_us:g} us")


def predict(schedules, stages, n_layer, args, latency):
    """{'p4_m8': {schedule: {iteration_s, bubble} or {error}}}, the simulator run on the measured costs."""
    out = {}
    for p in args.ranks:
        for k in args.m_per_rank:
            row = out[f"p{p}_m{k * p}"] = {}
            for name, spec in schedules.items():
                costs = {(r, c): stages[key]["s"] for r, c, key in chunks(spec, p, n_layer)}
                try:
                    res = simulate(name, p, k * p, costs=costs, latency=latency, iterations=1)
                except (ValueError, ScheduleError) as e:  # its constraints reject this (p, m)
                    row[name] = {"error": str(e).splitlines()[0]}
                    continue
                busy = sum(r["busy"] for r in res.per_rank)  # bubble: the idle share of all ranks' time
                row[name] = {"iteration_s": res.makespan, "bubble": 1 - busy / (p * res.makespan)}
    return out


def size_text(size, r):
    lines = [f"== {size}: {r['description']}; p2p {r['p2p_latency_s'] * 1e6:.0f} us ({r['p2p_source']})",
             f"{'stage':<10}" + "".join(f"{k + ' ms':>9}" for k in PHASES) + f"{'(B+W)/BW-1':>11}"
             f"{'MFU F':>7}{'MFU BW':>7}{'peak MiB':>9}"]
    for key, s in r["stages"].items():
        if s.get("empty"):
            lines.append(f"{key:<10}  (no blocks: costs 0)")
            continue
        mfu, mem = s["mfu"], s["peak_memory_bytes"]
        cells = [f"{s['s'][k] * 1e3:>9.3f}" for k in PHASES] + [f"{s['split_overhead']:>11.1%}"]
        cells += [f"{mfu[k]:>7.1%}" if mfu else f"{'-':>7}" for k in ("F", "BW")]
        lines.append(f"{key:<10}" + "".join(cells) + (f"{mem / 2**20:>9.0f}" if mem else f"{'-':>9}"))
    if "predictions" not in r:
        return lines + [f"predictions skipped: {r['skipped']}"]
    lines += ["predicted iteration, ms (bubble: idle share of all ranks' time)",
              f"{'schedule':<22}" + "".join(f"{c.replace('_', ' '):>17}" for c in r["predictions"])]
    errors = []
    for name in next(iter(r["predictions"].values())):
        got = [(c, row[name]) for c, row in r["predictions"].items()]
        errors += [f"  {name} {c}: {g['error']}" for c, g in got if "error" in g]
        lines.append(f"{name:<22}" + "".join(f"{'rejected':>17}" if "error" in g else
                                             f"{g['iteration_s'] * 1e3:>10.2f} ({g['bubble']:>3.0%})" for _, g in got))
    return lines + errors


# The distributed part: the deep benchmark model sized for a GPU (16 x Linear 4096 on 256 rows: per
# stage of 2, ~1.5 ms per forward in fp32; each schedule's engine holds its own copy of the model
# with AdamW state, ~2 GiB per rank), 2 micro-batches per rank, few rounds: about a minute.
DISTRIBUTED_SHARE = 0.5  # of the budget, at most
DISTRIBUTED_FLAGS = ["--what", "throughput", "--deep-width", "4096", "--deep-depth", "16", "--micro-batch-size",
                     "256", "--rounds", "3", "--steps-per-round", "2"]


def run_distributed(args, n, deadline):
    """With several GPUs: scripts/benchmark_schedules.py --device cuda on 2 or 4 of them; its JSON
    and text, or {'error': why}."""
    import subprocess
    stages = 4 if n >= 4 else 2
    out = Path(args.out) / "schedules"
    timeout = max(30.0, deadline - time.perf_counter())
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark_schedules.py"), "--device", "cuda", "--stages",
           str(stages), "--micro-batches", str(2 * stages), *DISTRIBUTED_FLAGS, "--out", str(out),
           "--timeout", str(int(timeout))]
    record = {"stages": stages, "command": " ".join(cmd[1:])}
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return {**record, "error": f"the schedule benchmark did not finish within {timeout:.0f} s"}
    if done.returncode != 0:
        return {**record, "error": "the schedule benchmark failed: " + done.stderr.strip()[-1500:]}
    report = json.loads((out / "throughput.json").read_text())
    return {**record, "lines": (out / "throughput.txt").read_text().splitlines(), **report}


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available() and (args.device != "cpu" or args.require_gpu):
        print(NO_GPU)
        return 2 if args.require_gpu else 0
    global bench, gptlite, defer_weight_grads, apply_weight_grads, simulate, ScheduleError
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs on import; stdout keeps the tables
        import benchmark_split as bench

        import gptlite
        from schedules.errors import ScheduleError
        from schedules.observe.memory import machine_info
        from schedules.registry import available_schedules
        from schedules.runtime.weight_grad import apply_weight_grads, defer_weight_grads
        from schedules.simulator.simulate import simulate
    device = torch.device("cpu" if args.device == "cpu" else "cuda", 0)
    info, notes, n = machine_info(), [], torch.cuda.device_count() if device.type == "cuda" else 0
    info.update(cuda=torch.version.cuda, gpu_count=n, gpus=[{"name": torch.cuda.get_device_name(i), "memory_bytes":
                                                             torch.cuda.get_device_properties(i).total_memory}
                                                            for i in range(n)])
    distributed = run_distributed(args, n, START + args.budget_s * DISTRIBUTED_SHARE) if n > 1 else None
    if distributed is not None:
        notes.append(f"{n} GPUs: schedules trained on {distributed.get('stages')} of them: "
                     + ("see 'distributed'" if "error" not in distributed else distributed["error"]))
    name = info["gpus"][0]["name"] if n else info["cpu"]
    table = next((tf for key, tf in PEAK_BF16_TFLOPS if key in name), None)
    peak_tf = args.peak_tflops or table
    peak_src = "--peak-tflops" if args.peak_tflops else f"bf16 table: {name}" if table else "unknown: no MFU"
    schedules, deadline = available_schedules(), START + args.budget_s
    sizes, skipped = {}, []
    for size in args.sizes:
        if time.perf_counter() > deadline:
            skipped.append(size)
            continue
        cfg = replace(gptlite.MODEL_SIZES[size], block_size=args.block_size or gptlite.MODEL_SIZES[size].block_size,
                      head=gptlite.fastest_head(device.type))  # the head train.py's --head auto runs here
        torch.manual_seed(0)
        model = gptlite.GPTlite(cfg)
        needed = {key for p in args.ranks for spec in schedules.values() for *_, key in chunks(spec, p, cfg.n_layer)}
        needed = sorted(needed, key=lambda k: (ROLES.index(k.split("-")[0]), -int(k.split("-")[1])))
        stages = {}
        for key in needed:
            if time.perf_counter() > deadline:
                break
            stages[key] = measure_stage(model, key, args, device, peak_tf and peak_tf * 1e12, deadline)
            print(f"gpu_benchmark: {size} {key} measured at {time.perf_counter() - START:.0f} s", file=sys.stderr)
        latency, source = p2p_latency(cfg, args, device)
        r = sizes[size] = {"config": asdict(cfg), "p2p_latency_s": latency, "p2p_source": source, "stages": stages,
                           "description": f"{cfg.n_layer} blocks x C={cfg.n_embd}, {cfg.n_head} heads, "
                                          f"T={cfg.block_size}, V={cfg.vocab_size}, micro-batch "
                                          f"{args.micro_batch_size}, {cfg.head} head, bf16 weights on {device}"}
        if len(stages) < len(needed):
            r["skipped"] = f"time budget ran out after {len(stages)} of {len(needed)} stages"
        else:
            r["predictions"] = predict(schedules, stages, cfg.n_layer, args, latency)
        del model
    if skipped:
        notes.append(f"time budget ({args.budget_s:g} s) ran out: skipped sizes {', '.join(skipped)}")
    wall = time.perf_counter() - START
    gpus = f"{name} x{n}" if n else "no GPU"
    head = [f"gpu_benchmark on {device} ({gpus}), torch {info['torch']}, CUDA {info['cuda']}, deepspeed "
            f"{info['deepspeed']}; peak {peak_tf or '-'} TFLOP/s ({peak_src}); {args.rounds} rounds; "
            f"took {wall:.0f} s",
            "stage key: role-blocks (first adds the embedding, last LayerNorm + head + loss)", *notes]
    text = "\n".join(head + (["", *distributed["lines"]] if distributed and "lines" in distributed else [])
                     + sum((["", *size_text(s, r)] for s, r in sizes.items()), []))
    print(text)
    record = {"args": vars(args), "machine": info, "device": str(device), "dtype": "bf16", "peak_tflops": peak_tf,
              "peak_source": peak_src, "notes": notes, "skipped_sizes": skipped, "sizes": sizes, "wall_s": wall,
              "distributed": distributed}
    common.save(args, "gpu_benchmark", record, [text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
