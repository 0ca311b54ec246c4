"""The whole vocabulary head in chunks (schedules/runtime/chunked_head.py; GPTlite's default head, `--head chunked`,
and `--head recompute`).

- `linear_cross_entropy` is F.cross_entropy(F.linear(...)) in fp32: the loss within 1e-6, the input's and the
  weight's gradients within 1e-5, through a fused backward, a B with a deferred W, in-place accumulation and under a
  memory tracker; on a plain torch model (an embedding, a block, a LayerNorm, a ChunkedHead, tied or not), with
  ignored labels, and on GPTlite (every parameter's gradient), in bf16 as torch's in bf16.
- Recomputing its logits in the backward (`--head recompute`) it holds one block of them: GPTlite small's head at most
  a quarter of nn.Linear + torch's cross-entropy's peak; keeping its exponentials (`--head chunked`), as much.
- The head's weight keeps its name, shape and initial values; train.py trains the same with every head
  (`--head chunked | recompute | linear`), and refuses `--head linear` with `--vocab-parallel` in one line.
Pipelines: every schedule's equivalence tests run GPTlite with this head; a user's model with it (tied) runs every
schedule in tests/test_user_models.py.
"""
import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from training import TINY, assert_one_error_line, run_in_process, train, write_sgd_config

BACKWARDS = ["fused", "deferred", "in place", "tracked"]


def _backward(loss, how):
    """loss.backward() as the engines run it: fused (under a memory tracker's saved-tensor hooks too, as with
    --trace-memory); B then a deferred W; adding into .grad in place."""
    from schedules.runtime.weight_grad import accumulate_in_place, apply_weight_grads, defer_weight_grads
    if how == "deferred":
        with defer_weight_grads() as queue:
            loss.backward()
        assert queue, "the head's weight gradient was not deferred"
        apply_weight_grads(queue)
    elif how == "in place":
        with accumulate_in_place():
            loss.backward()
    else:
        loss.backward()


class TinyLM(nn.Module):
    """A model that is not GPTlite: an embedding, a block of plain nn.Linear, a LayerNorm and an output head,
    tied to the embedding or its own (a ChunkedHead or an nn.Linear, of the same weight)."""

    def __init__(self, vocab, width, tied, chunked):
        super().__init__()
        from schedules.runtime.chunked_head import ChunkedHead
        torch.manual_seed(0)
        self.embed, self.fc, self.norm = nn.Embedding(vocab, width), nn.Linear(width, width), nn.LayerNorm(width)
        self.head = None if tied else (ChunkedHead(width, vocab) if chunked else nn.Linear(width, vocab, bias=False))
        self.chunked = chunked

    def forward(self, tokens):
        hidden = self.norm(F.gelu(self.fc(self.embed(tokens))))
        weight = self.embed.weight if self.head is None else self.head.weight
        if self.chunked:
            return (hidden, weight) if self.head is None else self.head(hidden)
        return F.linear(hidden, weight)


@pytest.mark.parametrize("keep", [0.0, 0.4, 1.0])  # none, some, all of the exponentials kept for the backward
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("how", BACKWARDS)
def test_a_users_model_with_the_chunked_head_is_torchs_cross_entropy(tied, how, keep):
    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime.chunked_head import linear_cross_entropy
    vocab, width, chunk = 203, 24, 64  # 4 blocks, the last one short
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, vocab, (3, 11), generator=g) for _ in range(2))
    labels[0, :4] = torch.tensor([0, chunk - 1, chunk, vocab - 1])  # targets at the blocks' edges
    labels[1, 2] = -100  # ignored, as torch ignores it
    ref, ours = TinyLM(vocab, width, tied, chunked=False), TinyLM(vocab, width, tied, chunked=True)
    for name, param in ref.state_dict().items():  # the same parameters, names and shapes
        assert torch.equal(param, ours.state_dict()[name]), name
    expected = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
    expected.backward()
    tracked = SavedTensorTracker(ignore=list(ours.parameters())) if how == "tracked" else contextlib.nullcontext()
    with tracked:
        hidden, weight = ours(tokens)
        loss = linear_cross_entropy(hidden, weight, labels, chunk=chunk, keep=keep)
        _backward(loss, how)
    assert abs(loss.item() - expected.item()) <= 1e-6
    for name, param in ref.named_parameters():
        other = dict(ours.named_parameters())[name]
        assert (other.grad - param.grad).abs().max() <= 1e-5, name
        assert param.grad.abs().max() > 1e-4, name  # the comparison compares something


