"""What a post-validated step (interlock.py) does to the optimizer it steps: one class per optimizer.

Post-validation needs the same few operations of every optimizer: this stage's squared gradient norm (summed
over the pipeline by an all-reduce started at once), a step with a given clipping coefficient, a backup and an
exact restore of what a step changes, and (speculating past a step) its gradients set aside while the next
step's accumulate, brought back if the step is redone. Each class here is those operations for one optimizer:

- TorchStep: ZeRO 0 in fp32. The client's torch optimizer over the module's parameters; gradients in `.grad`;
  the norm as lean_step.py clips by it (every stage of the model counted once, summed over the pipeline).
- BF16Step: DeepSpeed's BF16 optimizer (bf16: at ZeRO 1 with fp32 gradients, at ZeRO 0 with bf16 ones). Its
  fp32 master partitions, their optimizer state and the bf16 weights are what a step changes; its gradients
  accumulate in flat buffers.
- ZeroStep: DeepSpeed's ZeRO optimizer at stage 1 in fp32. Its fp32 partitions, their optimizer state and the
  weights; the step consumes the reduced gradient partitions, so they are kept, flattened, until validated.

For the last two the norm, the coefficient and the step are DeepSpeed's (0.19.8) to the bit, with the norm
given: DeepSpeed's own step blocks on the norm's all-reduce over the pipeline, which is what interlocking takes
off the critical path. Even with clipping off their norm decides (a step with a non-finite norm is skipped), so
there is something to validate either way.

`step_target(engine)` picks the class (its `validates()`: whether the step has anything to validate now), or None
where DeepSpeed's own step runs (fp16, ZeRO 1 in bf16 with bf16 gradients, CPU offload, mixture of experts,
Muon, ZenFlow): interlocked there, a stage waits inside that step for the model's norm.
"""
import torch
from deepspeed import comm as dist
from deepspeed.comm import pg_utils
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.utils import combine_grad_norm_groups, is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.utils import get_norm_dtype

from schedules.runtime.lean_step import clip_coefficient, master_is_weights, plain_zero1, squared_grad_norm, zero0_fp32
from schedules.runtime.weight_grad import keep_spare_grads


def step_target(engine):
    """The post-validated step's operations for `engine`'s optimizer, or None where DeepSpeed's own step runs."""
    if engine.has_moe_layers or engine.torch_autocast_z0_gradscaler:
        return None
    if zero0_fp32(engine):
        return TorchStep(engine)
    if type(engine.optimizer) is BF16_Optimizer and not getattr(engine.optimizer, '_uses_muon', False):
        return BF16Step(engine)
    if type(engine.optimizer) is DeepSpeedZeroOptimizer and ZeroStep.takes(engine):
        return ZeroStep(engine)
    return None


class TorchStep:
    """ZeRO 0, fp32: the module's parameters and their `.grad`, stepped by the client's torch optimizer."""

    steps_over_replicas = False  # the step is local: no collective over data-parallel replicas

    def __init__(self, engine):
        self.engine, self._params = engine, []

    def validates(self):
        """Whether there is anything to validate: with clipping off nothing is checked (the norm decides nothing).
        Asked at every step: the threshold may change between steps."""
        return self.engine.gradient_clipping() > 0

    def group(self):
        """Where the norm is summed: the pipeline (data-parallel replicas hold the same reduced gradients)."""
        return self.engine.grid.get_pipe_parallel_group()

    def local_squares(self):
        self._params = [p for p in self.engine.module.parameters() if p.grad is not None]
        return squared_grad_norm(self._params)

    def norm(self, squares):
        return squares.sqrt()

    def coefficient(self, squares):
        """The clipping coefficient of a (finite) squared norm: below 1, the step scales the gradients by it."""
        return clip_coefficient(self.engine.gradient_clipping(), self.norm(squares))

    def save(self, backup):
        backup.save(self._params, self.engine.optimizer)

    def restore(self, backup):
        backup.restore(self.engine.optimizer)

    def step(self, squares=None):
        """Step, the gradients clipped by the model's squared norm `squares` (None: unclipped, the stage's own norm
        not clipping). The gradients stay until `clear` (a redo steps from them again)."""
        coef = 1.0 if squares is None else self.coefficient(squares)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in self.engine.module.parameters() if p.grad is not None], coef)
        self.engine.optimizer.step()

    def set_aside(self):
        """The step's gradients, out of the way of the next step's: returned, and `.grad` emptied."""
        grads = [(p, p.grad) for p in self._params]
        for p in self._params:
            p.grad = None
        return grads

    def bring_back(self, grads):
        """The step is redone: its set-aside gradients back in place of what the next step's passes added."""
        for p in self.engine.module.parameters():
            p.grad = None
        for p, grad in grads:
            p.grad = grad

    def release(self, grads):
        """The step is kept: its set-aside gradients are not needed again (a later step may write into them)."""
        keep_spare_grads(grads)

    def clear(self):
        self.engine.zero_grad()


