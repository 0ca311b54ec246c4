"""The end of a training step, without work nobody needs: gradient reduction and clipping for our engines.

DeepSpeed's pipeline step ends with ReduceTiedGrads, ReduceGrads and OptimizerStep. Measured on
the deep benchmark model (2 ranks, one data-parallel replica), two of them cost more than the
optimizer itself (scripts/benchmark_peers.py; docs/benchmarks.md):

- ReduceGrads with one data-parallel rank flattens every gradient into one buffer, all-reduces it
  over a group of one rank and copies it back: an exact no-op, tens of milliseconds. Here it only
  does what it has to: give a trainable parameter without a gradient a zero one (DeepSpeed does,
  so that the optimizer steps it as before).
- Gradient clipping with ZeRO 0 (fp32) takes one Python norm per parameter, a tensor per step, and
  counts only the parameters of model-parallel rank 0, which in a pipeline grid is the first stage:
  every stage clips by the first stage's norm, not the model's. Here the norm is the whole model's, as the
  non-pipelined model and ZeRO 1 clip: fused per-tensor norms (one kernel per dtype), one
  all-reduce of a scalar over the pipeline group, each parameter counted once (DualPipe's second
  copies and tied copies are marked `ds_pipe_replicated`), and no scaling at all when the
  coefficient is 1.

- The loss: DeepSpeed broadcasts it from the last stage after the optimizer step, so every stage
  waits there for the last one to finish its step. Here the last stage sends its replica's loss as
  soon as its last forward of the step has computed it, to receives the other stages posted when
  the step began; at the end of the step it has arrived. With several data-parallel replicas
  (fp32 or bf16), each stage then averages it over its own data-parallel group, the ranks of the same
  stage, which the gradient reduction has just brought together anyway: the same sum, in the same order
  and the loss's own dtype, as DeepSpeed's average over the last stages. Same values, same place
  (`train_batch`'s return value on every stage).

The step itself (clipping, and skipping a step whose global gradient norm is not finite, on every
stage) is interlock.py's (step_targets.py: at ZeRO 0 in fp32, and with DeepSpeed's BF16 and ZeRO-1
optimizers): validated at once when steps are synchronised, later when they are interlocked.

Everything else (the gradient reduction at ZeRO 1, in bf16 or with several replicas, fp16, MoE, additional
losses) goes through DeepSpeed unchanged.
"""
import torch
from deepspeed import comm as dist


def needs_no_reduction(engine):
    """True when ReduceGrads has nothing to do but create missing gradients (ZeRO 0, fp32 or fp16
    without DeepSpeed's BF16 optimizer, one data-parallel rank, no experts)."""
    return (engine.zero_optimization_stage() == 0 and not engine.using_bf16_optimizer
            and engine.dp_world_size == 1 and not engine.has_moe_layers)


def zero0_fp32(engine):
    """ZeRO 0 in fp32: the gradients and the optimizer step are plain torch ones, with no ZeRO, fp16 or BF16
    optimizer of DeepSpeed's hooking or reading them, so our engines may take them over."""
    return (engine.zero_optimization_stage() == 0 and not engine.using_bf16_optimizer
            and not engine.fp16_enabled() and not engine.bfloat16_enabled())


def accumulates_in_place(engine):
    """True when weight gradients may be added into `.grad` by their own multiply (weight_grad.accumulate_in_place):
    ZeRO 0 in fp32 and no hook on any parameter."""
    return zero0_fp32(engine) and not any(p._backward_hooks or getattr(p, '_post_accumulate_grad_hooks', None)
                                          for p in engine.module.parameters())


def zero_missing_grads(module):
    """What DeepSpeed's reduction does before reducing: a zero gradient for each trainable parameter that has none."""
    for p in module.parameters():
        if p.requires_grad and p.numel() and p.grad is None:
            p.grad = torch.zeros_like(p)


def squared_grad_norm(params):
    """The squared 2-norm of the gradients of `params` on this rank, each parameter counted once (a float32
    scalar tensor): fused per-tensor norms, one kernel per dtype."""
    counted = [p.grad for p in params if p.grad is not None and not getattr(p, 'ds_pipe_replicated', False)]
    by_dtype = {}
    for g in counted:
        by_dtype.setdefault(g.dtype, []).append(g)
    squares = torch.zeros((), dtype=torch.float32, device=counted[0].device if counted else None)
    for grads in by_dtype.values():
        squares += torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
    return squares


