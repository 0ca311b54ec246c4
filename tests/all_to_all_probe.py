"""One rank of tests/test_all_to_all.py: the experts' exchange (schedules/runtime/all_to_all.py, receives posted
before sends) against torch's all_to_all_single, over the whole group and over a subgroup, forward and through
overlap.exchange's backward, on several sizes. Prints one JSON line: whether each matched bit for bit.
Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (local_launch)."""
import json
from datetime import timedelta

import torch
import torch.distributed as dist

from schedules.runtime import overlap
from schedules.runtime.all_to_all import post_all_to_all

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
pair = dist.new_group([0, world - 1])  # a subgroup whose group ranks are not the global ones
seen = {}
for name, group, members in (("world", None, world), ("pair", pair, 2)):
    if rank not in (range(world) if group is None else (0, world - 1)):
        continue
    for rows in (members, 4 * members):
        x = torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5) + 1000 * rank
        want = torch.empty_like(x)
        dist.all_to_all_single(want, x, group=group)
        got = torch.empty_like(x)
        post_all_to_all(got, x, group).wait()
        y = x.clone().requires_grad_()
        out = overlap.exchange(y, group)
        out.backward(torch.full_like(out, 1.0) * (rank + 1))
        back = torch.empty_like(x)
        dist.all_to_all_single(back, torch.full_like(x, 1.0) * (rank + 1), group=group)
        seen[f"{name}-{rows}"] = [bool(torch.equal(got, want)), bool(torch.equal(out.detach(), want)),
                                  bool(torch.equal(y.grad, back))]
print(json.dumps(seen), flush=True)
dist.destroy_process_group()
