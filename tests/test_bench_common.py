"""scripts/bench_common.py, what the benchmark scripts share: their flags, the command line their ranks get back,
and what they write and publish. Fast: no process started, no torch imported."""
import importlib.util
import json
import sys
import types

from local_launch import ROOT


def helper():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "scripts" / "bench_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_script_takes_the_shared_flags_with_its_own_defaults():
    common = helper()
    p = common.add(common.parser("Bench.\n\nmore"), "stages", "micro-batches", "model", "out", "docs", "worker-out",
                   stages=dict(nargs="+", default=[1, 2]), out="runs/x", docs="x[-y]")
    assert p.description == "Bench."
    args = p.parse_args([])
    assert vars(args) == {"stages": [1, 2], "micro_batches": [4, 8], "model": "deep", "out": "runs/x", "docs": False,
                          "worker_out": None}
    assert "docs/bench/x[-y].json" in p.format_help() and "--worker-out" not in p.format_help()
    assert common.FLAGS["stages"] == {"type": int, "default": 2}  # a script's changes stay its own


def test_ranks_get_the_parents_flags_back_with_the_launchs_changes():
    common = helper()
    p = common.add(common.parser("Bench."), "stages", "micro-batches", "schedules", "docs", "partition-weights",
                   "worker-out")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--pass-ms", type=float, nargs=3, default=None)
    args = p.parse_args(["--stages", "4", "--docs", "--pass-ms", "1", "2.5", "3"])
    args.partition_weights = [0.1, 1e-05]  # set by the parent after parsing: the ranks get it too
    flags = common.argv(args, micro_batches=[8], schedules=["zb-v", "1f1b"], worker_out="/tmp/w")
    assert "--docs" not in flags and "--bf16" not in flags  # ranks publish nothing; False is left out
    back = vars(p.parse_args(flags))
    assert back == {**vars(args), "micro_batches": [8], "schedules": ["zb-v", "1f1b"], "worker_out": "/tmp/w",
                    "docs": False}


def test_rounds_rotate_and_the_engines_share_one_config():
    common = helper()
    assert [common.rotated([1, 2, 3], r) for r in range(4)] == [[1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3]]
    cfg = common.engine_config(32, 4, gradient_clipping=1.0)
    assert cfg["train_micro_batch_size_per_gpu"] == 32 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["optimizer"]["params"]["fused"] and cfg["gradient_clipping"] == 1.0


def test_save_writes_the_record_and_publishes_it_with_docs(tmp_path, monkeypatch):
    common = helper()
    published = []
    monkeypatch.setitem(sys.modules, "benchmark_docs",
                        types.SimpleNamespace(publish=lambda record, name: published.append((record, name))))
    args = types.SimpleNamespace(out=str(tmp_path / "out"), docs=False)
    common.save(args, "x", {"a": 1}, ["line 1", "line 2"])
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == {"a": 1}
    assert (tmp_path / "out" / "x.txt").read_text() == "line 1\nline 2\n" and not published
    args.docs = True
    common.save(args, "x", {"a": 2}, publish="x-512kib")
    common.save(args, "y", {"a": 3}, published={"a": 3, "table": []})
    assert published == [({"a": 2}, "x-512kib"), ({"a": 3, "table": []}, "y")]
    common.save(types.SimpleNamespace(out=str(tmp_path / "gpu")), "gpu", {})  # a script without --docs
    assert (tmp_path / "gpu" / "gpu.json").exists()
