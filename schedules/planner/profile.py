"""The profile the chooser plans from: what each layer of a model costs on this device, measured once,
composable into the cost of any cut of the layer list into stages and chunks (compose.py).

Per layer (and for the loss, measured as one more layer after the last), on one micro-batch:

- `F`, `B`, `W`, `BW`: seconds of the forward, the input-gradient pass, the weight-gradient pass and the
  fused backward. B and W are split as the engines split them: B is the backward inside
  `defer_weight_grads()`, W is `apply_weight_grads` of what it queued (schedules/runtime/weight_grad.py).
- `saved`: bytes saved for backward (the engines' tracker convention, `SavedTensorTracker`: each storage
  once, parameters not counted, deferred W work counted until W runs) after the F, after the B and after
  the W, each as `[total, of which the layer's input storage, of which its output storage]`: where two
  layers meet in one chunk the storage one saves as its output and the next as its input is one storage,
  counted once (compose.py).
- `params`, `param_bytes`, `output_bytes` (what a cut after this layer sends), `optimizer`: seconds of
  one optimizer step over the layer's parameters.

Optionally (`slices`, `measure_slices`) the same figures of the last layer, a vocabulary head, split into
VocabSlices as a pipeline of that many stages runs it: each on the tuple it takes, the last with its loss.

Per device and job: `p2p` (ping-pong latency of a small message, its cost per byte, the time a send and
a receive take on their own rank, and an all-reduce's latency and cost per byte), `dispatch` (the
framework's work around each pass that a layer's own timing misses) and `step_overhead` (the engine's own work
per step, whatever the parameters). Times are the median of 3 to
`repeats` timed runs (as many as fit 150 ms) after a warm-up run, which also counts the saved bytes; layers
alike (a model's repeated blocks) then share the median of their figures (`pool_identical`).

Only torch: this file never builds an engine (calibration.py measures the engine's own work with one).
`measure_layers` runs on every rank of a job at once, each rank measuring its share of the layers, timed
together (`in_situ_times`: the devices busy side by side and the caches shared, as in training); `merge`
puts the shares together; `measure_p2p` needs the process group. `Profile.save` / `load` write JSON.
"""
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

KINDS = ('F', 'B', 'W', 'BW')
STATES = ('F', 'B', 'W')  # the saved bytes after each pass of the split backward


@dataclass
class LayerCost:
    name: str
    F: float
    B: float
    W: float
    BW: float
    saved: dict  # state -> [total, input's storage, output's storage] bytes
    params: int = 0
    param_bytes: int = 0
    output_bytes: int = 0
    optimizer: float = 0.0
    # kind -> the most bytes saved above the pass's start while it runs, where that is more than at its end: what a
    # pass holds only while it runs (a split head's recomputed logits in its backward); missing: nothing more
    within: dict = field(default_factory=dict)
    # a layer with experts (schedules/runtime/moe.py's ExpertLayer): how many expert layers it holds, the bytes of one
    # all-to-all's payload summed over them (its dispatched tokens; the combine's is as large), and its experts'
    # parameter bytes: what sharing its experts between ranks exchanges and saves
    exchanges: int = 0
    exchange_bytes: int = 0
    expert_param_bytes: int = 0

    @property
    def cost(self):
        """Seconds of its forward and backward: what a cut balanced on measured costs balances."""
        return self.F + self.BW


