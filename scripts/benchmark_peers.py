"""Our schedules against PyTorch's own `torch.distributed.pipelining`, side by side: the whole training step.

    python scripts/benchmark_peers.py                          # deep model, m = 4 and 8, clipping off and on
    python scripts/benchmark_peers.py --model gptlite --micro-batches 4 --clip on

One launch per (micro-batch count, clipping) of `--stages` ranks (one thread each): every rank
builds, for each schedule, our DeepSpeed engine and PyTorch's PipelineStage(s) + schedule, on the
same layers (the same seeded weights, cut at the same layer bounds; PyTorch's with plain
torch.nn.Linear), the same micro-batches and the same optimizer (torch's fused AdamW with our
engine's hyper-parameters), then runs them in rounds, the order rotating every round; within a round
every run steps in turn, ours and PyTorch's of a schedule one after the other, so load from other
work hits both alike. Each step starts after a barrier; a step's time is its slowest rank's; ours /
PyTorch is the median of the ratios of steps that ran back to back.

Per step and rank:
- PyTorch: `schedule.step(...)` is the schedule span; after it, the clipping (off, or on: the
  global norm over every stage's parameters, each rank's sum of squares all-reduced over the
  pipeline group, as DeepSpeed computes it, then one fused scale), `optimizer.step()` and
  `optimizer.zero_grad()` are the time outside.
- Ours: `engine.train_batch(...)`; the span runs from its first point-to-point work (the receives
  posted when the step starts, PostReceives, as PyTorch's `schedule.step` posts its own inside its
  span) or instruction to the end of its last pass or point-to-point instruction; outside is the
  rest: before that (`train_batch`'s prologue: module.train(), timers, the schedule looked up), the
  step's ReduceTiedGrads / ReduceGrads / OptimizerStep instructions, and after the last one (the
  loss shared with every stage).
The first step's loss of both sides is printed too: the same weights and data must give the same
loss (a check that the two sides train the same thing).

`--device cuda`: one GPU per rank over NCCL (NCCL refuses two ranks on one device), the micro-batches
on the device for both sides. A step is timed from a device synchronize after the barrier to one
after the step, on both sides alike; inside the step nothing is synchronized (a synchronize per
instruction would stop our engine's host from running ahead of its kernels, and PyTorch's side has
no such points), so there span and outside are the host's dispatch times, the step time the
device's.
Writes JSON and text under --out; `--docs` publishes docs/bench/peers.json (and peers-gptlite.json)
and re-renders docs/benchmarks.md.
"""
import copy
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

# (ours, PyTorch's) per schedule both offer; PyTorch-only and ours-only rows are listed once
PAIRS = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}
TORCH_ONLY = {"interleaved-zb": "ScheduleInterleavedZeroBubble"}
# 1f1b-lean (registry.py): DeepSpeed's own TrainSchedule (1F1B) run by our split-backward engine (asynchronous
# sends, receives posted ahead, the lean step's end): what closing the stock engine's gap to PyTorch's 1F1B takes
STOCK_ON_OURS = "1f1b-lean"
OURS_ONLY = ("zb-h1", "zb-h2", "dualpipe", STOCK_ON_OURS)
STEP_OPS = ("ReduceTiedGrads", "ReduceGrads", "OptimizerStep")  # our instructions that are not the schedule
NESTED = ("ValidateStep", "Rollback")  # the post-validated step's records (schedules/runtime/interlock.py)


def parse_args(argv=None):
    p = common.parser(__doc__)
    common.add(p, "stages", "micro-batches")
    p.add_argument("--clip", choices=["off", "on", "both"], default="both",
                   help="gradient clipping at 1.0 (global norm over all stages) on both sides")
    return common.add(p, "schedules", "model", "model-size", "deep-width", "deep-depth", "micro-batch-size", "rounds",
                      "steps-per-round", "out", "docs", "timeout", "device", "partition-weights", "worker-out",
                      out="runs/peers", schedules=dict(help=f"default: {' '.join([*PAIRS, *TORCH_ONLY, *OURS_ONLY])}"),
                      micro_batch_size=dict(default=None, help="rows per micro-batch (default: 32 on the deep model, "
                                            "4 on GPTlite, whose logits over the 50257-token vocabulary take 51 MB "
                                            "per 4 x 64 tokens)"),
                      docs="peers[-gptlite]").parse_args(argv)


