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
- `moe_param_groups(params)`: the optimizer's parameter groups with the experts' apart, as DeepSpeed's ZeRO and
  gradient reduction want them (the experts' gradients are averaged over the expert-data-parallel group only).
- `scale_aux_losses(module, scale)`: the gradient the aux loss gets per unit of its coefficient: what the engine
  multiplies the model's loss by before its backward (1 / gradient-accumulation steps); schedules.initialize
  sets it.
"""
import torch
import torch.nn as nn


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
    mine = torch.tensor([len(layers), max((layer.moe.ep_size for layer in layers), default=0)], dtype=torch.long)
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


def create_expert_groups(ep_size: int, pp_size: int):
    """DeepSpeed's expert-parallel and expert-data-parallel groups for `ep_size`, on every rank alike (see the
    module docstring); a no-op where they exist."""
    from deepspeed.utils import groups
    if f"ep_size_{ep_size}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size, pp_size=max(pp_size, 1))


class ExpertLayer(nn.Module):
    """DeepSpeed's MoE over `num_experts` experts, `ep_size`-way expert parallel; expert e is `make_expert(e)`,
    built under a seed of its own (so expert e starts the same whichever rank holds it). `capacity_factor` 0:
    no token is dropped (each expert's capacity is its largest load). `aux_loss_coef`: the load-balancing loss's
    weight in the training loss."""

    def __init__(self, hidden_size, make_expert, num_experts, ep_size=1, k=1, capacity_factor=1.0, min_capacity=4,
                 aux_loss_coef=0.01, eval_capacity_factor=None):
        super().__init__()
        from deepspeed.moe.layer import MoE
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks")
        local = num_experts // ep_size
        first = expert_parallel_rank(ep_size) * local
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
        for copy, expert in zip(self.moe.deepspeed_moe.experts.deepspeed_experts, experts):
            copy.load_state_dict(expert.state_dict())  # DeepSpeed deep-copies one expert; each gets its own weights
        self.first_expert = first  # this rank's experts are first .. first + local - 1 of num_experts
        self.aux_loss_coef, self.aux_scale = aux_loss_coef, 1.0
        self.last_aux_loss = None

    def forward(self, x):
        out, aux, _ = self.moe(x)
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AuxLossGradient.apply(out, aux, self.aux_loss_coef * self.aux_scale)
        return out


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
