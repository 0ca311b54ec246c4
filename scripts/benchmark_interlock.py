"""Interlocked against synchronised steps of the same schedule: measured bubble and speed-up, held against the
simulator's interlocked prediction from the run's own costs; the rollback rate and cost of post-validation.

    python scripts/benchmark_interlock.py                      # 2 ranks, deep model, m = 4 and 8
    python scripts/benchmark_interlock.py --docs               # also docs/bench/interlock.json, docs/benchmarks.md
    python scripts/benchmark_interlock.py --stages 4 --micro-batches 8 16 --deep-width 16 --pass-ms 2.5 2.5 2.5 \
        --iterations 8 --docs                      # passes of set times (docs/bench/interlock-timed-p4.json)
    python scripts/benchmark_interlock.py --micro-batches 4 8 --deep-width 16 --pass-ms 2.5 2.5 2.5 \
        --iterations 10 --rounds 12 --clipping-off --docs   # p = 2, the issue's criteria (...-timed-p2-clipping-off)

`--pass-ms F B W` builds the deep model of `TimedBlock`s (deep_model.py): each block's forward, input gradient and
weight gradient sleep F, B and W ms around their (small, real) arithmetic. The ranks then sleep rather than compute,
so more stages than the machine has cores run as they would on a device each, with pass costs that are set rather
than drifting: what the engine makes of the interlocked order, at p where the order's gain is large.

For each micro-batch count, ONE launch of p ranks (one thread each) builds an engine per schedule (ZeRO 0, or
`--zero 1`; fp32, or `--bf16`; fused AdamW) and runs, in rounds with the order rotating:
- `sync`: K steps, a barrier before each (what a synchronising step end does: every stage starts together);
- `interlocked`: one `train_batches(iterations=K)` call, clipping off (nothing to validate);
- `clipped-ahead`, `clipped-wait`, `clipped-auto`, `clipped-speculate` (schedules whose engine post-validates):
  the same call with clipping at a threshold between the norms the steps have (the median of K synchronised
  steps' global norms, measured again each round before the clipped calls), under each post-validation policy
  (`engine.post_validation`): stepping ahead of the model's norm (so that some steps roll back), waiting for it,
  choosing per rank by the measured costs, and speculating past it (the next step's passes before the norm; a
  step that clips is redone and the next replayed);
- `never-wait`, `never-speculate`, `never-auto`: clipping on far above every norm (nothing clips, every step is
  validated): what waiting for the norm costs, what speculating past it saves where clipping does not bite, and
  which of the two `auto` picks (its speculation vote: the slowest rank's wait against a backup).
Every step is traced. Measured: the synchronised step (per step the slowest rank's time after the barrier, its
ReduceGrads and optimizer step included as in the predicted makespan; the mean over steps 2 to K-1, those the
interlocked period spans) and its bubble per rank (1 - busy / those steps' time, as the predicted makespan counts
it); the interlocked period (per rank, the time between the ends
of its passes of steps 1 and K-1, divided by K-2; the largest) and its bubble per rank (1 - busy per step / period).
The overlap of the ranks' compute (`contention`) tells whether sharing the machine's cores slows the interlocked
passes, and the cores in use on average (every rank's CPU time over the run's time) how close the ranks come to
waiting for a core. Predicted, each run from its own traced costs (pass times, a message's latency as traced, the
send / receive time on their rank, each receive paired with its send by the schedule's own streams, the engine's
time between instructions, and each rank's optimizer step as traced): the synchronised
makespan from the synchronised run's, the interlocked period and bubbles (simulate(..., iterations=K)) from the
interlocked run's, and the speed-up makespan / period; beside it ("order") the period predicted from the
synchronised run's costs too, the gain of the interlocked order alone; the never-wait and never-speculate runs, and
the speculating runs where clipping bites (the steps they replayed run twice: simulate(replayed=...)). Replayed:
the interlocked run predicted from each traced pass's own duration instead of the mean of its kind
(trace.replayed_costs), over the measured window.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "zb-v"]
# clipping on, per post-validation policy: at the median norm ("clipped-", about half the steps clip), and far
# above every norm ("never-": nothing clips, yet every step is validated)
CLIPPED = ["clipped-ahead", "clipped-wait", "clipped-auto", "clipped-speculate", "never-wait", "never-speculate",
           "never-auto"]
NEVER = 1e30  # the clipping threshold of the never- runs
COUNTERS = ("rollbacks", "waited", "replays", "speculated", "validations")  # post-validation's, per call and rank


def policy_key(mode):
    """The key of a clipped run's figures: its policy, prefixed by `never-` where nothing clips."""
    return mode[len("clipped-"):] if mode.startswith("clipped-") else mode