@dataclass
class Profile:
    layers: list  # LayerCost, in forward order
    loss: Optional[LayerCost] = None  # the loss, after the last layer (on the last stage)
    p2p: dict = field(default_factory=lambda: {'latency': 0.0, 'per_byte': 0.0, 'send': 0.0, 'recv': 0.0})
    dispatch: float = 0.0
    meta: dict = field(default_factory=dict)
    # the last layer (a vocabulary head) split into len(slices) VocabSlices as train.py --vocab-parallel builds them,
    # each measured on the tuple it takes, the last with the split head's loss (`measure_slices`); None: not measured
    slices: Optional[list] = None
    slices_recompute: bool = True  # their layout: slice_layout(recompute=...), gptlite.layer_specs' vocab_recompute
    step_overhead: float = 0.0  # the engine's own seconds per step on a rank, besides the optimizer's per parameter

    def to_json(self):
        data = {'version': 1, 'meta': self.meta, 'p2p': self.p2p, 'dispatch': self.dispatch,
                'layers': [asdict(c) for c in self.layers], 'loss': asdict(self.loss) if self.loss else None}
        if self.slices:  # optional: files without it load as before
            data['slices'] = {'recompute': self.slices_recompute, 'layers': [asdict(c) for c in self.slices]}
        if self.step_overhead:
            data['step_overhead'] = self.step_overhead
        return data

    @classmethod
    def from_json(cls, data):
        if data.get('version') != 1 or 'layers' not in data:
            raise ValueError("not a layer profile (version 1): write one with scripts/choose_schedule.py --save")
        loss = LayerCost(**data['loss']) if data.get('loss') else None
        slices = data.get('slices') or {}
        return cls([LayerCost(**c) for c in data['layers']], loss, dict(data['p2p']), data['dispatch'],
                   data.get('meta', {}), [LayerCost(**c) for c in slices['layers']] if slices else None,
                   bool(slices.get('recompute', True)), data.get('step_overhead', 0.0))

    def save(self, path):
        with open(path, 'w') as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path):
        with open(path) as f:
            return cls.from_json(json.load(f))

    @classmethod
    def synthetic(cls, layers, F=1.0, B=1.0, W=1.0, saved=1.0, params=1, optimizer=0.0, latency=0.0):
        """`layers` identical layers in units: each saves `saved` in its forward, B frees half, W the rest
        (the published convention), one parameter each. For tests and for reasoning in closed forms."""
        state = {'F': [saved, 0, 0], 'B': [saved / 2, 0, 0], 'W': [0, 0, 0]}
        cost = [LayerCost(f'L{i}', F, B, W, B + W, {k: list(v) for k, v in state.items()}, params, 4 * params, 0,
                          optimizer) for i in range(layers)]
        return cls(cost, None, {'latency': latency, 'per_byte': 0.0, 'send': 0.0, 'recv': 0.0}, 0.0,
                   {'synthetic': True})


# ----------------------------------------------------------------------------------------------
# Measuring layers

MIN_SECONDS, MIN_RUNS = 0.15, 3  # timed runs of a layer: MIN_RUNS (a median outvotes one slowed run) or more, up to
# `repeats`, until this long


def _typical_times(run, repeats, sync, warm_up=True):
    """The median seconds of each phase `run()` reports, over at least MIN_RUNS runs and at most `repeats`,
    as many as fit MIN_SECONDS, after one warm-up run. The median, not the least: a job's passes pay what the
    machine costs them (the other ranks' memory traffic, their shared caches, time slices lost), and the step
    predicted is the step that runs. On the deep model's 768-wide layers the least was 0.6 of the engine's
    forward; a pass slowed on its own is outvoted here and again by `pool_identical`."""
    if warm_up:
        run()
    times = []
    while len(times) < max(repeats, MIN_RUNS) and (len(times) < MIN_RUNS or sum(map(sum, times)) < MIN_SECONDS):
        sync()
        times.append(run())
    return [statistics.median(t[i] for t in times) for i in range(len(times[0]))]


def _tensors(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out, )) if hasattr(t, 'requires_grad')]


def _backward(out):
    """The backward of a layer's outputs: of those computed in it (a leaf among them, its input passed on, as a
    ChunkedHead or a VocabSlice passes the hidden state on, has no backward to run)."""
    import torch
    outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _fresh(x):
    """The layer's input as a stage receives it: a leaf, needing a gradient when it is a float tensor."""
    if isinstance(x, (tuple, list)):
        return type(x)(_fresh(t) for t in x)
    return x.detach().requires_grad_(x.is_floating_point())


def _nbytes(out):
    return sum(t.numel() * t.element_size() for t in _tensors(out))


