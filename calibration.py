"""What the engine itself costs on this job's ranks, for `--pipeline-schedule auto` (planning.measure): per pass,
per step, and per parameter stepped.

A layer's profile times its passes and the optimizer's arithmetic; the engine adds its own work around both: per
pass its instruction handler (the micro-batch's buffers, DeepSpeed's forward wrapper, the loss on the last stage)
and the loop between instructions; per step its step instructions (the reduction, the norm in fp64, the clipping,
the optimizer, the gradients zeroed). Here the engine runs, traced, on this job's ranks with its config: a model of
one width-8 layer a stage, whose passes are almost nothing but the engine's work, built twice, without and with a
`bank` of parameters the forward never reads, as many as a rank of the real model holds. The first step's time
is the step's fixed cost; the second's, less the first's, what stepping those parameters costs in this engine.

On the 2-core machine (deep model, 768 x 12, 2 ranks): 0.2-0.3 ms a pass (`profile.measure_dispatch`, which
needs no engine, estimates 0.07) and 2-3 ms a step; the 3.5M parameters of a rank step in 11-14 ms with their
norm, where a warm optimizer step over one layer's tensors suggested 2 ms and a cold one over a flat tensor 7.
"""
import contextlib
import copy
import io
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 8  # of the calibration model's layers
STEPS = 5  # steps of each calibration engine, the first untimed (it allocates)
MICRO_BATCHES = 2  # per stage: each step has 2p
MIN_BANK = 1 << 20  # parameters stepped at least: below that the difference is the machine's noise


class Stage(nn.Module):
    """One stage of the calibration model: a width-8 linear layer, and `bank` parameters the forward never reads
    (the optimizer steps them: DeepSpeed gives a parameter without a gradient a zero one)."""

    def __init__(self, bank=0):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bank = nn.Parameter(torch.zeros(bank)) if bank else None

    def forward(self, x):
        return self.fc(x)


def _run(args, cfg, build_engine, bank):
    """(seconds per pass, seconds per step) of this rank in a traced engine over the calibration model."""
    from argparse import Namespace

    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    from schedules.observe.trace import RunTrace, measured_dispatch
    from schedules.simulator.timeline import Timeline
    parts = args.pipeline_parallel_size
    tiny = Namespace(**{**vars(args), "pipeline_schedule": "zb-h1", "virtual_stages": None, "trace": "calibration",
                        "save_dir": None})
    m = MICRO_BATCHES * parts
    size = cfg["train_micro_batch_size_per_gpu"]
    tiny_cfg = copy.deepcopy(cfg)
    tiny_cfg.update(gradient_accumulation_steps=m, train_batch_size=size * m * max(dist.get_world_size() // parts, 1))
    tiny_cfg.get("pipeline", {}).pop("activation_checkpoint_interval", None)
    # the calibration model's layout and deferral lines are not the run's: not printed
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model = PipelineModule(layers=[LayerSpec(Stage, bank) for _ in range(parts)], num_stages=parts,
                               loss_fn=F.mse_loss, partition_method="uniform")
        engine, _ = build_engine(tiny, tiny_cfg, model=model)
    dtype = torch.bfloat16 if cfg.get("bf16", {}).get("enabled", False) else torch.float32
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(size, WIDTH, generator=g, dtype=dtype), torch.randn(size, WIDTH, generator=g, dtype=dtype))
               for _ in range(m)]
    trace = RunTrace(engine, "calibration", steps=range(1, STEPS), meta={})
    for step in range(STEPS):
        with trace.step(step):
            engine.train_batch(iter(batches))
    tracer = trace.tracer
    handlers, per_step = [], []
    for it in range(STEPS - 1):
        handlers.append(statistics.mean(p.duration for p in tracer.passes if p.iteration == it))
        step = [(name, b - a) for name, a, b, i in tracer.other if i == it and name != "LoadMicroBatch"]
        waited = sum(t for name, t in step if name == "NormWait")  # for the other ranks' norms, within ValidateStep
        per_step.append(sum(t for name, t in step if name != "NormWait") - waited)
    between = measured_dispatch(Timeline([tracer.passes], "s", {}), [tracer.p2p])[0]  # the loop between instructions
    return statistics.median(handlers) + between, statistics.median(per_step)


def engine_costs(args, cfg, build_engine, held):
    """(dispatch, step_overhead, step_per_parameter): the engine's seconds per pass and per step, and per parameter
    stepped, the same on every rank (the medians over the ranks). `held`: parameters a rank of the real model
    holds; `build_engine(args, cfg, model=)`: train.py's. Every rank of the job calls it (engines are built)."""
    import torch.distributed as dist
    rng = torch.get_rng_state()  # the run's own model and data are drawn as without the calibration
    bank = max(int(held), MIN_BANK)
    dispatch, fixed = _run(args, cfg, build_engine, 0)
    _, banked = _run(args, cfg, build_engine, bank)
    torch.set_rng_state(rng)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dispatch, fixed, max(banked - fixed, 0.0) / bank))
    return tuple(statistics.median(figures[i] for figures in every) for i in range(3))
