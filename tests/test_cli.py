"""Bad input ends with one clear line from rank 0 (exit status 2), never a traceback or a hang."""
import pytest

from local_launch import launch

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CASES = {
    "unknown-schedule": (["--pipeline-schedule", "nope"], "--pipeline-schedule"),
    "unknown-model": (["--model", "nope"], "--model"),
    "unknown-size": (["--model-size", "huge"], "--model-size"),
    "missing-data-file": (["--data-file", "/no/such/file.txt"], "--data-file"),
    "offline-hub": (["--dataset", "karpathy/tiny_shakespeare"], "--data-file"),
    "resume-without-dir": (["--resume"], "--save-dir"),
    "schedule-without-pipeline": (["--pipeline-schedule", "zb-h1"], "--pipeline-parallel-size"),
}


def assert_one_error_line(run, flag):
    assert run.returncodes and all(rc == 2 for rc in run.returncodes), run.explain()
    errors = [line for line in run.stderr[0].splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and flag in errors[0], run.stderr[0]
    for out, err in zip(run.stdout, run.stderr):
        assert "Traceback" not in out + err
    for err in run.stderr[1:]:
        assert "error" not in err  # other ranks stay silent


@pytest.mark.parametrize("case", CASES)
def test_bad_flag_is_one_line(case):
    flags, flag = CASES[case]
    assert_one_error_line(launch(1, flags + ["--model-size", "tiny"] * (case != "unknown-size"), timeout=60,
                                 env={"HF_HUB_OFFLINE": "1"}), flag)


def test_stages_must_divide_world_size():
    run = launch(2, ["--pipeline-parallel-size", "3", "--model-size", "tiny"], timeout=60)
    assert_one_error_line(run, "--pipeline-parallel-size")


@pytest.mark.parametrize("ranks,flags,expected", [
    (2, ["--pipeline-schedule", "zb-h2", "--gradient-accumulation-steps", "2"], "--gradient-accumulation-steps >= 3"),
    (2, ["--pipeline-schedule", "dualpipev", "--gradient-accumulation-steps", "3"], "--gradient-accumulation-steps"),
    (3, ["--pipeline-schedule", "dualpipe", "--gradient-accumulation-steps", "6"], "--pipeline-parallel-size"),
    (2, ["--pipeline-schedule", "interleaved", "--virtual-stages", "1"], "--virtual-stages"),
], ids=["zb-h2-m", "dualpipev-m", "dualpipe-odd-p", "interleaved-v"])
def test_schedule_constraints_are_one_line(ranks, flags, expected):
    run = launch(ranks, ["--pipeline-parallel-size", str(ranks), "--model-size", "tiny"] + flags, timeout=60)
    assert_one_error_line(run, expected)
