"""What a resume under another layout costs: train.py's time to load a checkpoint, its own layout against others.

    python scripts/benchmark_resume.py [--model-size medium] [--rounds 2] [--out runs/resume] [--docs]

Trains GPTlite one step at 2 stages (1F1B, the shipped config: ZeRO 1) and saves it; then resumes that
checkpoint one step further, in rotating rounds of fresh launches: under its own layout (DeepSpeed's own
files), and under others (ZB-V; ZB-V with the head split; 1F1B at ZeRO 0), each once with its universal
layout written afresh (`<tag>/zero` removed first) and once reading the one already written. The time is
what rank 0 reports from the start of the load to its end ("resumed ... in S s"); the table prints each
median and its difference from the plain resume.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

# name: (flags beside the run's, ZeRO stage, whether the universal layout is written afresh)
RESUMES = {
    "own layout": ([], 1, False),
    "zb-v, converted": (["--pipeline-schedule", "zb-v"], 1, True),
    "zb-v, already converted": (["--pipeline-schedule", "zb-v"], 1, False),
    "zb-v split head, converted": (["--pipeline-schedule", "zb-v", "--vocab-parallel"], 1, True),
    "1f1b at ZeRO 0, converted": ([], 0, True),
}


def main(argv=None):
    p = common.add(common.parser(__doc__), "model-size", "block-size", "rounds", "out", "docs", "timeout",
                   model_size="medium", block_size=32, rounds=2, out="runs/resume", docs="resume", timeout=900)
    args = p.parse_args(argv)
    from local_launch import ROOT, launch
    work = tempfile.mkdtemp(prefix="resume-bench-")
    configs = {}
    for stage in (0, 1):
        cfg = json.loads((ROOT / "ds_config.json").read_text())
        configs[stage] = os.path.join(work, f"zero{stage}.json")
        with open(configs[stage], "w") as f:
            json.dump({**cfg, "zero_optimization": {"stage": stage}}, f)
    model = ["--model-size", args.model_size, "--block-size", str(args.block_size), "--micro-batch-size", "1",
             "--gradient-accumulation-steps", "4", "--pipeline-parallel-size", "2", "--pipeline-schedule", "1f1b"]
    saved = os.path.join(work, "ckpt")
    run = launch(2, [*model, "--steps", "1", "--save-dir", saved], timeout=args.timeout)
    if not run.ok:
        raise SystemExit(run.explain())
    tag = os.path.join(saved, "global_step1")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tag) for f in fs)
    times = {name: [] for name in RESUMES}
    for r in range(args.rounds):
        for name in common.rotated(list(RESUMES), r):
            flags, stage, afresh = RESUMES[name]
            if afresh:
                shutil.rmtree(os.path.join(tag, "zero"), ignore_errors=True)
            run = launch(2, [*model, *flags, "--deepspeed_config", configs[stage], "--steps", "2",
                             "--resume-from", saved], timeout=args.timeout)
            if not run.ok:
                raise SystemExit(f"{name}: {run.explain()}")
            times[name].append(float(re.search(r"resumed global_step1 in ([\d.]+) s", run.stdout[0]).group(1)))
    shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    plain = medians["own layout"]
    lines = [f"# {common.machine('benchmark_resume.py', argparse.Namespace(device='cpu', stages=2))}",
             f"# GPTlite {args.model_size}, 2 stages, checkpoint of {size / 2**20:.0f} MiB, {args.rounds} rounds",
             f"{'resume':32} {'load (s)':>9} {'over plain (s)':>15}"]
    lines += [f"{name:32} {t:9.2f} {t - plain:15.2f}" for name, t in medians.items()]
    print("\n".join(lines))
    record = {"machine": lines[0][2:], "args": vars(args), "checkpoint_bytes": size, "times_s": times,
              "median_s": medians}
    common.save(args, "resume", record, lines)


if __name__ == "__main__":
    main()
