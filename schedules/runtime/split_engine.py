"""A DeepSpeed PipelineEngine that runs split-backward schedules (ZB-H1, ZB-H2, ...).

Extends DeepSpeed by subclassing only: `_INSTRUCTION_MAP` is the stock map plus

- `BackwardInputPass` (B): the stock backward of one micro-batch, run while `Linear` layers
  defer their weight gradients (weight_grad.py); the deferred work is kept per buffer.
- `BackwardWeightPass` (W): runs that work, oldest first, accumulating into `.grad`.
- `SendActivation` / `SendGrad`: asynchronous (`isend`). The stock engine sends with a blocking
  rendezvous, so a stage that sends early waits for its peer; zero-bubble schedules send as soon
  as a pass ends and go on computing. Sends complete before the batch ends (and before the
  gradient reduction); received data arrives in posting order per pair of ranks. An activation
  stream's shape goes ahead of its first tensor, once, asynchronously as well.
- `RecvActivation` / `RecvGrad`: on gloo, each channel's next receive is posted ahead, in the
  order the step's own instruction stream gives (receive_ahead.py), so an early send
  is not held up waiting for its receiver.

With ZeRO 0 in fp32, and ZeRO 1 in fp32 with one data-parallel rank (the shipped config), weight gradients
are added into `.grad` by their own multiply (weight_grad.py's `accumulate_in_place`), in B, W and fused
backwards alike, and a step's first one is written into the last step's gradient tensor (`spare_grads`).

The step's end skips what one data-parallel rank does not need and clips by the whole model's
gradient norm, fused (lean_step.py); `train_batches` runs several steps back to back, the step
post-validated (interlock.py).

One value per engine in the stock engine becomes one per micro-batch where a split schedule
needs it: the last stage's loss (its B may come after later forwards) and the received output
gradient (deferred W work may still hold it when the next one arrives).
"""
from collections import defaultdict, deque

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.engine import PipelineEngine

from schedules.instructions import BackwardInputPass, BackwardWeightPass
from schedules.runtime import messages
from schedules.runtime.interlock import Interlock
from schedules.runtime.lean_step import LeanStep, accumulates_in_place
from schedules.runtime.receive_ahead import ReceiveAhead
from schedules.runtime.weight_grad import accumulate_in_place, apply_weight_grads, defer_weight_grads, spare_grads


