"""Convert a DeepSpeed pipeline checkpoint to DeepSpeed's universal layout, one file per parameter and state.

    python scripts/convert_checkpoint.py CKPT_DIR [--tag global_step40] [--out FOLDER]

CKPT_DIR is a --save-dir (the tag `latest` names, or --tag) or a tag's folder. Writes `<tag>/zero/`
(or --out): `<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, `step.pt` and `optimizer_state.pt`, the
layout of DeepSpeed's `ds_to_universal`, which DeepSpeed loads on its stock engine under any stage count
(config `"checkpoint": {"load_universal": true}`). Beyond ds_to_universal: ZeRO 0 (train.py's checkpoints
name their parameters), interleaved, V and DualPipe placements, a split vocabulary head (written as the
unsplit head), and no need for a `layer_01` file. train.py's `--resume` converts by itself when the layout
changes; this is for other tools, or to convert ahead of time.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tag_folder(path, tag=None):
    """The checkpoint folder of one tag: `path` itself, or `path/tag`, or `path/<latest>`."""
    if tag:
        return os.path.join(path, tag)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a --save-dir, or one tag's folder")
    p.add_argument("--tag", default=None, help="the tag to convert (default: the one 'latest' names)")
    p.add_argument("--out", default=None, help="where to write (default: <tag folder>/zero)")
    args = p.parse_args(argv)
    folder = tag_folder(args.checkpoint, args.tag)
    from checkpoints import to_universal
    from schedules.runtime import universal
    start = time.perf_counter()
    try:
        names = to_universal(folder, out=args.out)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {folder}: {e}")
    out = args.out or os.path.join(folder, universal.ZERO)
    print(f"{out}: {len(names)} parameters in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
