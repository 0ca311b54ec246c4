"""Checkpoints of train.py: what a run was trained with (`run.json`, written after every rank's files, so a
checkpoint with it is complete), compared before a resume loads anything; saves that a crash cannot
leave half-pointed-at; a damaged file named in one line.
"""
import argparse
import json
import os

from faults import Fault, UsageError, one_line
from schedules.registry import schedule_spec, trainable_schedules
from validation import layer_types

RUN_FILE = "run.json"  # in each checkpoint folder, written after every rank's files: a checkpoint is complete


def placement(args):
    """Where the model's stages live: the checkpoint's layer files and optimizer state follow it. Two
    schedules with the same placement (1f1b, zb-h1, zb-h2; zb-v, dualpipev) resume each other."""
    pp = args.pipeline_parallel_size
    if not pp:
        return None
    spec = schedule_spec(args.pipeline_schedule, args.virtual_stages)
    where = spec.placement(pp)
    chunks = getattr(where, "chunks", 1)
    return {"module": spec.module or ("chunked" if chunks > 1 else "pipeline"),  # which PipelineModule saves them
            "stages": [[where.stage(r, c) for c in range(chunks)] for r in range(pp)]}  # rank -> its model stages


def run_record(args, cfg, world):
    """What a checkpoint records of the run that wrote it (compared on --resume)."""
    pp = args.pipeline_parallel_size
    model = ({"model": "deep", "deep_width": args.deep_width, "deep_depth": args.deep_depth} if args.model == "deep"
             else {"model": "gptlite", "model_size": args.model_size, "layers": len(layer_types(args)),
                   # what older records lack is recorded only where it is not the default
                   **({"vocab_parallel": True} if pp and args.vocab_parallel else {}),
                   **({"block_size": args.block_size} if getattr(args, "block_size", None) else {})})
    chunks = getattr(schedule_spec(args.pipeline_schedule, args.virtual_stages).factory, "virtual_stages", None)
    return {"schedule": args.pipeline_schedule if pp else None, "virtual_stages": chunks if pp else None,
            "pipeline_parallel_size": pp, "data_parallel_size": world // max(pp, 1), "placement": placement(args),
            "model": model, "partition_method": (args.partition_method or "parameters").lower() if pp else None,
            "zero_stage": cfg.get("zero_optimization", {}).get("stage", 0), "optimizer": cfg["optimizer"]["type"],
            "bf16": bool(cfg.get("bf16", {}).get("enabled", False))}


