"""Every flag of train.py and the merged DeepSpeed config, checked before any process waits on another:
`validate()` refuses bad input with a UsageError naming the flag (or config key) and the fix. Every rank
runs it on the same flags, config and files, so every rank reaches the same verdict.
"""
import os
import re

from faults import UsageError


def validate(args, cfg, world: int, on_cpu: bool):
    """Refuse bad input with a UsageError naming the flag (or config key) and the fix.

    Every rank runs this on the same flags, config and files before `init_distributed`, so every
    rank reaches the same verdict and none is left waiting on a peer that gave up. (A checkpoint to
    resume is checked by checkpoints.check_resume.)
    """
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    for flag, value, least in (("--steps", args.steps, 1), ("--micro-batch-size", args.micro_batch_size, 1),
                               ("--gradient-accumulation-steps", args.gradient_accumulation_steps, 1),
                               ("--eval-interval", args.eval_interval, 0), ("--eval-batches", args.eval_batches, 1),
                               ("--log-interval", args.log_interval, 1), ("--save-interval", args.save_interval, 0),
                               ("--trace-steps", args.trace_steps, 1), ("--dist-timeout", args.dist_timeout, 1),
                               ("--activation-checkpoint-interval", args.activation_checkpoint_interval, 0),
                               ("--n-layer", args.n_layer, 1), ("--block-size", args.block_size, 1),
                               ("--deep-width", args.deep_width, 1),
                               ("--deep-depth", args.deep_depth, 1), ("--pipeline-parallel-size",
                                                                      args.pipeline_parallel_size, 0)):
        need(value is None or value >= least, f"{flag} {value} is below {least}: pass {flag} N with N >= {least}")
    need(0 <= args.dropout < 1, f"--dropout {args.dropout}: pass --dropout P with 0 <= P < 1")
    need(args.lr is None or args.lr > 0, f"--lr {args.lr}: pass a positive --lr")
    pp = args.pipeline_parallel_size
    need(not pp or world % pp == 0, f"--pipeline-parallel-size {pp} must divide the world size {world}: "
         f"launch a multiple of {pp} processes or change the flag")
    need(args.virtual_stages is None or args.pipeline_schedule == "interleaved",
         "--virtual-stages applies to --pipeline-schedule interleaved only"
         + (" (auto chooses v itself)" if args.pipeline_schedule == "auto" else ""))
    _validate_auto(args, need)
    _validate_vocab_parallel(args, need)
    need(not args.trace or pp, "--trace records pipeline schedules: it needs --pipeline-parallel-size >= 1")
    need(not args.trace_memory or args.trace, "--trace-memory counts memory in the traced steps: add --trace PATH")
    need(not args.resume or args.save_dir, "--resume needs --save-dir DIR (the checkpoint directory to resume from)")
    need(not args.resume_from or os.path.isdir(args.resume_from),
         f"--resume-from {args.resume_from}: no such directory; pass the --save-dir of the run to continue")
    need(not args.init_from or os.path.isfile(args.init_from),
         f"--init-from {args.init_from}: no such file; pass a file --export wrote")
    need(not (args.init_from and (args.resume or args.resume_from)), "--init-from starts a run from exported weights, "
         "--resume continues a checkpoint (weights and optimizer): pass one of them")
    if args.model == "gptlite":
        from gptlite import MODEL_SIZES
        need(args.model_size in MODEL_SIZES,
             f"--model-size {args.model_size!r} is unknown: choose from {', '.join(MODEL_SIZES)}")
    _validate_config(cfg, pp, on_cpu, need)
    _validate_experts(args, world // max(pp, 1), need)
    _validate_interlock(args, cfg, need)
    _validate_pipeline(args, cfg["gradient_accumulation_steps"], need)
    for flag, path in (("--metrics-file", args.metrics_file), ("--export", args.export), ("--trace", args.trace)):
        if path:
            need(not os.path.isdir(path), f"{flag} {path}: is a directory; pass a file name")
            need(_creatable(os.path.dirname(os.path.abspath(path))), f"{flag} {path}: cannot create it here "
                 "(no write permission, or a file stands where a folder should); pass another path")
    if not args.save_dir:
        return
    need(not os.path.exists(args.save_dir) or os.path.isdir(args.save_dir),
         f"--save-dir {args.save_dir}: is a file, not a directory; pass a directory")
    need(_creatable(args.save_dir), f"--save-dir {args.save_dir}: cannot write there; pass another directory")
    latest = os.path.join(args.save_dir, "latest")
    need(args.resume or not os.path.exists(latest), f"--save-dir {args.save_dir} already holds a checkpoint; pass "
         "--resume to continue it, or another --save-dir (nothing is overwritten)")


def _creatable(folder):
    """Whether `folder` exists as a writable directory or could be created."""
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def _validate_config(cfg, pp, on_cpu, need):
    """What DeepSpeed would refuse with an assertion on every rank, said up front."""
    mbs, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg["gradient_accumulation_steps"]
    need(mbs is not None, "config train_micro_batch_size_per_gpu is missing: set it in --deepspeed_config or pass "
         "--micro-batch-size N")
    for key, flag, value in (("train_micro_batch_size_per_gpu", "--micro-batch-size", mbs),
                             ("gradient_accumulation_steps", "--gradient-accumulation-steps", gas)):
        need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"config {key} {value!r}: must be an integer >= 1; fix --deepspeed_config or pass {flag} N")
    zero = cfg.get("zero_optimization", {}).get("stage", 0)
    need(zero in (0, 1, 2, 3), f"config zero_optimization.stage {zero!r}: must be 0, 1, 2 or 3")
    need(not (pp and zero >= 2), f"config zero_optimization.stage {zero}: DeepSpeed's pipeline engine supports ZeRO "
         "stages 0 and 1 only; set zero_optimization.stage to 0 or 1 in --deepspeed_config, or train without a "
         "pipeline (--pipeline-parallel-size 0)")
    fp16, bf16 = (cfg.get(k, {}).get("enabled", False) for k in ("fp16", "bf16"))
    need(not (fp16 and bf16), "config fp16.enabled and bf16.enabled: choose one; set fp16.enabled false for --bf16")
    accumulate = str(cfg.get("data_types", {}).get("grad_accum_dtype", "")).lower()
    need(not (bf16 and zero == 0 and accumulate in ("fp32", "float32")), "config bf16 with fp32 gradient "
         "accumulation (what --bf16 sets) at zero_optimization.stage 0: DeepSpeed accumulates bf16 weights' "
         "gradients in fp32 at ZeRO 1 only; set zero_optimization.stage 1 in --deepspeed_config")
    need(not (fp16 and on_cpu), "config fp16.enabled: DeepSpeed trains fp16 on GPUs only; on CPU set fp16.enabled "
         "false in --deepspeed_config (or train in bf16 with --bf16)")
    need(isinstance(cfg["optimizer"].get("type"), str), "config optimizer.type is missing: set it, or pass "
         "--optimizer adamw|sgd")
    if cfg["optimizer"]["type"].lower() == "sgd" and zero and not cfg.get("zero_allow_untested_optimizer"):
        need(False, f"config zero_optimization.stage {zero} with the SGD optimizer (a torch optimizer, which "
             "DeepSpeed calls untested): set zero_allow_untested_optimizer true in --deepspeed_config, or "
             "zero_optimization.stage 0")
    warmup = cfg.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 1)
    need(isinstance(warmup, int) and warmup >= 1, f"config scheduler.params.warmup_num_steps {warmup!r}: must be "
         "an integer >= 1")


