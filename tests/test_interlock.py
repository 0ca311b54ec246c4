"""Interlocked steps (schedules/runtime/interlock.py, train.py --interlock): steps back to back train exactly
what synchronised steps of the same schedule train, with clipping post-validated (rolled back and redone
when the global norm clips) and a non-finite step skipped on every stage."""
import json

import pytest
import torch

from local_launch import launch
from schedules.runtime.interlock import StepBackup
from training import TINY_CHUNKED, assert_one_error_line, assert_same_training, run_in_process, train


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_a_rolled_back_step_restores_parameters_and_optimizer_state_exactly(make):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    opt, backup = make(params), StepBackup()

    def step():
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for first in (True, False):  # before the optimizer has state (created lazily), and after
        if not first:
            step()
        before = [p.detach().clone() for p in params]
        state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                 for i, p in enumerate(params) if p in opt.state}
        backup.save(params, opt)
        step()
        backup.restore(opt)
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert {i for i, p in enumerate(params) if p in opt.state} == set(state)
        for i, saved in state.items():
            for k, v in saved.items():
                assert torch.equal(opt.state[params[i]][k], v) if torch.is_tensor(v) else opt.state[params[i]][k] == v


def _args(**kw):
    import argparse
    base = dict(interlock=4, steps=10, eval_interval=0, save_interval=0, trace=None, trace_steps=3)
    return argparse.Namespace(**{**base, **kw})


def test_a_call_ends_where_a_validation_a_checkpoint_or_the_trace_begins():
    from train import interlocked_steps
    assert [interlocked_steps(_args(), s) for s in (0, 4, 8)] == [4, 4, 2]
    assert [interlocked_steps(_args(eval_interval=3), s) for s in (0, 3, 5)] == [3, 3, 1]
    assert interlocked_steps(_args(save_interval=2), 0) == 2
    assert [interlocked_steps(_args(trace="t.json"), s) for s in (4, 7)] == [3, 3]


def test_train_py_says_what_post_validation_did_on_each_rank():
    from types import SimpleNamespace

    from train import post_validation_summary
    counters = dict(validations=8, rollbacks=2, waited=1, speculated=5, replays=1, skipped=0)
    assert post_validation_summary(SimpleNamespace(post_validation="auto", **counters)) == (
        "post-validation (auto): 8 steps validated, 2 rolled back, 1 waited for the norm, 5 speculated past, "
        "1 replayed, 0 skipped")
    assert post_validation_summary(SimpleNamespace(post_validation="auto", **dict(counters, validations=0))) is None
    assert post_validation_summary(SimpleNamespace()) is None  # DeepSpeed's own engine: nothing post-validated


def test_a_replayed_step_takes_the_same_micro_batches_and_random_numbers_again():
    """Speculating: a step whose run found the step before redone runs again on the micro-batches it took and
    from the RNG state it began with, prints nothing and writes no monitor event meanwhile, and the call leaves
    the engine's own iterator in place (not its wrapper, which the next call would wrap again). A stand-in
    engine: two micro-batches a step, the second run flagged for replay as `_take_model_step` flags it."""
    from types import SimpleNamespace

    from schedules.runtime.interlock import Interlock

    class Engine:
        global_steps = 1

        def steps_per_print(self):
            return 1

    class Speculating(Interlock, Engine):
        post_validation, _step_lr = "speculate", 0.1

        def post_validates(self):  # clipping on, ZeRO 0, fp32
            return True

        def __init__(self):
            self.data_iterator, self.runs, self.draws, self.events = None, [], [], []
            self.monitor = SimpleNamespace(enabled=True)

        def train_batch(self, data_iter=None):
            if data_iter is not None:
                self.data_iterator = data_iter
            self.runs.append([next(self.data_iterator) for _ in range(2)])
            self.draws.append(torch.rand(1).item())
            if len(self.runs) == 2:
                self._flag_replay()
                assert self.global_steps % self.steps_per_print() != 0  # no log line for it
            if self.monitor.enabled:  # as DeepSpeed's train_batch writes its loss event
                self.events.append(sum(self.runs[-1]))
            return sum(self.runs[-1])

    engine, data = Speculating(), iter(range(100))
    assert engine.train_batches(data, iterations=3) == [1, 5, 9]
    assert engine.runs == [[0, 1], [2, 3], [2, 3], [4, 5]] and engine.replays == 1
    assert engine.draws[1] == engine.draws[2] != engine.draws[3]
    assert engine.data_iterator is data and next(data) == 6
    assert engine.steps_per_print() == 1
    assert engine.events == [1, 5, 9] and engine.monitor.enabled  # the replayed run's loss 5 once, the monitor back


