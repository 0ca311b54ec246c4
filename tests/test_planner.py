"""The planner (schedules/planner/): the chooser on synthetic profiles picks what the closed forms say, a
memory budget is honoured or refused in one line, and per-layer measurements compose into exactly what a
chunk of those layers saves. Fast tier: no processes."""
import pytest
import torch

import schedules
from schedules.planner.choose import MiB, NoScheduleFits, choose, summary, table
from schedules.planner.compose import chunk_figures, cut
from schedules.planner.profile import Profile, measure_layers
from schedules.registry import schedule_spec, trainable_schedules

P, M, LAYERS = 4, 8, 16
UNIT = MiB / (LAYERS // P)  # per layer: one micro-batch on a 1/p stage saves 1 MiB (one unit)
V_SCHEDULES = {"zb-v", "dualpipev", "v-half", "v-min"}  # V placement, zero bubble at F = B = W for zb-v


def synthetic():
    """Equal F = B = W: one micro-batch through a 1/p stage costs 1 per pass and saves 1 MiB."""
    share = P / LAYERS
    return Profile.synthetic(LAYERS, F=share, B=share, W=share, saved=UNIT, optimizer=1e-3)


def test_equal_f_b_w_unlimited_memory_picks_a_zero_bubble_v_schedule():
    choice = choose(synthetic(), P, M)
    assert choice.pick.schedule == "zb-v"
    # the closed forms of the synchronised step: ZB-V idles (p-1)/2 per rank, 1F1B 3(p-1)
    by_name = {c.label: c for c in choice.ranked}
    assert by_name["zb-v"].span == pytest.approx(3 * M + (P - 1) / 2)
    assert by_name["1f1b"].span == pytest.approx(3 * M + 3 * (P - 1))
    assert {c.schedule for c in choice.ranked} <= set(trainable_schedules())


def test_interlocked_candidates_are_ranked_by_the_interlocked_period():
    """--interlock K: our engines' candidates by the simulator's period of K chained steps. Speculating past the
    validation (or nothing to validate) ZB-H2 and ZB-V reach the busy time, 3 units a micro-batch; validating
    before the next step costs ZB-H2 its overlap (its synchronised step again: the first stage waits for the
    last one's norm). DeepSpeed's own engine (stock 1F1B) synchronises every step: its synchronised step."""
    free = {c.label: c for c in choose(synthetic(), P, M, interlock=4, validation=None).ranked}
    outside = free["zb-h2"].outside  # a stage's optimizer step, the same on every rank here
    assert free["zb-h2"].step == pytest.approx(3 * M + outside) and free["zb-v"].step == pytest.approx(3 * M + outside)
    assert max(free["zb-h2"].bubble) < 1e-3  # (but for its optimizer step)
    assert free["1f1b"].step == pytest.approx(3 * M + 3 * (P - 1) + outside)  # synchronised, unchanged
    waiting = choose(synthetic(), P, M, interlock=4, validation="wait")
    assert {c.label: c for c in waiting.ranked}["zb-h2"].step == pytest.approx(3 * M + (P - 1) + outside)
    assert "interlocked (4 steps per call" in summary(waiting)
    # what K buys the pick: ZB-V speculating, 3 units a micro-batch against (p-1)/2 more synchronised
    assert free["zb-v"].synchronised == pytest.approx(3 * M + (P - 1) / 2 + outside)
    picked = choose(synthetic(), P, M, interlock=4, validation=None)
    gain = (3 * M + (P - 1) / 2 + outside) / (3 * M + outside) - 1
    assert f"{(3 * M + (P - 1) / 2 + outside) * 1e3:.1f} ms synchronised: --interlock 4 is {gain:.1%} faster" \
        in summary(picked)
    one = choose(synthetic(), P, M, interlock=4, validation=None, schedules=["1f1b"])  # DeepSpeed's own engine
    assert "--interlock 4 gains nothing here" in summary(one)


def test_the_chooser_validates_interlocked_steps_as_the_run_will():
    from types import SimpleNamespace

    from planning import validation_model
    run = SimpleNamespace(post_validation="auto")
    assert validation_model(run, {"gradient_clipping": 1.0}) == "wait"
    assert validation_model(run, {"gradient_clipping": 0.0}) is None  # ZeRO 0 in fp32: nothing to validate
    assert validation_model(run, {"gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}) == "wait"
    assert validation_model(SimpleNamespace(post_validation="speculate"), {}) is None
    assert validation_model(SimpleNamespace(post_validation="ahead"), {}) == "ahead"


def test_a_budget_of_half_1f1b_memory_picks_v_half_or_less():
    """p/2 units: only the controllable-memory V schedules fit; without them registered, one clear refusal."""
    budget = P / 2  # MiB = units here
    lean = {"v-half", "v-min"} & set(trainable_schedules())
    if lean:
        choice = choose(synthetic(), P, M, max_activation_memory=budget)
        assert choice.pick.schedule in lean and max(choice.pick.peak) <= budget * MiB
    else:
        with pytest.raises(NoScheduleFits, match="--max-activation-memory 2 MiB: no schedule fits"):
            choose(synthetic(), P, M, max_activation_memory=budget)


def test_a_budget_of_1f1b_memory_drops_zb_h2_and_keeps_the_v():
    choice = choose(synthetic(), P, M, max_activation_memory=P)  # 1F1B's peak: p units on rank 0
    assert all(max(c.peak) <= P * MiB for c in choice.ranked)
    assert "zb-h2" in {c.schedule for c in choice.dropped}
    assert choice.pick.schedule == "zb-v" and max(choice.pick.peak) == pytest.approx(P * MiB)
    assert "within --max-activation-memory 4 MiB" in summary(choice)
    assert table(choice)[-1].lstrip().startswith("dropped")


def test_a_budget_below_every_candidate_is_one_line_naming_the_least():
    with pytest.raises(NoScheduleFits) as error:
        choose(synthetic(), P, M, max_activation_memory=0.5)
    message = str(error.value)
    assert "\n" not in message and "least predicted peak is" in message and "MiB" in message


@pytest.mark.parametrize("stages", [0, 1])
def test_one_stage_is_refused(stages):
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        choose(synthetic(), stages, M)


def test_the_head_heavy_model_goes_to_the_mirror():
    """A last layer costing more than the rest (GPTlite's head): only the mirror placement shares it, so
    DualPipe wins at p = 2 however the cut is balanced."""
    profile = Profile.synthetic(6, saved=UNIT)
    head = profile.layers[-1]
    head.F, head.B, head.W, head.BW = 10.0, 10.0, 10.0, 20.0
    choice = choose(profile, 2, 4)
    assert choice.pick.schedule == "dualpipe"
    assert cut(profile, "profile", 2) == [0, 5, 6]  # balanced on the measured costs: the head alone
    assert cut(profile, "uniform", 2) == [0, 3, 6]


def test_the_library_entry_point_reads_a_profile_file(tmp_path):
    path = tmp_path / "profile.json"
    synthetic().save(path)
    assert Profile.load(path).to_json() == synthetic().to_json()
    assert schedules.choose(str(path), P, M).pick.schedule == "zb-v"


def test_a_profile_keeps_its_measured_slices_through_json(tmp_path):
    """Profile.slices (the split head measured) and their layout survive save / load; a file without them (every
    profile written before) loads with none."""
    import json
    from dataclasses import replace

    from schedules.planner.profile import LayerCost
    slices = [LayerCost("LMHeadSlice", 1.0 + k, 2.0, 3.0, 4.5, {s: [10 + k, 4, 6] for s in "FBW"}, 7 + k, 28 + 4 * k,
                        99, 1e-3) for k in range(3)]
    for recompute in (True, False):
        profile = replace(synthetic(), slices=slices, slices_recompute=recompute)
        profile.save(tmp_path / "with.json")
        back = Profile.load(tmp_path / "with.json")
        assert back.slices == slices and back.slices_recompute is recompute
        assert back.to_json() == profile.to_json() and back.layers == profile.layers
    old = synthetic().to_json()
    assert "slices" not in old
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Profile.load(tmp_path / "old.json").slices is None


def _deep_layers(width, depth):
    from deep_model import DeepBlock
    torch.manual_seed(0)
    return [DeepBlock(width) for _ in range(depth)]


def test_measured_layers_compose_into_what_the_chunk_saves():
    """Four Linear + ReLU layers measured one by one, composed into one chunk: the bytes it saves after
    its forward, after B and after W are those of the four run as one chunk (the storage two neighbours
    share counted once), as the tracker counts them."""
    from deep_model import mse_loss
    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime.weight_grad import apply_weight_grads, defer_weight_grads
    width, rows = 64, 8
    layers = _deep_layers(width, 4)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    costs, loss = measure_layers([(type(m).__name__, lambda m=m: m) for m in layers], x, mse_loss, y, repeats=1)
    profile = Profile(costs, loss)
    _, memory = chunk_figures(profile, range(4), last=True)

    params = [p for m in layers for p in m.parameters()]
    with SavedTensorTracker(ignore=params) as tracker:
        h = x.clone().requires_grad_()
        for m in layers:
            h = m(h)
        out = mse_loss(h, y)
        after_f = tracker.live_bytes
        with defer_weight_grads() as queue:
            out.backward()
        after_b = tracker.live_bytes
        apply_weight_grads(queue)
        after_w = tracker.live_bytes
    assert memory["F"] == after_f
    assert memory["B"] == after_b - after_f
    assert memory["W"] == after_w - after_b
    assert memory["BW"] == -after_f
    assert all(c.F > 0 and c.B > 0 and c.W > 0 and c.BW > 0 for c in costs)
    assert costs[0].params == width * width + width and costs[0].output_bytes == rows * width * 4


AUTO = ["--pipeline-parallel-size", "2", "--pipeline-schedule", "auto", "--model-size", "tiny",
        "--gradient-accumulation-steps", "4", "--micro-batch-size", "2"]


def test_experts_shared_by_dualpipes_copies_are_priced_as_they_exchange_tokens():
    """--dualpipe-experts shard: on the mirror placement each expert layer's forward and backward exchange their
    tokens twice with the mirrored rank (half of each all-to-all's payload crosses the link each way), a rank holds
    half the experts, and only the dense gradients are summed between the copies; DualPipe's overlapped pairs hide
    the exchanges behind the other pass, one after the other they add up. Other placements exchange nothing."""
    from dataclasses import replace

    from schedules.planner.candidate import simulated
    from schedules.planner.compose import compose
    from schedules.registry import schedule_spec
    base = Profile.synthetic(8, F=0.01, B=0.01, W=0.01, params=1000)
    base.p2p = {'latency': 1e-4, 'per_byte': 1e-8, 'send': 0.0, 'recv': 0.0, 'reduce_latency': 1e-4,
                'reduce_per_byte': 2e-8}
    base.layers = [replace(c, exchanges=1, exchange_bytes=1 << 20, expert_param_bytes=3000) for c in base.layers]
    spec = schedule_spec("dualpipe")
    place = spec.placement(2)
    parts = cut(base, "uniform", place.num_stages)
    duplicate = compose(replace(base, meta={'dualpipe_experts': 'duplicate'}), place, parts)
    shard = compose(replace(base, meta={'dualpipe_experts': 'shard'}), place, parts)
    v = schedule_spec("zb-v").placement(2)
    assert duplicate['comm'] is None
    assert compose(replace(base, meta={'dualpipe_experts': 'shard'}), v, cut(base, "uniform", v.num_stages))['comm'] \
        is None
    one = 2 * (1e-4 + 1e-8 * (1 << 20) / 2)  # a layer's pass: two all-to-alls
    assert shard['comm'][(0, 0)] == {'F': pytest.approx(4 * one), 'B': pytest.approx(4 * one)}  # 4 layers a chunk
    assert duplicate['param_bytes'][0] == 8 * 4000 and shard['param_bytes'][0] == 8 * 4000 - 8 * 1500
    summed = duplicate['outside'][0] - shard['outside'][0]
    assert summed == pytest.approx(2e-8 * 8 * 3000)  # the experts' gradients are not all-reduced
    steps = {overlap: simulated(replace(base, meta={'dualpipe_experts': 'shard', 'overlap': overlap}), spec, None,
                                'uniform', parts, place, 8).span for overlap in (False, True)}
    alone = simulated(replace(base, meta={'dualpipe_experts': 'duplicate'}), spec, None, 'uniform', parts, place,
                      8).span
    assert alone < steps[True] < steps[False]


def test_a_cut_leaving_a_rank_without_experts_is_no_candidate():
    """Experts in layers 4-7 of 8 only: every cut and schedule whose ranks all hold one stays a candidate, the others
    are skipped saying which rank holds none (train.py would refuse them before training)."""
    from dataclasses import replace
    base = Profile.synthetic(8, F=0.01, B=0.01, W=0.01, params=1000)
    base.layers = [replace(c, expert_param_bytes=3000 if i >= 4 else 0) for i, c in enumerate(base.layers)]
    choice = choose(base, 2, 8)
    assert choice.ranked
    for c in choice.ranked:
        place = schedule_spec(c.schedule, c.virtual_stages).placement(2)
        for r in range(2):
            stages = [place.stage(r, ch) for ch in range(place.chunks)]
            assert any(i >= 4 for s in stages for i in range(c.parts[s], c.parts[s + 1])), (c.schedule, c.parts)
    reasons = [why for _, why in choice.skipped if "holds no layer with experts" in why]
    assert reasons and all(why.startswith("rank ") for why in reasons)
    assert len(choose(replace(base, layers=[replace(c, expert_param_bytes=0) for c in base.layers]), 2, 8).ranked) > \
        len(choice.ranked)


def test_experts_sharded_over_replicas_are_priced_by_the_share_of_the_all_to_all_that_crosses():
    """--expert-parallel-size E: every placement's expert layers exchange their tokens among E replicas of the
    stage, (E - 1) / E of each all-to-all's payload crossing; the profile's all-to-all, measured over all its ranks,
    is scaled to E; a rank holds 1 / E of the experts. A dense profile exchanges nothing whatever E says."""
    from dataclasses import replace

    from schedules.planner.compose import compose
    from schedules.registry import schedule_spec
    base = Profile.synthetic(8, F=0.01, B=0.01, W=0.01, params=1000)
    base.p2p = {'latency': 1e-4, 'per_byte': 1e-8, 'send': 0.0, 'recv': 0.0, 'a2a_latency': 2e-4,
                'a2a_per_byte': 3e-9}
    moe = replace(base, layers=[replace(c, exchanges=1, exchange_bytes=1 << 20, expert_param_bytes=3000)
                                for c in base.layers])
    place = schedule_spec("1f1b").placement(2)
    parts = cut(base, "uniform", 2)
    alone = compose(replace(moe, meta={'expert_parallel_size': 1, 'ranks': 4}), place, parts)
    sharded = compose(replace(moe, meta={'expert_parallel_size': 2, 'ranks': 4}), place, parts)
    assert alone['comm'] is None
    assert compose(replace(base, meta={'expert_parallel_size': 2, 'ranks': 4}), place, parts)['comm'] is None
    per_byte = 3e-9 * (1 / 2) / (3 / 4)  # measured over 4 ranks (3/4 crossing), exchanged among 2 (1/2)
    one = 2 * (2e-4 + per_byte * (1 << 20))  # a layer's pass: dispatch and combine
    assert sharded['comm'][(1, 0)] == {'F': pytest.approx(4 * one), 'B': pytest.approx(4 * one)}  # 4 layers a stage
    assert sharded['param_bytes'][0] == alone['param_bytes'][0] - 4 * 1500
    four = compose(replace(moe, meta={'expert_parallel_size': 4, 'ranks': 8}), place, parts)
    assert four['param_bytes'][0] == alone['param_bytes'][0] - 4 * 2250
    assert four['comm'][(0, 0)]['F'] == pytest.approx(4 * 2 * (2e-4 + 3e-9 * (3 / 4) / (7 / 8) * (1 << 20)))


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("interlock", [1, 2])
def test_train_auto_profiles_chooses_says_why_and_trains(interlock):
    """With --interlock 2 the pick is ranked by the interlocked period, and says so."""
    from local_launch import launch
    run = launch(2, AUTO + ["--steps", "3", "--interlock", str(interlock)], timeout=120)
    assert run.ok, run.explain()
    out = run.stdout[0]
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    chose = [line for line in out.splitlines() if line.startswith("auto: chose ")]
    assert rows and len(chose) == 1, out
    picked = rows[0].split()[1]
    assert chose[0].startswith(f"auto: chose {picked} ") and "profiling and choosing took" in chose[0]
    assert ("interlocked (2 steps per call; " in chose[0]) == (interlock == 2)
    assert ("ms synchronised: --interlock 2 " in chose[0]) == (interlock == 2)
    assert [line for line in out.splitlines() if line.startswith("step 3/3: loss ")], out
    said = [line for line in out.splitlines() if line.startswith("auto: predicted ") and ", ran " in line]
    predicted = float(chose[0].split("predicted ")[1].split(" ms")[0])
    assert len(said) == 1 and said[0].startswith(f"auto: predicted {predicted:.1f} ms per step, ran "), out
    assert said[0].endswith("the median of steps 3-3)"), said
    # the engine's own work, measured on these ranks by calibration.py: a pass, a step, a parameter stepped
    engine = chose[0].split("the engine's own work ")[1]
    per_pass, per_step, per_parameter = (float(engine.split(unit)[0].split()[-1]) for unit in
                                         (" ms a pass", " ms a step", " ns a parameter stepped"))
    assert 0 < per_pass < 20 and 0 < per_step < 200 and 0 <= per_parameter < 1e3, chose
    assert "auto:" not in run.stdout[1]  # rank 0 alone says it


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_train_auto_prices_experts_sharded_over_replicas_and_trains_its_pick():
    """A MoE GPTlite with --expert-parallel-size 2 over 2 stages of 2 replicas: auto profiles it on the 4 ranks,
    ranks the schedules with the replicas' all-to-alls priced, and trains its pick with the experts sharded."""
    from local_launch import launch
    run = launch(4, AUTO + ["--steps", "2", "--moe-experts", "4", "--expert-parallel-size", "2"], timeout=180)
    assert run.ok, run.explain()
    out = run.stdout[0]
    assert [line for line in out.splitlines() if line.startswith("auto: chose ")], out
    assert [line for line in out.splitlines() if line.startswith("step 2/2: loss ")], out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_train_auto_profiles_the_experts_and_prices_dualpipe_sharing_them():
    """A MoE GPTlite with --dualpipe-experts shard: auto measures its expert layers (the exchanged bytes too),
    ranks DualPipe with the shared experts' exchanges priced, and trains its pick."""
    from local_launch import launch
    run = launch(2, AUTO + ["--steps", "2", "--moe-experts", "4", "--dualpipe-experts", "shard"], timeout=120)
    assert run.ok, run.explain()
    out = run.stdout[0]
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert "dualpipe" in [row[1] for row in rows], out
    assert [line for line in out.splitlines() if line.startswith("step 2/2: loss ")], out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_train_auto_with_a_budget_nothing_fits_is_one_line():
    from local_launch import launch
    from training import assert_one_error_line
    run = launch(2, AUTO + ["--steps", "1", "--max-activation-memory", "0.001"], timeout=120)
    assert set(run.returncodes) == {2}, run.explain()
    assert_one_error_line(2, run.stderr[0], "--max-activation-memory 0.001 MiB: no schedule fits",
                          others=run.stderr[1:])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_partition_method_profile_cuts_on_the_measured_costs_and_trains_exactly(sgd_config, references, tmp_path):
    """`--partition-method profile` without auto, GPTlite tiny on 2 ranks: the cut the engines used (each
    logs its stage's layers, tests/partition_probe.py) is DeepSpeed's balanced partition of the per-layer
    costs the run printed; the 50257-token head dominates, so it is alone on the last stage ([0, 6, 7]),
    where uniform cuts [0, 4, 7] and parameters (the model's default) [0, 3, 7]. Trained exactly as the
    non-pipelined model (tests/training.py)."""
    import json
    import re

    from deepspeed.runtime import utils as ds_utils

    from local_launch import launch
    from training import COMMON, TINY, assert_same_training
    metrics, export = tmp_path / "metrics.jsonl", tmp_path / "weights.pt"
    run = launch(2, [*TINY, *COMMON, "--deepspeed_config", sgd_config(), "--gradient-accumulation-steps", "4",
                     "--metrics-file", metrics, "--export", export, "--pipeline-parallel-size", "2",
                     "--partition-method", "profile"], timeout=240, script="tests/partition_probe.py")
    assert run.ok, run.explain()
    said = [line for line in run.stdout[0].splitlines() if line.startswith("profile: --partition-method profile:")]
    assert len(said) == 1 and "profile:" not in run.stdout[1], run.stdout
    weights = [float(w) for w in re.search(r"costs \(ms\) ([0-9. ]+);", said[0]).group(1).split()]
    stages = sorted((int(s), int(a), int(b)) for out in run.stdout
                    for s, a, b in re.findall(r"STAGE=(\d+) LAYERS=\d+ \[(\d+), (\d+)\)", out))
    assert [s for s, _, _ in stages] == [0, 1], run.stdout
    used = [stages[0][1]] + [b for _, _, b in stages]
    assert used == [int(b) for b in ds_utils.partition_balanced(weights=weights, num_parts=2)], (used, weights)
    assert used == [0, 6, 7], (used, weights)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    result = ([r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r],
              torch.load(export))
    assert_same_training(result, references(4, TINY))


def choose_schedule_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "scripts" / "choose_schedule.py"
    spec = importlib.util.spec_from_file_location("choose_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,expected", [
    (["--stages", "1"], "--stages 1"),
    (["--micro-batches", "0"], "--micro-batches"),
    (["--max-activation-memory", "0"], "--max-activation-memory"),
    (["--profile", "/no/such/profile.json"], "--profile /no/such/profile.json"),
])
def test_choose_schedule_refuses_bad_input_in_one_line(flags, expected, capsys):
    with pytest.raises(SystemExit) as exit:
        choose_schedule_script().main(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and expected in err[0], err


def test_choose_schedule_plans_from_a_saved_profile(tmp_path, capsys):
    """Planning only: any p and m from one profile, no ranks; a budget nothing fits is one line per (p, m)."""
    path = tmp_path / "profile.json"
    synthetic().save(path)
    choose_schedule_script().main(["--profile", str(path), "--stages", "2", "4", "--micro-batches", "8",
                                   "--limit", "3", "--json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert out.count("chose ") == 2 and "p = 2, m = 8:" in out and "chose zb-v with" in out.split("p = 4, m = 8:")[1]
    import json
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [(c["stages"], c["micro_batches"]) for c in plan["choices"]] == [(2, 8), (4, 8)]
    assert plan["choices"][1]["ranked"][0]["schedule"] == "zb-v"
    choose_schedule_script().main(["--profile", str(path), "--stages", "4", "--micro-batches", "8",
                                   "--max-activation-memory", "0.5"])
    assert "no schedule fits" in capsys.readouterr().out


def test_each_layers_step_is_its_parameters_at_the_rate_of_one_ranks_share(monkeypatch):
    """planning.measure costs every layer's optimizer step as its parameters times the per-parameter rate of
    one cold step over what a rank holds (measure_step, with the norm when the config clips): the engines
    step a rank's parameters at once, and a warm step over one layer's few tensors was a quarter of it. It
    times B and W adding into .grad in place where the engines will (fp32, one data-parallel rank)."""
    import planning
    import train
    from schedules.planner import profile as planner
    asked = []

    def rate(numel, optimizer, clip=True, **_):
        asked.append((numel, clip))
        return 1e-9
    monkeypatch.setattr(planner, "measure_step", rate)
    measured = planner.measure_layers
    in_place = []

    def layers(*a, **kw):
        in_place.append(kw["in_place"])
        return measured(*a, **kw)
    monkeypatch.setattr(planner, "measure_layers", layers)
    args = train.parse_args(["--model", "deep", "--deep-width", "16", "--deep-depth", "4", "--micro-batch-size", "2",
                             "--pipeline-parallel-size", "2"])
    cfg = train.ds_config(args, 1)
    batch_of = train.micro_batch_source(args, cfg["train_micro_batch_size_per_gpu"], False)
    profile = planning.measure(args, cfg, batch_of, repeats=1)
    total = sum(c.params for c in profile.layers)
    assert asked == [(total / 2, planning.normed(cfg))] and total > 0
    assert all(c.optimizer == pytest.approx(c.params * 1e-9) for c in profile.layers)
    assert profile.slices is None  # no vocabulary head to split
    assert in_place == [True]  # fp32 at ZeRO 1 with one data-parallel rank: B and W timed as the engines run them
    planning.measure(args, {**cfg, "bf16": {"enabled": True}}, batch_of, repeats=1)
    assert in_place == [True, False]
    assert planning.normed({"gradient_clipping": 0.0, "zero_optimization": {"stage": 0}}) is False
    assert planning.normed({"gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}) is True


def test_in_situ_times_give_each_layer_its_own_passes():
    """A rank's layers timed together, each pass over all of them in turn (in_situ_times): each layer's F, B, W
    and fused BW are its own, in forward order, though the backward runs them in reverse (set sleeps)."""
    import deep_model
    from schedules.planner.profile import in_situ_times
    seconds = [(0.002, 0.004, 0.006), (0.008, 0.001, 0.003), (0.001, 0.007, 0.002)]
    layers = [deep_model.TimedBlock(8, s) for s in seconds]
    x = torch.randn(2, 8)
    times = in_situ_times([(layer, x) for layer in layers], repeats=2)
    for (f, b, w), measured in zip(seconds, times):
        for got, want in zip(measured, (f, b, w, b + w)):
            assert want <= got < want + 0.004, (seconds, times)


def test_the_engines_own_step_is_outside_every_rank_and_kept_in_the_file(tmp_path):
    """Profile.step_overhead (the engine's own work per step, calibration.py) is added to every rank's step
    outside the schedule, and survives save / load; a file without it loads with none."""
    from schedules.planner.compose import compose
    from schedules.registry import schedule_spec
    profile = Profile.synthetic(LAYERS, optimizer=1e-3)
    placement = schedule_spec("zb-h1").placement(P)
    parts = cut(profile, "uniform", P)
    before = compose(profile, placement, parts)["outside"]
    profile.step_overhead = 0.25
    after = compose(profile, placement, parts)["outside"]
    assert after == pytest.approx([o + 0.25 for o in before]) and len(after) == P
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path).step_overhead == 0.25
    data = profile.to_json()
    del data["step_overhead"]
    assert Profile.from_json(data).step_overhead == 0.0


def test_the_simulator_counts_what_a_pass_holds_while_it_runs():
    """A memory table's `within` (bytes a pass holds above its start while it runs, beyond what it leaves) raises
    the peak where it falls inside the pass: 1F1B at p = 2, m = 2, the last stage holding one micro-batch (1
    unit) and its fused backward 5 more while it runs."""
    from schedules.simulator.simulate import simulate
    table = {(r, 0): {"F": 1.0, "BW": -1.0} for r in range(2)}
    plain = simulate("1f1b", 2, 2, memory=table, iterations=1)
    table[(1, 0)]["within"] = {"BW": 5.0}
    held = simulate("1f1b", 2, 2, memory=table, iterations=1)
    assert [row["peak_activation_memory"] for row in plain.per_rank] == [2.0, 1.0]
    assert [row["peak_activation_memory"] for row in held.per_rank] == [2.0, 6.0]


def test_a_recomputing_slice_holds_its_logits_while_its_backward_runs():
    """measure_layer's `within`: the most saved above a pass's start while it runs, where more than it leaves. A
    VocabSlice recomputing q of its rows holds their logits inside its backward (split or fused), exactly their
    bytes; the last slice, which keeps its logits, holds nothing more; compose counts it in the chunk."""
    from schedules.planner.compose import chunk_figures
    from schedules.planner.profile import measure_slices
    from schedules.runtime.vocab_parallel import VocabSlice, slice_layout, vocab_parallel_loss
    vocab, width, tokens = 1000, 16, (2, 8)
    rows, q = slice_layout(vocab, 2)
    builders = [(f"S{k}", lambda k=k: VocabSlice(width, vocab, k, 2, recompute=q[k], rows=rows)) for k in range(2)]
    costs = measure_slices(builders, torch.randn(*tokens, width), torch.randint(0, vocab, tokens),
                           vocab_parallel_loss, repeats=1)
    again = round(q[0] * rows[0]) * tokens[0] * tokens[1] * 4  # the recomputed rows' fp32 logits
    assert costs[0].within == {"B": again, "BW": again} and costs[1].within == {}
    profile = Profile(costs)
    assert chunk_figures(profile, [0], False)[1]["within"] == {"B": again, "BW": again}
    assert "within" not in chunk_figures(profile, [1], False)[1]
    # layers holding nothing more while they run, whose neighbours share a storage (one's output, the next one's
    # input): the chunk holds nothing more either (each storage counted once, as at the passes' ends)
    from schedules.planner.profile import LayerCost
    shared = Profile([LayerCost(f"L{i}", 1.0, 1.0, 1.0, 2.0, {"F": [2, 1, 1], "B": [1, 1, 0], "W": [0, 0, 0]})
                      for i in range(3)])
    memory = chunk_figures(shared, range(3), False)[1]
    assert memory["F"] == 4 and "within" not in memory


def test_measure_step_times_the_optimizer_stepping_one_flat_tensor():
    """measure_step's rate is per parameter of one flat tensor: positive, and the optimizer did step it."""
    from schedules.planner.profile import measure_step
    stepped = []

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            stepped.append(1)
            return super().step(closure)
    assert measure_step(1 << 16, lambda params: Counting(params, lr=0.1), repeats=2) > 0
    assert len(stepped) >= 3  # a warm-up and at least two timed


def test_measure_records_the_split_heads_slices_as_train_py_builds_them(monkeypatch):
    """For GPTlite planning.measure also measures the head split into --pipeline-parallel-size slices as train.py
    --vocab-parallel builds them (gptlite.layer_specs' rows, the last slice with its loss), their optimizer step
    at the profile's rate and their B and W timed as the layers' are; not where asked not to (a cut alone)."""
    import gptlite
    import planning
    import train
    from schedules.planner import profile as planner
    monkeypatch.setattr(planner, "measure_step", lambda numel, optimizer, clip=True, **_: 1e-9)
    measured, in_place = planner.measure_slices, []

    def slices(*a, **kw):
        in_place.append(kw["in_place"])
        return measured(*a, **kw)
    monkeypatch.setattr(planner, "measure_slices", slices)
    args = train.parse_args(["--model", "gptlite", "--model-size", "tiny", "--micro-batch-size", "2",
                             "--pipeline-parallel-size", "2"])
    cfg = train.ds_config(args, 1)
    batch_of = train.micro_batch_source(args, cfg["train_micro_batch_size_per_gpu"], False)
    profile = planning.measure(args, cfg, batch_of, repeats=1)
    head, config = profile.layers[-1], gptlite.MODEL_SIZES["tiny"]
    rows = list(gptlite.layer_specs(config, vocab_parts=2)[-1][1][4])
    assert in_place == [True] and profile.slices_recompute is True and len(profile.slices) == 2
    assert [c.name for c in profile.slices] == ["LMHeadSlice"] * 2
    assert [c.params for c in profile.slices] == [r * config.n_embd for r in rows] and rows[0] < rows[1]
    assert sum(c.params for c in profile.slices) == head.params
    assert sum(c.param_bytes for c in profile.slices) == head.param_bytes
    assert all(c.optimizer == pytest.approx(c.params * 1e-9) for c in profile.slices)
    assert all(c.F > 0 and c.B > 0 and c.W > 0 and c.BW > 0 for c in profile.slices)
    tokens = 2 * config.block_size
    # slice 0 passes on (hidden, lse, z, labels); the last one's output is its loss, a scalar
    assert profile.slices[0].output_bytes == tokens * (4 * config.n_embd + 4 + 4 + 8)
    assert profile.slices[1].output_bytes == 4
    assert profile.slices[0].saved["F"][1] == tokens * 4 * config.n_embd  # its input: the hidden state
    assert profile.meta["slices_seconds"] > 0
    # the chooser's split head is the measured slices
    from schedules.planner.compose import split_head
    assert split_head(profile, 2).layers[-2:] == profile.slices
    assert planning.measure(args, cfg, batch_of, repeats=1, split=False).slices is None
    assert in_place == [True]


def test_measure_slices_shares_the_slices_over_the_ranks():
    """Slice k is measured by rank k mod world (every rank r with r mod p = k when the ranks outnumber them), the
    others run forward only; the loss with the last slice."""
    import planning
    import train
    from schedules.planner.profile import measure_slices
    from schedules.runtime.vocab_parallel import vocab_parallel_loss
    args = train.parse_args(["--model", "gptlite", "--model-size", "tiny", "--pipeline-parallel-size", "3"])
    tokens = torch.randint(0, 50257, (1, 8))
    builders = planning.slice_builders(args, 3)

    def who(rank, world):
        costs = measure_slices(builders, planning.head_input(args, tokens), tokens, vocab_parallel_loss, repeats=1,
                               rank=rank, world=world)
        return [c is not None for c in costs]
    assert who(0, 1) == [True] * 3
    assert who(1, 2) == [False, True, False] and who(0, 2) == [True, False, True]
    assert who(4, 6) == [False, True, False] and who(2, 3) == [False, False, True]
