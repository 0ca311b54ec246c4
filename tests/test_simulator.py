"""The pipeline-schedule simulator: measured costs, DeepSpeed's DualPipeV, broken streams, extension APIs
(the closed forms of every schedule are in test_closed_forms.py).

Every broken stream must end in a ScheduleError naming the rank and what it waited on: the
simulator detects lack of progress, so none of these tests can hang.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from deepspeed.runtime.pipe import schedule as ds

from schedules import registry
from schedules.errors import ScheduleError
from schedules.placement import DualPipeVPlacement, InterleavedPlacement, SplitBackwardPlacement, StockPlacement
from schedules.registry import register_schedule
from schedules.simulator.simulate import Compute, register_instruction, simulate
from schedules.simulator.timeline import Timeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# helpers

def perturbed(base, rank, edit, **overrides):
    """A PipeSchedule running `base` on every rank, with `edit(steps)` applied to rank `rank`'s steps."""

    class Perturbed(ds.PipeSchedule):
        def __init__(self, micro_batches, stages, stage_id):
            super().__init__(micro_batches, stages, stage_id)
            self.inner = base(micro_batches=micro_batches, stages=stages, stage_id=stage_id)

        def steps(self):
            steps = [list(cmds) for cmds in self.inner.steps()]
            if self.stage_id == rank:
                edit(steps)
            yield from steps

    return Perturbed


def find(steps, instr_type, nth=0):
    """(step, index) of the nth instruction of exactly `instr_type`."""
    return [(s, i) for s, cmds in enumerate(steps) for i, c in enumerate(cmds) if type(c) is instr_type][nth]


def check_causality(timeline, stages):
    """Independent of the simulator's internals: every pass after the ones it needs, no overlap on a rank."""
    done = {}
    for rank, row in enumerate(timeline.ranks):
        for a, b in zip(row, row[1:]):
            assert a.end <= b.start + 1e-9, f'rank {rank}: {a} overlaps {b}'
        for p in row:
            key = (p.kind, p.stage, p.micro_batch, p.iteration)
            assert key not in done, f'{key} ran twice'
            done[key] = p
    for (kind, stage, mb, it), p in done.items():
        if kind == 'F' and stage > 0:
            assert done[('F', stage - 1, mb, it)].end <= p.start + 1e-9
        if kind in ('B', 'BW'):
            assert done[('F', stage, mb, it)].end <= p.start + 1e-9
            if stage < stages - 1:
                assert done[(kind, stage + 1, mb, it)].end <= p.start + 1e-9


def test_latency_and_costs_in_seconds():
    # p=2, M=1, latency 0.25: F, shape message + activation (2 latencies), F, BW, gradient, BW.
    r = simulate('1f1b', 2, 1, latency=0.25, iterations=1)
    assert r.makespan == 1 + 0.5 + 1 + 2 + 0.25 + 2
    costs = {(rank, 0): {'F': 2.0, 'B': 1.5, 'W': 2.5} for rank in range(3)}  # BW = B + W = 4 s
    r = simulate('1f1b', 3, 4, costs=costs, iterations=1)
    assert r.units == 's' and r.timeline.units == 's'
    assert r.makespan == (4 + 3 - 1) * 6.0
    assert r.per_rank[1]['idle_synced'] == 2 * 6.0


def test_costs_that_cannot_make_a_backward_are_refused_in_one_line():
    """A fused backward (BW) is its 'BW' or 'B' + 'W'; a B or W alone is half a 'BW'. Given 'B' without 'W' or
    'BW', each was asked of the other until Python's recursion limit."""
    refused = r"costs of rank \d, chunk 0: 'BW' asked for; give 'BW' or both 'B' and 'W'.*given: \['B', 'F'\]"
    with pytest.raises(ValueError, match=refused):
        simulate('1f1b', 2, 4, costs={(r, 0): {'F': 1.0, 'B': 2.0} for r in range(2)}, iterations=1)
    assert simulate('1f1b', 2, 4, costs={(r, 0): {'F': 1.0, 'BW': 2.0} for r in range(2)}, iterations=1).makespan > 0


def test_time_on_a_rank_besides_its_passes():
    """p2p_cpu: a send and a receive also take time on their own rank; dispatch: the engine's own
    work before each pass. Neither counts as busy."""
    base = simulate('1f1b', 2, 1, iterations=1)  # F, F, BW, BW on the critical path: 6
    assert base.makespan == 6
    r = simulate('1f1b', 2, 1, iterations=1, dispatch=0.1)
    assert r.makespan == pytest.approx(6.4) and r.per_rank[0]['busy'] == 3
    r = simulate('1f1b', 2, 1, iterations=1, dispatch={0: 0.0, 1: 0.5})  # rank 1's two passes
    assert r.makespan == pytest.approx(7.0)
    r = simulate('1f1b', 2, 1, iterations=1, p2p_cpu=(0.25, 0.125))  # one activation, one gradient
    assert r.makespan == pytest.approx(6 + 2 * (0.25 + 0.125))


