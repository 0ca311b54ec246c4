"""`ChunkedPipelineModule`: a DeepSpeed PipelineModule holding several model chunks per rank.

DeepSpeed's PipelineModule cuts the layer list into one contiguous stage per rank. Here the
list is cut into the placement's model stages (v*p for interleaved and V placements, p for the
mirror placement) with DeepSpeed's own partition methods, and each rank builds the stages its
placement gives it, as chunks: only those layers when they are LayerSpecs. `activate_chunk(c)`
exposes one chunk as the module's forward (and to DeepSpeed's checkpoint code), as DeepSpeed's
DualPipeVModule does with its two phases.

With the mirror placement every stage exists twice (rank r's chunk 0 and rank p-1-r's chunk 1),
built from the same per-layer seeds, so the copies start identical. The second copy's
parameters are marked `ds_pipe_replicated`, which DeepSpeed's gradient-norm code skips, so
clipping counts each parameter once; checkpoints save the first copy only.

Tied layers (`TiedLayerSpec`): a rank builds a tied module once, whichever of its chunks use it;
DeepSpeed groups the ranks that hold it through `stage_owner`, answered here per model stage.
On the mirror placement the tied module's ranks hold both copies' uses, so DeepSpeed's tied
all-reduce already sums them all: the engine leaves tied parameters out of the mirror sum, and
DeepSpeed marks them replicated on all but one of their ranks.

Activation checkpointing follows DeepSpeed's rules (`checkpointable_layers`, else any layer with
parameters) per chunk, unless the model asks for block-aligned groups (`checkpointable`).
"""
import functools
import threading

import torch.nn as nn
from deepspeed.pipe import TiedLayerSpec

from schedules.runtime.pipe_module import LayerPipe


class _PerThread:
    """A module attribute that each thread sets for itself: an overlapped pair (schedules/runtime/overlap.py) runs
    two chunks' passes at once, one per thread, and an activation-checkpointed backward reads its chunk's layers
    (`forward_funcs`) when it recomputes them, after the other thread activated its own. A thread that has set none
    reads what was set last by any."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        mine = module.__dict__.get('_per_thread')
        try:
            return getattr(mine, self.name)
        except AttributeError:
            try:
                return module.__dict__['_last_set'][self.name]
            except KeyError:
                raise AttributeError(self.name) from None

    def __set__(self, module, value):
        setattr(module.__dict__.setdefault('_per_thread', threading.local()), self.name, value)
        module.__dict__.setdefault('_last_set', {})[self.name] = value


class ChunkedPipelineModule(LayerPipe):
    # what activate_chunk sets (and DeepSpeed's forward and checkpointing read), per thread
    active_chunk = _PerThread()
    forward_funcs = _PerThread()
    is_checkpointable_results = _PerThread()
    _local_start = _PerThread()
    _local_stop = _PerThread()

    def __init__(self, layers, placement, **kwargs):
        self._placement_cls = placement
        super().__init__(layers=layers, **kwargs)

    def _partition_layers(self, method='uniform'):
        ranks = self.num_stages
        self.placement = self._placement_cls(ranks)
        self.num_stages = self.placement.num_model_stages  # partition the layers into model stages
        try:
            super()._partition_layers(method)
        finally:
            self.num_stages = ranks
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1])
                             for s in (self.placement.stage(self.stage_id, c) for c in range(self.placement.chunks))]
        if any(self.parts[s] == self.parts[s + 1] for s in range(self.placement.num_model_stages)):
            # every rank sees the same cut, so every rank refuses it (none waits on a peer that failed)
            raise ValueError(f"a model stage of {self.placement.num_model_stages} got no layer: the model has "
                             f"{len(self._layer_specs)} layers; use fewer --pipeline-parallel-size or a deeper "
                             f"model")

    def _model_stage(self, layer_idx):
        stages = range(self.placement.num_model_stages)
        return next(s for s in stages if self.parts[s] <= layer_idx < self.parts[s + 1])

    def stage_owner(self, layer_idx):
        """The rank holding layer `layer_idx` (of the first copy, on the mirror placement): DeepSpeed
        groups the ranks of tied layers with it."""
        return self.placement.owner(self._model_stage(layer_idx))[0]

    def _index_tied_modules(self):
        if hasattr(self.placement, 'holders'):  # the mirror: DeepSpeed's tied group must hold every copy
            for key in sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)}):
                stages = {self._model_stage(i) for i, s in enumerate(self._layer_specs)
                          if isinstance(s, TiedLayerSpec) and s.key == key}
                owners = {self.placement.owner(s)[0] for s in stages}
                if set().union(*(self.placement.holders(s) for s in stages)) != owners:
                    raise ValueError(f"tied layers '{key}' on model stages {sorted(stages)}: dualpipe's mirror "
                                     f"placement needs a tied module's stages to mirror each other (e.g. the first "
                                     f"and the last stage), so that one group of ranks holds all its copies")
        return super()._index_tied_modules()

    def _build(self):
        self.chunk_funcs = []
        for c, (start, stop) in enumerate(self.chunk_bounds):
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            if self.placement.direction(c) == 1:  # the mirror's second copy (tied modules: DeepSpeed marks them)
                tied = self.tied_parameter_ids()
                for p in self.chunk_parameters(c):
                    if id(p) not in tied and not getattr(p, 'shared_by_copies', False):  # experts the copies share
                        p.ds_pipe_replicated = True
        self.chunk_checkpointable = [[] for _ in self.chunk_funcs]
        self.activate_chunk(0)

    def activate_chunk(self, chunk):
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def _precompute_checkpointable_values(self):
        for c in range(len(self.chunk_funcs)):  # per chunk: DeepSpeed caches one list per interval
            self.activate_chunk(c)
            self.is_checkpointable_results_interval = None
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[c] = self.is_checkpointable_results
        self.activate_chunk(0)

    def chunk_parameters(self, chunk):
        """The parameters chunk `chunk` uses, each once (a tied module's included)."""
        # a TiedLayerSpec with forward_fn runs as partial(forward_fn, tied module)
        layers = [f.args[0] if isinstance(f, functools.partial) else f for f in self.chunk_funcs[chunk]]
        params = [p for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()]
        return list({id(p): p for p in params}.values())

    def tied_parameter_ids(self):
        return {id(p) for p in self.tied_modules.parameters()}

    def _saved_chunks(self):
        return [c for c in range(self.placement.chunks) if self.placement.direction(c) != 1]

    def save_state_dict(self, *args, **kwargs):
        for c in self._saved_chunks():
            self.activate_chunk(c)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args, **kwargs):
        for c in range(self.placement.chunks):
            self.activate_chunk(c)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)


def stock_dualpipev_module(layers, **kwargs):
    """DeepSpeed's own DualPipeVModule over the same layers (for `dualpipev-deepspeed`), with this
    project's block-aligned activation checkpointing; deepspeed.initialize gives it DeepSpeed's
    DualPipeVEngine."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    from schedules.runtime.vocab_parallel import count_slices, refusal
    if count_slices(layers):  # its engine is DeepSpeed's, and its partition knows nothing of slices
        raise ValueError(refusal("not dualpipev-deepspeed, which runs on DeepSpeed's own engine"))

    class StockDualPipeVModule(DualPipeVModule, LayerPipe):  # DualPipeV's partition first, then ours
        pass

    return StockDualPipeVModule(layers=layers, **kwargs)
