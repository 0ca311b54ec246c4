"""Run a multi-node job on this one machine: N emulated nodes (network namespaces joined by links of a set
speed, emulated_nodes.py), the job started on each through DeepSpeed's launcher in its --no_ssh mode (or
torchrun), every node's output streamed with a node prefix, a fault injected if asked, and every namespace
removed on every exit (success, failure, Ctrl-C, SIGTERM, a killed child).

    python scripts/cluster.py --nodes 2 --link 200mbit -- train.py --pipeline-parallel-size 2 --steps 20
    python scripts/cluster.py --nodes 2 --ranks-per-node 2 --launcher torchrun -- train.py --pipeline-parallel-size 4
    python scripts/cluster.py --nodes 2 --fault cut:1@step3 -- train.py ... --dist-timeout 20 --save-dir ckpt
    python scripts/cluster.py --clean          # remove what a killed run of this tool left behind

Each node k runs, in its namespace (address 10.77.0.<k+1>, hostname nodek):
    deepspeed --hostfile H --no_ssh --node_rank k --master_addr 10.77.0.1 --master_port P SCRIPT ARGS
with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to its interface and NCCL_HOSTID=nodek, and
OMP_NUM_THREADS = cores / ranks on the machine (unless set). Exit status: 0 when every node ended well,
else the first failing node's; 2 for bad options or no rights to make namespaces.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from emulated_nodes import EmulatedNodes, NoRights, format_rate, parse_rate, sweep  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step (\d+)/")  # train.py's progress line
# What torch prints while a node cannot reach its peers: its C++ side's glog-style lines ("[W1204 15:07:03.64
# socket.cpp:207] [c10d] ..."), and the stack frames under them. Held back and counted, not streamed.
NOISE = re.compile(r"^(\[rank\d+\]:)?\[[WE]\d{4} [^\]]*\]|^frame #\d+:|^Exception raised from "
                   r"|^<omitting python frames>"
                   # torchrun's agents, glog-style too: at a clean end the agent whose node hosts the store may leave
                   # first, and the other's exit barrier logs a traceback
                   r"|^[WE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/distributed/elastic/")


def parse_fault(text):
    """'cut:1@20' (node 1's link cut 20 s after the start), 'kill:1@step3' (node 1's processes killed when a
    node prints step 3) -> (kind, node, seconds or None, step or None)."""
    m = re.fullmatch(r"(cut|kill):(\d+)@(?:(\d+(?:\.\d+)?)s?|step(\d+))", text or "")
    if not m:
        raise ValueError(f"--fault {text!r}: give cut:NODE@SECONDS or kill:NODE@stepN (e.g. cut:1@20, kill:1@step3)")
    return m.group(1), int(m.group(2)), float(m.group(3)) if m.group(3) else None, \
        int(m.group(4)) if m.group(4) else None


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """Bad options: one line, exit status 2."""
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                usage="%(prog)s [options] -- SCRIPT [ARGS ...]")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="processes on each node (default 1)")
    p.add_argument("--link", default=None, help="every node's link speed: 1gbit, 200mbit, 50mbit ... (default: "
                                                "unthrottled, about 10-20 Gbit/s here)")
    p.add_argument("--burst", type=int, default=None, help="bytes a link sends at full speed after being idle "
                                                           "(default: 0.25 ms of its rate, at least 2000 B)")
    p.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--fault", default=None, help="cut:NODE@SECONDS | cut:NODE@stepN | kill:NODE@SECONDS | "
                                                 "kill:NODE@stepN: pull node NODE's cable, or kill its processes")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds the other nodes get to end on their own once one failed (default: the job's "
                        "--dist-timeout + 20, or 60)")
    p.add_argument("--timeout", type=float, default=0, help="end everything after this many seconds (0: never)")
    p.add_argument("--no-measure", action="store_true", help="skip measuring the rate a transfer gets")
    p.add_argument("--clean", action="store_true", help="remove the namespaces of every run of this tool, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS ...] after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.clean:
        if not command:
            p.error("no command: give the script to run after --, e.g. -- train.py --pipeline-parallel-size 2")
        if args.nodes < 1 or args.ranks_per_node < 1:
            p.error(f"--nodes {args.nodes} --ranks-per-node {args.ranks_per_node}: give at least 1 of each")
        try:
            args.rate = parse_rate(args.link)
            args.fault = parse_fault(args.fault) if args.fault else None
        except ValueError as e:
            p.error(str(e))
        if args.fault and args.fault[1] >= args.nodes:
            p.error(f"--fault: node {args.fault[1]} does not exist; nodes are 0..{args.nodes - 1}")
    args.command = command
    return args


def node_argv(args, k, hostfile, master):
    """What node k runs: the launcher of a node of a multi-node job, with this node's rank."""
    script, *rest = args.command
    if not script.endswith(".py"):
        return args.command  # a command of the user's own: NODE_RANK etc. are in its environment
    if args.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}", f"--node_rank={k}",
                f"--nproc_per_node={args.ranks_per_node}", f"--master_addr={master}",
                f"--master_port={args.master_port}", script, *rest]
    return ["deepspeed", f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={k}", f"--master_addr={master}",
            f"--master_port={args.master_port}", script, *rest]


def grace_of(args):
    if args.grace is not None:
        return args.grace
    for i, a in enumerate(args.command):
        if a in ("--dist-timeout", "--dist_timeout") and i + 1 < len(args.command):
            return float(args.command[i + 1]) + 20
        if a.startswith(("--dist-timeout=", "--dist_timeout=")):
            return float(a.split("=", 1)[1]) + 20
    return 60.0


