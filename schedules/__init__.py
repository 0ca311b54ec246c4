"""Pipeline schedules for DeepSpeed, selected by name (`train.py --pipeline-schedule NAME`), the
runtime that executes them, their simulator and the tools that observe real runs.

The folders are the architecture; dependencies point up this list, never down it:

    passes.py, instructions.py, placement.py, lowering.py, errors.py
                     the vocabulary: typed passes, the B / W / paired instructions and the one
                     instruction -> pass-kind table, where chunks live, the lowering of a per-rank
                     order of passes to DeepSpeed instructions
    definitions/     the schedules, one file per family (ZB-H1/H2, Interleaved 1F1B, ZB-V and
                     DualPipeV, DualPipe), each a named OrderedSchedule subclass
    registry.py      the one table: name -> schedule class, placement, engine and module names
    runtime/         the engines that run the instructions, the chunked PipelineModule, deferred
                     weight gradients, receives posted ahead
    simulator/       every rank's instruction stream run without a model -> Timeline, idle, memory
    observe/         tracing real runs into Timelines, plots, memory measurement

The runtime and the simulator both read the vocabulary and never each other. docs/architecture.md
draws the data flow and gives the reading paths.

    planner/         per-layer profiles of a model on its device, composed into any cut and
                     placement, and the chooser that simulates every schedule on them

`choose(profile, stages, micro_batches, ...)` ranks the schedules for a run from a measured profile
(`train.py --pipeline-schedule auto` uses it; docs/choosing.md).

`init_distributed(timeout=...)` starts the process group as `deepspeed.init_distributed` does, without
leaving DeepSpeed's CPU shared-memory buffers in /dev/shm. `initialize(schedule, ...)` is the one entry
point that builds the engine a schedule needs and
returns what `deepspeed.initialize` returns: `deepspeed.initialize` cannot be told which engine
class to build. `pipeline_module(schedule, layers, ...)` builds the PipelineModule the schedule needs from
your layer list (`pipe_module(schedule)`: what builds it).
"""


def choose(profile, stages, micro_batches, max_activation_memory=None, cuts=None):
    """Rank every trainable schedule (each valid v, each cut) for `stages` ranks and `micro_batches` per
    step by its predicted step time on `profile` (a schedules.planner.profile.Profile, or the path of its
    JSON); `max_activation_memory` in MiB per rank drops those predicted to exceed it. Returns a
    schedules.planner.choose.Choice (`.pick` is the first; `schedules.planner.choose.table(choice)` the
    table). Raises ValueError for p < 2, and NoScheduleFits (a ValueError) when nothing is within the budget."""
    from schedules.planner.choose import CUTS
    from schedules.planner.choose import choose as rank
    from schedules.planner.profile import Profile
    if not isinstance(profile, Profile):
        profile = Profile.load(profile)
    return rank(profile, stages, micro_batches, max_activation_memory, cuts=cuts or CUTS)


def init_distributed(timeout=None, dist_backend=None, **kwargs):
    """`deepspeed.init_distributed(...)` for training: gloo on CPU, the accelerator's backend (nccl) on
    GPUs, `timeout` in seconds (or a timedelta; None: DeepSpeed's default) before a stuck collective fails.
    Other keyword arguments go to deepspeed.init_distributed. Call it instead of deepspeed.init_distributed.

    On CPU, DeepSpeed's shared-memory all-reduce op maps a 66 MB buffer per rank under /dev/shm when
    LOCAL_SIZE (which the deepspeed launcher sets) equals the world size, and nothing removes it, at a
    normal exit or when a rank dies. The op serves only inference_all_reduce (tensor-parallel inference),
    never training's collectives (gloo), so it is initialised without LOCAL_SIZE: it creates nothing."""
    global _SHARED_MEMORY_AVOIDED
    import os
    from datetime import timedelta

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    on_cpu = get_accelerator().device_name() == "cpu"
    if dist_backend is None:
        dist_backend = "gloo" if on_cpu else get_accelerator().communication_backend_name()
    if timeout is not None:
        kwargs["timeout"] = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    hidden = os.environ.pop("LOCAL_SIZE", None) if on_cpu else None
    try:
        deepspeed.init_distributed(dist_backend=dist_backend, **kwargs)
    finally:
        if hidden is not None:
            os.environ["LOCAL_SIZE"] = hidden
    _SHARED_MEMORY_AVOIDED = True