class _PostedAtTheInstruction(SplitBackwardPlacement):
    receives_ahead = False


def test_receives_posted_ahead_take_a_message_while_the_receiver_computes():
    """Our engines post each channel's next receive when the one before it is taken (receive_ahead.py), so a
    message sent while its receiver computes is there when it needs it; gloo moves a message only once its receive
    is posted. 1F1B on our engine, p = 2, unit costs, latency 3 (> a pass)."""
    def starts(placement):
        r = simulate('1f1b-lean', 2, 4, placement=placement, latency=3.0, iterations=1)
        return {(rank, p.kind, p.micro_batch): p.start for rank, row in enumerate(r.timeline.ranks) for p in row}
    ahead, late = starts(SplitBackwardPlacement), starts(_PostedAtTheInstruction)
    # the receives posted at the step's start: F0 on rank 0 ends at 1, the activation is there at 1 + 3 (its shape
    # message beside it, both sends asynchronous); rank 1's BW0 ends at 7, the gradient is on rank 0 at 10
    assert ahead[1, 'F', 0] == 4.0 and ahead[0, 'BW', 0] == 10.0
    # posted at the instructions: the activation is asked for once its shapes are in (4), there at 7; the
    # gradient once rank 0 reaches its RecvGrad
    assert late[1, 'F', 0] == 7.0 and late[0, 'BW', 0] == 13.0


def test_a_blocking_send_returns_once_its_bytes_are_handed_over():
    """send_wait: a send completes that long after both sides posted it (the sockets' buffers take the message),
    not when it arrives. DeepSpeed's 1F1B sends block: rank 0's second forward waits for its first send."""
    def second_forward(**links):
        return simulate('1f1b', 2, 4, latency=3.0, iterations=1, **links).timeline.ranks[0][1].start
    # F0 ends at 1; its shape message (a few bytes) arrives a small message's latency later: send_wait where it is
    # given, else the latency; the data's receive is posted once the shapes arrived (1 + wait), and the data's send
    # is done a wait after that
    assert second_forward() == 1 + 2 * 3.0
    assert second_forward(send_wait=0.0) == 1.0
    assert second_forward(send_wait=0.5) == 2.0


def test_messages_between_two_ranks_share_their_link():
    """wire: a message holds the link from its rank to its peer that long, so the two chunks' messages of a V
    schedule (an activation of one, a gradient of the other, on one link) cross one after the other; one chunk a
    rank, the one message in flight on each link never waits for another."""
    for name in ('zb-v', 'dualpipev', 'interleaved'):
        alone = simulate(name, 2, 4, latency=5.0, iterations=1).makespan
        shared = simulate(name, 2, 4, latency=5.0, wire=5.0, iterations=1).makespan
        assert alone < shared <= alone + 16 * 5.0, name
    for name in ('zb-h1', '1f1b-lean'):
        assert simulate(name, 2, 4, latency=5.0, wire=5.0, iterations=1).makespan == \
            simulate(name, 2, 4, latency=5.0, iterations=1).makespan, name


class _NoticeAhead(DualPipeVPlacement):
    notice_behind_sends = False


def test_a_batch_that_sends_first_tells_its_peer_of_its_receive_behind_those_bytes():
    """DeepSpeed's DualPipeVEngine posts a CommitP2P batch's sends before its receives, and gloo writes a receive's
    ready-notice behind the bytes the rank is sending that peer: where both ranks exchange in one batch, the
    second message crosses after the first. The simulator counts such a receive as posted once the rank's own sends
    to that peer held the link: with a link (wire > 0) the step is longer by at least one message's wire and at
    most one per exchange; with none, nothing changes."""
    def step(placement, wire):
        return simulate('dualpipev-deepspeed', 2, 4, placement=placement, latency=5.0, wire=wire,
                        iterations=1).makespan
    assert step(DualPipeVPlacement, 0.0) == step(_NoticeAhead, 0.0)
    behind, ahead = step(DualPipeVPlacement, 5.0), step(_NoticeAhead, 5.0)
    assert ahead + 5.0 <= behind <= ahead + 16 * 5.0


class _NoticeAheadOfSends(SplitBackwardPlacement):
    notice_behind_sends = False


class _InterleavedNoticeAheadOfSends(InterleavedPlacement):
    notice_behind_sends = False