def parse_args(argv=None):
    p = common.parser(__doc__)
    common.add(p, "stages", "micro-batches", "schedules", "deep-width", "deep-depth", "micro-batch-size",
               schedules=SCHEDULES)
    p.add_argument("--pass-ms", type=float, nargs=3, default=None, metavar=("F", "B", "W"),
                   help="blocks whose forward, input gradient and weight gradient take these ms "
                        "(deep_model.TimedBlock)")
    p.add_argument("--iterations", type=int, default=6, help="steps per interlocked call (K)")
    common.add(p, "rounds", rounds=3)
    p.add_argument("--zero", type=int, choices=[0, 1], default=0,
                   help="ZeRO stage: at 1 the step is DeepSpeed's ZeRO-1 optimizer's, whose norm is validated even "
                        "with clipping off (it skips a non-finite step)")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 weights and activations, DeepSpeed's BF16 optimizer (fp32 gradients at ZeRO 1, as "
                        "train.py --bf16; bf16 ones at ZeRO 0): its norm is validated even with clipping off")
    p.add_argument("--clipping-off", action="store_true",
                   help="only the synchronised and interlocked runs (clipping off): many rounds cheaply, for a "
                        "speed-up paired round by round (docs/bench/interlock[-timed-pP]-clipping-off.json)")
    return common.add(p, "out", "docs", "timeout", "worker-out", out="runs/interlock",
                      docs="interlock[-timed-pP][-zero1][-bf16][-clipping-off]").parse_args(argv)


# --------------------------------------------------------------------------------------------
# Worker: one rank
# --------------------------------------------------------------------------------------------
def build_engine(name, args, m):
    import deep_model
    import schedules
    seconds = tuple(t / 1e3 for t in args.pass_ms) if args.pass_ms else None
    model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, pipeline_num_stages=args.stages,
                                 pipeline_spec_layers=True, pipe_module=schedules.pipe_module(name, None),
                                 pass_seconds=seconds)
    cfg = common.engine_config(args.micro_batch_size, m, gradient_clipping=0.0,
                               zero_optimization={"stage": args.zero})
    if args.bf16:  # DeepSpeed accumulates bf16 weights' gradients in fp32 at ZeRO 1 only
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32" if args.zero else "bf16"})
    engine, *_ = schedules.initialize(name, model=model, model_parameters=list(model.parameters()), config=cfg,
                                      trace=True)
    return engine


