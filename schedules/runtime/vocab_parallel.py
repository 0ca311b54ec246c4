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
"""
import torch

from schedules.registry import splitting_schedules
from schedules.runtime.weight_grad import Linear


def vocab_bounds(vocab_size, part, parts):
    """[start, stop) of the vocabulary rows slice `part` of `parts` holds (sizes differ by at most one)."""
    if not 0 <= part < parts:
        raise ValueError(f"slice {part} of {parts}: needs 0 <= part < parts")
    base, extra = divmod(vocab_size, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


class VocabSlice(Linear):
    """Rows [start, stop) of a `vocab_size` x `width` output head (no bias): one pipeline layer of the split
    head. Its weight gradients can be deferred to W passes (it is this package's deferrable Linear).

    `weight`: the full head's (vocab_size, width) weight to take the rows from, e.g. an unsplit model's
    initial head, so the split model starts identical to it."""

    def __init__(self, width, vocab_size, part, parts, weight=None):
        self.vocab_size, self.part, self.parts = vocab_size, part, parts
        self.start, self.stop = vocab_bounds(vocab_size, part, parts)
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
        logits = super().forward(hidden).float()  # the softmax in fp32, as for an unsplit head
        lse, z = _LogSumExpAndTarget.apply(logits, labels - self.start)
        if carry:
            lse, z = torch.logaddexp(carry[0], lse), carry[1] + z
        return hidden, lse, z, labels

    def extra_repr(self):
        return f"{super().extra_repr()}, rows {self.start}:{self.stop} (slice {self.part} of {self.parts})"


class _LogSumExpAndTarget(torch.autograd.Function):
    """(log-sum-exp of each row of `logits`, the logit at column `target` where 0 <= target < columns, else 0),
    keeping one tensor the size of the logits for the backward: exp(logits - max), whose rows scaled by the
    incoming gradient over their sum are the gradient (torch.logsumexp keeps its input and recomputes the
    exponentials, in more passes over the slice's logits, the largest tensor of the head)."""

    @staticmethod
    def forward(ctx, logits, target):
        inside = (target >= 0) & (target < logits.shape[-1])
        index = target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        z = logits.detach().gather(-1, index).squeeze(-1).masked_fill_(~inside, 0.0)
        top = logits.detach().amax(dim=-1, keepdim=True)
        # in place: the logits are this function's alone (the projection's backward keeps its input and weight)
        exp = logits.detach().sub_(top).exp_()
        total = exp.sum(dim=-1)
        ctx.save_for_backward(exp, total, index, inside)
        return top.squeeze(-1) + total.log(), z

    @staticmethod
    def backward(ctx, grad_lse, grad_z):
        exp, total, index, inside = ctx.saved_tensors
        grad = exp * (grad_lse / total).unsqueeze(-1)
        grad.scatter_add_(-1, index, grad_z.masked_fill(~inside, 0.0).unsqueeze(-1))
        return grad, None


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
