"""Interlocked iterations: several training steps back to back on each rank, with optimizer post-validation.

`engine.train_batches(data_iter, iterations=k)` runs k steps (each `gradient_accumulation_steps`
micro-batches) and returns their k losses. Between two steps a rank waits for nobody: its last
passes, its step, then the next step's first passes, while the other stages still finish theirs.
With our engines' lean step end (lean_step.py: ZeRO 0) nothing else synchronises the stages:
ReduceGrads is local (with several data-parallel replicas it brings together the replicas of the
same stage only), and the loss travels from the last stage as soon as its last forward has it.

What would synchronise is the step's global check: the gradient norm that clipping needs is the
whole model's, summed over the pipeline. Post-validation (as the Zero Bubble paper proposes) takes
it off the critical path:

- At its OptimizerStep a rank computes its gradients' squared norm and starts the all-reduce over
  the pipeline asynchronously. If its own norm is finite and does not clip on its own (the usual
  case), it steps at once, after a backup of its parameters and optimizer state; otherwise the
  global norm will certainly scale its gradients (or skip the step), so it does not step yet.
- The step is validated when the reduction's result is needed: before this rank's parameters
  are used again, at the start of its next instruction stream (the next step, an `eval_batch`),
  and when `train_batches` returns. If the global norm clips, the step is rolled back from the
  backup (parameters and optimizer state restored exactly) and redone with the global
  coefficient; if it is not finite, the step is undone and skipped, on every stage alike
  (`skipped_steps`, no learning-rate step), as DeepSpeed's overflow check skips a step. The
  gradients are released and the learning-rate schedule steps only then.

Exactness costs overlap: a rank may not use its new parameters before every stage's norm of the
step exists, and the stage whose head of step i+1 overlaps the others' tail of step i (the first
stage on ZB-H2, ZB-V) therefore waits for the last stage to finish step i. With clipping on, that
wait is the interlocking's gain (docs/interlock.md has the figures); with clipping off there is
nothing to validate and the gain is whole.

`rollbacks`, `deferred` (steps not taken until validation), `skipped` and `validations` count per rank;
a traced engine records each validation (`ValidateStep`) and each rollback (`Rollback`) in `tracer.other`.
"""
import torch
from deepspeed import comm as dist

from schedules.runtime.lean_step import clip_coefficient, squared_grad_norm, zero0_fp32


class StepBackup:
    """Parameters and optimizer state before a step, restored exactly on rollback. The parameter copies are
    kept between steps (one allocation); the optimizer state (created lazily by torch's optimizers) is cloned."""

    def __init__(self):
        self._copies, self._state, self._params = None, None, None

    def save(self, params, optimizer):
        self._params = params
        if self._copies is None or len(self._copies) != len(params):
            self._copies = [torch.empty_like(p) for p in params]
        with torch.no_grad():
            torch._foreach_copy_(self._copies, [p.detach() for p in params])
        self._state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()}
                       for p in params if p in optimizer.state}

    def restore(self, optimizer):
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self._params], self._copies)
        for p in self._params:
            if p in self._state:
                optimizer.state[p] = self._state[p]
            else:
                optimizer.state.pop(p, None)
        self._state = None


class _Pending:
    __slots__ = ('work', 'squares', 'stepped', 'lr_kwargs')

    def __init__(self, work, squares, stepped, lr_kwargs):
        self.work, self.squares, self.stepped, self.lr_kwargs = work, squares, stepped, lr_kwargs