def check_resume(args, cfg, world):
    """The checkpoint `latest` names is complete and undamaged (every file at its recorded size) and was
    trained with what this run uses, or with a difference a resume may make: (its tag, its record).
    Else a UsageError naming the file or the flag. Every rank checks, before any waits on another."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    latest = os.path.join(args.save_dir, "latest")
    need(os.path.isfile(latest), f"--resume: no checkpoint in --save-dir {args.save_dir} (no 'latest' file); "
         "drop --resume to start afresh")
    with open(latest) as f:
        tag = f.read().strip()
    folder = os.path.join(args.save_dir, tag)
    need(tag and os.path.isdir(folder), f"--resume: {latest} names checkpoint {tag!r}, which is missing; write the "
         f"tag of a checkpoint in {args.save_dir} to {latest}")
    run_file = os.path.join(folder, RUN_FILE)
    need(os.path.isfile(run_file), f"--resume: {folder} is incomplete (no {RUN_FILE}: its save was interrupted, or "
         f"an older train.py wrote it); write the tag of a complete checkpoint to {latest}")
    try:
        with open(run_file) as f:
            saved = json.load(f)
        files, step = dict(saved.pop("files")), int(saved.pop("step"))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--resume: {run_file} is damaged ({e}); write the tag of another checkpoint to {latest}")
    for name, size in files.items():
        path = os.path.join(folder, name)
        need(os.path.isfile(path), f"--resume: checkpoint file {path} is missing; restore it or write the tag of "
             f"another checkpoint to {latest}")
        actual = os.path.getsize(path)
        need(actual == size, f"--resume: checkpoint file {path} is damaged ({actual} bytes, written with {size}); "
             f"restore it or write the tag of another checkpoint to {latest}")
    mismatch = resume_mismatch(saved, run_record(args, cfg, world), args)
    need(mismatch is None, f"--resume: {folder} {mismatch}")
    need(step < args.steps, f"--steps {args.steps}: the checkpoint is at step {step} already; pass --steps above "
         f"{step} to train on")
    return tag, saved


def resume_mismatch(saved, now, args):
    """None when a run with record `now` may resume a checkpoint with record `saved`, else which
    difference stops it and how to proceed."""
    def schedule(record):
        v = record.get("virtual_stages")
        return f"--pipeline-schedule {record['schedule']}" + (f" --virtual-stages {v}" if v else "")

    def flags_of(record):
        pp = record["pipeline_parallel_size"]
        return f"--pipeline-parallel-size {pp}" + (f" {schedule(record)}" if pp else "")

    pp = saved["pipeline_parallel_size"]
    if now["pipeline_parallel_size"] != pp:
        return (f"was trained {'without a pipeline' if not pp else f'with {pp} pipeline stages'}: pass "
                f"{flags_of(saved)}")
    if now["data_parallel_size"] != saved["data_parallel_size"]:
        return (f"was trained with {saved['data_parallel_size']} data-parallel replicas, this launch has "
                f"{now['data_parallel_size']}: launch {saved['data_parallel_size'] * max(pp, 1)} processes")
    if now["placement"] != saved["placement"]:
        same = [name + (f" --virtual-stages {saved['virtual_stages']}" if name == saved["schedule"] and
                        saved["virtual_stages"] else "")
                for name in trainable_schedules()
                if placement(_with_schedule(args, name, saved)) == saved["placement"]]
        return (f"was trained with {schedule(saved)}, whose model stages sit elsewhere than with "
                f"{schedule(now)}: resume with --pipeline-schedule {' or '.join(same)}")
    split = saved["model"].get("vocab_parallel", False)
    if now["model"].get("vocab_parallel", False) != split:
        return (f"was trained with the vocabulary head {'split over the ranks' if split else 'whole'}: "
                f"{'pass' if split else 'drop'} --vocab-parallel")
    if now["model"] != saved["model"]:
        want = saved["model"]
        flags = (f"--model deep --deep-width {want['deep_width']} --deep-depth {want['deep_depth']}"
                 if want["model"] == "deep" else f"--model-size {want['model_size']} (with {want['layers']} layers)")
        return f"holds another model: pass {flags}"
    for key, what, fix in (("partition_method", "--partition-method", "pass --partition-method {}"),
                           ("zero_stage", "ZeRO stage", "set zero_optimization.stage {} in --deepspeed_config"),
                           ("optimizer", "optimizer", "pass --optimizer {}")):
        if now[key] != saved[key]:
            value = saved[key].lower() if key == "optimizer" else saved[key]
            return f"was trained with {what} {saved[key]}, this run uses {now[key]}: {fix.format(value)}"
    if now["bf16"] != saved["bf16"]:
        return "was trained in bf16: pass --bf16" if saved["bf16"] else "was trained in fp32: drop --bf16"
    return None


def _with_schedule(args, name, saved):
    v = saved.get("virtual_stages") if name == saved["schedule"] else None
    return argparse.Namespace(**{**vars(args), "pipeline_schedule": name, "virtual_stages": v})


def save_checkpoint(engine, args, record, step):
    """Every rank writes its files; then rank 0 lists them with their sizes in run.json and points
    `latest` at the folder. Both are replaced atomically, after all files exist: a crash mid-save
    leaves `latest` on the previous, complete checkpoint."""
    import torch.distributed as dist
    tag = f"global_step{step}"
    folder = os.path.join(args.save_dir, tag)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(folder, RUN_FILE)):
        os.remove(os.path.join(folder, RUN_FILE))  # re-saving a tag: incomplete until written again
    engine.save_checkpoint(args.save_dir, tag=tag, client_state={"step": step}, save_latest=False)  # ends in a barrier
    if dist.get_rank() == 0:
        files = {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
                 for d, _, names in sorted(os.walk(folder)) for f in sorted(names) if f != RUN_FILE}
        _write_atomically(os.path.join(folder, RUN_FILE), json.dumps({**record, "step": step, "files": files}))
        _write_atomically(os.path.join(args.save_dir, "latest"), tag)


def _write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


class NamedFiles:
    """The engine's checkpoint engine, naming the file a load or a save failed on: each rank reads and
    writes its own files, so only that rank knows (Peers carries its line to rank 0)."""

    def __init__(self, inner, save_dir):
        self._inner, self._latest = inner, os.path.join(save_dir, "latest")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path, *args, **kwargs):
        try:
            return self._inner.load(path, *args, **kwargs)
        except Exception as e:
            raise UsageError(f"--resume: checkpoint file {path} is damaged ({one_line(e)}); restore it or write the "
                             f"tag of another checkpoint to {self._latest}") from None

    def save(self, state_dict, path, *args, **kwargs):
        try:
            return self._inner.save(state_dict, path, *args, **kwargs)
        except Exception as e:
            raise Fault(f"--save-dir: cannot write {path} ({one_line(e)}); {self._latest} still names the last "
                        "complete checkpoint") from None


def load_checkpoint(engine, args, tag):
    """Load checkpoint `tag` (validated) into the engine; the step it was saved at."""
    path, client_state = engine.load_checkpoint(args.save_dir, tag=tag)
    if path is None:
        raise UsageError(f"--resume: DeepSpeed found no checkpoint {tag} in --save-dir {args.save_dir}")
    return client_state["step"]
