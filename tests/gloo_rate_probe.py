"""One of two ranks on two emulated nodes (tests/test_cluster.py): rank 0 sends rank 1 a 4 MiB tensor a few
times over gloo, then a 128 KiB one (a deep-model message) a few times, each after the link was idle a moment, and
prints the rate each size got, in bits per second (the best round of each).
Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME."""
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ROUNDS, SIZES = 4, (4 << 20, 128 << 10)

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.barrier()
rates = []
for nbytes in SIZES:
    buf, best = torch.zeros(nbytes // 4), 0.0
    for _ in range(ROUNDS):
        time.sleep(0.2)  # the link idle a moment, as between a pipeline's messages
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf[:1], 1)  # the receiver's acknowledgement: the transfer is over when it has it all
        else:
            dist.recv(buf, 0)
            dist.send(buf[:1], 0)
        best = max(best, nbytes * 8 / (time.perf_counter() - start))
    rates.append(best)
if dist.get_rank() == 0:
    print(*rates)
dist.destroy_process_group()
