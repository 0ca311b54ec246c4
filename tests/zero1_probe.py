"""One rank of a 2-stage GPTlite pipeline (zb-h1) at ZeRO 1 in fp32 with one data-parallel rank: the shipped config's
optimizer (DeepSpeed's ZeRO-1, torch's fused AdamW), clipping at argv[1] (0.05 bites), trained three steps three ways
from the same weights and micro-batches:

- `lean`: as our engines run it (lean_step.zero1_one_replica): ReduceGrads hands the optimizer its gradients, its
  gradient hooks removed, weight gradients accumulated in place, the weights views of its fp32 master partition;
- `lean-not-in-place`: the same hand-over, weight gradients handed to autograd as DeepSpeed's path has them;
- `deepspeed`: DeepSpeed's own ZeRO-1 reduction (its hooks, buckets, the all-reduce over one rank).

Run by tests/test_lean_step.py through local_launch. Prints one JSON line per rank: whether each engine took the
lean path, accumulated in place, kept DeepSpeed's hooks and holds its weights in the master partition; each engine's
losses; and, against `deepspeed`, whether the fp32 master partition (the weights) and the optimizer's moments are
equal bit for bit, and their largest difference.
"""
import json
import sys
from datetime import timedelta

import deepspeed
import torch

import gptlite
import schedules
from schedules.runtime import lean_step, split_engine

MODES = ("deepspeed", "lean-not-in-place", "lean")
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 0.05,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                    "torch_adam": True, "fused": True}},
          "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def build(mode, clip):
    real_lean, real_in_place = lean_step.zero1_one_replica, split_engine.accumulates_in_place
    if mode == "deepspeed":
        lean_step.zero1_one_replica = lambda engine: False
    if mode == "lean-not-in-place":
        split_engine.accumulates_in_place = lambda engine: False
    try:
        model = gptlite.get_model(pipeline_num_stages=2, model_size="tiny", seed=3,
                                  pipe_module=schedules.pipe_module("zb-h1"))
        engine, *_ = schedules.initialize("zb-h1", model=model, model_parameters=list(model.parameters()),
                                          config=dict(CONFIG, gradient_clipping=clip))
    finally:
        lean_step.zero1_one_replica, split_engine.accumulates_in_place = real_lean, real_in_place
    return engine


def state(engine):
    """(the fp32 master partitions, every tensor of the optimizer's state), flattened."""
    opt = engine.optimizer
    master = torch.cat([p.detach().reshape(-1) for p in opt.single_partition_of_fp32_groups])
    moments = torch.cat([v.reshape(-1).float() for p in opt.single_partition_of_fp32_groups
                         for k, v in sorted(opt.optimizer.state[p].items()) if torch.is_tensor(v)])
    return master, moments


def main(clip):
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    steps = [[(torch.randint(0, 50257, (2, 32), generator=g), torch.randint(0, 50257, (2, 32), generator=g))
              for _ in range(4)] for _ in range(3)]
    seen = {}
    for mode in MODES:
        engine = build(mode, clip)
        losses = [engine.train_batch(iter(batches)).item() for batches in steps]
        seen[mode] = {"lean": engine._lean_zero1(), "in_place": engine._in_place,
                      "weights_are_master": lean_step.master_is_weights(engine.optimizer),
                      "hooks": len(engine.optimizer._grad_acc_hooks), "losses": losses,
                      "norm": float(engine.get_global_grad_norm()), "state": state(engine)}
    reference = seen["deepspeed"]["state"]
    out = {"stage": engine.stage_id}
    for mode, s in seen.items():
        master, moments = s.pop("state")
        s["master_equal"] = torch.equal(master, reference[0])
        s["moments_equal"] = torch.equal(moments, reference[1])
        s["master_diff"] = (master - reference[0]).abs().max().item()
        out[mode] = s
    print(json.dumps(out))
    torch.distributed.barrier()  # neither rank tears gloo down while the other still talks
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(float(sys.argv[1]))
