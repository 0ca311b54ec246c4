"""The vocabulary head split over the pipeline: one slice of the output layer per rank, as layers.

A language model's output layer (V x h) and its cross-entropy can be most of the model's work (GPTlite
small: 89%), and one layer cannot be cut by DeepSpeed's partitioning, so the rank holding it works while
the others wait. Here the head is `parts` consecutive pipeline layers, `VocabSlice` k holding rows
[start_k, stop_k) of the weight. Each computes its logits and carries the online softmax on:

    (hidden, labels)            -> slice 0   -> (hidden, lse, z, labels)
    (hidden, lse, z, labels)    -> slice k   -> (hidden, logaddexp(lse, lse_k), z + z_k, labels)

where lse_k is the log-sum-exp of the slice's logits and z_k the target's logit where the target falls
in the slice (0 elsewhere). After the last slice lse is the log-sum-exp over the whole vocabulary and z
the target's logit, so `vocab_parallel_loss` = mean(lse - z) is the cross-entropy, exactly up to the
order of summation; autograd through the chain gives the exact gradients, and only point-to-point
messages pass between the slices (no collective). No rank ever holds more than its slice's logits.

On a placement whose last chunk visits every rank (the V placement of ZB-V, DualPipeV, V-Half, V-Min;
Interleaved 1F1B's last chunk) each rank holds one slice: the head's work and its logits are shared
by every rank. The pipeline module (pipe_module.py) gives each slice a model stage of its own, cuts the
layers before them (the trunk) over the other stages, and carries the labels from the first stage to
the slices: the pipeline's inputs are `(inputs, labels)` (`with_labels`), and the trunk's layers never
see the labels.

Memory. A slice keeps what its backward needs from its forward until the slices after it have answered, so
in a pipeline slice k holds about p - k micro-batches at once (the first the most, the last one) where a
rank's other stages hold theirs too. `slice_layout` evens the ranks out: every slice but the last computes
most of its logits again in its backward instead of keeping them (`VocabSlice(recompute=...)`), and gets
fewer rows for that extra work, so that each slice's peak and its time come out alike
(docs/vocab-parallel.md#memory).
"""
import torch

from schedules.registry import splitting_schedules
from schedules.runtime.chunked_head import head_statistics
from schedules.runtime.weight_grad import Linear


