"""From a per-layer profile to what the simulator takes for one cut and one placement: the costs and the
saved-bytes changes of every (rank, chunk), the parameters per rank, the largest message, and the time
outside the schedule (the optimizer step, the mirror placement's gradient sum).

A cut is the list of layer boundaries of the model stages, as DeepSpeed's PipelineModule keeps it
(`parts`): stage s holds layers parts[s] to parts[s+1]-1. `cut(profile, method, stages)` computes it
the way the module will: DeepSpeed's own `uniform`, `parameters` and `type:NAME` methods, and `profile`,
balanced on the measured per-layer costs (what `partition_weights` makes LayerPipe do).
"""
import re
from dataclasses import replace

from schedules.planner.profile import KINDS, STATES, LayerCost

CUTS = ('uniform', 'parameters', 'profile')


def layer_weights(profile, method):
    """The per-layer weights a method balances (None for `uniform`)."""
    method = method.lower()
    if method == 'uniform':
        return None
    if method == 'parameters':
        return [c.params for c in profile.layers]
    if method == 'profile':
        weights = [c.cost for c in profile.layers]
        if profile.loss is not None:  # the loss runs on the last stage
            weights[-1] += profile.loss.cost
        return weights
    if method.startswith('type:'):
        return [1 if re.search(method[5:], c.name, re.IGNORECASE) else 0 for c in profile.layers]
    raise ValueError(f"unknown partition method {method!r}: choose uniform, parameters, profile or type:NAME")


def cut(profile, method, stages, slices=0):
    """Layer boundaries of `stages` model stages, as DeepSpeed's PipelineModule computes them; with `slices`
    (a split head's last layers, `split_head`), as LayerPipe does: a stage per slice, the trunk cut over the
    others."""
    from deepspeed.runtime import utils as ds_utils
    weights = layer_weights(profile, method)
    n = len(profile.layers) - slices
    if slices:
        weights, stages = (None if weights is None else weights[:n]), stages - slices
    parts = ds_utils.partition_uniform(n, stages) if weights is None else _balanced(weights, stages)
    return [int(b) for b in parts] + [n + k for k in range(1, slices + 1)]


_BALANCED = {}  # (weights, parts) -> partition_balanced's boundaries, kept: the chooser asks each once per schedule


def _balanced(weights, parts):
    """DeepSpeed's partition_balanced (a pure function, O(layers^2 x parts) in Python: seconds at 130 layers into
    128 stages), computed once per weights and stage count."""
    from deepspeed.runtime import utils as ds_utils
    key = (tuple(weights), parts)
    if key not in _BALANCED:
        if len(_BALANCED) >= 256:
            _BALANCED.clear()
        _BALANCED[key] = [int(b) for b in ds_utils.partition_balanced(weights=list(weights), num_parts=parts)]
    return list(_BALANCED[key])