def _validate_interlock(args, cfg, need):
    """--interlock K: steps back to back on a pipeline of our engines, the step post-validated (ZeRO 0 and 1, fp32
    and bf16: schedules/runtime/interlock.py, step_targets.py). DeepSpeed's own engines synchronise every step
    where they clip: refused, not silently synchronised."""
    k, pp = args.interlock, args.pipeline_parallel_size
    need(k >= 1, f"--interlock {k} is below 1: pass --interlock K with K >= 1 (1: one step per call)")
    if k == 1:
        return
    need(pp >= 1, f"--interlock {k} runs pipeline steps back to back: it needs --pipeline-parallel-size >= 1 "
         "(or --interlock 1)")
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default clips at 1.0
    if not clip:
        return
    from schedules.registry import schedule_spec
    ours = args.pipeline_schedule == "auto" or schedule_spec(args.pipeline_schedule, args.virtual_stages).engine
    need(ours, f"--interlock {k} with gradient_clipping {clip}: --pipeline-schedule {args.pipeline_schedule} runs "
         "on DeepSpeed's own engine, whose step synchronises every stage; pick one of ours (e.g. zb-h1, 1f1b-lean), "
         "set gradient_clipping 0 in --deepspeed_config, or pass --interlock 1")


def layer_types(args):
    """The class name of every layer of the model, in order: what the pipeline partitions."""
    if args.model == "deep":
        return ["DeepBlock"] * args.deep_depth
    from dataclasses import replace

    import gptlite
    config = gptlite.MODEL_SIZES[args.model_size]
    config = replace(config, n_layer=args.n_layer or config.n_layer, head=getattr(args, "head", "chunked"))
    parts = args.pipeline_parallel_size if getattr(args, "vocab_parallel", False) else 1
    return [spec[0].__name__ for spec in gptlite.layer_specs(config, vocab_parts=parts)]


