"""A user's own language model (not GPTlite) with its vocabulary head split over the pipeline ranks:
`python tests/vocab_parallel_probe.py SCHEDULE...`, run on p ranks by tests/test_vocab_parallel.py.

The model is written as a DeepSpeed user writes one: a LayerSpec list of torch.nn layers (an embedding,
blocks of plain nn.Linear, a LayerNorm) ending in p `VocabSlice`s laid out by `slice_layout` (uneven rows, all
but the last recomputing most of their logits in their backward), with
`schedules.vocab_parallel_loss` as its loss and `schedules.with_labels` micro-batches. The reference is
the same model unsplit, in one process: its head one nn.Linear holding the slices' initial rows, its loss
torch's cross-entropy over the whole vocabulary. After two plain-SGD steps rank 0 prints one JSON line per
schedule: the largest loss, validation-loss and weight differences (the slices merged into one head).
"""
import argparse
import json
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec

import schedules
from schedules.runtime.vocab_parallel import VocabSlice, merge_slices, slice_layout, vocab_parallel_loss, with_labels
from user_models import Block  # GELU(Linear(x)) + x: a plain nn.Linear in a user's own block

WIDTH, VOCAB, TOKENS, MICRO_BATCH, LR, SEED = 16, 37, 5, 2, 0.5, 1234  # 37 rows: slices of unequal size


def trunk_specs():
    return [LayerSpec(nn.Embedding, VOCAB, WIDTH)] + [LayerSpec(Block, WIDTH) for _ in range(4)] + \
        [LayerSpec(nn.LayerNorm, WIDTH)]


def layer_specs(parts):
    rows, recompute = slice_layout(VOCAB, parts)
    return trunk_specs() + [LayerSpec(VocabSlice, WIDTH, VOCAB, k, parts, recompute=recompute[k], rows=rows)
                            for k in range(parts)]


def batch(index):
    g = torch.Generator().manual_seed(100 + index)
    return (torch.randint(0, VOCAB, (MICRO_BATCH, TOKENS), generator=g),
            torch.randint(0, VOCAB, (MICRO_BATCH, TOKENS), generator=g))


def reference(parts, steps):
    """The unsplit model in one process, built with DeepSpeed's per-layer seeds: (losses, val loss, state)."""
    specs = layer_specs(parts)
    layers = []
    for i, spec in enumerate(specs):
        torch.manual_seed(SEED + i)
        layers.append(spec.build())
    trunk, slices = layers[:-parts], layers[-parts:]
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.cat([s.weight for s in slices]))
    model = nn.Sequential(*trunk, head)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in steps[:2]:
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(step)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    with torch.no_grad():
        val = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in steps[2]) / len(steps[2])
    state = {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(model) for k, v in layer.state_dict().items()}
    return losses, val, state


def run(name, p, steps):
    module = schedules.pipeline_module(name, layer_specs(p), num_stages=p, loss_fn=vocab_parallel_loss,
                                       partition_method="uniform", seed_layers=True, seed_fn=torch.manual_seed,
                                       base_seed=SEED)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": len(steps[0]),
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    params = [q for q in module.parameters() if q.requires_grad]
    engine, *_ = schedules.initialize(name, model=module, optimizer=torch.optim.SGD(params, lr=LR),
                                      model_parameters=params, config=cfg)
    def labelled(step):
        return iter([with_labels(x, y) for x, y in step])
    losses = [engine.train_batch(labelled(step)).item() for step in steps[:2]]
    val = engine.eval_batch(labelled(steps[2])).item()
    mine = {}
    for funcs, (start, _) in zip(module.chunk_funcs, module.chunk_bounds):
        for i, layer in enumerate(funcs):
            mine.update({f"{start + i}.{k}": v.detach().clone() for k, v in layer.state_dict().items()})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    state = merge_slices({k: v for part in gathered for k, v in part.items()}, len(trunk_specs()), p)
    ref_losses, ref_val, ref_state = reference(p, steps)
    _, _, initial = reference(p, [[], [], steps[2]])
    return {"schedule": name, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "val_loss_diff": abs(val - ref_val), "missing": sorted(set(state) ^ set(ref_state)),
            "weight_diff": max((state[k] - ref_state[k]).abs().max().item() for k in ref_state if k in state),
            "moved": max((ref_state[k] - initial[k]).abs().max().item() for k in ref_state)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("schedules", nargs="+")
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    p, m = dist.get_world_size(), args.micro_batches
    steps = [[batch(s * m + j) for j in range(m)] for s in range(3)]  # two to train, one to evaluate
    for name in args.schedules:
        result = run(name, p, steps)
        if result is not None:
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
