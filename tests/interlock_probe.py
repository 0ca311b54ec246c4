"""One rank of interlocked against synchronised training of the same schedule (tests/test_interlock.py).

    python tests/interlock_probe.py STEPS MICRO_BATCHES SCHEDULE:SCENARIO ...
    PROBE_DP=2 python tests/interlock_probe.py ...    # the ranks as 2 data-parallel replicas of the pipeline
    PROBE_PASS_MS=5 python tests/interlock_probe.py ... # blocks whose F, B and W passes take 5 ms each (TimedBlock)
    PROBE_OPTIMIZER=zero1 python tests/interlock_probe.py ...  # DeepSpeed's optimizers, the synchronised engine
                                                        # stepping with DeepSpeed's own step: zero1 (fp32, its ZeRO
                                                        # optimizer), bf16-zero1 (its BF16 optimizer, fp32 gradients:
                                                        # train.py --bf16), bf16 (the same at ZeRO 0, bf16 gradients)

SCENARIO: `off` (no clipping), `never` (clipping on, threshold far above every norm), `bites` (threshold
between the global norms the steps have: some steps clip), `nan` (clipping on, an infinite gradient
injected on the last stage at step 2), `nan-unclipped` (the same with clipping off: in bf16 the norm still skips
the step). POLICY (after a second colon) is the post-validation policy, "ahead"
unless named; `auto-alternate` is `auto` with a vote that speculates past every other step (the switches both
ways, on every rank alike, whatever the timings). For each, two engines built from the same seed train the same
micro-batches with SGD and momentum (so optimizer state is rolled back too): one a `train_batch` per step
(synchronised), one `train_batches(iterations=STEPS)` (interlocked). Prints one JSON line per rank: per
case the largest weight difference between the two, both runs' losses, the interlocked engine's counters.
"""
import json
import os
import sys
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist

import deep_model
import schedules

WIDTH, DEPTH, MBS = 32, 8, 4
INJECT_AT = 2


PASS_MS = float(os.environ.get("PROBE_PASS_MS", "0"))
OPTIMIZER = os.environ.get("PROBE_OPTIMIZER", "")  # "" (torch's, ZeRO 0 in fp32), "zero1", "bf16-zero1", "bf16"
BF16 = OPTIMIZER.startswith("bf16")


def engine(schedule, stages, m, clip):
    seconds = (PASS_MS / 1e3,) * 3 if PASS_MS else None
    model = deep_model.get_model(width=WIDTH, depth=DEPTH, seed=1, pipeline_num_stages=stages,
                                 pipeline_spec_layers=True, pipe_module=schedules.pipe_module(schedule, None),
                                 pass_seconds=seconds)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": m, "gradient_clipping": clip,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}
    if OPTIMIZER:
        cfg.update(zero_optimization={"stage": 0 if OPTIMIZER == "bf16" else 1}, zero_allow_untested_optimizer=True)
    if BF16:  # DeepSpeed builds its BF16 optimizer at ZeRO 1 for fp32 gradients, at ZeRO 0 for bf16 ones
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16" if OPTIMIZER == "bf16" else "fp32"})
    eng, *_ = schedules.initialize(schedule, model=model, optimizer=torch.optim.SGD(params, lr=0.3, momentum=0.9),
                                   model_parameters=params, config=cfg)
    return eng


def inject(eng):
    """An infinite gradient on the last stage, just before the step of global step INJECT_AT."""
    take = eng._take_model_step

    def hooked(lr_kwargs):
        if eng.global_steps == INJECT_AT and eng.is_last_stage():
            if BF16:  # the fp32 gradients the BF16 optimizer accumulated
                eng.optimizer.fp32_groups_gradients_flat[0].view(-1)[0] = float("inf")
            elif OPTIMIZER:  # this rank's partition of the reduced gradients
                eng.optimizer.averaged_gradients[0][0].view(-1)[0] = float("inf")
            else:
                next(p for p in eng.module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return take(lr_kwargs)
    eng._take_model_step = hooked


DP = int(os.environ.get("PROBE_DP", "1"))


def batches(steps, m):
    """This replica's micro-batches (each replica its own, so that the losses averaged over replicas differ)."""
    replica = dist.get_rank() % DP  # DeepSpeed's topology: rank = stage x dp + replica
    made = [deep_model.synthetic_micro_batch(replica * 1000 + i, MBS, WIDTH, 0) for i in range(steps * m)]
    return [(x.bfloat16(), y.bfloat16()) for x, y in made] if BF16 else made


def norms(schedule, stages, steps, m):
    """The global gradient norm of each synchronised step (clipping far away)."""
    eng = engine(schedule, stages, m, 1e9)
    out = []
    data = iter(batches(steps, m))
    for _ in range(steps):
        eng.train_batch(data)
        out.append(float(eng._global_grad_norm))
    return out


def main(steps, m, cases):
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    stages = dist.get_world_size() // DP
    report = {"rank": dist.get_rank(), "cases": {}}
    for case in cases:
        schedule, scenario, *policy = case.split(":")  # policy: the post-validation policy, "ahead" unless named
        clip = {"off": 0.0, "never": 1e9, "nan": 1e9, "nan-unclipped": 0.0}.get(scenario)
        if scenario == "bites":
            seen = sorted(norms(schedule, stages, steps, m))
            clip = (seen[len(seen) // 2 - 1] + seen[len(seen) // 2]) / 2  # between two steps' norms: half clip
        sync, inter = engine(schedule, stages, m, clip), engine(schedule, stages, m, clip)
        if OPTIMIZER:  # against DeepSpeed's own step, whose norm's all-reduce blocks, and its loss broadcast
            sync._step_target = None
            sync._loss_shared_early = lambda: False
        inter.post_validation = policy[0] if policy else "ahead"
        if inter.post_validation == "auto-alternate":
            inter.post_validation = "auto"
            inter._vote().rule = lambda vote: vote.validated % 2 == 0  # every rank has validated as many steps
        if scenario.startswith("nan"):
            inject(sync)
            inject(inter)
        data = iter(batches(steps, m))
        sync_losses = [float(sync.train_batch(data)) for _ in range(steps)]
        inter_losses = [float(x) for x in inter.train_batches(iter(batches(steps, m)), iterations=steps)]
        diff = max((a - b).abs().max().item() for a, b in zip(sync.module.parameters(), inter.module.parameters()))
        finite = all(torch.isfinite(p).all().item() for p in inter.module.parameters())
        report["cases"][case] = {"clip": clip, "max_diff": diff, "finite": finite, "sync_losses": sync_losses,
                                 "losses": inter_losses, "rollbacks": inter.rollbacks, "deferred": inter.deferred,
                                 "waited": inter.waited,
                                 "skipped": inter.skipped, "sync_skipped": sync.skipped_steps,
                                 "validations": inter.validations, "replays": inter.replays,
                                 "speculated": inter.speculated,
                                 "pending": inter._pending is not None}
    print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