def worker(args):
    import torch
    import torch.distributed as dist

    from deep_model import synthetic_micro_batch
    from schedules.observe.trace import Tracer, engine_placement
    from schedules.runtime.interlock import train_batches

    rank, _, _ = common.init_rank()
    torch.set_num_threads(1)
    m, k = args.micro_batches[0], args.iterations
    batches = [synthetic_micro_batch(i, args.micro_batch_size, args.deep_width, 0) for i in range(m * k)]
    if args.bf16:
        batches = [(x.bfloat16(), y.bfloat16()) for x, y in batches]
    engines = {name: build_engine(name, args, m) for name in args.schedules}
    for engine in engines.values():
        engine.tracer = Tracer(engine.stage_id, engine_placement(engine))
    message = args.micro_batch_size * args.deep_width * (2 if args.bf16 else 4)  # an activation's bytes
    latency = common.ping_pong_latency(rank, message)
    modes = {name: ["sync", "interlocked"] + (CLIPPED if hasattr(engines[name], "post_validates")
                                              and not args.clipping_off else [])
             for name in args.schedules}
    runs = {name: {mode: [] for mode in modes[name]} for name in args.schedules}  # per round: step times
    thresholds = {}
    dist.barrier()
    origin = time.perf_counter()
    for engine in engines.values():
        engine.tracer.origin = origin
    for r in range(args.rounds + 1):  # round 0 warms up (and measures the norms the clipping threshold sits in)
        for name in common.rotated(args.schedules, r):
            engine = engines[name]
            # synchronised first in even rounds, interlocked first in odd ones: a drift of the passes' speed
            # within a round favours neither (the clipped runs follow, after the threshold is measured)
            paired = ["sync", "interlocked"] if r % 2 == 0 else ["interlocked", "sync"]
            for mode in paired + modes[name][2:]:
                clipped = mode in CLIPPED
                threshold = NEVER if mode.startswith("never-") else thresholds.get(name, 0.0)
                set_clipping(engine, threshold if clipped else 0.0)
                if hasattr(engine, "post_validation"):  # (clipping off, only a ZeRO-1 step validates: auto)
                    engine.post_validation = mode.split("-")[1] if clipped else "auto"
                tracer = engine.tracer
                tracer.start_iteration(0)
                tracer.passes, tracer.p2p, tracer.other = [], [], []
                dist.barrier()
                cpu0, wall0 = time.process_time(), time.perf_counter()  # this process's CPU time, all its threads
                if mode == "sync":
                    times = []
                    for s in range(k):
                        if s:
                            tracer.start_iteration(s)
                        dist.barrier()
                        t0 = time.perf_counter()
                        engine.train_batch(iter(batches[s * m:(s + 1) * m]))
                        times.append(time.perf_counter() - t0)
                else:
                    before = {c: getattr(engine, c, 0) for c in COUNTERS}
                    t0 = time.perf_counter()
                    train_batches(engine, iter(batches), iterations=k)
                    times = [time.perf_counter() - t0]
                tracer.stop()
                record = {"times": times, "passes": [p.__dict__ for p in tracer.passes], "p2p": tracer.p2p,
                          "other": tracer.other, "cpu_s": time.process_time() - cpu0,
                          "wall_s": time.perf_counter() - wall0}
                if mode != "sync" and hasattr(engine, "validations"):  # what post-validation did in the call
                    record.update({c: getattr(engine, c) - before[c] for c in COUNTERS})
                if r > 0:
                    record["threshold"] = threshold if clipped else thresholds.get(name)
                    runs[name][mode].append(record)
                if mode == "interlocked" and hasattr(engine, "post_validates"):
                    # every round: training moves the norms, and a threshold from the first round soon clips nothing
                    thresholds[name] = _median_norm(engine, batches, m, k)
    common.finish_rank(args, rank, {"rank": rank, "latency_s": latency, "runs": runs, "thresholds": thresholds})


def set_clipping(engine, threshold):
    """Clip at `threshold` from the next step on: the engine's config, and DeepSpeed's ZeRO and BF16 optimizers'
    own copy of it (`clip_grad`, taken from the config when they were built)."""
    engine._config.gradient_clipping = threshold
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = threshold


def _median_norm(engine, batches, m, k):
    """The median global gradient norm of K synchronised steps (clipping far above it): the threshold at which
    about half the steps clip."""
    set_clipping(engine, 1e30)
    norms = []
    for s in range(k):
        engine.train_batch(iter(batches[s * m:(s + 1) * m]))
        norms.append(float(engine._global_grad_norm))
    set_clipping(engine, 0.0)
    return statistics.median(norms)


# --------------------------------------------------------------------------------------------
# Parent: launch, analyse against the simulator
# --------------------------------------------------------------------------------------------
def launch_worker(args, m):
    return common.launch_ranks("benchmark_interlock.py", args.stages, args, micro_batches=[m])


def _timeline(ranks, name, mode, i, m, args):
    from schedules.simulator.timeline import Pass, Timeline
    return Timeline([[Pass(**p) for p in r["runs"][name][mode][i]["passes"]] for r in ranks], "s",
                    {"schedule": name, "stages": args.stages, "micro_batches": m})


def _period(timeline, k):
    """Steady-state seconds per step of an interlocked call: per rank, from the end of its step 1 to the end of
    its step K-1, over K-2 steps; the largest over ranks."""
    periods = []
    for r, row in enumerate(timeline.ranks):
        ends = {}
        for p in row:
            ends[p.iteration] = max(ends.get(p.iteration, 0.0), p.end)
        periods.append((ends[k - 1] - ends[1]) / (k - 2))
    return max(periods)