def _storage_bytes(tracker, x):
    return sum(tracker.bytes_of(t) for t in _tensors(x))


def measure_layer(layer, x, name, repeats=7, optimizer=None, sync=lambda: None, call=None, in_place=False,
                  timed=True):
    """One layer's LayerCost on input `x` (its output is returned too, the next layer's input).
    `call(layer, x)` runs the forward (default `layer(x)`), e.g. a loss against its target. `in_place`: the
    weight gradients are added into `.grad` by their multiply, as our engines do in fp32 with one data-parallel
    rank (weight_grad.accumulate_in_place; through autograd a W pass costs 1.7x as much on the deep model).
    `timed=False`: its bytes only, the times left 0 (`measure_layers` times a rank's layers together after)."""
    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime.weight_grad import accumulate_in_place, apply_weight_grads, defer_weight_grads
    call = call or (lambda mod, inp: mod(inp))
    now = time.perf_counter

    def split():
        inp = _fresh(x)
        t0 = now()
        out = call(layer, inp)
        sync()
        t1 = now()
        with defer_weight_grads() as queue, accumulate_in_place(in_place):
            _backward(out)
        sync()
        t2 = now()
        apply_weight_grads(queue, in_place=in_place)
        sync()
        return t1 - t0, t2 - t1, now() - t2

    def fused():
        inp = _fresh(x)
        out = call(layer, inp)
        sync()
        t0 = now()
        with accumulate_in_place(in_place):
            _backward(out)
        sync()
        return (now() - t0, )

    params = [p for p in layer.parameters() if p.requires_grad] if hasattr(layer, 'parameters') else []
    saved = {}
    with SavedTensorTracker(ignore=params) as tracker:  # the warm-up run, whose times are not kept
        inp = _fresh(x)
        out = call(layer, inp)

        def state():
            return [tracker.live_bytes, _storage_bytes(tracker, inp), _storage_bytes(tracker, out)]

        def held(start):  # the most saved above `start` during the pass just run, where more than at its end
            most = tracker.peak_bytes - start
            return most if most > tracker.live_bytes - start else 0
        saved['F'] = state()
        within = {'F': held(0)}
        tracker.peak_bytes = tracker.live_bytes
        with defer_weight_grads() as queue:
            _backward(out)
        saved['B'] = state()
        within['B'] = held(saved['F'][0])
        tracker.peak_bytes = tracker.live_bytes
        apply_weight_grads(queue)
        saved['W'] = state()
        within['W'] = held(saved['B'][0])
    # a fused backward holds what B holds, or what B leaves and W holds besides
    within['BW'] = max(within['B'], saved['B'][0] - saved['F'][0] + within['W'])
    within = {kind: extra for kind, extra in within.items() if extra > 0}
    # split and fused alternate, alike exposed to the machine's load
    f, b, w, bw = _typical_times(lambda: split() + fused(), repeats, sync, warm_up=False) if timed else (0.0, ) * 4
    nxt = _detached(out)  # the next layer's input
    step = 0.0
    if params and optimizer is not None:
        opt = optimizer(params)

        def optimizer_step():
            t0 = now()
            opt.step()
            sync()
            return (now() - t0, )
        step, = _typical_times(optimizer_step, repeats, sync)
    return LayerCost(name, f, b, w, bw, saved, sum(p.numel() for p in params),
                     sum(p.numel() * p.element_size() for p in params), _nbytes(nxt), step, within,
                     **_experts_of(layer)), nxt


def _experts_of(layer):
    """{exchanges, exchange_bytes, expert_param_bytes} of a layer that has run a forward: its expert layers' (the
    modules reporting `exchange_bytes` and `expert_param_bytes()`: schedules.ExpertLayer, or one of your own)."""
    found = [m for m in layer.modules() if hasattr(m, 'exchange_bytes')] if hasattr(layer, 'modules') else []
    if not found:
        return {}
    return {'exchanges': len(found), 'exchange_bytes': sum(e.exchange_bytes for e in found),
            'expert_param_bytes': sum(e.expert_param_bytes() for e in found)}


