"""`--pipeline-schedule auto` and `--partition-method profile`: measure this model's layers on the ranks of
this job, then choose the schedule and the cut (schedules/planner/), before the model is built.

- `layer_builders(args)`: the model's layers as (class name, build) pairs, built one at a time;
- `measure(args, cfg, batch_of)`: the ranks measure their shares of the layers side by side (the cores as
  busy as when training) and put them together; for GPTlite also its head split into p slices as
  --vocab-parallel builds them (`slice_builders`), a slice a rank; p2p between ranks 0 and 1; every rank gets
  the same Profile;
- `plan(args, cfg, batch_of, rank)`: fills in `args.pipeline_schedule`, `args.virtual_stages`,
  `args.partition_method` and `args.partition_weights` (the cut balanced on the measured costs), and
  has rank 0 print the ranked table, one line per candidate kept, and the pick.

Every rank computes the same choice from the same gathered profile, so no rank waits on another's
verdict, and a budget nothing fits is refused on every rank alike (UsageError, one line).
"""
import os
import statistics
import time
from dataclasses import replace

from faults import UsageError


def wanted(args):
    """Whether this run profiles its layers before building the model."""
    return args.pipeline_parallel_size >= 2 and (args.pipeline_schedule == "auto"
                                                  or (args.partition_method or "").lower() == "profile")


def layer_builders(args):
    """[(class name, build())] of the model's layers in forward order, as the pipeline cuts them."""
    from layers import build_layer
    if args.model == "deep":
        import deep_model
        specs = deep_model.layer_specs(deep_model.DeepConfig(width=args.deep_width, depth=args.deep_depth,
                                                             seed=args.seed, **measured_experts(args)))
        seed = args.seed
    else:
        import gptlite
        config = gptlite_config(args)
        specs, seed = gptlite.layer_specs(config), config.seed
    return [(cls.__name__, lambda i=i: build_layer(specs, i, seed)) for i, (cls, _) in enumerate(specs)]


def measured_experts(args):
    """The model config's Mixture-of-Experts fields as the profile builds them: each expert layer whole on the rank
    measuring it (no exchange; compose prices sharing the experts between ranks); {} for a dense model."""
    from validation import moe_config
    return dict(moe_config(args), expert_parallel_size=1) if getattr(args, "moe_experts", 0) else {}


def gptlite_config(args):
    """The GPTliteConfig train.py builds from these flags."""
    import gptlite
    config = gptlite.MODEL_SIZES[args.model_size]
    return replace(config, n_layer=args.n_layer or config.n_layer, dropout=args.dropout, seed=args.seed,
                   block_size=getattr(args, "block_size", None) or config.block_size,
                   head=getattr(args, "head", "chunked"), **measured_experts(args))  # the head measured is the one run


def slice_builders(args, parts, recompute=True):
    """[(class name, build())] of GPTlite's vocabulary head split into `parts` slices as train.py --vocab-parallel
    builds them (gptlite.layer_specs(vocab_parts=parts, vocab_recompute=recompute): slice_layout's rows, each
    slice drawing its rows of the unsplit head's weight)."""
    import gptlite
    from layers import build_layer
    config = gptlite_config(args)
    specs = gptlite.layer_specs(config, vocab_parts=parts, vocab_recompute=recompute)
    first = len(specs) - parts
    return [(specs[i][0].__name__, lambda i=i: build_layer(specs, i, config.seed)) for i in range(first, len(specs))]


def head_input(args, tokens, seed=0):
    """A micro-batch of the hidden state GPTlite's head takes for `tokens` (B, T): layer-normalised (what its
    final LayerNorm gives at initialisation), random; a slice's costs do not depend on the values."""
    import torch
    g = torch.Generator().manual_seed(seed)
    width = gptlite_config(args).n_embd
    hidden = torch.randn(*tokens.shape, width, generator=g)
    return torch.nn.functional.layer_norm(hidden, (width, ))


def loss_function(args):
    if args.model == "deep":
        from deep_model import mse_loss
        return mse_loss
    from gptlite import head_loss
    return head_loss(getattr(args, "head", "chunked"))  # the loss of the head that runs


