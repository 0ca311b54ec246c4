"""Where the model's chunks live: which rank holds which model stage, for every placement.

One object answers, for the module (which layers a rank builds), the schedule (which passes
need a send or a receive), the engine (which rank a message goes to) and the simulator: chunk c
of rank r runs global stage `stage(r, c)`; its neighbour one stage downstream (+1) or upstream
(-1) is `neighbour(r, c, step)`, a (rank, chunk) pair or None at either end of the pipeline.

- Stock (DeepSpeed's engine, and the split-backward engine): rank r is stage r.
- DeepSpeed's DualPipeV: rank r holds stages r and 2p-1-r as its two phases.
- Interleaved (Megatron-LM): v chunks per rank, chunk c of rank r is stage c*p + r.
- V (ZB-V, DualPipeV): chunk 0 of rank r is stage r, chunk 1 is stage 2p-1-r: rank 0 holds the
  first and the last stage; the turn at rank p-1 is local.
- Mirror (DualPipe): two copies of a p-stage model. Chunk 0 of rank r is stage r of copy 0,
  whose micro-batches flow from rank 0 to rank p-1; chunk 1 is stage p-1-r of copy 1, whose
  micro-batches flow from rank p-1 to rank 0. The chunk is the direction.

Besides where chunks live, a placement states the traits of the engine that runs it which
decide how its messages meet (asynchronous sends, one received-gradient slot, batched p2p,
one communicator per message kind): the simulator models an engine through its placement.

The chunked placements are the chunked engine's: its sends are asynchronous, it keeps a received
gradient per micro-batch, and activations and gradients travel on two communicators. The last
matters: on the V and mirror placements the link from a rank to its neighbour carries the
activations of one chunk and the gradients of the other, which the schedules send and receive
in different orders; each kind on its own is in order, and a communicator per kind keeps the
two apart on any backend (NCCL ignores message tags).
"""
from schedules.errors import ScheduleError


class Placement:
    """Ranks hold `chunks` model chunks each; chunk (r, c) runs global stage `stage(r, c)`.

    Neighbours follow the stage order: activations go from stage s to s + 1 and gradients back.
    When both stages sit on one rank the hand-over is local (no message).
    """
    chunks = 1
    batched_p2p = False  # sends/receives only queue until CommitP2P
    tensor_meta = True  # the first activation send of each chunk is preceded by a blocking shape message
    single_grad_slot = False  # the engine keeps one received gradient at a time
    async_sends = False  # sends are posted (isend) and complete later; the stream waits for them at its end
    channels_by_kind = False  # activations and gradients travel on separate communicators (FIFO within each)
    # each channel's next receive is posted as soon as the one before it is taken, the first at the step's start
    # (schedules/runtime/receive_ahead.py, gloo): a message then crosses the link while its receiver computes
    receives_ahead = False
    # gloo moves a message once its receive is posted, and the receiver's ready-notice crosses the link behind the
    # bytes queued on it, its own sends to that peer: a receive counts as posted once those held the link. A
    # CommitP2P batch posts its sends before its receives (DeepSpeed's DualPipeVEngine; two emulated nodes at
    # 50 Mbit/s, 128 KiB each way: 81 ms on the rank that posted later, 42 with its receives posted first); a
    # receive posted ahead right after a send to that peer waits as well (interleaved at 50 Mbit/s: the simulator
    # 0.95x the measured step without it, 1.02x with it). Whatever the communicator: the link is one queue.
    notice_behind_sends = True
    handlers = {}  # engine-specific overrides of the simulator's instruction handlers

    def __init__(self, ranks):
        self.ranks = ranks
        self._owner = {self.stage(r, c): (r, c) for r in range(ranks) for c in range(self.chunks)}
        assert len(self._owner) == ranks * self.chunks, 'override neighbour() when stages repeat'
        self.num_stages = len(self._owner)

    def stage(self, rank, chunk):
        return rank

    def chunk_size(self, rank, chunk):
        """Share of the model in units of one 1F1B stage (1/p of the model)."""
        return self.ranks / self.num_stages

    def chunk_of(self, rank, instr):
        return instr.kwargs.get('chunk', instr.kwargs.get('phase', 0))

    def neighbour(self, rank, chunk, step, direction=None):
        """(rank, chunk) holding the stage `step` (+1 downstream, -1 upstream) away, or None."""
        return self._owner.get(self.stage(rank, chunk) + step)

    def owner(self, stage):
        """(rank, chunk) that runs model stage `stage` (of the first direction, where there are two)."""
        return self._owner[stage]

    def direction(self, chunk):
        """Which stream of micro-batches a chunk serves (None: the only one)."""
        return None


# --- one chunk per rank ------------------------------------------------------------------------

class StockPlacement(Placement):
    """DeepSpeed's PipelineEngine: rank r runs stage r, sends activations to r+1, grads to r-1."""
    single_grad_slot = True  # _exec_recv_grads writes self.grad_layer, read by the next backward

    def chunk_of(self, rank, instr):
        extra = set(instr.kwargs) - {'buffer_id'}
        if extra:  # the stock engine calls its handlers with **kwargs and would raise
            raise ScheduleError(f'rank {rank}: the stock PipelineEngine cannot run {instr!r} '
                                f'(its handlers take only buffer_id, not {sorted(extra)})')
        return 0


class SplitBackwardPlacement(StockPlacement):
    """SplitBackwardEngine: the stock placement, with asynchronous sends and a received gradient
    kept per micro-batch, and receives posted ahead."""
    async_sends = True
    receives_ahead = True
    single_grad_slot = False


class DualPipeVPlacement(Placement):
    """DeepSpeed's DualPipeVEngine: rank r holds stage r (phase 0) and 2p-1-r (phase 1).

    Chunk = instruction's phase. Phase 0 sends activations to r+1, phase 1 to r-1, as in
    _downstream_stage(); on the last rank phase 0 hands over to phase 1 locally (the engine
    copies the outputs), which the stage order below gives: stages p-1 and p share rank p-1.
    """
    chunks = 2
    batched_p2p = True

    def stage(self, rank, chunk):
        return rank if chunk == 0 else 2 * self.ranks - 1 - rank

    def chunk_of(self, rank, instr):
        return instr.kwargs.get('phase', 0)  # LoadMicroBatch carries no phase: it fills phase 0


# --- several chunks per rank (ChunkedEngine) ----------------------------------------------------


class ChunkedPlacement(Placement):
    async_sends = True
    receives_ahead = True
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
        """The placement with `v` chunks per rank: one class per v, kept in this module so that it pickles (a
        traced run gathers its ranks' records, placement included)."""
        name = f"{cls.__name__}{v}"
        if name not in globals():
            globals()[name] = type(name, (cls, ), {"chunks": v, "__module__": __name__})
        return globals()[name]

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

    def owner(self, stage):
        return stage, 0

    def holders(self, stage):
        """Every rank holding a copy of model stage `stage`."""
        return {stage, self.ranks - 1 - stage}

    def chunk_size(self, rank, chunk):
        return 1.0  # each copy of a stage is a full 1/p of the model

    def direction(self, chunk):
        return chunk

    def neighbour(self, rank, chunk, step, direction=None):
        nxt = rank + step if chunk == 0 else rank - step
        return (nxt, chunk) if 0 <= nxt < self.ranks else None
