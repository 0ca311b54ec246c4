"""The pass vocabulary every schedule is written in: what one rank computes, in which order.

A schedule definition returns, for each rank, a list of

    Action(kind, micro_batch, chunk)   one compute pass of one micro-batch on one of the rank's chunks
    Paired(forward, backward)          a forward and a backward of two micro-batches run as one unit
                                       (DualPipe's overlapped pair): two Actions, F and B or BW

Kinds: F forward; B backward for inputs (its weight gradients deferred); W backward for weights
(the deferred work of an earlier B of the same chunk); BW fused backward (inputs and weights).

`micro_batch` counts within the chunk's stream of micro-batches (within a direction, for the
mirror placement); `chunk` is 0 on placements with one chunk per rank. Both are tuples, so
`Action('F', 0, 1) == ('F', 0, 1)`. schedules/lowering.py turns an order into DeepSpeed
instructions; nothing else interprets it.
"""
from typing import NamedTuple

F, B, W, BW = 'F', 'B', 'W', 'BW'
KINDS = (F, B, W, BW)
BACKWARD_KINDS = (B, BW)  # the passes that send an input gradient upstream


class Action(NamedTuple):
    kind: str  # one of KINDS
    micro_batch: int
    chunk: int = 0

    def __repr__(self):
        return f"{self.kind}{self.micro_batch}" + (f"c{self.chunk}" if self.chunk else "")


class Paired(NamedTuple):
    forward: Action  # kind F
    backward: Action  # kind B (weights deferred) or BW (fused)

    def __repr__(self):
        return f"({self.forward!r}&{self.backward!r})"


def paired(forward, backward, fused=True):
    """Paired(F of `forward`, BW (fused) or B of `backward`), each given as (micro_batch, chunk)."""
    return Paired(Action(F, *forward), Action(BW if fused else B, *backward))


def actions(order):
    """The compute passes of an order, a Paired unit unfolded into its forward then its backward."""
    for item in order:
        if isinstance(item, Paired):
            yield item.forward
            yield item.backward
        else:
            yield item


def own_weight_next(order):
    """Indices of the B passes in one rank's order (Actions and Paired units, or (kind, micro_batch, chunk) tuples,
    anything else standing for a pass that is not one of those) whose next item is their own W, the same micro-batch
    and chunk. Such a B may compute its weight gradients while it waits for its collectives, the W computing what is
    left: the same works, added in the same order, nothing computing in between (overlap.run_alone; the simulator
    prices it so). The engines and the simulator both ask this."""
    def kind_key(item):
        return tuple(item) if isinstance(item, tuple) and not isinstance(item, Paired) and len(item) == 3 else None
    keys = [kind_key(item) for item in order]
    return {i for i in range(len(keys) - 1)
            if keys[i] is not None and keys[i][0] == B and keys[i + 1] == (W, *keys[i][1:])}