def optimizer_factory(cfg):
    """params -> the torch optimizer the run's config builds (DeepSpeed's torch_adam AdamW, or SGD)."""
    import torch
    opt = cfg.get("optimizer", {})
    params = {k: v for k, v in opt.get("params", {}).items() if k not in ("torch_adam", "adam_w_mode",
                                                                            "fp32_optimizer_states")}
    cls = torch.optim.SGD if str(opt.get("type", "")).lower() == "sgd" else torch.optim.AdamW
    return lambda parameters: cls(parameters, **params)


def normed(cfg):
    """Whether the step takes the gradients' norm: to clip them, or at ZeRO >= 1 (DeepSpeed's step always does)."""
    return bool(cfg.get("gradient_clipping", 1.0) or cfg.get("zero_optimization", {}).get("stage", 0))


def measure(args, cfg, batch_of, repeats=7, split=None, build_engine=None):
    """The Profile of this model on this job's device and ranks (every rank returns the same one). `split` (default:
    for GPTlite at 2 stages or more): also the vocabulary head split into --pipeline-parallel-size slices as
    train.py --vocab-parallel builds them, each slice on its own rank side by side, the last with its loss
    (Profile.slices; compose.split_head composes them where the chooser weighs a split head). `build_engine`
    (train.py's): the engine's own work per pass and per step, and its step per parameter, are measured on tiny
    engines of this job (calibration.py); without it, the step is timed on a flat tensor (`measure_step`), the
    work per pass estimated (`measure_dispatch`, a lower bound) and per step left out."""
    import torch
    import torch.distributed as dist

    from schedules.planner import profile as planner
    started = time.perf_counter()
    x, y = batch_of("train", 0)
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    dtype = torch.bfloat16 if bf16 else None
    if bf16 and x.is_floating_point():
        x = x.to(dtype)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world > 1:
        dist.barrier()  # the ranks measure side by side from the start
    # each layer's optimizer step comes from a rate per parameter: the engine's (calibration.py) or a cold step
    # over a rank's share (measure_step)
    # our engines add weight gradients into .grad by their multiply in fp32 at ZeRO 0, and at ZeRO 1 with one
    # data-parallel rank (lean_step.accumulates_in_place): the profile's B and W are timed the same way
    parts = args.pipeline_parallel_size
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    in_place = not bf16 and (stage == 0 or (stage == 1 and world <= max(parts, 1)))
    layers, loss = planner.measure_layers(layer_builders(args), x, loss_function(args), y, repeats=repeats,
                                          device=device, dtype=dtype, sync=sync, rank=rank, world=world,
                                          in_place=in_place)
    calibrated = build_engine is not None and world % max(parts, 1) == 0
    if not calibrated:  # the step measured without the engine, over this rank's share scaled to a rank's whole
        held = sum(c.params for c in layers if c is not None) * world / max(parts, 1)
        rate = planner.measure_step(held, optimizer_factory(cfg), clip=normed(cfg), device=device, sync=sync)
    if split is None:
        # the split head's slices are the chunked head's math: a run that asks for torch's head is not offered them
        split = args.model == "gptlite" and parts >= 2 and getattr(args, "head", "chunked") != "linear"
    slices, slices_started = None, time.perf_counter()
    if split:
        from schedules.runtime.vocab_parallel import vocab_parallel_loss
        if world > 1:
            dist.barrier()  # the slices side by side, as a pipeline runs them
        slices = planner.measure_slices(slice_builders(args, parts), head_input(args, x), y, vocab_parallel_loss,
                                        repeats=repeats, device=device, dtype=dtype, sync=sync, rank=rank,
                                        world=world, in_place=in_place)
    slices_seconds = time.perf_counter() - slices_started
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, (layers, loss, slices))
        layers, loss = planner.merge([(mine, its_loss) for mine, its_loss, _ in every])
        if split:
            slices, _ = planner.merge([(its_slices, None) for *_, its_slices in every])
    step_overhead = 0.0
    if calibrated:  # the engine's own work per pass and per step, and its step per parameter (calibration.py)
        from calibration import engine_costs
        # what a rank of the real model holds, from the merged layers: the same on every rank (a rank's own share of
        # the layers measured differs, and the data-parallel replicas of a calibration engine must build alike)
        held = sum(c.params for c in layers if c is not None) / max(parts, 1)
        dispatch, step_overhead, rate = engine_costs(args, cfg, build_engine, held)
    elif world > 1:  # the same rate on every rank: the median of theirs
        rates = [None] * world
        dist.all_gather_object(rates, rate)
        rate = statistics.median(rates)
    layers = [replace(c, optimizer=c.params * rate) for c in planner.pool_identical(layers)]
    if slices is not None:
        slices = [replace(c, optimizer=c.params * rate) for c in slices]
    message = max(c.output_bytes for c in layers[:-1]) if len(layers) > 1 else 8
    p2p = planner.measure_p2p(message, device=device) if world > 1 else None
    if not calibrated:
        dispatch = planner.measure_dispatch(torch.zeros(message // 4 or 1))
        if world > 1:  # the same dispatch figure on every rank: rank 0's
            box = [dispatch]
            dist.broadcast_object_list(box, src=0)
            dispatch = box[0]
    meta = {"model": args.model, "model_size": args.model_size if args.model == "gptlite" else None,
            "vocab_size": gptlite_config(args).vocab_size if args.model == "gptlite" else None,
            "deep_width": args.deep_width if args.model == "deep" else None, "deep_depth": args.deep_depth
            if args.model == "deep" else None, "micro_batch_size": int(x.shape[0]), "bf16": bf16,
            "device": str(device or "cpu"), "threads": torch.get_num_threads(), "ranks": world, "repeats": repeats,
            "seconds": time.perf_counter() - started,
            # how the run lays out its experts (compose prices DualPipe's copies sharing them) and runs its pairs
            "dualpipe_experts": args.dualpipe_experts if getattr(args, "moe_experts", 0) else None,
            "expert_parallel_size": args.expert_parallel_size if getattr(args, "moe_experts", 0) else 1,
            "overlap": getattr(args, "overlap", "on") == "on"}
    if slices is not None:
        meta["slices_seconds"] = slices_seconds  # of which the split head's slices
    if calibrated:
        meta["step_per_parameter"] = rate  # the engine's (calibration.py)
    profile = planner.Profile(layers, loss, dispatch=dispatch, meta=meta, slices=slices, step_overhead=step_overhead)
    if p2p is not None:
        profile.p2p = p2p
    return profile


def validation_model(args, cfg):
    """How the chooser's simulator validates an interlocked step (simulate(validation=...)): None where nothing
    is validated (ZeRO 0 in fp32 with clipping off) or the policy speculates past it; 'ahead' where it steps
    ahead; 'wait' for `wait`, and for `auto`, which waits where a backup costs more than the wait (as on CPUs)."""
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default clips at 1.0
    validated = clip or cfg.get("zero_optimization", {}).get("stage", 0) or cfg.get("bf16", {}).get("enabled")
    policy = getattr(args, "post_validation", "auto")
    if not validated or policy == "speculate":
        return None
    return "ahead" if policy == "ahead" else "wait"


def fit_vocab_layout(args, cfg, profile, rank, choice=None):
    """--vocab-parallel with --vocab-layout auto on a GPTlite profile: the slices' rows and recomputed shares fitted
    to the schedule (schedules.planner.layout.fit_slices; `auto`'s pick comes with its own), into
    `args.vocab_fitted`; rank 0 says what it predicts against slice_layout's. Resuming a split checkpoint at this
    p, its rows are kept (only the recompute is fitted), so it loads as written. The Fitted, or None where nothing
    is fitted."""
    if not (args.vocab_parallel and getattr(args, "vocab_layout", "auto") == "auto" and args.model == "gptlite"):
        return None
    from schedules.planner.layout import fit_slices
    MiB = 1 << 20
    kept = getattr(args, "kept_vocab_rows", None)
    fitted = choice.pick.vocab_layout if choice is not None and not kept else None
    if fitted is None:
        budget = args.max_activation_memory * MiB if getattr(args, "max_activation_memory", None) else None
        fitted = fit_slices(profile, args.pipeline_schedule, args.pipeline_parallel_size,
                            cfg["gradient_accumulation_steps"], method=(args.partition_method or "uniform").lower(),
                            virtual_stages=args.virtual_stages, budget=budget, interlock=getattr(args, "interlock", 1),
                            validation=validation_model(args, cfg), vocab_size=gptlite_config(args).vocab_size,
                            rows=kept)
        if choice is not None:  # the pick as it runs: in the layout it keeps
            choice.ranked[0] = fitted.candidate_of(choice.pick.cut)
    args.vocab_fitted = fitted.layout
    if rank == 0:
        def peaks(bytes_):
            return " / ".join(f"{b / MiB:.1f}" for b in bytes_)
        print(f"vocab layout: rows {' '.join(map(str, fitted.rows))}, recomputed "
              f"{' '.join(f'{q:.0%}' for q in fitted.recompute)}, fitted to {args.pipeline_schedule}: predicted "
              f"{fitted.step * 1e3:.1f} ms a step, peaks {peaks(fitted.peak)} MiB (the balanced layout: "
              f"{fitted.start[0] * 1e3:.1f} ms, {peaks(fitted.start[1])} MiB)", flush=True)
    return fitted


def plan(args, cfg, batch_of, rank, save=None, build_engine=None):
    """Profile, choose (auto), and set the flags the model and the engine are built from. Returns the
    Choice (None for --partition-method profile alone)."""
    from schedules.planner.choose import CUTS, choose, summary, table
    from schedules.planner.compose import layer_weights
    from schedules.registry import splitting_schedules
    started = time.perf_counter()
    # the split head's slices are measured where the chooser weighs them (GPTlite, `auto`), not for the cut alone
    profile = measure(args, cfg, batch_of, split=args.model == "gptlite" and (args.pipeline_schedule == "auto"
                                                                              or bool(args.vocab_parallel)),
                      build_engine=build_engine if args.pipeline_schedule == "auto" else None)
    if save and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(save)), exist_ok=True)
        profile.save(save)
    choice = None
    if args.pipeline_schedule == "auto":
        cuts = [args.partition_method.lower()] if args.partition_method else CUTS
        try:
            # GPTlite's vocabulary head may be split over the ranks (--vocab-parallel): those candidates too, or only
            split = args.model == "gptlite"
            choice = choose(profile, args.pipeline_parallel_size, cfg["gradient_accumulation_steps"],
                            args.max_activation_memory, cuts=cuts, interlock=getattr(args, "interlock", 1),
                            validation=validation_model(args, cfg), split=split,
                            fit_layouts=getattr(args, "vocab_layout", "auto") == "auto",
                            vocab_recompute=getattr(args, "vocab_layout", "auto") != "even",
                            schedules=splitting_schedules(args.pipeline_parallel_size) if args.vocab_parallel
                            else None)
            if args.vocab_parallel:
                choice.ranked = [c for c in choice.ranked if c.vocab_parallel]
        except ValueError as e:
            raise UsageError(f"--pipeline-schedule auto: {e}") from None
        pick = choice.pick
        args.pipeline_schedule, args.virtual_stages, args.partition_method = \
            pick.schedule, pick.virtual_stages, pick.method
        args.vocab_parallel = pick.vocab_parallel
        if rank == 0:
            print("\n".join(["auto: predicted per candidate, fastest first (the simulator on the layers measured "
                             "here)", *table(choice)]), flush=True)
    if (args.partition_method or "").lower() == "profile":
        args.partition_weights = layer_weights(profile, "profile")
    fit_vocab_layout(args, cfg, profile, rank, choice)
    if rank == 0:
        took = time.perf_counter() - started
        line = summary(choice) if choice else (
            "--partition-method profile: stages balanced on the measured layer costs (ms) "
            + " ".join(f"{w * 1e3:.1f}" for w in args.partition_weights))
        engine = (f"; the engine's own work {profile.dispatch * 1e3:.2f} ms a pass, {profile.step_overhead * 1e3:.1f}"
                  f" ms a step, and {profile.meta['step_per_parameter'] * 1e9:.2f} ns a parameter stepped"
                  if "step_per_parameter" in profile.meta else "")  # calibration.py
        print(f"{'auto' if choice else 'profile'}: {line}; profiling and choosing took {took:.1f} s "
              f"(the profile alone {profile.meta['seconds']:.1f} s{engine})", flush=True)
    return choice