@pytest.mark.parametrize("flags, expected", [
    (["--interlock", "0"], "--interlock 0 is below 1"),
    (["--interlock", "2", "--pipeline-parallel-size", "0"], "needs --pipeline-parallel-size >= 1"),
    (["--interlock", "2", "--pipeline-parallel-size", "2"], "runs on DeepSpeed's own engine"),
])
def test_interlock_refused_where_the_step_cannot_be_post_validated(flags, expected, monkeypatch, capsys):
    status, err, _ = run_in_process(["--model-size", "tiny", "--steps", "2", *flags], monkeypatch, capsys, world=2)
    assert_one_error_line(status, err, expected)
    assert "--interlock" in err


STEPS = 4


def _probe(nprocs, steps, m, cases, dp=1, pass_ms=0, optimizer=""):
    run = launch(nprocs, [steps, m, *cases], script="tests/interlock_probe.py", timeout=240,
                 env={"PROBE_DP": str(dp), "PROBE_PASS_MS": str(pass_ms), "PROBE_OPTIMIZER": optimizer})
    assert run.ok, run.explain()
    return [json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["cases"]
            for out in run.stdout]


def _assert_interlocked_equals_synchronised(ranks, case, bitwise=False):
    for rank in ranks:
        r = rank[case]
        assert (r["max_diff"] == 0 if bitwise else r["max_diff"] < 1e-5) and r["finite"], (case, r)
        assert r["losses"] == (r["sync_losses"] if bitwise else pytest.approx(r["sync_losses"], abs=1e-6)), (case, r)
        assert not r["pending"], case


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p, dp, m, optimizer, cases", [
    (2, 1, 4, "", ["zb-h2:bites", "zb-h2:nan", "zb-v:never", "zb-h2:bites:wait", "zb-v:bites:auto",
                   "zb-h2:bites:speculate", "zb-v:nan:speculate", "zb-h2:never:speculate",
                   "dualpipe:bites:speculate", "interleaved:bites:speculate", "1f1b-lean:bites:speculate",
                   "zb-h2:bites:auto-alternate", "zb-v:nan:auto-alternate"]),
    (4, 1, 8, "", ["zb-h2:bites", "zb-v:nan", "zb-v:bites:speculate", "zb-v:bites:auto-alternate"]),
    (2, 2, 4, "", ["zb-h1:bites", "zb-v:nan", "zb-h1:bites:speculate",  # 2 data-parallel replicas of 2 stages
                   "zb-h1:nan:auto-alternate"]),
    (2, 1, 4, "bf16", ["zb-h2:bites", "zb-h2:nan", "zb-h2:nan-unclipped", "zb-h2:bites:wait",
                       "zb-v:bites:speculate", "zb-v:nan-unclipped:speculate", "dualpipe:bites:speculate",
                       "zb-h2:bites:auto-alternate"]),
    (4, 1, 8, "bf16-zero1", ["zb-v:bites", "zb-h2:bites:speculate"]),
    (2, 2, 4, "bf16-zero1", ["zb-h1:bites", "zb-v:nan", "zb-h1:bites:speculate",
                             "zb-h2:nan-unclipped:auto-alternate", "zb-h2:bites:auto"]),
    (2, 1, 4, "zero1", ["zb-h2:bites", "zb-h2:nan", "zb-h2:nan-unclipped", "zb-h2:bites:wait", "zb-v:bites:speculate",
                        "zb-v:nan:speculate", "interleaved:bites:speculate", "zb-h2:bites:auto-alternate"]),
    (2, 2, 4, "zero1", ["zb-h1:bites", "zb-v:nan", "zb-h1:bites:speculate", "zb-h1:nan:auto-alternate",
                        "zb-h2:bites:auto"]),
], ids=["pp2", "pp4", "pp2xdp2", "pp2-bf16", "pp4-bf16-zero1", "pp2xdp2-bf16-zero1", "pp2-zero1", "pp2xdp2-zero1"])
def test_interlocked_steps_train_what_synchronised_steps_train(p, dp, m, optimizer, cases):
    """Weights and losses equal step for step; where clipping bites, a stage that stepped on its own norm
    rolled back and redid the step (counted), and one whose own norm already clipped waited; the infinite
    gradient of one stage skipped that step on every stage, in both runs. Speculating past the validation,
    the step after one that was redone or skipped ran again from its start, on every rank alike. With two
    data-parallel replicas (each its own data) the losses are the replicas' average, as DeepSpeed's
    synchronised step returns it. With DeepSpeed's optimizers (its BF16 optimizer: bf16 gradients at ZeRO 0,
    fp32 ones at ZeRO 1; its ZeRO-1 optimizer in fp32; at ZeRO 1 the fp32 weights are partitioned over the
    replicas) the synchronised run is DeepSpeed's own step, and the weights equal it to the bit; in bf16 with
    clipping on or off (an infinite gradient skips the step either way). With two replicas `auto` steps ahead on
    every rank there (the step all-gathers over them)."""
    ranks = _probe(p * dp, STEPS, m, cases, dp=dp, optimizer=optimizer)
    for case in cases:
        _assert_interlocked_equals_synchronised(ranks, case, bitwise=bool(optimizer))
        assert all(r[case]["sync_losses"] == ranks[0][case]["sync_losses"] for r in ranks), case  # one average
        scenario, *policy = case.split(":")[1:]
        replays = {r[case]["replays"] for r in ranks}
        assert len(replays) == 1, (case, replays)  # every rank replays the same steps, or the pipeline would hang
        speculated = {r[case]["speculated"] for r in ranks}
        assert len(speculated) == 1, (case, speculated)  # every rank speculated past the same steps
        if policy == ["speculate"]:  # a step whose validation redid the one before ran again, on every rank
            assert replays.pop() > 0 if scenario in ("bites", "nan", "nan-unclipped") else replays.pop() == 0, case
            assert speculated.pop() > 0
        elif policy == ["auto-alternate"]:  # auto speculated past every other step, and some were redone
            assert replays.pop() > 0 and speculated.pop() == STEPS // 2, (case, ranks[0][case])
        elif policy != ["auto"]:  # (auto speculates where its vote, from this run's timings, says it pays)
            assert replays.pop() == 0 and speculated.pop() == 0, case
        if policy == ["wait"]:  # never ahead of the norm: no backup, no rollback, and the same training
            assert all(r[case]["rollbacks"] == 0 for r in ranks), case
            assert sum(r[case]["waited"] for r in ranks) > 0, case
        elif scenario == "bites":
            assert sum(r[case]["rollbacks"] for r in ranks) > 0, case  # the rollback path ran
            assert all(r[case]["validations"] == STEPS for r in ranks)
        if scenario == "never":
            assert all(r[case]["rollbacks"] == r[case]["deferred"] == 0 and r[case]["validations"] == STEPS
                       for r in ranks)
        if scenario.startswith("nan"):
            assert all(r[case]["skipped"] == r[case]["sync_skipped"] == 1 for r in ranks), case
            assert sum(r[case]["rollbacks"] for r in ranks) > 0, case  # stages with finite gradients had stepped


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, schedule, policy", [(2, "zb-h2", "auto"), (4, "zb-h1", "auto"),
                                                    (2, "zb-v", "speculate")], ids=["pp2", "pp2xdp2", "speculate"])
