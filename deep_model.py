"""The deep benchmark model: `depth` blocks of Linear(width, width) + ReLU, regression loss.

Every block costs the same, so any cut into stages is balanced: the workload for measuring
schedules, where GPTlite's 50257-token embedding and head would make one stage dominate.
Same pipeline interface as gptlite.py: `to_layers()`, `DeepPipeSpec`, `get_model(...)`.
Inputs and targets are synthetic: `synthetic_micro_batch` draws them from (seed, index).

`pass_seconds=(forward, input gradient, weight gradient)` makes every block a `TimedBlock`, whose
passes sleep those times: a pipeline whose pass costs are set, not measured, for runs with more
stages than the machine has cores (the ranks sleep instead of contending for the cores).
"""
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers import SeededLayerSpec, build_layer
from schedules.runtime.moe import ExpertLayer
from schedules.runtime.pipe_module import LayerPipe, run_layers
from schedules.runtime.weight_grad import DeferredLinearGrad, Linear, defer_or_compute


@dataclass(frozen=True)
class DeepConfig:
    width: int = 256
    depth: int = 16
    seed: int = 0
    pass_seconds: tuple = None  # (forward, input gradient, weight gradient) seconds per block: TimedBlock
    # Mixture of Experts: the blocks in `moe_blocks` are DeepExpertBlocks (as GPTliteConfig's moe_* fields)
    moe_experts: int = 0
    moe_blocks: tuple = ()
    moe_top_k: int = 1
    moe_capacity_factor: float = 1.0
    moe_aux_coef: float = 0.01
    expert_parallel_size: int = 1


class DeepBlock(nn.Module):

    def __init__(self, width: int):
        super().__init__()
        self.fc = Linear(width, width)

    def forward(self, x):
        return F.relu(self.fc(x))


class DeepExpertBlock(DeepBlock):
    """A DeepBlock followed by a Mixture of Experts, as a transformer block's attention is by its MoE MLP: DeepSpeed's
    top-k gate over `experts` Linear(width, width) + ReLU (an ExpertLayer). Each sample is a token: a micro-batch of
    B samples sends B x width values per all-to-all, and the dense layer is what an overlapped pair computes while
    the other pass's tokens are in flight (schedules/runtime/overlap.py)."""

    def __init__(self, width: int, experts: int, k: int, capacity_factor: float, aux_coef: float, ep_size: int):
        super().__init__(width)
        self.experts = ExpertLayer(width, lambda e: nn.Sequential(nn.Linear(width, width), nn.ReLU()), experts,
                                   ep_size=ep_size, k=k, capacity_factor=capacity_factor, aux_loss_coef=aux_coef)

    def forward(self, x):
        return self.experts(super().forward(x))


class _TimedWeightGrad(DeferredLinearGrad):
    """A linear layer's weight-gradient work that takes `seconds` more (in W, or in B when not deferred)."""
    __slots__ = ('seconds', )

    def __init__(self, seconds, *args):
        super().__init__(*args)
        self.seconds = seconds

    def _weight_grad(self):
        time.sleep(self.seconds)
        return super()._weight_grad()

    def accumulate(self):
        time.sleep(self.seconds)
        super().accumulate()


class _TimedLinearFunction(torch.autograd.Function):
    """F.linear whose forward, input gradient and (deferrable) weight gradient each sleep their set time: a
    layer made deferrable as weight_grad.py describes for any layer."""

    @staticmethod
    def forward(ctx, x, weight, bias, seconds):
        time.sleep(seconds[0])
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.seconds = weight, bias, seconds  # the parameters themselves (weight_grad.py)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        weight = ctx.weight
        time.sleep(ctx.seconds[1])
        work = _TimedWeightGrad(ctx.seconds[2], weight, ctx.bias, x, grad_out)
        grads = defer_or_compute(work, x, grad_out)
        return grad_out @ weight, grads.get(id(weight)), grads.get(id(ctx.bias)), None


class TimedBlock(DeepBlock):
    """A DeepBlock whose passes take set times (`seconds`: forward, input gradient, weight gradient), mostly
    asleep; its arithmetic is still real, so training is exact."""

    def __init__(self, width: int, seconds: tuple):
        super().__init__(width)
        self.seconds = tuple(seconds)

    def forward(self, x):
        return F.relu(_TimedLinearFunction.apply(x, self.fc.weight, self.fc.bias, self.seconds))


def layer_specs(config: DeepConfig):
    if config.pass_seconds:
        return [(TimedBlock, (config.width, config.pass_seconds))] * config.depth
    experts = (DeepExpertBlock, (config.width, config.moe_experts, config.moe_top_k, config.moe_capacity_factor,
                                 config.moe_aux_coef, config.expert_parallel_size))
    return [experts if config.moe_experts and i in config.moe_blocks else (DeepBlock, (config.width, ))
            for i in range(config.depth)]


class DeepModel(nn.Module):

    def __init__(self, config: DeepConfig, activation_checkpoint_interval: int = 0):
        super().__init__()
        self.activation_checkpoint_interval = activation_checkpoint_interval
        specs = layer_specs(config)
        self.blocks = nn.ModuleList(build_layer(specs, i, config.seed) for i in range(config.depth))

    def to_layers(self):
        return list(self.blocks)

    def forward(self, x):
        def checkpoint(f, x):
            return torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
        return run_layers(self.to_layers(), x, self.activation_checkpoint_interval, checkpoint,
                          DeepPipe.checkpointable)


class DeepPipe(LayerPipe):
    checkpointable = (DeepBlock, DeepExpertBlock)


class DeepPipeSpec(DeepPipe):

    def __init__(self, config: DeepConfig, **kwargs):
        specs = layer_specs(config)
        super().__init__(layers=[SeededLayerSpec(specs, i, config.seed) for i in range(len(specs))], **kwargs)


def mse_loss(output, target):
    return F.mse_loss(output, target)


def synthetic_micro_batch(index: int, batch_size: int, width: int, seed: int):
    """Micro-batch `index`: inputs ~ N(0,1) and targets ~ N(0,1), drawn from (seed, index) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, width, generator=g)


def get_model(criterion=mse_loss, pipeline_num_stages=0, pipeline_spec_layers=False,
              activation_checkpoint_interval=0, width=256, depth=16, seed=0, partition_method="uniform",
              pipe_module=None, partition_weights=None, pass_seconds=None, **moe):
    """`moe`: DeepConfig's moe_* fields and expert_parallel_size (a Mixture of Experts)."""
    config = DeepConfig(width=width, depth=depth, seed=seed, pass_seconds=pass_seconds, **moe)
    if not pipeline_num_stages:
        return DeepModel(config, activation_checkpoint_interval)
    pipe_kwargs = dict(num_stages=pipeline_num_stages, loss_fn=criterion, partition_method=partition_method,
                       activation_checkpoint_interval=activation_checkpoint_interval,
                       partition_weights=partition_weights)  # per-layer costs to balance (LayerPipe)
    if pipe_module is not None:  # several chunks per rank (see gptlite.get_model)
        specs = layer_specs(config)
        layers = ([SeededLayerSpec(specs, i, config.seed) for i in range(len(specs))] if pipeline_spec_layers else
                  DeepModel(config).to_layers())
        return pipe_module(layers, checkpointable=DeepPipe.checkpointable, **pipe_kwargs)
    if pipeline_spec_layers:
        return DeepPipeSpec(config, **pipe_kwargs)
    return DeepPipe(layers=DeepModel(config).to_layers(), **pipe_kwargs)