def test_a_receive_posted_after_a_send_to_its_peer_counts_as_posted_once_those_bytes_held_the_link():
    """Our engines post each channel's next receive as soon as the one before is taken, often right after sending
    that peer a message: the receive's ready-notice crosses behind those bytes (the link is one queue, whatever the
    communicator). ZB-H2 and interleaved on two ranks, unit costs, latency 5, wire 5: such a receive lets its
    sender start later, the step is longer by about one wire. No link (wire 0), no change."""
    for name, placement, off, later in (('zb-h2', SplitBackwardPlacement, _NoticeAheadOfSends, 5.0),
                                        ('interleaved', InterleavedPlacement, _InterleavedNoticeAheadOfSends, 5.5)):
        def step(where, **links):
            return simulate(name, 2, 4, placement=where, latency=5.0, send_wait=0.1, iterations=1, **links).makespan
        assert step(placement) == step(off)
        assert step(placement, wire=5.0) == step(off, wire=5.0) + later, name


@pytest.mark.parametrize('overlap', [False, True])
def test_collectives_of_a_pass_and_an_overlapped_pair(overlap):
    """comm: a pass's own collectives (the experts' all-to-alls). Alone, a pass computes then waits for them; in
    an overlapped pair (DualPipe's forward and backward run as one unit) each computes while the other's are in
    flight: max(F, cB) + max(B, cF)."""
    compute = {'F': 1.0, 'B': 1.5, 'W': 0.75}
    comm = {'F': 2.0, 'B': 0.5}
    costs = {(r, c): dict(compute) for r in range(2) for c in range(2)}
    r = simulate('dualpipe', 2, 8, costs=costs, comm={key: dict(comm) for key in costs}, overlap=overlap,
                 iterations=1)
    kinds = Counter()
    for row in r.timeline.ranks:
        units = {}
        for p in row:
            units.setdefault(p.pair, []).append(p) if p.pair is not None else units.setdefault(id(p), [p])
        for unit in units.values():
            took = sum(p.duration for p in unit)
            if len(unit) == 1:
                (p, ) = unit
                own = compute.get(p.kind, compute['B'] + compute['W']) + comm.get(p.kind, comm['B'] * (p.kind == 'BW'))
                assert took == pytest.approx(own), p
            else:
                f, b = sorted(unit, key=lambda p: p.kind != 'F')
                bc = compute['B'] + (compute['W'] if b.kind == 'BW' else 0.0)
                want = max(compute['F'], comm['B']) + max(bc, comm['F']) if overlap else \
                    compute['F'] + comm['F'] + bc + comm['B']
                assert took == pytest.approx(want), (f, b)
            kinds[len(unit)] += 1
    assert kinds[2] > 0 and kinds[1] > 0  # pairs and passes alone both checked
    alone = simulate('dualpipe', 2, 8, costs=costs, iterations=1).makespan
    assert r.makespan > alone


def test_the_part_of_a_collective_that_keeps_the_core_busy_is_not_hidden():
    """comm_cpu: the part of a pass's collectives that occupies its own core (copying, the kernel's work) runs beside
    no computation: an overlapped pair costs max(F + kF, cB) + max(B + kB, cF), and where all of a collective is
    the core's (an unthrottled link) the pair costs what its passes cost one after the other."""
    compute = {'F': 1.0, 'B': 1.5, 'W': 0.75}
    comm = {'F': 2.0, 'B': 0.5}
    costs = {(r, c): dict(compute) for r in range(2) for c in range(2)}

    def run(cpu, overlap=True):
        return simulate('dualpipe', 2, 8, costs=costs, comm={k: dict(comm) for k in costs}, overlap=overlap,
                        comm_cpu=cpu and {k: dict(cpu) for k in costs}, iterations=1)
    cpu = {'F': 0.25, 'B': 0.25}
    for row in run(cpu).timeline.ranks:
        units = {}
        for p in row:
            if p.pair is not None:
                units.setdefault(p.pair, []).append(p)
        for unit in units.values():
            f, b = sorted(unit, key=lambda p: p.kind != 'F')
            bc = compute['B'] + (compute['W'] if b.kind == 'BW' else 0.0)
            want = max(compute['F'] + cpu['F'], comm['B']) + max(bc + cpu['B'], comm['F'])
            assert sum(p.duration for p in unit) == pytest.approx(want), (f, b)
    assert run(None).makespan < run(cpu).makespan < run(comm).makespan
    assert run(comm).makespan == pytest.approx(run(None, overlap=False).makespan)


