"""One of two ranks on two emulated nodes (tests/test_cluster.py): the planner's link profile
(schedules.planner.profile.measure_p2p) of a 128 KiB message, printed by rank 0 as JSON.
Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME."""
import json
from datetime import timedelta

import torch.distributed as dist

from schedules.planner.profile import measure_p2p

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
figures = measure_p2p(128 << 10)
if dist.get_rank() == 0:
    print(json.dumps(figures))
dist.destroy_process_group()
