"""Interlocked iterations: several training steps back to back on each rank, with optimizer post-validation.

`engine.train_batches(data_iter, iterations=k)` runs k steps (each `gradient_accumulation_steps`
micro-batches) and returns their k losses. Between two steps a rank waits for nobody: its last
passes, its step, then the next step's first passes, while the other stages still finish theirs.
With our engines' lean step end (lean_step.py) nothing else synchronises the stages:
ReduceGrads is local (with several data-parallel replicas it brings together the replicas of the
same stage only), and the loss travels from the last stage as soon as its last forward has it.

What would synchronise is the step's global check: the gradient norm that clipping needs is the
whole model's, summed over the pipeline. Post-validation (as the Zero Bubble paper proposes) takes
it off the critical path:

- At its OptimizerStep a rank computes its gradients' squared norm and starts the all-reduce over
  the pipeline asynchronously. If its own norm is finite and does not clip on its own (the usual
  case), its policy (`engine.post_validation`: AheadPolicy) decides: "ahead" steps at once, after
  a backup of its parameters and optimizer state; "wait" steps once the norm is in (`waited`);
  "auto" steps ahead while its last measured wait for the norm exceeds its last backup's time.
  Otherwise the global norm will certainly scale its gradients (or skip the step), so it does not
  step yet (`deferred`).
- The step is validated when the reduction's result is needed: before this rank's parameters
  are used again, at the start of its next instruction stream (the next step, an `eval_batch`),
  and when `train_batches` returns. Policy "speculate" validates it later, at the rank's next
  OptimizerStep: the next step's passes run on the parameters stepped ahead (and on a rank whose
  own norm clipped, on the parameters not yet stepped) without waiting for the norm; the step's
  gradients are set aside meanwhile. When the norm then says the step was not what was taken,
  every rank knows it from the same norm: each redoes the step from its set-aside gradients and
  replays the next one from the start (the same micro-batches, the RNG state it began with;
  `replays`). The next step's passes are wasted then; they are saved whenever clipping does not
  bite. If the global norm clips, the step is rolled back from the
  backup (parameters and optimizer state restored exactly) and redone with the global
  coefficient; if it is not finite, the step is undone and skipped, on every stage alike
  (`skipped_steps`, no learning-rate step), as DeepSpeed's overflow check skips a step. The
  gradients are released and the learning-rate schedule steps only then.

What the step does to the optimizer (its norm, backup and restore, clipped step, gradients set aside) is
step_targets.py's, per optimizer: torch's at ZeRO 0 in fp32 (with clipping on), DeepSpeed's BF16 optimizer
and its ZeRO-1 optimizer in fp32 (clipping on or off: their norm also skips a non-finite step). Elsewhere
DeepSpeed's own step runs.

Exactness costs overlap: a rank may not use its new parameters before every stage's norm of the
step exists, and the stage whose head of step i+1 overlaps the others' tail of step i (the first
stage on ZB-H2, ZB-V) therefore waits for the last stage to finish step i. With clipping on, that
wait is the interlocking's gain (docs/interlock.md has the figures); with clipping off there is
nothing to validate and the gain is whole.

`rollbacks`, `deferred` (steps not taken until validation), `waited`, `skipped`, `validations` and `replays`
count per rank; a traced engine records each validation (`ValidateStep`, and within it its wait for the norm,
`NormWait`), each rollback (`Rollback`) and each replayed step (`Replay`) in `tracer.other`.
"""
import time

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from schedules.runtime.lean_step import step_lr_scheduler
from schedules.runtime.step_targets import step_target
from schedules.runtime.validation_policy import POLICIES, AheadPolicy, SpeculationVote  # noqa: F401 (re-exported)


