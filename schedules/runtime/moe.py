"""A Mixture-of-Experts layer for a pipeline: DeepSpeed's gate and experts, its auxiliary loss trained where it is
made, its experts sharded over the data-parallel ranks of one stage.

- `ExpertLayer(hidden, make_expert, num_experts, ...)`: hidden -> hidden, DeepSpeed's `MoE` (TopKGate, MOELayer,
  Experts) around `make_expert(e)`, the e-th of `num_experts` experts. It returns a tensor, not DeepSpeed's
  (output, l_aux, exp_counts): the gate's load-balancing loss is attached to the output by `_AuxLossGradient`,
  whose backward gives that loss its gradient on the spot, so it trains as if added to the model's loss while
  no pipeline message carries it (Megatron-core's MoEAuxLossAutoScaler does the same). Deterministic routing:
  no random token selection, no noise, no sampled second expert, so a pipelined run routes every token as the
  plain model does.
- `expert_parallel_rank(ep_size)`, `create_expert_groups(ep_size, pp_size)`: DeepSpeed's groups of `ep_size`
  consecutive ranks inside a stage (a stage's data-parallel replicas sit on consecutive ranks), made on every
  rank before any model is built: `torch.distributed.new_group` is collective over the whole world, and a stage
  without experts would otherwise never call it while the others wait.
- `shared_by_copies(p)`: a context for building a model for DualPipe's mirror placement (train.py's
  --dualpipe-experts shard): each ExpertLayer holds half its experts and exchanges tokens with the stage's other copy
  (ranks r and p-1-r); `prepare_expert_groups` gives the layers those groups.
- Every exchange (dispatch, combine; forward, backward) goes through `overlap.exchange`, asynchronous, so that an
  overlapped forward-backward pair computes one pass while the other's tokens are in flight.
- `moe_param_groups(params)`: the optimizer's parameter groups with the experts' apart, as DeepSpeed's ZeRO and
  gradient reduction want them (the experts' gradients are averaged over the expert-data-parallel group only).
- `scale_aux_losses(module, scale)`: the gradient the aux loss gets per unit of its coefficient: what the engine
  multiplies the model's loss by before its backward (1 / gradient-accumulation steps); schedules.initialize
  sets it.
"""
from contextlib import contextmanager

import torch
import torch.nn as nn

from schedules.runtime.overlap import all_reduce_max, exchange


class _AuxLossGradient(torch.autograd.Function):
    """Identity on `x`; in the backward, `aux` gets the gradient `scale` (d(model loss)/d(aux) with the engine's
    scaling in it), so the aux loss trains with no path to the model's loss."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_shape = scale, (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_shape
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def expert_parallel_rank(ep_size: int) -> int:
    """This rank's place in its expert-parallel group (DeepSpeed's groups of consecutive ranks); 0 outside a
    distributed run."""
    if ep_size <= 1 or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank() % ep_size


class ExpertPlacementError(ValueError):
    """Some ranks hold expert layers and others none (or of another expert-parallel size)."""


def prepare_expert_groups(model, pp_size: int):
    """Collective over every rank, before the engine is built: which ranks hold ExpertLayers and at which
    expert-parallel size. Where some do and some hold none, ExpertPlacementError (the same on every rank): DeepSpeed's
    ZeRO optimizer would reduce one more parameter group's norm across the stages on the ranks with experts than on
    the others, and wait forever. Where all do, their groups are made on every rank (`create_expert_groups`)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    layers = expert_layers(model)
    mine = torch.tensor([len(layers), max((layer.moe.ep_size for layer in layers), default=0),
                         max((layer.copies for layer in layers), default=0)], dtype=torch.long)
    ranks = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(ranks, mine)
    holders = [r for r, t in enumerate(ranks) if t[0]]
    if not holders:
        return
    if len(holders) < len(ranks):
        empty = [r for r, t in enumerate(ranks) if not t[0]]
        raise ExpertPlacementError(
            f"rank{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} hold{'s' * (len(empty) == 1)} no layer with "
            f"experts, the others do (DeepSpeed's optimizer would then reduce across the stages a different number of "
            f"times on each and hang): put experts in a block of every rank's stages")
    sizes = sorted({int(t[1]) for t in ranks})
    if len(sizes) > 1:
        raise ExpertPlacementError(f"expert layers of expert-parallel sizes {sizes}: give them all one size")
    create_expert_groups(sizes[0], pp_size)
    if len({int(t[2]) for t in ranks}) > 1:
        raise ExpertPlacementError("some ranks' experts are shared by their stage's copies, others' not")
    if any(layer.copies > 1 for layer in layers):
        group = copies_groups(pp_size)
        for layer in layers:
            layer.exchange_group = group