class Interlock:
    """Mixin for our PipelineEngine subclasses (before LeanStep): `train_batches`, and the post-validated step.
    The engine calls `_validate_step()` when an instruction stream starts."""

    _interlocking = False
    _pending = None
    rollbacks = deferred = skipped = validations = 0

    def post_validates(self):
        """Whether this engine's step is the lean, validated one: ZeRO 0, fp32, clipping on (with clipping off
        there is nothing to validate). With several data-parallel replicas every replica's stages hold the
        reduced gradients, so each replica's pipeline finds the same norm and takes the same decision."""
        return (self.gradient_clipping() > 0 and zero0_fp32(self) and not self.has_moe_layers
                and not self.torch_autocast_z0_gradscaler)

    def train_batches(self, data_iter=None, iterations=1):
        """`iterations` training steps back to back: [loss of each step], as `train_batch` returns it. When it
        returns, every step is validated (nothing is pending: a checkpoint or an evaluation may follow).
        `step_lrs` holds the learning rate each step used."""
        self._interlocking, self.step_lrs = True, []
        tracer = getattr(self, 'tracer', None)
        losses = []
        try:
            for i in range(iterations):
                if i and tracer is not None and tracer.active:
                    tracer.start_iteration(tracer.iteration + 1)
                losses.append(self.train_batch(data_iter))
                self.step_lrs.append(self._step_lr)
        finally:
            self._interlocking = False
            self._validate_step()
        return losses

    # --- the step -------------------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs):
        self._step_lr = self.optimizer.param_groups[0]['lr']  # the scheduler steps after the step, validated or not
        if not self.post_validates():
            return super()._take_model_step(lr_kwargs)
        params = [p for p in self.module.parameters() if p.grad is not None]
        squares = squared_grad_norm(params)
        local_ok = bool(torch.isfinite(squares)) and self._coefficient(squares) >= 1.0
        group = self.grid.get_pipe_parallel_group()
        work = dist.all_reduce(squares, group=group, async_op=True) if dist.get_world_size(group=group) > 1 else None
        stepped = False
        if self._interlocking and local_ok:  # optimistic: the global norm is checked later
            if not hasattr(self, '_step_backup'):
                self._step_backup = StepBackup()
            self._step_backup.save(params, self.optimizer)
            self.optimizer.step()
            stepped = True
        elif self._interlocking:
            self.deferred += 1
        self._pending = _Pending(work, squares, stepped, lr_kwargs)
        if not self._interlocking:
            self._validate_step()  # synchronised: wait for the norm now, then step
        self.losses = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _coefficient(self, squares):
        return clip_coefficient(self.gradient_clipping(), squares.sqrt())

    def _validate_step(self):
        """Settle the pending step: wait for the global norm, then keep, redo or skip the step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        tracer = getattr(self, 'tracer', None)
        traced = tracer is not None and tracer.active
        t0 = tracer.now() if traced else None
        if pending.work is not None:
            pending.work.wait()
        squares = pending.squares
        self._global_grad_norm = squares.sqrt()
        finite = bool(torch.isfinite(squares))
        coef = self._coefficient(squares) if finite else 0.0
        if pending.stepped and not (finite and coef >= 1.0):
            r0 = tracer.now() if traced else None
            self._step_backup.restore(self.optimizer)
            self.rollbacks += 1
            if traced:
                tracer.record_other('Rollback', r0, tracer.now())
        self._step_applied = finite
        if not finite:
            self.skipped += 1
            self.skipped_steps += 1
        elif not pending.stepped or coef < 1.0:  # not taken yet, or rolled back above: step with the global norm
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self.module.parameters() if p.grad is not None], coef)
            self.optimizer.step()
        self.validations += 1
        self.zero_grad()
        if finite and self.lr_scheduler is not None:
            try:
                self.lr_scheduler.step(**(pending.lr_kwargs or {}))
            except TypeError:  # as DeepSpeed's own step does for pipelines
                self.lr_scheduler.step(self.train_batch_size())
        if traced:
            tracer.record_other('ValidateStep', t0, tracer.now())

def train_batches(engine, data_iter=None, iterations=1):
    """([loss of each step], [learning rate of each step]): `engine.train_batches` where the engine has it;
    else (DeepSpeed's own engines) its steps one after the other, which synchronise where its step does."""
    if hasattr(engine, 'train_batches'):
        return engine.train_batches(data_iter, iterations=iterations), engine.step_lrs
    losses, lrs = [], []
    tracer = getattr(engine, 'tracer', None)
    for i in range(iterations):
        if i and tracer is not None and tracer.active:
            tracer.start_iteration(tracer.iteration + 1)
        lrs.append(engine.optimizer.param_groups[0]['lr'])
        losses.append(engine.train_batch(data_iter))
    return losses, lrs