_SHARED_MEMORY_AVOIDED = False  # init_distributed started the process group: DeepSpeed mapped no buffer


def pipeline_module(schedule, layers, virtual_stages=None, **kwargs):
    """The PipelineModule that `schedule` needs, over your layer list: LayerSpecs, TiedLayerSpecs,
    modules and callables, as deepspeed.pipe.PipelineModule takes them, with every PipelineModule
    argument (`num_stages`, `loss_fn`, `partition_method`, `seed_layers`, `base_seed`,
    `activation_checkpoint_interval`, `checkpointable_layers`, ...). Train it with `initialize(schedule, ...)`.

    Built without autograd recording: PipelineModule's constructor broadcasts each tied weight from its
    first stage in place (`_synchronize_tied_weights`), and under grad mode autograd's fallback for
    c10d::broadcast_ (an op without an autograd kernel) hooks onto the weight a warning that every backward
    through it raised ("an autograd kernel was not registered ... silently incorrect behavior"). The hook
    left the gradient unchanged (tests/test_own_model_example.py: the tied model trains as in one process,
    built either way); the broadcast only copies initial values, which no gradient is meant to flow through.
    """
    import torch

    from schedules.runtime.pipe_module import LayerPipe
    build = pipe_module(schedule, virtual_stages) or LayerPipe
    with torch.no_grad():
        return build(layers=layers, **kwargs)


def pipe_module(schedule, virtual_stages=None):
    """What builds the PipelineModule `schedule` needs from a layer list, `(layers, **PipelineModule
    kwargs)`; None where a PipelineModule with one stage per rank serves (pass it to the models'
    `get_model(..., pipe_module=...)`)."""
    from schedules.registry import schedule_spec
    from schedules.runtime import pipe_module as module_of
    return module_of(schedule_spec(schedule, virtual_stages))


def initialize(schedule="1f1b", model=None, optimizer=None, model_parameters=None, config=None, args=None,
               virtual_stages=None, trace=False, **kwargs):
    """`deepspeed.initialize(...)` for a model trained with pipeline schedule `schedule`.

    Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize does.
    A schedule registered without an engine class (DeepSpeed's own 1F1B) goes through
    deepspeed.initialize itself; the others are built the way deepspeed.initialize builds a
    PipelineEngine, with the registered engine class and the schedule class passed to it. A model
    that is not a PipelineModule (no pipeline), in fp32 at ZeRO 0 or 1, gets LeanEngine
    (schedules/runtime/lean_engine.py): DeepSpeed's engine with our engines' lean step end.
    `virtual_stages` picks the chunks per rank of `interleaved` (the model must be built with the
    matching module: gptlite.get_model(..., pipe_module=schedules.pipe_module(schedule, virtual_stages))).
    `trace=True` builds the engine class wrapped by schedules.observe.trace.traced; set `engine.tracer`.
    Mixture-of-Experts layers (ExpertLayer): their expert groups are made on every rank first (a layout where some
    rank holds none is refused: ExpertPlacementError), and their aux loss's gradient scale comes from the engine,
    the 1 / gradient-accumulation steps it scales the model's loss by.
    """
    from deepspeed.pipe import PipelineModule

    from schedules.runtime.moe import prepare_expert_groups, scale_aux_losses
    prepare_expert_groups(model, model._topo.get_dim("pipe") if isinstance(model, PipelineModule) else 1)
    if optimizer is None and model_parameters is not None:  # the config's optimizer: experts in groups of their own
        from schedules.runtime.moe import moe_param_groups
        model_parameters = moe_param_groups(model_parameters)
    built = _initialize(schedule, model, optimizer, model_parameters, config, args, virtual_stages, trace, **kwargs)
    scale_aux_losses(built[0].module, 1.0 / built[0].gradient_accumulation_steps())
    return built