class _PartitionedStep:
    """What DeepSpeed's BF16 and ZeRO optimizers share: fp32 partitions stepped by a torch optimizer
    (`opt.optimizer`), whose state they link to the weights lazily, at their first step; the flat weights the
    partitions are copied into. `_stepped()`: (the fp32 partitions, the flat weights)."""

    def validates(self):
        return True  # clipping on or off, their norm decides whether the step is skipped

    def save(self, backup):
        partitions, weights = self._stepped()
        backup.save(list(partitions) + list(weights), self.opt.optimizer)

    def restore(self, backup):
        backup.restore(self.opt.optimizer)
        if not all(p in self.opt.optimizer.state for p in self._stepped()[0]):
            self.opt._hp_optimizer_states_linked = False  # the step created the state: the redo links its own


class BF16Step(_PartitionedStep):
    """DeepSpeed's BF16_Optimizer: fp32 master partitions (`fp32_groups_flat_partition`, one per data-parallel
    rank), fp32 gradients in flat buffers (`fp32_groups_gradients_flat`), bf16 weights (`bf16_groups_flat`)."""

    def __init__(self, engine):
        self.engine, self.opt, self._spare = engine, engine.optimizer, None
        # the step all-gathers the updated partitions over data-parallel replicas: every replica of a stage
        # must take as many steps (ahead, redone) as the others
        self.steps_over_replicas = engine.dp_world_size > 1

    def group(self):
        """Where BF16_Optimizer sums its norm: the grid's model-parallel group (the stages of one replica)."""
        return self.opt.mpu.get_model_parallel_group()

    def local_squares(self):
        # as get_global_norm_of_tensors (runtime/utils.py) sums them before its all-reduce
        grads, _ = self.opt.get_grads_for_norm()
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        return torch.stack([g.detach().float().norm(2.0) for g in grads]).pow(2.0).sum()

    def norm(self, squares):
        return squares.pow(1.0 / 2.0)

    def coefficient(self, squares):
        if self.opt.clip_grad <= 0:
            return float("inf")
        return float(self.opt.clip_grad / (self.norm(squares) + 1e-6))  # clip_tensors_by_global_norm's, in fp32

    def _stepped(self):
        return self.opt.fp32_groups_flat_partition, self.opt.bf16_groups_flat

    def step(self, squares=None):
        """BF16_Optimizer.step after its norm (DeepSpeed 0.19.8): clip, step the fp32 partitions, copy them to the
        bf16 weights. The gradients stay until `clear` (a redo steps from them again)."""
        opt = self.opt
        coef = 1.0 if squares is None else self.coefficient(squares)
        if coef < 1.0:  # by a float32 tensor, one gradient at a time, as clip_tensors_by_global_norm: with bf16
            coef = torch.tensor(coef, dtype=torch.float32)  # gradients its rounding is not a Python float's
            for grad in opt.get_grads_for_norm(for_clipping=True):
                grad.detach().mul_(coef)
        for param_partition, grad_partition in zip(opt.fp32_groups_flat_partition,
                                                   opt.fp32_groups_gradient_flat_partition):
            param_partition.grad = (grad_partition.to(param_partition.dtype)
                                    if grad_partition.dtype != param_partition.dtype else grad_partition)
        opt.optimizer.step()
        if opt.grad_acc_dtype is not torch.float32:
            for param_partition in opt.fp32_groups_flat_partition:
                param_partition.grad = None
        opt._lazy_init_hp_params_optimizer_state()
        opt.update_lp_params()

    def set_aside(self):
        flats = list(self.opt.fp32_groups_gradients_flat)
        if self._spare is None or [s.shape for s in self._spare] != [f.shape for f in flats]:
            self._spare = [torch.empty_like(f) for f in flats]
        torch._foreach_copy_(self._spare, flats)
        flags = [list(f) for f in self.opt.fp32_groups_has_gradients]
        self.opt.zero_grad(set_to_none=False)
        return flags

    def bring_back(self, flags):
        torch._foreach_copy_(list(self.opt.fp32_groups_gradients_flat), self._spare)
        for i, f in enumerate(flags):
            self.opt.fp32_groups_has_gradients[i] = list(f)
        self.opt.clear_lp_grads()

    def release(self, flags):
        pass  # the spare buffers are kept for the next step set aside

    def clear(self):
        self.opt.zero_grad(set_to_none=True)  # as DeepSpeed's _take_model_step does in bf16


