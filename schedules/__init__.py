"""Pipeline schedules for DeepSpeed, selected by name (`train.py --pipeline-schedule NAME`), the
runtime that executes them, and their simulator.

    registry.py      name -> schedule class, engine, simulator placement (the one registry)
    simulate.py      runs every rank's instruction stream without a model -> timeline, idle, memory
    timeline.py      the timeline schema shared by simulated and traced runs; plot.py draws it
    instructions.py  BackwardInputPass (B) and BackwardWeightPass (W)
    weight_grad.py   the Linear layer whose weight gradients a W pass computes later
    engine.py        SplitBackwardEngine: a PipelineEngine subclass that runs B, W and async sends
    receive_ahead.py receives posted ahead per channel, in the order of the step's instructions
    ordered.py       a PipeSchedule written as one rank's order of F, B, W passes (any chunks)
    zero_bubble.py   ZB-H1, ZB-H2
    placement.py     where chunks live: interleaved, V, mirror
    module.py        ChunkedPipelineModule: several model chunks per rank
    chunked_engine.py ChunkedEngine: runs schedules over several chunks per rank
    interleaved.py   Interleaved 1F1B
    vshape.py        ZB-V, DualPipeV
    dualpipe.py      DualPipe
    trace.py         tracing real runs into timelines; the simulator's costs measured from them
    memory.py        the saved-tensor tracker, RSS, the machine a measurement ran on

`initialize(schedule, ...)` is the one entry point that builds the engine a schedule needs and
returns what `deepspeed.initialize` returns: `deepspeed.initialize` cannot be told which engine
class to build.
"""


def initialize(schedule="1f1b", model=None, optimizer=None, model_parameters=None, config=None, args=None,
               virtual_stages=None, trace=False, **kwargs):
    """`deepspeed.initialize(...)` for a model trained with pipeline schedule `schedule`.

    Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize does.
    A schedule registered without an engine class (DeepSpeed's own 1F1B) goes through
    deepspeed.initialize itself; the others are built the way deepspeed.initialize builds a
    PipelineEngine, with the registered engine class and the schedule class passed to it.
    `virtual_stages` picks the chunks per rank of `interleaved` (the model must be built with the
    matching module: gptlite.get_model(..., pipe_module=schedule_spec(...).pipe_module)).
    `trace=True` builds the engine class wrapped by schedules.trace.traced; set `engine.tracer`.
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from schedules.registry import available_schedules, schedule_spec

    if schedule not in available_schedules():
        raise ValueError(f"unknown pipeline schedule '{schedule}': choose from {', '.join(available_schedules())}")
    spec = schedule_spec(schedule, virtual_stages)
    if spec.engine is None and not (trace and isinstance(model, PipelineModule)):
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    config=config, **kwargs)
    if not isinstance(model, PipelineModule):
        raise ValueError(f"pipeline schedule '{schedule}' needs a PipelineModule (--pipeline-parallel-size >= 2)")
    from deepspeed import set_optimizer_flags
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    engine_cls = spec.engine
    if engine_cls is None:  # DeepSpeed's own engine, as deepspeed.initialize would pick it (to be traced)
        engine_cls = DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine
    else:
        kwargs["schedule_cls"] = spec.factory
    if trace:
        from schedules.trace import traced
        engine_cls = traced(engine_cls)
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    set_optimizer_flags(config_class, model)
    engine = engine_cls(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, mpu=mpu,
                        config=config, config_class=config_class, **kwargs)
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