def in_situ_times(entries, repeats=7, sync=lambda: None, in_place=False):
    """[(F, B, W, BW) seconds] of each (layer, input) in `entries` (a rank's share of a model's layers, in forward
    order), timed as a stage runs them: each pass over all of them in turn (the forwards, the input gradients in
    reverse, then the weight gradients; then the forwards again and the fused backwards), so that between two
    passes of a layer the others have run, as in training, where they and the other ranks evict its weights from
    the caches. A layer repeated on its own runs from the caches: a 768-wide layer's forward took 0.30 ms there
    against 0.46 ms in its stage. Then the median of 3 to `repeats` such rounds (`_typical_times`)."""
    from schedules.runtime.weight_grad import accumulate_in_place, apply_weight_grads, defer_weight_grads
    now = time.perf_counter

    def timed(work):
        t0 = now()
        out = work()
        sync()
        return now() - t0, out

    def forwards():
        outs, times = [], []
        for layer, x in entries:
            inp = _fresh(x)  # taken in as a leaf outside the time, as measure_layer does
            seconds, out = timed(lambda layer=layer, inp=inp: layer(inp))
            outs.append(out)
            times.append(seconds)
        return outs, times

    def one_round():
        outs, f = forwards()
        queues, b = [], []
        for out in reversed(outs):
            with defer_weight_grads() as queue, accumulate_in_place(in_place):
                seconds, _ = timed(lambda out=out: _backward(out))
            queues.append(queue)
            b.append(seconds)
        w = [timed(lambda q=q: apply_weight_grads(q, in_place=in_place))[0] for q in queues]
        outs, _ = forwards()
        bw = []
        for out in reversed(outs):
            with accumulate_in_place(in_place):
                bw.append(timed(lambda out=out: _backward(out))[0])
        return (*f, *b[::-1], *w[::-1], *bw[::-1])
    n = len(entries)
    flat = _typical_times(one_round, repeats, sync, warm_up=False)
    return [(flat[i], flat[n + i], flat[2 * n + i], flat[3 * n + i]) for i in range(n)]


def _detached(out):
    if isinstance(out, (tuple, list)):
        return type(out)(t.detach() if hasattr(t, 'detach') else t for t in out)
    return out.detach()


def measure_layers(builders, sample, loss_fn=None, target=None, repeats=7, optimizer=None, device=None,
                   dtype=None, sync=lambda: None, rank=0, world=1, in_place=False):
    """([LayerCost or None per layer], the loss's LayerCost or None): `builders` are (name, build) pairs, each
    building one layer (built one at a time, freed after); `sample` is the first layer's input, one
    micro-batch; `optimizer(params)` builds the run's optimizer over some parameters; `in_place`: see
    `measure_layer`.

    With `world` ranks measuring at once, rank `rank` measures its share of the layers (None for the others,
    which it only runs forward for their outputs): each layer goes to the rank with the least work so far,
    weighing a layer by its parameters plus its output's elements, the same assignment on every rank. The
    ranks then run side by side as in training; `merge` puts their shares together."""
    import torch
    x = sample.to(device) if device is not None else sample
    load = [0] * world
    costs = []

    def mine(weight):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += weight
        return owner == rank
    held = []  # (index, layer, input) of this rank's share, timed together once all are built
    for name, build in builders:
        layer = build()
        if device is not None or dtype is not None:
            layer = layer.to(device=device, dtype=dtype)
        with torch.no_grad():
            out = layer(x)
        weight = sum(p.numel() for p in layer.parameters()) + sum(t.numel() for t in _tensors(out))
        if mine(weight):
            held.append((len(costs), layer, x))
            cost, x = measure_layer(layer, x, name, repeats, optimizer, sync, in_place=in_place, timed=False)
        else:
            cost, x = None, _detached(out)
        costs.append(cost)
        del layer, out
    if held:
        times = in_situ_times([(layer, inp) for _, layer, inp in held], repeats, sync, in_place)
        for (i, _, _), (f, b, w, bw) in zip(held, times):
            costs[i] = replace(costs[i], F=f, B=b, W=w, BW=bw)
        del held
    loss = None
    if loss_fn is not None and mine(sum(t.numel() for t in _tensors(x))):
        tgt = target.to(device) if device is not None else target
        loss, _ = measure_layer(None, x, 'loss', repeats, None, sync, call=lambda _, inp: loss_fn(inp, tgt))
    return costs, loss