def test_train_py_interlock_matches_the_non_pipelined_model(ranks, schedule, policy, sgd_config, references,
                                                            tmp_path):
    """train.py --interlock 2 (clipping on, biting every step: each stage's own norm already clips or the
    model's does): the per-step losses, validation losses and weights of the non-pipelined run; with two
    data-parallel replicas too; speculating past the validation (each call's second step replayed), with
    DeepSpeed's monitor getting one loss per step (the discarded runs write none)."""
    config = sgd_config(zero=0, clip=0.05)
    if policy == "speculate":  # the same config with DeepSpeed's CSV monitor
        with open(config) as f:
            cfg = json.load(f)
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "run"}
        config = tmp_path / "monitored.json"
        config.write_text(json.dumps(cfg))
    result = train(tmp_path, ranks, ["--pipeline-parallel-size", "2", "--pipeline-schedule", schedule, "--interlock",
                                     "2", "--post-validation", policy], config, 4, dp=ranks // 2,
                   model=TINY_CHUNKED)  # both steps in one call
    assert_same_training(result, references(4, TINY_CHUNKED, clip=0.05, zero=0))
    if policy == "speculate":
        for event in ("train_loss", "lr"):  # a header, then one row per step (2)
            rows = (tmp_path / "monitor" / "run" / f"Train_Samples_{event}.csv").read_text().splitlines()
            assert len(rows) == 1 + 2, (event, rows)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision, policy", [("fp32", "speculate"), ("bf16", "auto"), ("bf16", "speculate")])
