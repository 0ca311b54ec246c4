"""Train GPTlite (or the deep benchmark model) with DeepSpeed, with or without pipeline parallelism.

    python train.py --model-size tiny --steps 20                      # one process, no launcher
    deepspeed --num_gpus 2 train.py --pipeline-parallel-size 2        # 2-stage pipeline
    deepspeed --num_gpus 1 train.py --pipeline-parallel-size 0        # no pipeline

Reads top to bottom: flags -> DeepSpeed config -> validation -> data -> distributed -> model ->
engine -> loop. Pipelined steps are `engine.train_batch()` over `gradient_accumulation_steps`
micro-batches; the non-pipelined path runs forward / `engine.backward` / `engine.step` over the
very same micro-batches, so both report the same losses for the same seed.

Failures end in one `error:` line from rank 0: bad input (exit status 2) is found by `validate()`
before any process waits on another; what only one rank can see (a damaged checkpoint file) and
faults (a rank killed or stalled: exit status 1) reach rank 0 through `Peers`.
"""
import argparse
import json
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta


class UsageError(Exception):
    """Bad flags, config, launch or checkpoint: printed as one line by rank 0, exit status 2."""


class Fault(Exception):
    """A failure that is not bad input, already said in one line: printed by rank 0, exit status 1."""


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):

    def error(self, message):  # one line, no usage dump, no traceback
        raise UsageError(message)

    def flag(self, name, *aliases, **kwargs):
        """Register `--name-with-dashes` and its `--name_with_underscores` spelling (plus aliases)."""
        names = [spelling for n in (name, *aliases) for spelling in (n, "--" + n[2:].replace("-", "_"))]
        return self.add_argument(*dict.fromkeys(names), **kwargs)


