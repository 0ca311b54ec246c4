"""Where the model's chunks live when a rank holds several of them.

One object answers, for the module (which layers a rank builds), the schedule (which passes
need a send or a receive), the engine (which rank a message goes to) and the simulator: chunk c
of rank r runs global stage `stage(r, c)`; its neighbour one stage downstream (+1) or upstream
(-1) is `neighbour(r, c, step)`, a (rank, chunk) pair or None at either end of the pipeline.

- Interleaved (Megatron-LM): v chunks per rank, chunk c of rank r is stage c*p + r.
- V (ZB-V, DualPipeV): chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r: rank 0 holds the
  first and the last stage; the turn at rank p-1 is local.
- Mirror (DualPipe): two copies of a p-stage model. Chunk 0 of rank r is stage r of copy 0,
  whose micro-batches flow from rank 0 to rank p-1; chunk 1 is stage p-1-r of copy 1, whose
  micro-batches flow from rank p-1 to rank 0. The chunk is the direction.

These are the chunked engine's placements: its sends are asynchronous, it keeps a received
gradient per micro-batch, and activations and gradients travel on two communicators. The last
matters: on the V and mirror placements the link from a rank to its neighbour carries the
activations of one chunk and the gradients of the other, which the schedules send and receive
in different orders; each kind on its own is in order, and a communicator per kind keeps the
two apart on any backend (NCCL ignores message tags).
"""
from schedules.simulate import Placement


class ChunkedPlacement(Placement):
    async_sends = True
    single_grad_slot = False
    channels_by_kind = True
    num_model_stages = None  # stages the model is cut into (set in __init__)

    def __init__(self, ranks):
        super().__init__(ranks)
        self.num_model_stages = self.num_stages

    def is_first(self, rank, chunk):
        return self.neighbour(rank, chunk, -1, self.direction(chunk)) is None

    def is_last(self, rank, chunk):
        return self.neighbour(rank, chunk, +1, self.direction(chunk)) is None


class InterleavedPlacement(ChunkedPlacement):
    chunks = 2  # v, the virtual stages per rank; see with_chunks()

    @classmethod
    def with_chunks(cls, v):
        return type(f"InterleavedPlacement{v}", (cls, ), {"chunks": v})

    def stage(self, rank, chunk):
        return chunk * self.ranks + rank


class VPlacement(ChunkedPlacement):
    chunks = 2

    def stage(self, rank, chunk):
        return rank if chunk == 0 else 2 * self.ranks - 1 - rank


class MirrorPlacement(ChunkedPlacement):
    chunks = 2

    def __init__(self, ranks):
        self.ranks = ranks
        self.num_stages = self.num_model_stages = ranks

    def stage(self, rank, chunk):
        return rank if chunk == 0 else self.ranks - 1 - rank

    def chunk_size(self, rank, chunk):
        return 1.0  # each copy of a stage is a full 1/p of the model

    def direction(self, chunk):
        return chunk

    def neighbour(self, rank, chunk, step, direction=None):
        nxt = rank + step if chunk == 0 else rank - step
        return (nxt, chunk) if 0 <= nxt < self.ranks else None