def _busy_per_step(timeline, rank, steps):
    return sum(p.duration for p in timeline.ranks[rank] if p.iteration in steps) / len(steps)


COMPUTE = ("ReduceGrads", "ReduceTiedGrads", "OptimizerStep")  # traced step work that computes besides the passes


def _overlaps(ranks, name, mode, i, timeline):
    """Each pass of run `mode` of round i as (rank, kind, chunk, seconds, the fraction of it during which the
    other rank computed: a pass or its step's work)."""
    busy = []
    for r, row in enumerate(timeline.ranks):
        spans = [(p.start, p.end) for p in row]
        spans += [(s, e) for n, s, e, _ in ranks[r]["runs"][name][mode][i]["other"] if n in COMPUTE]
        busy.append(spans)
    out = []
    for r, row in enumerate(timeline.ranks):
        others = [span for q, spans in enumerate(busy) if q != r for span in spans]
        for p in row:
            shared = sum(max(0.0, min(p.end, e) - max(p.start, s)) for s, e in others if s < p.end and e > p.start)
            out.append((r, p.kind, p.chunk, p.duration, min(1.0, shared / p.duration) if p.duration > 0 else 0.0))
    return out


def cores_in_use(ranks, name, mode, rounds):
    """The machine's cores the run kept busy on average: every rank's CPU time (all its threads) over the run's
    wall time (the slowest rank's), median over rounds; None for runs recorded without it. Near the machine's
    core count, a rank that wakes (a message in, a sleep over) waits for a core: delays no model of the
    schedule has."""
    runs = [[r["runs"][name][mode][i] for r in ranks] for i in range(rounds)]
    if any("cpu_s" not in run for per_round in runs for run in per_round):
        return None
    return statistics.median(sum(run["cpu_s"] for run in per_round) / max(run["wall_s"] for run in per_round)
                             for per_round in runs)


def contention(passes_by_mode):
    """Whether the two modes share the machine's cores differently: per mode, the time-weighted share of pass time
    during which another rank computed; and `cost_ratio_measured`, the pass time interlocked over synchronised (the
    mean times of each (rank, kind, chunk), summed). With equal shares, contention slows both modes alike, and a
    pass-time ratio away from 1 is the passes' own drift between the runs."""
    overlap = {mode: sum(d * x for *_, d, x in passes) / sum(d for *_, d, _x in passes)
               for mode, passes in passes_by_mode.items()}
    means = {}
    for mode, passes in passes_by_mode.items():
        durations = {}
        for r, kind, chunk, d, _ in passes:
            durations.setdefault((r, kind, chunk), []).append(d)
        means[mode] = {key: statistics.fmean(v) for key, v in durations.items()}
    sync, inter = means["sync"], means["interlocked"]
    shared = sorted(set(sync) & set(inter))  # in one order: the sums are the same in every process
    measured = sum(inter[key] for key in shared) / sum(sync[key] for key in shared) if shared else None
    return {"overlap": overlap, "cost_ratio_measured": measured}


def _p2p_costs(spec, ranks, name, mode, i, ping_pong, messages):
    """(latency, (send, receive)) of run `mode` of round i as traced: a message's latency (trace.measured_latency:
    what ranks sharing the machine's cores add to a ping-pong's) and the send / receive time on its rank. For
    blocking sends, whose end is the receive's, the ping-pong's latency and no such time."""
    from schedules.observe.trace import measured_latency, measured_p2p_cpu
    if not spec.placement.async_sends:
        return ping_pong, (0.0, 0.0)
    p2p = [r["runs"][name][mode][i]["p2p"] for r in ranks]
    cpu = measured_p2p_cpu(p2p, messages)
    traced = measured_latency(p2p, messages, cpu[1])
    return (ping_pong if traced is None else traced), cpu


def _step_costs(ranks, name, mode, i, runs, validation=None):
    """{rank: seconds of its step, per step} as traced in run `mode` of round i: its ReduceGrads and OptimizerStep
    (a speculating rank validates inside the latter, a redone step's rollback included). With validation 'wait' a
    pair (before the norm, after): the step is taken in the validation at the next stream's start, once the norm
    is in (ValidateStep less NormWait). Per run of a step's stream (`runs` of them: a replayed step's two runs
    take one each)."""
    costs = {}
    for rank, r in enumerate(ranks):
        other = r["runs"][name][mode][i]["other"]
        per_step = lambda names: sum(e - s for n, s, e, _ in other if n in names) / runs  # noqa: E731
        step = per_step(("ReduceGrads", "ReduceTiedGrads", "OptimizerStep"))
        costs[rank] = (step, per_step(("ValidateStep", )) - per_step(("NormWait", ))) if validation == "wait" else step
    return costs


