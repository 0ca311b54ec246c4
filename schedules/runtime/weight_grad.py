"""Deferred weight gradients: the backward split into B (input gradients) and W (weight gradients).

A linear layer's backward is two matrix multiplies: grad_input = grad_out @ weight, which the
previous pipeline stage is waiting for, and grad_weight = grad_out^T @ input, which nobody
needs until the optimizer step. Inside `defer_weight_grads()` a deferrable layer's backward
computes only the first and queues the second; the engine runs the queue later as the W pass
(`apply_weight_grads`). Outside that context it computes both at once, as usual.

Deferrable layers:
- `torch.nn.Linear` and its subclasses that keep nn.Linear's forward: `make_deferrable(model)`
  (which `schedules.initialize` calls for the schedules that split the backward) gives each of
  them a deferrable forward, in place: same class, parameter names, state_dict keys and
  checkpoints. `Linear` below is an nn.Linear that is deferrable from the start.
- `torch.nn.Embedding` with its default options (no padding index, max norm, frequency scaling or
  sparse gradient), likewise (`Embedding` below). Its weight gradient is the output gradient added
  at the looked-up rows: in place that is an `index_add_` of the micro-batch's tokens into `.grad`,
  where torch's backward builds a dense vocabulary x width gradient per micro-batch and autograd then
  adds it (93 ms against 0.1 ms per micro-batch of 256 tokens for GPT-2's 50257 x 768 on a CPU core).
- Any other layer: make its forward an autograd Function whose backward returns the input
  gradient now and hands its weight-gradient work to `defer_or_compute(work, ...)`, where `work`
  has `gradients()`: [(parameter, function computing that parameter's gradient)] and holds only
  what those functions need (see `DeferredLinearGrad`, and `_LinearFunction` for the pattern).

Inside `accumulate_in_place()` (the engines enter it where nothing hooks gradient accumulation: ZeRO 0,
no BF16 optimizer) a weight gradient is added into `.grad` by the matrix multiply itself
(`grad.addmm_(g^T, x)`, Megatron's gradient-accumulation fusion) rather than computed into a new
tensor that autograd then adds: one allocation and one pass over the gradient fewer per layer and
micro-batch, the backward's largest cost after the two multiplies (~25% of a W pass on a CPU core,
scripts/benchmark_peers.py).

Between B and W a micro-batch keeps only what the queued work needs (each linear layer's input
and output gradient; each embedding's indices and output gradient): the rest of its autograd graph is freed
by B as usual. Parameters of other layers (LayerNorm) get their gradients in B. `counts` tells how many parameter
gradients were deferred and how many computed at once (the engines report the share).
"""
import contextlib
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

_queue = None  # the list that Linear backward appends to while deferral is on, else None
_in_place = False  # while on, computed weight gradients are added into .grad directly (accumulate_in_place)
_holders = []  # memory trackers told what queued work keeps alive (schedules/observe/memory.py)
counts = Counter()  # 'deferred' / 'immediate': parameter gradients of deferrable layers, queued or computed at once


def register_holder(holder):
    """`holder.hold(*tensors)` is called for what each queued weight-gradient work keeps; the
    returned tokens live as long as the work (a tracker releases them when W has run)."""
    _holders.append(holder)


def unregister_holder(holder):
    _holders.remove(holder)


@contextlib.contextmanager
def defer_weight_grads():
    """Within: `Linear` layers queue their weight-gradient work. Yields the queue (a list)."""
    global _queue
    outer, _queue = _queue, []
    try:
        yield _queue
    finally:
        _queue = outer


@contextlib.contextmanager
def accumulate_in_place(enabled=True):
    """Within (when `enabled`): weight gradients computed at once (a fused backward) are added into
    `.grad` by their multiply (`accumulate`), not handed to autograd. Only where nothing watches
    gradient accumulation: no hooks on the parameters, no optimizer that reads gradients as they come."""
    global _in_place
    outer, _in_place = _in_place, enabled
    try:
        yield
    finally:
        _in_place = outer


_SPARE = '_spare_grad'  # a parameter's attribute: its last step's gradient tensor, or None (spare_grads)


def spare_grads(params):
    """Release the gradients of `params` (`.grad = None`, as zeroing them after a step does) but keep the
    tensors of those that in-place accumulation wrote, so that the next step's first gradient of each is
    written into it (`mm(..., out=)`) instead of into new memory: no allocation and no release of a
    gradient-sized buffer per parameter and step (page faults and unmapping for large ones)."""
    for p in params:
        if p.grad is not None and hasattr(p, _SPARE):
            setattr(p, _SPARE, p.grad)
        p.grad = None


