"""`ChunkedEngine`: runs schedules whose ranks hold several model chunks (a ChunkedPipelineModule).

Built on SplitBackwardEngine (B/W split, asynchronous sends, per-micro-batch state); every
instruction here also names its `chunk`, and the engine:

- activates that chunk of the module, and answers `is_first_stage()` / `is_last_stage()` for
  the chunk's model stage, so DeepSpeed's own forward/backward/load code does the right thing
  (load inputs on the first stage, labels and loss on the last);
- keeps each chunk's buffers apart: slot = chunk * buffers_per_chunk + buffer_id;
- talks to the rank that holds the neighbouring stage of that chunk (the placement says which),
  activations and gradients on two communicators of their own (see schedules/placement.py);
- hands activations and gradients over locally where two consecutive stages share the rank (the
  turn of the V placement at the last rank);
- gives each direction of the mirror placement its own half of the step's micro-batches.
"""
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

from schedules.engine import SplitBackwardEngine
from schedules.instructions import BackwardInputPass, BackwardWeightPass, ForwardBackwardPass

_META_LEN = 8  # ndim, dims..., padded: the shape of the activations a chunk sends, exchanged once


class ChunkedEngine(SplitBackwardEngine):

    def __init__(self, *args, **kwargs):
        self._chunk = None  # no chunk active: is_first/last_stage() answer for the rank
        self._ready = False  # PipelineEngine.__init__ warms p2p up by rank, as if each held one stage
        super().__init__(*args, **kwargs)
        self._ready = True
        self.placement = self.module.placement
        self._loaded = Counter()       # (chunk, 'inputs' | 'labels') -> micro-batches loaded so far
        self._batches = None           # this step's micro-batches, taken from the data iterator once
        self._handover = {}            # slot -> activation handed from the upstream chunk on this rank
        self._shapes = {}              # chunk -> shape of the activations it receives
        self._sent_shape = set()       # chunks whose activation shape went downstream
        self._nbuf = 1
        everyone = list(range(dist.get_world_size()))
        self._channel = {'act': dist.new_group(everyone), 'grad': dist.new_group(everyone)}

    # --- which stage is active ------------------------------------------------------------
    @contextmanager
    def _in_chunk(self, chunk):
        self._chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._chunk = None

    def is_first_stage(self):
        if not self._ready or self._chunk is None:
            return super().is_first_stage()
        return self.placement.is_first(self.stage_id, self._chunk)

    def is_last_stage(self):
        if not self._ready:
            return super().is_last_stage()
        if self._chunk is None:  # outside a pass: "does this rank compute the loss"
            return any(self.placement.is_last(self.stage_id, c) for c in range(self.placement.chunks))
        return self.placement.is_last(self.stage_id, self._chunk)

    def _loss_stage_global_rank(self):
        last = self.module.placement.num_model_stages - 1
        rank = next(r for r in range(self.num_stages) for c in range(self.module.placement.chunks)
                    if self.module.placement.stage(r, c) == last and self.module.placement.direction(c) in (None, 0))
        return self.grid.stage_to_global(rank)

    def _slot(self, buffer_id, chunk):
        return chunk * self._nbuf + buffer_id

    def _peer(self, chunk, step):
        peer = self.placement.neighbour(self.stage_id, chunk, step, self.placement.direction(chunk))
        return None if peer is None else peer

    # --- schedule -------------------------------------------------------------------------
    def _train_schedule(self):
        return self.schedule_cls(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _inference_schedule(self, micro_batches):
        return self.schedule_cls(micro_batches=micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                 forward_only=True)

    def _exec_schedule(self, pipe_schedule):
        self._nbuf = pipe_schedule.buffers_per_chunk()
        self._steps_micro_batches = pipe_schedule.micro_batches
        self._batches, self._handover = None, {}
        self._loaded.clear()
        super()._exec_schedule(pipe_schedule)

    def _next_batch(self):
        """The micro-batch a LoadMicroBatch of the active chunk wants: its next input (first stage)
        or its next labels (last stage), of its direction's share of the step's micro-batches."""
        if self._chunk is None:
            return super()._next_batch()
        if self._batches is None:
            self._batches = [super(ChunkedEngine, self)._next_batch() for _ in range(self._steps_micro_batches)]
        role = 'inputs' if self.is_first_stage() else 'labels'
        k = self._loaded[(self._chunk, role)]
        self._loaded[(self._chunk, role)] += 1
        direction = self.placement.direction(self._chunk)
        return self._batches[k if direction is None else direction * (self._steps_micro_batches // 2) + k]

    # --- compute --------------------------------------------------------------------------
    def _run_load(self, buffer_id, chunk):
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_load_micro_batch(self, self._slot(buffer_id, chunk))

    def _run_forward(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        up, down = self._peer(chunk, -1), self._peer(chunk, +1)
        if up is not None and up[0] == self.stage_id:
            self.pipe_buffers['inputs'][slot] = self._handover.pop(slot)
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_forward_pass(self, slot)
        if down is not None and down[0] == self.stage_id:  # the next stage is here: hand the output over
            out = self.pipe_buffers['outputs'][slot]
            self._handover[self._slot(buffer_id, down[1])] = out.detach().requires_grad_(torch.is_grad_enabled())

    def _run_backward_input(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        down = self._peer(chunk, +1)
        if down is not None and down[0] == self.stage_id:  # the gradient comes from the chunk after, here
            below = self._slot(buffer_id, down[1])
            self._grads[slot] = self.pipe_buffers['inputs'][below].grad
            self.pipe_buffers['inputs'][below] = None
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_backward_input_pass(self, slot)

    def _run_backward_weight(self, buffer_id, chunk):
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_backward_weight_pass(self, self._slot(buffer_id, chunk))

    def _run_backward(self, buffer_id, chunk):
        self._run_backward_input(buffer_id, chunk)
        self._run_backward_weight(buffer_id, chunk)

    def _run_forward_backward(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused):
        # One after the other today; the unit is where overlapping the two (DualPipe) would go.
        self._run_forward(fwd_buffer, fwd_chunk)
        (self._run_backward if fused else self._run_backward_input)(bwd_buffer, bwd_chunk)

    # --- point to point -------------------------------------------------------------------
    def _rank_of(self, peer):
        return self.grid.stage_to_global(stage_id=peer[0])

    def _run_send_activations(self, buffer_id, chunk):
        out = self.pipe_buffers['outputs'][self._slot(buffer_id, chunk)]
        dst = self._rank_of(self._peer(chunk, +1))
        if chunk not in self._sent_shape:  # once: the receiver allocates from it
            self._sent_shape.add(chunk)
            meta = torch.zeros(_META_LEN, dtype=torch.long)
            meta[0] = out.dim()
            meta[1:1 + out.dim()] = torch.tensor(out.shape)
            dist.send(meta, dst, group=self._channel['act'])
        self._sends.append((dist.isend(out.contiguous(), dst, group=self._channel['act']), out))

    def _run_recv_activations(self, buffer_id, chunk):
        peer = self._peer(chunk, -1)
        src = self._rank_of(peer)
        if chunk not in self._shapes:
            meta = torch.zeros(_META_LEN, dtype=torch.long)
            dist.recv(meta, src, group=self._channel['act'])
            self._shapes[chunk] = tuple(meta[1:1 + int(meta[0])].tolist())
        dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        x = torch.empty(self._shapes[chunk], dtype=dtype, device=self.device)
        dist.recv(x, src, group=self._channel['act'])
        self.pipe_buffers['inputs'][self._slot(buffer_id, chunk)] = x.requires_grad_(torch.is_grad_enabled())

    def _run_send_grads(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        grad = self.pipe_buffers['inputs'][slot].grad
        dst = self._rank_of(self._peer(chunk, -1))
        self._sends.append((dist.isend(grad, dst, group=self._channel['grad']), grad))
        self.pipe_buffers['inputs'][slot] = None

    def _run_recv_grads(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        peer = self._peer(chunk, +1)
        grad = torch.empty_like(self.pipe_buffers['outputs'][slot])
        dist.recv(grad, self._rank_of(peer), group=self._channel['grad'])
        self._grads[slot] = grad

    _INSTRUCTION_MAP = {
        **SplitBackwardEngine._INSTRUCTION_MAP,
        ds.LoadMicroBatch: _run_load,
        ds.ForwardPass: _run_forward,
        ds.BackwardPass: _run_backward,
        BackwardInputPass: _run_backward_input,
        BackwardWeightPass: _run_backward_weight,
        ForwardBackwardPass: _run_forward_backward,
        ds.SendActivation: _run_send_activations,
        ds.RecvActivation: _run_recv_activations,
        ds.SendGrad: _run_send_grads,
        ds.RecvGrad: _run_recv_grads,
    }