def create_expert_groups(ep_size: int, pp_size: int):
    """DeepSpeed's expert-parallel and expert-data-parallel groups for `ep_size`, on every rank alike (see the
    module docstring); a no-op where they exist."""
    from deepspeed.utils import groups
    if f"ep_size_{ep_size}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size, pp_size=max(pp_size, 1))


_shared_by_copies = (0, 1)  # (this rank's copy, copies of each stage): see shared_by_copies


@contextmanager
def shared_by_copies(pipeline_parallel_size: int):
    """While building a model for DualPipe's mirror placement, where ranks r and p-1-r each hold a copy of stage r:
    each ExpertLayer built holds half its experts (rank r the first half of stage r's and of stage p-1-r's, rank
    p-1-r the second), and the two copies of a stage exchange their tokens (all-to-all) instead of each holding every
    expert. The two copies run mirror images of one order, so they reach each layer's all-to-all together."""
    global _shared_by_copies
    import torch.distributed as dist
    p = pipeline_parallel_size
    stage = dist.get_rank() // (dist.get_world_size() // p)  # a stage's data-parallel replicas are consecutive
    saved, _shared_by_copies = _shared_by_copies, (int(stage > p - 1 - stage), 2)
    try:
        yield
    finally:
        _shared_by_copies = saved


