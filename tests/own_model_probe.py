"""One rank of examples/own_model.py's model (an embedding tied to the output head) trained with several
schedules, each against the same layers run one after the other in one process:
`python tests/own_model_probe.py M SCHEDULE... [--depth D]`, run by tests/test_own_model_example.py.

The process group is started by `deepspeed.init_distributed` itself, as a user's script would, not by
`schedules.init_distributed`: under LOCAL_SIZE (the deepspeed launcher's) DeepSpeed maps this rank's
shared-memory buffer, and `schedules.initialize` removes its name.

For each schedule: `schedules.pipeline_module` over the example's layers (seeded per layer), plain SGD, two
`train_batch` steps of M micro-batches, every warning recorded; then every rank's layers gathered on rank 0
and compared with the reference (tests/user_model_probe.py: same seeds, same micro-batches, the loss
averaged over them, SGD). The control, "1f1b-deepspeed-built", builds the module as DeepSpeed's own
PipelineModule constructor does, with autograd recording its broadcast of the tied weight. Rank 0 prints
one JSON line per run: the largest weight difference, the tied weight's difference and how far it moved,
and the c10d::broadcast_ warnings seen on any rank.
"""
import argparse
import importlib.util
import json
import os
import warnings
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from user_model_probe import LR, SEED, layer_state, module_chunks, train_reference

import schedules

ROOT = Path(__file__).resolve().parent.parent
MICRO_BATCH = 2
CONTROL = "1f1b-deepspeed-built"  # DeepSpeed's PipelineModule built under grad mode, trained with 1f1b


def example():
    spec = importlib.util.spec_from_file_location("own_model", ROOT / "examples" / "own_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shm_buffer():
    """This rank's DeepSpeed shared-memory buffer (csrc/cpu/comm/shm.cpp's name): whether it exists."""
    return os.path.exists(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
                          f"{os.environ['MASTER_PORT']}_{dist.get_rank()}")


def run(name, own, args, batches, p):
    common = dict(num_stages=p, loss_fn=own.loss_fn, partition_method="uniform", seed_layers=True,
                  seed_fn=torch.manual_seed, base_seed=SEED, activation_checkpoint_interval=1,
                  checkpointable_layers=["Block"])
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": args.micro_batches,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if name == CONTROL:
            module, schedule = PipelineModule(layers=own.layers(args.depth), **common), "1f1b"
        else:
            module, schedule = schedules.pipeline_module(name, own.layers(args.depth), **common), name
        params = [q for q in module.parameters() if q.requires_grad]
        engine, *_ = schedules.initialize(schedule, model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                          model_parameters=params, config=cfg)
        losses = [engine.train_batch(iter(step)).item() for step in batches]
    warned = sum("c10d::broadcast_" in str(w.message) for w in seen)
    mine = layer_state(module._layer_specs, module_chunks(module), module.tied_modules)
    mine = mine if engine.grid.get_data_parallel_rank() == 0 else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, warned))
    if dist.get_rank() != 0:
        return None
    state = {k: v for part, _ in gathered for k, v in part.items()}
    ref_losses, _, ref_state, _ = train_reference(module._layer_specs, own.loss_fn, batches, 0.0)
    _, _, initial, _ = train_reference(module._layer_specs, own.loss_fn, [], 0.0)
    tied = "tied.embed.weight"
    return {"schedule": name, "losses": losses, "missing": sorted(set(ref_state) ^ set(state)),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "weight_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state if k in state),
            "tied_diff": (state[tied] - ref_state[tied]).abs().max().item(),
            "tied_moved": (ref_state[tied] - initial[tied]).abs().max().item(),
            "broadcast_warnings": sum(w for _, w in gathered)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("micro_batches", type=int)
    parser.add_argument("schedules", nargs="+")
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))  # as a user's script does
    made = shm_buffer()
    own, p, m = example(), dist.get_world_size(), args.micro_batches
    data = own.micro_batches(MICRO_BATCH, seed=SEED)
    batches = [[next(data) for _ in range(m)] for _ in range(2)]
    for name in args.schedules:
        result = run(name, own, args, batches, p)
        if result is not None:
            print(json.dumps(result), flush=True)
    left = [None] * dist.get_world_size()
    dist.all_gather_object(left, (made, shm_buffer()))
    if dist.get_rank() == 0:
        print(json.dumps({"shm_made": [m for m, _ in left], "shm_left": [k for _, k in left]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
