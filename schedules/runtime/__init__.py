"""The runtime: what runs a schedule's instructions on a real model.

    split_engine.py    SplitBackwardEngine: DeepSpeed's PipelineEngine plus B and W passes,
                       asynchronous sends, per-micro-batch losses and received gradients
    chunked_engine.py  ChunkedEngine: the same over several model chunks per rank (interleaved, V,
                       mirror placements), local hand-over, one communicator per message kind
    weight_grad.py     the Linear whose weight gradients a W pass computes later
    lean_step.py       the step end that synchronises no stages (ZeRO 0): local ReduceGrads, early loss
    lean_engine.py     LeanEngine: DeepSpeed's engine for a model that is not pipelined, with that step end
    interlock.py       train_batches: steps back to back, the optimizer step post-validated
    validation_policy.py  when a post-validated step goes ahead of the model's norm, and past it
    step_targets.py    what a post-validated step does to each optimizer (torch's, DeepSpeed's BF16 and ZeRO-1)
    receive_ahead.py   receives posted ahead per channel, in the order of the step's instructions
    messages.py        what passes between stages: one tensor or a tuple, its shapes, its gradients
    pipe_module.py     LayerPipe: block-aligned activation checkpointing, balanced partitions
    chunked_module.py  ChunkedPipelineModule: several model chunks per rank
    vocab_parallel.py  VocabSlice: the vocabulary head split over the ranks as layers, its loss, labels riding
    moe.py             ExpertLayer: DeepSpeed's Mixture of Experts, its aux loss trained where it is made

`engine_class(spec)` and `pipe_module(spec)` turn a registry row's engine and module names into
the classes that run it. The runtime never imports the simulator or the observation tools.
"""
import functools

from schedules import registry
from schedules.placement import ChunkedPlacement
from schedules.runtime.chunked_engine import ChunkedEngine
from schedules.runtime.chunked_module import ChunkedPipelineModule, stock_dualpipev_module
from schedules.runtime.split_engine import SplitBackwardEngine

ENGINES = {registry.SPLIT_BACKWARD: SplitBackwardEngine, registry.CHUNKED: ChunkedEngine}


def engine_class(spec):
    """The PipelineEngine subclass that runs `spec` (a registry row), or None for DeepSpeed's own choice."""
    if spec.engine is None or isinstance(spec.engine, type):
        return spec.engine
    if spec.engine not in ENGINES:
        raise ValueError(f"schedule '{spec.name}': unknown engine {spec.engine!r}; choose from {sorted(ENGINES)}")
    return ENGINES[spec.engine]


def pipe_module(spec):
    """What builds the PipelineModule `spec` needs from a layer list, `(layers, **PipelineModule kwargs)`:
    several chunks per rank where its placement has them, DeepSpeed's DualPipeVModule for
    `dualpipev-deepspeed`; None where the model's own one-stage-per-rank PipelineModule serves."""
    if spec.module == registry.DEEPSPEED_DUALPIPEV_MODULE:
        return stock_dualpipev_module
    if spec.module is not None:
        raise ValueError(f"schedule '{spec.name}': unknown module {spec.module!r}")
    if issubclass(spec.placement, ChunkedPlacement):
        return functools.partial(ChunkedPipelineModule, placement=spec.placement)
    return None
