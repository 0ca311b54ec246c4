"""What the two models share about being cut into pipeline stages.

- `seeded_init(index)`: every pipeline layer initialises its parameters from a seed derived
  from its global layer index, so a layer is identical whether it is built by the plain model,
  by `to_layers()`, or lazily by a `LayerSpec` on the rank that owns it. This is what lets a
  pipelined run be compared bit for bit with the non-pipelined one.
- `run_layers(...)`: forward through a list of layers with activation checkpointing applied to
  groups of `interval` consecutive checkpointable layers (transformer blocks), each group
  starting at the first such layer of the stage. DeepSpeed's own grouping counts from the
  stage's first layer, so on stage 0 it would glue the embedding (integer input, which
  reentrant checkpointing cannot take) to the first block and leave that group unchecked.
- `LayerPipe`: a `PipelineModule` whose forward is `run_layers`.
- `layer_state_dict(...)`: the parameters of a list of layers keyed by global layer index
  (`"3.attn.qkv.weight"`), the one naming that plain and pipelined models share; train.py's
  `--export` writes it and the tests compare it (a DualPipe run adds its second copy of each
  stage under `mirror:` keys).
"""
import contextlib

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule

LAYER_SEED_BASE = 1234  # seed of layer i is LAYER_SEED_BASE + seed + i


@contextlib.contextmanager
def seeded_init(seed: int):
    """Build modules under a fixed RNG seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_layer(specs, index: int, seed: int):
    """Layer `index` of a model described by `specs` [(class, args), ...], under its own seed."""
    cls, args = specs[index]
    with seeded_init(LAYER_SEED_BASE + seed + index):
        return cls(*args)


class SeededLayerSpec(LayerSpec):
    """A LayerSpec that builds its layer with `build_layer`, so its init matches the plain model."""

    def __init__(self, specs, index: int, seed: int):
        cls, args = specs[index]
        super().__init__(cls, *args)
        self.specs, self.index, self.seed = specs, index, seed

    def build(self, log=False):
        return build_layer(self.specs, self.index, self.seed)


def run_layers(layers, x, interval: int = 0, checkpoint_fn=None, checkpointable=()):
    """Apply `layers` in order; checkpoint runs of `interval` consecutive `checkpointable` layers."""
    i = 0
    while i < len(layers):
        if interval > 0 and isinstance(layers[i], checkpointable):
            group = []
            while i < len(layers) and len(group) < interval and isinstance(layers[i], checkpointable):
                group.append(layers[i])
                i += 1
            x = checkpoint_fn(_Sequence(group), x)
        else:
            x = layers[i](x)
            i += 1
    return x


class _Sequence:
    """A plain callable over a group of layers (not a Module: it must not re-register them)."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LayerPipe(PipelineModule):
    """PipelineModule whose activation checkpointing groups start at each stage's first block.

    `checkpointable` (a class attribute, or a keyword argument) names the layer classes worth
    checkpointing.
    """
    checkpointable: tuple = ()

    def __init__(self, *args, checkpointable=None, partition_weights=None, **kwargs):
        if checkpointable is not None:
            self.checkpointable = tuple(checkpointable)
        self.partition_weights = partition_weights  # per-layer costs to balance, e.g. measured times
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method='uniform'):
        """DeepSpeed's partition methods, plus `partition_weights`: stages of balanced total weight
        (the same balancing DeepSpeed's 'parameters' method does with parameter counts)."""
        if self.partition_weights is None:
            return super()._partition_layers(method)
        if len(self.partition_weights) != len(self._layer_specs):
            raise ValueError(f"partition_weights has {len(self.partition_weights)} entries for "
                             f"{len(self._layer_specs)} layers")
        from deepspeed.runtime import utils as ds_utils
        self.parts = ds_utils.partition_balanced(weights=list(self.partition_weights), num_parts=self.num_stages)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def forward(self, x):
        interval = self.activation_checkpoint_interval
        if interval > 0 and isinstance(x, tuple) and len(x) == 1:
            x = x[0]
        return run_layers(self.forward_funcs, x, interval, self.activation_checkpoint_func, self.checkpointable)


def layer_state_dict(layers, first_index: int = 0) -> dict:
    """{f"{global_layer_index}.{param_name}": tensor} for modules in `layers` (others skipped)."""
    state = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module):
            for name, tensor in layer.state_dict().items():
                state[f"{first_index + i}.{name}"] = tensor.detach().cpu().clone()
    return state


def pipe_layer_state_dict(module: PipelineModule) -> dict:
    """The layer-indexed state of the layers this pipeline rank owns (all its chunks, if it has several)."""
    # ChunkedPipelineModule has chunks, DeepSpeed's DualPipeVModule phases: the same thing
    chunks = getattr(module, 'chunk_funcs', None) or getattr(module, 'phase_funcs', None)
    if chunks is None:
        return layer_state_dict(module.forward_funcs, module._local_start)
    bounds = getattr(module, 'chunk_bounds', None) or module.phase_bounds
    placement = getattr(module, 'placement', None)
    state = {}
    for c, (funcs, (start, _)) in enumerate(zip(chunks, bounds)):
        mirror = placement is not None and placement.direction(c) == 1  # DualPipe's second copy of a stage
        state.update({("mirror:" if mirror else "") + k: v for k, v in layer_state_dict(funcs, start).items()})
    return state