def test_train_py_interlock_at_zero_1(precision, policy, sgd_config, references, tmp_path):
    """ZeRO 1, clipping biting: the step of DeepSpeed's ZeRO-1 optimizer (fp32) or of its BF16 optimizer (`--bf16`:
    fp32 gradient accumulation) post-validated, speculating past it or not. Both steps in one interlocked call
    train what one step per call trains, to the bit; in fp32 that is the non-pipelined model."""
    flags = ["--pipeline-parallel-size", "2", "--pipeline-schedule", "zb-v", "--post-validation", policy]
    flags += ["--bf16"] if precision == "bf16" else []
    config = sgd_config(zero=1, clip=0.05)
    interlocked = train(tmp_path / "k2", 2, flags + ["--interlock", "2"], config, 4, model=TINY_CHUNKED)
    if precision == "fp32":
        assert_same_training(interlocked, references(4, TINY_CHUNKED, clip=0.05, zero=1))
        return
    synchronised = train(tmp_path / "k1", 2, flags, config, 4, model=TINY_CHUNKED)
    assert interlocked[:2] == synchronised[:2]
    assert interlocked[2].keys() == synchronised[2].keys()
    assert all(torch.equal(interlocked[2][k], synchronised[2][k]) for k in synchronised[2])


def test_the_simulator_charges_each_ranks_optimizer_step():
    from schedules.simulator.simulate import simulate
    base, stepped = simulate("zb-h2", 2, 4), simulate("zb-h2", 2, 4, step_cost={0: 1.0, 1: 0.5})
    assert (base.makespan, base.period) == (13.0, 12.0)
    assert stepped.makespan == 13.5 and stepped.period == 13.0  # each rank ends later by its own step
    assert [r["busy"] for r in stepped.per_rank] == [r["busy"] for r in base.per_rank]  # passes only


@pytest.mark.parametrize("name, p, m, makespan, waits", [
    ("zb-h2", 2, 4, 13.0, [1.0, 0.0]), ("zb-h2", 4, 8, 27.0, [3.0, 2.0, 1.0, 0.0]),
    ("zb-h2", 8, 16, 55.0, [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]), ("zb-v", 4, 8, 25.5, [1.5, 1.0, 0.5, 0.0]),
    ("zb-h1", 4, 8, 27.0, [0.0] * 4), ("1f1b", 4, 8, 33.0, [0.0, 2.0, 4.0, 6.0])])
def test_the_simulator_validates_the_norm_before_the_next_step(name, p, m, makespan, waits):
    """simulate(validation=...): a rank's next iteration starts once every rank started the model's norm at its
    OptimizerStep. At unit costs the validated period is the synchronised makespan (the interlocking's gain is
    the first stage's wait); with 'wait' each rank's step comes after the norm, with 'ahead' before it."""
    from schedules.simulator.simulate import simulate
    free = simulate(name, p, m, iterations=6)
    ahead = simulate(name, p, m, iterations=6, validation="ahead")
    assert free.makespan == makespan and ahead.period == makespan
    assert [r["validation_wait"] for r in ahead.per_rank] == waits
    assert all(r["validation_wait"] == 0.0 for r in free.per_rank)
    stepped = simulate(name, p, m, iterations=6, validation="ahead", step_cost=0.5)
    waited = simulate(name, p, m, iterations=6, validation="wait", step_cost=0.5)
    assert waited.period == makespan + 0.5  # the step on the critical path, after the norm
    assert stepped.period <= waited.period
    assert waited.makespan == stepped.makespan == simulate(name, p, m, step_cost=0.5).makespan  # one step: as before
    assert simulate(name, p, m, iterations=6, validation="ahead", latency=0.25).period >= makespan + 0.25
    with pytest.raises(ValueError, match="validation 'soon'"):
        simulate(name, p, m, validation="soon")


