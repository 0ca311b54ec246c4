"""The backward split into B and W (schedules/weight_grad.py), on the models themselves, in one process.

B computes input gradients and the gradients of non-linear-layer parameters; W computes the
linear layers' weight gradients later; together they equal the fused backward, and each does
about half of its matrix-multiply FLOPs.
"""
import contextlib
import dataclasses
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import deep_model
import gptlite
from schedules.observe.memory import SavedTensorTracker
from schedules.runtime.weight_grad import (
    Embedding,
    Linear,
    accumulate_in_place,
    apply_weight_grads,
    defer_weight_grads,
    make_deferrable,
    spare_grads,
)


def gpt_stage(head="chunked"):
    """Blocks, final LayerNorm and head of the tiny GPTlite: a middle-to-last pipeline stage."""
    config = dataclasses.replace(gptlite.MODEL_SIZES["tiny"], head=head)
    layers = gptlite.GPTlite(config).to_layers()[1:]
    return torch.nn.Sequential(*layers)


def deep_stage():
    return torch.nn.Sequential(*deep_model.DeepModel(deep_model.DeepConfig(width=64, depth=4)).to_layers())


def timed_stage(seconds=(0.001, 0.002, 0.003)):
    config = deep_model.DeepConfig(width=64, depth=4, pass_seconds=seconds)
    return torch.nn.Sequential(*deep_model.DeepModel(config).to_layers())


def inputs(stage):
    torch.manual_seed(0)
    width = 32 if isinstance(stage[0], gptlite.Block) else 64
    shape = (4, 32, width) if isinstance(stage[0], gptlite.Block) else (16, width)
    return torch.randn(*shape, requires_grad=True)


def loss_of(stage, x):
    out = stage(x)
    if isinstance(out, tuple):  # GPTlite's head: (hidden, weight), projected inside its loss by vocabulary chunks
        hidden, weight = out
        labels = torch.arange(hidden.shape[0] * hidden.shape[1]).view(hidden.shape[:2]) * 7919 % weight.shape[0]
        return gptlite.CrossEntropyLoss_FlatView(out, labels)
    return (out ** 2).mean()


@pytest.mark.parametrize("make", [gpt_stage, deep_stage, timed_stage], ids=["gptlite", "deep", "timed"])
def test_b_then_w_equals_fused_backward(make):
    stage = make()
    x = inputs(stage)
    loss_of(stage, x).backward()
    fused = {n: p.grad.clone() for n, p in stage.named_parameters()}
    fused_x = x.grad.clone()
    stage.zero_grad(set_to_none=True)
    x.grad = None

    with defer_weight_grads() as queue:  # B
        loss_of(stage, x).backward()
    linear = {n for n, m in stage.named_modules() if isinstance(m, Linear) for n in (f"{n}.weight", f"{n}.bias")}
    assert torch.allclose(x.grad, fused_x, atol=1e-6)
    for name, p in stage.named_parameters():
        if name in linear:
            assert p.grad is None, f"{name} got its gradient in B"
        else:
            assert torch.allclose(p.grad, fused[name], atol=1e-6), name
    assert queue

    apply_weight_grads(queue)  # W
    assert not queue
    for name, p in stage.named_parameters():
        assert torch.allclose(p.grad, fused[name], atol=1e-6), name


