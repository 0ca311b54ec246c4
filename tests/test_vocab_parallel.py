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
def _models(parts, seed=3):
    import gptlite
    from layers import build_layer
    config = replace(gptlite.MODEL_SIZES["tiny"], seed=seed)
    specs = gptlite.layer_specs(config, vocab_parts=parts)
    return gptlite.GPTlite(config), [build_layer(specs, i, seed) for i in range(len(specs))], config


@pytest.mark.parametrize("parts", [2, 3])
def test_split_head_is_the_cross_entropy_of_the_unsplit_head(parts):
    import gptlite
    from layers import layer_state_dict
    from schedules.runtime.vocab_parallel import merge_slices, vocab_parallel_loss
    plain, layers, config = _models(parts)
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
    deeper = {**whole, "model": {**whole["model"], "layers": 8}}
    assert resume_refusal(record, deeper) == "holds another model: pass --model-size tiny (with 7 layers, the head " \
                                             "whole)"


# --- real ranks ---------------------------------------------------------------------------------
# (ranks, flags, model, micro-batches, ZeRO stage): every schedule that splits the head, p = 2 and 4
CASES = {
    "zb-v-pp2-interlock2": (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--interlock", "2"],
                            TINY, 8, 0),
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
    """A checkpoint of the split model resumes with the same next loss; bf16 (DeepSpeed's BF16 optimizer,
    ZeRO 1) trains it within bf16's precision of fp32, traced with its activation memory."""
    run = [*TINY, "--steps", "3", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4",
           "--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-parallel", "--dist-timeout", "120"]
    flags = run + ["--save-dir", tmp_path / "ckpt", "--save-interval", "2"]
    full = launch(2, flags + ["--metrics-file", tmp_path / "full.jsonl"])
    assert full.ok, full.explain()
    (tmp_path / "ckpt" / "latest").write_text("global_step2")
    resumed = launch(2, flags + ["--resume", "--metrics-file", tmp_path / "resumed.jsonl"])
    assert resumed.ok, resumed.explain()
    trace = tmp_path / "bf16.trace.json"
    bf16 = launch(2, run + ["--bf16", "--metrics-file", tmp_path / "bf16.jsonl", "--trace", trace, "--trace-memory"])
    assert bf16.ok, bf16.explain()
    from schedules.observe.trace import peak_saved_bytes
    peaks = peak_saved_bytes(trace)  # --trace-memory: each rank's activation memory, slices' logits included
    slice_logits = 2 * 32 * (50257 // 2) * 4  # a micro-batch's exponentials of one slice, fp32
    assert sorted(peaks) == [0, 1] and all(slice_logits <= b < 8 * slice_logits for b in peaks.values()), peaks
    counters = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "C"]
    assert {e["pid"] for e in counters} == {0, 1}

    def losses(name):
        return [json.loads(line)["loss"] for line in (tmp_path / name).read_text().splitlines()]
    assert losses("resumed.jsonl") == pytest.approx(losses("full.jsonl")[2:], abs=TOL)
    assert losses("bf16.jsonl") == pytest.approx(losses("full.jsonl"), abs=0.05)


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
    profile = _head_heavy()
    split = split_head(profile, 4)
    assert len(split.layers) == 5 + 4 and split.loss is None
    for kind, whole in (("F", 12.0), ("B", 12.0), ("W", 10.0), ("BW", 22.0)):
        assert sum(getattr(c, kind) for c in split.layers[5:]) == pytest.approx(whole)
    assert sum(c.params for c in split.layers[5:]) == 100
    # V placement at p = 4: 8 model stages, the last 4 a slice each, the trunk's 5 layers over the first 4
    assert cut(split, "uniform", 8, slices=4) == [0, 2, 3, 4, 5, 6, 7, 8, 9]


def test_the_chooser_considers_the_split_head_and_picks_it_when_faster():
    from schedules.planner.choose import choose
    whole = choose(_head_heavy(), 4, 8)
    assert not any(c.vocab_parallel for c in whole.ranked)
    both = choose(_head_heavy(), 4, 8, split=True)
    split = [c for c in both.ranked if c.vocab_parallel]
    assert {"zb-v", "interleaved"} <= {c.schedule for c in split} <= set(SPLITTING)
    assert both.pick.vocab_parallel and both.pick.label.endswith(" +vocab")
    best_whole = min(c.step for c in both.ranked if not c.vocab_parallel)
    assert both.pick.step < best_whole / 1.3  # the head and loss are 2/3 of the work: split, the ranks share it


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_train_auto_with_vocab_parallel_picks_and_trains_a_split_head():
    run = launch(2, [*TINY, "--pipeline-parallel-size", "2", "--pipeline-schedule", "auto", "--vocab-parallel",
                     "--gradient-accumulation-steps", "4", "--micro-batch-size", "2", "--steps", "2"], timeout=180)
    assert run.ok, run.explain()
    chose = [line for line in run.stdout[0].splitlines() if line.startswith("auto: chose ")]
    assert len(chose) == 1 and " +vocab with the " in chose[0], run.stdout[0]
    assert [line for line in run.stdout[0].splitlines() if line.startswith("step 2/2: loss ")]
