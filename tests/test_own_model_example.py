"""examples/own_model.py, the README's library example, as a user runs it: with DeepSpeed's own launcher
(`deepspeed --num_gpus 2 ...`), which sets LOCAL_SIZE and so arms DeepSpeed's CPU shared-memory op. It
leaves nothing in /dev/shm, on a normal exit and after a rank is killed (`schedules.init_distributed` starts
the process group without the op's buffers), and prints no `c10d::broadcast_` autograd warning.

The warning came from PipelineModule's constructor broadcasting the tied embedding in place under grad mode
(autograd hooked a warning onto the weight); `schedules.pipeline_module` builds without recording it. The
example's model, tied embedding and all, trains exactly as its layers do in one process with every
schedule, built our way and (the control, which still warns) DeepSpeed's way: the tied weight's gradient is
right either way, and the warning is gone from ours. A user's script that starts the process group with
deepspeed.init_distributed itself gets its buffers' names removed by schedules.initialize.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

import local_launch
from local_launch import MASTER_ADDR, ROOT, launch, shm_buffers

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TINY = ["--schedule", "zb-v", "--depth", "2", "--micro-batches", "4"]
WARNING = "c10d::broadcast_"
TOL = 1e-5


def deepspeed_launcher(args, port, out):
    """`deepspeed --num_gpus 2 examples/own_model.py ARGS` on `port`, in a session of its own."""
    runner = Path(sys.executable).parent / "deepspeed"
    command = [str(runner)] if runner.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen([*command, "--num_gpus", "2", "--master_addr", MASTER_ADDR, "--master_port", str(port),
                             "examples/own_model.py", *args], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def end(launcher):
    """Kill what is left of the launch (its session: the launcher and its ranks)."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def removed(port):
    """The launch's buffers, removed (a failing test leaves nothing either)."""
    left = shm_buffers(port)
    for path in left:
        os.unlink(path)
    return left


def read(out):
    """What the launch printed so far (read without moving the offset it writes at)."""
    return os.pread(out.fileno(), os.fstat(out.fileno()).st_size, 0).decode(errors="replace")


@pytest.mark.timeout(240)
def test_the_example_under_deepspeed_leaves_nothing_in_shared_memory_and_warns_nothing():
    port = local_launch.free_port()  # refused in an unmarked test (conftest)
    with tempfile.TemporaryFile("wb+") as out:
        launcher = deepspeed_launcher([*TINY, "--steps", "2"], port, out)
        try:
            launcher.wait(timeout=200)
        finally:
            end(launcher)
            left = removed(port)
        text = read(out)
    assert launcher.returncode == 0, text[-3000:]
    assert "step 1: loss" in text, text[-3000:]
    assert not left, left
    assert WARNING not in text, text[-3000:]


@pytest.mark.timeout(240)
def test_a_killed_rank_leaves_nothing_in_shared_memory():
    """Rank 1 killed mid-run: DeepSpeed's launcher ends rank 0 and exits with an error; no buffer was ever
    mapped, so none is left."""
    port = local_launch.free_port()  # refused in an unmarked test (conftest)
    with tempfile.TemporaryFile("wb+") as out:
        launcher = deepspeed_launcher([*TINY, "--steps", "100000"], port, out)
        try:
            deadline = time.monotonic() + 180
            while "step 1: loss" not in read(out):
                assert launcher.poll() is None, read(out)[-3000:]
                assert time.monotonic() < deadline, "no step 1 after 180 s"
                time.sleep(0.2)
            assert not shm_buffers(port)  # training, and nothing mapped (removed at the end if there is)
            ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                     if "--local_rank=1" in p.cmdline()]
            assert len(ranks) == 1, [p.cmdline() for p in psutil.Process(launcher.pid).children(recursive=True)]
            ranks[0].kill()
            launcher.wait(timeout=60)  # the launcher ends the other rank
        finally:
            end(launcher)
            left = removed(port)
        text = read(out)
    assert launcher.returncode != 0, text[-3000:]
    assert not left, left


def test_the_tied_weight_gradient_is_right_and_unwarned():
    """The example's model (its tied embedding is the output head) at 2 ranks: two SGD steps equal the same
    layers run in one process, every weight and the tied one within 1e-5 (the tied weight moved by far more),
    for schedules that place the tie on two ranks (1f1b, interleaved) and on one (zb-v, dualpipev). Built by
    DeepSpeed's constructor (the control), the training is as exact and the c10d::broadcast_ warning is
    there; built by schedules.pipeline_module, it is not. The probe starts its process group with
    deepspeed.init_distributed under LOCAL_SIZE: the buffers were made, and initialize removed their names."""
    runs = ["1f1b", "interleaved", "zb-v", "dualpipev", "1f1b-deepspeed-built"]
    done = launch(2, [4, *runs], script="tests/own_model_probe.py", timeout=200, env={"LOCAL_SIZE": "2"})
    assert done.ok, done.explain()
    lines = [json.loads(line) for line in done.stdout[0].splitlines() if line.startswith("{")]
    results, shm = lines[:-1], lines[-1]
    assert [r["schedule"] for r in results] == runs
    for r in results:
        assert r["missing"] == [], r
        assert r["tied_moved"] > 100 * TOL, r  # the weights did change: equal means the same gradients
        assert r["loss_diff"] < TOL and r["weight_diff"] < TOL and r["tied_diff"] < TOL, r
        assert (r["broadcast_warnings"] > 0) == (r["schedule"] == "1f1b-deepspeed-built"), r
    assert shm == {"shm_made": [True, True], "shm_left": [False, False]}, shm
