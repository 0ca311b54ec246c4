"""One rank of a user's model with tied weights (tests/user_models.py's `tied`: an embedding that is also
the output head) moved from one layout to another through the universal layout, as a library user would:
`python tests/resume_probe.py SCHEDULE_A ZERO_A SCHEDULE_B ZERO_B DIR`, run by tests/test_resume_anywhere.py.

Under A: `schedules.pipeline_module` + `schedules.initialize` with AdamW, one `train_batch`, then DeepSpeed's
`engine.save_checkpoint` with `universal.client_state(engine)`; rank 0 converts it (`universal.convert`).
Under B: a fresh engine, `universal.load`, saved and converted the same way. Rank 0 prints one JSON line:
the parameters whose weight, moments or step differ between the two universal layouts (none when exact),
how many were compared, and how far the tied weight moved in A's step (that the compared state is trained).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import schedules
from schedules.runtime import universal
from user_models import MICRO_BATCH, MODELS, cross_entropy, token_batch

SEED, MICRO_BATCHES = 1234, 8
KEYS = ("fp32", "exp_avg", "exp_avg_sq", "step")


def engine_of(schedule, zero):
    module = schedules.pipeline_module(schedule, MODELS["tied"][0](), num_stages=dist.get_world_size(),
                                       loss_fn=cross_entropy, partition_method="uniform", seed_layers=True,
                                       seed_fn=torch.manual_seed, base_seed=SEED)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True, "weight_decay": 0.01}}}
    engine, *_ = schedules.initialize(schedule, model=module, model_parameters=module.parameters(), config=cfg)
    return engine


def save_and_convert(engine, folder, tag):
    engine.save_checkpoint(folder, tag=tag, client_state=universal.client_state(engine))
    if dist.get_rank() == 0:
        universal.convert(os.path.join(folder, tag))
    dist.barrier()
    return os.path.join(folder, tag)


def read(folder):
    zero = os.path.join(folder, universal.ZERO)
    names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    return {n: {k: torch.load(os.path.join(zero, n, f"{k}.pt"), weights_only=False) for k in KEYS} for n in names}


def same(a, b):
    if isinstance(a, dict):
        return torch.equal(a["param"], b["param"])
    return float(a) == float(b)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("schedule_a")
    p.add_argument("zero_a", type=int)
    p.add_argument("schedule_b")
    p.add_argument("zero_b", type=int)
    p.add_argument("dir")
    args = p.parse_args()
    schedules.init_distributed(timeout=60)
    a = engine_of(args.schedule_a, args.zero_a)
    initial = a.module.tied_modules["embed"].weight.detach().clone() if "embed" in a.module.tied_modules else None
    a.train_batch(iter([token_batch(i) for i in range(MICRO_BATCHES)]))
    moved = (a.module.tied_modules["embed"].weight.detach() - initial).abs().max().item() if initial is not None \
        else None
    folder_a = save_and_convert(a, args.dir, "a")
    b = engine_of(args.schedule_b, args.zero_b)
    universal.load(b, folder_a)
    folder_b = save_and_convert(b, args.dir, "b")
    moves = [None] * dist.get_world_size()
    dist.all_gather_object(moves, moved)
    if dist.get_rank() == 0:
        state_a, state_b = read(folder_a), read(folder_b)
        differ = sorted(n for n in state_a if n not in state_b or
                        not all(same(state_a[n][k], state_b[n][k]) for k in KEYS))
        print(json.dumps({"compared": len(state_a), "differ": differ, "extra": sorted(set(state_b) - set(state_a)),
                          "tied_moved": max(m for m in moves if m is not None)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
