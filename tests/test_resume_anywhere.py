"""A checkpoint written under one layout continues under any other (checkpoints.py, universal.py).

One GPTlite run (1F1B, 2 stages, ZeRO 1, fp32) trains 3 steps, saving each. Its step-1 checkpoint is
then carried through a chain of layouts, each run resuming the previous one's checkpoint with
`--resume-from` at its own step (no training) and saving it again under its layout:

    one chunk -> V -> mirror -> interleaved -> one chunk -> mirror -> V -> interleaved -> one chunk
    -> no pipeline -> V

which crosses every pair of placements, 2 <-> 4 stages, a pipeline <-> none, 1 <-> 2 data-parallel
replicas, ZeRO 0 <-> 1, fp32 <-> bf16 and the vocabulary head split <-> whole. Every checkpoint of the
chain, converted to the universal layout, holds exactly the first one's weights, Adam moments, step count,
learning-rate schedule and optimizer hyperparameters (the round trip: state equality, as Megatron proves
its resharding). Then losses: a checkpoint of the chain resumed under the layout that wrote the first
trains on bit for bit as the uninterrupted run; under other layouts, within 1e-5 relative. The weights
`--export` wrote start a run under any layout (`--init-from`), and come out the same.
"""
import json
import os
import shutil

import pytest
import torch

from local_launch import launch
from training import TINY_CHUNKED, assert_one_error_line, run_in_process, write_config

pytestmark = pytest.mark.multiprocess

# 8 micro-batches of 2 per step: halved over 2 replicas, still enough for DualPipe at 2 stages and ZB-V at 4
FLAGS = [*TINY_CHUNKED, "--micro-batch-size", "2", "--dist-timeout", "60"]
GAS = ["--gradient-accumulation-steps", "8"]
GAS_DP2 = ["--gradient-accumulation-steps", "4"]
FIRST = ["--pipeline-parallel-size", "2", "--pipeline-schedule", "1f1b", "--partition-method", "parameters", *GAS]

