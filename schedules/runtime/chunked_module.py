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
"""
from schedules.runtime.pipe_module import LayerPipe


class ChunkedPipelineModule(LayerPipe):

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
        for start, stop in self.chunk_bounds:
            if start == stop:
                raise ValueError(f"a model stage of {self.placement.num_model_stages} got no layer: the model has "
                                 f"{len(self._layer_specs)} layers; use fewer --pipeline-parallel-size or a deeper "
                                 f"model")

    def _build(self):
        self.chunk_funcs = []
        for c, (start, stop) in enumerate(self.chunk_bounds):
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            if self.placement.direction(c) == 1:  # the mirror's second copy
                for layer in self.forward_funcs:
                    for p in getattr(layer, 'parameters', lambda: [])():
                        p.ds_pipe_replicated = True
        self.activate_chunk(0)

    def activate_chunk(self, chunk):
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def chunk_parameters(self, chunk):
        return [p for layer in self.chunk_funcs[chunk] for p in getattr(layer, 'parameters', lambda: [])()]

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

    class StockDualPipeVModule(DualPipeVModule, LayerPipe):  # DualPipeV's partition first, then ours
        pass

    return StockDualPipeVModule(layers=layers, **kwargs)