def split_head(profile, parts, recompute=True, cost=None, vocab_size=None, layout=None):
    """The profile of the same model with its last layer (the vocabulary head) and the loss split into `parts`
    VocabSlices (schedules/runtime/vocab_parallel.py), laid out as `gptlite.layer_specs(vocab_recompute=...)`
    builds them: `slice_layout(V, parts, recompute, cost)` gives slice k rows_k of the V rows and recomputes
    round(q_k rows_k) of them in its backward (`recompute=False`: the even split that keeps every logit).

    Slice k takes rows_k / V of the head's and the loss's seconds, parameters, optimizer step and of what they
    save beyond the slice's input (the hidden state, which every slice saves whole); its recomputed rows add
    cost x (their share of the head's and loss's F + B + W) to its B and BW (`cost`: RECOMPUTE_COST, a
    recomputed row's extra backward time over a kept row's forward + backward + W) and keep nothing from its F
    to its B but that input and a log-sum-exp per token (left out): its saved bytes after F scale with its kept
    rows, after B (a deferred W's gradient of the logits, recomputed rows' too) with all its rows. Every slice
    passes on the hidden state (the labels and two statistics per token beside it are left out of its message
    size). The logits a B computes again live only while it runs: its `within` (rows_k q_k / V of the head's
    output, the logits: 15 MiB at p = 2 on GPTlite small), which the simulator counts inside the pass. V:
    `vocab_size`, else the
    head's parameters x its output over its input bytes, square-rooted (h V and V / h); where that does not give
    a whole row count the shares are kept unrounded.

    Where the profile measured the slices themselves (`Profile.slices`, planning.measure: `parts` of them, laid out
    alike, their parameters this layout's rows), those are the split head's layers instead, as measured: the
    derivation charges every row what the whole head and torch's cross-entropy cost per row, more than a slice's
    own projection and statistics cost on GPTlite small. Measured in another layout (other rows, another p), they
    are scaled per row instead (`_from_slices`).

    `layout`: (rows, recompute) of every slice, as `slice_layout` gives them or `planner.layout.fit_slices` fits
    them (then `recompute` and `cost` are not used)."""
    from schedules.runtime.vocab_parallel import RECOMPUTE_COST, slice_layout
    head, loss = profile.layers[-1], profile.loss
    both = [head] + ([loss] if loss is not None else [])
    cost = RECOMPUTE_COST if cost is None else cost
    vocab = vocab_size or _vocab_size(profile) or _NOMINAL_ROWS
    rows, q = layout if layout is not None else slice_layout(vocab, parts, recompute=recompute, cost=cost)
    rows, q = list(rows), list(q)
    if len(rows) != parts or len(q) != parts:
        raise ValueError(f"layout {rows}, {q}: one row count and one recompute share per slice, {parts} of each")
    had = _measured_layout(profile) if getattr(profile, 'slices', None) else None
    if had is not None:  # the slices measured: themselves where laid out as asked, else scaled per row
        measured = [replace(c, saved={k: list(v) for k, v in c.saved.items()}) for c in profile.slices] \
            if had == (rows, q) else _from_slices(profile, rows, q, cost)
        return replace(profile, layers=[*profile.layers[:-1], *measured], loss=None, slices=None)
    total = sum(rows)
    recomputed = [round(qk * r) for qk, r in zip(q, rows)]  # as VocabSlice rounds them
    work = sum(c.F + c.B + c.W for c in both)  # a micro-batch's F + B + W of every row
    params, param_bytes = _split_count(head.params, rows), _split_count(head.param_bytes, rows)
    message = profile.layers[-2].output_bytes if len(profile.layers) > 1 else 0
    # the logits' fp32 bytes, tokens x V: the head's input over its width (its parameters over V), times V
    logits = message * vocab * vocab / head.params if head.params and message else head.output_bytes
    pieces = []
    for k in range(parts):
        share, kept = rows[k] / total, (rows[k] - recomputed[k]) / total
        extra = cost * recomputed[k] / total * work  # the recompute: a matrix multiply and an exponential more in B
        seconds = {kind: share * sum(getattr(c, kind) for c in both) for kind in KINDS}
        seconds['B'] += extra
        seconds['BW'] += extra
        saved = {}
        for state in STATES:
            own = head.saved[state][1]  # the slice's input: the hidden state, saved whole by every slice
            rest = sum(c.saved[state][0] for c in both) - own
            saved[state] = [own + rest * (kept if state == 'F' else share), own, 0]
        again = recomputed[k] / total * logits  # the logits its backward computes again, while it runs
        pieces.append(LayerCost(f"{head.name}Slice", *(seconds[kind] for kind in KINDS), saved=saved,
                                params=params[k], param_bytes=param_bytes[k], output_bytes=message,
                                optimizer=head.optimizer * share,
                                within={'B': again, 'BW': again} if again else {}))
    return replace(profile, layers=[*profile.layers[:-1], *pieces], loss=None, slices=None)


def _measured_layout(profile):
    """(rows, recompute) of the profile's measured slices: laid out by `slice_layout` (planning.slice_builders)
    over the head's rows, its parameters (h V) telling V; None where they do not."""
    from schedules.runtime.vocab_parallel import slice_layout
    slices, vocab = profile.slices, _vocab_size(profile)
    if not vocab:
        return None
    rows, q = slice_layout(vocab, len(slices), recompute=profile.slices_recompute)
    width = profile.layers[-1].params // vocab
    return (rows, q) if [c.params for c in slices] == [r * width for r in rows] else None


