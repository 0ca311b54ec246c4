"""The experts' all-to-all across two emulated nodes: torch's all_to_all_single against the receives posted first.

    sudo python scripts/benchmark_exchange.py [--rates off 500mbit 250mbit] [--kib 1024] [--out runs/exchange]

Two ranks, one on each node, exchange a tensor of `--kib` KiB each (half of it crosses each way, as the deep MoE
model's 0.5 MiB a way) while computing `--compute-ms` between exchanges, as a pass does between its dispatch and
its combine; no barrier before an exchange, as in training. Each round times torch's `all_to_all_single` and
`schedules/runtime/all_to_all.py`'s exchange (receives posted before sends) one after the other, the order
alternating by round, so drift hits both alike. Printed per link: each way's median time on the rank that waited
longer, the ratio, and the bytes' own time on the wire. Why they differ: all_to_all.py's docstring. Writes JSON;
states the machine. Needs root (network namespaces).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
import bench_common as common  # noqa: E402

WAYS = ("torch", "receives first")


def parse_args(argv=None):
    p = common.add(common.parser(__doc__), "rounds", "out", "timeout", rounds=dict(default=6, help="rounds per link"),
                   out="runs/exchange", timeout=300)
    p.add_argument("--rates", nargs="+", default=["off", "500mbit", "250mbit"], help="link speeds")
    p.add_argument("--kib", type=int, default=1024, help="each rank's tensor, KiB (half of it crosses each way)")
    p.add_argument("--compute-ms", type=float, default=8.0, help="computation between two exchanges")
    p.add_argument("--exchanges", type=int, default=12, help="exchanges each way of a round; the first 2 dropped")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _worker(args):
    """One rank: every round, each way's exchanges timed; rank 0 prints the medians as JSON."""
    import json

    import torch
    import torch.distributed as dist

    from schedules.runtime.all_to_all import post_all_to_all
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    group, results = dist.new_group([0, 1]), dist.new_group([0, 1])
    x = torch.full((args.kib * 256,), float(rank + 1))
    want = torch.cat([torch.full((args.kib * 128,), float(r + 1)) for r in range(2)])
    a = torch.randn(256, 256)
    ways = {"torch": lambda out: dist.all_to_all_single(out, x, group=group),
            "receives first": lambda out: post_all_to_all(out, x, group).wait()}
    times, wrong = {way: [] for way in WAYS}, 0
    for rnd in range(args.rounds):
        for way in (WAYS if rnd % 2 == 0 else WAYS[::-1]):
            dist.barrier(group=results)  # the ways start together; the exchanges inside a way do not
            for i in range(args.exchanges):
                t = time.perf_counter()
                while time.perf_counter() - t < args.compute_ms / 1e3:
                    a @ a
                out = torch.empty_like(x)
                t = time.perf_counter()
                ways[way](out)
                if i >= 2:
                    times[way].append(time.perf_counter() - t)
                wrong += int(not torch.equal(out, want))
    every = [None, None]
    dist.all_gather_object(every, {"median_s": {w: statistics.median(t) for w, t in times.items()}, "wrong": wrong},
                           group=results)
    if rank == 0:
        print(json.dumps(every), flush=True)
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    import json

    from emulated_nodes import format_rate, parse_rate
    from schedules.observe.memory import machine_line
    nodes = common.open_emulated_nodes(2)
    record = {"machine": machine_line(), "args": vars(args), "results": {}}
    lines = [record["machine"] + ", 2 emulated nodes (network namespaces, tc htb links), one rank each",
             f"{args.kib} KiB a rank ({args.kib // 2} KiB each way), {args.compute_ms:g} ms of computation between "
             f"exchanges, {args.rounds} rounds of {args.exchanges - 2}; median ms on the rank that waited longer:", "",
             "| link | torch's all-to-all | receives first | ratio | the bytes on the wire |", "|---|---|---|---|---|"]
    try:
        for rate in args.rates:
            nodes.set_rate(parse_rate(rate))
            got = nodes.measure()
            worker = [os.path.abspath(__file__), *common.argv(args, worker=True, rates=None, out=None)]
            (_, out, _), *_ = common.launch_across(nodes, worker, args.timeout)
            ranks = json.loads(out.strip().splitlines()[-1])
            median = {w: max(r["median_s"][w] for r in ranks) for w in WAYS}
            wire = args.kib * 512 * 8 / got  # half of each rank's tensor crosses each way
            record["results"][rate] = {"median_s": median, "wire_s": wire, "measured_rate": format_rate(got),
                                       "wrong": sum(r["wrong"] for r in ranks)}
            lines.append(f"| {rate} ({format_rate(got)}) | {median['torch'] * 1e3:.1f} | "
                         f"{median['receives first'] * 1e3:.1f} | {median['torch'] / median['receives first']:.2f}x | "
                         f"{wire * 1e3:.1f} |")
            print(lines[-1], flush=True)
    finally:
        nodes.close()
    print("\n".join(lines))
    common.save(args, "exchange", record, lines)
    return 1 if any(r["wrong"] for r in record["results"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