def test_a_steps_work_before_the_norm_is_started_delays_every_ranks_validation():
    """step_cost as (before, after) the norm: the norm starts after each rank's first part; with 'ahead' the second
    part overlaps the first stage's wait, with 'wait' it follows it (ZB-H2, p = 4, m = 8, unit costs)."""
    from schedules.simulator.simulate import simulate
    run = lambda validation, cost: simulate("zb-h2", 4, 8, iterations=6, validation=validation,  # noqa: E731
                                            step_cost=cost).period
    assert run(None, (0.25, 0.5)) == run(None, 0.75) == 24.75  # unvalidated: a step is its total
    assert run("ahead", 0.75) == 27.0 and run("ahead", (0.25, 0.5)) == 27.25 and run("ahead", (0.75, 0.0)) == 27.75
    assert run("wait", (0.25, 0.5)) == run("wait", 0.75) == 27.75


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_backup_restores_parameters_and_optimizer_state_exactly(fused):
    """StepBackup: after a restore, parameters and every optimizer state tensor equal the saved ones bitwise,
    in the same tensors (a fused optimizer keeps its buffers); state the step created (AdamW's, at its first
    step) is dropped; the copies are allocated once and reused."""
    import torch

    from schedules.runtime.interlock import StepBackup
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused)
    backup = StepBackup()

    def step():
        for q in params:
            q.grad = torch.randn_like(q)
        opt.step()

    backup.save(params, opt)  # before the first step: no state yet
    step()
    backup.restore(opt)
    assert all(q not in opt.state for q in params)
    step()
    step()
    before = [q.detach().clone() for q in params]
    state = {q: {k: (v, v.clone()) for k, v in opt.state[q].items()} for q in params}
    backup.save(params, opt)
    copies = list(backup._copies)
    step()
    assert not torch.equal(params[0], before[0])
    backup.restore(opt)
    assert all(torch.equal(q, b) for q, b in zip(params, before))
    for q in params:
        assert set(opt.state[q]) == set(state[q])
        for k, (tensor, value) in state[q].items():
            assert opt.state[q][k] is tensor and torch.equal(tensor, value), k
    backup.save(params, opt)
    assert all(a is b for a, b in zip(backup._copies, copies))  # reused


def test_the_ahead_policy_steps_ahead_only_where_the_norm_takes_longer_than_a_backup():
    from schedules.runtime.interlock import AheadPolicy
    assert AheadPolicy("ahead").steps_ahead() and not AheadPolicy("wait").steps_ahead()
    with pytest.raises(ValueError, match="post-validation policy 'soon'"):
        AheadPolicy("soon")
    auto = AheadPolicy()
    assert auto.steps_ahead()  # nothing measured yet: ahead, which times the backup
    auto.backed_up(0.010, norm_arrived=True)  # the norm was there before the 10 ms backup was done: not worth it
    assert not auto.steps_ahead()
    auto.waited_for_norm(0.030, waited=False)  # in hand 30 ms after (arrived earlier): the step ahead said no
    assert not auto.steps_ahead()
    auto.waited_for_norm(0.025, waited=True)  # had to wait for it, 25 ms after: a 10 ms backup pays
    assert auto.steps_ahead()
    auto.backed_up(0.010, norm_arrived=False)  # still out after the backup: ahead again
    assert auto.steps_ahead()
    auto.backed_up(0.010, norm_arrived=True)
    auto.waited_for_norm(0.004, waited=True)  # 4 ms: waiting is cheaper
    assert not auto.steps_ahead()


def test_the_speculation_vote_weighs_the_slowest_ranks_wait_against_backups_and_replays():
    from schedules.runtime.validation_policy import SpeculationVote
    votes = [SpeculationVote(rank, 2) for rank in range(2)]
    assert not votes[0].speculates()  # nothing measured: no speculation
    votes[0].waited(0.030)  # the first stage waits 30 ms for the norm before its next stream, the last none
    votes[1].waited(0.0)
    for vote, at in zip(votes, (0.0, 0.001)):
        vote.step_at(at)
        vote.step_at(at + 0.300)  # 300 ms a step
    ballots = [vote.ballot(backup_s) for vote, backup_s in zip(votes, (0.002, 0.005))]
    assert ballots[0].tolist() == pytest.approx([0.030, 0, 0.002, 0, 0.300, 0])  # its own slots only
    total = ballots[0] + ballots[1]  # what the all-reduce gives every rank
    for vote in votes:
        vote.counted(total)
        assert vote.figures == pytest.approx((0.030, 0.005, 0.300))  # the largest over ranks
        vote.validated_step(redone=False)
    assert all(vote.speculates() for vote in votes)  # 30 ms saved against a 5 ms backup, nothing clips
    for vote in votes:  # one step in ten redone: a replay of 300 ms costs 30 ms a step, with the backup 35 > 30
        for i in range(9):
            vote.validated_step(redone=i == 0)
    assert votes[0].clip_rate() == pytest.approx(0.1) and not any(vote.speculates() for vote in votes)
    for vote in votes:  # the history is the last 16 steps: the redone one drops out
        for _ in range(SpeculationVote.HISTORY):
            vote.validated_step(redone=False)
    assert all(vote.speculates() for vote in votes)
    votes[0].speculated_and_found(arrived=True)  # speculating, the norm was in before the next stream: saves 0
    assert votes[0].norm_wait_s == 0.0
    votes[0].speculated_and_found(arrived=False)  # not in: the last measurement stands
    assert votes[0].norm_wait_s == 0.0


