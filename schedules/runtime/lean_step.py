"""The end of a training step, without work nobody needs: gradient reduction and clipping for our engines.

DeepSpeed's pipeline step ends with ReduceTiedGrads, ReduceGrads and OptimizerStep. Measured on
the deep benchmark model (2 ranks, one data-parallel replica), two of them cost more than the
optimizer itself (scripts/benchmark_peers.py; docs/benchmarks.md):

- ReduceGrads with one data-parallel rank flattens every gradient into one buffer, all-reduces it
  over a group of one rank and copies it back: an exact no-op, tens of milliseconds. Here it only
  does what it has to: give a trainable parameter without a gradient a zero one (DeepSpeed does,
  so that the optimizer steps it as before).
- The same at ZeRO 1 (the shipped config) with one data-parallel rank, in fp32 (`zero1_one_replica`):
  DeepSpeed's ZeRO-1 optimizer has one partition then, the whole stage, and its reduction (a bucket of
  5e8 elements per gradient hook, copies into it and into a contiguous buffer, an all-reduce over one
  rank, a division by 1) hands its step each parameter's gradient unchanged. Here ReduceGrads hands them
  over directly, as its own epilogue lists them (`zero1_gradients`), and the optimizer's per-parameter
  gradient hooks, which only prepare that reduction, are removed (`release_zero1_hooks`), so that the
  weight gradients accumulate in place as at ZeRO 0. Its fp32 master partition, equal to the weights at all
  times, becomes their storage (`share_master_weights`): the step updates them in place, with no copy
  after it and no second copy of the weights. The optimizer is DeepSpeed's, whole: its master partition and
  its state are what steps and what checkpoints hold; its step is step_targets.py's ZeroStep, DeepSpeed's
  to the bit.
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

Everything else (the gradient reduction in bf16 or with several replicas, fp16, MoE, additional losses, ZeRO 1
with offload or an overlapped reduction) goes through DeepSpeed unchanged.
"""
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


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


def plain_zero1(engine):
    """DeepSpeed's ZeRO optimizer at stage 1 in fp32 with nothing that changes its step: no loss scale, offload,
    Muon, experts, ZenFlow (step_targets.ZeroStep steps it, DeepSpeed's step to the bit)."""
    opt = engine.optimizer
    return (type(opt) is DeepSpeedZeroOptimizer and engine.zero_optimization_stage() == 1
            and opt.dtype == torch.float32 and not opt.cpu_offload and not opt.partition_gradients
            and opt.compute_grad_norm and opt.loss_scale == 1.0 and not opt.has_moe_layers
            and not getattr(opt, 'zenflow', False) and not getattr(opt, 'torch_autocast_gradscaler', None)
            and not any(opt._use_compact_grad_partition_buffer(i) or opt._muon_update_lacks_loss_scale(i)
                        for i in range(len(opt.bit16_groups))))


def zero1_one_replica(engine):
    """ZeRO 1 in fp32 with one data-parallel rank (`plain_zero1`, its gradients accumulated in the weights' dtype,
    no reduction overlapped with the backward): the optimizer's one partition is the whole stage, and its
    reduction hands the step each parameter's gradient unchanged, so our engines hand them over themselves
    (`zero1_gradients`) and accumulate them in place."""
    opt = engine.optimizer
    return (plain_zero1(engine) and engine.dp_world_size == 1 and not engine.has_moe_layers
            and not opt.overlap_comm and not opt.use_grad_accum_attribute
            and 'muon' not in type(opt.optimizer).__name__.lower())


def release_zero1_hooks(opt):
    """Remove the per-parameter gradient hooks of DeepSpeed's ZeRO-1 optimizer (`zero1_one_replica`): at stage 1
    without an overlapped reduction they only prepare the reduction's bucket (a 5e8-element buffer per call),
    which `zero1_gradients` does without."""
    for handle in opt._grad_acc_hooks:
        handle.remove()
    opt._grad_acc_hooks.clear()


