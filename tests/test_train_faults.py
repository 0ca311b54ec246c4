"""A rank killed (SIGKILL) or stalled (SIGSTOP) mid-run ends the others within --dist-timeout plus a
few seconds, with one line from rank 0 naming the rank; and no launch leaves anything in /dev/shm.

The ranks run as the deepspeed launcher starts them (LOCAL_SIZE = the world size), which arms
DeepSpeed's shared-memory all-reduce op: train.py keeps it from creating its buffers, and the
project's launcher removes any a script created, whatever became of its ranks.
"""
import signal
import sys
import time

import pytest

from local_launch import shm_buffers, start
from training import TINY_CHUNKED

pytestmark = pytest.mark.multiprocess

TIMEOUT_S = 20  # --dist-timeout
SLACK_S = 12  # rank 0's own detection (a heartbeat a second), its report, and a busy machine


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.2)


# A killed rank closes its connections, which each engine's waits see in their own way: every engine. A stopped one
# closes nothing, and only rank 0's heartbeat watcher (faults.py, a thread of its own, whatever the engine) ends
# the run after --dist-timeout: one engine is enough, and each such run waits out the whole timeout.
@pytest.mark.parametrize("schedule, fault", [(s, signal.SIGKILL) for s in ("1f1b", "zb-h1", "zb-v")]
                         + [("zb-v", signal.SIGSTOP)],
                         ids=["killed-1f1b", "killed-zb-h1", "killed-zb-v", "stopped-zb-v"])
def test_a_lost_rank_ends_the_run_with_one_line(schedule, fault):
    ranks = start(2, [*TINY_CHUNKED, "--pipeline-parallel-size", "2", "--pipeline-schedule", schedule, "--steps",
                      "100000", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4", "--dist-timeout",
                      TIMEOUT_S], env={"LOCAL_SIZE": "2"})
    try:
        wait_for(lambda: "step 2/" in ranks.stdout(0), 240, "step 2")
        assert not shm_buffers(ranks.port)  # train.py runs DeepSpeed's shared-memory op without buffers
        ranks.signal(1, fault)
        faulted = time.monotonic()
        wait_for(lambda: ranks.procs[0].poll() is not None, TIMEOUT_S + SLACK_S, "end of rank 0")
        ended_s = time.monotonic() - faulted
    finally:
        ranks.signal(1, signal.SIGKILL)  # the stopped rank never ends by itself
        run = ranks.wait(30)
    assert run.returncodes[0] == 1, run.explain()
    errors = [line for line in run.stderr[0].splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 stopped responding"), run.stderr[0]
    assert run.stderr[0].rstrip().endswith(errors[0])  # the last word
    assert "Traceback" not in run.stdout[0] + run.stderr[0]
    assert ended_s < TIMEOUT_S + SLACK_S
    assert not shm_buffers(ranks.port)


def test_the_launcher_removes_shared_memory_of_killed_ranks():
    """This file, run as a script, is a rank that arms DeepSpeed's op as the deepspeed launcher does and
    waits: one rank killed and the deadline passed, the launcher leaves nothing behind."""
    ranks = start(2, [], script="tests/test_train_faults.py", env={"LOCAL_SIZE": "2"})
    try:
        wait_for(lambda: len(shm_buffers(ranks.port)) == 2, 120, "shared-memory buffers")
        ranks.signal(1, signal.SIGKILL)
        with pytest.raises(TimeoutError):
            ranks.wait(timeout=1)  # rank 0 still waits
    finally:
        ranks.close()
    assert not shm_buffers(ranks.port)


if __name__ == "__main__":  # a rank of test_the_launcher_removes_shared_memory_of_killed_ranks
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    print("ready", flush=True)
    time.sleep(600)
    sys.exit(0)