def validation_of(ranks, name, mode, i):
    """How run `mode` of round i validated its steps, as the simulator models it: None where nothing was validated
    (ZeRO 0 in fp32 with clipping off; runs recorded without counters) or most steps were speculated past; 'wait'
    where most waited for the model's norm before the next stream; else 'ahead' (stepped before it arrived). From
    the first stage's counters: its wait is the one that holds the overlap back."""
    record = ranks[0]["runs"][name][mode][i]
    validations = record.get("validations", 0)
    if not validations or 2 * record.get("speculated", 0) >= validations:
        return None
    return "wait" if 2 * record.get("waited", 0) >= validations else "ahead"


def _replayed(ranks, name, mode, i):
    """The steps of run `mode` of round i that ran twice (speculating past a step that was then redone), as
    traced (`Replay`, the same steps on every rank)."""
    return {it for n, _s, _e, it in ranks[0]["runs"][name][mode][i]["other"] if n == "Replay"}


def _predict(spec, ranks, name, mode, i, timeline, latency, args, messages, replay=False, validation=None):
    """The simulator's prediction of run `mode` of round i from that run's own traced costs: pass times (means),
    message latency, the send / receive time on their rank, the engine's time between instructions, and each
    rank's optimizer step (_step_costs). `replay`: each pass's own traced duration instead of the mean of its
    kind (trace.replayed_costs). `validation`: the simulator's post-validation model ('wait': each next step
    waits for the model's norm, the rank's own step taken after it). The steps the run replayed are replayed
    (`simulate(replayed=...)`)."""
    from schedules.observe.trace import measured_costs, measured_dispatch, replayed_costs
    from schedules.simulator.simulate import simulate
    k = args.iterations
    p2p = [r["runs"][name][mode][i]["p2p"] for r in ranks]
    traced_latency, cpu = _p2p_costs(spec, ranks, name, mode, i, latency, messages)
    replayed = _replayed(ranks, name, mode, i)
    return simulate(spec.factory, args.stages, timeline.meta["micro_batches"], placement=spec.placement,
                    costs=(replayed_costs if replay else measured_costs)(timeline), latency=traced_latency,
                    p2p_cpu=cpu,
                    dispatch=measured_dispatch(timeline, p2p), iterations=k,
                    step_cost=_step_costs(ranks, name, mode, i, k + len(replayed), validation),
                    validation=validation, replayed=replayed)


