"""Several nodes on one machine: a Linux network namespace per node, joined through a switch (a bridge in a
namespace of its own) by links of a set speed, for running a multi-node job here the way it runs on a
cluster (scripts/cluster.py is the command line; the tests and benchmarks use `EmulatedNodes` directly).

    node k: namespace <tag>-n<k>, interface eth0, address 10.<subnet>.0.<k+1>/24, hostname nodek (its hosts file)
    switch: namespace <tag>-sw, bridge br0, port p<k> to node k

A link's speed is a token bucket (tc htb, one class) on both ends of node k's cable: the node's eth0 (what it
sends) and the switch's port p<k> (what it receives), so any transfer between two nodes crosses two links
of the set rate, full duplex. The bucket's burst is kept small: a large one is bandwidth saved up while the
ranks compute, which lets the next message up to its size leave at full speed, and the link looks free.
Why htb and not tbf: a tbf bucket smaller than a packet cuts TCP's 64 KB segmentation-offload packets into
frames of the MTU, and the kernel's per-frame work (two veths, the bridge, both buckets) ran on the cores the
ranks compute on: 5.2 core-seconds per GiB crossing at 2 Gbit/s against 2.3 unthrottled, a sixth of both cores
during an overlapped DualPipe step. htb lets a large packet through and charges the bucket for it (the rate is
kept, no bandwidth saved up): 2.7 core-seconds per GiB, the rate within 5% of the set one.

Nothing here routes anywhere but between the namespaces made here. Everything made is removed by `close()`
(or leaving the `with` block): the namespaces (their interfaces go with them), the processes still in them,
and the per-namespace /etc/netns/<name> files. Namespaces are named after the process that made them, so a
later one removes those of a process that died without closing (`sweep()`).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "emnode"  # every namespace made here: emnode<pid>-n<k>, emnode<pid>-sw
IFACE = "eth0"
MTU = 9000  # jumbo frames, as data-centre fabrics use: a sixth of the packets, so of the CPU the emulation takes
HOSTS_DIR = "/etc/netns"  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*


class NoRights(RuntimeError):
    """Network namespaces cannot be made here (not root, or no kernel support)."""


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _tc(ns, *args, check=True):
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"tc {' '.join(args)} (in {ns}): {r.stderr.strip()}")
    return r


def parse_rate(text):
    """'200mbit', '1gbit', '50Mbit', '1e9' (bit/s) -> bits per second; None or 'off' -> None (unthrottled)."""
    if text is None or str(text).lower() in ("off", "none", "0", ""):
        return None
    m = re.fullmatch(r"([0-9.eE+]+)\s*([kmg]?)(bit)?(/s)?", str(text).strip().lower())
    if not m:
        raise ValueError(f"link rate {text!r}: give it as e.g. 1gbit, 200mbit, 50mbit or off")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    if value < 1e5:
        raise ValueError(f"link rate {text!r}: below 100 kbit/s, the runs would take hours; give at least 100kbit")
    return value


def default_burst(rate_bps):
    """Bytes a link may send at full speed after being idle: a quarter of a millisecond at its rate (less loses
    rate at 1 Gbit/s on this kernel: 16 KiB there, 8 MiB took 1.2x its bytes over the rate), at least 2000.
    31 KiB at 1 Gbit/s, 6 KiB at 200 Mbit/s, 2000 B at 50 Mbit/s. The floor was 16 KiB, which let a 128 KiB message
    after an idle link cross 50 Mbit/s in 0.87 of its bytes over the rate (2000 B: 0.97; AMD EPYC, 2026-12-06)."""
    return max(2000, int(rate_bps / 8 * 250e-6))


def format_rate(bps):
    if bps is None:
        return "unthrottled"
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def can_make_namespaces():
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return ("emulated nodes need root (network namespaces, veth, tc): run as root, or in a container with "
                "CAP_NET_ADMIN")
    if not shutil.which("ip") or not shutil.which("tc"):
        return "emulated nodes need iproute2's `ip` and `tc` on PATH: apt-get install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"cannot make a network namespace here ({r.stderr.strip()}); emulated nodes need CAP_SYS_ADMIN"
    _ip("netns", "delete", probe, check=False)
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours(names=None):
    """The namespaces made here by any process, as {owner pid: [names]}."""
    if names is None:
        names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    owners = {}
    for name in names:
        m = re.fullmatch(rf"{PREFIX}(\d+)-(n\d+|sw|probe)", name)
        if m:
            owners.setdefault(int(m.group(1)), []).append(name)
    return owners


def _kill_in(name):
    """SIGKILL every process in namespace `name`."""
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove(names):
    """Kill every process in `names`, then delete them and their /etc/netns files."""
    for name in names:
        _kill_in(name)
    for name in names:
        for _ in range(50):  # a killed process may hold the namespace for a moment
            if not _ip("netns", "pids", name, check=False).stdout.split():
                break
            time.sleep(0.05)
        _ip("netns", "delete", name, check=False)
        shutil.rmtree(os.path.join(HOSTS_DIR, name), ignore_errors=True)


def sweep(everything=False):
    """Remove what processes that died without closing left behind (`everything`: every process's)."""
    removed = []
    for pid, names in ours().items():
        if everything or not _alive(pid):
            _remove(names)
            removed += names
    return removed


class EmulatedNodes:
    """`nodes` namespaces joined through a switch; `rate` bits per second on every node's link (None:
    unthrottled), `burst` bytes (default: default_burst). Use as a context manager."""

    def __init__(self, nodes, rate=None, burst=None, subnet=77):
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes {nodes}: give 1 to 200")
        self.nodes, self.subnet = nodes, subnet
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.names = [f"{self.tag}-n{k}" for k in range(nodes)]
        self.rate, self.burst = None, None
        self._made = []
        self._wanted = (rate, burst)

    # --- making and removing -------------------------------------------------------------------------
    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()

    def open(self):
        why = can_make_namespaces()
        if why:
            raise NoRights(why)
        sweep()
        try:
            self._make()
            self.set_rate(*self._wanted)
        except BaseException:
            self.close()
            raise

    def _make(self):
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(k)} node{k}\n" for k in range(self.nodes))
        for k, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            # each node resolves this machine's hostname to its own address (a fresh namespace would say
            # 127.0.0.1, which gloo and c10d then advertise to their peers) and the others' names
            os.makedirs(os.path.join(HOSTS_DIR, ns), exist_ok=True)
            with open(os.path.join(HOSTS_DIR, ns, "hosts"), "w") as f:
                f.write(hosts + f"{self.addr(k)} {os.uname().nodename}\n")
            _ip("link", "add", IFACE, "netns", ns, "mtu", str(MTU), "type", "veth", "peer", "name", f"p{k}", "netns",
                self.switch, "mtu", str(MTU))
            _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{k}", "up")

    def close(self):
        """Remove every namespace made (and the processes still in them); safe to call twice."""
        made, self._made = self._made, []
        _remove(made)

    # --- the nodes -----------------------------------------------------------------------------------
    def addr(self, k):
        return f"10.{self.subnet}.0.{k + 1}"

    def set_rate(self, rate=None, burst=None):
        """Every node's link at `rate` bits per second (None: unthrottled) with a bucket of `burst` bytes."""
        rate = parse_rate(rate) if isinstance(rate, str) else rate
        burst = burst or (default_burst(rate) if rate else None)
        for k, ns in enumerate(self.names):
            for where, dev in ((ns, IFACE), (self.switch, f"p{k}")):
                _tc(where, "qdisc", "del", "dev", dev, "root", check=False)
                if rate:
                    _tc(where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
                    _tc(where, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate",
                        f"{int(rate)}bit", "ceil", f"{int(rate)}bit", "burst", str(int(burst)), "cburst",
                        str(int(burst)))
        self.rate, self.burst = rate, burst

    def cut(self, k):
        """Node k's cable pulled: its interface goes down (what it sends and receives is lost)."""
        _ip("-n", self.names[k], "link", "set", IFACE, "down")

    def kill(self, k):
        """Every process on node k killed (SIGKILL), as when a node dies."""
        _kill_in(self.names[k])

    def command(self, k, argv):
        """`argv` run on node k."""
        return ["ip", "netns", "exec", self.names[k], *argv]

    def environment(self, k):
        """What a node's processes need to find their network: gloo and NCCL on the node's interface, NCCL
        told the nodes are different hosts (else it bypasses the network between processes of one machine)."""
        return {"GLOO_SOCKET_IFNAME": IFACE, "NCCL_SOCKET_IFNAME": IFACE, "NCCL_HOSTID": f"node{k}",
                "TP_SOCKET_IFNAME": IFACE}

    def rank_nodes(self, ranks_per_node=1, interleave=False):
        """The node of each global rank: consecutive ranks on a node, as DeepSpeed's launcher places them
        (node k holds ranks k*R .. k*R+R-1), or with `interleave` dealt round (node k holds k, k+N, ...)."""
        world = self.nodes * ranks_per_node
        return [r % self.nodes if interleave else r // ranks_per_node for r in range(world)]

    def run_ranks(self, argv, port, timeout, threads=1, cwd=None, extra_env=None, ranks_per_node=1,
                  interleave=False):
        """`python ARGV` as `ranks_per_node` ranks on each node, placed as `rank_nodes` says (one each: RANK =
        node; the process group's store on node 0 at `port`), with `extra_env` added to the environment, to
        their end or `timeout` seconds (then killed): every rank's (exit status, stdout, stderr), by rank."""
        logs, procs = [], []
        where = self.rank_nodes(ranks_per_node, interleave)
        for rank, k in enumerate(where):
            env = {**os.environ, **self.environment(k), "RANK": str(rank),
                   "LOCAL_RANK": str(where[:rank].count(k)), "WORLD_SIZE": str(len(where)),
                   "LOCAL_WORLD_SIZE": str(ranks_per_node), "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(self.command(k, [sys.executable, *argv]), cwd=cwd, env=env, stdout=out,
                                          stderr=err))
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = []
        for proc, (out, err) in zip(procs, logs):
            out.seek(0)
            err.seek(0)
            results.append((proc.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return results

    def measure(self, src=0, dst=1, nbytes=8 << 20, rounds=3):
        """The rate in bits per second a TCP transfer of `nbytes` from node `src` to node `dst` gets (gloo's
        transport is TCP), the best of `rounds`."""
        if self.nodes < 2:
            return None
        port = 29555
        server = subprocess.Popen(self.command(dst, [sys.executable, "-c", _RECEIVER, self.addr(dst), str(port),
                                                    str(nbytes), str(rounds)]), stdout=subprocess.PIPE, text=True)
        try:
            out = subprocess.run(self.command(src, [sys.executable, "-c", _SENDER, self.addr(dst), str(port),
                                                    str(nbytes), str(rounds)]),
                                 capture_output=True, text=True, timeout=60 + rounds * nbytes * 8 / 1e6)
            if out.returncode:
                raise RuntimeError(f"measuring the link failed: {out.stderr.strip().splitlines()[-1:]}")
            return float(out.stdout.strip())
        finally:
            server.kill()
            server.wait()


_RECEIVER = """
import socket, sys
addr, port, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(1)
c, _ = s.accept()
for _ in range(rounds):
    got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
"""

_SENDER = """
import socket, sys, time
addr, port, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for _ in range(100):
    try:
        c = socket.create_connection((addr, port)); break
    except OSError:
        time.sleep(0.05)
buf, best = b"x" * n, 0.0
for _ in range(rounds):
    time.sleep(0.2)  # the bucket refills: a burst is part of what a transfer gets after an idle link
    t = time.perf_counter(); c.sendall(buf); c.recv(1); best = max(best, n * 8 / (time.perf_counter() - t))
print(best)
"""