class SplitBackwardEngine(Interlock, LeanStep, PipelineEngine):
    """PipelineEngine running a `schedule_cls` whose streams may split the backward into B and W."""

    def __init__(self, *args, schedule_cls, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule_cls = schedule_cls
        self._losses = {}                        # buffer_id -> last stage's loss of that micro-batch
        self._deferred = defaultdict(deque)      # buffer_id -> queues of weight-gradient work (FIFO)
        self._grads = {}                         # buffer_id -> received output gradient
        self._sends = []                         # (work, tensor) of sends in flight
        self._shape_sent = set()                 # activation streams whose shape went out
        self._ahead = ReceiveAhead(self.device, enabled=torch.distributed.get_backend() == 'gloo',
                                   same_spec=not self.module.dynamic_shape)
        self._schedule_key, self._schedule = None, None  # the training schedule, kept while its shape holds
        self._receive_plan = (None, [])                    # (schedule, its receives) of the last step
        self._take_zero1_over()                            # ZeRO 1, one replica: its gradients handed over here
        self._in_place = accumulates_in_place(self)        # weight gradients added into .grad by their multiply

    def _train_schedule(self):
        # built once per shape: an order is the same every step, and computing it is Python work on every rank
        key = (self.micro_batches, self.num_stages, self.stage_id)
        if self._schedule_key != key:
            self._schedule_key = key
            self._schedule = self.schedule_cls(micro_batches=self.micro_batches, stages=self.num_stages,
                                               stage_id=self.stage_id)
        return self._schedule

    _RECEIVES = {ds.RecvActivation: 'act', ds.RecvGrad: 'grad'}

    def _receives(self, pipe_schedule):
        """(channel, stream) of each receive instruction of the step, in order; listed once per schedule
        object (the training schedule is kept from step to step)."""
        if self._receive_plan[0] is not pipe_schedule:
            plan = [(self._source(kind, chunk), (kind, chunk))
                    for kind, chunk in ((self._RECEIVES[type(cmd)], cmd.kwargs.get('chunk', 0))
                                        for step in pipe_schedule for cmd in step if type(cmd) in self._RECEIVES)]
            self._receive_plan = (pipe_schedule, plan)
        return self._receive_plan[1]

    def _exec_schedule(self, pipe_schedule):
        self._settle_before_stream()  # a post-validated step settles before the parameters are used again
        tracer = getattr(self, 'tracer', None)
        traced = tracer is not None and tracer.active
        start = tracer.now() if traced else None
        self._loss_step_start()
        self._ahead.start(self._receives(pipe_schedule) if self._ahead.enabled else ())  # posted ahead: gloo only
        if traced:  # point-to-point work of the step, as a schedule's own receive postings are (e.g. PyTorch's)
            tracer.record_p2p('PostReceives', start, tracer.now())
        try:
            super()._exec_schedule(pipe_schedule)
        finally:
            self._wait_sends()
        if any(self._deferred.values()):
            raise RuntimeError(f"{type(pipe_schedule).__name__} left weight-gradient passes undone on stage "
                               f"{self.stage_id}: every BackwardInputPass needs its BackwardWeightPass")

    # --- compute --------------------------------------------------------------------------
    def _exec_forward_pass(self, buffer_id):
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage() and self.module.training:
            self._losses[buffer_id] = self.loss
            self._loss_forward_done()

    def _exec_backward_input_pass(self, buffer_id):
        with defer_weight_grads() as queue:
            self._exec_stock_backward(buffer_id)
        self._deferred[buffer_id].append(queue)

    def _exec_stock_backward(self, buffer_id):
        """DeepSpeed's backward of one micro-batch, on that micro-batch's loss or received gradient."""
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        else:
            self.grad_layer = self._grads.pop(buffer_id)
        with accumulate_in_place(self._in_place):
            if self._several_outputs(buffer_id):
                self._backward_at_once(buffer_id)
            else:
                super()._exec_backward_pass(buffer_id)
        self.grad_layer = None
        if self.is_last_stage():
            # DeepSpeed's backward returns early on the last stage and keeps its output (e.g. a language model's
            # logits) until the buffer is reused: stock 1F1B has two buffers there, but our schedules
            # give the last stage a buffer per micro-batch in flight, and each would hold its logits to the end
            # of the step (and between steps)
            self.pipe_buffers['outputs'][buffer_id] = None

    def _several_outputs(self, buffer_id):
        """Whether this stage sent several floating tensors on (a split vocabulary head's statistics beside
        its hidden state, a user's tuple): DeepSpeed 0.19.8 backpropagates them one `backward` call each,
        the graph retained between calls, so the part of the graph they share (the head's logits and its
        projection) would run once per tensor."""
        if self.is_last_stage() or self.is_pipe_partitioned:
            return False
        outputs = self.pipe_buffers['outputs'][buffer_id]
        return isinstance(outputs, tuple) and sum(t.is_floating_point() for t in outputs) > 1

    def _backward_at_once(self, buffer_id):
        """DeepSpeed's backward of a stage's tuple of outputs (engine.py, _exec_backward_pass), in one
        autograd call over all of them: each part of the graph runs once, its gradients summed."""
        outputs = [t for t in self.pipe_buffers['outputs'][buffer_id] if t.is_floating_point()]
        grads = self.grad_layer
        if len(outputs) != len(grads):
            raise RuntimeError(f"stage {self.stage_id}: {len(grads)} output gradients for {len(outputs)} outputs")
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # as DeepSpeed's own non-last stages do: no optimizer.backward here
        self._running_engine_backward = True
        try:
            torch.autograd.backward(outputs, grads)
        finally:
            self._running_engine_backward = False
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)
        self.pipe_buffers['output_tensors'][buffer_id] = None
        self.pipe_buffers['outputs'][buffer_id] = None

    def _exec_backward_weight_pass(self, buffer_id):
        if not self._deferred[buffer_id]:
            raise RuntimeError(f"stage {self.stage_id}: BackwardWeightPass({buffer_id}) has no pending "
                               f"BackwardInputPass")
        queue = self._deferred[buffer_id].popleft()
        bf16 = self.using_bf16_optimizer
        if bf16:  # the BF16 optimizer moves low-precision grads to fp32 after each pass: only W's new ones
            self.optimizer.clear_lp_grads()
        self._running_engine_backward = True  # DeepSpeed refuses backward calls it did not start
        try:
            apply_weight_grads(queue, in_place=self._in_place)
        finally:
            self._running_engine_backward = False
        if bf16 and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def zero_grad(self):
        # after a step: with in-place accumulation, the next step writes its first gradients into these tensors
        if not self._in_place:
            return super().zero_grad()
        spare_grads(self.module.parameters())

    # A fused backward computes the weight gradients on the way, as the stock engine does (run as
    # B then W it would hold W's inputs and output gradients at once, for nothing).
    _exec_backward_pass = _exec_stock_backward

    # --- point to point -------------------------------------------------------------------
    # A message is one tensor or a tuple of them (messages.py). Activations go out with isend; the
    # first message of each stream is preceded by its spec, every message with dynamic_shape
    # (asynchronous too: two ranks that both send first must not wait for each other).
    def _send_activation(self, message, dst, stream, group=None):
        if self.module.dynamic_shape or stream not in self._shape_sent:
            self._shape_sent.add(stream)
            self._isend(messages.encode(message, self.device), dst, group)
        self._send(message, dst, group)

    def _send(self, message, dst, group=None):
        for tensor in messages.tensors(message):
            self._isend(messages.wire(tensor), dst, group)

    def _source(self, kind, chunk):
        """(rank, communicator) that `chunk`'s activations ('act') or output gradients ('grad') come from."""
        return self.grid.stage_to_global(stage_id=self.prev_stage if kind == 'act' else self.next_stage), None

    def _recv_activation(self, chunk=0):
        src, group = channel = self._source('act', chunk)

        def first():  # the stream's spec comes ahead of its first message
            meta = torch.zeros(messages.META_SIZE, dtype=torch.long, device=self.device)
            dist.recv(meta, src, group=group)
            return self._recv(messages.decode(meta), src, group)

        return messages.as_input(self._ahead.receive(channel, ('act', chunk), first), torch.is_grad_enabled())

    def _recv(self, spec, src, group=None):
        message = messages.empty(spec, self.device)
        for tensor in messages.tensors(message):
            dist.recv(tensor, src, group=group)
        return messages.restore(message, spec)

    def _isend(self, tensor, dst, group=None):
        self._sends.append((dist.isend(tensor, dst, group=group), tensor))

    def _wait_sends(self):
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def _exec_send_activations(self, buffer_id):
        outputs = self.pipe_buffers['outputs'][buffer_id]
        self._send_activation(outputs, self.grid.stage_to_global(stage_id=self.next_stage), stream=0)

    def _exec_recv_activations(self, buffer_id):
        self.pipe_buffers['inputs'][buffer_id] = self._recv_activation()

    def _exec_send_grads(self, buffer_id):
        inputs = self.pipe_buffers['inputs'][buffer_id]
        self._send(messages.input_grads(inputs), self.grid.stage_to_global(stage_id=self.prev_stage))
        self.pipe_buffers['inputs'][buffer_id] = None

    def _exec_recv_grads(self, buffer_id):
        # A fresh tensor per micro-batch, not the stock engine's one reused buffer: autograd hands
        # the received gradient itself (through residual adds) to the last linear layers, whose
        # deferred W work keeps it until it runs, after later gradients have arrived.
        self._recv_grad(buffer_id)

    def _recv_grad(self, slot, chunk=0):
        src, group = channel = self._source('grad', chunk)

        def first():  # the gradients of the floating tensors sent: their spec is known here
            return self._recv(messages.grad_spec(self.pipe_buffers['outputs'][slot]), src, group)

        self._grads[slot] = self._ahead.receive(channel, ('grad', chunk), first)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds.ForwardPass: _exec_forward_pass,
        ds.BackwardPass: _exec_backward_pass,
        ds.SendActivation: _exec_send_activations,
        ds.RecvActivation: _exec_recv_activations,
        ds.SendGrad: _exec_send_grads,
        ds.RecvGrad: _exec_recv_grads,
        ds.ReduceGrads: LeanStep._exec_reduce_grads,
        BackwardInputPass: _exec_backward_input_pass,
        BackwardWeightPass: _exec_backward_weight_pass,
    }

