"""GPTlite: a small GPT-2-style decoder, and its DeepSpeed pipeline builds.

    idx (B,T) -> EmbeddingsSum -> Block x n_layer -> LayerNorm -> lm_head -> (hidden, head weight) -> loss

The head's projection runs inside the loss, the vocabulary in chunks (schedules/runtime/chunked_head.py):
`head_loss(head)` takes the head's (hidden, weight), keeping the exponentials of its logits for the backward
(`head="chunked"`) or computing them again there (`"recompute"`), or the logits of `head="linear"` (nn.Linear and
torch's cross-entropy).

- `GPTlite`: the plain model (what runs without a pipeline).
- `GPTlite.to_layers()`: the same modules as the ordered list `PipelineModule(layers=...)` takes;
  every rank holds every layer (the list keeps them alive), only its own are trained.
- `GPTlitePipeSpec`: the memory-efficient build from `LayerSpec`s: each rank builds only the
  layers of its own stage.
- `get_model(...)`: one of the three, from train.py's flags.

Every layer draws its initial parameters from a seed given by its index (see layers.py), so
all three builds start from identical weights.
"""
import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers import SeededLayerSpec, build_layer
from schedules.runtime.chunked_head import ChunkedHead, chunked_head_loss
from schedules.runtime.moe import ExpertLayer
from schedules.runtime.pipe_module import LayerPipe, run_layers
from schedules.runtime.vocab_parallel import VocabSlice, refusal, slice_layout, vocab_parallel_loss
from schedules.runtime.weight_grad import Embedding, Linear  # whose weight gradients a W pass can defer


@dataclass(frozen=True)
class GPTliteConfig:
    vocab_size: int = 50257  # GPT-2 BPE
    block_size: int = 256    # context length
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    seed: int = 0            # layer i is initialised from seed LAYER_SEED_BASE + seed + i
    head: str = "chunked"    # the whole head: its projection in the loss ("chunked", "recompute"); "linear": logits
    # Mixture of Experts (schedules/runtime/moe.py): the blocks in `moe_blocks` have `moe_experts` MLPs and a top-k
    # gate instead of one MLP, sharded over `expert_parallel_size` data-parallel ranks of their stage
    moe_experts: int = 0     # 0: no experts
    moe_blocks: tuple = ()   # block indices (0-based) that carry experts
    moe_top_k: int = 1
    moe_capacity_factor: float = 1.0  # 0: no token dropped
    moe_min_capacity: int = 4
    moe_aux_coef: float = 0.01  # the load-balancing loss's weight
    expert_parallel_size: int = 1


MODEL_SIZES = {
    "tiny": GPTliteConfig(block_size=32, n_layer=4, n_head=2, n_embd=32),       # tests
    "small": GPTliteConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),     # CPU demo
    "medium": GPTliteConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),   # nanoGPT "baby GPT"
    "gpt2": GPTliteConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small
}


class EmbeddingsSum(nn.Module):
    """Token + position embeddings: the first pipeline layer (integer input, float output)."""

    def __init__(self, config: GPTliteConfig):
        super().__init__()
        self.tok_emb = Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


class CausalSelfAttention(nn.Module):

    def __init__(self, config: GPTliteConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = config.n_head
        self.qkv = Linear(config.n_embd, 3 * config.n_embd)
        self.proj = Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):

    def __init__(self, config: GPTliteConfig):
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd)
        self.proj = Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


def _residual_init(proj: nn.Linear, config: GPTliteConfig):
    nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))  # GPT-2's scaled init into the residual


