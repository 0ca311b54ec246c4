"""The vocabulary head split over the pipeline ranks (`--vocab-parallel`, schedules/runtime/vocab_parallel.py).

- The slices' chained online softmax is the cross-entropy of the unsplit head: same loss and gradients in
  one process (fast tier).
- Through train.py, every schedule that runs it trains GPTlite as the non-pipelined model does (losses,
  validation losses and weights after two plain-SGD steps, within 1e-5; the slices exported as the unsplit
  head): p = 2 and 4, both builds, activation checkpointing, ZeRO 0 and 1, data parallelism, interlocked
  steps, a resumed run; bf16 runs.
- A user's own model (tests/vocab_parallel_probe.py) with the library's slices equals its unsplit self.
- The schedules that cannot run it are refused in one line naming those that can.
"""
import json
from dataclasses import replace

import pytest
import torch

from local_launch import launch
from training import TINY, TINY_CHUNKED, TOL, assert_one_error_line, assert_same_training, run_in_process, train

SPLITTING = ["interleaved", "zb-v", "dualpipev", "v-half", "v-min"]


# --- one process --------------------------------------------------------------------------------
def _models(parts, seed=3, recompute=True):
    import gptlite
    from layers import build_layer
    config = replace(gptlite.MODEL_SIZES["tiny"], seed=seed)
    specs = gptlite.layer_specs(config, vocab_parts=parts, vocab_recompute=recompute)
    return gptlite.GPTlite(config), [build_layer(specs, i, seed) for i in range(len(specs))], config


@pytest.mark.parametrize("parts,recompute", [(2, True), (3, True), (2, False)])
def test_split_head_is_the_cross_entropy_of_the_unsplit_head(parts, recompute):
    import gptlite
    from layers import layer_state_dict
    from schedules.runtime.vocab_parallel import merge_slices, vocab_parallel_loss
    plain, layers, config = _models(parts, recompute=recompute)
    slices = layers[len(layers) - parts:]
    assert [s.recomputed > 0 for s in slices] == [recompute] * (parts - 1) + [False]  # the default layout
    trunk = len(layers) - parts
    # the split model starts as the unsplit one: its slices are the rows of the same head
    assert merge_slices(layer_state_dict(layers), trunk, parts).keys() == layer_state_dict(plain.to_layers()).keys()
    for name, value in merge_slices(layer_state_dict(layers), trunk, parts).items():
        assert torch.equal(value, layer_state_dict(plain.to_layers())[name]), name
    g = torch.Generator().manual_seed(0)
    idx, labels = (torch.randint(0, config.vocab_size, (2, config.block_size), generator=g) for _ in range(2))
    ref = gptlite.CrossEntropyLoss_FlatView(plain(idx), labels)
    x = idx
    for layer in layers[:trunk]:
        x = layer(x)
    state = (x, labels)
    for layer in layers[trunk:]:
        state = layer(state)
        assert state[1].shape == labels.shape  # what travels on: per-token statistics, never the logits
    loss = vocab_parallel_loss(state, labels)
    ref.backward()
    loss.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    head = torch.cat([s.weight.grad for s in layers[trunk:]])
    assert (head - plain.lm_head.weight.grad).abs().max() < 1e-7
    assert (layers[0].tok_emb.weight.grad - plain.emb.tok_emb.weight.grad).abs().max() < 1e-7
    assert plain.lm_head.weight.grad.abs().max() > 1e-4  # the comparison compares something


@pytest.mark.parametrize("recompute,rows", [((0.0, 0.0), (19, 18)), ((1.0, 0.0), (12, 25)),
                                           ((0.6, 0.3, 0.0), (9, 11, 17)), ((1.0, 1.0), (30, 7))])
@pytest.mark.parametrize("backward", ["fused", "deferred", "in place", "in place, tracked"])
def test_recomputed_and_kept_rows_give_the_same_gradients(recompute, rows, backward):
    """Any layout (uneven rows; all, some or none of a slice's logits recomputed in its backward) is the unsplit
    head's cross-entropy: loss, input and weight gradients, through a fused backward, one split into B and a
    deferred W, and one adding the weight gradients into .grad (twice: the second accumulates); `tracked`: under
    a memory tracker's saved-tensor hooks (--trace-memory)."""
    import contextlib

    import torch.nn.functional as F

    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime.vocab_parallel import VocabSlice, vocab_parallel_loss
    from schedules.runtime.weight_grad import accumulate_in_place, apply_weight_grads, defer_weight_grads
    g = torch.Generator().manual_seed(1)
    vocab, width = sum(rows), 6
    head, x = torch.randn(vocab, width, generator=g), torch.randn(2, 5, width, generator=g)
    y = torch.randint(0, vocab, (2, 5), generator=g)
    y[0, :3] = torch.tensor([0, rows[0], vocab - 1])  # targets at the slices' edges
    xr, wr = x.clone().requires_grad_(), head.clone().requires_grad_()
    ref = F.cross_entropy((xr @ wr.t()).flatten(0, 1), y.flatten())
    ref.backward()
    slices = [VocabSlice(width, vocab, k, len(rows), weight=head, recompute=q, rows=rows)
              for k, q in enumerate(recompute)]
    assert [s.recomputed for s in slices] == [round(q * n) for q, n in zip(recompute, rows)]
    tracked = (SavedTensorTracker(ignore=[s.weight for s in slices]) if "tracked" in backward
               else contextlib.nullcontext())
    for repeat in (1, 2) if backward.startswith("in place") else (1, ):
        hidden = x.clone().requires_grad_()
        with tracked:
            state = (hidden, y)
            for s in slices:
                state = s(state)
            loss = vocab_parallel_loss(state)
            if backward == "deferred":
                with defer_weight_grads() as queue:
                    loss.backward()
                assert len(queue) == len(slices) and all(s.weight.grad is None for s in slices)
                apply_weight_grads(queue)
            else:
                with accumulate_in_place(backward.startswith("in place")):
                    loss.backward()
        assert abs(loss.item() - ref.item()) < 1e-6
        assert (hidden.grad - xr.grad).abs().max() < 1e-6
        merged = torch.cat([s.weight.grad for s in slices])
        assert (merged - repeat * wr.grad).abs().max() < 1e-6