class StepBackup:
    """Parameters and optimizer state before a step, restored exactly on rollback. The copies are allocated
    once and kept between steps (one fused copy per save, no allocation); a restore copies back into the live
    tensors, so a fused optimizer keeps its buffers. State a step created (torch's optimizers create theirs
    lazily, at the first step) is dropped on restore."""

    def __init__(self):
        self._params, self._copies, self._saved = None, None, None
        self._state_copies = {}  # (param, key) -> tensor kept for the state value of that key

    def save(self, params, optimizer):
        if self._copies is None or len(self._copies) != len(params):
            self._copies = [torch.empty_like(p) for p in params]
        live, copies = [p.detach() for p in params], list(self._copies)
        saved = {}  # param -> {key: value}: the state's keys at save, a non-tensor value kept as it is
        for p in params:
            if p not in optimizer.state:
                continue
            saved[p] = {}
            for key, value in optimizer.state[p].items():
                if torch.is_tensor(value):
                    copy = self._state_copies.get((p, key))
                    if copy is None or copy.shape != value.shape or copy.dtype != value.dtype:
                        copy = self._state_copies[(p, key)] = torch.empty_like(value)
                    live.append(value)
                    copies.append(copy)
                saved[p][key] = value
        with torch.no_grad():
            torch._foreach_copy_(copies, live)
        self._params, self._saved = params, saved

    def restore(self, optimizer):
        live, copies = [p.detach() for p in self._params], list(self._copies)
        for p in self._params:
            before = self._saved.get(p)
            if before is None:  # the step created this parameter's state
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in before]:
                del state[key]
            for key, value in before.items():
                if torch.is_tensor(value):
                    if state.get(key) is not value:  # the step replaced the tensor: put the old one back
                        state[key] = value
                    live.append(value)
                    copies.append(self._state_copies[(p, key)])
                else:
                    state[key] = value
        with torch.no_grad():
            torch._foreach_copy_(live, copies)
        self._saved = None


class _Pending:
    __slots__ = ('work', 'squares', 'stepped', 'lr_kwargs', 'started', 'waits', 'grads', 'vote')

    def __init__(self, work, squares, stepped, lr_kwargs, started, waits):
        self.work, self.squares, self.stepped, self.lr_kwargs = work, squares, stepped, lr_kwargs
        self.started = started  # perf_counter() when the norm's all-reduce was started
        self.waits = waits      # could have stepped ahead, but the policy waits for the norm
        self.grads = None       # speculating: the step's gradients, set aside (what the step target returned)
        self.vote = None        # auto: (all-reduce work, the summed ballots) of SpeculationVote


class _Replayable:
    """The data iterator of a speculative call: it keeps what the step being run took from its source, so that a
    replayed step takes the same micro-batches again."""

    def __init__(self, source):
        self.source, self.taken, self.again = source, [], []

    def __iter__(self):
        return self

    def __next__(self):
        item = self.again.pop(0) if self.again else next(self.source)
        self.taken.append(item)
        return item

    def step(self):
        """A new step begins: what the last one took is no longer needed."""
        self.taken = []

    def rewind(self):
        """The step begins again: its micro-batches come again, in their order."""
        self.again, self.taken = self.taken + self.again, []


class _MutedMonitor:
    """DeepSpeed's monitor, as a run that will be replayed sees it: disabled (train_batch and the optimizer step
    write their events only where `monitor.enabled`)."""
    enabled = False


_MUTED_MONITOR = _MutedMonitor()


