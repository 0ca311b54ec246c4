"""Train GPTlite (or the deep benchmark model) with DeepSpeed, with or without pipeline parallelism.

    deepspeed --num_gpus 2 train.py --pipeline-parallel-size 2        # 2-stage pipeline
    deepspeed --num_gpus 1 train.py --pipeline-parallel-size 0        # no pipeline

Reads top to bottom: flags -> DeepSpeed config -> data -> distributed -> model -> engine -> loop.
Pipelined steps are `engine.train_batch()` over `gradient_accumulation_steps` micro-batches;
the non-pipelined path runs forward / `engine.backward` / `engine.step` over the very same
micro-batches, so both report the same losses for the same seed.
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta


class UsageError(Exception):
    """Bad flags or launch: printed as one line by rank 0, exit status 2."""


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
    p.flag("--steps", type=int, default=100, help="optimizer steps")
    p.flag("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    p.flag("--optimizer", choices=["adamw", "sgd"], default=None, help="overrides ds_config.json")
    p.flag("--lr", type=float, default=None, help="overrides ds_config.json")
    p.flag("--micro-batch-size", type=int, default=None, help="overrides ds_config.json")
    p.flag("--gradient-accumulation-steps", type=int, default=None, help="micro-batches per step; overrides config")
    p.flag("--bf16", action="store_true", help="train in bf16 (GPUs; overrides config)")
    p.flag("--dataset", default=None, help="Hugging Face hub dataset id, e.g. karpathy/tiny_shakespeare")
    p.flag("--data-file", default=None, help="a local text file to train on")
    p.flag("--eval-interval", type=int, default=0, help="validation every N steps (and at start and end); 0 = never")
    p.flag("--eval-batches", type=int, default=2, help="batches of micro-batches per validation")
    p.flag("--metrics-file", default=None, help="JSON lines written by rank 0, one object per step")
    p.flag("--save-dir", default=None, help="DeepSpeed checkpoint directory")
    p.flag("--save-interval", type=int, default=0, help="save every N steps (and at the end); 0 = at the end only")
    p.flag("--resume", action="store_true", help="resume from the latest checkpoint in --save-dir")
    p.flag("--export", default=None, help="write the trained weights, keyed by layer index, to this .pt file")
    p.flag("--trace", default=None, help="write a Chrome trace (Perfetto) of the last --trace-steps steps here")
    p.flag("--trace-steps", type=int, default=3, help="how many of the last steps --trace records")
    p.flag("--dist-timeout", type=int, default=600, help="seconds before a stuck collective fails")
    import deepspeed
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    pp = args.pipeline_parallel_size
    if pp < 0 or (pp and world % pp):
        raise UsageError(f"--pipeline-parallel-size {pp} must divide the world size {world}: "
                         f"launch a multiple of {pp} processes or change the flag")
    if args.virtual_stages is not None and args.pipeline_schedule != "interleaved":
        raise UsageError("--virtual-stages applies to --pipeline-schedule interleaved only")
    if args.trace and not pp:
        raise UsageError("--trace records pipeline schedules: it needs --pipeline-parallel-size >= 1")
    if args.resume and not args.save_dir:
        raise UsageError("--resume needs --save-dir DIR (the checkpoint directory to resume from)")
    if args.model == "gptlite":
        from gptlite import MODEL_SIZES
        if args.model_size not in MODEL_SIZES:
            raise UsageError(f"--model-size {args.model_size!r} is unknown: choose from {', '.join(MODEL_SIZES)}")
    return args


def ds_config(args, dp_world: int) -> dict:
    """ds_config.json (or --deepspeed_config) with the command-line overrides applied."""
    path = args.deepspeed_config or os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if args.micro_batch_size:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.gradient_accumulation_steps:
        cfg["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp_world
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    new_type = {"adamw": "AdamW", "sgd": "SGD", None: opt["type"]}[args.optimizer]
    if new_type.lower() != opt["type"].lower():  # another optimizer: the config's other params don't apply
        opt["type"], opt["params"] = new_type, {"lr": opt["params"].get("lr", 1e-3)}
    if args.lr is not None:
        opt["params"]["lr"] = args.lr
    if "scheduler" in cfg:
        cfg["scheduler"]["params"]["total_num_steps"] = args.steps
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


def check_schedule(args, stages: int, micro_batches: int):
    """Build the schedule once for stage 0 so that its constraints fail here, on every rank alike."""
    from schedules.registry import schedule_spec
    name = args.pipeline_schedule
    if name != "1f1b" and stages < 2:
        raise UsageError(f"--pipeline-schedule {name} needs --pipeline-parallel-size >= 2")
    if stages:
        try:
            schedule_spec(name, args.virtual_stages).factory(micro_batches=micro_batches, stages=stages, stage_id=0)
        except ValueError as e:
            raise UsageError(f"--pipeline-schedule {name}: {e}") from None


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
    if args.model == "deep":
        import deep_model
        model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, seed=args.seed, **common)
        return model, deep_model.mse_loss
    import gptlite
    if args.n_layer:
        common["n_layer"] = args.n_layer
    model = gptlite.get_model(model_size=args.model_size, dropout=args.dropout, seed=args.seed, **common)
    return model, gptlite.CrossEntropyLoss_FlatView


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
        torch.save({k: v for part in parts for k, v in part.items()}, path)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import schedules
    from schedules.observe.trace import RunTrace

    world = int(os.environ.get("WORLD_SIZE", 1))
    pp = args.pipeline_parallel_size
    dp = world // max(pp, 1)
    cfg = ds_config(args, dp)
    mbs, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    check_schedule(args, pp, gas)
    on_cpu = get_accelerator().device_name() == "cpu"
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: one thread each when crowded
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # data errors surface here, before any process waits on another
    batch_of = micro_batch_source(args, mbs, cfg.get("bf16", {}).get("enabled", False))

    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl", timeout=timedelta(seconds=args.dist_timeout))
    rank = dist.get_rank()
    model, criterion = build_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = schedules.initialize(schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
                                           trace=bool(args.trace), model=model,
                                           optimizer=build_optimizer(cfg, trainable), model_parameters=trainable,
                                           config=cfg)
    dp_rank = engine.grid.get_data_parallel_rank() if pp else rank

    def my_micro_batches(split, step):
        """This data-parallel rank's micro-batches of global batch `step`: the same set, in the same
        order, whatever the split of the world into pipeline stages and data-parallel ranks."""
        first = (step * dp + dp_rank) * gas
        return [batch_of(split, first + j) for j in range(gas)]

    def dp_mean(value):
        """Average over data-parallel ranks (non-pipelined path: every rank is one)."""
        if dp > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= dp
        return value

    def train_step(step):
        batches = my_micro_batches("train", step)
        if pp:
            return engine.train_batch(iter(batches)).item()
        losses = []
        for x, y in batches:
            loss = criterion(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return dp_mean(torch.stack(losses).mean()).item()

    def evaluate():
        losses = []
        for k in range(args.eval_batches):
            batches = my_micro_batches("val", k)
            if pp:
                losses.append(engine.eval_batch(iter(batches)).item())
            else:
                engine.eval()
                with torch.no_grad():
                    mean = torch.stack([criterion(engine(x.to(engine.device)), y.to(engine.device)).float()
                                        for x, y in batches]).mean()
                engine.train()
                losses.append(dp_mean(mean).item())
        return sum(losses) / len(losses)

    start = 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise UsageError(f"--resume: no checkpoint found in --save-dir {args.save_dir}")
        start = client_state["step"]
    for path in (args.metrics_file, args.export):
        if path and rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    metrics = open(args.metrics_file, "a" if args.resume else "w") if args.metrics_file and rank == 0 else None

    def log(record):
        if rank == 0:
            print(json.dumps(record), flush=True)
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()

    samples = mbs * gas * dp
    tokens = samples * (1 if args.model == "deep" else batch_of("train", 0)[0].shape[1])
    if args.eval_interval and start == 0:
        log({"step": 0, "val_loss": evaluate()})
    trace = RunTrace(engine, args.trace, steps=range(max(start, args.steps - args.trace_steps), args.steps),
                     meta={"schedule": args.pipeline_schedule, "stages": pp, "model": args.model})
    for step in range(start, args.steps):
        lr = engine.optimizer.param_groups[0]["lr"]  # the rate this step uses
        with trace.step(step):
            t0 = time.perf_counter()
            loss = train_step(step)
            dt = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss, "lr": lr, "iter_s": dt,
                  "samples_per_s": samples / dt, "tokens_per_s": tokens / dt}
        last = step + 1 == args.steps
        if args.eval_interval and ((step + 1) % args.eval_interval == 0 or last):
            record["val_loss"] = evaluate()
        log(record)
        if args.save_dir and (last or (args.save_interval and (step + 1) % args.save_interval == 0)):
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1})
    if args.export:
        export_weights(engine, args, args.export)
    trace.save()
    dist.barrier()
    dist.destroy_process_group()  # join gloo's threads now, not in the interpreter's teardown


def run():
    """main() with bad input reported as one line from rank 0 (exit 2), never a traceback."""
    from data import DataError
    try:
        main()
    except (UsageError, DataError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
