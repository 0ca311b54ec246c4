"""`LayerPipe`: a DeepSpeed PipelineModule whose activation checkpointing groups start at each
stage's first checkpointable layer, and which can balance stages on given per-layer weights.

- `run_layers(...)`: forward through a list of layers with activation checkpointing applied to
  groups of `interval` consecutive checkpointable layers (transformer blocks), each group
  starting at the first such layer of the stage. DeepSpeed's own grouping counts from the
  stage's first layer, so on stage 0 it would glue the embedding (integer input, which
  reentrant checkpointing cannot take) to the first block and leave that group unchecked.
- `LayerPipe`: a `PipelineModule` whose forward is `run_layers`; `partition_weights` cuts the
  layers into stages of balanced total weight (e.g. measured per-layer times). A layer list ending in
  a split vocabulary head (`VocabSlice`s, vocab_parallel.py) gets a model stage per slice, after the
  stages of the trunk, and its labels ride with the activations from the first stage to the slices.

The chunked module (chunked_module.py) builds on it; the models use it for their pipelines.
"""
from deepspeed.pipe import PipelineModule

from schedules.runtime.vocab_parallel import count_slices, is_vocab_slice, refusal


def layer_runs(module):
    """[(global index of its first layer, layer functions)] of each chunk a pipeline module holds on this rank, in
    chunk order: ChunkedPipelineModule's chunks (both copies of a mirrored stage), DeepSpeed's DualPipeVModule's
    phases, or a plain PipelineModule's one stage."""
    chunks = getattr(module, 'chunk_funcs', None) or getattr(module, 'phase_funcs', None)
    if chunks is None:
        return [(module._local_start, module.forward_funcs)]
    bounds = getattr(module, 'chunk_bounds', None) or module.phase_bounds
    return [(start, funcs) for funcs, (start, _) in zip(chunks, bounds)]


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
    """PipelineModule whose activation checkpointing groups can start at each stage's first block.

    `checkpointable` (a class attribute, or a keyword argument) names the layer classes worth
    checkpointing, grouped by `run_layers`; without it, DeepSpeed's own forward and grouping run
    (`checkpointable_layers`, by class name, or every layer with parameters).
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
        slices = count_slices(self._layer_specs)
        if slices:
            return self._partition_with_slices(method, slices)
        if self.partition_weights is None:
            return super()._partition_layers(method)
        if len(self.partition_weights) != len(self._layer_specs):
            raise ValueError(f"partition_weights has {len(self.partition_weights)} entries for "
                             f"{len(self._layer_specs)} layers")
        from deepspeed.runtime import utils as ds_utils
        self.parts = ds_utils.partition_balanced(weights=list(self.partition_weights), num_parts=self.num_stages)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _partition_with_slices(self, method, slices):
        """The split head's slices one per model stage, the last `slices` stages; the trunk (the layers
        before them) cut over the other stages by `method` (or `partition_weights`)."""
        stages, specs, weights = self.num_stages, self._layer_specs, self.partition_weights
        trunk = len(specs) - slices
        if stages - slices < 1:
            raise ValueError(refusal(f"its {slices} slices need a model stage each after the trunk's, and this "
                                     f"pipeline has {stages} model stages"))
        self._layer_specs, self.num_stages = specs[:trunk], stages - slices
        self.partition_weights = None if weights is None else list(weights)[:trunk]
        try:
            LayerPipe._partition_layers(self, method)  # not a subclass's: it would redo its own setup
        finally:
            self._layer_specs, self.num_stages, self.partition_weights = specs, stages, weights
        self.parts = list(self.parts) + [trunk + k for k in range(1, slices + 1)]
        self.carries_labels = True
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    carries_labels = False  # a split head downstream: the stage inputs end with the labels (vocab_parallel.py)

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts tied weights in place (at construction, and again when a checkpoint is loaded);
        # under grad mode autograd's fallback for c10d::broadcast_ hooks a warning onto the weight
        import torch
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def forward(self, x):
        if self.carries_labels:
            return self._forward_carrying_labels(x)
        return self._forward(x)

    def _forward_carrying_labels(self, x):
        """The trunk's layers see the inputs without the labels, which go on with the outputs; the slices
        of the head see (and pass on) the whole state."""
        if self.forward_funcs and is_vocab_slice(self.forward_funcs[0]):  # a slice's stage holds it alone
            for layer in self.forward_funcs:
                x = layer(x)
            return x
        *inputs, labels = x
        out = self._forward(inputs[0] if len(inputs) == 1 else tuple(inputs))
        return (*out, labels) if isinstance(out, tuple) else (out, labels)

    def _forward(self, x):
        if not self.checkpointable:
            return super().forward(x)
        interval = self.activation_checkpoint_interval
        if interval > 0 and isinstance(x, tuple) and len(x) == 1:
            x = x[0]
        return run_layers(self.forward_funcs, x, interval, self.activation_checkpoint_func, self.checkpointable)