# --------------------------------------------------------------------------------------------
# Worker: one rank
# --------------------------------------------------------------------------------------------
class StepClock:
    """Stands in for a Tracer on our engine (the traced engine calls it around every instruction): when
    the schedule's instructions started and ended, and the time of the step's other instructions. Its
    clock never synchronizes a device (see the module's docstring)."""
    sync = memory = None
    active = True

    def __init__(self):
        self.reset()

    def reset(self):
        self.first = self.last = None
        self.ops = defaultdict(float)

    def now(self):
        return time.perf_counter()

    def live_bytes(self):
        return None

    def _schedule(self, start, end):
        self.first = start if self.first is None else min(self.first, start)
        self.last = end if self.last is None else max(self.last, end)

    def record(self, kind, chunk, buffer_id, start, end, pair=None, live=None):
        self._schedule(start, end)

    def record_p2p(self, name, start, end):
        self._schedule(start, end)

    def record_other(self, name, start, end):
        if name in NESTED:
            return  # inside OptimizerStep, or before the first instruction (then counted there)
        if name in STEP_OPS:
            self.ops[name] += end - start
            self.first = start if self.first is None else min(self.first, start)
        else:
            self._schedule(start, end)

    def next_pair(self):
        return 0


def full_layers(args):
    """The model's whole layer list, built as our pipeline builds it (same seeds, so the same weights)."""
    if args.model == "gptlite":
        import gptlite
        return gptlite.GPTlite(gptlite.MODEL_SIZES[args.model_size]).to_layers()
    import deep_model
    return deep_model.DeepModel(deep_model.DeepConfig(width=args.deep_width, depth=args.deep_depth)).to_layers()


def loss_fn(args):
    if args.model == "gptlite":
        from gptlite import CrossEntropyLoss_FlatView
        return CrossEntropyLoss_FlatView
    from deep_model import mse_loss
    return mse_loss


def plain(module):
    """`module` with our deferrable Linear layers turned back into torch.nn.Linear (PyTorch's side)."""
    import torch.nn as nn
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = nn.Linear
    return module


def build_ours(name, args, m, clip):
    import deep_model
    import gptlite
    import schedules
    pipe = dict(pipeline_num_stages=args.stages, pipeline_spec_layers=True, pipe_module=schedules.pipe_module(name))
    if args.model == "gptlite":
        model = gptlite.get_model(model_size=args.model_size, partition_weights=args.partition_weights, **pipe)
    else:
        model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, **pipe)
    cfg = common.engine_config(args.micro_batch_size, m, gradient_clipping=1.0 if clip else 0.0)
    engine, *_ = schedules.initialize(name, model=model, model_parameters=list(model.parameters()), config=cfg,
                                      trace=True)
    engine.tracer = StepClock()
    return engine


def torch_stage_ids(name, rank, p):
    """The global stages PyTorch's schedule `name` puts on `rank` (its own placement rules)."""
    if name == "1f1b":
        return [rank]
    if name in ("interleaved", "interleaved-zb"):
        return [rank, rank + p]  # loop placement, two stages per rank
    return [rank, 2 * p - 1 - rank]  # V placement


