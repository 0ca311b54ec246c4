"""Rank k of two on emulated node k, for test_cluster: rank 0 hosts the store; both start `faults.Peers` with a
--dist-timeout of 5 s and then wait where no timeout applies (the main thread asleep), so only Peers can end them."""
import os
import sys
import time

from torch.distributed import TCPStore

from faults import Peers

rank = int(os.environ["RANK"])
if rank == 0:
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False)
Peers(rank, 2, timeout_s=5)
print("ready", flush=True)
time.sleep(120)
print(f"rank {rank}: nothing ended me", file=sys.stderr, flush=True)