def _initialize(schedule, model, optimizer, model_parameters, config, args, virtual_stages, trace, **kwargs):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from schedules.registry import available_schedules, schedule_spec
    from schedules.runtime import engine_class
    from schedules.runtime.weight_grad import make_deferrable

    if schedule not in available_schedules():
        raise ValueError(f"unknown pipeline schedule '{schedule}': choose from {', '.join(available_schedules())}")
    spec = schedule_spec(schedule, virtual_stages)
    engine_cls = engine_class(spec)
    if engine_cls is None and not isinstance(model, PipelineModule) and _lean_applies(config, args, kwargs):
        built = _lean_engine(args, model, optimizer, model_parameters, config, **kwargs)
        _remove_shared_memory_buffer()
        return built
    if engine_cls is None and not (trace and isinstance(model, PipelineModule)):
        built = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                     config=config, **kwargs)
        _warn_first_stage_clipping(built[0], spec)
        _remove_shared_memory_buffer()
        return built
    if not isinstance(model, PipelineModule):
        raise ValueError(f"pipeline schedule '{schedule}' needs a PipelineModule (--pipeline-parallel-size >= 2)")
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    ours = engine_cls is not None  # our engines take the schedule class, and may split the backward
    if ours:
        kwargs["schedule_cls"] = spec.factory
        deferrable = make_deferrable(model)  # plain torch.nn.Linear layers too, in place
    else:  # DeepSpeed's own engine, as deepspeed.initialize would pick it (to be traced)
        engine_cls = DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine
    if trace:
        from schedules.observe.trace import traced
        engine_cls = traced(engine_cls)
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, model)
    engine = engine_cls(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, mpu=mpu,
                        config=config, config_class=config_class, **kwargs)
    engine._configure_python_gc()
    if ours:
        _report_deferral(engine, spec, *deferrable)
    else:
        _warn_first_stage_clipping(engine, spec)
    _remove_shared_memory_buffer()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _lean_applies(config, args, kwargs):
    """Whether a model that is not pipelined is built as deepspeed.initialize builds it but with
    schedules.runtime.lean_engine.LeanEngine: a config dict in fp32 at ZeRO 0 or 1, nothing that makes
    deepspeed.initialize build another engine or another mesh. Elsewhere deepspeed.initialize itself."""
    if not isinstance(config, dict) or getattr(args, "deepspeed_config", None) or \
            set(kwargs) - {"training_data", "lr_scheduler", "collate_fn", "mpu", "dist_init_required"}:
        return False
    zero = config.get("zero_optimization", {}).get("stage", 0)
    return (zero in (0, 1) and not any(config.get(k, {}).get("enabled") for k in ("fp16", "bf16", "hybrid_engine"))
            and not config.get("tensor_parallel", {}).get("autotp_size")
            and not ("sequence_parallel_size" in config and "data_parallel_size" in config))