def analyse(ranks, args, m):
    from schedules.observe.trace import stream_messages
    from schedules.registry import schedule_spec
    k, p = args.iterations, args.stages
    latency = statistics.median(r["latency_s"] for r in ranks[:2])  # ranks 0 and 1 ping-pong, the others idle
    rows = {}
    for name in args.schedules:
        spec = schedule_spec(name)
        # who sends each message to whom: pairs a traced receive with its send (the send / receive time on a rank)
        messages = stream_messages(spec.factory, p, m, spec.placement)
        row = {"sync_s": [], "span_s": [], "period_s": [], "pred_makespan_s": [], "pred_period_s": [],
               "pred_period_sync_costs_s": [],
               "bubble_sync": [[] for _ in range(p)], "bubble_interlocked": [[] for _ in range(p)],
               "pred_bubble_sync": [[] for _ in range(p)], "pred_bubble_interlocked": [[] for _ in range(p)],
               "replay_period_s": [], "replay_bubble_interlocked": [[] for _ in range(p)], "call_s": [],
               "latency_traced_s": []}
        overlaps = {"sync": [], "interlocked": []}
        for i in range(args.rounds):
            sync = _timeline(ranks, name, "sync", i, m, args)
            inter = _timeline(ranks, name, "interlocked", i, m, args)
            overlaps["sync"] += _overlaps(ranks, name, "sync", i, sync)
            overlaps["interlocked"] += _overlaps(ranks, name, "interlocked", i, inter)
            # each run predicted from its own costs (passes, p2p, dispatch, each rank's optimizer step); the
            # interlocked period also from the synchronised run's costs: what the order alone changes
            pred = _predict(spec, ranks, name, "sync", i, sync, latency, args, messages)
            # validated as the run validated (at ZeRO 1 and in bf16 the norm is validated even with clipping off)
            validation = validation_of(ranks, name, "interlocked", i)
            own = _predict(spec, ranks, name, "interlocked", i, inter, latency, args, messages, validation=validation)
            # the same from each traced pass's own duration: what the means leave out (jitter on the critical path);
            # over the measured window (steps 1 to K-1), as the measured period
            replay = _predict(spec, ranks, name, "interlocked", i, inter, latency, args, messages, replay=True,
                              validation=validation).chained
            replay_period = _period(replay, k)
            row["replay_period_s"].append(replay_period)
            row["latency_traced_s"].append(_p2p_costs(spec, ranks, name, "interlocked", i, latency, messages)[0])
            # a synchronised step: the slowest rank's train_batch after the barrier, its ReduceGrads and optimizer
            # step included, as the simulator's makespan includes them (step_cost); the mean over the steps of the
            # interlocked period's window, as that period is a mean over them (a median would drop the slow steps
            # from one side of the ratio only)
            times = [r["runs"][name]["sync"][i]["times"] for r in ranks]
            steps = [max(step) for step in zip(*times)]
            window = range(2, k)  # the steps the interlocked period spans: from the end of step 1 to that of K-1
            row["sync_s"].append(statistics.fmean(steps[s] for s in window))
            row["call_s"].append(ranks[0]["runs"][name]["interlocked"][i]["times"][0] / k)
            spans = [sync.span(s) for s in sync.iterations()]
            row["span_s"].append(statistics.median(t1 - t0 for t0, t1 in spans))
            period = _period(inter, k)
            row["period_s"].append(period)
            row["pred_makespan_s"].append(pred.makespan)
            row["pred_period_s"].append(own.period)
            row["pred_period_sync_costs_s"].append(pred.period)
            middle = range(1, k - 1)
            for r in range(p):
                # over the whole synchronised step (the slowest rank's, its optimizer step included), as the
                # predicted makespan counts it: a rank's optimizer step and its wait for the other's are idle there
                row["bubble_sync"][r].append(1 - sum(sync.busy(r, s) for s in window) / sum(steps[s] for s in window))
                row["bubble_interlocked"][r].append(1 - _busy_per_step(inter, r, middle) / period)
                row["pred_bubble_sync"][r].append(pred.per_rank[r]["idle_synced"] / pred.makespan)
                row["pred_bubble_interlocked"][r].append(own.per_rank[r]["idle_interlocked"] / own.period)
                row["replay_bubble_interlocked"][r].append(1 - _busy_per_step(replay, r, middle) / replay_period)
        out = {key: (statistics.median(v) if v and not isinstance(v[0], list) else [statistics.median(x) for x in v])
               for key, v in row.items()}
        # the speed-ups: measured, synchronised step time over interlocked period; predicted, makespan / period,
        # each from its run's own costs, and from the synchronised run's costs alone (the order's own gain)
        out["speedup"] = out["sync_s"] / out["period_s"]
        # paired round by round (the two runs of a round are seconds apart, rounds minutes): the median of the
        # rounds' speed-ups, measured and predicted, and the measured ones' quartiles
        out["speedup_rounds"] = [s / q for s, q in zip(row["sync_s"], row["period_s"])]
        out["pred_speedup_rounds"] = [s / q for s, q in zip(row["pred_makespan_s"], row["pred_period_s"])]
        out["speedup_paired"] = statistics.median(out["speedup_rounds"])
        out["pred_speedup_paired"] = statistics.median(out["pred_speedup_rounds"])
        out["speedup_quartiles"] = quartiles(out["speedup_rounds"])
        out["meas_over_pred_paired"] = ratio_interval(out["speedup_rounds"], out["pred_speedup_rounds"])
        out["speedup_wall"] = out["sync_s"] / out["call_s"]
        out["pred_speedup"] = out["pred_makespan_s"] / out["pred_period_s"]
        out["pred_speedup_order"] = out["pred_makespan_s"] / out["pred_period_sync_costs_s"]
        out["contention"] = contention(overlaps)
        out["contention"]["cores_in_use"] = {mode: cores_in_use(ranks, name, mode, args.rounds)
                                             for mode in ("sync", "interlocked")}
        for mode in CLIPPED:
            if mode not in ranks[0]["runs"][name]:
                continue
            clipped = [ranks[r]["runs"][name][mode] for r in range(p)]
            steps = args.rounds * k
            rollbacks = [sum(c["rollbacks"] for c in runs) for runs in clipped]
            cost = [e - s for runs in clipped for c in runs for n, s, e, _ in c["other"] if n == "Rollback"]
            validate = [statistics.median([e - s for c in runs for n, s, e, _ in c["other"] if n == "ValidateStep"]
                                          or [0.0]) for runs in clipped]
            timelines = [_timeline(ranks, name, mode, i, m, args) for i in range(args.rounds)]
            periods = [_period(timeline, k) for timeline in timelines]
            # nothing clips in the never- runs: the simulator predicts them from their own costs, waiting for the
            # norm before each next step ('wait'), or not at all (speculating past it); speculating where clipping
            # bites, with the steps it replayed run twice, over the measured window
            predicted = None
            if mode in ("never-wait", "never-speculate"):
                validation = "wait" if mode == "never-wait" else None
                predicted = statistics.median(
                    _predict(spec, ranks, name, mode, i, timeline, latency, args, messages,
                             validation=validation).period for i, timeline in enumerate(timelines))
            elif mode == "clipped-speculate":
                predicted = statistics.median(
                    _period(_predict(spec, ranks, name, mode, i, timeline, latency, args, messages).chained, k)
                    for i, timeline in enumerate(timelines))
            out.setdefault("clipped", {})[policy_key(mode)] = {
                "pred_period_s": predicted,
                "threshold": statistics.median(c["threshold"] for c in clipped[0]), "steps": steps,
                "rollbacks_per_rank": rollbacks, "rollback_rate": sum(rollbacks) / (steps * p),
                "waited_per_rank": [sum(c["waited"] for c in runs) for runs in clipped],
                "replays_per_rank": [sum(c.get("replays", 0) for c in runs) for runs in clipped],
                "speculated_per_rank": [sum(c.get("speculated", 0) for c in runs) for runs in clipped],
                "rollback_s": statistics.median(cost) if cost else None,
                "validate_s_per_rank": validate, "period_s": statistics.median(periods),
                "speedup": out["sync_s"] / statistics.median(periods)}
        rows[name] = out
    return {"latency_s": latency, "schedules": rows}