def measure_slices(builders, hidden, labels, loss_fn, repeats=7, device=None, dtype=None, sync=lambda: None,
                   rank=0, world=1, in_place=False):
    """[LayerCost or None per slice] of a vocabulary head split into slices (schedules/runtime/vocab_parallel.py):
    `builders` are (name, build) pairs of the VocabSlices in order; `hidden` the head's input (one micro-batch of
    the hidden state), `labels` its targets. Each slice is measured on the tuple it takes in a pipeline, (hidden,
    labels) into the first, (hidden, lse, z, labels) after, the earlier slices' outputs; the last together with
    `loss_fn` (vocab_parallel_loss) on its output, as the unsplit head's loss is measured after it and the
    split head's last stage runs it. `in_place`: see `measure_layer`.

    With `world` ranks at once, slice k goes to rank k mod world (to every rank r with r mod p = k where the ranks
    outnumber the slices), as a pipeline holds them side by side; a rank runs the slices before its own forward
    only, for their outputs, and returns None for the slices it did not measure (`merge` puts them together)."""
    import torch
    parts = len(builders)
    mine = [k % world == rank if world <= parts else rank % parts == k for k in range(parts)]
    hidden = hidden.to(device=device, dtype=dtype) if device is not None or dtype is not None else hidden
    tgt = labels.to(device) if device is not None else labels
    state, costs = (hidden, tgt), []
    for k, (name, build) in enumerate(builders):
        if not any(mine[k:]):
            costs.extend([None] * (parts - k))
            break
        layer = build()
        if device is not None or dtype is not None:
            layer = layer.to(device=device, dtype=dtype)
        if mine[k]:
            last = k == parts - 1
            call = (lambda mod, inp: loss_fn(mod(inp))) if last else None
            cost, out = measure_layer(layer, state, name, repeats, None, sync, call=call, in_place=in_place)
        else:
            with torch.no_grad():
                cost, out = None, _detached(layer(state))
        costs.append(cost)
        state = out
        del layer
    return costs


def merge(per_rank):
    """One profile's layers from the ranks' shares (`measure_layers` on each): for each layer, the median of
    each time over the ranks that measured it (bytes and counts are the same on every rank)."""
    def med(costs):
        costs = [c for c in costs if c is not None]
        if not costs:
            return None
        times = {k: statistics.median(getattr(c, k) for c in costs) for k in KINDS + ('optimizer', )}
        return LayerCost(**{**asdict(costs[0]), **times})
    layers = [med([r[0][i] for r in per_rank]) for i in range(len(per_rank[0][0]))]
    return layers, med([r[1] for r in per_rank])


def pool_identical(layers):
    """Layers alike (same class, parameters, output and saved bytes: a model's repeated blocks) cost alike:
    each time becomes the median over the layers alike, which a pass slowed by another process cannot move."""
    groups = {}
    for i, c in enumerate(layers):
        key = (c.name, c.params, c.param_bytes, c.output_bytes, json.dumps(c.saved, sort_keys=True))
        groups.setdefault(key, []).append(i)
    out = list(layers)
    for members in groups.values():
        times = {k: statistics.median(getattr(layers[i], k) for i in members) for k in KINDS + ('optimizer', )}
        for i in members:
            out[i] = LayerCost(**{**asdict(layers[i]), **times})
    return out


STEP_SAMPLE = 16 << 20  # parameters the step is timed on at most (per parameter it is flat beyond a few million)
EVICT_BYTES = 64 << 20  # written between timed steps: the step finds its tensors out of the caches, as in training