def test_recomputed_rows_under_any_incoming_gradient():
    """The recomputed rows' softmax x gradient rides in the multiply for a loss's positive gradient; any other
    (here the log-sum-exp's, negative, and zero for some tokens) takes the plain route: both exact."""
    from schedules.runtime.vocab_parallel import VocabSlice
    g = torch.Generator().manual_seed(2)
    head, x = torch.randn(30, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    y = torch.randint(0, 30, (2, 3), generator=g)
    weights = torch.tensor([[-1.0, 0.0, 2.0], [0.5, -0.5, 1.0]])
    xr, wr = x.clone().requires_grad_(), head.clone().requires_grad_()
    (torch.logsumexp(xr @ wr.t(), -1) * weights).sum().backward()
    layer = VocabSlice(4, 30, 0, 1, weight=head, recompute=0.5)
    hidden = x.clone().requires_grad_()
    _, lse, _, _ = layer((hidden, y))
    (lse * weights).sum().backward()
    assert (hidden.grad - xr.grad).abs().max() < 1e-6 and (layer.weight.grad - wr.grad).abs().max() < 1e-6


def test_slice_layout_evens_the_slices_peaks_and_times():
    """slice_layout: every slice's peak (n_k micro-batches kept, plus the logits its backward recomputes) and its
    time (recomputed rows cost 1 + cost) come out alike; the last slice keeps all its logits and gets the most rows."""
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST, slice_layout, vocab_bounds
    for parts in (2, 3, 4, 8):
        rows, q = slice_layout(50257, parts)
        assert sum(rows) == 50257 and q[-1] == 0 and all(0 < qk < 1 for qk in q[:-1])
        assert rows == sorted(rows) and rows[-1] > 50257 / parts
        n = [parts - k for k in range(parts)]
        peaks = [r * (nk * (1 - qk) + qk) for r, nk, qk in zip(rows, n, q)]
        times = [r * (1 + RECOMPUTE_COST * qk) for r, qk in zip(rows, q)]
        for figures in (peaks, times):
            assert max(figures) / min(figures) < 1 + 1e-3
    rows, q = slice_layout(50257, 4, recompute=False)
    assert q == [0.0] * 4 and rows == [vocab_bounds(50257, k, 4)[1] - vocab_bounds(50257, k, 4)[0] for k in range(4)]
    assert slice_layout(100, 2, in_flight=[1, 1]) == ([50, 50], [0.0, 0.0])  # nothing held long: nothing recomputed
    with pytest.raises(ValueError, match="rows"):
        vocab_bounds(10, 0, 2, rows=[3, 3])


def test_a_recomputing_slice_keeps_its_input_and_counts_what_its_backward_holds():
    """What the memory tracker counts: a kept slice keeps one tensor of its logits' size from its forward; a
    recomputing one keeps its input and per-token figures, and the logits its backward computes again count
    while they live (the tracker's peak): in a fused backward for its time, in a deferring one until W, as any
    deferrable layer's output gradient."""
    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime.vocab_parallel import VocabSlice, vocab_parallel_loss
    from schedules.runtime.weight_grad import apply_weight_grads, defer_weight_grads
    tokens, width, vocab = 64, 8, 4000
    x, y = torch.randn(1, tokens, width, requires_grad=True), torch.randint(0, vocab, (1, tokens))
    logits, small = tokens * vocab * 4, tokens * (width + 4) * 8
    for recompute, after_forward in ((0.0, logits), (1.0, 0)):
        for deferred in (False, True):
            layer = VocabSlice(width, vocab, 0, 1, recompute=recompute)
            with SavedTensorTracker(ignore=list(layer.parameters())) as tracker:
                loss = vocab_parallel_loss(layer((x, y)))
                assert after_forward <= tracker.live_bytes < after_forward + small
                tracker.peak_bytes = tracker.live_bytes
                if deferred:
                    with defer_weight_grads() as queue:
                        loss.backward()
                    assert tracker.live_bytes >= logits  # the logits' gradient, kept for W
                    apply_weight_grads(queue)
                else:
                    loss.backward()
                assert tracker.peak_bytes >= logits and tracker.live_bytes < small
    with pytest.raises(RuntimeError, match="twice"):
        loss = vocab_parallel_loss(VocabSlice(width, vocab, 0, 1)((x, y)))
        loss.backward(retain_graph=True)
        loss.backward()


def test_slices_cover_the_vocabulary_once():
    from schedules.runtime.vocab_parallel import merge_slices, vocab_bounds
    for vocab, parts in ((50257, 2), (50257, 4), (37, 3), (8, 8)):
        bounds = [vocab_bounds(vocab, k, parts) for k in range(parts)]
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    head = torch.randn(37, 4)
    slices = {f"{3 + k}.weight": head[slice(*vocab_bounds(37, k, 3))] for k in range(3)}
    state = {"0.weight": torch.randn(5, 3), **slices}
    merged = merge_slices(state, 3, 3)
    assert merged.keys() == {"0.weight", "3.weight"} and torch.equal(merged["3.weight"], head)
    with pytest.raises(ValueError):
        vocab_bounds(10, 2, 2)


def test_the_schedules_that_split_the_head():
    from schedules.registry import splitting_schedules
    from schedules.runtime.vocab_parallel import count_slices
    assert splitting_schedules(2) == splitting_schedules(4) == SPLITTING
    from schedules.runtime.vocab_parallel import VocabSlice
    with pytest.raises(ValueError, match="last layers"):
        count_slices([VocabSlice(4, 10, 0, 2), torch.nn.Linear(4, 4)])


@pytest.mark.parametrize("flags,expected", [
    (["--pipeline-schedule", "zb-h1"], "--vocab-parallel needs a schedule whose last chunk visits every rank, one "
     "slice of the head each: pass --pipeline-schedule interleaved | zb-v | dualpipev | v-half | v-min (not zb-h1)"),
    (["--pipeline-schedule", "dualpipe"], "(not dualpipe)"),
    (["--pipeline-schedule", "1f1b"], "(not 1f1b)"),
    (["--pipeline-schedule", "dualpipev-deepspeed"], "(not dualpipev-deepspeed)"),
    (["--pipeline-parallel-size", "0"], "--vocab-parallel splits the head over the pipeline ranks: it needs "
     "--pipeline-parallel-size >= 2"),
    (["--pipeline-schedule", "zb-v", "--model", "deep"], "--vocab-parallel splits GPTlite's vocabulary head"),
])
def test_schedules_that_cannot_split_the_head_are_refused(flags, expected, monkeypatch, capsys):
    argv = [*TINY, "--pipeline-parallel-size", "2", *flags, "--vocab-parallel"]
    status, stderr, _ = run_in_process(argv, monkeypatch, capsys, world=2)
    assert_one_error_line(status, stderr, expected)


def test_a_vocab_layout_without_a_split_head_is_refused(monkeypatch, capsys):
    argv = [*TINY, "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-layout", "even"]
    status, stderr, _ = run_in_process(argv, monkeypatch, capsys, world=2)
    assert_one_error_line(status, stderr, "--vocab-layout even lays out the slices of a split head: add "
                                          "--vocab-parallel, or drop --vocab-layout")


def test_a_resume_takes_the_head_split_or_whole():
    """The split and the unsplit head are one model to a resume (tests/test_resume_anywhere.py moves them)."""
    from checkpoints import layout_changes, resume_refusal
    record = {"pipeline_parallel_size": 2, "data_parallel_size": 1, "placement": "V", "schedule": "zb-v",
              "model": {"model": "gptlite", "model_size": "tiny", "layers": 8, "vocab_parallel": True},
              "partition_method": "parameters", "zero_stage": 1, "optimizer": "AdamW", "bf16": False}
    whole = {**record, "model": {**record["model"], "layers": 7, "vocab_parallel": False}}
    assert resume_refusal(record, whole) is None and resume_refusal(whole, record) is None
    assert layout_changes(record, whole) == ["--vocab-parallel on -> off"]
    assert layout_changes(whole, record) == ["--vocab-parallel off -> on"]
    assert layout_changes(record, record) == []
    # a checkpoint of the even split (written before the slices' layout, its record without rows) moves too
    from checkpoints import split_rows
    laid_out = {**record, "vocab_rows": split_rows(2)}
    assert layout_changes(record, laid_out) == [f"the split head's rows {split_rows(2, layout=False)} -> "
                                                f"{split_rows(2)}"]
    assert layout_changes(laid_out, laid_out) == [] and split_rows(2) != split_rows(2, layout=False)
    deeper = {**whole, "model": {**whole["model"], "layers": 8}}
    assert resume_refusal(record, deeper) == "holds another model: pass --model-size tiny (with 7 layers, the head " \
                                             "whole)"


# --- real ranks ---------------------------------------------------------------------------------
# (ranks, flags, model, micro-batches, ZeRO stage): every schedule that splits the head, p = 2 and 4
CASES = {
    # its slices' rows and recompute fitted on the measured profile (--vocab-layout auto), for interlocked steps
    "zb-v-pp2-interlock2-fitted": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--interlock",
                                       "2", "--partition-method", "profile"], TINY, 8, 0),
    "dualpipev-pp2-spec": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipev",
                               "--pipeline-spec-layers"], TINY, 8, 1),
    "interleaved-pp2-zero0": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "interleaved"], TINY, 8, 0),
    "v-half-pp2-ckpt1": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "v-half",
                             "--activation-checkpoint-interval", "1"], TINY, 8, 1),
    "v-min-pp2-spec-zero0": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "v-min",
                                 "--pipeline-spec-layers"], TINY, 8, 0),
    "zb-v-pp4-spec": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-v", "--pipeline-spec-layers"],
                      TINY_CHUNKED, 8, 1),
    "interleaved-pp4-zero0": (4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "interleaved"],
                              TINY_CHUNKED, 8, 0),
    "zb-v-pp2xdp2": (4, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v"], TINY, 8, 1),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_split_head_trains_as_the_non_pipelined_model(case, sgd_config, references, tmp_path):
    nprocs, flags, model, micro_batches, zero = CASES[case]
    dp = nprocs // int(flags[1])
    traced = ["--trace", tmp_path / "trace.json"] if case.startswith("interleaved") else []
    result = train(tmp_path, nprocs, [*flags, "--vocab-parallel", *traced], sgd_config(zero), micro_batches, dp=dp,
                   model=model)
    assert_same_training(result, references(micro_batches, model=model, zero=zero))
    if traced:  # an interleaved run's trace (its placement class is made per v: it must pickle to be gathered)
        assert (tmp_path / "trace.json").exists()


@pytest.mark.multiprocess
def test_user_model_with_the_library_slices_equals_its_unsplit_self():
    for ranks, args in ((2, ["zb-v", "interleaved", "dualpipev"]), (4, ["zb-v", "--micro-batches", "8"])):
        done = launch(ranks, args, script="tests/vocab_parallel_probe.py", timeout=300)
        assert done.ok, done.explain()
        results = [json.loads(line) for line in done.stdout[0].splitlines() if line.startswith("{")]
        assert [r["schedule"] for r in results] == [a for a in args if not a.startswith("-") and not a.isdigit()]
        for r in results:
            assert r["missing"] == [], r
            assert r["moved"] > 100 * TOL, r
            assert r["loss_diff"] < TOL and r["val_loss_diff"] < TOL and r["weight_diff"] < TOL, r


@pytest.mark.multiprocess
def test_split_head_resumes_and_trains_in_bf16(tmp_path):
    """A checkpoint of the split model, its layout fitted (--partition-method profile), resumes with the same next
    loss and keeps its rows; bf16 (DeepSpeed's BF16 optimizer, ZeRO 1) trains it within bf16's precision of fp32,
    traced with its activation memory."""
    run = [*TINY, "--steps", "3", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4",
           "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-parallel", "--dist-timeout", "120"]
    flags = run + ["--save-dir", tmp_path / "ckpt", "--save-interval", "2", "--partition-method", "profile"]
    full = launch(2, flags + ["--metrics-file", tmp_path / "full.jsonl"])
    assert full.ok, full.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    resumed = launch(2, flags + ["--resume", "--metrics-file", tmp_path / "resumed.jsonl"])
    assert resumed.ok, resumed.explain()

    def rows(out):  # the "vocab layout: rows A B, recomputed ..." line's rows
        return [line.split(",")[0].split()[3:] for line in out.splitlines() if line.startswith("vocab layout: rows")]
    assert len(rows(full.stdout[0])) == 1 and rows(resumed.stdout[0]) == rows(full.stdout[0])
    saved = json.loads((tmp_path / "ckpt" / "global_step2" / "run.json").read_text())
    assert saved["vocab_rows"] == [int(r) for r in rows(full.stdout[0])[0]]
    trace = tmp_path / "bf16.trace.json"
    bf16 = launch(2, run + ["--bf16", "--metrics-file", tmp_path / "bf16.jsonl", "--trace", trace, "--trace-memory"])
    assert bf16.ok, bf16.explain()
    from schedules.observe.trace import peak_saved_bytes
    from schedules.runtime.vocab_parallel import slice_layout
    peaks = peak_saved_bytes(trace)  # --trace-memory: each rank's activation memory, slices' logits included
    last_slice = 2 * 32 * slice_layout(50257, 2)[0][1] * 4  # a micro-batch's exponentials of the last slice, fp32
    assert sorted(peaks) == [0, 1] and all(last_slice <= b < 4 * last_slice for b in peaks.values()), peaks
    assert max(peaks.values()) < 1.25 * min(peaks.values()), peaks  # the layout evens the ranks out
    counters = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "C"]
    assert {e["pid"] for e in counters} == {0, 1}

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]
    assert losses("resumed.jsonl") == pytest.approx(losses("full.jsonl")[2:], abs=TOL)
    assert losses("bf16.jsonl") == pytest.approx(losses("full.jsonl"), abs=0.05)