@pytest.mark.parametrize("tracked", [False, True], ids=["", "tracked"])
@pytest.mark.parametrize("make", [gpt_stage, deep_stage, timed_stage], ids=["gptlite", "deep", "timed"])
def test_in_place_accumulation_equals_autograds_over_micro_batches(make, tracked):
    """Three micro-batches: the weight gradients added into .grad by their multiply (fused backward, and B
    then W) equal autograd's accumulation of fresh gradients; the linear layers' .grad tensors are the
    first micro-batch's, added into, never replaced. `tracked`: under a memory tracker's saved-tensor hooks
    (--trace-memory), whose unpacked tensors are not the parameters: the gradients still reach them."""
    stage = make()
    xs = [(inputs(stage) * (k + 1)).detach().requires_grad_() for k in range(3)]

    def grads(backward):
        stage.zero_grad(set_to_none=True)
        first = None
        for k, x in enumerate(xs):
            backward(loss_of(stage, x))
            if k == 0:
                first = {n: p.grad for n, p in stage.named_parameters()}
        assert all(p.grad is first[n] for n, p in stage.named_parameters() if n.endswith("fc.weight"))
        return {n: p.grad.clone() for n, p in stage.named_parameters()}

    def fused_in_place(loss):
        with accumulate_in_place():
            loss.backward()

    def split(loss, in_place):
        with defer_weight_grads() as queue:
            loss.backward()
        apply_weight_grads(queue, in_place=in_place)

    reference = grads(lambda loss: loss.backward())
    for backward in (fused_in_place, lambda loss: split(loss, True), lambda loss: split(loss, False)):
        with SavedTensorTracker(ignore=list(stage.parameters())) if tracked else contextlib.nullcontext():
            got = grads(backward)
        for name, ref in reference.items():
            assert torch.allclose(got[name], ref, rtol=1e-5, atol=1e-6), name
        assert not any(p.grad.requires_grad for p in stage.parameters())  # no graph recorded by the sums


def test_a_steps_first_gradient_is_written_into_the_last_steps_tensor():
    """spare_grads releases the gradients (None, as after a step) but keeps the linear layers' tensors; the
    next step's in-place gradients land in them, with the values a fresh backward gives."""
    stage = deep_stage()
    x = inputs(stage)
    reference = torch.autograd.grad(loss_of(stage, x), list(stage.parameters()))
    for _ in range(2):
        with accumulate_in_place():
            loss_of(stage, x).backward()
        kept = [p.grad for p in stage.parameters()]
        spare_grads(stage.parameters())
        assert all(p.grad is None for p in stage.parameters())
    with accumulate_in_place():
        loss_of(stage, x).backward()
    for p, old, ref in zip(stage.parameters(), kept, reference):
        assert p.grad is old and torch.allclose(p.grad, ref, atol=1e-6)


def test_an_embeddings_gradient_deferred_or_added_in_place_equals_nn_embeddings():
    """The deferrable Embedding over three micro-batches with repeated tokens: fused, B then W, and both added into
    .grad by index_add_ (the first of a step written into the last step's tensor) give nn.Embedding's gradient."""
    torch.manual_seed(0)
    reference = torch.nn.Embedding(50, 8)
    ours = Embedding(50, 8)
    ours.load_state_dict(reference.state_dict())
    ids = [torch.randint(0, 10, (3, 7)) for _ in range(3)]  # 21 tokens over 10 rows: repeats
    probes = [torch.randn(3, 7, 8) for _ in ids]

    def grad(layer, backward):
        for x, probe in zip(ids, probes):
            backward(((layer(x) * probe) ** 2).sum())
        return layer.weight.grad

    expected = grad(reference, lambda loss: loss.backward())

    def split(loss, in_place=False):
        with defer_weight_grads() as queue:
            loss.backward()
        assert len(queue) == 1  # the lookup's gradient waits for W
        apply_weight_grads(queue, in_place=in_place)

    def fused_in_place(loss):
        with accumulate_in_place():
            loss.backward()

    for backward in (lambda loss: loss.backward(), split, lambda loss: split(loss, True), fused_in_place):
        for tracked in (False, True):  # under a memory tracker's saved-tensor hooks too (--trace-memory)
            ours.weight.grad = None
            with SavedTensorTracker(ignore=[ours.weight]) if tracked else contextlib.nullcontext():
                assert torch.allclose(grad(ours, backward), expected, atol=1e-6)
    kept = ours.weight.grad
    spare_grads([ours.weight])
    assert torch.allclose(grad(ours, fused_in_place), expected, atol=1e-6) and ours.weight.grad is kept


