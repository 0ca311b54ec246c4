"""A checkpoint that loads under any layout: DeepSpeed's universal checkpoint layout, written from a
DeepSpeed pipeline checkpoint by `convert`, read into any engine by `load`.

DeepSpeed's pipeline checkpoint keeps the weights by global layer index (`layer_XX-model_states.pt`,
found by any stage count) but the optimizer state as each rank's flat partitions
(`[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`; at ZeRO 0 the torch optimizer's state by
position, in `mp_rank_MM_model_states.pt`): usable only by the same ranks holding the same layers.
Universal checkpointing (DeepSpeed's `ds_to_universal`, config `"checkpoint": {"load_universal": true}`)
keys every parameter by name instead:

    <tag>/zero/<name>/fp32.pt        {'param': the full fp32 tensor}
    <tag>/zero/<name>/exp_avg.pt     {'param': ...}, exp_avg_sq.pt: Adam's moments, full size
    <tag>/zero/<name>/step.pt        the optimizer's step count
    <tag>/zero/optimizer_state.pt    what is not per parameter (param_groups' hyperparameters, ...)

where <name> is what DeepSpeed's own PipelineModule calls the parameter: `<global layer index>.<name
in the layer>`, or `tied_modules.<key>.<name>`. DeepSpeed writes it only from ZeRO >= 1 checkpoints,
needs a `layer_01` file (its issue #5776), and has no interleaved, V or mirror placement. Here:

- `convert` reads ZeRO 0, ZeRO 1 (any data-parallel degree) and bf16 checkpoints of any of this
  package's placements, with nothing of the model but the files (ZeRO 0 names its parameters through
  `param_names`, which `client_state` carries); DualPipe's mirrored second copies are read once;
- a split vocabulary head (`VocabSlice` layers at indices L .. L+p-1) is written as the unsplit head
  `L.weight` (rows concatenated), the layers after it renumbered: the names of the unsplit layer
  list, so a split and an unsplit run read the same files;
- `load` puts each parameter of an engine, whatever its schedule, stage count, data-parallel degree,
  ZeRO stage (0 or 1) or precision, at its value and moments, with the step count and the optimizer's
  hyperparameters: a VocabSlice takes its rows, every copy of a mirrored or tied parameter the same.

A ZeRO-1 checkpoint converted here loads with DeepSpeed's own `load_universal` on its stock engine.
"""
import glob
import os
import re

import torch

STATES = ("exp_avg", "exp_avg_sq")  # Adam's moments: the per-parameter optimizer state kept here
ZERO = "zero"
GLOBAL_STATE = "optimizer_state.pt"
_LAYER_NAME = re.compile(r"^(\d+)\.(.+)$")


# ---------------------------------------------------------------------------------------------
# Names: a parameter's name in the unsplit layer list
# ---------------------------------------------------------------------------------------------
def canonical(name, slices=None):
    """(name in the unsplit layer list, slice index or None) of a layer-indexed parameter name.
    `slices`: (first layer index, count) of a split head's VocabSlices, or None."""
    match = _LAYER_NAME.match(name)
    if not slices or not match:
        return name, None
    first, parts = slices
    index, rest = int(match.group(1)), match.group(2)
    if first <= index < first + parts:
        return f"{first}.{rest}", index - first
    return f"{index - (parts - 1) if index >= first + parts else index}.{rest}", None


def head_slices(layer_specs):
    """(first index, count) of the VocabSlices that end a layer list, or None."""
    from schedules.runtime.vocab_parallel import count_slices
    n = count_slices(layer_specs)
    return (len(layer_specs) - n, n) if n else None