# (name, ranks, flags, ZeRO stage): each resumes the one before it
CHAIN = [
    ("zb-v-zero0", 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", *GAS], 0),
    ("dualpipe-dp2", 4, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe", *GAS_DP2], 1),
    ("interleaved-pp4-bf16", 4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "interleaved", "--bf16",
                                 *GAS], 1),
    ("1f1b-stock", 2, FIRST, 1),  # DeepSpeed's own engine, reading the universal layout with its own loader
    ("dualpipe-zero0", 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe", *GAS], 0),
    ("zb-v-pp4-split", 4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "zb-v", "--vocab-parallel", *GAS],
     1),
    ("interleaved-split", 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "interleaved",
                              "--vocab-parallel", *GAS], 1),
    ("zb-h1-dp2-zero0", 4, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h1", *GAS_DP2], 0),
    ("no-pipeline-dp2", 2, ["--pipeline-parallel-size", "0", *GAS_DP2], 1),
    ("zb-v-from-no-pipeline", 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", *GAS], 0),
]


def config(folder, stage):
    """The shipped config at ZeRO `stage` (one file per stage in `folder`)."""
    path = folder / f"zero{stage}.json"
    return path if path.exists() else write_config(path, zero=stage)


def losses(path):
    return [entry["loss"] for entry in map(json.loads, path.read_text().splitlines()) if "loss" in entry]


def universal_state(folder):
    """{name: {state: tensor}} of a checkpoint folder's universal layout (converted here), and its schedule."""
    from checkpoints import to_universal
    from schedules.runtime import universal
    names = to_universal(str(folder))
    zero = folder / universal.ZERO
    state = {name: {key: torch.load(zero / name / f"{key}.pt", weights_only=False)
                    for key in ("fp32", "exp_avg", "exp_avg_sq", "step")} for name in names}
    model = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    groups = torch.load(zero / universal.GLOBAL_STATE, weights_only=False)["param_groups"]
    return state, model["lr_scheduler"], model["global_steps"], groups


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The first run (3 steps, saved after each) and the chain of re-saved step-1 checkpoints."""
    root = tmp_path_factory.mktemp("anywhere")
    run = launch(2, [*FLAGS, *FIRST, "--steps", "3", "--save-dir", root / "first", "--save-interval", "1",
                     "--metrics-file", root / "first.jsonl", "--export", root / "first.pt", "--eval-interval", "3"],
                 timeout=240)
    assert run.ok, run.explain()
    source = root / "step1"
    shutil.copytree(root / "first", source)
    (source / "latest").write_text("global_step1")
    folders = []
    for name, ranks, flags, stage in CHAIN:
        target = root / name
        run = launch(ranks, [*FLAGS, *flags, "--deepspeed_config", config(root, stage), "--steps", "1",
                             "--resume-from", source, "--save-dir", target], timeout=300)
        assert run.ok, f"{name}: {run.explain()}"
        assert "under another layout" in run.stdout[0]
        folders.append(target)
        source = target
    return root, losses(root / "first.jsonl"), folders


def test_every_layout_of_the_chain_holds_the_same_state(chain):
    root, _, folders = chain
    expected, schedule, steps, groups = universal_state(root / "first" / "global_step1")
    assert steps == 1 and set(expected) >= {"0.tok_emb.weight", "8.weight"}
    assert all(float(state["exp_avg_sq"]["param"].abs().sum()) > 0 for state in expected.values())
    for (name, *_), folder in zip(CHAIN, folders):
        record = json.loads((folder / "global_step1" / "run.json").read_text())
        assert record["step"] == 1
        state, lr, got_steps, got_groups = universal_state(folder / "global_step1")
        assert sorted(state) == sorted(expected), name
        for param, by_key in expected.items():
            for key, value in by_key.items():
                got = state[param][key]
                if key == "step":
                    assert float(got) == float(value), (name, param)
                else:
                    assert torch.equal(got["param"], value["param"]), (name, param, key)
        assert (lr, got_steps) == (schedule, steps), name
        assert [{k: v for k, v in g.items() if k != "params"} for g in got_groups] == \
               [{k: v for k, v in g.items() if k != "params"} for g in groups], name


def resume(chain, index, ranks, flags, tmp_path, stage=1):
    root, _, folders = chain
    run = launch(ranks, [*FLAGS, *flags, "--deepspeed_config", config(root, stage), "--steps", "3",
                         "--resume-from", folders[index], "--metrics-file", tmp_path / "m.jsonl"], timeout=300)
    assert run.ok, run.explain()
    return losses(tmp_path / "m.jsonl")


def test_the_first_layout_resumes_bit_for_bit(chain, tmp_path):
    """The chain's 1F1B checkpoint (after V, mirror and interleaved, bf16, ZeRO 0 and 2 replicas) under the first
    run's layout: DeepSpeed's own files, the same losses exactly."""
    _, first, _ = chain
    assert resume(chain, 3, 2, FIRST, tmp_path) == first[1:]


@pytest.mark.parametrize("index, ranks, flags, stage", [
    (6, 2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipev", *GAS], 0),  # split -> whole
    (7, 4, ["--pipeline-parallel-size", "4", "--pipeline-schedule", "v-half", "--vocab-parallel", *GAS], 1),
    (2, 4, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-h2", *GAS_DP2], 1),  # bf16's fp32 -> dp 2
    (5, 1, ["--pipeline-parallel-size", "0", *GAS], 0),  # a split head -> no pipeline
], ids=["interleaved-split-to-dualpipev-zero0", "zb-h1-dp2-to-v-half-pp4-split", "bf16-pp4-to-zb-h2-dp2",
        "zb-v-split-to-no-pipeline"])
def test_another_layout_resumes_within_1e_5(chain, index, ranks, flags, stage, tmp_path):
    _, first, _ = chain
    assert resume(chain, index, ranks, flags, tmp_path, stage) == pytest.approx(first[1:], rel=1e-5)


@pytest.mark.parametrize("flags, expected", [
    (["--model-size", "small"], "holds another model: pass --model-size tiny"),
    (["--n-layer", "8"], "--model-size tiny (with 9 layers, the head whole)"),
    (["--optimizer", "sgd"], "--optimizer adamw"),
    (["--micro-batch-size", "4"], "--micro-batch-size 2"),
    (["--gradient-accumulation-steps", "4"], "pass --gradient-accumulation-steps 8"),
])
def test_what_cannot_move_is_refused_before_loading(chain, flags, expected, monkeypatch, capsys):
    root, _, folders = chain
    argv = [*FLAGS, *FIRST, "--steps", "3", *flags, "--resume-from", str(folders[0])]
    status, stderr, _ = run_in_process(argv, monkeypatch, capsys, world=2)
    assert_one_error_line(status, stderr, expected)


def test_zero0_checkpoints_of_older_runs_name_the_layout_that_reads_them(chain, tmp_path, monkeypatch, capsys):
    """A ZeRO-0 checkpoint whose record lacks its parameters' names (written before they were recorded)."""
    root, _, folders = chain
    old = tmp_path / "old"
    shutil.copytree(folders[0], old)
    run_file = old / "global_step1" / "run.json"
    record = json.loads(run_file.read_text())
    del record["param_names"]
    run_file.write_text(json.dumps(record))
    argv = [*FLAGS, *FIRST, "--steps", "3", "--resume-from", str(old)]
    status, stderr, _ = run_in_process(argv, monkeypatch, capsys, world=2)
    assert_one_error_line(status, stderr, "resumes only under the layout that wrote it "
                                          "(--pipeline-parallel-size 2 --pipeline-schedule zb-v)")
    assert os.path.exists(old / "global_step1" / "run.json")


@pytest.mark.parametrize("ranks, flags", [
    (2, ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--vocab-parallel", *GAS]),
    (1, ["--pipeline-parallel-size", "0", *GAS]),
], ids=["zb-v-split", "no-pipeline"])
def test_exported_weights_start_any_layout(chain, ranks, flags, tmp_path):
    """The validation loss before the first step of a run started from the first run's exported weights is the
    first run's last validation loss."""
    root, _, _ = chain
    run = launch(ranks, [*FLAGS, *flags, "--steps", "1", "--init-from", root / "first.pt", "--eval-interval", "1",
                         "--metrics-file", tmp_path / "m.jsonl"], timeout=240)
    assert run.ok, run.explain()
    last = [json.loads(line) for line in (root / "first.jsonl").read_text().splitlines()][-1]
    start = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and last["step"] == 3
    assert start["val_loss"] == pytest.approx(last["val_loss"], rel=1e-5)


def test_the_converter_script_writes_what_a_resume_reads(chain, tmp_path, capsys):
    """scripts/convert_checkpoint.py: the universal layout of a --save-dir's latest checkpoint, anywhere."""
    import importlib.util

    from local_launch import ROOT
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "scripts" / "convert_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    root, _, folders = chain
    script.main([str(folders[5]), "--out", str(tmp_path / "u")])  # ZB-V at 4 stages, its head split
    assert f"{tmp_path / 'u'}: 77 parameters" in capsys.readouterr().out
    expected, *_ = universal_state(root / "first" / "global_step1")
    for name, by_key in expected.items():
        assert torch.equal(torch.load(tmp_path / "u" / name / "fp32.pt")["param"], by_key["fp32"]["param"])
    with pytest.raises(SystemExit, match="not a DeepSpeed checkpoint folder"):
        script.main([str(tmp_path / "nothing")])


@pytest.mark.parametrize("a, zero_a, b, zero_b", [("zb-v", 1, "dualpipe", 0), ("interleaved", 0, "1f1b-lean", 1)])
def test_a_users_model_with_tied_weights_moves_exactly(a, zero_a, b, zero_b, tmp_path):
    """The library's path (tests/resume_probe.py): a tied embedding and head trained under A, saved by DeepSpeed,
    converted, loaded under B and saved again: every weight, moment and step the same."""
    run = launch(2, [a, zero_a, b, zero_b, tmp_path], script="tests/resume_probe.py", timeout=200)
    assert run.ok, run.explain()
    result = json.loads(run.stdout[0].strip().splitlines()[-1])
    assert result["differ"] == [] and result["extra"] == [] and result["compared"] == 17
    assert result["tied_moved"] > 1e-3