def keep_spare_grads(pairs):
    """[(parameter, gradient tensor no longer needed)]: each becomes its parameter's spare (`spare_grads`), where
    in-place accumulation keeps one, so that a later step's first gradient is written into it."""
    for p, grad in pairs:
        if grad is not None and hasattr(p, _SPARE):
            setattr(p, _SPARE, grad)


def _first_grad(param, compute_into):
    """`param`'s first gradient of a step: written into its spare tensor when it has one, else new."""
    buffer = getattr(param, _SPARE, None)
    if buffer is not None and buffer.shape == param.shape and buffer.dtype == param.dtype:
        param.grad = compute_into(buffer)
    else:
        param.grad = compute_into(None)
    setattr(param, _SPARE, None)  # kept between steps from now on (spare_grads)


def accumulate(work):
    """Add one work's gradients into its parameters' `.grad` (set it where there is none): its own
    `accumulate()` when it has one (fused into the multiply), else each gradient computed, then added."""
    if hasattr(work, 'accumulate'):
        work.accumulate()
        return
    for param, compute in work.gradients():
        grad = compute()
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def apply_weight_grads(queue, in_place=False):
    """The W pass: compute the queued weight gradients and accumulate them into `.grad`; with
    `in_place`, straight into `.grad` (`accumulate`), as `accumulate_in_place` does.

    They go through autograd (a backward to the leaf parameters) rather than being written to
    `.grad` directly, so gradient-accumulation hooks (DeepSpeed's among them) see them. Each one is
    computed inside that backward, by `_Computed`, so that autograd owns it: a step's first
    gradient then becomes `.grad` as it is instead of being copied (a gradient handed to
    `backward()` by its caller is copied, because the caller still holds it), and one
    gradient at a time is alive, not the whole queue's.
    """
    if in_place:
        with torch.no_grad():  # as inside autograd's backward: the sums must not record a graph
            for work in queue:
                accumulate(work)
        queue.clear()
        return
    roots = [_Computed.apply(param, compute) for work in queue for param, compute in work.gradients()]
    queue.clear()
    if roots:
        torch.autograd.backward(roots, [root.new_ones(()) for root in roots])  # on each root's device


class _Computed(torch.autograd.Function):
    """A scalar stand-in for `param` whose backward hands autograd `compute()` as its gradient."""

    @staticmethod
    def forward(ctx, param, compute):
        ctx.compute = compute
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.compute = ctx.compute(), None
        return grad, None


class DeferredLinearGrad:
    """The weight-gradient work of one linear layer for one micro-batch: what W will compute.

    Holds exactly what that needs: the layer's input and its output gradient.
    """
    __slots__ = ('weight', 'bias', 'x', 'grad_out', '_tokens')

    def __init__(self, weight, bias, x, grad_out):
        self.weight, self.bias, self.x, self.grad_out = weight, bias, x, grad_out
        self._tokens = None

    def _g(self):
        return self.grad_out.reshape(-1, self.grad_out.shape[-1])

    def _weight_grad(self):
        return self._g().t() @ self.x.reshape(-1, self.x.shape[-1])

    def _bias_grad(self):
        return self._g().sum(0)

    def gradients(self):
        """[(parameter, function computing its gradient for this micro-batch)]."""
        return [(p, f) for p, f in ((self.weight, self._weight_grad), (self.bias, self._bias_grad)) if p is not None]

    def accumulate(self):
        """Add this micro-batch's gradients into `.grad`: the weight's by one multiply-add into it (the
        step's first written into the last step's tensor, `spare_grads`)."""
        weight, bias = self.weight, self.bias
        g, x = self._g(), self.x.reshape(-1, self.x.shape[-1])
        if weight is not None:
            if weight.grad is None:
                _first_grad(weight, lambda out: torch.mm(g.t(), x, out=out))
            else:
                weight.grad.addmm_(g.t(), x)
        if bias is not None:
            if bias.grad is None:
                _first_grad(bias, lambda out: torch.sum(g, 0, out=out))
            else:
                bias.grad.add_(g.sum(0))


class _LinearFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves (see above defer_or_compute)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        weight = ctx.weight
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        want_b = ctx.bias is not None and ctx.needs_input_grad[2]
        work = DeferredLinearGrad(weight if ctx.needs_input_grad[1] else None, ctx.bias if want_b else None,
                                  x, grad_out)
        grads = defer_or_compute(work, x, grad_out)
        return grad_x, grads.get(id(weight)), grads.get(id(ctx.bias))


