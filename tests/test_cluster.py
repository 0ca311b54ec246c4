"""Emulated nodes (emulated_nodes.py) and the multi-node runs of scripts/cluster.py.

- a set link rate is what gloo sees (within 10%), a message after an idle link included;
- train.py across two nodes, through DeepSpeed's launcher in --no_ssh mode and through torchrun, trains
  as on one node;
- a node cut off or killed mid-run ends every surviving node in one line within --dist-timeout plus a
  margin, the last checkpoint intact, and that checkpoint resumes on one node under another layout exactly;
- every exit path (success, failure, Ctrl-C, SIGTERM, a killed child, the tool itself killed) leaves no
  namespace behind.
Skipped, with the reason, where network namespaces cannot be made (not root).
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import emulated_nodes
from emulated_nodes import EmulatedNodes, can_make_namespaces, ours, sweep
from local_launch import ROOT, launch
from training import TINY

WHY_NOT = can_make_namespaces()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=f"no emulated nodes here: {WHY_NOT}")
TIMEOUT_S = 10  # --dist-timeout of the fault runs
SLACK_S = 20  # the cut-off rank's own timeout fires at --dist-timeout; then its report, the launcher, a busy machine
STEPS = 8
FLAGS = [*TINY, "--seed", "3", "--micro-batch-size", "2", "--gradient-accumulation-steps", "4", "--log-interval", "1",
         "--steps", str(STEPS)]
TWO_STAGES = ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v"]


def cluster(args, timeout=240):
    """scripts/cluster.py run to its end: (exit status, output lines)."""
    r = subprocess.run([sys.executable, "scripts/cluster.py", *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, (r.stdout + r.stderr).splitlines()


def losses(path):
    return {e["step"]: e["loss"] for e in map(json.loads, path.read_text().splitlines()) if "loss" in e}


def node_lines(lines, k):
    return [line[len(f"[node{k}] "):] for line in lines if line.startswith(f"[node{k}] ")]


def namespaces_of(pid):
    return ours().get(pid, [])


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: the same training on one node (loopback), uninterrupted."""
    metrics = tmp_path_factory.mktemp("one-node") / "metrics.jsonl"
    run = launch(2, [*FLAGS, *TWO_STAGES, "--metrics-file", metrics])
    assert run.ok, run.explain()
    return losses(metrics)