def copies_groups(pipeline_parallel_size: int):
    """The group {rank r, rank p-1-r} of each replica, made on every rank in the same order; this rank's."""
    import torch.distributed as dist
    p, world = pipeline_parallel_size, dist.get_world_size()
    dp = world // p
    mine = None
    for replica in range(dp):
        for r in range(p // 2):
            ranks = [r * dp + replica, (p - 1 - r) * dp + replica]
            group = dist.new_group(ranks, timeout=_default_timeout())
            if dist.get_rank() in ranks:
                mine = group
    return mine


def _default_timeout():
    """The default group's timeout (train.py's --dist-timeout): a new group otherwise gets torch's 30 minutes."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


class ExpertLayer(nn.Module):
    """DeepSpeed's MoE over `num_experts` experts, `ep_size`-way expert parallel; expert e is `make_expert(e)`,
    built under a seed of its own (so expert e starts the same whichever rank holds it). `capacity_factor` 0:
    no token is dropped (each expert's capacity is its largest load). `aux_loss_coef`: the load-balancing loss's
    weight in the training loss."""

    def __init__(self, hidden_size, make_expert, num_experts, ep_size=1, k=1, capacity_factor=1.0, min_capacity=4,
                 aux_loss_coef=0.01, eval_capacity_factor=None):
        super().__init__()
        from deepspeed.moe.layer import MoE
        copy, self.copies = _shared_by_copies
        if self.copies > 1 and ep_size > 1:
            raise ValueError("experts shared by a stage's copies cannot also be sharded over its data-parallel ranks: "
                             "pass --expert-parallel-size 1 (or --dualpipe-experts duplicate)")
        shards = ep_size * self.copies
        if num_experts % shards:
            raise ValueError(f"{num_experts} experts cannot be split over {shards} "
                             + ("expert-parallel ranks" if ep_size > 1 else "copies of the stage"))
        local = num_experts // shards
        first = (expert_parallel_rank(ep_size) if ep_size > 1 else copy) * local
        self.exchange_group = None  # the copies' group (prepare_expert_groups), where they share the experts
        base = torch.initial_seed()  # the caller's seed (a seeded layer's), drawn from for each expert
        experts = []
        for e in range(first, first + local):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((base * 1000003 + e) % (1 << 63))
                experts.append(make_expert(e))
        drop = capacity_factor > 0
        factor = capacity_factor if drop else 1.0
        self.moe = MoE(hidden_size, experts[0], num_experts=num_experts, ep_size=ep_size, k=k,
                       capacity_factor=factor, eval_capacity_factor=eval_capacity_factor or factor,
                       min_capacity=min_capacity, drop_tokens=drop, use_rts=False, noisy_gate_policy=None,
                       top2_2nd_expert_sampling=False)
        held = self.moe.deepspeed_moe.experts
        if self.copies > 1:  # DeepSpeed sees no expert parallelism (its groups are of data-parallel ranks): keep ours
            held.deepspeed_experts = nn.ModuleList(list(held.deepspeed_experts)[:local])
            # (the MoE's own count too: DeepSpeed's checkpoint saves and loads that many experts per rank)
            held.num_local_experts = self.moe.deepspeed_moe.num_local_experts = self.moe.num_local_experts = local
            for param in held.parameters():
                param.shared_by_copies = True  # not a copy of the other rank's: summed with none, counted once
        for built, expert in zip(held.deepspeed_experts, experts):
            built.load_state_dict(expert.state_dict())  # DeepSpeed deep-copies one expert; each gets its own weights
        self.first_expert = first  # this rank's experts are first .. first + local - 1 of num_experts
        self.aux_loss_coef, self.aux_scale = aux_loss_coef, 1.0
        self.last_aux_loss = None
        self.exchange_bytes = 0  # bytes of its last forward's dispatched tokens, every rank's share (_route)

    def expert_param_bytes(self) -> int:
        """Bytes of the experts this rank holds (what sharing them between ranks saves a rank)."""
        return sum(p.numel() * p.element_size() for p in self.moe.deepspeed_moe.experts.parameters())

    def exchanges(self) -> bool:
        """Whether its passes send tokens to other ranks (all-to-all): experts sharded over several."""
        return self.copies > 1 or self.moe.deepspeed_moe.ep_size > 1

    def forward(self, x):
        out, aux = self._route(x)
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AuxLossGradient.apply(out, aux, self.aux_loss_coef * self.aux_scale)
        return out

    def _route(self, x):
        """DeepSpeed's MOELayer.forward (0.19.8; no tensor parallelism, no Tutel) with its gate, encoding, experts and
        decoding, its two all-to-alls through `overlap.exchange`: the same arithmetic, but an overlapped pair
        (schedules/runtime/overlap.py) computes its other pass while either is in flight. (output, aux loss)."""
        from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode
        layer = self.moe.deepspeed_moe
        group, ranks = (layer.ep_group, layer.ep_size) if self.copies == 1 else (self.exchange_group, self.copies)
        if self.copies > 1 and group is None:
            raise RuntimeError("an ExpertLayer shared by a stage's copies has no group: build the engine with "
                               "schedules.initialize")
        # No token dropped: each expert's capacity is the group's largest load, which DeepSpeed's gate agrees on
        # with a blocking all-reduce. Here the gate sees no group and returns this rank's largest load, and the
        # group's largest comes from an asynchronous all-reduce that hands an overlapped pair's turn over like the
        # exchanges do: the same capacity (top-1's bound by the token count is the same on every rank).
        agree = ranks > 1 and not layer.gate.drop_tokens
        if agree:
            layer.gate.ep_group = None
        width = x.shape[-1]
        tokens = x.reshape(-1, width)
        aux, capacity, experts, indices, locations, gates, layer.exp_counts = layer.gate(tokens, None, True, False)
        if agree:
            capacity = all_reduce_max(torch.as_tensor(capacity, dtype=torch.int64).reshape(1), group)
        capacity = int(capacity)
        slots = _route_slots(indices, locations, experts, capacity)
        dispatched = _sparse_encode(tokens, slots, experts, capacity)
        # one all-to-all's payload (the combine's is as large): what the profile prices the exchanges of a pass by
        self.exchange_bytes = dispatched.numel() * dispatched.element_size()
        if ranks > 1:  # dispatch: each rank's tokens to the ranks holding their experts
            dispatched = exchange(dispatched, group)
        dispatched = dispatched.contiguous().reshape(ranks, layer.num_local_experts, -1, width)
        out = layer.experts(dispatched).reshape(ranks * layer.num_local_experts, -1, width)
        if ranks > 1:  # combine: the experts' outputs back to their tokens' ranks
            out = exchange(out, group)
        layer.l_aux = aux
        combined = _sparse_decode(out.contiguous().view(experts * capacity, width), slots, gates, tokens.size(0))
        return combined.reshape(x.shape), aux


EXPERTS_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."  # an ExpertLayer's experts, by local index


def global_expert_name(module, name: str) -> str:
    """A parameter name of `module`'s state dict with its experts' local indices made global (expert e of the
    layer, whichever rank holds it): what an export of an expert-parallel model is keyed by."""
    for path, layer in module.named_modules():
        if isinstance(layer, ExpertLayer):
            prefix = (path + "." if path else "") + EXPERTS_PREFIX
            if name.startswith(prefix):
                local, rest = name[len(prefix):].split(".", 1)
                return f"{prefix}{layer.first_expert + int(local)}.{rest}"
    return name


def is_expert_name(name: str) -> bool:
    return EXPERTS_PREFIX in name


def expert_layers(module):
    return [m for m in module.modules() if isinstance(m, ExpertLayer)]


def scale_aux_losses(module, scale: float):
    """Every ExpertLayer in `module` gives its aux loss `coefficient x scale` as gradient (see the docstring)."""
    for layer in expert_layers(module):
        layer.aux_scale = scale


def moe_param_groups(params):
    """`params` (a list) as DeepSpeed's optimizers want them beside experts: [{'params': dense}, {'params':
    experts of one group, 'moe': True, ...}] (deepspeed.moe.utils); the list itself where none is an expert's."""
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    params = list(params)
    if not any(is_moe_param(p) for p in params):
        return params
    return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