def test_activation_memory_from_measured_pass_deltas():
    """W holding more than the forward saved (linear layers keep their input and output gradient):
    B adds memory. ZB-H1's last rank runs F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3."""
    table = {(r, 0): {'F': 9.0, 'B': 7.0, 'W': -16.0} for r in range(2)}
    res = simulate('zb-h1', 2, 4, iterations=1, memory=table)
    assert res.per_rank[1]['peak_activation_memory'] == 32.0  # 9+7+9+7: two micro-batches waiting for W
    assert simulate('zb-h1', 2, 4, iterations=1).per_rank[1]['peak_activation_memory'] == 1.5  # the convention
    only_f = {(r, 0): {'F': 4.0} for r in range(2)}  # BW frees F, B and W half of it each
    assert simulate('1f1b', 2, 4, iterations=1, memory=only_f).per_rank[0]['peak_activation_memory'] == 8.0
    assert simulate('zb-h1', 2, 4, iterations=1, memory=only_f).per_rank[1]['peak_activation_memory'] == 6.0
    w_given = {(r, 0): {'F': 4.0, 'W': -3.0} for r in range(2)}  # B = -4 - (-3)
    assert simulate('zb-h1', 2, 4, iterations=1, memory=w_given).per_rank[1]['peak_activation_memory'] == 7.0


# ----------------------------------------------------------------------------------------------
# DeepSpeed's DualPipeV

@pytest.mark.parametrize('p,m', [(2, 4), (2, 7), (3, 6), (3, 10), (4, 8), (4, 9), (5, 12), (6, 12)])
def test_dualpipev_deepspeed_runs_to_completion(p, m):
    r = simulate('dualpipev-deepspeed', p, m, iterations=3)
    runs = Counter((p_.kind, p_.stage, p_.micro_batch) for _, p_ in r.timeline.passes())
    # every micro-batch: exactly one F and one BW on each of the 2p stages, nothing else
    assert runs == Counter({(k, s, mb): 1 for k in ('F', 'BW') for s in range(2 * p) for mb in range(m)})
    for rank, row in enumerate(r.timeline.ranks):
        assert {(x.chunk, x.stage) for x in row} == {(0, rank), (1, 2 * p - 1 - rank)}
    for row in r.per_rank:
        assert row['busy'] == 3 * m  # 2 chunks x M x (F 0.5 + BW 1)
        assert row['params'] == 1  # two half-size chunks
        # Figures of the simulator itself, checked by hand on the P=2 timeline; with the
        # backward fused and the batched CommitP2P waiting for all its transfers, DeepSpeed's
        # DualPipeV idles (5P - 6)/2 on every rank (1F1B: 3P - 3) and holds P + 1/2 micro-batch
        # activations of a 1F1B stage on every rank (1F1B: P on rank 0).
        assert row['idle_synced'] == (5 * p - 6) / 2
        assert row['peak_activation_memory'] == p + 0.5
    assert r.period == r.makespan  # rank 0 starts and ends each iteration
    check_causality(r.timeline, 2 * p)
    check_causality(r.chained, 2 * p)


def test_dualpipev_constraints():
    with pytest.raises(ValueError, match='at least 2 \\* 4 micro-batches'):
        simulate('dualpipev-deepspeed', 4, 7)


def test_dualpipev_tensor_meta_exchange_changes_no_matching():
    # The engine's blocking shape exchange at the first activation of each phase is modelled; it
    # matches cleanly and costs only its latency (nothing at zero latency).
    class NoMeta(DualPipeVPlacement):
        tensor_meta = False
    a = simulate(ds.DualPipeVSchedule, 4, 8, placement=DualPipeVPlacement, iterations=1)
    b = simulate(ds.DualPipeVSchedule, 4, 8, placement=NoMeta, iterations=1)
    assert a.timeline.to_dict() == b.timeline.to_dict()
    a = simulate(ds.DualPipeVSchedule, 4, 8, placement=DualPipeVPlacement, latency=0.1, iterations=1)
    b = simulate(ds.DualPipeVSchedule, 4, 8, placement=NoMeta, latency=0.1, iterations=1)
    assert a.makespan > b.makespan


# ----------------------------------------------------------------------------------------------
# broken streams are reported, not hung on

def test_receive_posted_before_the_send_it_needs_deadlocks():
    # rank 0 waits for the gradient of micro-batch 0 before sending its activation
    def edit(steps):
        s, i = find(steps, ds.RecvGrad)
        recv = steps[s].pop(i)
        s, i = find(steps, ds.SendActivation)
        steps[s].insert(i, recv)
    with pytest.raises(ScheduleError) as err:
        simulate(perturbed(ds.TrainSchedule, 0, edit), 2, 4, iterations=1)
    msg = str(err.value)
    assert msg.startswith('Deadlock')
    assert 'rank 0 (iteration 0, step 1: RecvGrad(buffer_id=0)) waits to receive gradient of stage 1->0 ' \
           'for micro-batch 0 from rank 1' in msg
    # rank 1's first receive starts with the engine's tensor-shape message
    assert ('rank 1 (iteration 0, step 1: RecvActivation(buffer_id=0)) waits to receive tensor-meta of stage 0->1'
            in msg)