def share_master_weights(opt):
    """Make the weights of each group views of the optimizer's fp32 master partition (`zero1_one_replica`): with
    one data-parallel rank in fp32 that partition is the whole group (padding included) and equal to the weights
    at all times (DeepSpeed's step copies it into them), so the step updates them in place, and neither a copy
    per step nor a second copy of the weights is kept. The master and its state (what steps, what checkpoints
    hold, what the parameters' fp32 mappings point into) stay the optimizer's; the old flat weights are freed."""
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        flat = opt.bit16_groups_flat[i]
        if (master.shape != flat.shape or master.dtype != flat.dtype or master.device != flat.device
                or not torch.equal(master, flat)):
            continue  # (not one partition of fp32 weights: left as DeepSpeed keeps it)
        opt.bit16_groups_flat[i] = master.detach()
        opt.parallel_partitioned_bit16_groups[i] = opt.get_data_parallel_partitions(opt.bit16_groups_flat[i], i)
        opt._update_model_bit16_weights(i)


def master_is_weights(opt):
    """Whether every group's weights are views of its fp32 master partition (`share_master_weights`): its step
    has nothing to copy into them."""
    return all(flat.data_ptr() == master.data_ptr() and flat.numel() == master.numel()
               for flat, master in zip(opt.bit16_groups_flat, opt.single_partition_of_fp32_groups))


def zero1_gradients(opt):
    """What DeepSpeed's ZeRO-1 reduction (0.19.8) hands its step with one data-parallel rank, without the
    reduction: per group, `averaged_gradients`, listed by its own epilogue (`get_flat_partition`) from each
    parameter's gradient (zeros for one without, the partition's padding)."""
    device = get_accelerator().current_device_name()
    for i in range(len(opt.bit16_groups)):
        params = opt.params_in_partition[i]
        opt.all_grad_tensors[i] = opt.get_all_grad_tensors(params, dtype=opt.gradient_accumulation_dtype)
        opt.averaged_gradients[i] = opt.get_flat_partition(params, opt.first_offset[i], opt.partition_size[i],
                                                           dtype=opt.gradient_accumulation_dtype, device=device,
                                                           param_group_idx=i, return_tensor_list=True)
        opt.all_grad_tensors[i] = None


def accumulates_in_place(engine):
    """True when weight gradients may be added into `.grad` by their own multiply (weight_grad.accumulate_in_place):
    ZeRO 0 in fp32, or ZeRO 1 in fp32 with one data-parallel rank (its hooks released), and no hook on any
    parameter."""
    return ((zero0_fp32(engine) or zero1_one_replica(engine))
            and not any(p._backward_hooks or getattr(p, '_post_accumulate_grad_hooks', None)
                        for p in engine.module.parameters()))


def step_lr_scheduler(engine, lr_kwargs):
    """The learning-rate schedule's step after an optimizer step that was taken, as DeepSpeed's _take_model_step
    does it (a schedule that takes no keywords steps by the batch size, as it does for pipelines)."""
    if engine.lr_scheduler is None:
        return
    try:
        engine.lr_scheduler.step(**(lr_kwargs or {}))
    except TypeError:
        engine.lr_scheduler.step(engine.train_batch_size())


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

    def _lean_zero1(self):
        """Whether ReduceGrads hands DeepSpeed's ZeRO-1 optimizer its gradients itself (`zero1_one_replica`);
        decided once, when the engine is built (`_take_zero1_over`)."""
        return getattr(self, '_zero1_taken_over', False)

    def _take_zero1_over(self):
        """Called once the optimizer is built: with ZeRO 1 in fp32 and one data-parallel rank, its gradient
        hooks go, and ReduceGrads lists its gradients for it (`zero1_gradients`)."""
        self._zero1_taken_over = zero1_one_replica(self)
        if self._zero1_taken_over:
            release_zero1_hooks(self.optimizer)
            share_master_weights(self.optimizer)

    def _exec_reduce_grads(self):
        if self._lean_zero1():
            zero1_gradients(self.optimizer)
            return
        if not needs_no_reduction(self):
            return super()._exec_reduce_grads()
        zero_missing_grads(self.module)

    def clip_fp32_gradients(self):
        # called by DeepSpeed's _take_model_step for ZeRO 0 without fp16 / bf16 only
        self._global_grad_norm = clip_grads_(list(self.module.parameters()), self.gradient_clipping(),
                                             self.grid.get_pipe_parallel_group())
