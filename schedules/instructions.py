"""Pipeline instructions that DeepSpeed's engine does not have: the backward split in two.

- `BackwardInputPass` (B): gradients with respect to the stage's input, which the previous
  stage waits for, plus the gradients of parameters outside deferrable `Linear` layers
  (embeddings, LayerNorm). The linear layers' weight-gradient work is queued.
- `BackwardWeightPass` (W): runs the queued weight-gradient work of one micro-batch.

- `ForwardBackwardPass`: the forward of one micro-batch and the backward-for-inputs of another
  as one unit (DualPipe's overlapped pair; run one after the other today, drawn as one unit).

A stock `BackwardPass` is B immediately followed by W. The engine handlers are in engine.py and
chunked_engine.py; the simulator learns each type where it is registered below. On engines that
hold several chunks per rank every instruction also names its `chunk`.
"""
from deepspeed.runtime.pipe.schedule import BufferOpInstruction, PipeInstruction

from schedules.simulate import Compute, register_instruction


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


register_instruction(BackwardInputPass, lambda instr, ctx: [Compute('B', ctx.chunk, instr.buffer_id)])
register_instruction(BackwardWeightPass, lambda instr, ctx: [Compute('W', ctx.chunk, instr.buffer_id)])
register_instruction(ForwardBackwardPass, lambda i, ctx: [
    Compute('F', i.fwd_chunk, i.fwd_buffer, pair=True),
    Compute('BW' if i.fused else 'B', i.bwd_chunk, i.bwd_buffer, pair=True)])
