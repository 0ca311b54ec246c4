"""One rank of a user's model (tests/user_models.py) trained with several schedules, each against a plain
single-process reference: `python tests/user_model_probe.py MODEL M SCHEDULE... [--clip C]`, run by
tests/test_user_models.py through local_launch on p ranks.

For each schedule, in one process group: `schedules.pipeline_module(...)` over the model's layer list,
`schedules.initialize(...)` with plain SGD, two `train_batch` steps of M micro-batches; then every rank's
layers are gathered on rank 0 and compared with the same layers run one after the other in one process
(same seeds, same micro-batches, the loss averaged over them, SGD, clipping over each parameter once).
Then one `eval_batch` on the trained weights, against the reference's forward. Rank 0 prints one JSON line
per schedule: the largest loss and weight differences, and on every rank the share of the deferrable
layers' weight gradients that W passes computed.
"""
import argparse
import functools
import json
import os
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.pipe import LayerSpec, TiedLayerSpec

import schedules
from schedules.runtime import weight_grad
from schedules.runtime.moe import scale_aux_losses
from user_models import MICRO_BATCH, MODELS

LR, SEED = 0.5, 1234


def module_chunks(module, copies=False):
    """[(layer functions, first global layer index)] of the layers this rank trains (one copy of each, or
    with `copies` DualPipe's second copy too)."""
    if hasattr(module, "chunk_funcs"):
        placement = module.placement
        return [(funcs, start) for c, (funcs, (start, _)) in enumerate(zip(module.chunk_funcs, module.chunk_bounds))
                if copies or placement.direction(c) != 1]
    if hasattr(module, "phase_funcs"):  # DeepSpeed's DualPipeVModule
        return [(funcs, start) for funcs, (start, _) in zip(module.phase_funcs, module.phase_bounds)]
    return [(module.forward_funcs, module._local_start)]


def layer_state(specs, chunks, tied_modules):
    """{"<layer index>.<name>" or "tied.<key>.<name>": tensor} of the given layers."""
    state = {}
    for funcs, start in chunks:
        for i, f in enumerate(funcs):
            spec = specs[start + i]
            if isinstance(spec, TiedLayerSpec):
                key, layer = f"tied.{spec.key}", tied_modules[spec.key]
            elif isinstance(f, nn.Module):
                key, layer = str(start + i), f
            else:
                continue
            state.update({f"{key}.{n}": t.detach().cpu().clone() for n, t in layer.state_dict().items()})
    return state


def reference(specs):
    """The layer list built in one process with DeepSpeed's per-layer seeds: (functions, tied modules)."""
    funcs, tied = [], {}
    for i, spec in enumerate(specs):
        torch.manual_seed(SEED + i)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            module = tied[spec.key]
            funcs.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
        elif isinstance(spec, LayerSpec):
            funcs.append(spec.build())
        else:
            funcs.append(spec)
    return funcs, tied


def forward(funcs, x):
    for f in funcs:
        x = f(x)
    return x


def train_reference(specs, loss_fn, batches, clip):
    funcs, tied = reference(specs)
    modules = [f for f in funcs if isinstance(f, nn.Module)] + list(tied.values())
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=LR)
    losses, norms = [], []
    for module in modules:  # the aux loss of expert layers, as the engine scales it: averaged over micro-batches
        scale_aux_losses(module, 1.0 / len(batches[0]) if batches else 1.0)
    for step in batches[:2]:
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            loss = loss_fn(forward(funcs, x), y) / len(step)
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")).item())
        opt.step()
        losses.append(total)
    val = None
    if len(batches) > 2:  # the evaluation step: the mean loss of its micro-batches, forward only
        with torch.no_grad():
            val = sum(loss_fn(forward(funcs, x), y).item() for x, y in batches[2]) / len(batches[2])
    return losses, norms, layer_state(specs, [(funcs, 0)], tied), val