def _expert(config: GPTliteConfig):
    mlp = MLP(config)
    _residual_init(mlp.proj, config)
    return mlp


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); with `experts`, the MLP is a Mixture of
    Experts of MLPs (ExpertLayer: DeepSpeed's top-k gate, the aux loss trained in place)."""

    def __init__(self, config: GPTliteConfig, experts: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        if experts:
            self.mlp = ExpertLayer(config.n_embd, lambda e: _expert(config), config.moe_experts,
                                   ep_size=config.expert_parallel_size, k=config.moe_top_k,
                                   capacity_factor=config.moe_capacity_factor, min_capacity=config.moe_min_capacity,
                                   aux_loss_coef=config.moe_aux_coef)
        else:
            self.mlp = MLP(config)
        for proj in (self.attn.proj, ) + (() if experts else (self.mlp.proj, )):
            _residual_init(proj, config)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(ChunkedHead):
    """The vocabulary head (no bias, GPT-2 init): returns (hidden, weight), projected to the vocabulary inside the
    loss (`CrossEntropyLoss_FlatView`), a chunk of rows at a time."""

    def __init__(self, config: GPTliteConfig):
        super().__init__(config.n_embd, config.vocab_size)
        nn.init.normal_(self.weight, std=0.02)


class LinearLMHead(Linear):
    """The vocabulary head as a projection to the logits (`head="linear"`), for torch's cross-entropy: the same
    weight, name and initialisation as LMHead's."""

    def __init__(self, config: GPTliteConfig):
        super().__init__(config.n_embd, config.vocab_size, bias=False)
        nn.init.normal_(self.weight, std=0.02)


class LMHeadSlice(VocabSlice):
    """Rows of the vocabulary head for a split head (`vocab_parts` > 1): built under the head's own seed,
    it takes its rows of the head GPTlite would build, so split and unsplit models start identical.
    `recompute`, `rows`: VocabSlice's (schedules.runtime.vocab_parallel.slice_layout)."""

    def __init__(self, config: GPTliteConfig, part: int, parts: int, recompute: float = 0.0, rows=None):
        super().__init__(config.n_embd, config.vocab_size, part, parts, weight=LMHead(config).weight,
                         recompute=recompute, rows=rows)


def layer_specs(config: GPTliteConfig, vocab_parts: int = 1, vocab_recompute: bool = True, vocab_layout=None):
    """(class, args) of every layer in forward order: the one description of the layer list. With
    `vocab_parts` > 1 the head is that many slices (layer indices head .. head + vocab_parts - 1), each
    drawn from the head's seed, laid out by `slice_layout`: all but the last recompute most of their logits in
    their backward and hold fewer rows, evening out the ranks' activation memory (`vocab_recompute=False`:
    even slices that keep their logits). `vocab_layout`: (rows, recompute) per slice instead, e.g. fitted to a
    schedule (schedules.planner.layout.fit_slices)."""
    blocks = [(Block, (config, ) + ((True, ) if config.moe_experts and i in config.moe_blocks else ()))
              for i in range(config.n_layer)]
    trunk = [(EmbeddingsSum, (config, ))] + blocks + [(nn.LayerNorm, (config.n_embd, ))]
    if vocab_parts <= 1:
        return trunk + [(LinearLMHead if config.head == "linear" else LMHead, (config, ))]
    rows, recompute = vocab_layout or slice_layout(config.vocab_size, vocab_parts, recompute=vocab_recompute)
    return trunk + [(LMHeadSlice, (config, k, vocab_parts, recompute[k], tuple(rows)), len(trunk))
                    for k in range(vocab_parts)]


class GPTlite(nn.Module):

    def __init__(self, config: GPTliteConfig, activation_checkpoint_interval: int = 0):
        super().__init__()
        self.config = config
        self.activation_checkpoint_interval = activation_checkpoint_interval
        specs, n = layer_specs(config), config.n_layer
        self.emb = build_layer(specs, 0, config.seed)
        self.blocks = nn.ModuleList(build_layer(specs, 1 + i, config.seed) for i in range(n))
        self.ln_f = build_layer(specs, n + 1, config.seed)
        self.lm_head = build_layer(specs, n + 2, config.seed)

    def to_layers(self):
        """The model as the ordered layer list for `PipelineModule(layers=...)`."""
        return [self.emb, *self.blocks, self.ln_f, self.lm_head]

    def forward(self, idx):
        checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        return run_layers(self.to_layers(), idx, self.activation_checkpoint_interval, checkpoint, (Block, ))


class GPTlitePipe(LayerPipe):
    """A PipelineModule over GPTlite's layers; checkpointing applies to Blocks only."""
    checkpointable = (Block, )


class GPTlitePipeSpec(GPTlitePipe):
    """Memory-efficient pipeline build: layers are LayerSpecs, built only on their own stage."""

    def __init__(self, config: GPTliteConfig, **kwargs):
        specs = layer_specs(config)
        super().__init__(layers=[SeededLayerSpec(specs, i, config.seed) for i in range(len(specs))], **kwargs)


HEAD_KEEP = {"chunked": 1.0, "recompute": 0.0}  # the share of the logits whose exponentials the loss keeps for the
# backward: all of them (as many bytes as torch's log-softmax; the fastest on a CPU core, no second multiply), or
# none (one block of 2048 rows at a time, computed again in the backward; docs/vocab-parallel.md)


def CrossEntropyLoss_FlatView(outputs, labels, keep=HEAD_KEEP["chunked"]):
    """Cross-entropy of the head's outputs against (B,T) labels: of LMHead's (hidden, weight), computed in chunks of
    the vocabulary (chunked_head_loss, `keep`); of (B,T,V) logits (LinearLMHead), torch's. Flattening happens here."""
    if isinstance(outputs, tuple):
        return chunked_head_loss(outputs, labels, keep=keep)
    return F.cross_entropy(outputs.view(-1, outputs.size(-1)), labels.view(-1))


def fastest_head(device_type: str) -> str:
    """The whole head that trains fastest on this kind of device (train.py's `--head auto`). On CPU cores the
    chunked head (1.2x torch's on GPTlite small); on a GPU torch's: cuBLAS's one projection and the fused
    cross-entropy kernel beat a Python loop of vocabulary blocks, 1.3-1.6x at GPT-2 small's shape in bf16 and 6-11x at
    GPTlite small's on an H200 (docs/gpu.md); there the chunked forms' gain is memory (`recompute`: 0.07-0.18)."""
    return "chunked" if device_type == "cpu" else "linear"


def head_loss(head="chunked"):
    """The loss of GPTlite built with `head` (GPTliteConfig.head)."""
    if head == "recompute":
        return functools.partial(CrossEntropyLoss_FlatView, keep=HEAD_KEEP["recompute"])
    return CrossEntropyLoss_FlatView


def get_model(criterion=None, vocab_size=50257, pipeline_num_stages=0,
              pipeline_spec_layers=False, activation_checkpoint_interval=0, model_size="tiny",
              partition_method="parameters", pipe_module=None, partition_weights=None, vocab_parallel=False,
              vocab_recompute=True, vocab_layout=None, **config_overrides):
    """The plain GPTlite when `pipeline_num_stages` is 0, else one of its two pipeline builds.

    `pipe_module(layers, **kwargs)` builds another PipelineModule from the same layers (LayerSpecs
    or modules), for schedules that need one: several model chunks per rank (see
    schedules.pipe_module(name)). `vocab_parallel`: the head as one slice per pipeline rank
    (schedules/runtime/vocab_parallel.py), trained with its loss (`criterion` is not used); the
    micro-batches' inputs must carry the labels (`with_labels`). `vocab_recompute`: the slices laid out to even
    the ranks' memory (`layer_specs`), else even slices that keep their logits; `vocab_layout`: (rows, recompute)
    per slice instead.
    """
    config = replace(MODEL_SIZES[model_size], vocab_size=vocab_size, **config_overrides)
    criterion = criterion or head_loss(config.head)
    if not pipeline_num_stages:
        return GPTlite(config, activation_checkpoint_interval)
    pipe_kwargs = dict(num_stages=pipeline_num_stages, loss_fn=criterion, partition_method=partition_method,
                       activation_checkpoint_interval=activation_checkpoint_interval,
                       partition_weights=partition_weights)
    if vocab_parallel:
        if pipe_module is None:
            raise ValueError(refusal("this schedule keeps one stage per rank"))
        specs = layer_specs(config, vocab_parts=pipeline_num_stages, vocab_recompute=vocab_recompute,
                            vocab_layout=vocab_layout)
        build = SeededLayerSpec if pipeline_spec_layers else build_layer
        layers = [build(specs, i, config.seed) for i in range(len(specs))]
        return pipe_module(layers, checkpointable=GPTlitePipe.checkpointable,
                           **{**pipe_kwargs, "loss_fn": vocab_parallel_loss})
    if pipe_module is not None:
        specs = layer_specs(config)
        layers = ([SeededLayerSpec(specs, i, config.seed) for i in range(len(specs))] if pipeline_spec_layers else
                  GPTlite(config).to_layers())
        return pipe_module(layers, checkpointable=GPTlitePipe.checkpointable, **pipe_kwargs)
    if pipeline_spec_layers:
        return GPTlitePipeSpec(config, **pipe_kwargs)
    layers = GPTlite(config).to_layers()
    return GPTlitePipe(layers=layers, **pipe_kwargs)
