"""schedules/memory.py: the saved-tensor tracker on graphs whose saved bytes are known exactly,
the RSS helpers, and the benchmark's (single-process) summary code. Fast, no distributed launch."""
import importlib.util
from pathlib import Path

import pytest
import torch

from schedules.observe.memory import (
    SavedTensorTracker,
    machine_info,
    machine_line,
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
)

N = 1000
NB = N * 4  # bytes of one float32 tensor of N elements


def chain(x):
    """x -> exp -> sin -> view[:5] -> pow(2): exp saves its result a, sin saves a again (same
    storage), pow saves a view of sin's output b (its whole storage counts)."""
    a = x.exp()
    b = a.sin()
    return b.view(10, 100)[:5].pow(2).sum()


def test_chain_counts_each_storage_once_and_peak_survives_backward():
    x = torch.randn(N, requires_grad=True)
    with SavedTensorTracker() as t:
        a = x.exp()
        assert t.live_bytes == NB and t.saved_tensors == 1
        b = a.sin()                       # saves a: same storage, not counted again
        assert t.live_bytes == NB and t.saved_tensors == 2
        loss = b.view(10, 100)[:5].pow(2).sum()  # saves a view of b: b's whole storage
        assert t.live_bytes == 2 * NB and t.saved_tensors == 3
        loss.backward()
        assert t.live_bytes == 0          # backward freed the graph's saved tensors
        assert t.peak_bytes == 2 * NB
        loss2 = chain(x)                  # a second graph, after the first was freed
        assert t.live_bytes == 2 * NB
        loss2.backward()
    assert t.live_bytes == 0 and t.peak_bytes == 2 * NB and t.total_bytes == 4 * NB


def test_peak_is_max_live_not_total_and_two_graphs_add_up():
    x = torch.randn(N, requires_grad=True)
    with SavedTensorTracker() as t:
        l1, l2 = chain(x), chain(x)       # two graphs alive at once
        assert t.live_bytes == 4 * NB
        l1.backward()
        assert t.live_bytes == 2 * NB
        l2.backward()
    assert t.peak_bytes == 4 * NB and t.live_bytes == 0


def test_dropping_the_graph_without_backward_releases():
    x = torch.randn(N, requires_grad=True)
    with SavedTensorTracker() as t:
        loss = chain(x)
        assert t.live_bytes == 2 * NB
        del loss                          # no reference cycle: freed by refcounting, no gc needed
        assert t.live_bytes == 0


def test_two_views_of_one_storage_counted_once():
    base = torch.randn(2 * N)
    x = base.requires_grad_()
    with SavedTensorTracker() as t:
        y = x * 1.0                       # fresh storage of 2N floats (mul by a Python scalar saves nothing)
        assert t.live_bytes == 0
        lo, hi = y[:N], y[N:]
        out = (lo * hi).sum()             # saves both views of y's storage: counted once, 2*NB
        assert t.saved_tensors == 2 and t.live_bytes == 2 * NB
        out.backward()
    assert t.peak_bytes == 2 * NB and t.live_bytes == 0


def test_ignored_parameters_and_linear():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedTensorTracker(ignore=lin.parameters()) as t:
        lin(x).sum().backward()          # saves x (8*64*4) and a view of the weight (ignored)
    assert t.peak_bytes == 8 * 64 * 4
    with SavedTensorTracker() as t:
        lin(x).sum().backward()
    assert t.peak_bytes == 8 * 64 * 4 + 32 * 64 * 4


def test_gradients_unchanged_by_tracker():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    x = torch.randn(5, 16)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedTensorTracker(ignore=model.parameters()) as t:
        model(x).square().mean().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert t.peak_bytes > 0 and t.live_bytes == 0


def test_hooks_only_inside_context():
    x = torch.randn(N, requires_grad=True)
    t = SavedTensorTracker()
    with t:
        pass
    chain(x).backward()
    assert t.peak_bytes == 0 and t.saved_tensors == 0


def test_rss_functions_are_plausible():
    release_free_memory()
    rss = rss_bytes()
    assert 10 << 20 < rss < machine_info()["ram_bytes"]
    assert peak_rss_bytes() >= rss
    big = torch.ones(200 << 20, dtype=torch.uint8)  # 200 MiB, written so it is resident
    grown = rss_bytes()
    assert grown - rss > 150 << 20
    assert peak_rss_bytes() >= grown
    del big
    release_free_memory()
    assert rss_bytes() < grown - (150 << 20)        # a freed large tensor leaves RSS
    if reset_peak_rss():                            # Linux >= 4.0; may be refused in some sandboxes
        assert peak_rss_bytes() < grown - (100 << 20)


def test_machine_info():
    info = machine_info()
    assert info["cores"] >= 1 and info["ram_bytes"] > 0
    assert info["torch"] == torch.__version__
    line = machine_line(info)
    assert "cores" in line and "torch" in line


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "scripts" / "benchmark_memory.py"
    spec = importlib.util.spec_from_file_location("benchmark_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_summary_and_savings(bench, tmp_path):
    def row(stages, build, rank, build_rss, peak_rss):
        return dict(stages=stages, build=build, rank=rank, stage=rank, layers=["Block"], first_layer=rank,
                    base_rss=100, build_rss=build_rss, build_peak=build_rss, param_bytes=10, peak_saved=5,
                    peak_rss=peak_rss)
    mib = 1 << 20
    results = [row(2, "list", 0, 200 * mib, 1000 * mib), row(2, "list", 1, 200 * mib, 800 * mib),
               row(2, "LayerSpec", 0, 120 * mib, 900 * mib), row(2, "LayerSpec", 1, 80 * mib, 700 * mib)]
    summary = bench.summarize(results)
    spec = next(s for s in summary if s["build"] == "LayerSpec")
    assert spec["build_rss"] == {"max": 120 * mib, "mean": 100 * mib, "max_rank": 0}
    (saving, ) = bench.savings(summary)
    assert saving["build_rss_max"] == pytest.approx(40.0) and saving["build_rss_mean"] == pytest.approx(50.0)
    assert saving["peak_rss_max"] == pytest.approx(10.0) and saving["param_bytes_max"] == 0.0
    doc = {"machine": machine_info(), "results": results, "summary": summary, "savings": bench.savings(summary),
           "runtime_s": 1.0, "config": dict(model_size="tiny", n_layer=2, block_size=8, micro_batches=2,
                                            micro_batch_size=1, partition_method="type:Block", optimizer="sgd")}
    text = bench.report(doc)
    assert "40.0 / 50.0" in text and machine_line(doc["machine"]) in text
    bench.plot(doc, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
