"""Which pipeline schedule to train with: profile the model's layers on this machine's ranks, then rank every
schedule, v and cut for each number of stages and micro-batches asked, as `train.py --pipeline-schedule
auto` does before it trains (docs/choosing.md). Nothing is trained.

    python scripts/choose_schedule.py --model deep --deep-width 1024 --micro-batch-size 32 \\
        --stages 2 4 --micro-batches 4 8 [--max-activation-memory MiB] [--save runs/profile.json]
    python scripts/choose_schedule.py --profile runs/profile.json --stages 8 --micro-batches 16   # plan only

The profile is measured on `--ranks` ranks launched on this machine (2 by default; every rank measures every
layer, as in a training job), or read from `--profile`. Stage and micro-batch counts need not be the ones
profiled: the per-layer figures compose into any cut. Every flag this script does not know is train.py's
(the model, its size, the micro-batch size, the optimizer, --bf16, the data): the profile measures the model
train.py would build with them.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/, wherever this is loaded from
import bench_common as common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py, planning.py: importable without the package installed


def parse_args(argv=None):
    p = common.add(common.parser(__doc__), "stages", "micro-batches", "timeout", timeout=300,
                   stages=dict(nargs="+", default=[2], help="pipeline stages p to plan for"),
                   micro_batches=dict(default=[4], help="micro-batches per step m"))
    p.add_argument("--max-activation-memory", type=float, default=None, help="MiB per rank")
    p.add_argument("--cuts", nargs="+", default=None, help="partition methods to try (default: all)")
    p.add_argument("--profile", default=None, help="read this profile (JSON) instead of measuring")
    p.add_argument("--save", default=None, help="write the measured profile (JSON) here")
    p.add_argument("--json", default=None, help="write the ranked candidates of every (p, m) here")
    p.add_argument("--ranks", type=int, default=2, help="ranks to profile on (p2p is measured between two)")
    p.add_argument("--limit", type=int, default=None, help="print only the first N rows of each table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_known_args(argv)


def fail(message):
    print(f"choose_schedule: {message}", file=sys.stderr)
    raise SystemExit(2)


def train_flags(rest, stages):
    """train.py's parsed flags and merged config for the model to profile."""
    import train
    args = train.parse_args(rest + ["--pipeline-parallel-size", str(stages)])
    return args, train.ds_config(args, 1)


def worker(opts, rest):
    """One rank: measure the profile with the others, rank 0 writes it."""
    import torch

    import planning
    import train
    args, cfg = train_flags(rest, 2)
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    batch_of = train.micro_batch_source(args, cfg["train_micro_batch_size_per_gpu"],
                                        cfg.get("bf16", {}).get("enabled", False))
    train.init_distributed(args, on_cpu=not torch.cuda.is_available())
    profile = planning.measure(args, cfg, batch_of, build_engine=train.build_engine)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        profile.save(opts.save)
    dist.barrier()
    dist.destroy_process_group()


def measure(opts, rest):
    """Launch `--ranks` ranks of this script to measure the profile; returns (Profile, seconds of the launch)."""
    from local_launch import launch
    from schedules.planner.profile import Profile
    save = opts.save or os.path.join(tempfile.mkdtemp(prefix="profile-"), "profile.json")
    started = time.perf_counter()
    run = launch(opts.ranks, ["--worker", "--save", save, *rest], timeout=opts.timeout,
                 script="scripts/choose_schedule.py")
    if not run.ok:
        fail(f"profiling ranks failed:\n{run.explain()}")
    return Profile.load(save), time.perf_counter() - started


def plan(profile, opts):
    """{(p, m): Choice or the one-line reason none}, printing each table."""
    from schedules.planner.choose import CUTS, choose, summary, table
    out = {}
    for p in opts.stages:
        for m in opts.micro_batches:
            try:
                # a GPTlite profile: also its vocabulary head split over the ranks (train.py --vocab-parallel), the
                # slices laid out for each schedule (--vocab-layout auto)
                choice = choose(profile, p, m, opts.max_activation_memory, cuts=opts.cuts or CUTS,
                                split=profile.meta.get("model") == "gptlite", fit_layouts=True)
            except ValueError as e:
                print(f"p = {p}, m = {m}: {e}")
                out[(p, m)] = str(e)
                continue
            print("\n".join([f"p = {p}, m = {m}:", *table(choice, opts.limit), summary(choice), ""]))
            out[(p, m)] = choice
    return out


def main(argv=None):
    opts, rest = parse_args(argv)
    if opts.worker:
        return worker(opts, rest)
    if any(p < 2 for p in opts.stages):
        fail(f"--stages {' '.join(map(str, opts.stages))}: a pipeline schedule needs at least 2 stages")
    if any(m < 1 for m in opts.micro_batches):
        fail("--micro-batches: pass counts >= 1")
    if opts.max_activation_memory is not None and opts.max_activation_memory <= 0:
        fail(f"--max-activation-memory {opts.max_activation_memory}: pass a positive number of MiB")
    from schedules.planner.choose import to_json
    from schedules.planner.profile import Profile
    if opts.profile:
        try:
            profile, took = Profile.load(opts.profile), None
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"--profile {opts.profile}: cannot read a profile from it ({e})")
    else:
        profile, took = measure(opts, rest)
        print(f"profiled {len(profile.layers)} layers on {opts.ranks} ranks in {took:.1f} s "
              f"(the measurement itself {profile.meta.get('seconds', 0):.1f} s)")
    choices = plan(profile, opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"profile_launch_s": took, "profile": profile.to_json(),
                       "choices": [{"stages": p, "micro_batches": m, **(to_json(c) if not isinstance(c, str)
                                                                           else {"error": c})}
                                   for (p, m), c in choices.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
