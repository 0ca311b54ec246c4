"""An all-to-all of equal splits that posts its receives before its sends: the experts' token exchange on gloo.

Why not `torch.distributed.all_to_all_single` on gloo: gloo posts each peer's send before its receive, and moves a
message only once the receiver has told the sender that its receive is posted. That notice travels on the same
connection as the data, so the rank that enters the all-to-all last sends its notice behind its own bytes: the
other rank learns it may send only once those bytes have crossed, and the two ways cross one after the other.
The rank that was late ends last, so it is late again at the next all-to-all. Measured between two emulated nodes
(0.5 MiB each way, ranks computing 8-30 ms between exchanges, no barrier), every exchange took twice its wire
time: 16 ms at 500 Mbit/s and 27 ms at 300 (wire 8.4 and 14). Receives posted first send their notices before any
byte: 10 and 14 ms.

NCCL keeps torch's all-to-all: there a receive blocks its stream until the matching send starts, so the receives
first on every rank would wait for each other; and it has no notices behind bytes.
"""
import torch.distributed as dist


class Posted:
    """The receives and sends of one all-to-all in flight, as one torch Work (`wait`, `is_completed`)."""

    def __init__(self, works):
        self.works = works

    def is_completed(self):
        return all(work.is_completed() for work in self.works)

    def wait(self):
        for work in self.works:
            work.wait()
        return True


def receives_first(group):
    """Whether this group's all-to-alls post their receives before their sends (gloo; see the module docstring)."""
    return dist.get_backend(group) == "gloo"


def post_all_to_all(out, x, group):
    """`out` (as `x`, contiguous) gets, in its i-th of `ranks` equal parts along dim 0, the part of rank i's `x` meant
    for this rank, as `all_to_all_single(out, x, group=group)`; started, not waited for: a Work."""
    if not receives_first(group):
        return dist.all_to_all_single(out, x, group=group, async_op=True)
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % ranks:
        raise ValueError(f"an all-to-all of equal splits over {ranks} ranks needs dim 0 a multiple of {ranks}, "
                         f"got {tuple(x.shape)}")
    ins, outs = out.chunk(ranks), x.chunk(ranks)
    peers = [(me + k) % ranks for k in range(1, ranks)]  # every other rank (all posted before any wait: any order)
    works = [dist.irecv(ins[peer], group=group, group_src=peer) for peer in peers]
    works += [dist.isend(outs[peer], group=group, group_dst=peer) for peer in peers]
    ins[me].copy_(outs[me])
    return Posted(works)