class Node:
    """One node's launcher process and a thread streaming its output with the node's prefix."""

    def __init__(self, k, argv, env, out, on_line):
        self.k, self.noise, self.first_noise = k, 0, None
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._out, self._on_line = out, on_line
        self.thread = threading.Thread(target=self._stream, daemon=True)
        self.thread.start()

    def _stream(self):
        in_noise = False
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if NOISE.search(line) or (in_noise and not line.strip()):
                self.noise += 1
                self.first_noise = self.first_noise or line.strip()
                in_noise = True
                continue
            in_noise = False
            self._out(f"[node{self.k}] {line}")
            self._on_line(self.k, line)

    def summary(self):
        if self.noise:
            first = self.first_noise if len(self.first_noise) < 160 else self.first_noise[:157] + "..."
            return f"[node{self.k}] ({self.noise} lines of torch's C++ warnings and stack frames held back; " \
                   f"the first: {first})"
        return None


class Interrupted(Exception):
    def __init__(self, signum):
        self.signum = signum


def _raise_on(signum, frame):
    raise Interrupted(signum)


def run(args):
    total = args.nodes * args.ranks_per_node
    lock = threading.RLock()

    def out(line):
        with lock:
            print(line, flush=True)

    fault_at_step = threading.Event()

    def on_line(k, line):
        m = STEP.match(line)
        if m and args.fault and args.fault[3] is not None and int(m.group(1)) >= args.fault[3]:
            fault_at_step.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise_on)
    start = time.monotonic()
    nodes, procs, status = None, [], 0
    hostfile = tempfile.NamedTemporaryFile("w", prefix="cluster-hostfile-", suffix=".txt", delete=False)
    try:
        hostfile.write("".join(f"node{k} slots={args.ranks_per_node}\n" for k in range(args.nodes)))
        hostfile.close()
        nodes = EmulatedNodes(args.nodes, rate=args.rate, burst=args.burst)
        nodes.open()
        measured = None if args.no_measure or args.nodes < 2 else nodes.measure()
        out(f"[cluster] {args.nodes} nodes x {args.ranks_per_node} ranks, link {format_rate(nodes.rate)}"
            + (f" (burst {nodes.burst} B)" if nodes.rate else "")
            + (f", a transfer gets {format_rate(measured)}" if measured else "")
            + f"; node k at {nodes.addr(0)[:-1]}<k+1>, launcher {args.launcher}")
        threads = str(max(1, (os.cpu_count() or 1) // total))
        for k in range(args.nodes):
            env = {**os.environ, **nodes.environment(k), "PYTHONUNBUFFERED": "1",
                   "NODE_RANK": str(k), "NNODES": str(args.nodes), "MASTER_ADDR": nodes.addr(0),
                   "MASTER_PORT": str(args.master_port)}
            env.setdefault("OMP_NUM_THREADS", threads)
            procs.append(Node(k, nodes.command(k, node_argv(args, k, hostfile.name, nodes.addr(0))), env, out,
                              on_line))
        status = supervise(args, nodes, procs, start, fault_at_step, out)
    except Interrupted as e:
        out(f"[cluster] {signal.Signals(e.signum).name}: every node stopped")
        status = 128 + e.signum
    except NoRights as e:
        print(f"error: {e}", file=sys.stderr)
        status = 2
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not stop the cleaning
        for node in procs:
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if nodes is not None:
            nodes.close()
        for node in procs:
            node.proc.wait()
            node.thread.join(timeout=5)
            line = node.summary()
            if line:
                out(line)
        os.unlink(hostfile.name)
    return status


def supervise(args, nodes, procs, start, fault_at_step, out):
    """Wait for every node: inject the fault when due, give the others `grace` seconds once one failed,
    end everything past --timeout. The exit status of the run."""
    grace, failed_at, fault = grace_of(args), None, args.fault
    while True:
        now = time.monotonic() - start
        codes = [node.proc.poll() for node in procs]
        if all(c is not None for c in codes):
            break
        if fault and ((fault[2] is not None and now >= fault[2]) or fault_at_step.is_set()):
            kind, k = fault[0], fault[1]
            (nodes.cut if kind == "cut" else nodes.kill)(k)
            out(f"[cluster] fault at {now:.1f} s: " + (f"node {k}'s link cut" if kind == "cut" else
                                                        f"node {k}'s processes killed"))
            fault = None
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            out(f"[cluster] nodes {', '.join(str(n.k) for n in procs if n.proc.poll() is None)} still running "
                f"{grace:.0f} s after a node failed: killed")
            break
        if args.timeout and now > args.timeout:
            out(f"[cluster] --timeout {args.timeout:g} s passed: every node stopped")
            return 124
        time.sleep(0.1)
    codes = [node.proc.poll() for node in procs]
    out(f"[cluster] ended after {time.monotonic() - start:.1f} s: " +
        ", ".join(f"node {n.k} exit {'running (killed)' if c is None else c}" for n, c in zip(procs, codes)))
    bad = [1 if c is None else 128 - c if c < 0 else c for c in codes if c != 0]  # killed by signal N: 128 + N
    return bad[0] if bad else 0


def main(argv=None):
    args = parse_args(argv)
    if args.clean:
        removed = sweep(everything=True)
        print(f"removed {len(removed)} namespaces" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