def moe_blocks(spec: str, n_layer: int) -> tuple:
    """--moe-blocks as block indices: all, every:N or a comma list (validation.py refuses others)."""
    if spec == "all":
        return tuple(range(n_layer))
    if spec.startswith("every:"):
        n = int(spec[len("every:"):])
        return tuple(range(n - 1, n_layer, n))
    return tuple(sorted({int(i) for i in spec.split(",")}))


def moe_config(args) -> dict:
    """GPTliteConfig's Mixture-of-Experts fields from the flags."""
    n_layer = _blocks(args)
    return dict(moe_experts=args.moe_experts, moe_blocks=moe_blocks(args.moe_blocks, n_layer),
                moe_top_k=args.moe_top_k, moe_capacity_factor=args.moe_capacity_factor,
                moe_aux_coef=args.moe_aux_coef, expert_parallel_size=args.expert_parallel_size)


def _blocks(args) -> int:
    """The model's blocks, which --moe-blocks picks from."""
    if args.model == "deep":
        return args.deep_depth
    from gptlite import MODEL_SIZES
    return args.n_layer or MODEL_SIZES[args.model_size].n_layer


def experts_shared_by_copies(args) -> bool:
    """DualPipe's two copies of each stage hold half its experts each (--dualpipe-experts shard)."""
    return bool(args.moe_experts and args.pipeline_parallel_size and args.pipeline_schedule == "dualpipe"
                and args.dualpipe_experts == "shard")


def model_stages(args):
    """How many stages the pipeline cuts the model into: stages x chunks per rank (DualPipe: p)."""
    from schedules.registry import schedule_spec
    pp = args.pipeline_parallel_size
    return schedule_spec(args.pipeline_schedule, args.virtual_stages).placement(pp).num_stages if pp else 0


def _validate_experts(args, dp, need):
    """--moe-*, --expert-parallel-size: GPTlite's Mixture of Experts (schedules/runtime/moe.py)."""
    n, ep = args.moe_experts, args.expert_parallel_size
    need(n >= 0, f"--moe-experts {n}: pass the number of experts per MoE block (0: none)")
    need(ep >= 1, f"--expert-parallel-size {ep} is below 1: pass --expert-parallel-size N with N >= 1")
    if not n:
        need(ep == 1, f"--expert-parallel-size {ep} shards experts: add --moe-experts N")
        return
    need(n >= args.moe_top_k, f"--moe-top-k {args.moe_top_k} routes each token to that many of --moe-experts {n}: "
         f"pass more experts or a smaller k")
    need(args.moe_capacity_factor >= 0, f"--moe-capacity-factor {args.moe_capacity_factor}: pass a positive factor "
         "(0: no token dropped)")
    need(args.moe_aux_coef >= 0, f"--moe-aux-coef {args.moe_aux_coef}: pass a coefficient >= 0")
    need(n % ep == 0, f"--expert-parallel-size {ep} must divide --moe-experts {n} (each rank holds n / E experts)")
    need(dp % ep == 0, f"--expert-parallel-size {ep} shards experts over the data-parallel ranks of a stage, "
         f"{dp} here: launch a multiple of {ep} data-parallel ranks, or pass a divisor of {dp}")
    n_layer = _blocks(args)
    spec, every = args.moe_blocks, re.fullmatch(r"every:(\d+)", args.moe_blocks)
    listed = re.fullmatch(r"\d+(,\d+)*", spec) and max(map(int, spec.split(","))) < n_layer
    need(spec == "all" or listed or (every and 1 <= int(every[1]) <= n_layer),
         f"--moe-blocks {spec}: pass all, every:N (1 <= N <= {n_layer}) or block indices below {n_layer}, e.g. 0,2")
    # (auto may pick dualpipe: what sharing its experts needs is checked before)
    if experts_shared_by_copies(args) or (args.pipeline_schedule == "auto" and args.dualpipe_experts == "shard"):
        need(ep == 1, f"--expert-parallel-size {ep} with dualpipe: its two copies of each stage already share the "
             "experts (--dualpipe-experts shard): pass --expert-parallel-size 1, or --dualpipe-experts duplicate")
        need(n % 2 == 0, f"--moe-experts {n} with dualpipe: its two copies of a stage hold half the experts each: "
             "pass an even number, or --dualpipe-experts duplicate")


