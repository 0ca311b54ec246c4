"""Pipeline instructions that DeepSpeed's engine does not have: the backward split in two.

- `BackwardInputPass` (B): gradients with respect to the stage's input, which the previous
  stage waits for, plus the gradients of parameters outside deferrable `Linear` layers
  (embeddings, LayerNorm). The linear layers' weight-gradient work is queued.
- `BackwardWeightPass` (W): runs the queued weight-gradient work of one micro-batch.

A stock `BackwardPass` is B immediately followed by W. The engine handlers are in engine.py;
the simulator learns each type where it is registered below.
"""
from deepspeed.runtime.pipe.schedule import BufferOpInstruction

from schedules.simulate import Compute, register_instruction


class BackwardInputPass(BufferOpInstruction):
    """B: backward for the stage input of the micro-batch in `buffer_id`; weight gradients deferred."""


class BackwardWeightPass(BufferOpInstruction):
    """W: the deferred weight gradients of the micro-batch in `buffer_id` (oldest B first)."""


register_instruction(BackwardInputPass, lambda instr, ctx: [Compute('B', ctx.chunk, instr.buffer_id)])
register_instruction(BackwardWeightPass, lambda instr, ctx: [Compute('W', ctx.chunk, instr.buffer_id)])