def quartiles(values):
    """(lower quartile, upper quartile) of a list: its middle half (the values themselves below 4 of them)."""
    if len(values) < 4:
        return (min(values), max(values))
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], q[2])


def ratio_interval(measured, predicted, level=0.9, draws=2000):
    """[median, low, high]: the median over rounds of each round's measured speed-up over its predicted one, and
    its `level` confidence interval (a percentile bootstrap over the rounds, seeded: the same figures from the
    same rounds). Where the interval holds 1, the rounds cannot tell measurement from prediction."""
    import random
    ratios = [m / p for m, p in zip(measured, predicted)]
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return [statistics.median(ratios), medians[tail], medians[draws - 1 - tail]]


def table(res, m):
    from benchmark_docs import gain_ratio  # beside this script (as the report is rendered for the docs)
    lines = [f"m = {m}: synchronised step (the slowest rank's, optimizer step included) against the interlocked "
             f"period; bubble per rank "
             f"measured / predicted",
             f"{'schedule':10} {'sync ms':>8} {'pred ms':>8} {'inter ms':>8} {'pred ms':>8} {'speed-up':>8} "
             f"{'pred':>6} {'order':>6} {'ratio':>6}  bubble sync | interlocked"]
    for name, r in res["schedules"].items():
        bub = lambda a, b: " ".join(f"{x:5.1%}/{y:5.1%}" for x, y in zip(r[a], r[b]))  # noqa: E731
        ratio = gain_ratio(r["speedup"], r["pred_speedup"])
        ratio = f"{ratio:6.0%}" if ratio is not None else "     -"
        lines.append(f"{name:10} {r['sync_s'] * 1e3:8.1f} {r['pred_makespan_s'] * 1e3:8.1f} "
                     f"{r['period_s'] * 1e3:8.1f} {r['pred_period_s'] * 1e3:8.1f} {r['speedup']:8.3f} "
                     f"{r['pred_speedup']:6.3f} {r['pred_speedup_order']:6.3f} {ratio}  "
                     f"{bub('bubble_sync', 'pred_bubble_sync')} | "
                     f"{bub('bubble_interlocked', 'pred_bubble_interlocked')}")
        if "speedup_paired" in r:
            lo, hi = r["speedup_quartiles"]
            paired = gain_ratio(r["speedup_paired"], r["pred_speedup_paired"])
            lines.append(f"{'':10} paired by round ({len(r['speedup_rounds'])}): speed-up {r['speedup_paired']:.3f} "
                         f"(middle half {lo:.3f}-{hi:.3f}) / {r['pred_speedup_paired']:.3f} predicted"
                         + (f", {paired:.0%} of the predicted gain" if paired is not None else "")
                         + ("; measured / predicted {:.3f} (90% interval {:.3f}-{:.3f})".format(
                             *r["meas_over_pred_paired"]) if "meas_over_pred_paired" in r else ""))
        lines.append(f"{'':10} each pass's traced duration replayed: {r['replay_period_s'] * 1e3:.1f} ms, "
                     f"bubble {bub('bubble_interlocked', 'replay_bubble_interlocked')}")
        c = r["contention"]
        measured = f"{c['cost_ratio_measured']:.3f}" if c["cost_ratio_measured"] is not None else "-"
        lines.append(f"{'':10} pass time overlapped by the other rank's compute: sync {c['overlap']['sync']:.1%}, "
                     f"interlocked {c['overlap']['interlocked']:.1%}; pass time interlocked / sync {measured}")
        if c["cores_in_use"]["sync"] is not None:
            lines.append(f"{'':10} cores in use on average (of {os.cpu_count()}): sync "
                         f"{c['cores_in_use']['sync']:.2f}, interlocked {c['cores_in_use']['interlocked']:.2f}")
        for policy, c in r.get("clipped", {}).items():
            cost = f"{c['rollback_s'] * 1e3:.1f} ms" if c["rollback_s"] else "-"
            at = "none clips" if c["threshold"] >= NEVER else f"at {c['threshold']:.3g}"
            lines.append(f"{'':10} clipping {at}, {policy}: rollbacks {c['rollbacks_per_rank']}, "
                         f"replays {c.get('replays_per_rank')}, speculated {c.get('speculated_per_rank')}, "
                         f"waited {c['waited_per_rank']} of {c['steps']} steps per rank, a rollback {cost}, "
                         f"validation per step (ms) {' '.join(f'{v * 1e3:.1f}' for v in c['validate_s_per_rank'])}, "
                         f"period {c['period_s'] * 1e3:.1f} ms"
                         + (f" (predicted {c['pred_period_s'] * 1e3:.1f})" if c.get("pred_period_s") else "")
                         + f", speed-up {c['speedup']:.3f}")
    return lines


def published_name(args):
    """The docs/bench file a run publishes: interlock (p = 2, real compute), interlock-timed-pP (passes of set
    times), with -zero1 at ZeRO 1, -bf16 in bf16 and -clipping-off for the paired runs of clipping off only."""
    name = f"interlock-timed-p{args.stages}" if args.pass_ms else "interlock"
    return (name + ("-zero1" if args.zero else "") + ("-bf16" if args.bf16 else "")
            + ("-clipping-off" if args.clipping_off else ""))


def main(argv=None):
    args = parse_args(argv)
    if args.worker_out:
        return worker(args)
    from schedules.observe.memory import machine_line
    started = time.time()
    report = {"machine": machine_line(), "args": vars(args), "sync_measure": "mean", "interlock": {}}
    lines = [machine_line()]
    for m in args.micro_batches:
        res = analyse(launch_worker(args, m), args, m)
        report["interlock"][m] = res
        lines += table(res, m)
    lines.append(f"took {time.time() - started:.0f} s")
    print("\n".join(lines))
    common.save(args, "interlock", report, lines, publish=published_name(args))


if __name__ == "__main__":
    main()