def test_make_deferrable_takes_plain_embeddings_and_leaves_those_whose_options_change_the_backward():
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Embedding(20, 4, padding_idx=0),
                                torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 4))
    layers, elements, total = make_deferrable(model)
    assert (layers, elements, total) == (2, 20 * 4 + 4 * 4 + 4, 3 * 20 * 4 + 4 * 4 + 4)
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1]) and "forward" not in vars(model[2])
    x = torch.randint(0, 20, (2, 5))
    with defer_weight_grads() as queue:
        model[0](x).sum().backward()
        model[1](x).sum().backward()
    assert model[0].weight.grad is None and model[1].weight.grad is not None and len(queue) == 1


def matmul_flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if "mm" in str(op) or "bmm" in str(op))


@pytest.mark.parametrize("make,low,high", [(deep_stage, 0.49, 0.51), (gpt_stage, 0.40, 0.60)], ids=["deep", "gptlite"])
def test_b_and_w_each_do_about_half_of_the_backward_matmuls(make, low, high):
    stage = make()
    x = inputs(stage)
    loss = loss_of(stage, x)
    fused = matmul_flops(lambda: loss.backward())
    loss = loss_of(stage, x)
    with defer_weight_grads() as queue:
        b = matmul_flops(lambda: loss.backward())
    w = matmul_flops(lambda: apply_weight_grads(queue))
    assert b + w == fused
    assert low <= b / fused <= high and low <= w / fused <= high, (b, w, fused)


def test_between_b_and_w_only_the_linear_inputs_and_output_grads_are_kept():
    """B frees the micro-batch's autograd graph; the queue holds each linear layer's input and output
    gradient, which the memory tracker counts until W has run (torch's head: a Linear; the chunked head's deferred
    work keeps its blocks' gradients instead, tests/test_chunked_head.py)."""
    stage = gpt_stage(head="linear")
    x = inputs(stage)
    params = list(stage.parameters())
    with SavedTensorTracker(ignore=params) as tracker:
        loss = loss_of(stage, x)
        saved_after_forward = tracker.live_bytes
        with defer_weight_grads() as queue:
            loss.backward()
        # what the queue keeps: each linear layer's input and output gradient, nothing else
        tokens = x.shape[0] * x.shape[1]
        expected = sum((m.in_features + m.out_features) * tokens * 4 for m in stage.modules() if isinstance(m, Linear))
        assert sum(t.numel() * t.element_size() for work in queue for t in (work.x, work.grad_out)) == expected
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for work in queue for t in (work.x, work.grad_out)}
        assert 0 < tracker.live_bytes == sum(storages.values()) < saved_after_forward
        apply_weight_grads(queue)
        assert tracker.live_bytes == 0


def test_timed_blocks_compute_what_deep_blocks_do_in_their_set_times():
    """deep_model's TimedBlock (pass_seconds): the same parameters, outputs and gradients as DeepBlock, its
    forward, B and W each taking at least their set time per block, and not much more."""
    timed, deep = timed_stage((0.02, 0.03, 0.04)), deep_stage()
    for (name, a), (_, b) in zip(timed.named_parameters(), deep.named_parameters()):
        assert torch.equal(a, b), name
    x = inputs(deep)

    def clocked(f):
        t0 = time.perf_counter()
        out = f()
        return out, time.perf_counter() - t0

    def passes():
        loss, forward = clocked(lambda: loss_of(timed, x))
        with defer_weight_grads() as queue:
            _, b = clocked(loss.backward)
        _, w = clocked(lambda: apply_weight_grads(queue))
        return forward, b, w

    passes()  # autograd's first backward in a process starts its machinery (0.3 s here)
    timed.zero_grad(set_to_none=True)
    forward, b, w = passes()
    loss_of(deep, x).backward()
    for (name, a), (_, b_) in zip(timed.named_parameters(), deep.named_parameters()):
        assert torch.allclose(a.grad, b_.grad, atol=1e-6), name
    for took, want in ((forward, 0.08), (b, 0.12), (w, 0.16)):  # 4 blocks; a loaded machine may add, never take
        assert want <= took < 2 * want + 0.1, (took, want)
