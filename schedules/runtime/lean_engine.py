"""DeepSpeed's engine for a model that is not pipelined, with our engines' lean step end where it is exact.

`train.py` without a pipeline (and `schedules.initialize` for any model that is not a PipelineModule) runs
forward / `engine.backward` / `engine.step` over the micro-batches on DeepSpeed's own DeepSpeedEngine. With one
data-parallel rank in fp32 that engine does work nobody needs, as its pipeline engine does (lean_step.py): at
ZeRO 1, the shipped config, its optimizer's gradient hooks copy every gradient into a reduction bucket at every
micro-batch, its reduction hands them to the step unchanged after more copies, and its step copies the fp32
master partition into the weights. On GPT-2 small's shape at context 64 (one process, one thread, 4 micro-batches
of 1 sequence) DeepSpeed's engine took 8.8 s a step, 5.9 s at ZeRO 0, and this one 4.0 s
(scripts/benchmark_one_process.py; docs/benchmarks.md).

`LeanEngine` is that engine, doing here what our pipeline engines do at one data-parallel rank in fp32:

- ZeRO 1 (`lean_step.zero1_one_replica`): the optimizer's hooks go, its master partition becomes the weights'
  storage, the reduction hands the step each parameter's gradient as DeepSpeed's would (`zero1_gradients`), and
  the step is step_targets.ZeroStep (DeepSpeed's ZeRO-1 step, with the clipping and the skip of a step whose
  norm is not finite, to the bit), from a flat gradient buffer that in-place accumulation writes into.
- ZeRO 0 (`lean_step.needs_no_reduction`): no reduction over one rank; clipping by fused per-tensor norms.
- Both, and ZeRO 0 with several data-parallel ranks (`lean_step.accumulates_in_place`): deferrable layers
  (weight_grad.py; `make_deferrable` gives every plain nn.Linear and nn.Embedding their forward) add their weight
  gradients into `.grad` by their own multiply, into the last step's gradient tensors.

Everything else (bf16, fp16, ZeRO 2 and 3, several data-parallel ranks at ZeRO 1, offload, experts) is
DeepSpeed's engine unchanged. The same gradients as DeepSpeed's engine up to the order of a sum's terms
(tests/test_lean_engine.py), the same checkpoints.
"""
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine

from schedules.runtime.lean_step import (
    accumulates_in_place,
    clip_grads_,
    needs_no_reduction,
    release_zero1_hooks,
    share_master_weights,
    step_lr_scheduler,
    zero1_gradients,
    zero1_one_replica,
    zero_missing_grads,
)
from schedules.runtime.step_targets import ZeroStep
from schedules.runtime.weight_grad import accumulate_in_place, make_deferrable, spare_grads


class LeanEngine(DeepSpeedEngine):
    """DeepSpeedEngine with lean_step.py's step end at one data-parallel rank in fp32 (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.using_bf16_optimizer = type(self.optimizer) is BF16_Optimizer  # as PipelineEngine has it (lean_step)
        self._zero1_step = None  # step_targets.ZeroStep where ZeRO 1's step is ours (one replica, fp32)
        if zero1_one_replica(self) and self.managed_gradient_accumulation():
            release_zero1_hooks(self.optimizer)
            share_master_weights(self.optimizer)
            self._zero1_step = ZeroStep(self)
        self._no_reduction = needs_no_reduction(self)  # (ZeRO 0 only)
        self._in_place = accumulates_in_place(self)  # (ZeRO 1: its hooks released above)
        if self._in_place:
            make_deferrable(self.module)

    def backward(self, loss, *args, **kwargs):
        with accumulate_in_place(self._in_place):
            return super().backward(loss, *args, **kwargs)

    def allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE):
        if self._zero1_step is None and not self._no_reduction:
            return super().allreduce_gradients(bucket_size)
        if not self.is_gradient_accumulation_boundary():
            return
        if self._zero1_step is not None:
            zero1_gradients(self.optimizer)  # what DeepSpeed's reduction over one rank hands its step
        else:
            zero_missing_grads(self.module)  # what DeepSpeed's does before reducing

    def clip_fp32_gradients(self):
        # ZeRO 0 in fp32 (DeepSpeed's _take_model_step calls it there only): the model's norm by fused norms,
        # where DeepSpeed's takes one Python norm per parameter
        self._global_grad_norm = clip_grads_(list(self.module.parameters()), self.gradient_clipping(), None)

    def zero_grad(self):
        # after a step: with in-place accumulation, the next step writes its first gradients into these tensors
        if not self._in_place:
            return super().zero_grad()
        spare_grads(self.module.parameters())

    def _take_model_step(self, lr_kwargs):
        if self._zero1_step is None:
            return super()._take_model_step(lr_kwargs)
        # DeepSpeed's _take_model_step around its ZeRO-1 optimizer's step: step (skipped where the norm is not
        # finite, DeepSpeed's overflow), release the gradients, then the learning rate and the counters
        target = self._zero1_step
        squares = target.local_squares()
        self._global_grad_norm = target.norm(squares)
        self._step_applied = bool(torch.isfinite(squares).all())
        if self._step_applied:
            target.step(squares)
        target.clear()
        if not self._step_applied:
            self.skipped_steps += 1
        else:
            step_lr_scheduler(self, lr_kwargs)
        if self.steps_per_print() is not None and self.global_rank == 0 and \
                (self.global_steps + 1) % self.steps_per_print() == 0:
            self._report_progress(self.global_steps + 1)
        self.losses = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
