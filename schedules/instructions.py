"""Pipeline instructions that DeepSpeed's engine does not have, and the one table of compute kinds.

- `BackwardInputPass` (B): gradients with respect to the stage's input, which the previous
  stage waits for, plus the gradients of parameters outside deferrable `Linear` layers
  (embeddings, LayerNorm). The linear layers' weight-gradient work is queued.
- `BackwardWeightPass` (W): runs the queued weight-gradient work of one micro-batch.
- `ForwardBackwardPass`: the forward of one micro-batch and the backward of another as one unit
  (DualPipe's overlapped pair; run one after the other today, drawn as one unit).

A stock `BackwardPass` is B immediately followed by W. On engines that hold several chunks per
rank every instruction also names its `chunk`.

`PASS_KIND` maps each compute instruction type to the pass kind it runs (schedules/passes.py);
the lowering, the engines' tracer, the simulator and the tests all read it from here.
"""
from deepspeed.runtime.pipe import schedule as ds
from deepspeed.runtime.pipe.schedule import BufferOpInstruction, PipeInstruction

from schedules.passes import BW, B, F, W


class BackwardInputPass(BufferOpInstruction):
    """B: backward for the stage input of the micro-batch in `buffer_id`; weight gradients deferred."""


class BackwardWeightPass(BufferOpInstruction):
    """W: the deferred weight gradients of the micro-batch in `buffer_id` (oldest B first)."""


class ForwardBackwardPass(PipeInstruction):
    """F of the micro-batch in (fwd_buffer, fwd_chunk), then the backward of the one in
    (bwd_buffer, bwd_chunk): B, or with `fused` the whole backward (B and W at once)."""

    def __init__(self, fwd_buffer, fwd_chunk, bwd_buffer, bwd_chunk, fused=False):
        super().__init__(fwd_buffer=fwd_buffer, fwd_chunk=fwd_chunk, bwd_buffer=bwd_buffer, bwd_chunk=bwd_chunk,
                         fused=fused)

    def kinds(self):
        """The pass kinds of its two parts, in order."""
        return paired_kinds(self.kwargs['fused'])


def paired_kinds(fused):
    """(F, BW) for a forward paired with a fused backward, (F, B) with a backward for inputs only."""
    return F, BW if fused else B


# Exact types, as DeepSpeed's _INSTRUCTION_MAP looks them up (a subclass is another instruction).
PASS_KIND = {ds.ForwardPass: F, BackwardInputPass: B, BackwardWeightPass: W, ds.BackwardPass: BW}
INSTRUCTION_OF_KIND = {kind: instr for instr, kind in PASS_KIND.items()}

# Point-to-point instructions: what the tracer times as communication.
P2P = (ds.SendActivation, ds.RecvActivation, ds.SendGrad, ds.RecvGrad, ds.CommitP2P)
