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
from collections import Counter
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import BackwardInputPass, BackwardWeightPass, ForwardBackwardPass
from schedules.runtime import messages, overlap
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
        self._sums, self._backwards_left = {}, {}
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
        self._sums = {}
        self._backwards_left = Counter(self._early_sums(pipe_schedule))
        super()._exec_schedule(pipe_schedule)

    # --- the copies' gradient sum, a chunk's started once its last backward is done ----------
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

    def _backward_done(self, chunk):
        """After an instruction that ends a backward of `chunk`: with its last of the step, its gradients' sum
        starts (where they are all fp32 tensors of their own; else it waits for ReduceGrads)."""
        if chunk in self._backwards_left:
            self._backwards_left[chunk] -= 1
            if self._backwards_left[chunk] == 0:
                _, grads = self._summed_gradients([chunk])
                if _summable_in_place(grads):
                    self._sums[chunk] = _start_sum(grads, self._mirror_group)

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

    def _run_backward_input(self, buffer_id, chunk, fused=False):
        slot = self._slot(buffer_id, chunk)
        down = self._peer(chunk, +1)
        if down is not None and down[0] == self.stage_id:  # the gradient comes from the chunk after, here
            below = self._slot(buffer_id, down[1])
            self._grads[slot] = messages.input_grads(self.pipe_buffers['inputs'][below])
            self.pipe_buffers['inputs'][below] = None
        with self._in_chunk(chunk):
            if fused:
                SplitBackwardEngine._exec_backward_pass(self, slot)
            else:
                SplitBackwardEngine._exec_backward_input_pass(self, slot)

    def _run_backward_weight(self, buffer_id, chunk):
        with self._in_chunk(chunk):
            SplitBackwardEngine._exec_backward_weight_pass(self, self._slot(buffer_id, chunk))
        self._backward_done(chunk)

    def _run_backward(self, buffer_id, chunk):
        if self.fills_pairs():  # alone, its weight gradients fill its own waits for its collectives
            overlap.run_alone(partial(self._run_backward_filling, buffer_id, chunk))
        else:
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
        with defer_weight_grads() as queue:
            overlap.fill_with(queue, self._weight_grads_now)
            self._run_backward_input(buffer_id, chunk, fused=True)

    def _weight_grads_now(self, work):
        """One deferred work's weight gradients, added into `.grad` as a W pass adds them (its hooks see them)."""
        running, self._running_engine_backward = self._running_engine_backward, True
        try:
            with torch.enable_grad():  # inside a backward grad mode is off, and W's roots must record
                apply_weight_grads([work], in_place=self._in_place)
        finally:
            self._running_engine_backward = running

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
            chunks = sorted(range(self.placement.chunks), key=lambda c: self.placement.stage(self.stage_id, c))
            rest = [c for c in chunks if c not in self._sums]
            if rest:
                params, grads = self._summed_gradients(rest)
                if _summable_in_place(grads):
                    _start_sum(grads, self._mirror_group)()
                else:
                    _sum_flat(params, grads, self._mirror_group)
            for finish in self._sums.values():  # those started as their chunk's last backward ended
                finish()
            self._sums = {}
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
        BackwardInputPass: _run_backward_input,
        BackwardWeightPass: _run_backward_weight,
        ForwardBackwardPass: _run_forward_backward,
        ds.SendActivation: _run_send_activations,
        ds.RecvActivation: _run_recv_activations,
        ds.SendGrad: _run_send_grads,
        ds.RecvGrad: _run_recv_grads,
    }


SMALL_GRADIENT_BYTES = 1 << 20  # below this, gradients are summed together in one flat buffer


def gradient_ends(pipe_schedule):
    """The chunk of each instruction of a step's stream that ends a backward's gradients (a fused backward, alone or
    paired, or a W), in order."""
    ends = []
    for step in pipe_schedule:
        for cmd in step:
            kind, kw = type(cmd), cmd.kwargs
            if kind in (ds.BackwardPass, BackwardWeightPass):
                ends.append(kw.get('chunk', 0))
            elif kind is ForwardBackwardPass and kw['fused']:
                ends.append(kw['bwd_chunk'])
    return ends


def gradient_order(schedule_cls, placement, rank, stages, micro_batches):
    """The model stages `rank` holds, in the order its step's stream ends their gradients (their last backward)."""
    ends = gradient_ends(schedule_cls(micro_batches=micro_batches, stages=stages, stage_id=rank))
    last = {c: i for i, c in enumerate(ends)}
    return [placement.stage(rank, c) for c in sorted(last, key=last.get)]


def _summable_in_place(grads):
    """Whether `_start_sum` can sum these where they lie: every one an fp32 tensor of its own layout (else
    `_sum_flat`)."""
    return all(g is not None and g.dtype == torch.float32 and g.is_contiguous() for g in grads)


def _start_sum(grads, group):
    """Every fp32 gradient summed over `group`, all in flight at once; returns what waits for them. Those of 1 MiB
    or more where they lie, one all-reduce each (no flat copy made and copied back: 64 MiB of DualPipe's deep-model
    gradients took 110 ms that way against 56 for the all-reduce alone), the smaller ones through one flat copy,
    since gloo's cost per all-reduce outweighs their copy (GPTlite small's 146 gradients, 59 MB: 60-121 ms one each,
    35-45 ms so; loopback, AMD EPYC). Summing two ranks' values is the same in any grouping, bit for bit."""
    small, large = [], []
    for g in grads:
        (small if g.numel() * g.element_size() < SMALL_GRADIENT_BYTES else large).append(g)
    works = [dist.all_reduce(g, group=group, async_op=True) for g in large]
    flat = None
    if small:
        flat = torch.cat([g.reshape(-1) for g in small])
        works.append(dist.all_reduce(flat, group=group, async_op=True))

    def finish():
        for work in works:
            work.wait()
        offset = 0
        for g in small:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return finish


def _sum_flat(params, grads, group):
    """The gradients summed over `group` through one flat fp32 copy: for bf16 gradients and those not yet made."""
    flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p, g in zip(params, grads)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):  # the BF16 optimizer's fp32 gradients may be flat views
        summed = flat[offset:offset + p.numel()]
        offset += p.numel()
        if g is None:
            p.grad = summed.view_as(p).to(p.dtype)
        else:
            g.copy_(summed.view(g.shape))
