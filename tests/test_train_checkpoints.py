"""Checkpoints record what they were trained with; `--resume` compares before loading and refuses a
difference it cannot take, naming the flag; a damaged checkpoint is one line naming the file; a
schedule of the same placement resumes another's checkpoint exactly.

One 2-stage 1F1B run, saved after each of its 2 steps, serves every case. Refusals found before
any rank waits (the comparison, missing or truncated files) run in this process as rank 0 of the
case's world (tests/training.py, run_in_process); a file damaged inside, which only the rank that
loads it can see, and the resumes that must work, are real launches.
"""
import json
import os
import shutil

import pytest

from local_launch import launch
from training import TINY_CHUNKED, TOL, assert_one_error_line, run_in_process

pytestmark = pytest.mark.multiprocess  # the fixture trains

FLAGS = [*TINY_CHUNKED, "--micro-batch-size", "2", "--gradient-accumulation-steps", "4", "--dist-timeout", "60"]
PP2 = ["--pipeline-parallel-size", "2"]


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def train_and_save(folder, schedule):
    """2 steps at 2 stages, a checkpoint after each: (checkpoint folder, per-step losses)."""
    run = launch(2, [*FLAGS, *PP2, "--pipeline-schedule", schedule, "--steps", "2", "--save-dir", folder / "ckpt",
                     "--save-interval", "1", "--metrics-file", folder / "m.jsonl"], timeout=240)
    assert run.ok, run.explain()
    return folder / "ckpt", losses(folder / "m.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_and_save(tmp_path_factory.mktemp("1f1b"), "1f1b")


@pytest.fixture
def copy(trained, tmp_path):
    """A copy of the trained checkpoints, to damage or roll back."""
    shutil.copytree(trained[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_checkpoint_records_the_run(trained):
    folder = trained[0]
    assert (folder / "latest").read_text() == "global_step2"
    record = json.loads((folder / "global_step2" / "run.json").read_text())
    assert {k: record[k] for k in ("schedule", "pipeline_parallel_size", "data_parallel_size", "zero_stage",
                                   "optimizer", "step")} == {"schedule": "1f1b", "pipeline_parallel_size": 2,
                                                             "data_parallel_size": 1, "zero_stage": 1,
                                                             "optimizer": "AdamW", "step": 2}
    assert record["placement"] == {"module": "pipeline", "stages": [[0], [1]]}
    assert record["model"] == {"model": "gptlite", "model_size": "tiny", "layers": 9}
    files = sorted(p.name for p in (folder / "global_step2").iterdir() if p.name != "run.json")
    assert sorted(record["files"]) == files and "layer_08-model_states.pt" in files
    assert not [p for p in folder.rglob("*.tmp")]


# name: (world size, flags instead of 1F1B at 2 stages, what the line names); another layout resumes
# (tests/test_resume_anywhere.py), another model, optimizer or data order does not
REFUSED = {
    "more-data-parallel": (4, PP2, "pass --gradient-accumulation-steps 2 (the same global batch"),
    "another-model-size": (2, [*PP2, "--model-size", "small"], "--model-size tiny"),
    "another-depth": (2, [*PP2, "--n-layer", "8"], "--model-size tiny (with 9 layers"),
    "another-optimizer": (2, [*PP2, "--optimizer", "sgd"], "--optimizer adamw"),
    "already-at-steps": (2, [*PP2, "--steps", "2"], "--steps"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_resume_refuses_what_it_cannot_take(case, trained, tmp_path, monkeypatch, capsys):
    world, flags, expected = REFUSED[case]
    steps = [] if "--steps" in flags else ["--steps", "3"]
    status, stderr, _ = run_in_process([*FLAGS, *flags, *steps, "--save-dir", trained[0], "--resume"],
                                       monkeypatch, capsys, world)
    assert_one_error_line(status, stderr, expected)
    assert "--resume" in stderr or case == "already-at-steps"


def test_a_fresh_run_does_not_overwrite_a_checkpoint(trained, monkeypatch, capsys):
    status, stderr, _ = run_in_process([*FLAGS, *PP2, "--steps", "3", "--save-dir", trained[0]], monkeypatch, capsys,
                                       world=2)
    assert_one_error_line(status, stderr, "--resume")


def truncate(path):
    path.write_bytes(path.read_bytes()[:100])


DAMAGED = {  # found before loading: (damage, the file the line names)
    "truncated-layer-file": (lambda ckpt: truncate(ckpt / "global_step2" / "layer_03-model_states.pt"),
                             "layer_03-model_states.pt"),
    "empty-optimizer-file": (lambda ckpt: (ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
                             .write_bytes(b""), "zero_pp_rank_0_mp_rank_01_optim_states.pt"),
    "missing-file": (lambda ckpt: (ckpt / "global_step2" / "mp_rank_00_model_states.pt").unlink(),
                     "mp_rank_00_model_states.pt"),
    "latest-names-a-missing-tag": (lambda ckpt: (ckpt / "latest").write_text("global_step9"), "global_step9"),
    "interrupted-save": (lambda ckpt: (ckpt / "global_step2" / "run.json").unlink(), "incomplete"),
    "run-record-garbled": (lambda ckpt: (ckpt / "global_step2" / "run.json").write_text("{"), "run.json"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_checkpoint_is_one_line_naming_the_file(case, copy, monkeypatch, capsys):
    damage, named = DAMAGED[case]
    damage(copy)
    status, stderr, _ = run_in_process([*FLAGS, *PP2, "--steps", "3", "--save-dir", copy, "--resume"], monkeypatch,
                                       capsys, world=2)
    assert_one_error_line(status, stderr, named)


@pytest.mark.parametrize("name,rank", [("layer_08-model_states.pt", 1),
                                       ("zero_pp_rank_0_mp_rank_00_optim_states.pt", 0)])
def test_garbage_in_a_file_reaches_rank_0_as_one_line(name, rank, copy):
    """Random bytes of the right size: only the rank that loads the file finds out, and says so to rank 0."""
    path = copy / "global_step2" / name
    path.write_bytes(os.urandom(path.stat().st_size))
    run = launch(2, [*FLAGS, *PP2, "--steps", "3", "--save-dir", copy, "--resume"], timeout=120)
    assert run.returncodes == [2, 2], run.explain()
    assert_one_error_line(2, run.stderr[0], f"{path} is damaged", others=run.stderr[1:])
    assert run.stderr[0].startswith("error: rank 1: " if rank else "error: --resume")
    assert "Traceback" not in "".join(run.stdout + run.stderr)


def test_a_schedule_of_the_same_placement_resumes_exactly(trained, copy, tmp_path):
    """1F1B's checkpoint of step 1, resumed by ZB-H1: its step 2 is the uninterrupted 1F1B run's."""
    (copy / "latest").write_text("global_step1")
    run = launch(2, [*FLAGS, *PP2, "--pipeline-schedule", "zb-h1", "--steps", "2", "--save-dir", copy, "--resume",
                     "--metrics-file", tmp_path / "resumed.jsonl"], timeout=240)
    assert run.ok, run.explain()
    assert losses(tmp_path / "resumed.jsonl") == pytest.approx(trained[1][1:], abs=TOL)
    assert (copy / "latest").read_text() == "global_step2"


def test_chunked_schedules_of_the_same_placement_resume_exactly(tmp_path):
    """ZB-V's checkpoint of step 1, resumed by DualPipeV (both V-shaped) for more steps than ZB-V's run had."""
    ckpt, full = train_and_save(tmp_path, "zb-v")
    (ckpt / "latest").write_text("global_step1")
    run = launch(2, [*FLAGS, *PP2, "--pipeline-schedule", "dualpipev", "--steps", "3", "--save-dir", ckpt, "--resume",
                     "--metrics-file", tmp_path / "resumed.jsonl"], timeout=240)
    assert run.ok, run.explain()
    resumed = losses(tmp_path / "resumed.jsonl")
    assert len(resumed) == 2 and resumed[0] == pytest.approx(full[1], abs=TOL)  # in the warm-up: --steps aside
    assert (ckpt / "latest").read_text() == "global_step3"


def test_a_save_that_fails_midway_leaves_latest_on_the_last_complete_checkpoint(tmp_path):
    """Rank 1 cannot write its optimizer state at step 2 (a folder stands in its place) after writing its
    layers: the run ends with rank 1's reason on rank 0, and `latest` still names step 1, complete."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt").mkdir(parents=True)
    run = launch(2, [*FLAGS, *PP2, "--steps", "2", "--save-dir", ckpt, "--save-interval", "1"], timeout=240)
    assert run.returncodes == [1, 1], run.explain()
    errors = [line for line in run.stderr[0].splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: ") and "optim_states" in errors[0], errors
    assert (ckpt / "latest").read_text() == "global_step1"
    assert (ckpt / "global_step1" / "run.json").exists() and not (ckpt / "global_step2" / "run.json").exists()
    assert "layer_08-model_states.pt" in os.listdir(ckpt / "global_step2")  # the partial checkpoint