def local_names(module, layers=None):
    """{id(parameter): (name in the unsplit layer list, rows (start, stop) or None)} for the parameters
    this rank holds: a pipeline module's layers (every chunk, both mirrored copies) and tied modules,
    or, with `layers`, a non-pipelined model's layer list (the order of the pipeline's layers); experts by their
    global index (an expert-parallel rank holds some of them)."""
    from schedules.runtime.moe import global_expert_name
    from schedules.runtime.pipe_module import layer_runs
    from schedules.runtime.vocab_parallel import is_vocab_slice
    if layers is not None:
        runs, slices = [(0, list(layers))], head_slices(layers)
    else:
        runs, slices = layer_runs(module), head_slices(module._layer_specs)
    # tied modules first: DeepSpeed names them so even where a layer list entry is the module itself
    names = {id(p): (f"tied_modules.{pname}", None)
             for pname, p in getattr(module, 'tied_modules', torch.nn.ModuleDict()).named_parameters()}
    for start, funcs in runs:
        for i, layer in enumerate(funcs):
            if not isinstance(layer, torch.nn.Module):
                continue  # a function, or a tied module's partial: named below
            for pname, p in layer.named_parameters():
                name, part = canonical(f"{start + i}.{global_expert_name(layer, pname)}", slices)
                rows = (layer.start, layer.stop) if part is not None and is_vocab_slice(layer) else None
                names.setdefault(id(p), (name, rows))
    return names


def layer_names(model, layers):
    """{a non-pipelined model's parameter name: its name in the layer list `layers` (the model's, in order)}."""
    index = {id(p): f"{i}.{n}" for i, layer in enumerate(layers) if isinstance(layer, torch.nn.Module)
             for n, p in layer.named_parameters()}
    return {name: index[id(p)] for name, p in model.named_parameters() if id(p) in index}


def client_state(engine):
    """What `engine.save_checkpoint(..., client_state=)` must add for `convert` to read a ZeRO-0 checkpoint:
    the parameters' names in the optimizer's order (its state is kept by position), and the tied modules'
    weights (DeepSpeed's layer files skip a tied layer with a forward_fn). Empty at ZeRO >= 1."""
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    names = [engine.param_names.get(p) for p in params]
    if None in names:  # ZeRO >= 1: the optimizer's groups are flat partitions, named by DeepSpeed itself
        return {}
    tied = getattr(engine.module, 'tied_modules', torch.nn.ModuleDict())
    return {"param_names": names, "tied_weights": {f"tied_modules.{n}": p.detach().cpu().clone()
                                                   for n, p in tied.named_parameters()}}


# ---------------------------------------------------------------------------------------------
# convert: DeepSpeed's pipeline checkpoint -> the universal layout
# ---------------------------------------------------------------------------------------------
def convert(folder, slices=None, out=None, rename=None):
    """Write `out` (default `<folder>/zero`) from the DeepSpeed checkpoint in `folder` (one tag): every
    parameter once, full size, by its name in the unsplit layer list. Returns the names written.
    `slices`: (first layer index, count) of a split head's slices, merged into one head. `rename`: a
    non-pipelined model's names -> the layer list's (`layer_names`)."""
    out = out or os.path.join(folder, ZERO)
    tensors, step, groups = _read_native(folder)  # {name: {key: full tensor}} with the checkpoint's names
    if rename:
        tensors = {rename.get(name, name): value for name, value in tensors.items()}
    merged = {}
    for name in sorted(tensors, key=_layer_order):
        canon, part = canonical(name, slices)
        merged.setdefault(canon, []).append((part or 0, tensors[name]))
    os.makedirs(out, exist_ok=True)
    for canon, pieces in merged.items():
        pieces = [t for _, t in sorted(pieces, key=lambda piece: piece[0])]
        os.makedirs(os.path.join(out, canon), exist_ok=True)
        for key in ("fp32", *STATES):
            if key in pieces[0]:
                full = torch.cat([t[key] for t in pieces]) if len(pieces) > 1 else pieces[0][key]
                torch.save({"param": full.float().contiguous()}, os.path.join(out, canon, f"{key}.pt"))
        torch.save(step, os.path.join(out, canon, "step.pt"))
    import deepspeed
    # written last: a folder with it is complete
    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__, "clip_grad": _clip_grad(folder)},
               os.path.join(out, GLOBAL_STATE))
    return sorted(merged)


def is_converted(folder):
    return os.path.isfile(os.path.join(folder, ZERO, GLOBAL_STATE))


def _layer_order(name):
    match = _LAYER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else (-1, name)