# A parameter whose gradient a work adds into `.grad` must be the parameter itself, so a Function keeps it on `ctx`
# (`ctx.weight = weight`), never through `ctx.save_for_backward`: under saved-tensor hooks (a memory tracker's,
# schedules/observe/memory.py) what `ctx.saved_tensors` hands back is another tensor of the same storage, and a
# gradient set on it never reaches the parameter.


def deferring():
    """Whether a backward running now is a deferring one (B): weight-gradient work would be queued for W."""
    return _queue is not None


def defer_or_compute(work, *kept):
    """In a deferring backward (B), queue `work` for the W pass and return {}; else compute its
    gradients now: {id(parameter): gradient}. `kept` are the tensors the work holds (memory trackers count them)."""
    gradients = work.gradients()
    if _queue is not None and gradients:
        work._tokens = [h.hold(*kept) for h in _holders]
        _queue.append(work)
        counts['deferred'] += len(gradients)
        return {}
    counts['immediate'] += len(gradients)
    if _in_place:
        accumulate(work)
        return {}
    return {id(p): compute() for p, compute in gradients}


def _deferrable_linear_forward(self, x):
    return _LinearFunction.apply(x, self.weight, self.bias)


class Linear(nn.Linear):
    """nn.Linear whose weight (and bias) gradients can be deferred to a W pass."""

    forward = _deferrable_linear_forward


class DeferredEmbeddingGrad:
    """The weight-gradient work of one embedding lookup for one micro-batch: the output gradient added at the
    looked-up rows. Holds exactly what that needs: the indices and the output gradient."""
    __slots__ = ('weight', 'ids', 'grad_out', '_tokens')

    def __init__(self, weight, ids, grad_out):
        self.weight, self.ids, self.grad_out = weight, ids, grad_out
        self._tokens = None

    def _weight_grad(self):  # torch's own dense backward, as nn.Embedding computes it
        return torch.ops.aten.embedding_dense_backward(self.grad_out, self.ids, self.weight.shape[0], -1, False)

    def gradients(self):
        """[(parameter, function computing its gradient for this micro-batch)]."""
        return [(self.weight, self._weight_grad)]

    def accumulate(self):
        """Add this micro-batch's rows into `.grad` (`index_add_`): no vocabulary-sized tensor but the step's first
        gradient, written into the last step's tensor (`spare_grads`)."""
        weight = self.weight
        ids, g = self.ids.reshape(-1), self.grad_out.reshape(-1, weight.shape[1])
        if weight.grad is None:
            _first_grad(weight, lambda out: (torch.zeros_like(weight) if out is None else out.zero_())
                        .index_add_(0, ids, g))
        else:
            weight.grad.index_add_(0, ids, g)


class _EmbeddingFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None
        ids, = ctx.saved_tensors
        grads = defer_or_compute(DeferredEmbeddingGrad(ctx.weight, ids, grad_out), ids, grad_out)
        return None, grads.get(id(ctx.weight))


def _deferrable_embedding_forward(self, ids):
    if not _plain_embedding(self):  # an option changes the backward: nn.Embedding's own
        return nn.Embedding.forward(self, ids)
    return _EmbeddingFunction.apply(ids, self.weight)


def _plain_embedding(module):
    """An nn.Embedding with none of the options that change its backward: deferrable as it is."""
    return (module.padding_idx is None and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse)


class Embedding(nn.Embedding):
    """nn.Embedding whose weight gradient can be deferred to a W pass and added into `.grad` at the looked-up rows
    (nn.Embedding's own backward where an option changes it: a padding index, max norm, frequency scaling, sparse)."""

    forward = _deferrable_embedding_forward


def make_deferrable(module):
    """Give every torch.nn.Linear in `module` that keeps nn.Linear's own forward a deferrable one, in
    place (an instance attribute: class, names, state_dict and checkpoints unchanged), and every
    torch.nn.Embedding with its default options likewise.
    Returns (deferrable layers, their trainable parameter elements, all trainable parameter elements)."""
    layers = elements = 0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            stock, deferrable = nn.Linear.forward, _deferrable_linear_forward
        elif isinstance(m, nn.Embedding) and _plain_embedding(m):
            stock, deferrable = nn.Embedding.forward, _deferrable_embedding_forward
        else:
            continue
        if type(m).forward in (stock, deferrable):
            if type(m).forward is stock and 'forward' not in vars(m):
                m.forward = deferrable.__get__(m)
            layers += 1
            elements += sum(p.numel() for p in m.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return layers, elements, total
