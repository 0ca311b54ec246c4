"""Train GPTlite (or the deep benchmark model) with DeepSpeed, with or without pipeline parallelism.

    python train.py --model-size tiny --steps 20                      # one process, no launcher
    deepspeed --num_gpus 2 train.py --pipeline-parallel-size 2        # 2-stage pipeline
    deepspeed --num_gpus 1 train.py --pipeline-parallel-size 0        # no pipeline

Reads top to bottom: flags -> DeepSpeed config -> validation -> data -> distributed -> (auto: profile
the layers, choose the schedule, planning.py) -> model -> engine -> loop. Pipelined steps are
`engine.train_batch()` over `gradient_accumulation_steps` micro-batches; the non-pipelined path runs
forward / `engine.backward` / `engine.step` over the very same micro-batches, so both report the same
losses for the same seed.

Failures end in one `error:` line from rank 0: bad input (exit status 2) is found by `validate()`
(validation.py) before any process waits on another; what only one rank can see (a damaged
checkpoint file, checkpoints.py) and faults (a rank killed or stalled: exit status 1) reach rank 0
through `Peers` (faults.py).
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time

import planning
from checkpoints import NamedFiles, check_resume, init_from, load_checkpoint, run_record, save_checkpoint
from faults import Fault, Peers, UsageError, one_line
from validation import validate

PEERS = None  # set once the process group is up, for more than one rank


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
    from schedules.registry import splitting_schedules, trainable_schedules
    trainable = sorted(trainable_schedules())
    p = _Parser(description=__doc__.splitlines()[0])
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.flag("--pipeline-parallel-size", "--pipeline-num-stages", type=int, default=0, dest="pipeline_parallel_size",
           help="pipeline stages; 0 = no pipeline. World size = data-parallel degree x this.")
    p.flag("--pipeline-spec-layers", action="store_true",
           help="build stages from LayerSpecs (each rank builds its own)")
    p.flag("--pipeline-schedule", default="1f1b", choices=trainable + ["auto"],
           help="pipeline schedule; auto: profile the layers on these ranks and pick the fastest predicted")
    p.flag("--max-activation-memory", type=float, default=None,
           help="auto: MiB of activation memory per rank that the chosen schedule's predicted peak stays under")
    p.flag("--virtual-stages", type=int, default=None, help="interleaved: model chunks per rank (default 2)")
    p.flag("--partition-method", default=None,
           help="DeepSpeed partition method (parameters, uniform, type:Block), or profile: balanced on measured "
                "per-layer costs")
    p.flag("--activation-checkpoint-interval", type=int, default=0, help="checkpoint every N blocks; 0 = off")
    p.flag("--vocab-parallel", action="store_true",
           help="GPTlite: split the vocabulary head and its loss over the pipeline ranks, one slice each (with a "
                f"schedule whose last chunk visits every rank: {', '.join(splitting_schedules())})")
    p.flag("--vocab-layout", default="auto", choices=["auto", "balanced", "even"],
           help="--vocab-parallel: each slice's rows and the share of them its backward recomputes. auto: fitted to "
                "the schedule on the measured layers where they are measured (--partition-method profile, "
                "--pipeline-schedule auto; the fastest predicted with the ranks' activation memory within 1.2x), "
                "else balanced: the slices alone even in time and memory; even: even rows, nothing recomputed")
    p.flag("--head", default="auto", choices=["auto", "chunked", "recompute", "linear"],
           help="GPTlite's whole vocabulary head and loss: chunked (the projection inside the loss, a chunk of the "
                "vocabulary at a time, the exponentials kept for the backward: exact, the fastest on CPU), recompute "
                "(the same, the logits computed again in the backward: a block of them held at a time, the least "
                "memory) or linear (nn.Linear and torch's cross-entropy, the fastest on a GPU); auto: the fastest "
                "where it runs")
    p.flag("--model", default="gptlite", choices=["gptlite", "deep"])
    p.flag("--model-size", default="small", help="GPTlite size: tiny, small, medium, gpt2")
    p.flag("--n-layer", type=int, default=None, help="GPTlite: override the size's number of blocks")
    p.flag("--block-size", type=int, default=None, help="GPTlite: override the size's context length (tokens)")
    p.flag("--moe-experts", type=int, default=0,
           help="GPTlite as a Mixture of Experts: this many expert MLPs in each block of --moe-blocks, DeepSpeed's "
                "top-k gate; 0 = dense")
    p.flag("--moe-blocks", default="all", help="which blocks carry experts: all, every:N (blocks N-1, 2N-1, ...) "
                                               "or indices, e.g. 1,3")
    p.flag("--moe-top-k", type=int, default=1, choices=[1, 2], help="experts per token")
    p.flag("--moe-capacity-factor", type=float, default=1.0,
           help="tokens an expert takes per micro-batch, as a multiple of an even share; 0 = none dropped")
    p.flag("--moe-aux-coef", type=float, default=0.01, help="weight of the gate's load-balancing loss")
    p.flag("--expert-parallel-size", type=int, default=1,
           help="shard each MoE block's experts over this many data-parallel ranks of its stage (all-to-all)")
    p.flag("--dualpipe-experts", default="duplicate", choices=["duplicate", "shard"],
           help="dualpipe: the two copies of a stage (ranks r and p-1-r) each hold all its experts, their gradients "
                "summed once a step (duplicate), or half of them each, exchanging tokens with an all-to-all in "
                "every pass (shard: half the experts' bytes; the all-to-all overlaps with --overlap on)")
    p.flag("--overlap", default="on", choices=["on", "off"],
           help="dualpipe, dualpipev: each forward-backward pair computes one pass while the other's expert "
                "all-to-all is in flight (off: one pass after the other)")
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
    p.flag("--resume", action="store_true", help="resume from the latest checkpoint in --save-dir (under any layout)")
    p.flag("--resume-from", default=None, help="resume from the latest checkpoint in this directory; saves go to "
           "--save-dir (with --steps at the checkpoint's step: save it under this run's layout, no training)")
    p.flag("--export", default=None, help="write the trained weights, keyed by layer index, to this .pt file")
    p.flag("--init-from", default=None, help="start from weights --export wrote (under any layout), a fresh optimizer")
    p.flag("--trace", default=None, help="write a Chrome trace (Perfetto) of the last --trace-steps steps here")
    p.flag("--trace-steps", type=int, default=3, help="how many of the last steps --trace records")
    p.flag("--trace-memory", action="store_true",
           help="--trace also counts the bytes saved for backward per rank (a counter track and each step's peak)")
    p.flag("--interlock", type=int, default=1,
           help="pipeline steps run back to back per call (engine.train_batches): each stage steps and goes on "
                "without waiting for the others; clipping post-validated. 1 = one step per call")
    p.flag("--post-validation", default="auto", choices=["auto", "ahead", "wait", "speculate"],
           help="with --interlock (ZeRO 0 and 1, fp32 and bf16; at ZeRO 0 in fp32 with clipping on): a stage whose "
                "own norm does not clip steps before the model's norm "
                "arrives (ahead: a backup, a rollback if the norm clips) or waits for it (wait); speculate: ahead, "
                "and the next step's passes run before the norm arrives (a step that clips is redone and the next "
                "one replayed: pays where clipping rarely bites); auto: ahead where the rank measured the norm's "
                "wait longer than the backup, and speculating while the slowest rank's wait exceeds a backup plus "
                "the clip rate times a step (decided alike on every rank). Same training either way")
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
    windows = data.TokenWindows(tokens, args.block_size or MODEL_SIZES[args.model_size].block_size)
    return lambda split, index: windows.micro_batch(split, index, micro_batch_size, args.seed)


# ---------------------------------------------------------------------------------------------
# Distributed: the process group, and what ranks tell each other outside it
# ---------------------------------------------------------------------------------------------
def init_distributed(args, on_cpu):
    """gloo on CPU, nccl on GPUs, --dist-timeout; no shared-memory buffer left in /dev/shm on CPU
    (schedules.init_distributed)."""
    import schedules
    schedules.init_distributed(timeout=args.dist_timeout, dist_backend="gloo" if on_cpu else "nccl")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def build_model(args):
    pp = args.pipeline_parallel_size
    common = dict(pipeline_num_stages=pp, pipeline_spec_layers=args.pipeline_spec_layers,
                  activation_checkpoint_interval=args.activation_checkpoint_interval)
    if args.partition_method and args.partition_method.lower() != "profile":
        common["partition_method"] = args.partition_method
    elif args.vocab_parallel:  # the trunk's layers by count: by parameters the embedding would take a stage alone
        common["partition_method"] = "uniform"
    if getattr(args, "partition_weights", None):  # --partition-method profile: the measured per-layer costs
        common["partition_weights"] = args.partition_weights
    import schedules
    pipe_module = schedules.pipe_module(args.pipeline_schedule, args.virtual_stages)
    if pp and pipe_module is not None:  # the schedule needs its own PipelineModule (several chunks per rank)
        common["pipe_module"] = pipe_module
    from schedules.runtime.moe import shared_by_copies
    from validation import experts_shared_by_copies, moe_config
    if args.moe_experts:
        common.update(moe_config(args))
    # DualPipe's two copies of a stage hold half its experts each (--dualpipe-experts shard)
    experts_shared = shared_by_copies(pp) if experts_shared_by_copies(args) else contextlib.nullcontext()
    try:
        if args.model == "deep":
            import deep_model
            with experts_shared:
                model = deep_model.get_model(width=args.deep_width, depth=args.deep_depth, seed=args.seed, **common)
            return model, deep_model.mse_loss
        import gptlite
        if args.n_layer:
            common["n_layer"] = args.n_layer
        if args.block_size:
            common["block_size"] = args.block_size
        with experts_shared:
            model = gptlite.get_model(model_size=args.model_size, dropout=args.dropout, seed=args.seed,
                                      head=args.head, vocab_parallel=bool(pp and args.vocab_parallel),
                                      vocab_recompute=getattr(args, "vocab_layout", "auto") != "even",
                                      vocab_layout=getattr(args, "vocab_fitted", None), **common)
        return model, gptlite.head_loss(args.head)
    except ValueError as e:  # e.g. a partition that leaves a model stage empty (every rank computes the same cut)
        raise UsageError(f"--pipeline-schedule {args.pipeline_schedule} at --pipeline-parallel-size {pp}: {e}") \
            from None


def export_weights(engine, args, path: str):
    """Gather the trained weights, keyed by global layer index, and save them from rank 0."""
    import torch
    import torch.distributed as dist

    from layers import layer_state_dict, pipe_layer_state_dict
    # data-parallel rank 0 of each stage exports it; ranks 1 .. E-1 the experts only they hold (E: expert parallel)
    dp_rank = engine.grid.get_data_parallel_rank() if args.pipeline_parallel_size else dist.get_rank()
    ep = args.expert_parallel_size if args.moe_experts else 1
    if dp_rank >= ep:
        mine = {}
    elif args.pipeline_parallel_size:
        mine = pipe_layer_state_dict(engine.module, experts_only=dp_rank > 0)
    else:
        mine = layer_state_dict(engine.module.to_layers(), experts_only=dp_rank > 0)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        weights = {k: v for part in parts for k, v in part.items()}
        if args.pipeline_parallel_size and args.vocab_parallel:  # the unsplit model's head, as without a pipeline
            from schedules.runtime.vocab_parallel import merge_slices
            from validation import layer_types
            pp = args.pipeline_parallel_size
            weights = merge_slices(weights, len(layer_types(args)) - pp, pp)
        torch.save(weights, path)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
class Trainer:
    """Steps and validation of one engine over this data-parallel rank's micro-batches."""

    def __init__(self, engine, criterion, batch_of, args, dp):
        import torch.distributed as dist
        self.engine, self.criterion, self.batch_of, self.dp = engine, criterion, batch_of, dp
        self.pipelined, self.eval_batches = bool(args.pipeline_parallel_size), args.eval_batches
        self.labels_ride = self.pipelined and args.vocab_parallel  # a split head: every slice needs the labels
        self.gas = engine.gradient_accumulation_steps()
        self.dp_rank = engine.grid.get_data_parallel_rank() if self.pipelined else dist.get_rank()
        self.samples = engine.train_micro_batch_size_per_gpu() * self.gas * dp  # per step
        self.tokens = self.samples * (1 if args.model == "deep" else batch_of("train", 0)[0].shape[1])

    def micro_batches(self, split, step):
        """This data-parallel rank's micro-batches of global batch `step`: the same set, in the same
        order, whatever the split of the world into pipeline stages and data-parallel ranks."""
        first = (step * self.dp + self.dp_rank) * self.gas
        batches = [self.batch_of(split, first + j) for j in range(self.gas)]
        if self.labels_ride:
            from schedules.runtime.vocab_parallel import with_labels
            batches = [with_labels(x, y) for x, y in batches]
        return batches

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

    def train_steps(self, step, count):
        """Steps `step` .. `step + count - 1` as one interlocked call (--interlock): (their losses, the
        learning rate each used)."""
        if count == 1 or not self.pipelined:
            lr = self.engine.optimizer.param_groups[0]["lr"]  # the rate this step uses
            return [self.train_step(step)], [lr]
        from schedules.runtime.interlock import train_batches
        batches = [b for s in range(step, step + count) for b in self.micro_batches("train", s)]
        losses, lrs = train_batches(self.engine, iter(batches), iterations=count)
        return [loss.item() for loss in losses], lrs

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
    tok/s, 0:16 left`; validation lines say `validation`. After `--pipeline-schedule auto`, the last step's line
    is followed by the pick's predicted step beside the measured one (the median after the first two steps)."""

    def __init__(self, args, rank, start):
        self.total, self.every, self.start, self.began = args.steps, args.log_interval, start, None
        self.predicted, self.times = getattr(args, "predicted_step_s", None), []
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
            if self.predicted:
                self.times.append(record["iter_s"])
            if step == self.total and len(self.times) > 2:
                ran = statistics.median(self.times[2:])
                print(f"auto: predicted {self.predicted * 1e3:.1f} ms per step, ran {ran * 1e3:.1f} ms "
                      f"({ran / self.predicted - 1:+.0%}; the median of steps {self.start + 3}-{step})", flush=True)
        if "val_loss" in record:
            print(f"step {step}/{self.total}: validation loss {record['val_loss']:.4f}", flush=True)


def build_engine(args, cfg, model=None):
    """The model (or `model`, a PipelineModule: planning's calibration) and its engine, for the schedule:
    (engine, criterion)."""
    import schedules
    model, criterion = build_model(args) if model is None else (model, None)
    from schedules.runtime.moe import moe_param_groups
    trainable = moe_param_groups(p for p in model.parameters() if p.requires_grad)
    from schedules.runtime.moe import ExpertPlacementError
    try:
        engine, _, _, scheduler = schedules.initialize(
            schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages, trace=bool(args.trace), model=model,
            optimizer=build_optimizer(cfg, trainable), model_parameters=trainable, config=cfg)
    except ExpertPlacementError as e:
        raise UsageError(f"--moe-blocks {args.moe_blocks} with --pipeline-schedule {args.pipeline_schedule} at "
                         f"--pipeline-parallel-size {args.pipeline_parallel_size}: {e} ("
                         + "--moe-blocks all, " * (args.moe_blocks != "all")
                         + "--partition-method uniform or type:Block, or more --n-layer)") from None
    if getattr(scheduler, "last_batch_iteration", 0) < 0:  # DeepSpeed's schedulers start before iteration 0, at
        scheduler.step(0)  # learning rate 0, so the first step would not train: it trains at iteration 0's rate
    if hasattr(engine, "post_validation"):
        engine.post_validation = args.post_validation
    if hasattr(engine, "overlap_pairs"):
        engine.overlap_pairs = args.overlap == "on"
    if args.save_dir:
        engine.checkpoint_engine = NamedFiles(engine.checkpoint_engine, args.save_dir)
    return engine, criterion


def interlocked_steps(args, step):
    """How many steps from `step` one call runs: --interlock, cut short so that every validation, checkpoint
    and the traced steps fall on a call's boundary (nothing of a step is pending there)."""
    count = min(args.interlock, args.steps - step)
    for every in (args.eval_interval, args.save_interval):
        if every:
            count = min(count, every - step % every)
    first_traced = args.steps - args.trace_steps
    if args.trace and step < first_traced:
        count = min(count, first_traced - step)
    return max(count, 1)


def train(args, trainer, start, progress, record):
    """Steps `start` to --steps: validation, progress, checkpoints, the trace."""
    from schedules.observe.trace import RunTrace
    engine = trainer.engine
    if args.eval_interval and start == 0:
        progress.log({"step": 0, "val_loss": trainer.evaluate()})
    trace = RunTrace(engine, args.trace, steps=range(max(start, args.steps - args.trace_steps), args.steps),
                     meta={"schedule": args.pipeline_schedule, "stages": args.pipeline_parallel_size,
                           "model": args.model, "vocab_parallel": bool(args.vocab_parallel)},
                     memory=args.trace_memory)
    step = start
    if start == args.steps and args.save_dir:  # --resume-from at its step: the checkpoint under this layout
        save_checkpoint(engine, args, record, start)
    while step < args.steps:
        count = interlocked_steps(args, step)
        with trace.step(step):
            t0 = time.perf_counter()
            losses, lrs = trainer.train_steps(step, count)
            dt = (time.perf_counter() - t0) / count  # an interlocked call's steps share its time
        for loss, lr in zip(losses, lrs):
            entry = {"step": step + 1, "loss": loss, "lr": lr, "iter_s": dt,
                     "samples_per_s": trainer.samples / dt, "tokens_per_s": trainer.tokens / dt}
            last = step + 1 == args.steps
            if args.eval_interval and ((step + 1) % args.eval_interval == 0 or last):
                entry["val_loss"] = trainer.evaluate()
            progress.log(entry)
            if args.save_dir and (last or (args.save_interval and (step + 1) % args.save_interval == 0)):
                save_checkpoint(engine, args, record, step + 1)
            step += 1
    trace.save()
    summary = post_validation_summary(engine)
    if summary and args.interlock > 1:
        print(f"rank {engine.global_rank}: {summary}", flush=True)


def post_validation_summary(engine):
    """What post-validation did on this rank (interlock.py's counters), in one line; None where the engine's step
    is not post-validated or validated nothing."""
    if not getattr(engine, "validations", 0):
        return None
    return (f"post-validation ({engine.post_validation}): {engine.validations} steps validated, "
            f"{engine.rollbacks} rolled back, {engine.waited} waited for the norm, {engine.speculated} speculated "
            f"past, {engine.replays} replayed, {engine.skipped} skipped")


def whole_head(args, device_type):
    """--head auto resolved: the fastest whole head on this device (gptlite.fastest_head); a split head or another
    model has no whole head to choose, and keeps the placeholder `chunked`."""
    if args.head != "auto":
        return args.head
    import gptlite
    return "chunked" if args.vocab_parallel or args.model != "gptlite" else gptlite.fastest_head(device_type)


def main(argv=None):
    global PEERS
    args = parse_args(argv)
    world, rank = launch_env()
    from deepspeed.accelerator import get_accelerator
    on_cpu = get_accelerator().device_name() == "cpu"
    args.head = whole_head(args, get_accelerator().device_name())
    dp = world // max(args.pipeline_parallel_size, 1)
    cfg = ds_config(args, dp)
    validate(args, cfg, world, on_cpu)
    resume = check_resume(args, cfg, world) if args.resume or args.resume_from else None  # (tag, its record)
    rows = resume[1].get("vocab_rows") if resume else None
    if rows and len(rows) == args.pipeline_parallel_size and args.vocab_parallel and args.vocab_layout == "auto":
        # the checkpoint's rows are kept, so it loads as written: their recompute fitted where the layers are
        # measured (planning.fit_vocab_layout), else slice_layout's
        from schedules.runtime.vocab_parallel import slice_layout
        args.kept_vocab_rows = rows
        args.vocab_fitted = (rows, slice_layout(sum(rows), len(rows))[1])
    import torch
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:  # ranks share the cores: one thread each when crowded
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    # data errors surface here, before any process waits on another
    batch_of = micro_batch_source(args, cfg["train_micro_batch_size_per_gpu"], bf16)

    init_distributed(args, on_cpu)
    PEERS = Peers(rank, world, args.dist_timeout) if world > 1 else None
    if planning.wanted(args):  # auto, --partition-method profile: measure the layers on these ranks, then choose
        choice = planning.plan(args, cfg, batch_of, rank, build_engine=build_engine)
        args.predicted_step_s = choice.pick.step if choice else None  # said beside the measured step at the end
    record = run_record(args, cfg, world)
    engine, criterion = build_engine(args, cfg)
    trainer = Trainer(engine, criterion, batch_of, args, dp)
    start = load_checkpoint(engine, args, *resume, record) if resume else 0
    if args.init_from:
        init_from(engine, args)
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
