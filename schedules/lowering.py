"""`OrderedSchedule`: the one way to define a schedule, and its lowering to DeepSpeed instructions.

A schedule is a named subclass that says, for its rank, in which order it runs which passes:
`compute_order()` returns a list of `Action(kind, micro_batch, chunk)` and `Paired(forward,
backward)` units (schedules/passes.py), `check(micro_batches, stages)` refuses (p, m) it cannot
run with a ValueError naming the flag, and `placement_cls` says where its chunks live
(schedules/placement.py). This base turns the order into DeepSpeed instructions, the same way
for every schedule, from the placement (which stage a chunk runs and where its neighbours are):

    F:  LoadMicroBatch (first stage: inputs; last stage: labels), RecvActivation (unless the
        upstream stage is on this rank or there is none), ForwardPass, SendActivation
    B / BW:  RecvGrad, BackwardInputPass / BackwardPass, SendGrad (same conditions downstream)
    W:  BackwardWeightPass
    Paired: both receives, ForwardBackwardPass, both sends
    end: ReduceTiedGrads, ReduceGrads, OptimizerStep

Receives are posted right before the pass that needs them; sends right after the pass that
produced the data (the engines that run these schedules send asynchronously). Micro-batch mb
uses buffer mb of its chunk: a schedule may finish micro-batches out of order (DualPipe mixes
fused and split backwards), and a buffer slot holds nothing once its micro-batch is done (the
engines free outputs at the backward and inputs once their gradient is sent), so one slot per
micro-batch costs nothing and a micro-batch has the same buffer id in every chunk, which makes
a local hand-over from one chunk to the next need no bookkeeping. With one chunk per rank the
instructions carry only `buffer_id`, as DeepSpeed's own do.

Add a schedule in one file: subclass OrderedSchedule (name, placement_cls, check, compute_order)
in schedules/definitions/, and add its row to the table in schedules/registry.py.
"""
from deepspeed.runtime.pipe import schedule as ds

from schedules.instructions import INSTRUCTION_OF_KIND, ForwardBackwardPass
from schedules.passes import BACKWARD_KINDS, BW, KINDS, Action, B, F, Paired, W, actions


