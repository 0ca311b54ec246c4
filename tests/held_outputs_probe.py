"""One rank of 2-stage GPTlite pipelines, one engine per schedule named in argv: after a train_batch, how many
forward outputs (on the last stage, the logits) each engine's pipe buffers still hold.

Run by tests/test_split_engine.py through local_launch. Prints one JSON line: {schedule: {"last_stage": whether
this rank runs the engine's last stage, "held": how many outputs its buffers still reference}}.
"""
import json
import sys
from datetime import timedelta

import deepspeed
import torch

import gptlite
import schedules


def held(engine):
    """The forward outputs an engine's pipe buffers still reference (DeepSpeed's 'outputs' buffers)."""
    return sum(out is not None for out in engine.pipe_buffers['outputs'])


def main(names):
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 50257, (2, 32), generator=g), torch.randint(0, 50257, (2, 32), generator=g))
               for _ in range(4)]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    seen = {}
    for name in names:
        model = gptlite.get_model(pipeline_num_stages=2, model_size="tiny", pipeline_spec_layers=True,
                                  pipe_module=schedules.pipe_module(name))
        engine, *_ = schedules.initialize(name, model=model, model_parameters=list(model.parameters()), config=cfg)
        engine.train_batch(iter(batches))
        seen[name] = {"last_stage": engine.is_last_stage(), "held": held(engine)}
    print(json.dumps(seen))
    torch.distributed.barrier()  # neither rank tears gloo down while the other still talks
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