def _from_slices(profile, rows, q, cost):
    """The split head laid out as (rows, q), from slices measured in another layout (`_measured_layout`, known): a
    slice's seconds are linear in its rows and its recomputed rows (F, W and the optimizer step per row; B and BW
    per row and per recomputed row, fitted by least squares over the measured slices; where none recomputed, `cost`
    x a row's F + B + W), its saved bytes its input plus a micro-batch's logits per kept row (every row after B),
    its recomputed logits held inside B. Its message and input are the measured slice's in its place (the last's for
    the last slice, the first's for the others)."""
    import numpy as np
    slices, (had, shares), head = profile.slices, _measured_layout(profile), profile.layers[-1]
    again = [round(s * r) for s, r in zip(shares, had)]
    total = sum(had)
    per = {kind: sum(getattr(c, kind) for c in slices) / total for kind in ('F', 'W', 'optimizer')}
    for kind in ('B', 'BW'):  # seconds = a row's x rows + a recomputed row's x recomputed rows
        y = [getattr(c, kind) for c in slices]
        if any(again):
            fitted, *_ = np.linalg.lstsq(np.array([had, again], float).T, y, rcond=None)
            per[kind], per[kind + '+'] = (float(x) for x in fitted)
        else:
            per[kind] = sum(y) / total
            per[kind + '+'] = cost * (per['F'] + per['B'] + per['W'])
    kept_had = [r - a for r, a in zip(had, again)]
    logits = sum(c.saved['F'][0] - c.saved['F'][1] for c in slices) / max(sum(kept_had), 1)  # per kept row
    params, param_bytes = _split_count(head.params, rows), _split_count(head.param_bytes, rows)
    out = []
    for k, (r, share) in enumerate(zip(rows, q)):
        like = slices[-1] if k == len(rows) - 1 else slices[0]
        redo = round(share * r)
        own, passed = like.saved['F'][1], like.saved['F'][2]
        saved = {'F': [own + (r - redo) * logits, own, passed], 'B': [own + r * logits, own, like.saved['B'][2]],
                 'W': [0, 0, 0]}
        out.append(replace(like, F=per['F'] * r, B=per['B'] * r + per['B+'] * redo, W=per['W'] * r,
                           BW=per['BW'] * r + per['BW+'] * redo, saved=saved, params=params[k],
                           param_bytes=param_bytes[k], optimizer=per['optimizer'] * r,
                           within={'B': redo * logits, 'BW': redo * logits} if redo else {}))
    return out


_NOMINAL_ROWS = 1 << 30  # a head's row count where the profile does not give it: the layout's shares, unrounded


def _vocab_size(profile):
    """The head's rows V: as the profile records it (`meta['vocab_size']`: a head whose projection runs in its loss
    outputs no logits), else from its measurement, or None: its parameters are h V, its output over its input (the
    layer before's output) V / h tokens' worth alike."""
    if profile.meta.get("vocab_size"):
        return int(profile.meta["vocab_size"])
    head = profile.layers[-1]
    hidden = profile.layers[-2].output_bytes if len(profile.layers) > 1 else 0
    if not (head.params and head.output_bytes and hidden):
        return None
    vocab = round((head.params * head.output_bytes / hidden) ** 0.5)
    return vocab if vocab and head.params % vocab == 0 else None