def parse_args(argv=None):
    from schedules.registry import available_schedules
    trainable = sorted(name for name, spec in available_schedules().items() if spec.trains)
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.flag("--pipeline-parallel-size", "--pipeline-num-stages", type=int, default=0, dest="pipeline_parallel_size",
           help="pipeline stages; 0 = no pipeline. World size = data-parallel degree x this.")
    p.flag("--pipeline-spec-layers", action="store_true",
           help="build stages from LayerSpecs (each rank builds its own)")
    p.flag("--pipeline-schedule", default="1f1b", choices=trainable, help="pipeline schedule")
    p.flag("--virtual-stages", type=int, default=None, help="interleaved: model chunks per rank (default 2)")
    p.flag("--partition-method", default=None, help="DeepSpeed partition method (parameters, uniform, type:Block)")
    p.flag("--activation-checkpoint-interval", type=int, default=0, help="checkpoint every N blocks; 0 = off")
    p.flag("--model", default="gptlite", choices=["gptlite", "deep"])
    p.flag("--model-size", default="small", help="GPTlite size: tiny, small, medium, gpt2")
    p.flag("--n-layer", type=int, default=None, help="GPTlite: override the size's number of blocks")
    p.flag("--deep-width", type=int, default=256, help="deep model: width of each Linear")
    p.flag("--deep-depth", type=int, default=16, help="deep model: number of Linear+ReLU blocks")
    p.flag("--dropout", type=float, default=0.0)
    p.flag("--steps", type=int, default=100, help="optimizer steps (in all, counting those of a resumed checkpoint)")
    p.flag("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    p.flag("--optimizer", choices=["adamw", "sgd"], default=None, help="overrides ds_config.json")
    p.flag("--lr", type=float, default=None, help="overrides ds_config.json")
    p.flag("--micro-batch-size", type=int, default=None, help="overrides ds_config.json")
    p.flag("--gradient-accumulation-steps", type=int, default=None, help="micro-batches per step; overrides config")
    p.flag("--bf16", action="store_true", help="train in bf16 (overrides config)")
    p.flag("--dataset", default=None, help="Hugging Face hub dataset id, e.g. karpathy/tiny_shakespeare")
    p.flag("--data-file", default=None, help="a local text file to train on")
    p.flag("--eval-interval", type=int, default=0, help="validation every N steps (and at start and end); 0 = never")
    p.flag("--eval-batches", type=int, default=2, help="batches of micro-batches per validation")
    p.flag("--log-interval", type=int, default=1, help="a progress line on stdout every N steps (and the last)")
    p.flag("--metrics-file", default=None, help="JSON lines written by rank 0, one object per step")
    p.flag("--save-dir", default=None, help="DeepSpeed checkpoint directory")
    p.flag("--save-interval", type=int, default=0, help="save every N steps (and at the end); 0 = at the end only")
    p.flag("--resume", action="store_true", help="resume from the latest checkpoint in --save-dir")
    p.flag("--export", default=None, help="write the trained weights, keyed by layer index, to this .pt file")
    p.flag("--trace", default=None, help="write a Chrome trace (Perfetto) of the last --trace-steps steps here")
    p.flag("--trace-steps", type=int, default=3, help="how many of the last steps --trace records")
    p.flag("--dist-timeout", type=int, default=600, help="seconds before a stuck collective or silent rank fails")
    import deepspeed
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def launch_env():
    """(world size, rank). Started without a launcher (`python train.py`), this is a one-rank run on
    this machine: DeepSpeed would otherwise look for MPI to find its peers."""
    mpi = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ and not mpi:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def ds_config(args, dp_world: int) -> dict:
    """ds_config.json (or --deepspeed_config) with the command-line overrides applied."""
    path = args.deepspeed_config or os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        raise UsageError(f"--deepspeed_config {path}: cannot read it ({e.strerror}); pass an existing JSON file") \
            from None
    except ValueError as e:
        raise UsageError(f"--deepspeed_config {path}: not valid JSON ({e}); fix the file") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"--deepspeed_config {path}: holds a JSON {type(cfg).__name__}, not an object; fix the file")
    if args.micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.gradient_accumulation_steps is not None:
        cfg["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    mbs, gas = cfg.get("train_micro_batch_size_per_gpu"), cfg.setdefault("gradient_accumulation_steps", 1)
    if isinstance(mbs, int) and isinstance(gas, int):  # validate() refuses anything else
        cfg["train_batch_size"] = mbs * gas * dp_world
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt.setdefault("params", {})
    new_type = {"adamw": "AdamW", "sgd": "SGD", None: opt.get("type", "AdamW")}[args.optimizer]
    if new_type.lower() != str(opt.get("type")).lower():  # another optimizer: the config's other params don't apply
        opt["type"], opt["params"] = new_type, {"lr": opt["params"].get("lr", 1e-3)}
    if args.lr is not None:
        opt["params"]["lr"] = args.lr
    if isinstance(cfg.get("scheduler"), dict):
        cfg["scheduler"].setdefault("params", {})["total_num_steps"] = args.steps
    if args.bf16:  # bf16 weights and activations, gradients accumulated in fp32 (DeepSpeed's BF16 optimizer)
        cfg["bf16"] = {"enabled": True}
        cfg.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    if args.pipeline_parallel_size and args.activation_checkpoint_interval:
        cfg.setdefault("pipeline", {})["activation_checkpoint_interval"] = args.activation_checkpoint_interval
    return cfg


def build_optimizer(cfg: dict, params):
    """DeepSpeed has no SGD, and its AdamW is a JIT-compiled op unless `torch_adam`: build a torch
    optimizer here for SGD and leave Adam/AdamW to DeepSpeed's config handling."""
    opt = cfg["optimizer"]
    if opt["type"].lower() != "sgd":
        opt["params"].setdefault("torch_adam", True)
        return None
    cfg.pop("optimizer")
    return __import__("torch").optim.SGD(params, **opt["params"])


# ---------------------------------------------------------------------------------------------
# Validation: every flag and the merged config, before any process waits on another
# ---------------------------------------------------------------------------------------------
def validate(args, cfg, world: int, on_cpu: bool):
    """Refuse bad input with a UsageError naming the flag (or config key) and the fix.

    Every rank runs this on the same flags, config and files before `init_distributed`, so every
    rank reaches the same verdict and none is left waiting on a peer that gave up. Returns the
    checkpoint to resume from, `(tag, what it was trained with)`, or None.
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
                               ("--n-layer", args.n_layer, 1), ("--deep-width", args.deep_width, 1),
                               ("--deep-depth", args.deep_depth, 1), ("--pipeline-parallel-size",
                                                                      args.pipeline_parallel_size, 0)):
        need(value is None or value >= least, f"{flag} {value} is below {least}: pass {flag} N with N >= {least}")
    need(0 <= args.dropout < 1, f"--dropout {args.dropout}: pass --dropout P with 0 <= P < 1")
    need(args.lr is None or args.lr > 0, f"--lr {args.lr}: pass a positive --lr")
    pp = args.pipeline_parallel_size
    need(not pp or world % pp == 0, f"--pipeline-parallel-size {pp} must divide the world size {world}: "
         f"launch a multiple of {pp} processes or change the flag")
    need(args.virtual_stages is None or args.pipeline_schedule == "interleaved",
         "--virtual-stages applies to --pipeline-schedule interleaved only")
    need(not args.trace or pp, "--trace records pipeline schedules: it needs --pipeline-parallel-size >= 1")
    need(not args.resume or args.save_dir, "--resume needs --save-dir DIR (the checkpoint directory to resume from)")
    if args.model == "gptlite":
        from gptlite import MODEL_SIZES
        need(args.model_size in MODEL_SIZES,
             f"--model-size {args.model_size!r} is unknown: choose from {', '.join(MODEL_SIZES)}")
    _validate_config(cfg, pp, on_cpu, need)
    _validate_pipeline(args, cfg["gradient_accumulation_steps"], need)
    for flag, path in (("--metrics-file", args.metrics_file), ("--export", args.export), ("--trace", args.trace)):
        if path:
            need(not os.path.isdir(path), f"{flag} {path}: is a directory; pass a file name")
            need(_creatable(os.path.dirname(os.path.abspath(path))), f"{flag} {path}: cannot create it here "
                 "(no write permission, or a file stands where a folder should); pass another path")
    if not args.save_dir:
        return None
    need(not os.path.exists(args.save_dir) or os.path.isdir(args.save_dir),
         f"--save-dir {args.save_dir}: is a file, not a directory; pass a directory")
    need(_creatable(args.save_dir), f"--save-dir {args.save_dir}: cannot write there; pass another directory")
    latest = os.path.join(args.save_dir, "latest")
    if not args.resume:
        need(not os.path.exists(latest), f"--save-dir {args.save_dir} already holds a checkpoint; pass --resume to "
             "continue it, or another --save-dir (nothing is overwritten)")
        return None
    return _validate_resume(args, cfg, world, need)


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


def layer_types(args):
    """The class name of every layer of the model, in order: what the pipeline partitions."""
    if args.model == "deep":
        return ["DeepBlock"] * args.deep_depth
    from dataclasses import replace

    import gptlite
    config = gptlite.MODEL_SIZES[args.model_size]
    config = replace(config, n_layer=args.n_layer or config.n_layer)
    return [cls.__name__ for cls, _ in gptlite.layer_specs(config)]


def model_stages(args):
    """How many stages the pipeline cuts the model into: stages x chunks per rank (DualPipe: p)."""
    from schedules.registry import schedule_spec
    pp = args.pipeline_parallel_size
    return schedule_spec(args.pipeline_schedule, args.virtual_stages).placement(pp).num_stages if pp else 0


def _validate_pipeline(args, micro_batches, need):
    """The schedule's own constraints (built once for stage 0) and enough layers for its model stages."""
    from schedules.registry import schedule_spec
    name, pp = args.pipeline_schedule, args.pipeline_parallel_size
    need(name == "1f1b" or pp >= 2, f"--pipeline-schedule {name} needs --pipeline-parallel-size >= 2")
    if not pp:
        return
    try:
        schedule_spec(name, args.virtual_stages).factory(micro_batches=micro_batches, stages=pp, stage_id=0)
    except ValueError as e:
        raise UsageError(f"--pipeline-schedule {name}: {e}") from None
    method = (args.partition_method or "parameters").lower()
    types = layer_types(args)
    need(method in ("parameters", "uniform") or (method.startswith("type:") and method[5:]),
         f"--partition-method {args.partition_method}: choose parameters, uniform or type:LAYER_CLASS")
    if method.startswith("type:"):
        need(any(re.search(method[5:], t, re.IGNORECASE) for t in types), f"--partition-method "
             f"{args.partition_method} matches "
             f"no layer of the model (its layer classes: {', '.join(dict.fromkeys(types))})")
    stages = model_stages(args)
    # GPTlite's layers: the blocks, the embeddings, the final norm and the head
    size, least = ("--n-layer", stages - 3) if args.model == "gptlite" else ("--deep-depth", stages)
    need(len(types) >= stages, f"--pipeline-schedule {name} at --pipeline-parallel-size {pp} cuts the model into "
         f"{stages} stages, but it has {len(types)} layers: pass {size} {least} or more, or fewer stages")


# ---------------------------------------------------------------------------------------------
# Checkpoints: what a run was trained with, written last, compared before loading
# ---------------------------------------------------------------------------------------------
RUN_FILE = "run.json"  # in each checkpoint folder, written after every rank's files: a checkpoint is complete


def placement(args):
    """Where the model's stages live: the checkpoint's layer files and optimizer state follow it. Two
    schedules with the same placement (1f1b, zb-h1, zb-h2; zb-v, dualpipev) resume each other."""
    from schedules.registry import schedule_spec
    pp = args.pipeline_parallel_size
    if not pp:
        return None
    spec = schedule_spec(args.pipeline_schedule, args.virtual_stages)
    where = spec.placement(pp)
    chunks = getattr(where, "chunks", 1)
    return {"module": spec.module or ("chunked" if chunks > 1 else "pipeline"),  # which PipelineModule saves them
            "stages": [[where.stage(r, c) for c in range(chunks)] for r in range(pp)]}  # rank -> its model stages


def run_record(args, cfg, world):
    """What a checkpoint records of the run that wrote it (compared on --resume)."""
    pp = args.pipeline_parallel_size
    model = ({"model": "deep", "deep_width": args.deep_width, "deep_depth": args.deep_depth} if args.model == "deep"
             else {"model": "gptlite", "model_size": args.model_size, "layers": len(layer_types(args))})
    from schedules.registry import schedule_spec
    chunks = getattr(schedule_spec(args.pipeline_schedule, args.virtual_stages).factory, "virtual_stages", None)
    return {"schedule": args.pipeline_schedule if pp else None, "virtual_stages": chunks if pp else None,
            "pipeline_parallel_size": pp, "data_parallel_size": world // max(pp, 1), "placement": placement(args),
            "model": model, "partition_method": (args.partition_method or "parameters").lower() if pp else None,
            "zero_stage": cfg.get("zero_optimization", {}).get("stage", 0), "optimizer": cfg["optimizer"]["type"],
            "bf16": bool(cfg.get("bf16", {}).get("enabled", False))}


def _validate_resume(args, cfg, world, need):
    """The checkpoint `latest` names is complete and undamaged (every file at its recorded size) and was
    trained with what this run uses, or with a difference a resume may make."""
    latest = os.path.join(args.save_dir, "latest")
    need(os.path.isfile(latest), f"--resume: no checkpoint in --save-dir {args.save_dir} (no 'latest' file); "
         "drop --resume to start afresh")
    with open(latest) as f:
        tag = f.read().strip()
    folder = os.path.join(args.save_dir, tag)
    need(tag and os.path.isdir(folder), f"--resume: {latest} names checkpoint {tag!r}, which is missing; write the "
         f"tag of a checkpoint in {args.save_dir} to {latest}")
    run_file = os.path.join(folder, RUN_FILE)
    need(os.path.isfile(run_file), f"--resume: {folder} is incomplete (no {RUN_FILE}: its save was interrupted, or "
         f"an older train.py wrote it); write the tag of a complete checkpoint to {latest}")
    try:
        with open(run_file) as f:
            saved = json.load(f)
        files, step = dict(saved.pop("files")), int(saved.pop("step"))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--resume: {run_file} is damaged ({e}); write the tag of another checkpoint to {latest}")
    for name, size in files.items():
        path = os.path.join(folder, name)
        need(os.path.isfile(path), f"--resume: checkpoint file {path} is missing; restore it or write the tag of "
             f"another checkpoint to {latest}")
        actual = os.path.getsize(path)
        need(actual == size, f"--resume: checkpoint file {path} is damaged ({actual} bytes, written with {size}); "
             f"restore it or write the tag of another checkpoint to {latest}")
    mismatch = resume_mismatch(saved, run_record(args, cfg, world), args)
    need(mismatch is None, f"--resume: {folder} {mismatch}")
    need(step < args.steps, f"--steps {args.steps}: the checkpoint is at step {step} already; pass --steps above "
         f"{step} to train on")
    return tag, saved


def resume_mismatch(saved, now, args):
    """None when a run with record `now` may resume a checkpoint with record `saved`, else which
    difference stops it and how to proceed."""
    def schedule(record):
        v = record.get("virtual_stages")
        return f"--pipeline-schedule {record['schedule']}" + (f" --virtual-stages {v}" if v else "")

    def flags_of(record):
        pp = record["pipeline_parallel_size"]
        return f"--pipeline-parallel-size {pp}" + (f" {schedule(record)}" if pp else "")

    pp = saved["pipeline_parallel_size"]
    if now["pipeline_parallel_size"] != pp:
        return (f"was trained {'without a pipeline' if not pp else f'with {pp} pipeline stages'}: pass "
                f"{flags_of(saved)}")
    if now["data_parallel_size"] != saved["data_parallel_size"]:
        return (f"was trained with {saved['data_parallel_size']} data-parallel replicas, this launch has "
                f"{now['data_parallel_size']}: launch {saved['data_parallel_size'] * max(pp, 1)} processes")
    if now["placement"] != saved["placement"]:
        same = [name + (f" --virtual-stages {saved['virtual_stages']}" if name == saved["schedule"] and
                        saved["virtual_stages"] else "")
                for name in _trainable() if placement(_with_schedule(args, name, saved)) == saved["placement"]]
        return (f"was trained with {schedule(saved)}, whose model stages sit elsewhere than with "
                f"{schedule(now)}: resume with --pipeline-schedule {' or '.join(same)}")
    if now["model"] != saved["model"]:
        want = saved["model"]
        flags = (f"--model deep --deep-width {want['deep_width']} --deep-depth {want['deep_depth']}"
                 if want["model"] == "deep" else f"--model-size {want['model_size']} (with {want['layers']} layers)")
        return f"holds another model: pass {flags}"
    for key, what, fix in (("partition_method", "--partition-method", "pass --partition-method {}"),
                           ("zero_stage", "ZeRO stage", "set zero_optimization.stage {} in --deepspeed_config"),
                           ("optimizer", "optimizer", "pass --optimizer {}")):
        if now[key] != saved[key]:
            value = saved[key].lower() if key == "optimizer" else saved[key]
            return f"was trained with {what} {saved[key]}, this run uses {now[key]}: {fix.format(value)}"
    if now["bf16"] != saved["bf16"]:
        return "was trained in bf16: pass --bf16" if saved["bf16"] else "was trained in fp32: drop --bf16"
    return None


def _trainable():
    from schedules.registry import available_schedules
    return [name for name, spec in available_schedules().items() if spec.trains]


def _with_schedule(args, name, saved):
    v = saved.get("virtual_stages") if name == saved["schedule"] else None
    return argparse.Namespace(**{**vars(args), "pipeline_schedule": name, "virtual_stages": v})


def save_checkpoint(engine, args, record, step):
    """Every rank writes its files; then rank 0 lists them with their sizes in run.json and points
    `latest` at the folder. Both are replaced atomically, after all files exist: a crash mid-save
    leaves `latest` on the previous, complete checkpoint."""
    import torch.distributed as dist
    tag = f"global_step{step}"
    folder = os.path.join(args.save_dir, tag)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(folder, RUN_FILE)):
        os.remove(os.path.join(folder, RUN_FILE))  # re-saving a tag: incomplete until written again
    engine.save_checkpoint(args.save_dir, tag=tag, client_state={"step": step}, save_latest=False)  # ends in a barrier
    if dist.get_rank() == 0:
        files = {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
                 for d, _, names in sorted(os.walk(folder)) for f in sorted(names) if f != RUN_FILE}
        _write_atomically(os.path.join(folder, RUN_FILE), json.dumps({**record, "step": step, "files": files}))
        _write_atomically(os.path.join(args.save_dir, "latest"), tag)


