"""`OrderedSchedule`: a DeepSpeed PipeSchedule written as one stage's order of compute passes.

A subclass says, for its stage, in which order it runs forward (F), backward-for-inputs (B) and
backward-for-weights (W) passes of which micro-batches: `compute_order()` returns a list like
[('F', 0), ('F', 1), ('B', 0), ('W', 0), ...]. This base turns that order into DeepSpeed
instructions, the same way for every schedule:

    F(mb): LoadMicroBatch (first and last stage) or RecvActivation, ForwardPass, SendActivation
    B(mb): RecvGrad (unless last stage), BackwardInputPass, SendGrad (unless first stage)
    W(mb): BackwardWeightPass
    'BW':  a fused BackwardPass, with the same communication as B
    end:   ReduceTiedGrads, ReduceGrads, OptimizerStep

Receives are posted right before the pass that needs them; sends right after the pass that
produced the data (the SplitBackwardEngine sends asynchronously). A micro-batch holds a buffer
from its F to its W (or fused backward); buffers are reused round robin, which is safe because F
and W both visit micro-batches in increasing order, so the micro-batches alive at once are
consecutive.
"""
from abc import abstractmethod

from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import BackwardInputPass, BackwardWeightPass


class OrderedSchedule(ds.PipeSchedule):
    name = "ordered"  # as train.py --pipeline-schedule spells it

    def __init__(self, micro_batches, stages, stage_id):
        super().__init__(micro_batches, stages, stage_id)
        self.check(micro_batches, stages)
        self._order = self.compute_order()
        self._check_order()

    @classmethod
    def check(cls, micro_batches, stages):
        """Raise ValueError naming the flag and the minimum when this schedule cannot run (p, m)."""
        if stages < 2:
            raise ValueError(f"{cls.name} needs --pipeline-parallel-size >= 2 (got {stages})")

    @abstractmethod
    def compute_order(self):
        """This stage's passes in execution order: [(kind, micro_batch), ...]."""

    def _check_order(self):
        m, seen = self.micro_batches, {k: [] for k in ('F', 'B', 'W', 'BW')}
        for kind, mb in self._order:
            seen[kind].append(mb)
        split = bool(seen['B'])
        expected = {'F': list(range(m)), 'B': list(range(m)) if split else [], 'W': list(range(m)) if split else [],
                    'BW': [] if split else list(range(m))}
        if seen != expected:
            raise AssertionError(f"{type(self).__name__} stage {self.stage_id}: passes {seen} are not one F and "
                                 f"one backward per micro-batch in increasing order")

    def num_pipe_buffers(self):
        live = peak = 0
        for kind, _ in self._order:
            live += kind == 'F'
            live -= kind in ('W', 'BW')
            peak = max(peak, live)
        return max(peak, 1)

    def steps(self):
        nbuf = self.num_pipe_buffers()
        first, last = self.is_first_stage, self.is_last_stage
        for kind, mb in self._order:
            buf = mb % nbuf
            cmds = []
            if kind == 'F':
                if first or last:
                    cmds.append(ds.LoadMicroBatch(buf))
                if not first:
                    cmds.append(ds.RecvActivation(buf))
                cmds.append(ds.ForwardPass(buf))
                if not last:
                    cmds.append(ds.SendActivation(buf))
            elif kind in ('B', 'BW'):
                if not last:
                    cmds.append(ds.RecvGrad(buf))
                cmds.append(BackwardInputPass(buf) if kind == 'B' else ds.BackwardPass(buf))
                if not first:
                    cmds.append(ds.SendGrad(buf))
            else:
                cmds.append(BackwardWeightPass(buf))
            yield cmds
        yield [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
