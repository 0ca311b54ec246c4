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
import threading
from collections import Counter, deque
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import PASS_KIND, BackwardInputPass, BackwardWeightPass, ForwardBackwardPass
from schedules.passes import own_weight_next
from schedules.runtime import messages, overlap
from schedules.runtime.copies_sum import CopiesSum, gradient_ends, gradient_order
from schedules.runtime.moe import expert_layers
from schedules.runtime.split_engine import SplitBackwardEngine
from schedules.runtime.weight_grad import apply_weight_grads, defer_weight_grads


class ChunkedEngine(SplitBackwardEngine):
    overlap_pairs = True  # a ForwardBackwardPass overlaps its passes' all-to-alls where it has any (overlaps_pairs)

    def __init__(self, *args, **kwargs):
        self._passes = threading.local()  # the active chunk, per thread: an overlapped pair runs two passes at once
        self._chunk = None  # no chunk active: is_first/last_stage() answer for the rank
        self._overlapping = None
        self._early_counts = None  # per chunk, the step's instructions ending its gradients; {}: no early sums
        self._copies = None  # the mirror placement's gradient sum between the copies (copies_sum.py)
        self._fills_own = (None, [])  # (schedule, whether each of its B instructions fills with its own W's works)
        self._filling_b = deque()  # this step's, still to run
        self._ready = False  # PipelineEngine.__init__ warms p2p up by rank, as if each held one stage
        super().__init__(*args, **kwargs)
        self._ready = True
        self.placement = self.module.placement
        self._loaded = Counter()       # (chunk, 'inputs' | 'labels') -> micro-batches loaded so far
        self._batches = None           # this step's micro-batches, taken from the data iterator once
        self._handover = {}            # slot -> activation handed from the upstream chunk on this rank
        self._nbuf = 1
        everyone = list(range(dist.get_world_size()))
        self._channel = {'act': self._new_group(everyone), 'grad': self._new_group(everyone)}
        self._mirror = any(self.placement.direction(c) == 1 for c in range(self.placement.chunks))
        if self._mirror:
            self._mirror_group, self._loss_group = self._mirror_groups()
            self._copies = CopiesSum(self._mirror_group, self._summed_gradients)

    # --- which stage is active ------------------------------------------------------------
    @property
    def _chunk(self):
        return getattr(self._passes, 'chunk', None)

    @_chunk.setter
    def _chunk(self, chunk):
        self._passes.chunk = chunk

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
        """The rank holding the last model stage (of the first direction, for the mirror placement)."""
        placement = self.module.placement  # also asked during PipelineEngine.__init__
        rank = next(r for r in range(self.num_stages) for c in range(placement.chunks)
                    if placement.direction(c) in (None, 0) and placement.is_last(r, c))
        return self.grid.stage_to_global(rank)

    def _slot(self, buffer_id, chunk):
        return chunk * self._nbuf + buffer_id

    def _peer(self, chunk, step):
        """(rank, chunk) of the stage `step` away downstream (+1) or upstream (-1); None at an end."""
        return self.placement.neighbour(self.stage_id, chunk, step, self.placement.direction(chunk))

    # --- schedule -------------------------------------------------------------------------
    def _inference_schedule(self, micro_batches):
        return self.schedule_cls(micro_batches=micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                 forward_only=True)

    def _exec_schedule(self, pipe_schedule):
        self._nbuf = pipe_schedule.buffers_per_chunk()
        self._steps_micro_batches = pipe_schedule.micro_batches
        self._batches, self._handover = None, {}
        self._loaded.clear()
        if self._copies is not None:
            self._copies.new_step(self._early_sums(pipe_schedule))
        self._filling_b = deque(self._b_fills(pipe_schedule) if self.fills_pairs() else ())
        super()._exec_schedule(pipe_schedule)

    def _b_fills(self, pipe_schedule):
        """Whether each B instruction of the step fills its waits with its own W's works: where that W is the
        rank's next pass (passes.own_weight_next, read from the stream). Listed once per schedule object."""
        if self._fills_own[0] is not pipe_schedule:
            order = [(PASS_KIND[type(cmd)], cmd.kwargs['buffer_id'], cmd.kwargs.get('chunk', 0))
                     if type(cmd) in PASS_KIND else None
                     for step in pipe_schedule for cmd in step if type(cmd) in PASS_KIND or
                     type(cmd) is ForwardBackwardPass]
            fills = own_weight_next(order)
            self._fills_own = (pipe_schedule, [i in fills for i, item in enumerate(order)
                                               if item is not None and item[0] == 'B'])
        return self._fills_own[1]

    # --- the copies' gradient sum, started as early as the step allows (copies_sum.py) -------
    def _early_sums(self, pipe_schedule):
        """{chunk: instructions of the step that end its gradients} where each chunk's share of the copies' gradient
        sum may start once its last backward is done, else {}: on the mirror placement, where both copies of every
        stage this rank holds finish its gradients in the same order (the schedule's streams of this rank and its
        mirror say so; the sums share one communicator, where collectives match by order), outside the BF16
        optimizer (whose fp32 gradients are made at the step's end). Counted once: the training schedule is kept
        from step to step."""
        if not self._mirror or self.using_bf16_optimizer or pipe_schedule is not getattr(self, '_schedule', None):
            return {}
        if self._early_counts is None:
            p, m = self.num_stages, pipe_schedule.micro_batches
            same = (gradient_order(self.schedule_cls, self.placement, self.stage_id, p, m)
                    == gradient_order(self.schedule_cls, self.placement, p - 1 - self.stage_id, p, m))
            self._early_counts = Counter(gradient_ends(pipe_schedule)) if same else {}
        return self._early_counts

    def _backward_ending(self, chunk):
        """Before an instruction that ends a backward of `chunk` (or a B whose own W comes next): whether it is the
        chunk's last of the step, whose works' sums start as they are added."""
        return self._copies is not None and self._copies.ending(chunk)

    def _backward_done(self, chunk):
        """After an instruction that ends a backward of `chunk`: with its last of the step, the rest of its
        gradients' sum starts."""
        if self._copies is not None:
            self._copies.ended(chunk)

    def _summed_gradients(self, chunks):
        """(parameters, gradients) of `chunks` that the copies sum: not the tied ones (DeepSpeed's ReduceTiedGrads
        already summed them over every rank that holds a copy), nor the experts the copies share
        (moe.shared_by_copies: no copy of the other rank's, each holds its own)."""
        tied = self.module.tied_parameter_ids()
        params = [p for c in chunks for p in self.module.chunk_parameters(c)
                  if p.requires_grad and id(p) not in tied and not getattr(p, 'shared_by_copies', False)]
        return params, [(p._hp_grad if self.using_bf16_optimizer else p.grad) for p in params]

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
            self._handover[self._slot(buffer_id, down[1])] = messages.as_input(out, torch.is_grad_enabled())

    def _run_backward_input_pass(self, buffer_id, chunk):
        """A B. Where its own W is the rank's next pass (`_b_fills`), it computes its weight gradients while it waits
        for its collectives, as a fused backward alone does, and the W computes what is left (DualPipe's last B and
        W on the first stage): the same works, added in the same order."""
        if self._filling_b and self._filling_b.popleft():
            self._backward_ending(chunk)  # its works are the chunk's last where its W is
            overlap.run_alone(partial(self._run_backward_input, buffer_id, chunk, fill=True), rest=False)
        else:
            self._run_backward_input(buffer_id, chunk)

    def _run_backward_input(self, buffer_id, chunk, fused=False, fill=False):
        slot = self._slot(buffer_id, chunk)
        down = self._peer(chunk, +1)
        if down is not None and down[0] == self.stage_id:  # the gradient comes from the chunk after, here
            below = self._slot(buffer_id, down[1])
            self._grads[slot] = messages.input_grads(self.pipe_buffers['inputs'][below])
            self.pipe_buffers['inputs'][below] = None
        with self._in_chunk(chunk):
            if fused:
                SplitBackwardEngine._exec_backward_pass(self, slot)
            elif fill:  # its works fill its waits; its W computes the rest
                with self._filling(chunk) as queue:
                    SplitBackwardEngine._exec_stock_backward(self, slot)
                self._deferred[slot].append(queue)
            else:
                SplitBackwardEngine._exec_backward_input_pass(self, slot)

    def _run_backward_weight(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        final = self._backward_ending(chunk)
        works = list(self._deferred[slot][0]) if final and self._deferred[slot] else ()
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_backward_weight_pass(self, slot)
        for work in works:  # in the chunk's last backward, their sums start in the works' order
            self._copies.work_added(chunk, work)
        self._backward_done(chunk)

    def _run_backward(self, buffer_id, chunk):
        if self.fills_pairs():  # alone, its weight gradients fill its own waits for its collectives
            overlap.run_alone(partial(self._run_backward_filling, buffer_id, chunk))
        else:
            self._backward_ending(chunk)
            self._run_backward_input(buffer_id, chunk, fused=True)
        self._backward_done(chunk)

    def _run_forward_backward(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused):
        self._run_pair(*self._pair_parts(fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused))
        self._pair_done(bwd_chunk, fused)

    def _pair_done(self, bwd_chunk, fused):
        if fused:  # its backward was whole: the chunk's gradients may be complete
            self._backward_done(bwd_chunk)

    def _pair_parts(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused):
        """A ForwardBackwardPass's two passes: (forward, backward), each a function of no argument."""
        if fused and self.fills_pairs():
            backward = partial(self._run_backward_filling, bwd_buffer, bwd_chunk)
        else:
            backward = partial(self._run_backward_input, bwd_buffer, bwd_chunk, fused=fused)
        return partial(self._run_forward, fwd_buffer, fwd_chunk), backward

    def fills_pairs(self):
        """Whether an overlapped pair's fused backward defers its weight gradients to fill the time both passes wait
        for their collectives (overlap.fill_with), and a fused backward alone its own waits. Not under DeepSpeed's
        BF16 optimizer, which moves gradients to fp32 after each backward and would have to after each piece."""
        return self.overlaps_pairs() and not self.using_bf16_optimizer

    def _run_backward_filling(self, buffer_id, chunk):
        self._backward_ending(chunk)
        with self._filling(chunk):
            self._run_backward_input(buffer_id, chunk, fused=True)

    @contextmanager
    def _filling(self, chunk):
        """Within a pair or a pass alone (overlap.py): the weight-gradient works of the backward run inside deferred
        to a queue, which the pass's waits for its collectives compute from (overlap.fill_with)."""
        with defer_weight_grads() as queue:
            overlap.fill_with(queue, partial(self._weight_grads_now, chunk))
            yield queue

    def _weight_grads_now(self, chunk, work):
        """One deferred work's weight gradients, added into `.grad` as a W pass adds them (its hooks see them); in
        the chunk's last backward, their sum between the copies starts."""
        running, self._running_engine_backward = self._running_engine_backward, True
        try:
            with torch.enable_grad():  # inside a backward grad mode is off, and W's roots must record
                apply_weight_grads([work], in_place=self._in_place)
        finally:
            self._running_engine_backward = running
        if self._copies is not None:
            self._copies.work_added(chunk, work)

    def _run_pair(self, forward, backward):
        if self.overlaps_pairs():  # the backward starts; each computes while the other's all-to-all is in flight
            overlap.run_pair(backward, forward)
        else:
            forward()
            backward()

    def overlaps_pairs(self):
        """Whether a ForwardBackwardPass runs its two passes overlapped (overlap.py): where `overlap_pairs` is on
        and the module exchanges something in its passes (layers with experts sharded over several ranks)."""
        if self._overlapping is None:
            self._overlapping = self.overlap_pairs and any(layer.exchanges() for layer in expert_layers(self.module))
        return self._overlapping

    # --- the mirror placement: two copies of each stage, two loss ranks --------------------------
    def _mirror_groups(self):
        """Process groups {rank r, rank p-1-r} (the two copies of stage r) and {rank 0, rank p-1} (the two
        loss stages), per data-parallel replica. Every rank creates every group, in the same order."""
        p, mine, loss = self.num_stages, None, None
        for dp in range(self.grid.data_parallel_size):
            to_global = lambda stage: self.grid.topology().get_rank(pipe=stage, data=dp)  # noqa: E731
            for r in range(p // 2):
                group = self._new_group([to_global(r), to_global(p - 1 - r)])
                if dp == self.grid.get_data_parallel_id() and self.stage_id in (r, p - 1 - r):
                    mine = group
            group = self._new_group([to_global(0), to_global(p - 1)])
            if dp == self.grid.get_data_parallel_id() and self.stage_id in (0, p - 1):
                loss = group
        return mine, loss

    def _new_group(self, ranks):
        """A communicator with the default group's timeout (deepspeed.init_distributed(timeout=...), train.py's
        --dist-timeout): without it, torch gives a new group its own default, 30 minutes on gloo, and a
        stalled peer would hold this rank that long."""
        default = dist.distributed_c10d._get_default_group()
        try:
            timeout = default._get_backend(self.device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options: torch's default
            timeout = None
        return dist.new_group(ranks, timeout=timeout)

    def _exec_reduce_grads(self):
        if self._mirror:  # each copy of a stage gets the sum of both copies' gradients, so they stay equal
            self._copies.finish(sorted(range(self.placement.chunks),
                                       key=lambda c: self.placement.stage(self.stage_id, c)))
        super()._exec_reduce_grads()

    def _loss_shared_early(self):
        return not self._mirror and super()._loss_shared_early()  # the mirror has two loss ranks: below

    def _aggregate_total_loss(self):
        if not self._mirror:
            return super()._aggregate_total_loss()
        # Two ranks compute losses, one per direction: sum their shares over the pipeline group.
        total = self.total_loss if self.total_loss is not None else torch.zeros((), device=self.device)
        loss = self._scale_loss_by_gas(total.detach().clone().float())
        dist.all_reduce(loss, group=self.grid.get_pipe_parallel_group())
        self.dp_group_loss = loss.clone()
        if self.is_data_parallel:
            dist.all_reduce(loss, group=self.mpu.get_data_parallel_group())
            loss /= self.dp_world_size
        return loss

    def _reduce_outputs(self, outputs, reduce='avg', reduce_dp=True, micro_batches=None):
        reduced = super()._reduce_outputs(outputs, reduce, reduce_dp, micro_batches)
        if self._mirror and reduce is not None:  # each loss rank averaged its direction's share
            dist.all_reduce(reduced, group=self._loss_group)
        return reduced

    # --- point to point -------------------------------------------------------------------
    def _rank_of(self, peer):
        return self.grid.stage_to_global(stage_id=peer[0])

    def _run_send_activations(self, buffer_id, chunk):
        out = self.pipe_buffers['outputs'][self._slot(buffer_id, chunk)]
        self._send_activation(out, self._rank_of(self._peer(chunk, +1)), stream=chunk, group=self._channel['act'])

    def _source(self, kind, chunk):
        return self._rank_of(self._peer(chunk, -1 if kind == 'act' else +1)), self._channel[kind]

    def _run_recv_activations(self, buffer_id, chunk):
        self.pipe_buffers['inputs'][self._slot(buffer_id, chunk)] = self._recv_activation(chunk)

    def _run_send_grads(self, buffer_id, chunk):
        slot = self._slot(buffer_id, chunk)
        self._send(messages.input_grads(self.pipe_buffers['inputs'][slot]), self._rank_of(self._peer(chunk, -1)),
                   group=self._channel['grad'])
        self.pipe_buffers['inputs'][slot] = None

    def _run_recv_grads(self, buffer_id, chunk):
        self._recv_grad(self._slot(buffer_id, chunk), chunk)

    _INSTRUCTION_MAP = {
        **SplitBackwardEngine._INSTRUCTION_MAP,
        ds.ReduceGrads: _exec_reduce_grads,
        ds.LoadMicroBatch: _run_load,
        ds.ForwardPass: _run_forward,
        ds.BackwardPass: _run_backward,
        BackwardInputPass: _run_backward_input_pass,
        BackwardWeightPass: _run_backward_weight,
        ForwardBackwardPass: _run_forward_backward,
        ds.SendActivation: _run_send_activations,
        ds.RecvActivation: _run_recv_activations,
        ds.SendGrad: _run_send_grads,
        ds.RecvGrad: _run_recv_grads,
    }