class Interlock:
    """Mixin for our PipelineEngine subclasses (before LeanStep): `train_batches`, and the post-validated step.
    The engine calls `_settle_before_stream()` when an instruction stream starts."""

    _interlocking = False
    _pending = None
    _replay = False  # speculating: the step being run ran on parameters its validation rejected
    rollbacks = deferred = waited = skipped = validations = replays = speculated = 0
    post_validation = "auto"  # "auto", "ahead", "wait" or "speculate" (validation_policy.py)

    def post_validates(self):
        """Whether this engine's step is the validated one (step_targets.py): ZeRO 0 in fp32 with clipping on (with
        clipping off there is nothing to validate), DeepSpeed's BF16 optimizer or its ZeRO-1 optimizer in fp32
        (whose norm also decides whether a step is skipped). With several data-parallel replicas every replica's
        stages hold the reduced gradients (or their partitions, whose norms the replicas sum), so each replica's
        pipeline finds the same norm and takes the same decision. Otherwise (fp16, offload, ...) DeepSpeed's own
        step runs, interlocked or not: its optimizer all-reduces the model's norm before it updates, so an
        interlocked stage waits there for it and has nothing to roll back."""
        target = self._target()
        return target is not None and target.validates()

    def _target(self):
        if not hasattr(self, '_step_target'):
            self._step_target = step_target(self)
        return self._step_target

    def train_batches(self, data_iter=None, iterations=1):
        """`iterations` training steps back to back: [loss of each step], as `train_batch` returns it. When it
        returns, every step is validated (nothing is pending: a checkpoint or an evaluation may follow).
        `step_lrs` holds the learning rate each step used."""
        self._interlocking, self.step_lrs = True, []
        tracer = getattr(self, 'tracer', None)
        losses = []
        source = data_iter if data_iter is not None else getattr(self, 'data_iterator', None)
        data = _Replayable(source) if self._may_speculate() and source is not None else data_iter
        try:
            for i in range(iterations):
                if i and tracer is not None and tracer.active:
                    tracer.start_iteration(tracer.iteration + 1)
                losses.append(self._train_batch_replayed(data))
                self.step_lrs.append(self._step_lr)
        finally:
            self._interlocking = False
            self._validate_step()
            if isinstance(data, _Replayable) and getattr(self, 'data_iterator', None) is data:
                self.data_iterator = source  # the next call wraps its own, not this one's wrapper
        return losses

    def _may_speculate(self):
        """Whether a step of this call may be speculated past (`speculate`, or `auto` where its vote says so)."""
        return self._interlocking and self.post_validation in ("speculate", "auto") and self.post_validates()

    def _speculates_past_this_step(self):
        """Decided at the step's OptimizerStep, the step before validated: the same on every rank."""
        if not self._interlocking:
            return False
        return self.post_validation == "speculate" or (self.post_validation == "auto" and self._vote().speculates())

    def _vote(self):
        if getattr(self, '_speculation_vote', None) is None:
            self._speculation_vote = SpeculationVote(dist.get_rank(), dist.get_world_size())
        return self._speculation_vote

    def _train_batch_replayed(self, data):
        """`train_batch`, run again from its start (same micro-batches, same RNG state) when its step found that
        the step before, speculated past, had to be redone."""
        if not self._may_speculate():
            return self.train_batch(data)
        if isinstance(data, _Replayable):
            data.step()
        rng = torch.get_rng_state(), get_accelerator().get_rng_state()
        while True:
            self._replay = False
            try:
                loss = self.train_batch(data)
            finally:
                if self._replay:
                    self.monitor = self._monitor_kept
            if not self._replay:
                return loss
            self.replays += 1
            torch.set_rng_state(rng[0])
            get_accelerator().set_rng_state(rng[1])
            if isinstance(data, _Replayable):
                data.rewind()

    _NEVER_PRINTS = 1 << 62  # no step count is a multiple of it (a replay comes after a step: the count is >= 1)

    def steps_per_print(self):
        # a step that is replayed prints nothing: its loss is not the step's (DeepSpeed's train_batch logs it, and
        # its optimizer step's timers take `global_steps % steps_per_print()`, so the answer must stay a number)
        return self._NEVER_PRINTS if self._replay else super().steps_per_print()

    def _flag_replay(self):
        """The step before was redone: this step's passes ran on parameters it replaced, and run again once its
        stream is done. Until then its run reports nothing: no log line (steps_per_print), no monitor event (its
        loss and learning rate are not the step's)."""
        self._replay = True
        self._monitor_kept, self.monitor = self.monitor, _MUTED_MONITOR
        tracer = getattr(self, 'tracer', None)
        if tracer is not None and tracer.active:
            now = tracer.now()
            tracer.record_other('Replay', now, now)

    # --- the step -------------------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs):
        if self._pending is not None and self._pending.grads is not None and self._validate_step():
            self._flag_replay()
            return
        self._step_lr = self.optimizer.param_groups[0]['lr']  # the scheduler steps after the step, validated or not
        if not self.post_validates():
            return super()._take_model_step(lr_kwargs)
        self._vote().step_at(time.perf_counter())
        target = self._target()
        squares = target.local_squares()
        local_ok = bool(torch.isfinite(squares).all()) and target.coefficient(squares) >= 1.0
        group = target.group()
        reduced = group is not None and dist.get_world_size(group=group) > 1
        work = dist.all_reduce(squares, group=group, async_op=True) if reduced else None
        started, stepped = time.perf_counter(), False
        speculate = self._speculates_past_this_step()
        if self._interlocking and local_ok and (speculate or self._steps_ahead()):  # norm later
            if not hasattr(self, '_step_backup'):
                self._step_backup = StepBackup()
            t0 = time.perf_counter()
            target.save(self._step_backup)
            self._ahead_policy().backed_up(time.perf_counter() - t0, work is None or work.is_completed())
            target.step()
            stepped = True
        elif self._interlocking and local_ok:
            self.waited += 1
        elif self._interlocking:
            self.deferred += 1
        self._pending = _Pending(work, squares, stepped, lr_kwargs, started,
                                 waits=self._interlocking and local_ok and not stepped)
        if self._interlocking and self.post_validation == "auto":  # each rank's figures, for the next decision
            ballot = self._vote().ballot(self._ahead_policy().backup_s)
            self._pending.vote = (dist.all_reduce(ballot, async_op=True), ballot)
        if speculate:  # the next step's passes accumulate afresh; these wait for the validation
            self.speculated += 1
            self._pending.grads = target.set_aside()
        if not self._interlocking:
            self._validate_step()  # synchronised: wait for the norm now, then step
        self.losses = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _ahead_policy(self):
        if getattr(self, '_norm_policy', None) is None or self._norm_policy.policy != self.post_validation:
            self._norm_policy = AheadPolicy(self.post_validation)
        return self._norm_policy

    def _steps_ahead(self):
        """Whether a rank whose own norm does not clip steps before the model's norm arrives. Where the step has a
        collective over data-parallel replicas (the BF16 and ZeRO-1 optimizers' all-gather of the updated
        partitions), every replica of a stage must take its steps alike, so `auto` steps ahead there rather than
        by each rank's own timings."""
        if self.post_validation == "auto" and self._target().steps_over_replicas:
            return True
        return self._ahead_policy().steps_ahead()

    def _settle_before_stream(self):
        """Before an instruction stream uses the parameters: settle a pending step, unless speculating past it."""
        pending = self._pending
        if pending is None:
            return
        if pending.grads is not None:  # speculated past: validated at the next OptimizerStep
            self._vote().speculated_and_found(pending.work is None or pending.work.is_completed())
            return
        self._validate_step()
        self._vote().waited(self._norm_wait_s)

    def _validate_step(self):
        """Settle the pending step: wait for the global norm, then keep, redo or skip the step. True when the step
        is not the one taken ahead (rolled back and redone, taken only now, or skipped): what ran on the parameters
        since then ran on the wrong ones."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        tracer = getattr(self, 'tracer', None)
        traced = tracer is not None and tracer.active
        t0 = tracer.now() if traced else None
        wait_started = time.perf_counter()
        if pending.work is not None:
            waited = not pending.work.is_completed()
            pending.work.wait()
            if traced:  # the validation's own wait for the norm, apart from the step work around it
                tracer.record_other('NormWait', t0, tracer.now())
            if pending.waits:
                self._ahead_policy().waited_for_norm(time.perf_counter() - pending.started, waited)
        if pending.vote is not None:  # started with the norm's, over every rank
            pending.vote[0].wait()
            self._vote().counted(pending.vote[1])
        self._norm_wait_s = time.perf_counter() - wait_started
        squares, target = pending.squares, self._target()
        self._global_grad_norm = target.norm(squares)
        finite = bool(torch.isfinite(squares).all())
        coef = target.coefficient(squares) if finite else 0.0
        self._vote().validated_step(not finite or coef < 1.0)  # the model's verdict: every rank alike
        redo = not (pending.stepped and finite and coef >= 1.0)
        if pending.grads is not None:  # speculated past: the step's gradients were set aside
            if redo:  # back in place of the later passes' (which ran on the wrong parameters)
                target.bring_back(pending.grads)
            else:  # not needed again: a later step's gradients may be written into them
                target.release(pending.grads)
        if pending.stepped and redo:
            r0 = tracer.now() if traced else None
            target.restore(self._step_backup)
            self.rollbacks += 1
            if traced:
                tracer.record_other('Rollback', r0, tracer.now())
        self._step_applied = finite
        if not finite:
            self.skipped += 1
            self.skipped_steps += 1
        elif redo:  # not taken yet, or rolled back above: step with the global norm
            target.step(squares)
        self.validations += 1
        if pending.grads is None or redo:  # (speculated past and kept: the gradients are the next step's)
            target.clear()
        if finite:
            step_lr_scheduler(self, pending.lr_kwargs)
        if traced:
            tracer.record_other('ValidateStep', t0, tracer.now())
        return redo

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