def _validate_auto(args, need):
    """--pipeline-schedule auto and --max-activation-memory: what the chooser cannot do, said up front."""
    auto = args.pipeline_schedule == "auto"
    need(args.max_activation_memory is None or auto,
         "--max-activation-memory applies to --pipeline-schedule auto only (it bounds the chosen schedule)")
    need(args.max_activation_memory is None or args.max_activation_memory > 0,
         f"--max-activation-memory {args.max_activation_memory}: pass a positive number of MiB")
    if not auto:
        return
    need(args.pipeline_parallel_size >= 2, "--pipeline-schedule auto chooses among pipeline schedules, which need "
         f"--pipeline-parallel-size >= 2 (it is {args.pipeline_parallel_size}); pass a schedule by name for one stage")
    need(not args.resume, "--resume with --pipeline-schedule auto: pass the schedule the checkpoint was trained with "
         "(its run.json names it), so that the resumed run does not choose another")
    need(not args.activation_checkpoint_interval, "--pipeline-schedule auto profiles the layers without activation "
         "checkpointing: drop --activation-checkpoint-interval, or pass a schedule by name")


def _validate_vocab_parallel(args, need):
    """--vocab-parallel: GPTlite's head split over the ranks, one slice each, on a schedule whose last chunk
    visits every rank (schedules/runtime/vocab_parallel.py). --vocab-layout lays its slices out: it needs one (auto
    may choose one)."""
    layout = getattr(args, "vocab_layout", "auto")
    need(layout == "auto" or args.vocab_parallel or args.pipeline_schedule == "auto",
         f"--vocab-layout {layout} lays out the slices of a split head: add --vocab-parallel, or drop --vocab-layout")
    head = getattr(args, "head", "chunked")
    whole = head not in ("auto", "chunked")  # a head asked for by name (auto: train.py resolves it to chunked here)
    need(not whole or args.model == "gptlite", f"--head {head} chooses GPTlite's head: drop it for --model "
         f"deep")
    if not args.vocab_parallel:
        return
    need(not whole, f"--head {head} keeps GPTlite's head whole, --vocab-parallel splits it into slices "
         f"(the chunked head's math): drop one of them")
    from schedules.registry import splitting_schedules
    pp, name = args.pipeline_parallel_size, args.pipeline_schedule
    need(args.model == "gptlite", "--vocab-parallel splits GPTlite's vocabulary head: drop it for --model deep")
    need(pp >= 2, f"--vocab-parallel splits the head over the pipeline ranks: it needs --pipeline-parallel-size >= 2 "
         f"(it is {pp})")
    supported = splitting_schedules()
    need(name in supported or name == "auto", f"--vocab-parallel needs a schedule whose last chunk visits every "
         f"rank, one slice of the head each: pass --pipeline-schedule {' | '.join(supported)} (not {name})")


def _validate_pipeline(args, micro_batches, need):
    """The schedule's own constraints (built once for stage 0) and enough layers for its model stages."""
    from schedules.registry import schedule_spec
    name, pp = args.pipeline_schedule, args.pipeline_parallel_size
    need(name == "1f1b" or pp >= 2, f"--pipeline-schedule {name} needs --pipeline-parallel-size >= 2")
    if not pp:
        return
    if name != "auto":  # auto considers only the schedules that run at this p and m
        try:
            schedule_spec(name, args.virtual_stages).factory(micro_batches=micro_batches, stages=pp, stage_id=0)
        except ValueError as e:
            raise UsageError(f"--pipeline-schedule {name}: {e}") from None
    method = (args.partition_method or "parameters").lower()
    types = layer_types(args)
    need(method in ("parameters", "uniform", "profile") or (method.startswith("type:") and method[5:]),
         f"--partition-method {args.partition_method}: choose parameters, uniform, profile or type:LAYER_CLASS")
    if method.startswith("type:"):
        need(any(re.search(method[5:], t, re.IGNORECASE) for t in types), f"--partition-method "
             f"{args.partition_method} matches "
             f"no layer of the model (its layer classes: {', '.join(dict.fromkeys(types))})")
    stages = pp if name == "auto" else model_stages(args)  # auto: at least 1F1B's stages
    # GPTlite's layers: the blocks, the embeddings, the final norm and the head (or its pp slices, a stage each)
    size, least = ("--n-layer", stages - 3) if args.model == "gptlite" else ("--deep-depth", stages)
    if args.vocab_parallel:
        types, stages, least = types[:-pp], stages - pp, stages - pp - 2
    need(len(types) >= stages, f"--pipeline-schedule {name} at --pipeline-parallel-size {pp} cuts the model into "
         f"{stages} stages, but it has {len(types)} layers: pass {size} {least} or more, or fewer stages")