def _split_count(count, rows):
    """`count` (parameters, bytes) over slices of `rows`: exactly in proportion where it is a multiple of the
    rows, else by largest remainders; the sum is `count` either way."""
    from schedules.runtime.vocab_parallel import vocab_rows
    total = sum(rows)
    if count % total == 0:
        return [count // total * r for r in rows]
    return vocab_rows(count, rows)


def stage_layers(parts, stage):
    return range(parts[stage], parts[stage + 1])


def _chunk_state(costs, state):
    """Bytes saved after `state` by a run of layers: their own, less each storage two neighbours share."""
    total = sum(c.saved[state][0] for c in costs)
    shared = sum(a.saved[state][2] for a, b in zip(costs, costs[1:]) if a.saved[state][2] and b.saved[state][1])
    return total - shared


def chunk_figures(profile, layers, last):
    """({kind: seconds}, {kind: saved-bytes change}) of a chunk running `layers` (plus the loss if `last`)."""
    costs = [profile.layers[i] for i in layers] + ([profile.loss] if last and profile.loss is not None else [])
    seconds = {k: sum(getattr(c, k) for c in costs) for k in KINDS}
    live = {s: _chunk_state(costs, s) for s in STATES}
    memory = {'F': live['F'], 'B': live['B'] - live['F'], 'W': live['W'] - live['B'], 'BW': -live['F']}
    within = {kind: held for kind in KINDS if (held := _chunk_within(costs, kind)) > max(memory[kind], 0)}
    if within:
        memory['within'] = within
    return seconds, memory


def _chunk_within(costs, kind):
    """The most a chunk's pass of `kind` holds above its start while it runs: its layers' passes in the order the
    pass runs them (forward in order, backward in reverse), each holding its own `within` above what the layers
    before it in the pass have added or freed (counted as `_chunk_state` counts them, each shared storage once)."""
    before, after = {'F': (None, 'F'), 'B': ('F', 'B'), 'W': ('B', 'W'), 'BW': ('F', None)}[kind]

    def change(run):  # what the pass changed over the layers `run` it has passed through
        return (_chunk_state(run, after) if after else 0) - (_chunk_state(run, before) if before else 0)
    return max((change(costs[:j] if kind == 'F' else costs[j + 1:]) + c.within[kind]
                for j, c in enumerate(costs) if c.within.get(kind)), default=0)


def compose(profile, placement, parts):
    """What the simulator needs for `placement` (an instance) with the model cut at `parts`:
    {'costs', 'memory'} keyed (rank, chunk), per rank 'params' and 'param_bytes', 'message_bytes' (the
    largest activation crossing a stage boundary), and 'outside' (per rank seconds of the optimizer step,
    plus the mirror placement's all-reduce of a rank's gradients with its mirror's)."""
    last = placement.num_stages - 1
    costs, memory = {}, {}
    params, param_bytes, optimizer = [0] * placement.ranks, [0] * placement.ranks, [0.0] * placement.ranks
    for r in range(placement.ranks):
        for c in range(placement.chunks):
            stage = placement.stage(r, c)
            layers = stage_layers(parts, stage)
            costs[(r, c)], memory[(r, c)] = chunk_figures(profile, layers, stage == last)
            params[r] += sum(profile.layers[i].params for i in layers)
            param_bytes[r] += sum(profile.layers[i].param_bytes for i in layers)
            optimizer[r] += sum(profile.layers[i].optimizer for i in layers)
    message = max((profile.layers[parts[s] - 1].output_bytes for s in range(1, len(parts) - 1)), default=0)
    outside = [o + profile.step_overhead for o in optimizer]  # the step's instructions cost even without parameters
    comm = None
    ep = expert_parallel_size(profile)
    if ep > 1:  # each stage's experts sharded over its data-parallel replicas: a rank holds 1/ep of them
        comm, held = _exchanged_experts(profile, placement, parts, ep)
        param_bytes = [b - h for b, h in zip(param_bytes, held)]
    if hasattr(placement, 'holders'):  # the mirror: one all-reduce of every gradient with the mirrored rank
        p2p = profile.p2p
        latency, per_byte = (p2p['reduce_latency'], p2p['reduce_per_byte']) if 'reduce_per_byte' in p2p else \
            (2 * p2p['latency'], 2 * p2p['per_byte'])  # a profile without the all-reduce: a message each way
        summed = param_bytes
        if shares_experts(profile):
            comm, held = _exchanged_experts(profile, placement, parts, 2)
            # a rank holds half of each of its stages' experts (`held` the other half), summed with no other rank's:
            # only the dense gradients are all-reduced
            summed = [b - 2 * h for b, h in zip(param_bytes, held)]
            param_bytes = [b - h for b, h in zip(param_bytes, held)]
        outside = [o + latency + per_byte * b for o, b in zip(outside, summed)]
    return {'costs': costs, 'memory': memory, 'params': params, 'param_bytes': param_bytes,
            'message_bytes': message, 'outside': outside, 'comm': comm}


def shares_experts(profile):
    """Whether DualPipe's two copies of each stage share its experts in the run profiled (train.py
    --dualpipe-experts shard: half each, every MoE layer's tokens exchanged between the copies) and the profile has
    any."""
    return profile.meta.get('dualpipe_experts') == 'shard' and any(c.exchanges for c in profile.layers)


def expert_parallel_size(profile):
    """Over how many data-parallel replicas of each stage the run profiled shards its experts (train.py
    --expert-parallel-size; 1 where its layers exchange nothing)."""
    ep = profile.meta.get('expert_parallel_size') or 1
    return ep if any(c.exchanges for c in profile.layers) else 1


def _exchanged_experts(profile, placement, parts, shards):
    """({(rank, chunk): {'F': s, 'B': s}}, per rank the expert bytes it does not hold) where each stage's experts are
    sharded over `shards` ranks (DualPipe's two copies with --dualpipe-experts shard, or --expert-parallel-size
    replicas), which exchange their tokens by all-to-all: a forward twice per expert layer (dispatch, combine), its
    backward twice again, each all-to-all sending (shards - 1) / shards of its payload and receiving as much; each
    rank holds 1 / shards of the experts. An all-to-all is priced as the profile measured one among its ranks
    (`a2a_latency` + `a2a_per_byte` x its payload, the part crossing scaled from the profile's rank count to
    `shards`), or, in a profile without it, as a message of the crossing part each way."""
    p2p = profile.p2p

    def crossing(n):  # the share of an all-to-all's payload that leaves each of its n ranks
        return (n - 1) / n
    if 'a2a_per_byte' in p2p:
        measured_over = max(profile.meta.get('ranks') or shards, 2)
        latency, per_byte = p2p['a2a_latency'], p2p['a2a_per_byte'] * crossing(shards) / crossing(measured_over)
    else:
        latency, per_byte = p2p['latency'], p2p['per_byte'] * crossing(shards)
    comm, held = {}, [0] * placement.ranks
    for r in range(placement.ranks):
        for c in range(placement.chunks):
            layers = [profile.layers[i] for i in stage_layers(parts, placement.stage(r, c))]
            seconds = sum(2 * (layer.exchanges * latency + per_byte * layer.exchange_bytes) for layer in layers)
            comm[(r, c)] = {'F': seconds, 'B': seconds}
            held[r] += sum(layer.expert_param_bytes * (shards - 1) // shards for layer in layers)
    return comm, held
