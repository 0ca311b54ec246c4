"""What a late receive costs on gloo when both ranks compute, and what posting it ahead saves.

    python scripts/benchmark_p2p.py [--rounds 40] [--kib 128] [--out runs/p2p]

Two ranks, one compute thread each (the benchmark's setting). Rank 0 sends a message with
`isend` and goes on computing; rank 1 computes too and only then asks for the message, either
with a plain `recv` there ("late") or by waiting on an `irecv` it posted before computing
("ahead", what schedules/receive_ahead.py does). The time rank 1 spends in the receive is the
cost of the message to the schedule. The two ways alternate round by round, so drift on this
noisy machine hits both alike. Writes JSON; states the machine.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

MODES = ("late", "ahead")


def parse_args(argv=None):
    p = common.add(common.parser(__doc__), "rounds", rounds=dict(default=40, help="messages per way"))
    p.add_argument("--kib", type=int, default=128, help="message size (the deep model's activation: 128 KiB)")
    p.add_argument("--compute-ms", type=float, default=10.0, help="compute on each rank around the message")
    common.add(p, "out", "docs", out="runs/p2p", docs="p2p[-KIBkib]")
    p.add_argument("--port", type=int, default=29561)
    return p.parse_args(argv)


def _compute(seconds, a):
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ a


def _rank(rank, args, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    a = torch.randn(256, 256)
    waits, wrong = {m: [] for m in MODES}, 0
    for i in range(2 * args.rounds + 2):  # two warm-up messages
        mode = MODES[i % 2]
        x = torch.full((args.kib * 256, ), float(i)) if rank == 0 else torch.empty(args.kib * 256)
        dist.barrier()
        if rank == 0:
            _compute(0.002, a)  # the sender finishes its pass first...
            work = dist.isend(x, 1)
            _compute(2 * args.compute_ms / 1e3, a)  # ...and goes on computing
            work.wait()
            continue
        work = dist.irecv(x, 0) if mode == "ahead" else None
        _compute(args.compute_ms / 1e3, a)  # the receiver is still busy when the message leaves
        t = time.perf_counter()
        if work is None:
            dist.recv(x, 0)
        else:
            work.wait()
        if i >= 2:
            waits[mode].append(time.perf_counter() - t)
            wrong += int(not bool((x == float(i)).all()))
    if rank == 1:
        queue.put({"waits_s": waits, "wrong_messages": wrong})
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    import torch.multiprocessing as mp

    from schedules.observe.memory import machine_line
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    lines = [machine_line(), f"{args.kib} KiB messages, {args.compute_ms:g} ms of compute on each rank, "
             f"{args.rounds} messages per way; time in the receive (ms):"]
    for mode in MODES:
        w = sorted(result["waits_s"][mode])
        lines.append(f"{mode:6} median {statistics.median(w) * 1e3:6.2f}  mean {statistics.mean(w) * 1e3:6.2f}  "
                     f"max {w[-1] * 1e3:6.2f}")
    if result["wrong_messages"]:
        lines.append(f"ERROR: {result['wrong_messages']} messages arrived with the wrong data")
    print("\n".join(lines))
    record = {"machine": machine_line(), "args": vars(args), **result}
    common.save(args, "p2p", record, publish="p2p" if args.kib == 128 else f"p2p-{args.kib}kib")
    return 1 if result["wrong_messages"] else 0


if __name__ == "__main__":
    sys.exit(main())
