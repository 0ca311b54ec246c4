"""Your own model, any schedule: a small language model written with plain torch.nn layers (not GPTlite),
as a DeepSpeed PipelineModule layer list, trained with the schedule you name.

    deepspeed --num_gpus 2 examples/own_model.py --schedule zb-v      # on CPU: 2 ranks over gloo
    torchrun --nproc_per_node 4 examples/own_model.py --schedule dualpipe --micro-batches 8

What it shows: `schedules.init_distributed` starts the process group (gloo on CPU, nccl on GPUs), leaving
none of DeepSpeed's CPU shared-memory buffers in /dev/shm; `schedules.pipeline_module` builds the
PipelineModule the schedule needs from an ordinary layer list (LayerSpecs, a TiedLayerSpec embedding reused
as the output head, activation checkpointing by class name); `schedules.initialize` builds the engine and
makes the plain nn.Linear layers' weight gradients deferrable to W passes (no change to the model);
`engine.train_batch` trains. The task is learnable on purpose: each sequence counts up by a step of its own,
so the loss falls within a few steps.
"""
import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

import schedules
from schedules.registry import SCHEDULES

VOCAB, WIDTH, TOKENS = 64, 64, 16


class Block(nn.Module):
    """A pre-norm MLP block with a residual: plain nn.Linear layers, nothing pipeline-specific."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def output_head(embedding, x):
    return x @ embedding.weight.t()  # the input embedding, reused as the output projection


def layers(depth):
    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH)]
            + [LayerSpec(Block, WIDTH) for _ in range(depth)]
            + [LayerSpec(nn.LayerNorm, WIDTH), TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH,
                                                               forward_fn=output_head)])


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def micro_batches(size, seed=0):
    """Endless (tokens, next tokens): sequences start anywhere and count up by a step of their own."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        step = torch.randint(1, 4, (size, 1), generator=g)
        seq = (start + step * torch.arange(TOKENS + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zb-v", help="any of: " + ", ".join(SCHEDULES))
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--depth", type=int, default=8, help="blocks")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args()

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # ranks share the cores
    schedules.init_distributed()  # deepspeed.init_distributed, leaving nothing in /dev/shm
    stages = int(os.environ["WORLD_SIZE"])
    model = schedules.pipeline_module(args.schedule, layers(args.depth), num_stages=stages, loss_fn=loss_fn,
                                      partition_method="uniform", activation_checkpoint_interval=1,
                                      checkpointable_layers=["Block"])
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": args.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = schedules.initialize(args.schedule, model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    data = micro_batches(config["train_micro_batch_size_per_gpu"])
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(data)
        if torch.distributed.get_rank() == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