def test_the_predicted_bound_is_never_beaten():
    """benchmark_vocab_parallel.py --profile: the bound (every rank busy with 1/p of the work and of the step) takes
    the cheaper of the head whole and split, so no predicted split beats it; with the slices measured cheaper than
    the whole head and its loss (GPTlite small's stored profile), a bound from the whole head alone was beaten."""
    import importlib.util
    from types import SimpleNamespace

    from local_launch import ROOT
    spec = importlib.util.spec_from_file_location("benchmark_vocab_parallel",
                                                  ROOT / "scripts" / "benchmark_vocab_parallel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows, _ = bench.predictions(SimpleNamespace(profile=str(ROOT / "docs" / "bench" / "profile-gptlite-small.json"),
                                                stages=[2], micro_batches=[4]))
    assert rows and all(r["bound_s"] <= r["split"]["step_s"] for r in rows)


def test_benchmark_summary():
    """scripts/benchmark_vocab_parallel.py's rows: medians, speed-ups over one process and the best whole head."""
    import importlib.util

    from local_launch import ROOT
    spec = importlib.util.spec_from_file_location("benchmark_vocab_parallel",
                                                  ROOT / "scripts" / "benchmark_vocab_parallel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    traced = {"span_s": [0.5], "predicted_span_s": [0.55], "busy_s": [[0.4, 0.45]], "peak_saved_bytes": [10, 12]}
    rows = bench.summarise({bench.ONE_PROCESS: [{"steps": [1.0, 1.2, 1.1], "loss": 9.0}],
                            "zb-v": [{"steps": [0.9], "loss": 9.0, **traced}],
                            "1f1b": [{"steps": [0.8], "loss": 9.0, **traced}],
                            "zb-v +vocab": [{"steps": [0.5, 0.6, 0.55], "loss": 9.0, **traced}]})
    assert rows["zb-v +vocab"]["iter_s"] == 0.55
    assert rows["zb-v +vocab"]["speedup_vs_one_process"] == pytest.approx(1.1 / 0.55)
    assert rows["zb-v +vocab"]["speedup_vs_best_whole"] == pytest.approx(0.8 / 0.55)
    assert rows["1f1b"]["busy_s"] == [0.4, 0.45] and rows["1f1b"]["peak_saved_bytes"] == [10, 12]
    lines = bench.table(rows, bench.parse_args([]), "machine")
    assert lines[3].split()[:3] == ["zb-v", "+vocab", "550"]  # fastest first
    assert bench.loss_line(rows).startswith("every configuration ends at one process's loss")
    rows["zb-v"]["loss"] = 9.01  # e.g. a lost weight gradient
    assert bench.loss_line(rows).startswith("warning: zb-v 9.010000 end at other losses")


# --- the planner ---------------------------------------------------------------------------------
def _head_heavy(layers=6, head=10.0):
    from schedules.planner.profile import LayerCost, Profile
    profile = Profile.synthetic(layers, saved=1.0)
    last = profile.layers[-1]
    last.F, last.B, last.W, last.BW, last.params = head, head, head, 2 * head, 100
    profile.loss = LayerCost("loss", 2.0, 2.0, 0.0, 2.0, {s: [4.0, 0, 0] for s in "FBW"})
    return profile


def test_the_planner_splits_the_head_and_its_loss_over_the_ranks():
    from schedules.planner.compose import cut, split_head
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST, slice_layout
    profile = _head_heavy()
    even, split = split_head(profile, 4, recompute=False), split_head(profile, 4)
    for s in (even, split):
        assert len(s.layers) == 5 + 4 and s.loss is None
        assert sum(c.params for c in s.layers[5:]) == 100
        # V placement at p = 4: 8 model stages, the last 4 a slice each, the trunk's 5 layers over the first 4
        assert cut(s, "uniform", 8, slices=4) == [0, 2, 3, 4, 5, 6, 7, 8, 9]
        assert cut(s, "profile", 8, slices=4)[4:] == [5, 6, 7, 8, 9]
    for kind, whole in (("F", 12.0), ("B", 12.0), ("W", 10.0), ("BW", 22.0)):
        assert sum(getattr(c, kind) for c in even.layers[5:]) == pytest.approx(whole)
        assert [getattr(c, kind) for c in even.layers[5:]] == pytest.approx([whole / 4] * 4)
    # the layout: F and W in proportion to the rows; B (and BW) also recompute a share q of the rows' logits
    shares, q = slice_layout(1 << 30, 4)  # the synthetic head gives no row count: the layout's shares unrounded
    shares = [r / (1 << 30) for r in shares]
    extra = [RECOMPUTE_COST * qk * sk * (12 + 12 + 10) for qk, sk in zip(q, shares)]
    for kind, whole in (("F", 12.0), ("W", 10.0)):
        assert sum(getattr(c, kind) for c in split.layers[5:]) == pytest.approx(whole)
    for kind, whole in (("B", 12.0), ("BW", 22.0)):
        assert [getattr(c, kind) for c in split.layers[5:]] == pytest.approx([whole * s + e for s, e in zip(shares,
                                                                                                              extra)])
    assert extra[0] > 0 and extra[-1] == 0


def _gptlite_small_head(parts, recompute=True):
    """(profile, split profile, rows, recomputed rows per slice): the measured GPTlite small profile, its head
    split by the planner, and the slices gptlite.layer_specs builds (what train.py --vocab-parallel trains). The
    profile without the slices it may carry measured: the split derived from its head and loss."""
    import os

    import gptlite
    from schedules.planner.compose import split_head
    from schedules.planner.profile import Profile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    profile = replace(Profile.load(os.path.join(root, "docs", "bench", "profile-gptlite-small.json")), slices=None)
    config = gptlite.MODEL_SIZES["small"]
    specs = gptlite.layer_specs(config, vocab_parts=parts, vocab_recompute=recompute)[-parts:]
    rows = list(specs[0][1][4])
    recomputed = [round(spec[1][3] * r) for spec, r in zip(specs, rows)]
    return profile, split_head(profile, parts, recompute=recompute), rows, recomputed


@pytest.mark.parametrize("parts", [2, 4])
def test_the_planner_lays_the_slices_out_as_train_py_builds_them(parts):
    """split_head's slices are the rows gptlite.layer_specs gives them (slice_layout): their parameters sum to
    the head's; each slice's F + B + W is the same (the layout's design), above the even split's by the
    recompute; with recompute=False the even split's figures come back."""
    from schedules.planner.profile import pool_identical
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST
    profile, split, rows, recomputed = _gptlite_small_head(parts)
    _, even, even_rows, none = _gptlite_small_head(parts, recompute=False)
    head, loss, vocab = profile.layers[-1], profile.loss, 50257
    width, n = head.params // vocab, len(profile.layers) - 1
    slices, even_slices = split.layers[n:], even.layers[n:]
    assert sum(rows) == vocab and min(recomputed[:-1]) > 0 and recomputed[-1] == 0 and set(none) == {0}
    assert [c.params for c in slices] == [r * width for r in rows]
    assert [c.params for c in even_slices] == [r * width for r in even_rows]
    assert sum(c.params for c in slices) == sum(c.params for c in even_slices) == head.params
    assert sum(c.param_bytes for c in slices) == head.param_bytes
    assert sum(c.optimizer for c in slices) == pytest.approx(head.optimizer)
    work = sum(c.F + c.B + c.W for c in (head, loss))

    def time(c):
        return c.F + c.B + c.W
    assert [time(c) for c in slices] == pytest.approx([time(slices[-1])] * parts, rel=2e-4)  # equal, but rounding
    assert [time(c) for c in even_slices] == pytest.approx([work / parts] * parts, rel=1e-4)
    for c, r, k in zip(slices, rows, recomputed):
        assert c.F == pytest.approx((head.F + loss.F) * r / vocab)
        assert c.W == pytest.approx((head.W + loss.W) * r / vocab)
        assert c.B - (head.B + loss.B) * r / vocab == pytest.approx(RECOMPUTE_COST * k / vocab * work)
        assert c.BW - (head.BW + loss.BW) * r / vocab == pytest.approx(RECOMPUTE_COST * k / vocab * work)
    assert sum(time(c) for c in slices) - work == pytest.approx(RECOMPUTE_COST * sum(recomputed) / vocab * work)
    assert time(slices[0]) > time(even_slices[0]) * 1.05  # the recompute is not free: 12% more at p = 2
    # saved from F to B: the input (the hidden state) whole, the logits of the kept rows only
    hidden, logits = head.saved["F"][1], head.saved["F"][0] + loss.saved["F"][0] - head.saved["F"][1]
    assert [c.saved["F"][0] for c in slices] == pytest.approx([hidden + logits * (r - k) / vocab
                                                               for r, k in zip(rows, recomputed)])
    assert [c.saved["F"][0] for c in even_slices] == pytest.approx([hidden + logits * r / vocab for r in even_rows])
    assert pool_identical(split.layers)[n:] == slices  # slices of different rows are not pooled as alike


def _measured(profile, rows, scale=0.5):
    """Slices as planning.measure would record them for `rows`: parameters in proportion, times `scale` x the
    derived figures of the head's share plus a mark per slice, so no derivation gives them."""
    from schedules.planner.profile import LayerCost
    head, loss = profile.layers[-1], profile.loss
    width, vocab = head.params // sum(rows), sum(rows)
    return [LayerCost("LMHeadSlice", *(scale * (getattr(head, kind) + getattr(loss, kind)) * r / vocab + 1e-3 * k
                                       for kind in ("F", "B", "W", "BW")),
                      saved={s: [1000 + k, 10, 20] for s in "FBW"}, params=r * width, param_bytes=4 * r * width,
                      output_bytes=77 + k, optimizer=1e-4 * (k + 1)) for k, r in enumerate(rows)]


def test_the_planner_takes_the_slices_measured_as_train_py_builds_them():
    """With the slices measured (Profile.slices: as many, laid out alike) split_head's last layers are those, figure
    for figure; another count or the other layout: scaled from them per row (compose._from_slices); slices not of
    their layout's rows: derived from the head as before."""
    from schedules.planner.choose import choose
    from schedules.planner.compose import _from_slices, split_head
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST, slice_layout
    profile, derived, rows, _ = _gptlite_small_head(2)
    _, derived_even, even_rows, _ = _gptlite_small_head(2, recompute=False)
    n = len(profile.layers) - 1
    slices = _measured(profile, rows)
    measured = replace(profile, slices=slices, slices_recompute=True)
    split = split_head(measured, 2)
    assert split.layers[n:] == slices and split.layers[:n] == profile.layers[:n]
    assert split.loss is None and split.slices is None
    assert split.layers[n:] != derived.layers[n:]
    split.layers[n].saved["F"][0] = 0  # a copy: the profile's slices stay as measured
    assert slices[0].saved["F"][0] == 1000
    # scaled from them where they are not the layout asked for
    vocab = sum(rows)
    assert split_head(measured, 2, recompute=False).layers[n:] == \
        _from_slices(measured, even_rows, [0.0, 0.0], RECOMPUTE_COST) != derived_even.layers[n:]
    assert split_head(measured, 4).layers[n:] == _from_slices(measured, *slice_layout(vocab, 4), RECOMPUTE_COST)
    # derived from the head where their rows are not their layout's
    assert split_head(replace(profile, slices=_measured(profile, even_rows), slices_recompute=True), 2).layers[n:] \
        == derived.layers[n:]
    even = replace(profile, slices=_measured(profile, even_rows), slices_recompute=False)
    assert split_head(even, 2, recompute=False).layers[n:] == _measured(profile, even_rows)
    assert split_head(even, 2).layers[n:] == _from_slices(even, rows, slice_layout(vocab, 2)[1], RECOMPUTE_COST)
    # the chooser composes them: slices at half the derived time, a faster split step
    kw = dict(split=True, schedules=["zb-v"], cuts=["uniform"])
    steps = [[c for c in choose(p, 2, 4, **kw).ranked if c.vocab_parallel][0].step for p in (profile, measured)]
    assert steps[1] < steps[0] * 0.9


def test_the_chooser_predicts_the_split_head_as_train_py_builds_it():
    """GPTlite small at p = 2, m = 4 (docs/bench/vocab-parallel.json): the layout's memory predicted as measured
    (zb-v: 39.8 / 36.1 MiB saved for backward; the even slices' 1.57x apart), its time above the even split's."""
    from schedules.planner.choose import choose
    profile = _gptlite_small_head(2)[0]
    kw = dict(split=True, schedules=["zb-v"], cuts=["uniform"])
    laid_out, even = ([c for c in choose(profile, 2, 4, vocab_recompute=r, **kw).ranked if c.vocab_parallel][0]
                      for r in (True, False))
    assert [b / 2**20 for b in laid_out.peak] == pytest.approx([39.8, 36.1], abs=0.1)
    assert max(even.peak) / min(even.peak) > 1.5
    assert laid_out.step > even.step * 1.05


@pytest.mark.parametrize("schedule,measured", [("zb-v", [39.8, 36.1]), ("dualpipev", [43.8, 40.3]),
                                               ("interleaved", [39.9, 36.0]), ("v-min", [35.8, 36.0]),
                                               ("v-half", [40.07, 51.34])])
def test_every_split_schedules_peaks_are_predicted_as_measured(schedule, measured):
    """The peaks measured by scripts/benchmark_vocab_parallel.py (GPTlite small, p = 2, m = 4, MiB per rank; v-half's
    with the embedding's deferred gradient, which it holds longest), predicted from the stored profile with its
    slices measured and derived from its head: on dualpipev and interleaved a rank's peak falls inside a fused
    backward, while the recomputed logits live (LayerCost.within, the simulator's `within`)."""
    import os

    from schedules.planner.choose import choose
    from schedules.planner.profile import Profile
    derived = _gptlite_small_head(2)[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stored = Profile.load(os.path.join(root, "docs", "bench", "profile-gptlite-small.json"))
    assert stored.slices and any(c.within for c in stored.slices)  # measured with what their backward holds
    for profile in (stored, derived):
        split = [c for c in choose(profile, 2, 4, split=True, schedules=[schedule], cuts=["uniform"]).ranked
                 if c.vocab_parallel][0]
        assert [b / 2**20 for b in split.peak] == pytest.approx(measured, abs=0.15), schedule


def _stored_small():
    import os

    from schedules.planner.profile import Profile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return Profile.load(os.path.join(root, "docs", "bench", "profile-gptlite-small.json"))


def test_slices_measured_in_one_layout_predict_another():
    """compose._from_slices: the stored profile's slices (measured as slice_layout lays them out at p = 2) scaled
    per row and per recomputed row. In their own layout the totals and each B are theirs; twice the rows, twice the
    seconds and the kept logits; the last slice passes on the loss, the others the hidden state."""
    from schedules.planner.compose import _from_slices, split_head
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST, slice_layout
    profile = _stored_small()
    rows, q = slice_layout(50257, 2)
    measured = split_head(profile, 2).layers[-2:]
    assert measured == profile.slices  # the layout measured: the slices themselves
    scaled = _from_slices(profile, rows, q, RECOMPUTE_COST)
    for kind in "FWB":
        assert sum(getattr(c, kind) for c in scaled) == pytest.approx(sum(getattr(c, kind) for c in measured))
    assert [c.B for c in scaled] == pytest.approx([c.B for c in measured])  # two slices, two unknowns: exact
    assert [c.params for c in scaled] == [c.params for c in measured]
    assert [c.saved["F"][0] for c in scaled] == pytest.approx([c.saved["F"][0] for c in measured], rel=0.01)
    assert [c.output_bytes for c in scaled] == [c.output_bytes for c in measured]
    kept = _from_slices(profile, [16000, 34257], [0.0, 0.0], RECOMPUTE_COST)
    assert kept[1].F / kept[0].F == pytest.approx(34257 / 16000) and not kept[0].within
    logits = [c.saved["F"][0] - c.saved["F"][1] for c in kept]
    assert logits[1] / logits[0] == pytest.approx(34257 / 16000)
    redo = _from_slices(profile, [16000, 34257], [0.5, 0.0], RECOMPUTE_COST)[0]
    assert redo.F == kept[0].F and redo.B > kept[0].B and redo.within["B"] == pytest.approx(logits[0] / 2)


def test_a_fitted_layout_is_predicted_faster_within_the_balance():
    """planner.layout.fit_slices on the stored GPTlite small profile (zb-v, p = 2, m = 4): slice_layout's layout
    evens the slices alone, while the rank with the embedding does more; the fitted one moves rows to the other
    rank and recomputes less, predicted at least 3% faster with the ranks' peaks within BALANCE. Its prediction is
    the chooser's for that layout; a budget caps its peak; kept rows stay."""
    from schedules.planner.candidate import simulated
    from schedules.planner.compose import cut, split_head
    from schedules.planner.layout import BALANCE, fit_slices
    from schedules.registry import schedule_spec
    from schedules.runtime.vocab_parallel import slice_layout
    profile, balanced = _stored_small(), slice_layout(50257, 2)
    fit = fit_slices(profile, "zb-v", 2, 4)
    assert sum(fit.rows) == 50257 and fit.rows[0] > balanced[0][0] and fit.recompute[0] < balanced[1][0]
    assert fit.step < 0.97 * fit.start[0] and max(fit.peak) / min(fit.peak) <= BALANCE
    assert max(fit.start[1]) / min(fit.start[1]) < max(fit.peak) / min(fit.peak)  # the memory it spends
    spec = schedule_spec("zb-v")
    split = split_head(profile, 2, layout=fit.layout)
    parts = cut(split, "uniform", 4, slices=2)
    assert simulated(split, spec, None, "uniform", parts, spec.placement(2), 4).step == pytest.approx(fit.step)
    budget = (max(fit.start[1]) + max(fit.peak)) / 2
    capped = fit_slices(profile, "zb-v", 2, 4, budget=budget)
    assert max(capped.peak) <= budget and fit.step <= capped.step < capped.start[0]
    kept = fit_slices(profile, "zb-v", 2, 4, rows=balanced[0])
    assert kept.rows == balanced[0] and kept.step <= kept.start[0]
    # where slice_layout's own peaks are further apart than BALANCE (dualpipev at p = 4, the trunk cut by layer
    # count), the fit is never slower and never further apart than it
    wide = fit_slices(profile, "dualpipev", 4, 8)
    ratio = [max(p) / min(p) for p in (wide.start[1], wide.peak)]
    assert ratio[0] > BALANCE and ratio[1] <= ratio[0] and wide.step <= wide.start[0]
    with pytest.raises(ValueError, match="2 slices of 50257 rows"):
        fit_slices(profile, "zb-v", 2, 4, rows=[1, 2])


def test_train_py_fits_the_layout_it_builds_and_records(capsys):
    """planning.fit_vocab_layout (--vocab-parallel, --vocab-layout auto, the layers measured): the fitted rows go to
    the model and the checkpoint's record; a resume keeps a checkpoint's rows; `balanced` and `even` fit nothing."""
    from types import SimpleNamespace

    import planning
    from checkpoints import split_rows, vocab_rows_of
    profile = _stored_small()
    args = SimpleNamespace(vocab_parallel=True, vocab_layout="auto", model="gptlite", model_size="small", n_layer=None,
                           dropout=0.0, seed=0, block_size=None, pipeline_schedule="zb-v", pipeline_parallel_size=2,
                           partition_method=None, virtual_stages=None, interlock=1, max_activation_memory=None)
    cfg = {"gradient_accumulation_steps": 4}
    fit = planning.fit_vocab_layout(args, cfg, profile, rank=0)
    assert args.vocab_fitted == fit.layout and vocab_rows_of(args) == fit.rows != split_rows(2)
    said = capsys.readouterr().out
    assert said.startswith(f"vocab layout: rows {fit.rows[0]} {fit.rows[1]}, recomputed ") and "fitted to zb-v" in said
    args.kept_vocab_rows = split_rows(2)
    assert planning.fit_vocab_layout(args, cfg, profile, rank=1).rows == split_rows(2) == vocab_rows_of(args)
    for layout, rows in (("balanced", split_rows(2)), ("even", split_rows(2, layout=False))):
        plain = SimpleNamespace(**{**vars(args), "vocab_layout": layout, "vocab_fitted": None})
        assert planning.fit_vocab_layout(plain, cfg, profile, rank=0) is None and vocab_rows_of(plain) == rows


def test_the_chooser_considers_the_split_head_and_picks_it_when_faster():
    from schedules.planner.choose import choose
    whole = choose(_head_heavy(), 4, 8)
    assert not any(c.vocab_parallel for c in whole.ranked)
    both = choose(_head_heavy(), 4, 8, split=True)
    split = [c for c in both.ranked if c.vocab_parallel]
    assert {"zb-v", "interleaved"} <= {c.schedule for c in split} <= set(SPLITTING)
    assert both.pick.vocab_parallel and both.pick.label.endswith(" +vocab")
    best_whole = min(c.step for c in both.ranked if not c.vocab_parallel)
    # the head and loss are 2/3 of the work: split, the ranks share it; the layout's recompute (three slices of
    # four recompute 71-88% of their rows) costs some of that, the even split keeps every logit
    assert both.pick.step < best_whole / 1.1
    even = choose(_head_heavy(), 4, 8, split=True, vocab_recompute=False)
    assert even.pick.vocab_parallel and even.pick.step < best_whole / 1.3 and even.pick.step < both.pick.step


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_train_auto_with_vocab_parallel_picks_and_trains_a_split_head():
    run = launch(2, [*TINY, "--pipeline-parallel-size", "2", "--pipeline-schedule", "auto", "--vocab-parallel",
                     "--gradient-accumulation-steps", "4", "--micro-batch-size", "2", "--steps", "2"], timeout=180)
    assert run.ok, run.explain()
    chose = [line for line in run.stdout[0].splitlines() if line.startswith("auto: chose ")]
    assert len(chose) == 1 and " +vocab with the " in chose[0], run.stdout[0]
    # its slices laid out for the pick (--vocab-layout auto): every row once
    fitted = [line for line in run.stdout[0].splitlines() if line.startswith("vocab layout: rows ")]
    assert len(fitted) == 1 and sum(map(int, fitted[0].split(",")[0].split()[3:])) == 50257, run.stdout[0]
    assert [line for line in run.stdout[0].splitlines() if line.startswith("step 2/2: loss ")]