def _lean_engine(args, model, optimizer, model_parameters, config, **kwargs):
    """deepspeed.initialize's build of a model that is not pipelined (DeepSpeed 0.19.8), the engine LeanEngine."""
    from deepspeed import comm as dist
    from deepspeed import set_optimizer_flags
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    from schedules.runtime.lean_engine import LeanEngine
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          dist_init_required=kwargs.get("dist_init_required"))
    config_class = DeepSpeedConfig(config, kwargs.get("mpu"))
    set_optimizer_flags(config_class, model)
    engine = LeanEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, config=config,
                        config_class=config_class, **kwargs)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _remove_shared_memory_buffer():
    """A process group started by deepspeed.init_distributed itself (not init_distributed above) under the
    deepspeed launcher on CPU has mapped this rank's 66 MB buffer under /dev/shm, which DeepSpeed never
    removes. Once every rank has opened every buffer (they do so within deepspeed.init_distributed: the
    barrier makes sure), the name is removed: the op keeps its mapping, the memory goes with the process,
    whether it exits or is killed. Named as csrc/cpu/comm/shm.cpp names it."""
    import os

    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    if _SHARED_MEMORY_AVOIDED or not dist.is_initialized() or get_accelerator().device_name() != "cpu":
        return
    world = dist.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # the op's own test (shm_interface.cpp), alike on every rank
        return
    dist.barrier()
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _warn_first_stage_clipping(engine, spec):
    """DeepSpeed 0.19.8's own pipeline engines with ZeRO 0 in fp32 clip by the first stage's gradient norm:
    `runtime/utils.clip_grad_norm_` counts only the parameters of model-parallel rank 0 (or marked
    tensor-parallel), and in a pipeline grid the model-parallel group is the pipeline, so rank 0 is the
    first stage. One warning (global rank 0) naming the fix; the training itself is DeepSpeed's."""
    import sys

    from deepspeed.runtime.pipe.engine import PipelineEngine
    # the condition of DeepSpeedEngine._take_model_step's call of clip_fp32_gradients
    if not (isinstance(engine, PipelineEngine) and engine.num_stages > 1 and engine.gradient_clipping() > 0
            and not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
            and engine.global_rank == 0):
        return
    print(f"[schedules] {spec.name}: warning: DeepSpeed's own pipeline engine with ZeRO 0 clips every stage by "
          f"the first stage's gradient norm, not the model's (gradient_clipping {engine.gradient_clipping()}); "
          f"for the whole model's norm use ZeRO stage 1 or one of our engines (e.g. --pipeline-schedule 1f1b-lean, "
          f"the same 1F1B order)", file=sys.stderr, flush=True)


def _report_deferral(engine, spec, layers, elements, total):
    """One line per stage (from its first data-parallel rank): what share of the stage's weight-gradient
    work its W passes take; a warning when the schedule splits the backward but nothing can be deferred."""
    import sys

    from schedules.instructions import BackwardInputPass
    if engine.grid.get_data_parallel_rank() != 0:
        return
    schedule = spec.factory(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)
    if not any(type(cmd) is BackwardInputPass for step in schedule.steps() for cmd in step):
        return  # every backward is fused: nothing is deferred, by design
    where = f"[schedules] {spec.name}, stage {engine.stage_id} of {engine.num_stages}"
    if layers == 0:
        print(f"{where}: warning: the schedule defers weight gradients to W passes, but this stage has no "
              f"torch.nn.Linear (or nn.Embedding) to defer, so its W passes do nothing and the split gains nothing "
              f"(docs/architecture.md: making a layer deferrable)", file=sys.stderr, flush=True)
        return
    in_place = (", added into .grad by their multiply (fp32, one data-parallel rank)"
                if getattr(engine, "_in_place", False) else "")
    print(f"{where}: the weight gradients of {layers} linear and embedding layers, {elements / total:.0%} of the "
          f"stage's trainable parameters, are deferrable to W passes{in_place}", file=sys.stderr, flush=True)


# The split vocabulary head (schedules/runtime/vocab_parallel.py), imported on first use: it imports torch.
_VOCAB_PARALLEL = ("VocabSlice", "vocab_parallel_loss", "with_labels", "merge_slices", "splitting_schedules")
# The whole head and its loss in chunks of the vocabulary (schedules/runtime/chunked_head.py), likewise.
_CHUNKED_HEAD = ("ChunkedHead", "chunked_head_loss", "linear_cross_entropy", "head_output")
# Mixture-of-Experts layers (schedules/runtime/moe.py), likewise: they import DeepSpeed's MoE.
_MOE = ("ExpertLayer", "moe_param_groups")


def __getattr__(name):
    if name in _VOCAB_PARALLEL:
        from schedules.runtime import vocab_parallel
        return getattr(vocab_parallel, name)
    if name in _CHUNKED_HEAD:
        from schedules.runtime import chunked_head
        return getattr(chunked_head, name)
    if name in _MOE:
        from schedules.runtime import moe
        return getattr(moe, name)
    raise AttributeError(f"module 'schedules' has no attribute {name!r}")
