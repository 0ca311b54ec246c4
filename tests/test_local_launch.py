"""The test launcher (local_launch.py): a rank forked from the preloaded server runs its script as a fresh
`python script args` would (tests/conftest.py turns preloading on for the whole suite)."""
import signal

import pytest

import local_launch
from local_launch import launch, start

pytestmark = pytest.mark.multiprocess

SCRIPT = '''
import atexit, os, sys
atexit.register(lambda: print("exit handlers ran", flush=True))
print(__name__, os.environ["RANK"], os.environ.get("PROBE_X"), sys.argv[1:], os.getcwd(), flush=True)
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "wait":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_ranks_are_forked_from_the_preloaded_server():
    assert local_launch._preload == ("torch", "deepspeed")


def test_environment_arguments_folder_exit_status_and_exit_handlers(script):
    run = launch(2, ["3"], script=script, env={"PROBE_X": "x"}, timeout=60)
    assert run.returncodes == [3, 3]
    for rank, out in enumerate(run.stdout):
        assert out.splitlines() == [f"__main__ {rank} x ['3'] {local_launch.ROOT}", "exit handlers ran"]


def test_an_uncaught_exception_is_a_traceback_and_status_1(script):
    run = launch(1, ["raise"], script=script, timeout=60)
    assert run.returncodes == [1]
    assert "Traceback" in run.stderr[0] and run.stderr[0].rstrip().endswith("ValueError: boom")
    assert run.stdout[0].splitlines()[-1] == "exit handlers ran"


def test_a_killed_rank_reports_the_signal(script):
    ranks = start(1, ["wait"], script=script)
    try:
        ranks.signal(0, signal.SIGKILL)
    finally:
        run = ranks.wait(30)
    assert run.returncodes == [-signal.SIGKILL]