def _write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class _NamedFiles:
    """The engine's checkpoint engine, naming the file a load or a save failed on: each rank reads and
    writes its own files, so only that rank knows (Peers carries its line to rank 0)."""

    def __init__(self, inner, save_dir):
        self._inner, self._latest = inner, os.path.join(save_dir, "latest")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, *args, **kwargs):
        try:
            return self._inner.load(path, *args, **kwargs)
        except Exception as e:
            raise UsageError(f"--resume: checkpoint file {path} is damaged ({one_line(e)}); restore it or write the "
                             f"tag of another checkpoint to {self._latest}") from None

    def save(self, state_dict, path, *args, **kwargs):
        try:
            return self._inner.save(state_dict, path, *args, **kwargs)
        except Exception as e:
            raise Fault(f"--save-dir: cannot write {path} ({one_line(e)}); {self._latest} still names the last "
                        "complete checkpoint") from None


def load_checkpoint(engine, args, tag):
    """Load checkpoint `tag` (validated) into the engine; the step it was saved at."""
    path, client_state = engine.load_checkpoint(args.save_dir, tag=tag)
    if path is None:
        raise UsageError(f"--resume: DeepSpeed found no checkpoint {tag} in --save-dir {args.save_dir}")
    return client_state["step"]


# ---------------------------------------------------------------------------------------------
# Data: a function from (split, global micro-batch index) to one (inputs, labels) micro-batch
# ---------------------------------------------------------------------------------------------
def micro_batch_source(args, micro_batch_size: int, bf16: bool):
    if args.model == "deep":
        import torch

        from deep_model import synthetic_micro_batch
        dtype = torch.bfloat16 if bf16 else torch.float32  # float inputs and targets in the model's precision

        def deep_batch(split, index):
            x, y = synthetic_micro_batch(index + (1 << 30 if split == "val" else 0), micro_batch_size, args.deep_width,
                                         args.seed)
            return x.to(dtype), y.to(dtype)
        return deep_batch
    import data
    from gptlite import MODEL_SIZES
    tokens = data.load_tokens(args.dataset, args.data_file)
    windows = data.TokenWindows(tokens, MODEL_SIZES[args.model_size].block_size)
    return lambda split, index: windows.micro_batch(split, index, micro_batch_size, args.seed)