def test_swapped_receives_match_an_activation_with_a_gradient():
    # DualPipeV: rank 0 receives phase-1 activations and phase-0 gradients from rank 1 in one
    # batch; swapping the two receives pairs a gradient receive with an activation send.
    def edit(steps):
        for cmds in steps:
            for i, (a, b) in enumerate(zip(cmds, cmds[1:])):
                if type(a) is ds.RecvActivation and type(b) is ds.RecvGrad and a.phase == 1:
                    cmds[i], cmds[i + 1] = b, a
                    return
        raise AssertionError('no such batch')
    with pytest.raises(ScheduleError) as err:
        simulate(perturbed(ds.DualPipeVSchedule, 0, edit), 2, 4, placement=DualPipeVPlacement, iterations=1)
    msg = str(err.value)
    assert msg.startswith('protocol error between rank 1 and rank 0')
    assert 'rank 0 (iteration 0, step 5: RecvGrad(buffer_id=0, phase=0)) waits to receive gradient' in msg
    assert 'SendActivation(buffer_id=6, phase=1)) trying to send activation' in msg


def test_missing_send_deadlocks():
    def edit(steps):
        s, i = find(steps, ds.SendActivation, -1)
        del steps[s][i]
    with pytest.raises(ScheduleError) as err:
        simulate(perturbed(ds.TrainSchedule, 0, edit), 2, 4, iterations=1)
    msg = str(err.value)
    assert 'rank 1 (iteration 0, step 7: RecvActivation(buffer_id=1)) waits to receive activation of ' \
           'stage 0->1 for micro-batch 3 from rank 0, which is itself blocked at rank 0' in msg


def test_receive_without_send_and_send_without_receive():
    extra_recv = perturbed(ds.TrainSchedule, 1, lambda steps: steps.append([ds.RecvActivation(0)]))
    with pytest.raises(ScheduleError, match=r'(?s)^Receive without send:.*rank 1 .*RecvActivation\(buffer_id=0\)\) '
                                            r'waits to receive activation .* from rank 0, which has finished'):
        simulate(extra_recv, 2, 4, iterations=1)
    extra = [ds.LoadMicroBatch(5), ds.ForwardPass(5), ds.SendActivation(5)]  # a fifth micro-batch
    with pytest.raises(ScheduleError) as err:
        simulate(perturbed(ds.TrainSchedule, 0, lambda steps: steps.append(extra)), 2, 4, iterations=1)
    assert str(err.value).startswith('Send with no matching receive:')
    assert 'rank 0 (iteration 0, step 10: SendActivation(buffer_id=5)) waits to send activation of stage 0->1 ' \
           'for micro-batch 4 to rank 1, which has finished its stream' in str(err.value)
    # sending a buffer whose output the backward already consumed is a misuse
    resend = perturbed(ds.TrainSchedule, 0, lambda steps: steps.append([ds.SendActivation(0)]))
    with pytest.raises(ScheduleError, match='rank 0 .*sends buffer 0, which holds no forward output'):
        simulate(resend, 2, 4, iterations=1)


def test_backward_before_forward_and_buffer_misuse():
    def edit(steps):
        (s1, i1), (s2, i2) = find(steps, ds.ForwardPass), find(steps, ds.BackwardPass)
        steps[s1][i1], steps[s2][i2] = steps[s2][i2], steps[s1][i1]
    with pytest.raises(ScheduleError, match=r'rank 1 \(iteration 0, step 1: BackwardPass\(buffer_id=0\)\): '
                                            r'backward before its forward'):
        simulate(perturbed(ds.TrainSchedule, 1, edit), 2, 4, iterations=1)

    class OneBuffer(ds.TrainSchedule):
        def num_pipe_buffers(self):
            return 1
    with pytest.raises(ScheduleError, match='rank 0 .*buffer misuse: forward of micro-batch 1 overwrites'):
        simulate(OneBuffer, 2, 4, iterations=1)


def test_missing_commit_and_unknown_instruction():
    def edit(steps):  # drop the CommitP2Ps that would launch rank 1's last gradient send
        s, i = find(steps, ds.SendGrad, -1)
        steps[s][i + 1:] = [c for c in steps[s][i + 1:] if type(c) is not ds.CommitP2P]
        for cmds in steps[s + 1:]:
            cmds[:] = [c for c in cmds if type(c) is not ds.CommitP2P]
    with pytest.raises(ScheduleError, match='rank 1.*never launched by a CommitP2P: send gradient'):
        simulate(perturbed(ds.DualPipeVSchedule, 1, edit), 2, 4, placement=DualPipeVPlacement, iterations=1)

    class MyForward(ds.ForwardPass):  # a subclass is not the registered type
        pass
    swap = perturbed(ds.TrainSchedule, 0, lambda steps: steps.__setitem__(
        0, [MyForward(0) if type(c) is ds.ForwardPass else c for c in steps[0]]))
    with pytest.raises(ScheduleError, match='rank 0.*does not understand MyForward'):
        simulate(swap, 2, 4, iterations=1)
    # DualPipeV's instructions on the stock engine: it has no CommitP2P and no phases
    with pytest.raises(ScheduleError, match=r'rank 0 .*CommitP2P\(\)\): StockPlacement has no CommitP2P'):
        simulate(ds.DualPipeVSchedule, 2, 4, placement=StockPlacement, iterations=1)
    phased = perturbed(ds.TrainSchedule, 1, lambda steps: steps.__setitem__(1, [
        ds.ForwardPass(c.buffer_id, phase=1) if type(c) is ds.ForwardPass else c for c in steps[1]]))
    with pytest.raises(ScheduleError,
                       match=r'rank 1: the stock PipelineEngine cannot run ForwardPass\(buffer_id=0, phase=1\)'):
        simulate(phased, 2, 4, iterations=1)