def _model_files(folder):
    files = sorted(glob.glob(os.path.join(folder, "mp_rank_*_model_states.pt")))
    if not files:
        raise FileNotFoundError(f"{folder}: no mp_rank_*_model_states.pt (not a DeepSpeed checkpoint folder)")
    return files


def _clip_grad(folder):
    state = torch.load(_model_files(folder)[0], map_location="cpu", weights_only=False)
    return float(state.get("ds_config", {}).get("gradient_clipping", 0.0) or 0.0)


def _read_native(folder):
    """({name: {'fp32', 'exp_avg', 'exp_avg_sq': full tensors}}, step, param_groups without 'params')."""
    zero_files = sorted(glob.glob(os.path.join(folder, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))
    return _read_zero(folder, zero_files) if zero_files else _read_zero0(folder)


def _read_zero(folder, files):
    """ZeRO >= 1 and bf16: each (pipeline rank, data-parallel rank) file holds a fragment of each flat
    group's fp32 weights and moments, and where each parameter's fragment lies in it."""
    by_stage = {}
    for path in files:
        dp, mp = map(int, re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim", path).groups())
        by_stage.setdefault(mp, {})[dp] = path
    shapes = {}
    for path in _model_files(folder):
        for group in torch.load(path, map_location="cpu", weights_only=False).get("param_shapes") or []:
            shapes.update(group)
    tensors, step, groups = {}, None, None
    for mp in sorted(by_stage):
        fragments = {}  # name -> key -> [fragments in data-parallel order]
        for dp in sorted(by_stage[mp]):
            sd = torch.load(by_stage[mp][dp], map_location="cpu", weights_only=False)["optimizer_state_dict"]
            base = sd["base_optimizer_state"]
            groups = groups or [{k: v for k, v in g.items() if k != "params"} for g in base["param_groups"]]
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                flat = {"fp32": sd["single_partition_of_fp32_groups"][g], **{k: base["state"][g][k] for k in STATES}}
                step = base["state"][g].get("step", step)
                for name, address in mapping.items():
                    for key, tensor in flat.items():
                        fragments.setdefault(name, {}).setdefault(key, []).append(
                            tensor.narrow(0, address.start, address.numel))
        for name, by_key in fragments.items():
            if name in tensors:
                continue  # a mirrored copy (DualPipe) or a tied module: every copy holds the same
            tensors[name] = {key: torch.cat(parts).view(shapes[name]) for key, parts in by_key.items()}
    return tensors, step, groups


def _read_zero0(folder):
    """ZeRO 0: the torch optimizer's state by position, in each pipeline rank's mp_rank file; the weights
    in the layer files; `param_names` (this package's save records them) names the positions."""
    tensors, step, groups = {}, None, None
    layer_files = {}
    for path in _model_files(folder):
        state = torch.load(path, map_location="cpu", weights_only=False)
        optimizer, names = state.get("optimizer"), state.get("param_names")
        if optimizer is None:
            raise ValueError(f"{path} holds no optimizer state")
        if names is None:
            raise ValueError(f"{path}: a ZeRO-0 checkpoint written without its parameters' names; resume it "
                             f"under the layout that wrote it and save once (this package's save records them)")
        groups = groups or [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        order = [i for g in optimizer["param_groups"] for i in g["params"]]
        for position, name in zip(order, names):
            if name in tensors:
                continue
            moments = optimizer["state"].get(position, {})
            step = moments.get("step", step)
            tensors[name] = {k: moments[k] for k in STATES if k in moments}
            tensors[name]["fp32"] = _layer_weight(folder, name, layer_files, state)
    return tensors, step, groups


def _layer_weight(folder, name, cache, model_state):
    if model_state.get("module") is not None:  # a non-pipelined model: its whole state, by its own names
        return model_state["module"][name]
    match = _LAYER_NAME.match(name)
    if match is None:  # a tied module's parameter: DeepSpeed's layer files skip it, the model state holds it
        weights = model_state.get("tied_weights") or {}
        if name not in weights:
            raise ValueError(f"{folder}: no saved weight for {name}")
        return weights[name]
    index, rest = int(match.group(1)), match.group(2)
    if index not in cache:
        cache[index] = torch.load(os.path.join(folder, f"layer_{index:02d}-model_states.pt"), map_location="cpu",
                                  weights_only=False)
    return cache[index][rest]


# ---------------------------------------------------------------------------------------------
# load: the universal layout -> an engine of any layout
# ---------------------------------------------------------------------------------------------
def load(engine, folder, layers=None):
    """Every parameter of `engine` (and Adam's moments, the step count, the optimizer's hyperparameters)
    from the universal layout in `folder` (`<tag>`, holding `zero/`). `layers`: a non-pipelined model's
    layer list. Collective over data-parallel ranks at ZeRO 1 and bf16 (DeepSpeed gathers the weights)."""
    zero = os.path.join(folder, ZERO)
    cache = {}

    def read(name, key):
        if (name, key) not in cache:
            path = os.path.join(zero, name, f"{key}.pt")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: the checkpoint has no {name} (another model?)")
            value = torch.load(path, map_location="cpu", weights_only=False)
            cache[(name, key)] = value if key == "step" else value["param"]
        return cache[(name, key)]

    saved = torch.load(os.path.join(zero, GLOBAL_STATE), map_location="cpu", weights_only=False)
    _put(engine, local_names(engine.module, layers), read, saved["param_groups"])


def load_weights(engine, weights, layers=None):
    """Every parameter of `engine` from `weights`, a state dict keyed by the unsplit layer list's names
    (train.py's --export), the optimizer's state left as it is (a fresh run's)."""
    def read(name, key):
        if name not in weights:
            raise KeyError(f"no {name} in the weights (another model?)")
        return weights[name]

    _put(engine, local_names(engine.module, layers), read, None)


def _put(engine, names, read, saved_groups):
    """Set each parameter of `engine` (its fp32 master where the optimizer keeps one) from
    `read(name, 'fp32')`, rows of it for a VocabSlice; with `saved_groups` (the checkpoint's
    param_groups) also Adam's moments and step (`read(name, key)`) and the groups' hyperparameters."""
    def full(p, key):
        name, rows = names[id(p)]
        value = read(name, key)
        if key == "step":
            return value
        value = value[rows[0]:rows[1]] if rows else value
        if value.shape != p.shape:
            raise ValueError(f"{name}: the checkpoint holds {tuple(value.shape)}, this model {tuple(p.shape)}")
        return value

    optimizer = engine.optimizer
    lp_groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)
    if lp_groups is not None:  # DeepSpeed's ZeRO 1/2 or BF16 optimizer: fp32 partitions behind the model's params
        from deepspeed.utils.tensor_fragment import map_to_flat_opt_states
        base = optimizer.optimizer
        for i, group in enumerate(base.param_groups):
            steps = set()
            for lp in lp_groups[i]:
                mapping = lp._hp_mapping
                if mapping is None:
                    continue  # held by another data-parallel rank's partition
                address = mapping.lp_fragment_address

                def fragment(key):
                    return full(lp, key).flatten().narrow(0, address.start, address.numel)
                mapping.get_hp_fragment().data.copy_(fragment("fp32"))
                if saved_groups is not None:
                    mapping.optim_fragment = {key: fragment(key).clone() for key in STATES}
                    steps.add(float(full(lp, "step")))
            if saved_groups is not None:
                hp = group["params"][0]
                if steps:
                    base.state[hp]["step"] = torch.tensor(steps.pop(), dtype=torch.float32)
                map_to_flat_opt_states(hp, lp_groups[i], base.state, STATES)
                _set_hyperparameters(group, saved_groups, i)
        optimizer.update_lp_params()
    else:  # ZeRO 0: the model's parameters are the optimizer's
        with torch.no_grad():
            for i, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    p.copy_(full(p, "fp32"))
                    if saved_groups is not None:
                        optimizer.state[p] = {"step": torch.tensor(float(full(p, "step")), dtype=torch.float32),
                                              **{key: full(p, key).to(p.dtype).clone() for key in STATES}}
                if saved_groups is not None:
                    _set_hyperparameters(group, saved_groups, i)


def _set_hyperparameters(group, saved_groups, i):
    for key, value in saved_groups[min(i, len(saved_groups) - 1)].items():
        if key != "params":
            group[key] = value
