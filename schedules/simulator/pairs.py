"""An overlapped pair's time from the shape of its two passes: each pass a run of computation broken by its
collectives, `(computes, collectives)` with one more computation than collectives (seconds), as a traced pass
shows them (trace.communication_shapes).

The pair takes turns as schedules/runtime/overlap.py runs it: `first` (the backward) computes until it issues a
collective, then the other computes until it issues one of its own, and so on; a pass given the turn back first
waits for the collective it issued (exposed), then computes on. A pass that has ended gives the turn up for good,
and the other runs its rest alone. So a pass whose computation sits in one piece (GPTlite's last stage: the head's
backward, then two MoE layers' all-to-alls) hides little of the other's collectives, which the closed form
max(a1, c2) + max(a2, c1) of the totals misses; with even pieces the two agree.

Both passes' collectives cross the rank's one link: one issued while the other pass's is still in flight starts
crossing when that one ends (a throttled link carries the two one after the other; traced one at a time, each
took its whole time alone).
"""


def pair_ends(first, second, fill=0.0):
    """When each pass of an overlapped pair ends, from the pair's start: (first's, second's); see `_turns`, whose
    weight gradients left over run once both passes have ended, as the end of `first`."""
    ends, left = _turns(first, second, fill)
    return (max(ends) + left if left > 0 else ends[0]), ends[1]


def alone_ends(shape, fill=0.0):
    """(when a pass alone ends, the seconds of weight gradients it leaves): `shape` as `_turns`' `first`, `fill` the
    seconds of its computation that are weight gradients it computes while it waits for its collectives; what is
    left runs after it (a B whose own W comes next: the W, passes.own_weight_next)."""
    ends, left = _turns(shape, ([0.0], [], []), fill)
    return ends[0], left


def _turns(first, second, fill=0.0):
    """When each pass of an overlapped pair ends, from the pair's start, and the weight gradients left: ([first's,
    second's], seconds left). `first`, `second`:
    (computes, collectives[, kernels]) with len(computes) == len(collectives) + 1; `first` starts. `kernels`: the
    part of each collective that keeps the core busy (copying, the kernel's work), spread over its flight: a pass
    computing while the other's collective is in flight runs that much slower; a pass waiting for it loses nothing
    more (the collective's own time holds it). `fill`: seconds of `first`'s computation that are weight gradients
    it defers (overlap.fill_with): each of its computes gives that share to a pool, which a pass given the turn
    while its collective is in flight computes until the collective ends (on what of the core the collective's
    kernel share leaves); what is left is returned. A collective issued while the other pass's is in flight
    crosses after it (the module's note)."""
    parties = [(*p, [0.0] * len(p[1])) if len(p) == 2 else p for p in (first, second)]
    for computes, collectives, _ in parties:
        if len(computes) != len(collectives) + 1:
            raise ValueError(f"a pass's shape has {len(computes)} computations around {len(collectives)} "
                             f"collectives: one more computation than collectives expected")
    total = sum(parties[0][0])
    share = min(1.0, fill / total) if total > 0 and fill > 0 else 0.0
    if share:  # the first pass computes the rest, and each piece leaves its weight gradients to the pool
        parties[0] = ([a * (1.0 - share) for a in parties[0][0]], *parties[0][1:])
    pool = 0.0
    t, turn = 0.0, 0
    flight = [None, None]  # the collective a pass issued last and has not waited for: (its end, its kernel's share)
    at = [0, 0]  # the next computation of each pass
    ends = [None, None]
    while ends[0] is None or ends[1] is None:
        me = turn
        computes, collectives, kernels = parties[me]
        if flight[me] is not None:  # the wait, filled with weight gradients where the collective leaves the core
            end, kernel = flight[me]
            pool -= min(pool, max(0.0, end - t) * (1.0 - kernel))
            t, flight[me] = max(t, end), None
        t = _computed(t, computes[at[me]], flight[1 - me])
        if me == 0 and share:
            pool += computes[at[me]] * share / (1.0 - share)
        if at[me] < len(collectives):
            c = collectives[at[me]]
            end = max(t, flight[1 - me][0]) + c if flight[1 - me] is not None else t + c  # behind the other's
            flight[me] = (end, min(1.0, kernels[at[me]] / (end - t)) if end > t else 0.0)
            at[me] += 1
            if ends[1 - me] is None:
                turn = 1 - me
        else:
            ends[me] = t
            turn = 1 - me
    return ends, pool


def _computed(t, work, other):
    """When `work` seconds of computation started at `t` end, beside the other pass's collective in flight
    (`other`: (its end, the share of the core it keeps busy until then), or None)."""
    if other is None or other[0] <= t or work <= 0:
        return t + work
    end, share = other
    if share >= 1.0:
        return end + work
    alone = t + work / (1.0 - share)  # slowed throughout
    return alone if alone <= end else end + work - (end - t) * (1.0 - share)


def scaled(shape, compute, collectives, cpu=0.0):
    """`shape` ((computes, collectives), any scale) stretched to `compute` seconds of computation and `collectives`
    seconds of collectives, `cpu` of which keep the core busy, shared among the collectives by their lengths:
    (computes, collectives, kernels), pair_ends's form."""
    computes, colls = shape
    total_a, total_c = sum(computes), sum(colls)
    a = [x * compute / total_a if total_a > 0 else compute / len(computes) for x in computes]
    c = [x * collectives / total_c if total_c > 0 else 0.0 for x in colls]
    k = [x * cpu / total_c if total_c > 0 else 0.0 for x in colls]
    return a, c, k
