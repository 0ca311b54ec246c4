"""`OrderedSchedule`: a DeepSpeed PipeSchedule written as one rank's order of compute passes.

A subclass says in which order its rank runs which passes: `compute_order()` returns a list of

    ('F', mb, chunk)    forward              ('B', mb, chunk)   backward for inputs
    ('W', mb, chunk)    backward for weights ('BW', mb, chunk)  fused backward
    ('FB', (mb, chunk), (mb, chunk))         a forward and a backward-for-inputs as one unit
    ('FBW', (mb, chunk), (mb, chunk))        a forward and a fused backward as one unit

(`chunk` may be left out on schedules with one chunk per rank). This base turns the order into
DeepSpeed instructions, the same way for every schedule, from the schedule's placement (which
stage a chunk runs and where its neighbours are, schedules/placement.py):

    F:  LoadMicroBatch (first stage: inputs; last stage: labels), RecvActivation (unless the
        upstream stage is on this rank or there is none), ForwardPass, SendActivation
    B / BW:  RecvGrad, BackwardInputPass / BackwardPass, SendGrad (same conditions downstream)
    W:  BackwardWeightPass
    FB / FBW: both receives, ForwardBackwardPass, both sends
    end: ReduceTiedGrads, ReduceGrads, OptimizerStep

Receives are posted right before the pass that needs them; sends right after the pass that
produced the data (the engines that run these schedules send asynchronously). Micro-batch mb
uses buffer mb of its chunk: a schedule may finish micro-batches out of order (DualPipe mixes
fused and split backwards), and a buffer slot holds nothing once its micro-batch is done (the
engines free outputs at the backward and inputs once their gradient is sent), so one slot per
micro-batch costs nothing and a micro-batch has the same buffer id in every chunk, which makes
a local hand-over from one chunk to the next need no bookkeeping. With one chunk per rank the
instructions carry only `buffer_id`, as DeepSpeed's own do.
"""
from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import BackwardInputPass, BackwardWeightPass, ForwardBackwardPass

KINDS = ('F', 'B', 'W', 'BW')


class OrderedSchedule(ds.PipeSchedule):
    name = "ordered"  # as train.py --pipeline-schedule spells it
    placement_cls = None  # set by subclasses: a schedules.simulate.Placement

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.check(micro_batches, stages)
        self.placement = self.placement_cls(stages)
        self.forward_only = forward_only
        self._order = [self._normalise(p) for p in (self.forward_order() if forward_only else self.compute_order())]
        self._check_order()

    @classmethod
    def check(cls, micro_batches, stages):
        """Raise ValueError naming the flag and the minimum when this schedule cannot run (p, m)."""
        if stages < 2:
            raise ValueError(f"{cls.name} needs --pipeline-parallel-size >= 2 (got {stages})")

    def compute_order(self):
        """This rank's passes in execution order (see the module docstring)."""
        raise NotImplementedError

    def forward_order(self):
        """Forward passes only (eval_batch): stage by stage, so every input is ready before it is needed."""
        chunks = sorted(range(self.placement.chunks), key=lambda c: self.placement.stage(self.stage_id, c))
        return [('F', mb, c) for c in chunks for mb in range(self.micro_batches_of(c))]

    def micro_batches_of(self, chunk):
        """Micro-batches that pass through `chunk` (the mirror placement splits them between its directions)."""
        return self.micro_batches if self.placement.direction(chunk) is None else self.micro_batches // 2

    @staticmethod
    def _normalise(item):
        if item[0] in ('FB', 'FBW'):
            return item
        return item if len(item) == 3 else (item[0], item[1], 0)

    def _passes(self):
        for item in self._order:
            if item[0] in ('FB', 'FBW'):
                yield ('F', ) + item[1]
                yield (item[0][1:], ) + item[2]
            else:
                yield item

    def _check_order(self):
        seen = {}
        for kind, mb, chunk in self._passes():
            seen.setdefault((chunk, kind), []).append(mb)
        for c in range(self.placement.chunks):
            m = list(range(self.micro_batches_of(c)))
            got = {k: seen.get((c, k), []) for k in KINDS}
            backward = [mb for kind, mb, chunk in self._passes() if chunk == c and kind in ('B', 'BW')]
            ok = got['F'] == m and (self.forward_only and not backward or backward == m and got['W'] == got['B'])
            if not ok:
                raise AssertionError(f"{type(self).__name__} rank {self.stage_id} chunk {c}: passes {got} are not "
                                     f"one F and one backward (BW, or B then W) per micro-batch in increasing order")

    def buffers_per_chunk(self):
        return max(self.micro_batches_of(c) for c in range(self.placement.chunks))

    def num_pipe_buffers(self):
        return self.buffers_per_chunk() * self.placement.chunks

    # --- instructions ---------------------------------------------------------------------
    def _remote(self, chunk, step):
        peer = self.placement.neighbour(self.stage_id, chunk, step, self.placement.direction(chunk))
        return peer is not None and peer[0] != self.stage_id

    def _at_end(self, chunk, step):
        return self.placement.neighbour(self.stage_id, chunk, step, self.placement.direction(chunk)) is None

    def _instr(self, cls, buf, chunk):
        return cls(buf, chunk=chunk) if self.placement.chunks > 1 else cls(buf)

    def _before(self, kind, buf, chunk):
        if kind == 'F':
            cmds = [self._instr(ds.LoadMicroBatch, buf, chunk)] if self._at_end(chunk, -1) or self._at_end(chunk, +1) \
                else []
            return cmds + ([self._instr(ds.RecvActivation, buf, chunk)] if self._remote(chunk, -1) else [])
        if kind in ('B', 'BW'):
            return [self._instr(ds.RecvGrad, buf, chunk)] if self._remote(chunk, +1) else []
        return []

    def _after(self, kind, buf, chunk):
        if kind == 'F' and self._remote(chunk, +1):
            return [self._instr(ds.SendActivation, buf, chunk)]
        if kind in ('B', 'BW') and self._remote(chunk, -1):
            return [self._instr(ds.SendGrad, buf, chunk)]
        return []

    def steps(self):
        compute = {'F': ds.ForwardPass, 'B': BackwardInputPass, 'W': BackwardWeightPass, 'BW': ds.BackwardPass}
        for item in self._order:
            if item[0] in ('FB', 'FBW'):
                (fmb, fc), (bmb, bc), bkind = item[1], item[2], item[0][1:]
                yield (self._before('F', fmb, fc) + self._before(bkind, bmb, bc) +
                       [ForwardBackwardPass(fmb, fc, bmb, bc, fused=bkind == 'BW')] + self._after('F', fmb, fc) +
                       self._after(bkind, bmb, bc))
                continue
            kind, mb, chunk = item
            yield self._before(kind, mb, chunk) + [self._instr(compute[kind], mb, chunk)] + \
                self._after(kind, mb, chunk)
        if not self.forward_only:
            yield [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]


def ordered_schedule(name, placement_cls, order, check, doc):
    """An OrderedSchedule class for a schedule defined by `order(p, m, rank)` (its passes, see above)
    and `check(p, m)` (raises ValueError naming the flag)."""
    return type(f"OrderedSchedule[{name}]", (OrderedSchedule, ), {
        "__doc__": doc, "name": name, "placement_cls": placement_cls,
        "check": classmethod(lambda cls, micro_batches, stages: check(stages, micro_batches)),
        "compute_order": lambda self: order(self.stages, self.micro_batches, self.stage_id)})