class ZeroStep(_PartitionedStep):
    """DeepSpeed's ZeRO optimizer at stage 1 in fp32: each data-parallel rank steps its fp32 partition
    (`single_partition_of_fp32_groups`) from its partition of the reduced gradients (`averaged_gradients`), then
    the partitions are all-gathered into the weights (`bit16_groups_flat`, fp32 here). The norm, the clipping and
    the step are DeepSpeedZeroOptimizer.step's (DeepSpeed 0.19.8) to the bit, with the norm given: each group's
    squared norm summed over the data-parallel group (the replicas of this stage, which have just reduced their
    gradients together: no other stage waits), then over the pipeline, asynchronously. A non-finite norm is
    DeepSpeed's overflow (its separate check finds exactly the gradients whose norm is not finite)."""

    @staticmethod
    def takes(engine):
        """Stage 1 in fp32 with nothing that changes the step: no loss scale, offload, Muon, experts, ZenFlow."""
        return plain_zero1(engine)

    def __init__(self, engine):
        self.engine, self.opt = engine, engine.optimizer
        self.steps_over_replicas = engine.dp_world_size > 1  # the all-gather of the updated partitions
        self._grads = None  # per group: the flat fp32 gradient partition this step steps from
        self._buffers = {}  # group -> (its gradient buffer, a view of it per parameter): `_flat_in_place`
        self._scratch = None  # a gradient in the norm's dtype (`_in_norm_dtype`)

    def group(self):
        opt = self.opt
        return opt.model_parallel_group if pg_utils.is_parallel(opt.model_parallel_group) else None

    def _partition_squares(self, gradients, params):
        # get_grad_norm_direct's sum before its all-reduces
        opt, counted = self.opt, []
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
            if getattr(p, 'ds_pipe_replicated', False):
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                counted.append(torch.linalg.vector_norm(self._in_norm_dtype(g.data.detach()), ord=2.0))
        if not counted:
            return torch.tensor(0.0, dtype=torch.float32)
        return torch.stack(counted).pow(2.0).sum().float()

    def _in_norm_dtype(self, grad):
        """`grad.to(get_norm_dtype())` (fp64), as DeepSpeed's norm takes it, written into a buffer kept from step to
        step: the same values, without a new gradient-sized allocation per parameter and step, whose first touch is
        most of the conversion's time on a CPU (3 of a deep-model stage's 4.4 ms of norms)."""
        dtype = get_norm_dtype()
        if grad.dtype == dtype:
            return grad
        n = grad.numel()
        if self._scratch is None or self._scratch.numel() < n or self._scratch.device != grad.device:
            self._scratch = torch.empty(n, dtype=dtype, device=grad.device)
        return self._scratch[:n].view(grad.shape).copy_(grad)

    def local_squares(self):
        """Each group's squared norm of this stage (a vector, a group each), summed over the replicas; then the
        gradient partitions are flattened as the step flattens them, and kept until `clear`."""
        opt = self.opt
        squares = torch.stack([self._partition_squares(opt.averaged_gradients[i], opt.params_in_partition[i])
                               for i in range(len(opt.bit16_groups))])
        if dist.get_world_size(group=opt.dp_process_group) > 1:  # (over one rank: the same tensor)
            dist.all_reduce(squares, group=opt.dp_process_group)
        self._grads = []
        in_place = master_is_weights(opt)
        for i in range(len(opt.bit16_groups)):
            if in_place:
                self._grads.append(self._flat_in_place(i))
                opt.free_grad_in_param_list(opt.params_in_partition[i])
                opt.averaged_gradients[i] = None
                opt.all_grad_tensors[i] = None
                continue
            opt.free_grad_in_param_list(opt.params_not_in_partition[i])
            partition_id = dist.get_rank(group=opt.real_dp_process_group[i])
            if partition_id == dist.get_world_size(group=opt.real_dp_process_group[i]) - 1:
                flat = opt.flatten_dense_tensors_aligned(opt.averaged_gradients[i], int(opt.partition_size[i]))
            else:
                flat = opt.flatten(opt.averaged_gradients[i])
            self._grads.append(flat.to(opt.single_partition_of_fp32_groups[i].dtype))
            opt.free_grad_in_param_list(opt.params_in_partition[i])
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None
        return squares

    def _flat_in_place(self, group):
        """The flattened gradient partition of `group` where the weights are the fp32 master partition (one
        data-parallel rank: lean_step.share_master_weights), in a buffer kept from step to step in the master's
        layout: each parameter's gradient at its weight's offset, the padding zero, as the flatten of
        `averaged_gradients` lays them out. A gradient already in its place is not copied: each parameter's place is
        its spare gradient tensor (weight_grad.spare_grads), so from the second step on in-place accumulation writes
        the linear layers' gradients there, and only what autograd accumulated (embeddings, norms) is copied in."""
        opt = self.opt
        if group not in self._buffers:
            master = opt.single_partition_of_fp32_groups[group]
            buffer = torch.zeros(master.shape, dtype=master.dtype, device=master.device)
            views = [buffer.narrow(0, (p.data_ptr() - master.data_ptr()) // p.element_size(), p.numel()).view_as(p)
                     for p in opt.params_in_partition[group]]
            self._buffers[group] = buffer, views
        buffer, views = self._buffers[group]
        params = opt.params_in_partition[group]
        for p, place in zip(params, views):
            if p.grad is None:
                place.zero_()  # as the flatten's zeros for a parameter without a gradient
            elif p.grad.data_ptr() != place.data_ptr():
                place.copy_(p.grad)
        keep_spare_grads(zip(params, views))  # (where in-place accumulation keeps spares)
        return buffer

    def norm(self, squares):
        """scaled_global_norm's: each group's root (an invalid one masked to -1), combined over groups."""
        norms = squares.pow(1.0 / 2.0)
        norms = torch.where(torch.isfinite(norms), norms, torch.full_like(norms, -1.0))
        return combine_grad_norm_groups(list(norms), norm_type=2)

    def coefficient(self, squares):
        """Below 1 where unscale_and_clip_grads scales the gradients: 1 / its clamped `clip`."""
        if self.opt.clip_grad <= 0:
            return float("inf")
        return 1.0 / float(((self.norm(squares) / self.opt.loss_scale) + 1e-6) / self.opt.clip_grad)

    def _scales_by_one(self, norm):
        """Whether unscale_and_clip_grads would multiply the gradients by exactly 1 (no loss scale, and a norm that
        does not clip: its clamped `clip` is 1): an identity, left out."""
        opt = self.opt
        if opt.loss_scale != 1.0:
            return False
        if opt.clip_grad <= 0.0:
            return True
        return bool(torch.clamp(((norm / opt.loss_scale) + 1e-6) / opt.clip_grad, min=1.0) == 1.0)

    def _stepped(self):
        # (the weights, where they are the master partition itself, once: lean_step.share_master_weights)
        weights = [] if master_is_weights(self.opt) else self.opt.bit16_groups_flat
        return self.opt.single_partition_of_fp32_groups, weights

    def step(self, squares=None):
        """DeepSpeedZeroOptimizer.step after its norm: per group clip and step the fp32 partition; then copy the
        partitions into the weights' and all-gather them over replicas (the optimizer's own update_lp_params),
        unless the weights are the partition itself (one data-parallel rank: lean_step.share_master_weights)."""
        opt, norm = self.opt, None if squares is None else self.norm(squares)
        for i, grad in enumerate(self._grads):
            fp32_partition = opt.single_partition_of_fp32_groups[i]
            fp32_partition.grad = grad
            if norm is not None and not self._scales_by_one(norm):  # (unclipped: by exactly 1 too)
                opt.unscale_and_clip_grads([grad], norm)
            opt._optimizer_step(i)
            fp32_partition.grad = None
        if master_is_weights(opt):
            return  # stepped in place
        opt.update_lp_params()
        for i in range(len(opt.bit16_groups)):
            opt._update_model_bit16_weights(i)

    def set_aside(self):
        grads, self._grads = self._grads, None
        if master_is_weights(self.opt):  # the next step's gradients accumulate into the buffers: a copy aside
            grads = [g.clone() for g in grads]
        return grads

    def bring_back(self, grads):
        self._discard_accumulated()
        self._grads = grads

    def release(self, grads):
        pass

    def _discard_accumulated(self):
        opt = self.opt
        opt.zero_grad(set_to_none=True)
        for i in range(len(opt.bit16_groups)):
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None

    def clear(self):
        self._grads = None
        self._discard_accumulated()