def test_a_zero_0_step_is_validated_while_clipping_is_on():
    """Asked at every step (the benchmark moves the threshold between runs of the same engine): at ZeRO 0 in fp32
    there is something to validate only while clipping is on; DeepSpeed's optimizers' norm always decides."""
    from types import SimpleNamespace

    from schedules.runtime.step_targets import BF16Step, TorchStep
    clip = [0.0]
    target = TorchStep(SimpleNamespace(gradient_clipping=lambda: clip[0]))
    assert not target.validates()
    clip[0] = 0.5
    assert target.validates()
    assert BF16Step(SimpleNamespace(optimizer=None, dp_world_size=1)).validates()


def test_the_speculation_vote_probes_the_wait_after_a_run_of_speculated_steps():
    """Speculating, a rank does not wait for the norm, so a wait that shrank goes unseen: after PROBE_AFTER steps
    speculated past in a row the next one validates before the next stream (measuring the wait again)."""
    from schedules.runtime.validation_policy import SpeculationVote
    vote = SpeculationVote(0, 1)
    vote.rule = lambda v: True  # it pays, every step
    n = SpeculationVote.PROBE_AFTER
    assert [vote.speculates() for _ in range(2 * n + 2)] == ([True] * n + [False]) * 2
    vote.rule = lambda v: v.validated % 2 == 0  # no run reaches a probe: the rule alone decides
    decisions = []
    for _ in range(6):
        decisions.append(vote.speculates())
        vote.validated_step(redone=False)
    assert decisions == [True, False] * 3


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_auto_speculates_where_the_first_stage_waits_for_the_norm():
    """ZB-H2 at p = 2, passes of 2 ms a block, clipping on and never biting: the first stage waits about a stage's
    pass for the last stage's norm, far more than a backup of the tiny model, so `auto` speculates past the
    steps once it has measured that (from the third step on), on both ranks alike, and trains the same."""
    steps = 6
    ranks = _probe(2, steps, 4, ["zb-h2:never:auto"], pass_ms=2)
    case = "zb-h2:never:auto"
    _assert_interlocked_equals_synchronised(ranks, case)
    assert {r[case]["speculated"] for r in ranks} == {steps - 2}, [r[case] for r in ranks]
    assert all(r[case]["replays"] == 0 and r[case]["rollbacks"] == 0 for r in ranks)


def test_the_simulator_replays_an_iteration_after_a_redone_step():
    """Speculating past the validation, a redone step makes every rank run the next iteration's stream twice:
    the chained run is that of one iteration more (same streams), its passes numbered by their iteration, and the
    wasted run's optimizer step also takes the rollback."""
    from schedules.simulator.simulate import simulate
    replayed = simulate("zb-h2", 2, 4, iterations=6, replayed={3})
    one_more = simulate("zb-h2", 2, 4, iterations=7)
    assert replayed.chained.span() == one_more.chained.span() == (0.0, 85.0)  # 7 runs of 12 units, and 1 of fill
    assert len(replayed.chained.passes(3)) == 2 * len(replayed.chained.passes(2))
    assert replayed.chained.iterations() == list(range(6))
    slower = simulate("zb-h2", 2, 4, iterations=6, replayed={3}, rollback_cost=0.5)
    assert slower.chained.span()[1] == pytest.approx(85.5)  # the rollback on the critical path, once
    with pytest.raises(ValueError, match="validates before the next iteration"):
        simulate("zb-h2", 2, 4, iterations=6, replayed={3}, validation="wait")
    with pytest.raises(ValueError, match="one of 1 .. 5"):
        simulate("zb-h2", 2, 4, iterations=6, replayed={0})