# ---------------------------------------------------------------------------------------------
# Distributed: the process group, and what ranks tell each other outside it
# ---------------------------------------------------------------------------------------------
def init_distributed(args, on_cpu):
    """gloo on CPU, nccl on GPUs. On CPU, DeepSpeed's shared-memory all-reduce op maps a 66 MB buffer per
    rank under /dev/shm when LOCAL_SIZE (which the deepspeed launcher sets) equals the world size, and
    nothing removes it when a rank dies. The op serves only inference_all_reduce (tensor-parallel
    inference), never training's all-reduce (gloo), so it is not given LOCAL_SIZE: it creates nothing."""
    import deepspeed
    hidden = os.environ.pop("LOCAL_SIZE", None) if on_cpu else None
    try:
        deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl",
                                   timeout=timedelta(seconds=args.dist_timeout))
    finally:
        if hidden is not None:
            os.environ["LOCAL_SIZE"] = hidden


class Peers:
    """What the ranks tell each other outside the collectives, through the rendezvous store (TCPStore
    clients of their own, with a short timeout): the run's failures in the order they happened, each
    a rank, an exit status and a one-line reason; and a heartbeat per rank.

    The first failure is the cause: a rank posts its reason before it exits, so before its peers see
    the connection close. A watcher thread beats, ends this rank as soon as another rank failed
    (whatever collective or store wait it is in), and on rank 0 ends the run when a rank has been
    silent for --dist-timeout seconds (killed, stopped, or stuck where no timeout applies)."""
    PREFIX, PERIOD, SILENT_S = "train.py/", 1.0, 3.0

    def __init__(self, rank, world, timeout_s):
        from torch.distributed import TCPStore
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._stores = threading.local()  # a client per thread: the main thread's and the watcher's
        self._connect = lambda: TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        self._ending, self._stop = threading.Lock(), threading.Event()
        self._heard = {}  # rank 0: rank -> (its last heartbeat, when that changed)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @property
    def store(self):
        if not hasattr(self._stores, "client"):
            self._stores.client = self._connect()
        return self._stores.client

    def close(self):
        """Stop watching (the run ended well): rank 0 no longer expects this rank's heartbeat."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(f"{self.PREFIX}beat/{self.rank}", "done")
        except Exception:
            pass

    def fail(self, status, reason, cause_unknown=False):
        """Post this rank's failure, then end the rank (rank 0 first prints the run's first failure).
        `cause_unknown`: the failure may be a peer's fault (a closed connection, a timeout)."""
        try:
            n = self.store.add(f"{self.PREFIX}failures", 1)
            self.store.set(f"{self.PREFIX}failure/{n}", json.dumps([self.rank, status, reason]))
            first = json.loads(self.store.get(f"{self.PREFIX}failure/1"))
        except Exception:  # the store went with rank 0
            first = [self.rank, status, reason]
        if first[0] == self.rank == 0 and cause_unknown:  # e.g. "connection closed by peer": whose fault?
            silent = self._silent(wait_s=self.SILENT_S + 1)
            if silent:
                first[2] = f"rank {silent} stopped responding (killed, crashed or stopped); rank 0 saw {reason}"
        self._end(*first, own_reason=reason)

    def _end(self, rank, status, reason, own_reason=None):
        with self._ending:  # the watcher and the main thread may both end the rank: one does
            if self.rank == 0:
                prefix = f"rank {rank}: " if rank != 0 and reason != own_reason else ""
                print(f"error: {prefix}{reason}", file=sys.stderr, flush=True)
                self._linger()
            else:
                try:
                    self.store.add(f"{self.PREFIX}read", 1)
                except Exception:
                    pass
            sys.stdout.flush()
            os._exit(status)

    def _linger(self, wait_s=5.0):
        """Rank 0 hosts the store: keep it up until the other ranks have read the failure."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if self.store.add(f"{self.PREFIX}read", 0) >= self.world - 1 - len(self._silent(as_list=True)):
                    return
            except Exception:
                return
            time.sleep(0.1)

    def _silent(self, wait_s=0.0, silent_s=None, as_list=False):
        """Rank 0: the ranks whose heartbeat has not changed for `silent_s` seconds, as "1, 3" (or a list),
        waiting up to `wait_s` seconds for one."""
        silent_s = self.SILENT_S if silent_s is None else silent_s
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            silent = sorted(r for r, (beat, since) in list(self._heard.items()) if beat != b"done" and
                            now - since >= silent_s)
            if silent or now >= deadline:
                return silent if as_list else ", ".join(map(str, silent))
            time.sleep(0.2)

    def _watch(self):
        try:
            self.store.set(f"{self.PREFIX}beat/{self.rank}", "0")
        except Exception:  # no store to reach as a client: failures end as this rank's own errors
            return
        beat, reachable = 0, time.monotonic()
        keys = [f"{self.PREFIX}beat/{r}" for r in range(self.world)]
        while not self._stop.wait(self.PERIOD if beat else 0):
            try:
                beat += 1
                self.store.set(keys[self.rank], str(beat))
                if self.store.add(f"{self.PREFIX}failures", 0):  # another rank failed: end this one too
                    first = json.loads(self.store.get(f"{self.PREFIX}failure/1"))
                    if first[0] != self.rank:
                        self._end(*first)
                if self.rank == 0 and self.store.check(keys):  # every rank beats: who went silent?
                    now = time.monotonic()
                    for r, value in enumerate(self.store.multi_get(keys)):
                        if r and (r not in self._heard or self._heard[r][0] != value):
                            self._heard[r] = (value, now)
                    stalled = self._silent(silent_s=self.timeout_s)
                    if stalled:
                        self.fail(1, f"rank {stalled} stopped responding for --dist-timeout {self.timeout_s} s "
                                     "(killed, stopped, or stuck), so the run ends")
                reachable = time.monotonic()
            except Exception:
                if time.monotonic() - reachable > max(10.0, self.timeout_s):  # rank 0, the store's host, is gone
                    os._exit(1)


PEERS = None  # set once the process group is up, for more than one rank


def one_line(e):
    """An exception as one line: its type and the first line of its message, without a C++ source location
    (gloo's `[.../pair.cc:553] Connection closed by peer [127.0.0.1]:49859. This is typically ...` ->
    `Connection closed by peer [127.0.0.1]:49859`)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\][\s.]*", "", lines[0] if lines else "")
    if text != (lines[0] if lines else ""):  # a message from C++ code: its first sentence says it
        text = text.split(". ")[0].rstrip(".")
    return f"{type(e).__name__}: {text}".rstrip(": ")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def build_model(args):
    pp = args.pipeline_parallel_size
    common = dict(pipeline_num_stages=pp, pipeline_spec_layers=args.pipeline_spec_layers,
                  activation_checkpoint_interval=args.activation_checkpoint_interval)
    if args.partition_method:
        common["partition_method"] = args.partition_method
    import schedules
    pipe_module = schedules.pipe_module(args.pipeline_schedule, args.virtual_stages)
    if pp and pipe_module is not None:  # the schedule needs its own PipelineModule (several chunks per rank)
        common["pipe_module"] = pipe_module
    try:
        if args.model == "deep":
            import deep_model
            model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, seed=args.seed, **common)
            return model, deep_model.mse_loss
        import gptlite
        if args.n_layer:
            common["n_layer"] = args.n_layer
        model = gptlite.get_model(model_size=args.model_size, dropout=args.dropout, seed=args.seed, **common)
        return model, gptlite.CrossEntropyLoss_FlatView
    except ValueError as e:  # e.g. a partition that leaves a model stage empty (every rank computes the same cut)
        raise UsageError(f"--pipeline-schedule {args.pipeline_schedule} at --pipeline-parallel-size {pp}: {e}") \
            from None