def test_without_the_rights_the_tool_says_so_in_one_line(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import cluster as tool
    monkeypatch.setattr(emulated_nodes.os, "geteuid", lambda: 1000)
    assert tool.main(["--nodes", "2", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: emulated nodes need root"), err
    assert tool.parse_fault("kill:1@step3") == ("kill", 1, None, 3)
    assert tool.parse_fault("cut:0@2.5") == ("cut", 0, 2.5, None)
    with pytest.raises(SystemExit) as e:
        tool.main(["--fault", "cut:one@3", "--", "true"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fault" in err[0] and "cut:NODE@SECONDS" in err[0], err


def on_both(nodes, script):
    """tests/SCRIPT as rank k on node k of two, the project importable: what rank 0 printed."""
    ranks = nodes.run_ranks([f"tests/{script}"], 29511, timeout=120, cwd=ROOT, extra_env={"PYTHONPATH": str(ROOT)})
    assert all(code == 0 for code, _, _ in ranks), ranks
    return ranks[0][1]


@needs_namespaces
@pytest.mark.multiprocess
def test_a_set_link_rate_is_what_gloo_sees_and_the_planner_measures():
    with EmulatedNodes(2, rate="200mbit") as nodes:
        made = namespaces_of(os.getpid())
        assert len(made) == 3
        tcp = nodes.measure()
        gloo, _ = map(float, on_both(nodes, "gloo_rate_probe.py").split())
        profile = json.loads(on_both(nodes, "p2p_profile_probe.py").splitlines()[-1])  # DeepSpeed's log line first
    assert abs(gloo / 200e6 - 1) < 0.10, f"gloo got {gloo / 1e6:.1f} Mbit/s of 200"
    assert abs(tcp / 200e6 - 1) < 0.10, f"a TCP transfer got {tcp / 1e6:.1f} Mbit/s of 200"
    # auto's link: a byte's time is the link's, and a receive's own time leaves the wire out (the simulator puts
    # the wire time between send and receive; counted in both, a slow link's cost was paid twice)
    wire = (128 << 10) * 8 / 200e6
    assert abs(profile["per_byte"] * (128 << 10) / wire - 1) < 0.15, profile
    assert profile["recv"] < 0.3 * wire, profile
    # the sockets' buffers take a 128 KiB message at once: its blocking send returns before the wire carried it
    assert (128 << 10) <= profile["buffered"] <= (1 << 20), profile
    # an all-to-all between the two moves half of each rank's payload across each way, both ways at once, also on
    # the rank that enters it last: half the link's byte time per byte a rank puts in. torch's all-to-all on gloo
    # took the whole of it there: that rank's receive, posted after its send, told the other it could send only
    # behind its own bytes, so the two ways crossed one after the other (schedules/runtime/all_to_all.py)
    assert 0.4 < profile["a2a_per_byte"] / (8 / 200e6) < 0.65, profile
    assert not namespaces_of(os.getpid())


@needs_namespaces
@pytest.mark.multiprocess
def test_a_slow_link_saves_up_no_bandwidth_while_it_idles():
    # a 128 KiB message (a deep-model activation) after a pause crosses 50 Mbit/s at the rate, not faster: a bucket
    # of 16 KiB let it through at 1.11-1.15x the rate (the default's 2000 bytes: 1.02); waiting only slows it
    with EmulatedNodes(2, rate="50mbit") as nodes:
        stream, message = map(float, on_both(nodes, "gloo_rate_probe.py").split())
    assert abs(stream / 50e6 - 1) < 0.10, f"gloo got {stream / 1e6:.1f} Mbit/s of 50"
    assert message / 50e6 < 1.06, f"a 128 KiB message after an idle link got {message / 1e6:.1f} Mbit/s of 50"


@needs_namespaces
@pytest.mark.multiprocess
def test_the_readmes_moe_gptlite_trains_overlapped_across_two_nodes(tmp_path):
    """The README's command (tiny, 2 steps): DualPipe's copies share each stage's experts and exchange their tokens
    over the 1 Gbit/s link, the pairs overlapped (the default), and the losses are the sequential pairs'. The
    sequential run's trace names each all-to-all's group and rank (what trace.communication_costs(own=True) reads)."""
    readme = ["--moe-experts", "4", "--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe",
              "--dualpipe-experts", "shard", "--gradient-accumulation-steps", "8"]
    assert " ".join(readme) in (ROOT / "README.md").read_text().replace(" \\\n    ", " ")
    got = {}
    for overlap in ("on", "off"):
        metrics = tmp_path / f"{overlap}.jsonl"
        traced = ["--trace", tmp_path / "off.json", "--trace-steps", 1] if overlap == "off" else []
        status, lines = cluster(["--nodes", 2, "--link", "1gbit", "--timeout", 200, "--", "train.py", *readme, *TINY,
                                 "--micro-batch-size", "2", "--steps", 2, "--log-interval", "1", "--overlap", overlap,
                                 "--metrics-file", metrics, *traced])
        assert status == 0, "\n".join(lines[-30:])
        got[overlap] = losses(metrics)
    assert sorted(got["on"]) == [1, 2] and got["on"] == got["off"]
    events = json.loads((tmp_path / "off.json").read_text())["traceEvents"]
    exchanges = [e["args"] for e in events if e.get("cat") == "comm" and e["name"] == "all-to-all"]
    assert exchanges and all(a["group"] == [0, 1] and a["rank"] in (0, 1) for a in exchanges)
    assert {a["rank"] for a in exchanges} == {0, 1}
    assert not namespaces_of(os.getpid())


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_two_nodes_train_as_one(launcher, one_node, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    steps = STEPS if launcher == "deepspeed" else 3
    status, lines = cluster(["--nodes", 2, "--link", "200mbit", "--launcher", launcher, "--timeout", 200, "--",
                             "train.py", *FLAGS, *TWO_STAGES, "--steps", steps, "--metrics-file", metrics])
    assert status == 0, "\n".join(lines[-30:])
    rate = r"link 200 Mbit/s \(burst \d+ B\), a transfer gets (1[89]\d|2[01]\d) Mbit/s"
    assert re.search(rate, lines[0]), lines[0]
    two = losses(metrics)
    assert sorted(two) == list(range(1, steps + 1))
    for step, loss in two.items():
        assert loss == pytest.approx(one_node[step], rel=1e-6, abs=0), (step, loss, one_node[step])
    assert not any("Traceback" in line for line in lines)


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize("fault, survivors, layout, ranks", [
    ("cut:1@step3", (0, 1), ["--pipeline-parallel-size", "2", "--pipeline-schedule", "1f1b"], 2),
    ("kill:0@step3", (1,), ["--pipeline-parallel-size", "0"], 1),
], ids=["cut", "kill"])
def test_a_lost_node_ends_every_node_in_one_line_and_the_run_resumes_exactly(fault, survivors, layout, ranks,
                                                                             one_node, tmp_path):
    save = tmp_path / "ckpt"
    status, lines = cluster(["--nodes", 2, "--fault", fault, "--timeout", 200, "--", "train.py", *FLAGS, *TWO_STAGES,
                             "--steps", 1000, "--dist-timeout", TIMEOUT_S, "--save-dir", save, "--save-interval", 2])
    assert status != 0, "\n".join(lines[-30:])
    faulted = float(re.search(r"\[cluster\] fault at ([\d.]+) s", "\n".join(lines)).group(1))
    ended = float(re.search(r"\[cluster\] ended after ([\d.]+) s", "\n".join(lines)).group(1))
    assert ended - faulted < TIMEOUT_S + SLACK_S, "\n".join(lines[-30:])
    assert "still running" not in "\n".join(lines)  # every node ended by itself, none was killed by the tool
    for k in survivors:
        errors = [line for line in node_lines(lines, k) if line.startswith("error:")]
        assert len(errors) == 1, (k, errors)
        if fault.startswith("kill") or k == 1:  # the rank that lost rank 0 says so
            assert errors[0].startswith("error: rank 1 lost rank 0: its store at 10.77.0.1:"), errors
        else:  # rank 0 names the rank it lost
            assert errors[0].startswith("error: rank 1 stopped responding"), errors
    assert not any("Traceback" in line for line in lines)
    reconnects = sum(int(m.group(1)) for m in re.finditer(r"\((\d+) lines of torch's C\+\+", "\n".join(lines)))
    assert reconnects < 10  # no c10d reconnect flood: a rank that lost rank 0 probes with a plain socket

    # the last checkpoint is intact: it resumes on one node, under another layout, and trains on exactly
    saved = int((save / "latest").read_text().strip().removeprefix("global_step"))
    assert saved >= 2
    metrics = tmp_path / "resumed.jsonl"
    run = launch(ranks, [*FLAGS, *layout, "--save-dir", save, "--resume", "--metrics-file", metrics])
    assert run.ok, run.explain()
    resumed = losses(metrics)
    assert sorted(resumed) == list(range(saved + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(one_node[step], rel=1e-5), (step, loss, one_node[step])


@needs_namespaces
@pytest.mark.multiprocess
def test_a_cut_off_rank_ends_itself_where_no_timeout_applies():
    # the cut-off rank's store calls never return (the client's timeout does not cover a silent peer): with its
    # main thread asleep, not in a collective that times out, only Peers' own deadline ends it (it ran for the
    # whole 120 s before that deadline)
    with EmulatedNodes(2) as nodes:
        runs = []
        thread = threading.Thread(target=lambda: runs.append(nodes.run_ranks(
            ["tests/peers_cut_probe.py"], 29513, timeout=60, cwd=ROOT, extra_env={"PYTHONPATH": str(ROOT)})))
        thread.start()
        time.sleep(8)  # both ranks started and beating
        nodes.cut(1)
        cut = time.monotonic()
        thread.join()
        ended = time.monotonic() - cut
    (status0, _, err0), (status1, _, err1) = runs[0]
    assert (status0, status1) == (1, 1), runs
    assert ended < 5 + 10, f"the ranks ended {ended:.0f} s after the cut (--dist-timeout 5 s): {runs}"
    assert "error: rank 1 lost rank 0" in err1 and "stopped responding" in err0, runs


@needs_namespaces
@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["success", "failure", "SIGINT", "SIGTERM", "killed-child", "tool-killed"])
def test_every_exit_path_removes_what_the_tool_made(path):
    command = {"success": ["sh", "-c", "echo node $NODE_RANK of $NNODES"], "failure": ["sh", "-c", "exit 3"]}.get(
        path, ["sleep", "120"])
    tool = subprocess.Popen([sys.executable, "scripts/cluster.py", "--nodes", "2", "--no-measure", "--grace", "1",
                             "--", *command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if path in ("success", "failure"):
        out, _ = tool.communicate(timeout=60)
        assert tool.returncode == (0 if path == "success" else 3), out
        if path == "success":
            assert "[node0] node 0 of 2" in out and "[node1] node 1 of 2" in out, out
    else:
        deadline = time.monotonic() + 60
        while not (len(namespaces_of(tool.pid)) == 3 and all(
                emulated_nodes._ip("netns", "pids", name).stdout.split() for name in namespaces_of(tool.pid)
                if name.endswith(("-n0", "-n1")))):
            assert time.monotonic() < deadline and tool.poll() is None, "the nodes never started"
            time.sleep(0.1)
        made = namespaces_of(tool.pid)
        if path == "killed-child":
            node0 = [n for n in made if n.endswith("-n0")][0]
            for pid in emulated_nodes._ip("netns", "pids", node0).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            expected = 128 + signal.SIGKILL
        elif path == "tool-killed":
            tool.kill()  # nothing can clean up after SIGKILL: the next run of the tool (or --clean) does
            expected = -signal.SIGKILL
        else:
            tool.send_signal(getattr(signal, path))
            expected = 128 + getattr(signal, path)
        tool.communicate(timeout=60)
        assert tool.returncode == expected
        if path == "tool-killed":
            assert namespaces_of(tool.pid) == made
            assert set(made) <= set(sweep())  # a dead process's namespaces, and the processes in them, removed
    assert not namespaces_of(tool.pid)
    hosts = os.listdir(emulated_nodes.HOSTS_DIR) if os.path.isdir(emulated_nodes.HOSTS_DIR) else []
    assert not [name for name in hosts if name.startswith(f"{emulated_nodes.PREFIX}{tool.pid}-")]
