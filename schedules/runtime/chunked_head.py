"""A language model's output layer and cross-entropy computed together, by online softmax over blocks of the
vocabulary's rows, its gradient exact by hand: the one implementation of that math, for the whole head in chunks
(`ChunkedHead` and `linear_cross_entropy`, here) and for the split head's slices (vocab_parallel.py, `VocabSlice`).

    loss = mean over tokens of lse - z,  lse = log-sum-exp of hidden @ weight^T,  z = the target's logit

`head_statistics` gives (lse, z) per token for any rows of the weight. It never holds a block's logits longer
than it needs: the forward computes each block (`chunk` rows), folds its log-sum-exp into the running one and
drops it; the backward computes each block again, turns it into its softmax times the incoming gradient (plus
the target's), uses it for the input's gradient and the weight's, and drops it. So the whole head of a micro-batch
holds one block of logits where nn.Linear + F.cross_entropy keep the vocabulary's log-softmax (GPTlite small, 4 x
64 tokens: 2048 rows, 2 MiB, against 49 MiB), at the price of computing the logits twice
(docs/vocab-parallel.md#the-whole-head-in-chunks). The forward may keep its first `kept` rows' exponentials instead
(no second multiply, one tensor of their size kept): a slice's kept rows, the whole head's `keep` share.

Inside a deferring backward (a B pass, weight_grad.py) the weight's gradient goes to the W pass, which then keeps
the blocks' gradients (the logits' size) until it runs, as the deferrable Linear keeps its output gradient.
"""
import torch
import torch.nn.functional as F

from schedules.runtime import weight_grad
from schedules.runtime.weight_grad import Linear, _first_grad, defer_or_compute

CHUNK_ROWS = 2048  # rows per block of the whole head: the fastest of 2048, 4096, 8192 on a CPU core for GPTlite small
# (width 128, 256 tokens) and GPT-2 small's shape (768, 64 tokens), scripts/benchmark_head.py (docs/vocab-parallel.md)
KEEP = 0.0  # the share of the whole head's rows whose exponentials the forward keeps: none, the least memory


def head_statistics(hidden, weight, target, kept=0, chunk=None):
    """(log-sum-exp of each token's logits hidden @ weight^T, the logit at column `target` where it falls in the
    rows, else 0), in fp32, exact gradients. `kept`: of the first rows the forward keeps exp(logits - max) for the
    backward (VocabSlice's kept rows); the others are computed in blocks of `chunk` rows (None: one block) in the
    forward and again in the backward."""
    return _HeadStatistics.apply(hidden, weight, target, kept, chunk)


def _row_blocks(kept, rows, chunk):
    """[start, stop) of each block: the kept rows, then the others, `chunk` at a time (None: each in one block)."""
    for first, last in ((0, kept), (kept, rows)):
        step = max(chunk or last - first, 1)
        for start in range(first, last, step):
            yield start, min(start + step, last)


def _target_logit(logits, target):
    """Each token's logit at its target column where 0 <= target < columns, else 0."""
    inside = (target >= 0) & (target < logits.shape[-1])
    return logits.gather(-1, target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1).masked_fill_(~inside, 0)


def _statistics(logits, target):
    """Of a block of fp32 logits (turned in place into exp(logits - top)) and each token's target column in it:
    (top, exp, the sum of exp, the target's logit where 0 <= target < columns, else 0)."""
    z = _target_logit(logits, target)
    top = logits.amax(dim=-1, keepdim=True)
    exp = logits.sub_(top).exp_()
    return top.squeeze(-1), exp, exp.sum(dim=-1), z


class _RunningLogSumExp:
    """The log-sum-exp over blocks, each given as (its max, the sum of its exp(logits - max)): carried in fp64 as
    (max, sum), rescaled to each new max (online softmax), one log at the end. Each block's log-sum-exp in fp32
    combined by logaddexp would round at the log-sum-exp's magnitude once per block: 1.9e-6 off torch's loss on
    GPTlite small's 13 blocks of 4096 rows, this 0 (scripts/benchmark_head.py)."""

    def __init__(self):
        self.top = self.total = None

    def add(self, top, total):
        top, total = top.double(), total.double()
        if self.top is None:
            self.top, self.total = top, total
            return
        new = torch.maximum(self.top, top)
        self.total = self.total.mul_((self.top - new).exp_()).add_(total.mul_((top - new).exp_()))
        self.top = new

    def value(self):
        return (self.top + self.total.log()).float()


def _add_target(grad, target, grad_z):
    """grad[token, target] += grad_z[token] where the target falls in this block of columns."""
    inside = (target >= 0) & (target < grad.shape[-1])
    grad.scatter_add_(-1, target.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), grad_z.masked_fill(~inside, 0.0)
                      .unsqueeze(-1))