def vocab_bounds(vocab_size, part, parts, rows=None):
    """[start, stop) of the vocabulary rows slice `part` of `parts` holds: an even split (sizes differ by at most
    one), or `rows`, every slice's row count in order (summing to `vocab_size`, see `vocab_rows`)."""
    if not 0 <= part < parts:
        raise ValueError(f"slice {part} of {parts}: needs 0 <= part < parts")
    if rows is not None:
        rows = [int(n) for n in rows]
        if len(rows) != parts or sum(rows) != vocab_size or min(rows) < 1:
            raise ValueError(f"rows {rows}: needs {parts} positive row counts summing to the vocabulary's "
                             f"{vocab_size}")
        start = sum(rows[:part])
        return start, start + rows[part]
    base, extra = divmod(vocab_size, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


def vocab_rows(vocab_size, shares):
    """Row counts proportional to `shares` (one per slice), summing to `vocab_size` (largest remainders)."""
    total = float(sum(shares))
    exact = [vocab_size * s / total for s in shares]
    rows = [int(x) for x in exact]
    for i in sorted(range(len(rows)), key=lambda i: rows[i] - exact[i])[:vocab_size - sum(rows)]:
        rows[i] += 1
    return rows


RECOMPUTE_COST = 0.4  # a recomputed row's extra backward time over a kept row's forward + backward + W (measured:
# GPTlite small's slices, 128 wide, 256 tokens, one CPU thread; the recompute is one more projection and exponential)


def slice_layout(vocab_size, parts, recompute=True, cost=RECOMPUTE_COST, in_flight=None):
    """(rows, recompute) of the `parts` slices: each slice's row count and the share of its rows that its backward
    recomputes (`VocabSlice`'s `rows` and `recompute`).

    Slice k keeps what it keeps of a micro-batch until the slices after it answer: n_k micro-batches at once
    (`in_flight`, default p - k, as on ZB-V and DualPipeV), plus during its backward the logits it recomputes. Of
    r rows with a share q recomputed it holds at most r (n_k (1 - q) + q) rows' worth of logits and works
    r (1 + cost q) rows' worth of time (`cost`: RECOMPUTE_COST). q_k = (n_k - 1) / (n_k - 1 + cost) makes the
    two factors equal, n_k (1 - q) + q = 1 + cost q, and rows in proportion to 1 / (1 + cost q_k) then give
    every slice the same peak (one micro-batch of the last slice's rows) and the same time. The last slice
    (n = 1) keeps all of its logits: it gets the most rows. `recompute=False`: an even split, nothing recomputed."""
    if not recompute:
        return vocab_rows(vocab_size, [1] * parts), [0.0] * parts
    n = list(in_flight) if in_flight is not None else [parts - k for k in range(parts)]
    if len(n) != parts or min(n) < 1:
        raise ValueError(f"in_flight {n}: one count >= 1 per slice")
    q = [(nk - 1) / (nk - 1 + cost) if nk > 1 else 0.0 for nk in n]
    return vocab_rows(vocab_size, [1 / (1 + cost * qk) for qk in q]), q


class VocabSlice(Linear):
    """Rows [start, stop) of a `vocab_size` x `width` output head (no bias): one pipeline layer of the split
    head. Its weight gradient can be deferred to a W pass, as this package's deferrable Linear's.

    `weight`: the full head's (vocab_size, width) weight to take the rows from, e.g. an unsplit model's
    initial head, so the split model starts identical to it. `rows`: every slice's row count (`vocab_bounds`),
    else an even split. `recompute`: the share of the slice's rows (its last ones) whose logits its backward
    computes again from its input instead of keeping them from the forward (0: keep all, 1: recompute all;
    `slice_layout` chooses it per slice); kept, the logits cost one tensor of their size per micro-batch from the
    forward to the backward, recomputed a matrix multiply and an exponential more in the backward."""

    def __init__(self, width, vocab_size, part, parts, weight=None, recompute=0.0, rows=None):
        self.vocab_size, self.part, self.parts = vocab_size, part, parts
        self.start, self.stop = vocab_bounds(vocab_size, part, parts, rows)
        if not 0.0 <= float(recompute) <= 1.0:
            raise ValueError(f"VocabSlice: recompute {recompute}: a share of the slice's rows, 0 to 1")
        self.recomputed = round(float(recompute) * (self.stop - self.start))  # rows whose logits B computes again
        super().__init__(width, self.stop - self.start, bias=False)
        if weight is not None:
            if tuple(weight.shape) != (vocab_size, width):
                raise ValueError(f"VocabSlice: weight of shape {tuple(weight.shape)}, "
                                 f"expected ({vocab_size}, {width})")
            with torch.no_grad():
                self.weight.copy_(weight[self.start:self.stop])

    def forward(self, state):
        if not isinstance(state, tuple) or len(state) not in (2, 4):
            raise TypeError("VocabSlice takes (hidden, labels) from the layer before the head, or (hidden, lse, z, "
                            "labels) from the slice before; its pipeline's inputs must be (inputs, labels): see "
                            "schedules.vocab_parallel.with_labels")
        hidden, *carry, labels = state
        kept = self.stop - self.start - self.recomputed
        lse, z = head_statistics(hidden, self.weight, labels - self.start, kept)
        if carry:
            lse, z = torch.logaddexp(carry[0], lse), carry[1] + z
        return hidden, lse, z, labels

    def extra_repr(self):
        recomputed = f", {self.recomputed} recomputed in the backward" if self.recomputed else ""
        return f"{super().extra_repr()}, rows {self.start}:{self.stop} (slice {self.part} of {self.parts}){recomputed}"


def vocab_parallel_loss(outputs, labels=None):
    """The cross-entropy from the last slice's (hidden, lse, z, labels): mean over tokens of lse - z (the
    mean reduction of torch.nn.functional.cross_entropy). Use it as the PipelineModule's `loss_fn`."""
    _, lse, z, _ = outputs
    return (lse - z).mean()


def with_labels(inputs, labels):
    """A micro-batch for a pipeline with a split head: the labels ride with the inputs (to reach every
    slice), and stay the batch's labels: `((inputs, labels), labels)`."""
    return (inputs, labels), labels


def is_vocab_slice(layer):
    """Whether a layer-list entry (module, LayerSpec, or class) is a VocabSlice."""
    cls = getattr(layer, 'typename', layer if isinstance(layer, type) else type(layer))
    return isinstance(cls, type) and issubclass(cls, VocabSlice)


def refusal(what):
    """The one-line error for a split head where `what` cannot run it."""
    return (f"a split vocabulary head needs a schedule whose last chunk visits every rank, one slice each "
            f"({', '.join(splitting_schedules())}): {what}")


def count_slices(layers):
    """How many trailing entries of a layer list are VocabSlices; raises if slices are not all at the end."""
    flags = [is_vocab_slice(layer) for layer in layers]
    n = sum(flags)
    if n and not all(flags[len(flags) - n:]):
        raise ValueError("VocabSlice layers must be the last layers of the list (the head, after the trunk)")
    return n


def merge_slices(state, first_index, parts):
    """A layer-indexed state dict (`"12.weight"`) with the `parts` slices at layer indices first_index ..
    first_index + parts - 1 merged into one unsplit head at `first_index` (its `weight`, V x h)."""
    keys = [f"{first_index + k}.weight" for k in range(parts)]
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"merge_slices: no {missing} in the state")
    merged = {k: v for k, v in state.items() if k not in keys}
    merged[keys[0]] = torch.cat([state[k] for k in keys])
    return merged