class TorchPipeline:
    """PyTorch's PipelineStage(s) and schedule for one of its schedules, on the same layers and cut as ours."""

    def __init__(self, name, args, m, layers, parts, device, optimizer_defaults, clip):
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining
        self.rank, p = dist.get_rank(), args.stages
        ids = torch_stage_ids(name, self.rank, p)
        nstages = p if name == "1f1b" else 2 * p
        bounds = parts[nstages]
        self.modules = [plain(torch.nn.Sequential(*copy.deepcopy(layers[bounds[s]:bounds[s + 1]]))).to(device)
                        for s in ids]
        stages = [pipelining.PipelineStage(mod, s, nstages, device) for mod, s in zip(self.modules, ids)]
        cls = getattr(pipelining, {**PAIRS, **TORCH_ONLY}[name])
        self.schedule = cls(stages[0] if name == "1f1b" else stages, n_microbatches=m, loss_fn=loss_fn(args))
        self.first, self.last = 0 in ids, nstages - 1 in ids
        self.params = [q for mod in self.modules for q in mod.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, **optimizer_defaults)
        self.clip = clip
        self.group = dist.group.WORLD

    def clip_grad_norm(self, max_norm=1.0):
        """The global gradient norm over every stage's parameters (each rank's sum of squares all-reduced,
        as DeepSpeed does), then one fused scale when it exceeds `max_norm`."""
        import torch
        import torch.distributed as dist
        grads = [q.grad for q in self.params if q.grad is not None]
        local = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        dist.all_reduce(local, group=self.group)
        coef = max_norm / (local.sqrt() + 1e-6)
        if coef < 1:
            torch._foreach_mul_(grads, coef)

    def step(self, x, y):
        """(seconds: schedule, clip, optimizer, zero_grad; loss or None)."""
        losses = []
        t0 = time.perf_counter()
        args = (x, ) if self.first else ()
        kwargs = dict(target=y, losses=losses) if self.last else {}
        self.schedule.step(*args, **kwargs)
        t1 = time.perf_counter()
        if self.clip:
            self.clip_grad_norm()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.optimizer.zero_grad()
        t4 = time.perf_counter()
        loss = float(sum(float(v) for v in losses) / len(losses)) if losses else None
        return {"span": t1 - t0, "clip": t2 - t1, "optimizer": t3 - t2, "zero_grad": t4 - t3}, loss


def worker(args):
    import torch
    import torch.distributed as dist
    from benchmark_schedules import synthetic_batches  # beside this script
    m, clip = args.micro_batches[0], args.clip == "on"
    torch.set_num_threads(1)
    rank, device, sync = common.init_rank(args.device)
    batches = synthetic_batches(args, m, device)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    ours_names = [n for n in args.schedules if n in PAIRS or n in OURS_ONLY]
    theirs_names = [n for n in args.schedules if n in PAIRS or n in TORCH_ONLY]
    ours = {n: build_ours(n, args, m, clip) for n in ours_names}
    parts = {}  # number of model stages -> layer bounds, as our modules cut them
    for engine in ours.values():
        bounds = list(engine.module.parts)
        if parts.setdefault(len(bounds) - 1, bounds) != bounds:
            raise SystemExit(f"two of our modules cut {len(bounds) - 1} stages differently")
    missing = {args.stages if n == "1f1b" else 2 * args.stages for n in theirs_names} - set(parts)
    if missing:
        raise SystemExit(f"no schedule of ours with {sorted(missing)} model stages to take the layer cut from")
    defaults = {k: v for k, v in next(iter(ours.values())).optimizer.param_groups[0].items()
                if k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "fused")}
    layers = full_layers(args)
    theirs = {n: TorchPipeline(n, args, m, layers, parts, device, defaults, clip) for n in theirs_names}
    # Runs grouped by schedule, ours beside PyTorch's, and every round steps each run once in turn,
    # steps_per_round times: the two sides of a schedule alternate step by step, so the i-th steps of
    # the two ran back to back, under the same load (compare() pairs them).
    groups = [[(side, n) for side, names in (("ours", ours_names), ("torch", theirs_names)) if n in names]
              for n in dict.fromkeys(ours_names + theirs_names)]
    steps = {f"{side}:{n}": [] for group in groups for side, n in group}
    first_loss = {}
    for r in range(args.rounds + 1):  # round 0 warms up (shapes, buffers, allocator)
        order = [run for group in common.rotated(groups, r) for run in group]
        for _ in range(args.steps_per_round):
            for side, n in order:
                key = f"{side}:{n}"
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                if side == "ours":
                    engine = ours[n]
                    engine.tracer.reset()
                    loss = float(engine.train_batch(iter(batches)))
                    sync()
                    dt = time.perf_counter() - t0
                    clock = engine.tracer
                    row = {"step": dt, "span": clock.last - clock.first, "before": clock.first - t0,
                           **{op: clock.ops.get(op, 0.0) for op in STEP_OPS}}
                    row["after"] = dt - row["before"] - row["span"] - sum(clock.ops.values())
                    loss = loss if engine.is_last_stage() else None
                else:
                    parts_s, loss = theirs[n].step(x, y)
                    sync()
                    dt = time.perf_counter() - t0
                    row = {"step": dt, **parts_s}
                first_loss.setdefault(key, loss)
                if r > 0:
                    steps[key].append(row)
    common.finish_rank(args, rank, {"rank": rank, "steps": steps, "first_loss": first_loss})