def _gptlite_gradients(head, size="tiny", dtype=torch.float32, seed=3):
    import gptlite
    config = replace(gptlite.MODEL_SIZES[size], seed=seed, head=head)
    model = gptlite.GPTlite(config).to(dtype)
    g = torch.Generator().manual_seed(0)
    idx, labels = (torch.randint(0, config.vocab_size, (2, config.block_size), generator=g) for _ in range(2))
    loss = gptlite.head_loss(head)(model(idx), labels)
    loss.backward()
    return model, loss, {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("head", ["chunked", "recompute"])
def test_gptlite_head_is_torchs_linear_and_cross_entropy(head):
    """Every parameter's gradient in fp32; the head's weight named, shaped and initialised as before."""
    linear, ref_loss, ref = _gptlite_gradients("linear")
    chunked, loss, grads = _gptlite_gradients(head)
    assert type(chunked.lm_head).__name__ == "LMHead" and type(linear.lm_head).__name__ == "LinearLMHead"
    shapes = {n: p.shape for n, p in linear.state_dict().items()}
    assert {n: p.shape for n, p in chunked.state_dict().items()} == shapes
    for name, param in linear.state_dict().items():  # the same initial weights (the gradients changed nothing)
        assert torch.equal(chunked.state_dict()[name], param), name
    assert abs(loss.item() - ref_loss.item()) <= 1e-6
    for name, grad in ref.items():
        assert (grads[name] - grad).abs().max().item() <= 1e-5, name
        assert grad.abs().max() > 1e-6, name


@pytest.mark.parametrize("head", ["chunked", "recompute"])
def test_gptlite_head_in_bf16_is_as_close_to_fp32_as_torchs(head):
    """In bf16 torch rounds the logits to bf16, the chunked head computes them in fp32: its loss and gradients are
    no further from the fp32 model's than torch's bf16 head's are."""
    _, exact_loss, exact = _gptlite_gradients("linear")
    _, linear_loss, linear = _gptlite_gradients("linear", dtype=torch.bfloat16)
    _, chunked_loss, chunked = _gptlite_gradients(head, dtype=torch.bfloat16)

    def error(grads):
        return torch.cat([(grads[n] - g).flatten() for n, g in exact.items()]).norm() / torch.cat(
            [g.flatten() for g in exact.values()]).norm()
    assert abs(chunked_loss.item() - exact_loss.item()) <= max(abs(linear_loss.item() - exact_loss.item()), 0.01)
    assert 0 < error(chunked) <= 1.2 * error(linear), (error(chunked), error(linear))


def _head_peak(head, tokens=(4, 64), width=128, vocab=50257):
    """Bytes GPTlite small's head and loss hold for backward at their most, over a forward and a fused backward of
    one micro-batch (the memory tracker's count: what autograd keeps, and logits computed again while they live)."""
    import gptlite
    from schedules.observe.memory import SavedTensorTracker
    config = replace(gptlite.MODEL_SIZES["small"], head=head)
    layer = (gptlite.LinearLMHead if head == "linear" else gptlite.LMHead)(config)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*tokens, width, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, tokens, generator=g)
    with SavedTensorTracker(ignore=list(layer.parameters())) as tracker:
        gptlite.head_loss(head)(layer(hidden), labels).backward()
    return tracker.peak_bytes


def test_recomputing_head_holds_a_quarter_of_torchs_memory_or_less():
    """The recomputing head holds one block of logits; the chunked one its exponentials, as much as torch's head
    keeps of its log-softmax."""
    recompute, chunked, linear = _head_peak("recompute"), _head_peak("chunked"), _head_peak("linear")
    logits = 4 * 64 * 50257 * 4
    assert linear >= logits  # torch keeps at least the vocabulary's log-softmax
    assert recompute <= linear / 4, (recompute, linear)
    assert chunked <= 1.01 * linear, (chunked, linear)  # its exponentials and a few numbers per token


@pytest.mark.multiprocess
def test_train_py_trains_the_same_with_either_head(tmp_path):
    """One process, two plain-SGD steps: the same losses, validation losses and weights (within 1e-5)."""
    config = write_sgd_config(tmp_path / "ds.json")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    from training import assert_same_training
    (tmp_path / "c").mkdir()
    chunked = train(tmp_path / "a", 1, ["--pipeline-parallel-size", "0"], config, 2, model=TINY)
    recompute = train(tmp_path / "c", 1, ["--pipeline-parallel-size", "0", "--head", "recompute"], config, 2,
                      model=TINY)
    linear = train(tmp_path / "b", 1, ["--pipeline-parallel-size", "0", "--head", "linear"], config, 2, model=TINY)
    assert_same_training(chunked, linear)
    assert_same_training(recompute, linear)


def test_head_linear_with_a_split_head_is_refused_in_one_line(monkeypatch, capsys):
    flags = [*TINY, "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-parallel",
             "--head", "linear"]
    status, stderr, _ = run_in_process(flags, monkeypatch, capsys, world=2, env={"HF_HUB_OFFLINE": "1"})
    assert_one_error_line(status, stderr, "--head linear")


@pytest.mark.parametrize("flags, device, expected", [
    ([], "cpu", "chunked"), ([], "cuda", "linear"), (["--head", "recompute"], "cuda", "recompute"),
    (["--vocab-parallel", "--pipeline-parallel-size", "2"], "cuda", "chunked"),
    (["--model", "deep"], "cuda", "chunked")])
def test_head_auto_is_the_fastest_whole_head_where_it_runs(flags, device, expected):
    import train
    assert train.whole_head(train.parse_args(flags), device) == expected