# ----------------------------------------------------------------------------------------------
# extension APIs

class BackwardInput(ds.BufferOpInstruction):
    """Input-gradient half of a backward (test-local)."""


class BackwardWeight(ds.PipeInstruction):
    """Weight-gradient half of the oldest pending backward (test-local)."""


class ForwardBackward(ds.PipeInstruction):
    """A forward and a backward run as one unit (test-local)."""


register_instruction(BackwardInput, lambda instr, ctx: [Compute('B', ctx.chunk, instr.buffer_id)])


@register_instruction(BackwardWeight)
def _weight(instr, ctx):
    return [Compute('W', ctx.chunk)]  # no buffer: the oldest pending B of the chunk


@register_instruction(ForwardBackward)
def _forward_backward(instr, ctx):
    return [Compute('F', ctx.chunk, instr.fwd, pair=True), Compute('BW', ctx.chunk, instr.bwd, pair=True)]


class SplitBackward(ds.TrainSchedule):
    """1F1B with the backward split into B and W and every W deferred to the end (zero-bubble style)."""

    def num_pipe_buffers(self):
        return self.micro_batches  # activations stay until their W

    def steps(self):
        for cmds in super().steps():
            cmds = [BackwardInput(c.buffer_id) if type(c) is ds.BackwardPass else c for c in cmds]
            if cmds and type(cmds[-1]) is ds.OptimizerStep:
                cmds[-3:-3] = [BackwardWeight() for _ in range(self.micro_batches)]
            yield cmds


def test_registered_instructions_split_backward():
    r = simulate(SplitBackward, 2, 4, iterations=3)
    for rank, row in enumerate(r.timeline.ranks):
        assert Counter(x.kind for x in row) == {'F': 4, 'B': 4, 'W': 4}
        assert [x.micro_batch for x in row if x.kind == 'W'] == [0, 1, 2, 3]
        assert all(x.kind == 'W' for x in row[-4:])
        assert r.per_rank[rank]['busy'] == 12
    # F adds 1, B frees half: rank 0 runs F F B F B F B B, rank 1 F B F B F B F B
    assert [row['peak_activation_memory'] for row in r.per_rank] == [3.0, 2.5]
    check_causality(r.timeline, 2)

    early_w = perturbed(ds.TrainSchedule, 1, lambda steps: steps[0].insert(0, BackwardWeight()))
    with pytest.raises(ScheduleError, match=r'rank 1 .*BackwardWeight\(\)\): weight pass .*no pending input'):
        simulate(early_w, 2, 4, iterations=1)


class PairingPlacement(StockPlacement):
    """A stock-like engine that also runs ForwardBackward(fwd=, bwd=) (the stock one rejects those kwargs)."""

    def chunk_of(self, rank, instr):
        return 0


def test_registered_paired_instruction():
    def pair_last_stage(steps):  # the last stage's F and BW of one micro-batch as one unit
        for s, cmds in enumerate(steps):
            if cmds and type(cmds[-1]) is ds.ForwardPass:
                fwd = cmds.pop()
                i = next(i for i, c in enumerate(steps[s + 1]) if type(c) is ds.BackwardPass)
                steps[s + 1][i] = ForwardBackward(fwd=fwd.buffer_id, bwd=steps[s + 1][i].buffer_id)
    r = simulate(perturbed(ds.TrainSchedule, 2, pair_last_stage), 3, 5, placement=PairingPlacement, iterations=1)
    assert r.makespan == simulate('1f1b', 3, 5, iterations=1).makespan
    last = r.timeline.ranks[2]
    pairs = Counter(x.pair for x in last)
    assert None not in pairs and len(pairs) == 5 and set(pairs.values()) == {2}
    for a, b in zip(last[::2], last[1::2]):
        assert (a.kind, b.kind, a.pair, a.micro_batch) == ('F', 'BW', b.pair, b.micro_batch)
    assert all(x.pair is None for x in r.timeline.ranks[0])