class _HeadStatistics(torch.autograd.Function):
    """`head_statistics`. Of the first `kept` rows the forward keeps exp(logits - max) for the backward (one tensor
    of their logits' size), which the backward turns in place into their gradient, softmax x the incoming gradient
    (+ the target's): torch.logsumexp would keep the logits and compute the exponentials again. Of the other rows
    it keeps nothing but its input and the per-token log-sum-exp: the backward computes their logits again, a block
    at a time (one multiply and an exponential more), and memory trackers are told of each block while it lives
    (`_holding`), as of what a deferred weight gradient keeps. The weight's gradient goes to the W pass as the
    deferrable Linear's (the logits' gradient kept until W runs), or is computed block by block at once outside a
    deferring backward (each block's gradient used for the input's and the weight's, then dropped)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, kept, chunk):
        tops, exps, lse, z = [], [], _RunningLogSumExp(), None
        for a, b in _row_blocks(kept, weight.shape[0], chunk):
            block_top, block_exp, block_sum, block_z = _statistics(F.linear(hidden, weight[a:b]).float(), target - a)
            if a < kept:
                tops.append(block_top)
                exps.append(block_exp)
            lse.add(block_top, block_sum)
            z = block_z if z is None else z + block_z
        lse = lse.value()
        ctx.kept, ctx.chunk, ctx.done = kept, chunk, False
        # the parameter itself, whose .grad W may set (weight_grad: not through saved tensors), or the weight that is
        # not one (computed from parameters: its gradient goes back through autograd)
        ctx.weight, ctx.leaf = _parameter(weight)
        ctx.save_for_backward(hidden, target, lse, *tops, *exps)
        return lse, z

    @staticmethod
    def backward(ctx, grad_lse, grad_z):
        if ctx.done:
            raise RuntimeError("a vocabulary head's backward ran twice over one forward (retain_graph): its backward "
                               "turns what it kept into the gradient in place")
        ctx.done = True
        hidden, target, lse, *kept = ctx.saved_tensors
        tops, exps = kept[:len(kept) // 2], kept[len(kept) // 2:]  # of each kept block
        weight = ctx.weight
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        # W keeps every block's gradient: they are made all at once
        defer = want_weight and ctx.leaf and weight_grad.deferring()
        grad_hidden, held = [], []

        def blocks():
            """Each block of the logits' gradient in turn, its share of the input's gradient added on the way."""
            for i, (a, b) in enumerate(_row_blocks(ctx.kept, weight.shape[0], ctx.chunk)):
                if a < ctx.kept:  # exp(logits - top) * exp(top - lse) is the softmax over the kept rows
                    grad = exps[i].mul_((grad_lse * (tops[i] - lse).exp()).unsqueeze(-1))
                else:
                    grad = _recomputed_softmax(hidden, weight[a:b], lse, grad_lse)
                    if not defer:
                        held.clear()  # the block before is dropped: one block of logits at a time
                    held.extend(_holding(grad))
                _add_target(grad, target - a, grad_z)
                if want_hidden:  # summed over the blocks in fp32: in bf16 each block's sum rounded once, not each sum
                    part = grad @ weight[a:b].float()
                    grad_hidden.append(part) if not grad_hidden else grad_hidden[0].add_(part)
                yield a, b, grad.to(hidden.dtype)
        work = _DeferredHeadGrad(weight, hidden, list(blocks()) if defer else blocks())
        grads = {}
        if want_weight and not ctx.leaf:  # to autograd, whatever the engine adds in place or defers
            grads = {id(weight): work._into(None)}
        elif want_weight:  # deferred: queued with its blocks; else computed now, the blocks made as it consumes them
            grads = defer_or_compute(work, hidden, *(g for *_, g in work.blocks)) if defer else \
                defer_or_compute(work, hidden)
        else:
            for _ in work.blocks:
                pass
        held.clear()  # the trackers stop counting the blocks (a deferred W's work holds its own)
        grad_hidden = grad_hidden[0].to(hidden.dtype) if grad_hidden else None
        return grad_hidden, grads.get(id(weight)), None, None, None


def _parameter(weight):
    """(the tensor whose .grad the weight's gradient goes to, whether that is a leaf): the weight, or the leaf it
    views whole (`head_output`)."""
    base = weight._base if weight._base is not None and weight._base.shape == weight.shape else weight
    return (base, True) if base.is_leaf else (weight, False)


def _recomputed_softmax(hidden, rows, lse, grad_lse):
    """exp(hidden @ rows^T - lse) * grad_lse per token, in fp32: the logits computed again, turned into their
    softmax times the incoming gradient. In fp32 with a positive incoming gradient (a loss's) the shift
    lse - log(grad_lse) rides in the multiply (addmm) and one exponential pass follows; else three passes."""
    if hidden.dtype == torch.float32 and bool((grad_lse > 0).all()):
        shift = (grad_lse.log() - lse).reshape(-1, 1)
        out = torch.addmm(shift, hidden.reshape(-1, hidden.shape[-1]), rows.t()).exp_()
        return out.view(*lse.shape, rows.shape[0])
    return F.linear(hidden, rows).float().sub_(lse.unsqueeze(-1)).exp_().mul_(grad_lse.unsqueeze(-1))


class _DeferredHeadGrad:
    """The head's weight-gradient work for one micro-batch (weight_grad.defer_or_compute): the gradient of its
    rows a..b is g^T @ x for each block (a, b, g) of its logits' gradient. `blocks`: a list (kept for a W pass), or
    an iterator that makes them as they are consumed (a backward computing the weight's gradient at once)."""
    __slots__ = ('weight', 'x', 'blocks', '_tokens')

    def __init__(self, weight, x, blocks):
        self.weight, self.x, self.blocks, self._tokens = weight, x, blocks, None

    def _into(self, out):
        x = self.x.reshape(-1, self.x.shape[-1])
        out = torch.empty_like(self.weight) if out is None else out
        for a, b, g in self.blocks:  # the blocks cover every row
            torch.mm(g.reshape(-1, b - a).t(), x, out=out[a:b])
        return out

    def gradients(self):
        return [(self.weight, lambda: self._into(None))]

    def accumulate(self):
        weight = self.weight
        if weight.grad is None:
            _first_grad(weight, self._into)
            return
        x = self.x.reshape(-1, self.x.shape[-1])
        for a, b, g in self.blocks:
            weight.grad[a:b].addmm_(g.reshape(-1, b - a).t(), x)


def _holding(tensor):
    """Tokens that make the memory trackers (schedules/observe/memory.py) count `tensor` as held until they are
    dropped, as they count what a deferred weight gradient keeps: logits computed again in a backward are activation
    memory too."""
    return [holder.hold(tensor) for holder in weight_grad._holders]


class ChunkedHead(Linear):
    """A vocabulary head (`vocab_size` x `width`, no bias) whose projection runs inside its loss: its forward
    returns (hidden, weight), which `chunked_head_loss` (the pipeline's `loss_fn`) turns into the cross-entropy by
    `linear_cross_entropy`, never holding the vocabulary's logits. An nn.Linear: its weight keeps the name, shape,
    initialisation and checkpoints of a plain head's; `logits(outputs)` gives them where they are wanted."""

    def __init__(self, width, vocab_size):
        super().__init__(width, vocab_size, bias=False)

    def forward(self, hidden):
        return head_output(hidden, self.weight)


def head_output(hidden, weight):
    """What a head whose projection runs in its loss returns: (hidden, a view of the weight), the loss's inputs (a
    tied head: the embedding's weight). Through a view the weight's gradient reaches one of the module's outputs
    before it is added to the weight: DeepSpeed's engine starts each backward (its BF16 optimizer clears the
    gradients there) when the first gradient reaches an output of the model, which a leaf never does."""
    return hidden, weight.view_as(weight)


def logits(outputs):
    """The logits a ChunkedHead's outputs (hidden, weight) stand for (for sampling or inspection)."""
    hidden, weight = outputs
    return F.linear(hidden, weight)


def linear_cross_entropy(hidden, weight, labels, chunk=CHUNK_ROWS, keep=KEEP, ignore_index=-100):
    """F.cross_entropy(F.linear(hidden, weight) over tokens, labels) with its mean reduction and ignored labels,
    computed `chunk` rows of the weight at a time (`head_statistics`): the same loss within summation order, its
    gradients exact. `keep`: the share of the rows whose exponentials the forward keeps for the backward (the rest
    are computed again there, one block held at a time). Tied weights: pass the embedding's."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    counted = labels != ignore_index
    if not bool(counted.all()):  # as torch: the mean over the labels not ignored
        hidden, labels = hidden[counted], labels[counted]
    lse, z = head_statistics(hidden, weight, labels, round(keep * weight.shape[0]), chunk)
    return (lse - z).mean()  # torch's mean reduction


def chunked_head_loss(outputs, labels, chunk=CHUNK_ROWS, keep=KEEP):
    """The cross-entropy of a ChunkedHead's (hidden, weight) against `labels`: a PipelineModule's `loss_fn`."""
    hidden, weight = outputs
    return linear_cross_entropy(hidden, weight, labels, chunk, keep)
