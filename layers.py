"""What the two models share about being cut into pipeline stages.

- `seeded_init(index)`: every pipeline layer initialises its parameters from a seed derived
  from its global layer index, so a layer is identical whether it is built by the plain model,
  by `to_layers()`, or lazily by a `LayerSpec` on the rank that owns it. This is what lets a
  pipelined run be compared bit for bit with the non-pipelined one.
- (the block-aligned activation checkpointing both models use, `run_layers` and `LayerPipe`,
  lives in the schedules package, schedules/runtime/pipe_module.py, which builds on it)
- `layer_state_dict(...)`: the parameters of a list of layers keyed by global layer index
  (`"3.attn.qkv.weight"`), the one naming that plain and pipelined models share; train.py's
  `--export` writes it and the tests compare it (a DualPipe run adds its second copy of each
  stage under `mirror:` keys).
"""
import contextlib

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

from schedules.runtime.pipe_module import layer_runs

LAYER_SEED_BASE = 1234  # seed of layer i is LAYER_SEED_BASE + seed + i


@contextlib.contextmanager
def seeded_init(seed: int):
    """Build modules under a fixed RNG seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_layer(specs, index: int, seed: int):
    """Layer `index` of a model described by `specs` [(class, args), ...], under its own seed; an entry
    (class, args, seed_index) draws from layer `seed_index`'s seed instead (the slices of a split head
    draw their rows of the unsplit head's weight)."""
    cls, args, *seed_index = specs[index]
    with seeded_init(LAYER_SEED_BASE + seed + (seed_index[0] if seed_index else index)):
        return cls(*args)


class SeededLayerSpec(LayerSpec):
    """A LayerSpec that builds its layer with `build_layer`, so its init matches the plain model."""

    def __init__(self, specs, index: int, seed: int):
        cls, args = specs[index][:2]
        super().__init__(cls, *args)
        self.specs, self.index, self.seed = specs, index, seed

    def build(self, log=False):
        return build_layer(self.specs, self.index, self.seed)


def layer_state_dict(layers, first_index: int = 0, experts_only: bool = False) -> dict:
    """{f"{global_layer_index}.{param_name}": tensor} for modules in `layers` (others skipped); the experts of a
    Mixture-of-Experts layer under their global index (schedules.runtime.moe.global_expert_name), so that
    expert-parallel ranks' exports merge. `experts_only`: only those (the rest is another rank's to export)."""
    from schedules.runtime.moe import global_expert_name, is_expert_name
    state = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module):
            for name, tensor in layer.state_dict().items():
                if not experts_only or is_expert_name(name):
                    state[f"{first_index + i}.{global_expert_name(layer, name)}"] = tensor.detach().cpu().clone()
    return state


def pipe_layer_state_dict(module: PipelineModule, experts_only: bool = False) -> dict:
    """The layer-indexed state of the layers this pipeline rank owns (all its chunks, if it has several)."""
    from schedules.runtime.moe import global_expert_name
    placement = getattr(module, "placement", None)
    state = {}
    for c, (start, funcs) in enumerate(layer_runs(module)):
        mirror = placement is not None and placement.direction(c) == 1  # DualPipe's second copy of a stage
        shared = {id(p) for layer in funcs if isinstance(layer, nn.Module) for p in layer.parameters()
                  if getattr(p, 'shared_by_copies', False)}  # experts the copies share: this copy's own
        owned = {f"{start + i}.{global_expert_name(layer, n)}" for i, layer in enumerate(funcs)
                 if isinstance(layer, nn.Module) for n, p in layer.named_parameters() if id(p) in shared}
        state.update({("mirror:" if mirror and k not in owned else "") + k: v
                      for k, v in layer_state_dict(funcs, start, experts_only).items()})
    return state