def test_register_schedule():
    register_schedule('test-split-backward', SplitBackward, StockPlacement, 'test only')
    try:
        assert 'test-split-backward' in registry.available_schedules()
        assert simulate('test-split-backward', 2, 4).per_rank[0]['busy'] == 12
    finally:
        del registry.SCHEDULES['test-split-backward']
    assert {'1f1b', 'dualpipev-deepspeed'} <= set(registry.available_schedules())


# ----------------------------------------------------------------------------------------------
# timeline format, renderer, table script

def test_timeline_json_round_trip(tmp_path):
    r = simulate('dualpipev-deepspeed', 2, 4, iterations=3)
    for timeline in (r.timeline, r.chained):
        again = Timeline.from_json(timeline.to_json())
        assert again == timeline
        assert json.loads(again.to_json()) == timeline.to_dict()
    r.chained.save(tmp_path / 't.json')
    assert Timeline.load(tmp_path / 't.json') == r.chained


def test_plot_writes_a_png(tmp_path):
    from schedules.observe.plot import plot_timeline
    r = simulate(ds.InferenceSchedule, 3, 4, forward_only=True)
    path = tmp_path / 'x.png'
    plot_timeline(r.chained, path, title='inference', reference_end=5, focus_iteration=2)
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.multiprocess
def test_schedule_table_json():
    out = subprocess.run([sys.executable, 'scripts/schedule_table.py', '--stages', '4', '--micro-batches', '6',
                          '--json'], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    rows = {row['schedule']: row for row in json.loads(out)}
    keys = {'schedule', 'idle_time', 'idle_time_synced', 'peak_activation_memory', 'params_per_rank', 'per_rank',
            'units', 'error'}
    assert all(set(row) == keys for row in rows.values())
    assert rows['1f1b']['idle_time_synced'] == 9 and rows['1f1b']['error'] is None
    assert rows['dualpipev-deepspeed']['error'].startswith('DualPipeV needs at least')
    assert rows['dualpipev-deepspeed']['idle_time'] is None


def test_replayed_costs_take_each_pass_its_own_duration():
    """A cost table with lists (trace.replayed_costs): each pass its own duration, in the rank's order, every
    simulated run from the first again; a traced run replayed through it gives back its passes' durations."""
    from schedules.observe.trace import replayed_costs
    means = simulate("zb-h1", 2, 4, costs={(r, 0): {"F": 1.0, "B": 1.0, "W": 1.0} for r in range(2)}, iterations=4)
    slow = [1.0, 1.0, 5.0, 1.0]  # rank 0's third forward is slow
    listed = {(0, 0): {"F": slow * 4, "B": [1.0], "W": [1.0]}, (1, 0): {"F": [1.0], "B": [1.0], "W": [1.0]}}
    res = simulate("zb-h1", 2, 4, costs=listed, iterations=4)
    assert [p.duration for p in res.timeline.ranks[0] if p.kind == "F"] == slow  # the one-iteration run
    assert [p.duration for p in res.chained.ranks[0] if p.kind == "F"] == slow * 4  # started over, not continued
    assert res.makespan > means.makespan and res.period > means.period  # the slow pass delays what follows it
    again = simulate("zb-h1", 2, 4, costs=replayed_costs(res.chained), iterations=4)
    assert [[p.duration for p in row] for row in again.chained.ranks] == \
        [[p.duration for p in row] for row in res.chained.ranks]


# ----------------------------------------------------------------------------------------------
# structure kept, timing replayed: the same answers as a fresh simulation of every run

def fresh(name):
    """Schedule `name` with its factory as a plain function (and its placement): the simulator neither keeps its
    structure nor replays its chained runs (it cannot know that the streams depend on p, m and the rank alone), so
    every call runs every rank's stream of every iteration together, as a first call of a registered schedule does
    for its first."""
    spec = registry.available_schedules()[name]

    def schedule(micro_batches, stages, stage_id):
        return spec.factory(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
    schedule.__name__ = name
    return schedule, spec.placement


def outcome(schedule, p, m, **kwargs):
    """Everything simulate answers, or the error it raises (`schedule`: a name or (factory, placement))."""
    if isinstance(schedule, tuple):
        schedule, kwargs = schedule[0], dict(kwargs, placement=schedule[1])
    try:
        r = simulate(schedule, p, m, **kwargs)
    except (ValueError, ScheduleError) as e:
        return type(e).__name__, str(e)
    return (r.timeline.to_dict(), r.chained and r.chained.to_dict(), r.makespan, r.period, r.per_rank, r.units,
            r.messages, r.instructions)


def costs_of(p, seed):
    """A cost table with a different figure per rank, chunk and kind."""
    return {(r, c): {'F': 1 + 0.1 * ((r + seed) % 3) + 0.05 * c, 'B': 1.25 + 0.07 * r, 'W': 0.5 + 0.125 * seed}
            for r in range(p) for c in range(4)}


KEPT_CASES = {
    'units': lambda p: {},
    'costs': lambda p: dict(costs=costs_of(p, 1), latency=0.25, p2p_cpu=(0.03, 0.01), dispatch=0.02),
    'other costs': lambda p: dict(costs=costs_of(p, 2), latency=0.5),
    'listed': lambda p: dict(costs={k: dict(v, F=[v['F'], 2 * v['F'], 0.5]) for k, v in costs_of(p, 3).items()}),
    'validated': lambda p: dict(validation='wait', step_cost={r: (0.1 * r, 0.5) for r in range(p)}, latency=0.1),
    'ahead': lambda p: dict(validation='ahead', step_cost=0.75),
    'replayed': lambda p: dict(replayed={1, 3}, rollback_cost=0.5, step_cost=0.25),
    'links': lambda p: dict(costs=costs_of(p, 1), latency=0.4, send_wait=0.05, wire=0.3),
    'one iteration': lambda p: dict(iterations=1, memory={(r, c): {'F': 3.0 + r, 'W': -1.0} for r in range(p)
                                                          for c in range(4)}),
}


@pytest.mark.parametrize('name', list(registry.available_schedules()))
def test_kept_structure_and_replayed_iterations_give_a_fresh_simulations_answers(name):
    """Every registered schedule at several p and m, at unit and measured costs, validated, replayed: simulating
    it again at other costs (its structure kept, its timing replayed) and chaining iterations (the first one's
    program replayed) answers exactly what simulating every run of every rank's stream afresh answers: timelines
    (pair numbers too), idle times, memory, messages, errors."""
    for p, m in ((2, 4), (3, 7), (4, 12), (6, 12)):
        for case, kwargs in KEPT_CASES.items():
            got, want = outcome(name, p, m, **kwargs(p)), outcome(fresh(name), p, m, **kwargs(p))
            assert got == want, f'{name} p = {p}, m = {m}, {case}'


def test_a_call_at_other_costs_replays_the_kept_structure(monkeypatch):
    from collections import OrderedDict

    from schedules.simulator import structure as sim
    monkeypatch.setattr(sim, '_STRUCTURES', OrderedDict())  # none kept by earlier tests
    simulate('zb-v', 4, 8)
    runs = []
    real = sim._Simulation.run
    monkeypatch.setattr(sim._Simulation, 'run', lambda self: runs.append(self) or real(self))
    again = simulate('zb-v', 4, 8, costs=costs_of(4, 1), latency=0.5)
    assert runs == []  # no stream run again: the first call's structure, timed at these costs
    assert again.period < again.makespan
    simulate('zb-v', 4, 8, validation='wait')  # another structure: one iteration's streams run, the rest replayed
    assert [sim.program.runs for sim in runs] == [1]


def test_pass_columns_are_the_timelines_and_the_explorer_draws_the_same_from_them():
    """SimResult.pass_columns: the timeline's passes without building them, in its order; the explorer draws a
    schedule from them (no arrows asked) exactly as from its Timeline (arrows asked): the same JSON."""
    import json

    from schedules.planner import explore
    for name in registry.available_schedules():
        for p, m in ((2, 4), (4, 8), (5, 10), (8, 16)):
            try:
                r = simulate(name, p, m, costs=costs_of(p, 1), latency=0.25)
            except ValueError:
                continue
            for chained, timeline in ((False, r.timeline), (True, r.chained)):
                c, meta = r.pass_columns(chained)
                rows = [(q.kind, q.stage, q.chunk, q.micro_batch, q.start, q.end, q.direction, q.pair, q.iteration)
                        for row in timeline.ranks for q in row]
                assert meta == timeline.meta
                assert c['rank'].tolist() == [rank for rank, row in enumerate(timeline.ranks) for _ in row]
                at = c['at'].tolist()
                assert list(zip(*([c[k][i] for i in at] for k in ('kind', 'stage', 'chunk', 'micro_batch')),
                                c['start'].tolist(), c['end'].tolist(), *([c[k][i] for i in at]
                                                                          for k in ('direction', 'pair')),
                                c['iteration'].tolist())) == rows
            for chained in (False, True):
                v = 2 if name == 'interleaved' else None
                fast = explore._simulated.__wrapped__(name, p, m, v, 1.5, 0.75, 0.5, 0.1, chained, False)
                slow = explore._simulated.__wrapped__(name, p, m, v, 1.5, 0.75, 0.5, 0.1, chained, True)
                slow.pop('dependencies')
                assert json.dumps(fast) == json.dumps(slow), (name, p, m, chained)