# --------------------------------------------------------------------------------------------
# Parent: launch, collect, compare
# --------------------------------------------------------------------------------------------
def launch_worker(args, m, clip):
    # DeepSpeed picks CUDA wherever it is installed: name the accelerator (--device cpu means it on a GPU machine)
    return common.launch_ranks("benchmark_peers.py", args.stages, args, env={"DS_ACCELERATOR": args.device},
                               micro_batches=[m], clip=clip)


def critical_schedule_extent(ranks_step):
    """One step's schedule over all ranks (each rank's row of that step): from the earliest rank's first
    instruction to the latest rank's last one, timed from the barrier before the step (PyTorch's side: its
    schedule.step() call, which starts at once)."""
    return (max(s.get("before", 0.0) + s["span"] for s in ranks_step)
            - min(s.get("before", 0.0) for s in ranks_step))


def analyse(ranks):
    """Per run ('ours:zb-v', 'torch:zb-v', ...): median step (slowest rank per step), and per rank the
    median span, outside time and its parts; the first step's loss."""
    rows = {}
    for key in ranks[0]["steps"]:
        per_rank = [r["steps"][key] for r in ranks]
        step = statistics.median(max(s["step"] for s in same) for same in zip(*per_rank))
        parts = [k for k in per_rank[0][0] if k not in ("step", "span")]
        rows[key] = row = {
            "step_s": step,
            "steps_s": [max(s["step"] for s in same) for same in zip(*per_rank)],  # slower rank's, step by step
            "span_s": [statistics.median(s["span"] for s in steps) for steps in per_rank],
            "outside_s": [statistics.median(s["step"] - s["span"] for s in steps) for steps in per_rank],
            # the step's time outside the schedule on its critical path, step by step: the slowest rank's step
            # less the schedule's extent over all ranks (from the first rank's start to the last one's end), so
            # the prologue before the first instruction and the tail after the last rank's schedule; a rank that
            # finished its schedule early and waits for another's (e.g. for the clipping norm) waits off that path
            "critical_outside_steps_s": [max(s["step"] for s in same) - critical_schedule_extent(same)
                                         for same in zip(*per_rank)],
            "outside_parts_s": [{k: statistics.median(s[k] for s in steps) for k in parts} for steps in per_rank],
            "first_loss": next((r["first_loss"][key] for r in ranks if r["first_loss"].get(key) is not None), None),
        }
        row["critical_outside_s"] = statistics.median(row["critical_outside_steps_s"])
    return rows