class OrderedSchedule(ds.PipeSchedule):
    name = "ordered"  # as train.py --pipeline-schedule spells it
    placement_cls = None  # set by subclasses: a schedules.placement.Placement

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.check(micro_batches, stages)
        self.placement = self.placement_cls(stages)
        self.forward_only = forward_only
        self._lowered = None
        self._neighbours = {}  # (chunk, step) -> placement.neighbour of this rank's chunk
        self._order = [self._typed(p) for p in (self.forward_order() if forward_only else self.compute_order())]
        self._check_order()

    @classmethod
    def check(cls, micro_batches, stages):
        """Raise ValueError naming the flag and the minimum when this schedule cannot run (p, m)."""
        if stages < 2:
            raise ValueError(f"{cls.name} needs --pipeline-parallel-size >= 2 (got {stages})")

    def compute_order(self):
        """This rank's passes in execution order: Actions and Paired units (schedules/passes.py)."""
        raise NotImplementedError

    def forward_order(self):
        """Forward passes only (eval_batch): stage by stage, so every input is ready before it is needed."""
        chunks = sorted(range(self.placement.chunks), key=lambda c: self.placement.stage(self.stage_id, c))
        return [Action(F, mb, c) for c in chunks for mb in range(self.micro_batches_of(c))]

    def micro_batches_of(self, chunk):
        """Micro-batches that pass through `chunk` (the mirror placement splits them between its directions)."""
        return self.micro_batches if self.placement.direction(chunk) is None else self.micro_batches // 2

    @staticmethod
    def _typed(item):
        if isinstance(item, (Action, Paired)):
            return item
        raise TypeError(f"an order holds Action and Paired units (schedules/passes.py), not {item!r}")

    def _check_order(self):
        seen = {}
        passes = list(actions(self._order))
        for kind, mb, chunk in passes:
            seen.setdefault((chunk, kind), []).append(mb)
        for c in range(self.placement.chunks):
            m = list(range(self.micro_batches_of(c)))
            got = {k: seen.get((c, k), []) for k in KINDS}
            backward = [mb for kind, mb, chunk in passes if chunk == c and kind in BACKWARD_KINDS]
            ok = got[F] == m and (self.forward_only and not backward or backward == m and got[W] == got[B])
            if not ok:
                raise AssertionError(f"{type(self).__name__} rank {self.stage_id} chunk {c}: passes {got} are not "
                                     f"one F and one backward (BW, or B then W) per micro-batch in increasing order")

    def buffers_per_chunk(self):
        return max(self.micro_batches_of(c) for c in range(self.placement.chunks))

    def num_pipe_buffers(self):
        return self.buffers_per_chunk() * self.placement.chunks

    # --- instructions ---------------------------------------------------------------------
    def _neighbour(self, chunk, step):
        key = (chunk, step)
        if key not in self._neighbours:
            self._neighbours[key] = self.placement.neighbour(self.stage_id, chunk, step,
                                                             self.placement.direction(chunk))
        return self._neighbours[key]

    def _remote(self, chunk, step):
        peer = self._neighbour(chunk, step)
        return peer is not None and peer[0] != self.stage_id

    def _at_end(self, chunk, step):
        return self._neighbour(chunk, step) is None

    def _instr(self, cls, buf, chunk):
        return _instruction(cls, buf, chunk if self.placement.chunks > 1 else None)

    def _before(self, a):
        if a.kind == F:
            cmds = [self._instr(ds.LoadMicroBatch, a.micro_batch, a.chunk)] \
                if self._at_end(a.chunk, -1) or self._at_end(a.chunk, +1) else []
            if self._remote(a.chunk, -1):
                cmds.append(self._instr(ds.RecvActivation, a.micro_batch, a.chunk))
            return cmds
        if a.kind in BACKWARD_KINDS:
            return [self._instr(ds.RecvGrad, a.micro_batch, a.chunk)] if self._remote(a.chunk, +1) else []
        return []

    def _after(self, a):
        if a.kind == F and self._remote(a.chunk, +1):
            return [self._instr(ds.SendActivation, a.micro_batch, a.chunk)]
        if a.kind in BACKWARD_KINDS and self._remote(a.chunk, -1):
            return [self._instr(ds.SendGrad, a.micro_batch, a.chunk)]
        return []

    def steps(self):
        if self._lowered is None:  # lowered once: engines that keep the schedule replay the same instructions
            self._lowered = list(self._lower())
        return iter(self._lowered)

    def _lower(self):
        for item in self._order:
            if isinstance(item, Paired):
                f, b = item
                yield (self._before(f) + self._before(b) +
                       [_instruction(ForwardBackwardPass, f.micro_batch, f.chunk, b.micro_batch, b.chunk,
                                     b.kind == BW)] +
                       self._after(f) + self._after(b))
                continue
            yield self._before(item) + [self._instr(INSTRUCTION_OF_KIND[item.kind], item.micro_batch, item.chunk)] + \
                self._after(item)
        if not self.forward_only:
            yield [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]


_INSTRUCTIONS = {}


def _instruction(cls, *args):
    """The instruction `cls(buffer, chunk=chunk)` (`cls(buffer)` for chunk None; ForwardBackwardPass: its five
    arguments), made once and shared by every stream that runs it: an instruction is a value the engines and the
    simulator only read, and a stream of p ranks and m micro-batches holds p x m x chunks of them."""
    key = (cls, *args)
    instr = _INSTRUCTIONS.get(key)
    if instr is None:
        if cls is ForwardBackwardPass:
            fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused = args
            instr = cls(fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused=fused)
        else:
            buf, chunk = args
            instr = cls(buf) if chunk is None else cls(buf, chunk=chunk)
        _INSTRUCTIONS[key] = instr
    return instr
