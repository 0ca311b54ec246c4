"""One rank of a 2-stage GPTlite pipeline run by the SplitBackwardEngine, recording what it executes.

Run by tests/test_split_engine.py through local_launch. Checks, on every rank, after one
train_batch with SCHEDULE (argv[1]):
- the executed order of compute passes equals the order in the schedule's instruction stream;
- after the first B, the linear and embedding layers' weights and biases have no gradient yet (deferred) while
  the other parameters (LayerNorm) have theirs; after the first W they all do.
Prints one JSON line with what it saw.
"""
import json
import sys
from datetime import timedelta

import deepspeed
import torch
from deepspeed.runtime.pipe import schedule as ds

import gptlite
import schedules
from schedules.instructions import PASS_KIND, BackwardInputPass, BackwardWeightPass
from schedules.registry import available_schedules, register_schedule
from schedules.runtime import engine_class
from schedules.runtime.weight_grad import Embedding, Linear


def main(schedule):
    spec = available_schedules()[schedule]
    base = engine_class(spec)

    class Recording(base):
        def _exec_schedule(self, pipe_schedule):
            self.executed, self.after_first = [], {}
            super()._exec_schedule(pipe_schedule)

        def _linear_and_other_grads(self):
            linear = [p for m in self.module.modules() if isinstance(m, (Linear, Embedding)) for p in m.parameters()]
            ids = {id(p) for p in linear}
            other = [p for p in self.module.parameters() if id(p) not in ids]
            return [p.grad is not None for p in linear], [p.grad is not None for p in other]

        def _exec_forward_pass(self, buffer_id):
            self.executed.append(("F", buffer_id))
            super()._exec_forward_pass(buffer_id)

        def _exec_backward_input_pass(self, buffer_id):
            self.executed.append(("B", buffer_id))
            super()._exec_backward_input_pass(buffer_id)
            self.after_first.setdefault("B", self._linear_and_other_grads())

        def _exec_backward_weight_pass(self, buffer_id):
            self.executed.append(("W", buffer_id))
            super()._exec_backward_weight_pass(buffer_id)
            self.after_first.setdefault("W", self._linear_and_other_grads())

        _INSTRUCTION_MAP = {**base._INSTRUCTION_MAP, ds.ForwardPass: _exec_forward_pass,
                            BackwardInputPass: _exec_backward_input_pass,
                            BackwardWeightPass: _exec_backward_weight_pass}

    register_schedule("probe", spec.factory, spec.placement, engine=Recording)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    model = gptlite.get_model(pipeline_num_stages=2, model_size="tiny")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = schedules.initialize("probe", model=model, model_parameters=list(model.parameters()), config=cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 50257, (2, 32), generator=g), torch.randint(0, 50257, (2, 32), generator=g))
               for _ in range(4)]
    engine.train_batch(iter(batches))
    stream = [(PASS_KIND[type(c)], c.buffer_id) for step in spec.factory(4, 2, engine.stage_id).steps() for c in step
              if type(c) in PASS_KIND]
    print(json.dumps({"stage": engine.stage_id, "executed": engine.executed, "stream": stream,
                      "after_first_b": engine.after_first["B"], "after_first_w": engine.after_first["W"]}))
    torch.distributed.barrier()  # neither rank tears gloo down while the other still talks
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