def compare(rows):
    """Per schedule both offer: our step / PyTorch's, the median of the ratios of steps that ran back to back;
    and our best against PyTorch's best."""
    out = {}
    for name in PAIRS:
        a, b = rows.get(f"ours:{name}"), rows.get(f"torch:{name}")
        if a and b:
            out[name] = {"ratio": statistics.median(x / y for x, y in zip(a["steps_s"], b["steps_s"])),
                         "outside_diff_s": max(a["outside_s"]) - max(b["outside_s"]),
                         # the critical path's time outside the schedule, ours over PyTorch's, step by step
                         "critical_outside_diff_s": statistics.median(
                             x - y for x, y in zip(a["critical_outside_steps_s"], b["critical_outside_steps_s"])),
                         "loss_diff": (abs(a["first_loss"] - b["first_loss"])
                                       if a["first_loss"] is not None and b["first_loss"] is not None else None)}
    best = {side: min(((k.split(":", 1)[1], r["step_s"]) for k, r in rows.items() if k.startswith(side + ":")),
                      key=lambda t: t[1], default=None) for side in ("ours", "torch")}
    if best["ours"] and best["torch"]:
        out["best"] = {"ours": best["ours"][0], "torch": best["torch"][0],
                       "speedup": best["torch"][1] / best["ours"][1] - 1}
    return out


def table(rows, cmp, m, clip):
    lines = [f"m = {m}, clipping {clip}: step = slowest rank's, median; span / outside per rank (ms)",
             f"{'run':26} {'step ms':>8} {'span ms':>13} {'outside ms':>13}  outside parts (rank 0)"]
    for key, r in rows.items():
        fmt = lambda xs: " ".join(f"{v * 1e3:6.1f}" for v in xs)  # noqa: E731
        parts = " ".join(f"{k} {v * 1e3:.1f}" for k, v in r["outside_parts_s"][0].items())
        lines.append(f"{key:26} {r['step_s'] * 1e3:8.1f} {fmt(r['span_s']):>13} {fmt(r['outside_s']):>13}  {parts}")
    for name, c in cmp.items():
        if name == "best":
            lines.append(f"best: ours {c['ours']} vs PyTorch {c['torch']}: ours {c['speedup']:+.1%} faster")
        else:
            loss = f", first losses differ by {c['loss_diff']:.1e}" if c["loss_diff"] is not None else ""
            lines.append(f"{name}: ours / PyTorch step {c['ratio']:.3f}, outside ours - PyTorch "
                         f"{c['outside_diff_s'] * 1e3:+.1f} ms (on the critical path, side by side "
                         f"{c['critical_outside_diff_s'] * 1e3:+.1f})"
                         f"{loss}")
    return lines


def main(argv=None):
    args = parse_args(argv)
    args.schedules = args.schedules or [*PAIRS, *TORCH_ONLY, *OURS_ONLY]
    args.micro_batch_size = args.micro_batch_size or (4 if args.model == "gptlite" else 32)
    if args.worker_out:
        return worker(args)
    import benchmark_schedules  # beside this script: the measured per-layer costs that balance GPTlite

    machine = common.machine("benchmark_peers", args)
    started = time.time()
    # other work on the machine slows both sides alike, but widens the spread: say how busy it was
    report = {"machine": machine, "args": vars(args), "runs": {}, "load_average": [os.getloadavg()[0]]}
    lines = [machine]
    if args.model == "gptlite":
        args.partition_weights = benchmark_schedules.gptlite_layer_costs(args)
    clips = ["off", "on"] if args.clip == "both" else [args.clip]
    for m in args.micro_batches:
        for clip in clips:
            rows = analyse(launch_worker(args, m, clip))
            cmp = compare(rows)
            report["runs"][f"m{m}-clip-{clip}"] = {"m": m, "clip": clip, "rows": rows, "compare": cmp}
            lines += table(rows, cmp, m, clip)
            print("\n".join(table(rows, cmp, m, clip)), flush=True)
    report["load_average"].append(os.getloadavg()[0])
    lines.append(f"took {time.time() - started:.0f} s; load average {report['load_average'][0]:.1f} at the start, "
                 f"{report['load_average'][1]:.1f} at the end")
    print(lines[-1])
    common.save(args, "peers" if args.model == "deep" else "peers-gptlite", report, lines)


if __name__ == "__main__":
    main()