def measure_step(numel, optimizer, clip=True, repeats=3, device=None, sync=lambda: None):
    """Seconds per parameter of the optimizer step at the end of an iteration, for a rank holding `numel`
    parameters: timed on one flat tensor of min(numel, STEP_SAMPLE) (how ZeRO's partition and the lean step hold
    a rank's parameters), with the caches evicted before each step as the iteration's passes evict them. With
    `clip`, also the gradient's norm as DeepSpeed takes it (in fp64, into a kept buffer) and the scaling.

    Per layer, `measure_layer` times a step over one layer's few tensors, warm: on a model of small layers that is
    a quarter of what the engines' step takes (the deep model, 3.5M parameters a rank: 2 ms against 8, and the
    norm another 4), so planning.measure costs every layer's step at this rate instead."""
    import torch
    n = max(1, min(int(numel), STEP_SAMPLE))
    weight = torch.zeros(n, device=device, requires_grad=True)
    weight.grad = torch.full_like(weight, 1e-3)
    opt = optimizer([weight])
    wide = torch.empty(n, dtype=torch.float64, device=device)
    scratch = torch.empty(EVICT_BYTES // 4, device=device)

    def once():
        scratch.fill_(1.0)
        sync()
        t0 = time.perf_counter()
        if clip:
            wide.copy_(weight.grad)
            norm = torch.linalg.vector_norm(wide).item()
            weight.grad.mul_(min(1.0, 1e3 / (norm + 1e-6)))
        opt.step()
        sync()
        return (time.perf_counter() - t0, )
    seconds, = _typical_times(once, repeats, sync)
    return seconds / n


# ----------------------------------------------------------------------------------------------
# The job: point-to-point messages and the engine's own work per pass

def measure_p2p(nbytes, repeats=20, device=None, reduce_bytes=8 << 20, a2a_bytes=2 << 20):
    """{'latency', 'per_byte', 'send', 'recv', 'reduce_latency', 'reduce_per_byte'} between ranks 0 and 1 of
    the default process group: one-way time of a 4-byte message by ping-pong (latency) and the slope per byte
    up to a message of max(`nbytes`, 1 MiB); the time posting a send of `nbytes` takes on its rank, and the
    time a receive takes once its sender waits beyond the message's one-way time (the wire time is the
    latency's, which the simulator charges between the two: counted here too, a slow link's was paid twice);
    an all-reduce of 4 bytes and of `reduce_bytes` over all ranks (what DualPipe's gradient sum costs); an
    all-to-all of a few bytes and of `a2a_bytes` a rank (a2a_latency, a2a_per_byte: per byte of what each rank puts
    in: the experts' exchange of tokens, timed on the rank that enters it last). The
    least time of the repeats. Every rank of the group calls it, and gets the same figures."""
    import torch
    import torch.distributed as dist

    from schedules.runtime.all_to_all import post_all_to_all
    rank = dist.get_rank()
    nbytes = max(int(nbytes), 8)
    small, message, big = (torch.zeros(n // 4, device=device) for n in (4, nbytes, max(nbytes, 1 << 20)))

    def ping_pong(x, n=repeats):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - t0) / 2)
        return min(times)

    def all_reduce(x, n=5):
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        return min(times)

    def blocking_send(x, n=3):  # how long a send holds its rank when the receive was posted before it
        times = []
        for _ in range(n):
            dist.barrier()
            if rank == 0:
                time.sleep(0.002)
                t0 = time.perf_counter()
                dist.send(x, 1)
                times.append(time.perf_counter() - t0)
            elif rank == 1:
                dist.recv(x, 0)
        return min(times) if times else 0.0

    dist.barrier()
    ping_pong(small, 3)  # warm-up: connections
    lat_small, lat_big = ping_pong(small), ping_pong(big, max(3, repeats // 4))
    send_big = blocking_send(big)
    sends, recvs = [], []
    for _ in range(repeats):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            work = dist.isend(message, 1)
            sends.append(time.perf_counter() - t0)
            work.wait()
        elif rank == 1:
            time.sleep(0.002)  # the sender is waiting when the receive is posted
            t0 = time.perf_counter()
            dist.recv(message, 0)
            recvs.append(time.perf_counter() - t0)
    def all_to_all(n, repeats=3):  # an all-to-all of `n` floats a rank (the experts' exchange of tokens)
        x = torch.zeros(n, device=device)
        out = torch.empty_like(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            if rank == 0:
                # timed on the rank that enters last, as one always does in training (with torch's all-to-all
                # on gloo the two ways then crossed one after the other: schedules/runtime/all_to_all.py)
                time.sleep(0.002)
            t0 = time.perf_counter()
            post_all_to_all(out, x, None).wait()  # the exchange the experts run
            times.append(time.perf_counter() - t0)
        return min(times)

    reduce_small = all_reduce(torch.zeros(1, device=device))
    reduce_big = all_reduce(torch.zeros(reduce_bytes // 4, device=device), 3)
    world = dist.get_world_size()
    a2a_floats = (a2a_bytes // 4) // world * world
    a2a_small, a2a_big = all_to_all(world), all_to_all(a2a_floats)
    per_byte = (lat_big - lat_small) / max(big.numel() * 4 - 4, 1)
    # the bytes the transport takes before the wire has carried them (the sockets' buffers): a send of `big`
    # returned that much wire time before the message's one-way time
    buffered = big.numel() * 4 - max(send_big - lat_small, 0.0) / per_byte if per_byte > 0 else float(big.numel() * 4)
    mine = [lat_small, per_byte, min(sends) if sends else 0.0, min(recvs) if recvs else 0.0, reduce_small,
            (reduce_big - reduce_small) / reduce_bytes, min(max(buffered, 0.0), big.numel() * 4), a2a_small,
            (a2a_big - a2a_small) / (4 * a2a_floats - 4 * world)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)  # every rank gets rank 0's and rank 1's figures
    one_way = every[0][0] + max(every[0][1], 0.0) * (nbytes - 4)
    return {'latency': every[0][0], 'per_byte': max(every[0][1], 0.0), 'send': every[0][2],
            'recv': max(every[1][3] - one_way, 0.0),
            'reduce_latency': every[0][4], 'reduce_per_byte': max(every[0][5], 0.0), 'buffered': every[0][6],
            'a2a_latency': every[0][7], 'a2a_per_byte': max(every[0][8], 0.0)}


def message_times(p2p, nbytes):
    """simulate's `latency`, `send_wait` and `wire` for messages of `nbytes` between two ranks: the one-way time;
    how long a send waits once both sides posted it, which is only the wire time of what the sockets' buffers
    (`p2p['buffered']` bytes, measured) cannot take at once (gloo moves a message only once its receive is
    posted); and how long it holds the link (its bytes over the link's rate), so that messages between the same
    ranks cross one after the other. A profile without 'buffered' (older) waits for the whole message."""
    latency, wire = p2p['latency'] + p2p['per_byte'] * nbytes, p2p['per_byte'] * nbytes
    if 'buffered' not in p2p:
        return {'latency': latency, 'send_wait': None, 'wire': wire}
    return {'latency': latency, 'wire': wire,
            'send_wait': p2p['latency'] + p2p['per_byte'] * max(nbytes - p2p['buffered'], 0.0)}


def measure_dispatch(activation, repeats=50):
    """Seconds of the framework's own work around one pass that a layer's timing leaves out, estimated
    without an engine: taking the input in as a leaf, copying the output into a buffer and starting
    autograd's backward on a one-op graph. A lower estimate: a traced run (trace.measured_dispatch)
    measures the engine's full instruction loop."""
    import torch
    x = activation.detach()
    if not x.is_floating_point():
        x = x.float()

    def once():
        t0 = time.perf_counter()
        inp = x.detach().requires_grad_()
        out = inp * 1.0
        kept = out.clone()
        torch.autograd.backward(out.sum())
        del kept
        return (time.perf_counter() - t0, )
    return _typical_times(once, repeats, lambda: None)[0]
