"""Deferred weight gradients: the backward split into B (input gradients) and W (weight gradients).

A linear layer's backward is two matrix multiplies: grad_input = grad_out @ weight, which the
previous pipeline stage is waiting for, and grad_weight = grad_out^T @ input, which nobody
needs until the optimizer step. `Linear` below is an `nn.Linear` whose backward, inside
`defer_weight_grads()`, computes only the first and queues the second; the engine runs the
queue later as the W pass (`apply_weight_grads`). Outside that context it is an ordinary
linear layer, so the models use it unconditionally.

Between B and W a micro-batch keeps only what the queued work needs (each linear layer's input
and output gradient): the rest of its autograd graph is freed by B as usual. Parameters of other
layers (embeddings, LayerNorm) get their gradients in B.
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

_queue = None  # the list that Linear backward appends to while deferral is on, else None


@contextlib.contextmanager
def defer_weight_grads():
    """Within: `Linear` layers queue their weight-gradient work. Yields the queue (a list)."""
    global _queue
    outer, _queue = _queue, []
    try:
        yield _queue
    finally:
        _queue = outer


def apply_weight_grads(queue, backward=torch.autograd.backward):
    """The W pass: compute the queued weight gradients and accumulate them into `.grad`.

    They go through autograd (`backward` on the leaf parameters) rather than being written to
    `.grad` directly, so gradient-accumulation hooks (DeepSpeed's among them) see them.
    """
    params, grads = [], []
    for work in queue:
        for param, grad in work():
            params.append(param)
            grads.append(grad)
    queue.clear()
    if params:
        backward(params, grads)


class _LinearFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        bias = ctx.bias
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads():
            g = grad_out.reshape(-1, grad_out.shape[-1])
            out = []
            if want_w:
                out.append((weight, g.t() @ x.reshape(-1, x.shape[-1])))
            if want_b:
                out.append((bias, g.sum(0)))
            return out

        if _queue is not None and (want_w or want_b):
            _queue.append(weight_grads)
            return grad_x, None, None
        grads = dict((id(p), g) for p, g in weight_grads())
        return grad_x, grads.get(id(weight)), grads.get(id(bias)) if bias is not None else None


class Linear(nn.Linear):
    """nn.Linear whose weight (and bias) gradients can be deferred to a W pass."""

    def forward(self, x):
        return _LinearFunction.apply(x, self.weight, self.bias)
