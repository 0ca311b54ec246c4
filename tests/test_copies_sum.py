"""The mirror placement's gradient sum between the copies (schedules/runtime/copies_sum.py): which gradients start
when, and in what order, with the all-reduces replaced by a log (the MoE and chunked-schedule tests run the real ones
on two ranks and compare the weights with a run without pipelining)."""
import pytest
import torch

from schedules.runtime import copies_sum
from schedules.runtime.weight_grad import DeferredLinearGrad


class _Layer:
    def __init__(self, name, out, inp):
        self.weight = torch.nn.Parameter(torch.zeros(out, inp))
        self.bias = torch.nn.Parameter(torch.zeros(out))
        self.weight.grad, self.bias.grad = torch.ones(out, inp), torch.ones(out)
        self.name = name

    def work(self):
        return DeferredLinearGrad(self.weight, self.bias, None, None)


class _Log(list):
    names = None


@pytest.fixture
def log(monkeypatch):
    started = _Log()

    def start_sum(grads, group):
        started.append([names[id(g)] for g in grads])
        return lambda: started.append("waited")
    monkeypatch.setattr(copies_sum, "start_sum", start_sum)
    names = {}
    started.names = names
    return started


def _sums(log, layers, extra):
    """A CopiesSum of one chunk holding `layers` (weights of 1 MiB and more, small biases) and `extra` (a gradient
    outside any deferred work, e.g. a LayerNorm's)."""
    params = [p for layer in layers for p in (layer.weight, layer.bias)] + [extra]
    for layer in layers:
        log.names[id(layer.weight.grad)], log.names[id(layer.bias.grad)] = layer.name + ".w", layer.name + ".b"
    log.names[id(extra.grad)] = "norm"
    return copies_sum.CopiesSum(None, lambda chunks: (params, [p.grad for p in params]))


def test_the_chunk_s_last_backward_starts_each_work_s_large_gradients_then_the_rest(log):
    """Two gradient-ending instructions: the first's works start nothing; in the last, each work's weight (1 MiB)
    starts as it is added, in the works' order, and the rest (biases, the norm) together as it ends; ReduceGrads
    only waits."""
    a, b = _Layer("a", 512, 512), _Layer("b", 512, 1024)
    extra = torch.nn.Parameter(torch.zeros(8))
    extra.grad = torch.ones(8)
    sums = _sums(log, [a, b], extra)
    sums.new_step({0: 2})
    sums.ending(0)
    sums.work_added(0, b.work())
    sums.ended(0)
    assert log == []
    sums.ending(0)
    sums.work_added(0, b.work())
    sums.work_added(0, a.work())
    assert log == [["b.w"], ["a.w"]]
    sums.ended(0)
    assert log[2] == ["a.b", "b.b", "norm"]
    sums.finish([0])
    assert log[3:] == ["waited"] * 3


def test_without_early_sums_reduce_grads_sums_everything(log):
    """No counts (the copies end their stages in different orders, or the BF16 optimizer): nothing starts before
    ReduceGrads, which sums every gradient at once."""
    a = _Layer("a", 512, 512)
    extra = torch.nn.Parameter(torch.zeros(8))
    extra.grad = torch.ones(8)
    sums = _sums(log, [a], extra)
    sums.new_step({})
    sums.ending(0)
    sums.work_added(0, a.work())
    sums.ended(0)
    assert log == []
    sums.finish([0])
    assert log == [["a.w", "a.b", "norm"], "waited"]