def build(name, args, p):
    """The user's layers as the PipelineModule `name` needs, and its engine (plain SGD)."""
    layers, loss_fn, _, options = MODELS[args.model]
    checkpointing = dict(activation_checkpoint_interval=args.checkpoint, checkpointable_layers=["Block"])
    module = schedules.pipeline_module(name, layers(), num_stages=p, loss_fn=loss_fn, partition_method="uniform",
                                       seed_layers=True, seed_fn=torch.manual_seed, base_seed=SEED, **checkpointing,
                                       **options)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": args.micro_batches,
           "gradient_clipping": args.clip, "zero_optimization": {"stage": args.zero},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    params = [q for q in module.parameters() if q.requires_grad]
    optimizer = torch.optim.SGD(schedules.moe_param_groups(params), lr=LR)  # experts apart, as DeepSpeed wants
    engine, *_ = schedules.initialize(name, model=module, optimizer=optimizer,
                                      model_parameters=params, config=cfg)
    return module, engine


def reloaded(name, args, p, engine):
    """Save `engine`'s checkpoint, load it into a freshly built one: every copy of every layer it holds."""
    folder = os.path.join(args.save, name)
    engine.save_checkpoint(folder, tag="t")
    module, fresh = build(name, args, p)
    fresh.load_checkpoint(folder, tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)
    return [kv for kv in layer_state(module._layer_specs, module_chunks(module, copies=True),
                                     module.tied_modules).items()]


def run(name, args, batches, p):
    loss_fn = MODELS[args.model][1]
    module, engine = build(name, args, p)
    checkpointed = []  # one entry per checkpointed group that ran
    inner = engine.module.activation_checkpoint_func
    engine.module.activation_checkpoint_func = lambda *a, **k: checkpointed.append(1) or inner(*a, **k)
    before = dict(weight_grad.counts)
    losses = [engine.train_batch(iter(step)).item() for step in batches[:2]]
    val_loss = engine.eval_batch(iter(batches[2])).item()  # forward only, on the trained weights
    deferred = weight_grad.counts["deferred"] - before.get("deferred", 0)
    immediate = weight_grad.counts["immediate"] - before.get("immediate", 0)
    share = deferred / (deferred + immediate) if deferred + immediate else None
    mine = layer_state(module._layer_specs, module_chunks(module), module.tied_modules)
    mine = mine if engine.grid.get_data_parallel_rank() == 0 else {}
    reload = reloaded(name, args, p, engine) if args.save else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, share, len(checkpointed), reload))
    if dist.get_rank() != 0:
        return None
    state = {k: v for part, *_ in gathered for k, v in part.items()}
    reload = [kv for *_, part in gathered for kv in part]
    ref_losses, norms, ref_state, ref_val = train_reference(module._layer_specs, loss_fn, batches, args.clip)
    _, _, initial, _ = train_reference(module._layer_specs, loss_fn, [], args.clip)
    missing = sorted(set(ref_state) ^ set(state))
    weight_diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state if k in state)
    return {"schedule": name, "losses": losses, "val_loss_diff": abs(val_loss - ref_val),
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "weight_diff": weight_diff, "missing": missing, "shares": [s for _, s, *_ in gathered],
            "checkpointed": [n for _, _, n, _ in gathered],
            "reload_diff": max(((v - state[k]).abs().max().item() for k, v in reload), default=None),
            "reloaded": sorted({k for k, _ in reload}) == sorted(state) if args.save else None,
            "moved": max((ref_state[k] - initial[k]).abs().max().item() for k in ref_state), "grad_norms": norms}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("micro_batches", type=int)
    parser.add_argument("schedules", nargs="+")
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage (0 or 1)")
    parser.add_argument("--checkpoint", type=int, default=0, help="activation checkpoint interval (Block layers)")
    parser.add_argument("--save", default=None, help="save each schedule's checkpoint here and load it back")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    p, m = dist.get_world_size(), args.micro_batches
    batch = MODELS[args.model][2]
    batches = [[batch(step * m + j) for j in range(m)] for step in range(3)]  # two to train, one to evaluate
    for name in args.schedules:
        result = run(name, args, batches, p)
        if result is not None:
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
