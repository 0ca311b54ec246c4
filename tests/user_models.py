"""Models this project did not design for, written as a DeepSpeed user would: plain torch.nn layers in a
PipelineModule layer list. Each entry of MODELS gives the layers as
LayerSpecs / TiedLayerSpecs, seeded by DeepSpeed (`seed_layers`), so every rank and the single-process
reference build the same initial weights: plain nn.Linear layers (mlp), a tied input/output embedding
(tied), the tied head and its loss computed together in chunks of the vocabulary (tied-chunked,
schedules.chunked_head_loss), a tuple with an int64 mask between stages (masked), a sequence length that changes
from one micro-batch to the next (dynamic), convolutions (conv), Mixture-of-Experts blocks (experts).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

WIDTH, VOCAB, TOKENS, MICRO_BATCH = 16, 32, 6, 2
CHUNK = 12  # rows of the vocabulary per block of the chunked head: 12, 12 and 8


def mlp():
    """16 layers: plain torch.nn.Linear and ReLU, alternating (every model stage of p = 4 x 2 chunks gets a Linear)."""
    layers = []
    for _ in range(8):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.ReLU)]
    return layers


def mlp_batch(index):
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(MICRO_BATCH, WIDTH, generator=g), torch.randn(MICRO_BATCH, WIDTH, generator=g)


def tied_head(embedding, x):
    """The output head: the embedding's weight, transposed (a tied input/output embedding)."""
    return x @ embedding.weight.t()


class Block(nn.Module):
    """GELU(Linear(x)) + x: a plain nn.Linear inside a user's own block."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return F.gelu(self.fc(x)) + x


def tied():
    """A token embedding whose weight is also the output head (TiedLayerSpec with forward_fn), 8 blocks between."""
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH)]
    layers += [LayerSpec(Block, WIDTH) for _ in range(8)]
    return layers + [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=tied_head)]


def chunked_head(embedding, x):
    """A tied output head for the library's chunked loss (schedules.chunked_head_loss): (hidden, the embedding's
    weight), projected inside the loss."""
    from schedules.runtime.chunked_head import head_output
    return head_output(x, embedding.weight)


def tied_chunked():
    """`tied`, its head and loss computed together, a few rows of the vocabulary at a time (CHUNK)."""
    return tied()[:-1] + [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=chunked_head)]


def chunked_loss(outputs, labels):
    from schedules.runtime.chunked_head import chunked_head_loss
    return chunked_head_loss(outputs, labels, chunk=CHUNK)


class MaskedEmbedding(nn.Embedding):
    """Tokens -> (hidden states, int64 mask of the non-padding tokens): two tensors between stages from here on."""

    def forward(self, tokens):
        return super().forward(tokens), (tokens != 0).long()


class MaskedBlock(Block):
    """A Block that takes and passes on (hidden, mask), zeroing the padding positions."""

    def forward(self, inputs):
        x, mask = inputs
        return super().forward(x) * mask.unsqueeze(-1).to(x.dtype), mask


class MaskedHead(nn.Linear):
    def forward(self, inputs):
        return super().forward(inputs[0])


def masked():
    """(hidden, mask) tuples between every two stages: an embedding, 8 masked blocks, a plain Linear head."""
    return ([LayerSpec(MaskedEmbedding, VOCAB, WIDTH)] + [LayerSpec(MaskedBlock, WIDTH) for _ in range(8)]
            + [LayerSpec(MaskedHead, WIDTH, VOCAB)])


def token_batch(index):
    g = torch.Generator().manual_seed(2000 + index)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, TOKENS + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def conv():
    """A small conv net: 4 x (Conv2d 3x3, ReLU), flatten, a Linear classifier."""
    layers = [LayerSpec(nn.Conv2d, 3, 8, 3, padding=1), LayerSpec(nn.ReLU)]
    for _ in range(3):
        layers += [LayerSpec(nn.Conv2d, 8, 8, 3, padding=1), LayerSpec(nn.ReLU)]
    return layers + [LayerSpec(nn.Flatten), LayerSpec(nn.Linear, 8 * 6 * 6, 10)]


def image_batch(index):
    g = torch.Generator().manual_seed(3000 + index)
    return torch.randn(MICRO_BATCH, 3, 6, 6, generator=g), torch.randint(0, 10, (MICRO_BATCH, ), generator=g)


def varying_token_batch(index):
    """Micro-batches of 4, 5 or 6 tokens: a different sequence length from one micro-batch to the next."""
    tokens, labels = token_batch(index)
    length = 4 + index % 3
    return tokens[:, :length], labels[:, :length]


class ExpertBlock(nn.Module):
    """x + a Mixture of Experts of small MLPs: the library's ExpertLayer (DeepSpeed's top-2 gate and experts),
    its aux loss trained in place."""

    def __init__(self, width):
        super().__init__()
        import schedules
        self.moe = schedules.ExpertLayer(width, lambda e: nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                                         nn.Linear(2 * width, width)),
                                         num_experts=4, k=2, capacity_factor=0, aux_loss_coef=0.1)

    def forward(self, x):
        return x + self.moe(x)


def experts():
    """8 layers: a Linear, then Mixture-of-Experts blocks (every model stage of p = 2 x 2 chunks gets experts)."""
    return [LayerSpec(nn.Linear, WIDTH, WIDTH)] + [LayerSpec(ExpertBlock, WIDTH) for _ in range(7)]


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


MODELS = {  # name: (layers, loss, micro-batch of an index, PipelineModule arguments)
    "mlp": (mlp, F.mse_loss, mlp_batch, {}),
    "tied": (tied, cross_entropy, token_batch, {}),
    "masked": (masked, cross_entropy, token_batch, {}),
    "dynamic": (tied, cross_entropy, varying_token_batch, {"dynamic_shape": True}),
    "tied-chunked": (tied_chunked, chunked_loss, token_batch, {}),
    "conv": (conv, F.cross_entropy, image_batch, {}),
    "experts": (experts, F.mse_loss, mlp_batch, {}),
}