def export_weights(engine, args, path: str):
    """Gather the trained weights, keyed by global layer index, and save them from rank 0."""
    import torch
    import torch.distributed as dist

    from layers import layer_state_dict, pipe_layer_state_dict
    if args.pipeline_parallel_size:
        mine = pipe_layer_state_dict(engine.module) if engine.grid.get_data_parallel_rank() == 0 else {}
    else:
        mine = layer_state_dict(engine.module.to_layers()) if dist.get_rank() == 0 else {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({k: v for part in parts for k, v in part.items()}, path)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
class Trainer:
    """Steps and validation of one engine over this data-parallel rank's micro-batches."""

    def __init__(self, engine, criterion, batch_of, args, dp):
        import torch.distributed as dist
        self.engine, self.criterion, self.batch_of, self.dp = engine, criterion, batch_of, dp
        self.pipelined, self.eval_batches = bool(args.pipeline_parallel_size), args.eval_batches
        self.gas = engine.gradient_accumulation_steps()
        self.dp_rank = engine.grid.get_data_parallel_rank() if self.pipelined else dist.get_rank()
        self.samples = engine.train_micro_batch_size_per_gpu() * self.gas * dp  # per step
        self.tokens = self.samples * (1 if args.model == "deep" else batch_of("train", 0)[0].shape[1])

    def micro_batches(self, split, step):
        """This data-parallel rank's micro-batches of global batch `step`: the same set, in the same
        order, whatever the split of the world into pipeline stages and data-parallel ranks."""
        first = (step * self.dp + self.dp_rank) * self.gas
        return [self.batch_of(split, first + j) for j in range(self.gas)]

    def dp_mean(self, value):
        """Average over data-parallel ranks (non-pipelined path: every rank is one)."""
        import torch.distributed as dist
        if self.dp > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.dp
        return value

    def train_step(self, step):
        import torch
        engine, batches = self.engine, self.micro_batches("train", step)
        if self.pipelined:
            return engine.train_batch(iter(batches)).item()
        losses = []
        for x, y in batches:
            loss = self.criterion(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return self.dp_mean(torch.stack(losses).mean()).item()

    def evaluate(self):
        import torch
        engine, losses = self.engine, []
        for k in range(self.eval_batches):
            batches = self.micro_batches("val", k)
            if self.pipelined:
                losses.append(engine.eval_batch(iter(batches)).item())
            else:
                engine.eval()
                with torch.no_grad():
                    mean = torch.stack([self.criterion(engine(x.to(engine.device)), y.to(engine.device)).float()
                                        for x, y in batches]).mean()
                engine.train()
                losses.append(self.dp_mean(mean).item())
        return sum(losses) / len(losses)


class Progress:
    """Rank 0's account of the run: each step's JSON object in --metrics-file, and for a person a short
    line every --log-interval steps on stdout, `step 20/40: loss 8.4512, lr 1.00e-03, 812 ms, 2,519
    tok/s, 0:16 left`; validation lines say `validation`."""

    def __init__(self, args, rank, start):
        self.total, self.every, self.start, self.began = args.steps, args.log_interval, start, None
        self.metrics = None
        if rank == 0 and args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)
            self.metrics = open(args.metrics_file, "a" if args.resume else "w")
        self.rank = rank

    def log(self, record):
        if self.rank != 0:
            return
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        step = record["step"]
        if "loss" in record:
            if self.began is None:
                self.began = time.perf_counter() - record["iter_s"]
            if step % self.every == 0 or step in (self.total, self.start + 1):
                left = (time.perf_counter() - self.began) / (step - self.start) * (self.total - step)
                print(f"step {step}/{self.total}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
                      f"{record['iter_s'] * 1000:.0f} ms, {record['tokens_per_s']:,.0f} tok/s, "
                      f"{int(left) // 60}:{int(left) % 60:02d} left", flush=True)
        if "val_loss" in record:
            print(f"step {step}/{self.total}: validation loss {record['val_loss']:.4f}", flush=True)


def build_engine(args, cfg):
    """The model and its engine, for the schedule: (engine, criterion)."""
    import schedules
    model, criterion = build_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, scheduler = schedules.initialize(schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
                                                   trace=bool(args.trace), model=model,
                                                   optimizer=build_optimizer(cfg, trainable),
                                                   model_parameters=trainable, config=cfg)
    if getattr(scheduler, "last_batch_iteration", 0) < 0:  # DeepSpeed's schedulers start before iteration 0, at
        scheduler.step(0)  # learning rate 0, so the first step would not train: it trains at iteration 0's rate
    if args.save_dir:
        engine.checkpoint_engine = _NamedFiles(engine.checkpoint_engine, args.save_dir)
    return engine, criterion


def train(args, trainer, start, progress, record):
    """Steps `start` to --steps: validation, progress, checkpoints, the trace."""
    from schedules.observe.trace import RunTrace
    engine = trainer.engine
    if args.eval_interval and start == 0:
        progress.log({"step": 0, "val_loss": trainer.evaluate()})
    trace = RunTrace(engine, args.trace, steps=range(max(start, args.steps - args.trace_steps), args.steps),
                     meta={"schedule": args.pipeline_schedule, "stages": args.pipeline_parallel_size,
                           "model": args.model})
    for step in range(start, args.steps):
        lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step uses
        with trace.step(step):
            t0 = time.perf_counter()
            loss = trainer.train_step(step)
            dt = time.perf_counter() - t0
        entry = {"step": step + 1, "loss": loss, "lr": lr, "iter_s": dt,
                 "samples_per_s": trainer.samples / dt, "tokens_per_s": trainer.tokens / dt}
        last = step + 1 == args.steps
        if args.eval_interval and ((step + 1) % args.eval_interval == 0 or last):
            entry["val_loss"] = trainer.evaluate()
        progress.log(entry)
        if args.save_dir and (last or (args.save_interval and (step + 1) % args.save_interval == 0)):
            save_checkpoint(engine, args, record, step + 1)
    trace.save()


def main(argv=None):
    global PEERS
    args = parse_args(argv)
    world, rank = launch_env()
    from deepspeed.accelerator import get_accelerator
    on_cpu = get_accelerator().device_name() == "cpu"
    dp = world // max(args.pipeline_parallel_size, 1)
    cfg = ds_config(args, dp)
    resume = validate(args, cfg, world, on_cpu)
    record = run_record(args, cfg, world)
    import torch
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: one thread each when crowded
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    # data errors surface here, before any process waits on another
    batch_of = micro_batch_source(args, cfg["train_micro_batch_size_per_gpu"], bf16)

    init_distributed(args, on_cpu)
    PEERS = Peers(rank, world, args.dist_timeout) if world > 1 else None
    engine, criterion = build_engine(args, cfg)
    trainer = Trainer(engine, criterion, batch_of, args, dp)
    start = load_checkpoint(engine, args, resume[0]) if resume else 0
    train(args, trainer, start, Progress(args, rank, start), record)
    if args.export:
        export_weights(engine, args, args.export)
    if PEERS:
        PEERS.close()
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()  # join gloo's threads now, not in the interpreter's teardown


def run(argv=None):
    """main() with every failure reported as one line by rank 0: bad input exit status 2, anything
    else (a fault, a bug) 1; never a traceback."""
    from data import DataError
    try:
        main(argv)
    except (UsageError, DataError) as e:
        status, reason, cause_unknown = 2, str(e), False
    except Fault as e:
        status, reason, cause_unknown = 1, str(e), False
    except KeyboardInterrupt:
        status, reason, cause_unknown = 130, "interrupted", False
    except Exception as e:
        status, reason, cause_unknown = 1, one_line(e), True
    else:
        return
    if PEERS is not None:
        PEERS.fail(status, reason, cause_unknown)  # does not return
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {reason}", file=sys.stderr, flush=True)
    sys.exit(status)


if __name__ == "__main__":
    run()