def global_grad_norm(params, group):
    """The 2-norm of the gradients of `params` on every rank of `group` (each parameter counted once)."""
    squares = squared_grad_norm(params)
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(squares, group=group)
    return squares.sqrt()


def clip_coefficient(max_norm, norm):
    """DeepSpeed's clipping coefficient for a gradient norm: max_norm / (norm + 1e-6); at or above 1, no clipping."""
    return max_norm / (float(norm) + 1e-6)


def clip_grads_(params, max_norm, group):
    """Scale the gradients of `params` so that their global norm is at most `max_norm` (`clip_coefficient`,
    at most 1). Returns the norm."""
    norm = global_grad_norm(params, group)
    coef = clip_coefficient(max_norm, norm)
    if not coef >= 1.0:  # a NaN norm scales too, as DeepSpeed's does
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
    return norm


LOSS_TAG = 0x1055  # the early loss messages' tag: apart from the activations and gradients between the same ranks
LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a loss's dtype, sent as its index


class LeanStep:
    """Mixin for a PipelineEngine subclass: ReduceGrads, the fp32 clipping and the loss above. Map
    `ds.ReduceGrads` to `_exec_reduce_grads` in the engine's `_INSTRUCTION_MAP`; call `_loss_step_start()`
    when a step's instructions start and `_loss_forward_done()` after each forward of the loss stage."""

    _early_loss = None  # this step: ([works], losses), the loss being received or sent, or None

    def _loss_shared_early(self):
        # several replicas: fp32 and bf16, where the average below is DeepSpeed's to the bit (fp16: untested here)
        return (self.is_pipe_parallel and self.module.training and self.module.get_additional_losses() is None
                and (self.dp_world_size == 1 or not self.fp16_enabled()))

    def _loss_step_start(self):
        self._early_loss, self._loss_forwards = None, 0
        if not self._loss_shared_early():
            return
        src = self._loss_stage_global_rank()
        if self.global_rank != src:
            buffer = torch.zeros(3, device=self.device)
            self._early_loss = ([dist.irecv(buffer, src, group=self.grid.get_pipe_parallel_group(), tag=LOSS_TAG)],
                                buffer)

    def _loss_forward_done(self):
        """After a training forward on the loss stage: once the step's last one is done, send the loss."""
        self._loss_forwards += 1
        if self._loss_forwards != self.micro_batches or not self._loss_shared_early():
            return
        loss = self._scale_loss_by_gas(self.total_loss).detach()
        # (this replica's loss, the average, the loss's dtype: the average over replicas is taken in it)
        losses = torch.stack([loss.float(), loss.float(), torch.tensor(float(LOSS_DTYPES.index(loss.dtype)),
                                                                       device=loss.device)])
        group = self.grid.get_pipe_parallel_group()
        works = [dist.isend(losses, rank, group=group, tag=LOSS_TAG)
                 for rank in self.grid.pp_group if rank != self.global_rank]
        self._early_loss = (works, losses)

    def _aggregate_total_loss(self):
        if self._early_loss is None:
            return super()._aggregate_total_loss()
        works, losses = self._early_loss
        self._early_loss = None
        for work in works:
            work.wait()
        if self.is_last_stage():
            self.agg_additional_losses = None
        self.dp_group_loss = losses[0].clone()
        average = losses[1].clone()
        if self.is_data_parallel:  # in the loss's own dtype, as DeepSpeed's last stages average it
            average = average.to(LOSS_DTYPES[int(losses[2])])
            dist.all_reduce(average, group=self.mpu.get_data_parallel_group())
            average /= self.dp_world_size
        return average.float()

    def _exec_reduce_grads(self):
        if not needs_no_reduction(self):
            return super()._exec_reduce_grads()
        zero_missing_grads(self.module)

    def clip_fp32_gradients(self):
        # called by DeepSpeed's _take_model_step for ZeRO 0 without fp16 / bf16 only
        self._global_grad_norm = clip_grads_(list(self.module.parameters()), self.gradient_clipping(),
                                             self.grid.get_pipe_parallel_group())
