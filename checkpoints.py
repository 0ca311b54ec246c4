"""Checkpoints of train.py: what a run was trained with (`run.json`, written after every rank's files, so a
checkpoint with it is complete), compared before a resume loads anything; saves that a crash cannot
leave half-pointed-at; a damaged file named in one line.

A resume under the layout that wrote the checkpoint loads DeepSpeed's own files (the same losses, bit for
bit). Under another layout (schedule, stage count, data-parallel degree, ZeRO stage, precision, the
vocabulary head split or whole, another cut of the layers) the checkpoint is first converted once to
DeepSpeed's universal layout, one file per parameter and state (schedules/runtime/universal.py), which
every rank reads its parameters from. What cannot move (another model, another optimizer, another
micro-batch or global batch) is refused before anything is loaded.
"""
import json
import os

from faults import Fault, UsageError, one_line
from schedules.registry import schedule_spec
from validation import layer_types, moe_config

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
                   **({"block_size": args.block_size} if getattr(args, "block_size", None) else {}),
                   **({"experts": _experts_of(args)} if getattr(args, "moe_experts", 0) else {})})
    chunks = getattr(schedule_spec(args.pipeline_schedule, args.virtual_stages).factory, "virtual_stages", None)
    return {"schedule": args.pipeline_schedule if pp else None, "virtual_stages": chunks if pp else None,
            "pipeline_parallel_size": pp, "data_parallel_size": world // max(pp, 1), "placement": placement(args),
            "model": model, "partition_method": (args.partition_method or "parameters").lower() if pp else None,
            "zero_stage": cfg.get("zero_optimization", {}).get("stage", 0), "optimizer": cfg["optimizer"]["type"],
            "bf16": bool(cfg.get("bf16", {}).get("enabled", False)),
            "micro_batch_size": cfg["train_micro_batch_size_per_gpu"],
            **({"expert_parallel_size": args.expert_parallel_size} if getattr(args, "moe_experts", 0) else {}),
            "gradient_accumulation_steps": cfg["gradient_accumulation_steps"],
            **({"vocab_rows": vocab_rows_of(args)} if model.get("vocab_parallel") else {})}


def _experts_of(args):
    """A Mixture of Experts' model (its expert-parallel size is layout, recorded apart)."""
    experts = moe_config(args)
    experts["moe_blocks"] = list(experts["moe_blocks"])
    return {k: v for k, v in experts.items() if k != "expert_parallel_size"}


def vocab_rows_of(args):
    """The rows of the split head's slices this run builds (train.py --vocab-layout)."""
    fitted = getattr(args, "vocab_fitted", None)
    if fitted:
        return [int(r) for r in fitted[0]]
    return split_rows(args.pipeline_parallel_size, layout=getattr(args, "vocab_layout", "auto") != "even")


def split_rows(parts, layout=True):
    """The rows of GPTlite's split head's slices at `parts` ranks (`layout=False`: the even split, as checkpoints
    written before the slices' layout have it)."""
    from gptlite import GPTliteConfig
    from schedules.runtime.vocab_parallel import slice_layout
    return slice_layout(GPTliteConfig.vocab_size, parts, recompute=layout)[0]


def check_resume(args, cfg, world):
    """The checkpoint `latest` names is complete and undamaged (every file at its recorded size) and holds
    what this run trains, on the same data order: (its tag, its record). Else a UsageError naming the file
    or the flag. Every rank checks, before any waits on another."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    source = source_dir(args)
    latest = os.path.join(source, "latest")
    flag = f"--resume-from {source}" if args.resume_from else f"--save-dir {source}"
    need(os.path.isfile(latest), f"--resume: no checkpoint in {flag} (no 'latest' file); drop --resume to start "
         "afresh")
    with open(latest) as f:
        tag = f.read().strip()
    folder = os.path.join(source, tag)
    need(tag and os.path.isdir(folder), f"--resume: {latest} names checkpoint {tag!r}, which is missing; write the "
         f"tag of a checkpoint in {source} to {latest}")
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
    now = run_record(args, cfg, world)
    if "micro_batch_size" not in saved:  # written before the record held them: the config it saved has them
        saved.update(_batch_of_saved_config(folder))
    refusal = resume_refusal(saved, now)
    need(refusal is None, f"--resume: {folder} {refusal}")
    changes = layout_changes(saved, now)
    need(not changes or "experts" not in saved["model"], f"--resume: {folder} holds a Mixture of Experts, whose "
         f"experts' states do not move to another layout yet ({'; '.join(changes)}): resume with "
         f"{_flags_of(saved)} and {saved['data_parallel_size']} data-parallel ranks")
    need(not changes or saved["zero_stage"] or saved.get("param_names"),
         f"--resume: {folder} was written at ZeRO 0 without its parameters' names, so it resumes only under "
         f"the layout that wrote it ({_flags_of(saved)}); resume there and save once, then change")
    resave = step == args.steps and args.resume_from and args.save_dir and \
        os.path.realpath(args.save_dir) != os.path.realpath(args.resume_from)
    need(step < args.steps or resave, f"--steps {args.steps}: the checkpoint is at step {step} already; pass --steps "
         f"above {step} to train on (or --resume-from it with --steps {step} and another --save-dir to save it "
         f"under this layout)")
    return tag, {**saved, "step": step}


def source_dir(args):
    """The directory a resume reads: --resume-from's, else --save-dir."""
    return args.resume_from or args.save_dir


def _batch_of_saved_config(folder):
    import torch
    path = os.path.join(folder, "mp_rank_00_model_states.pt")
    config = torch.load(path, map_location="cpu", weights_only=False).get("ds_config", {}) if os.path.isfile(path) \
        else {}
    return {"micro_batch_size": config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": config.get("gradient_accumulation_steps")}


def _schedule_flags(record):
    v = record.get("virtual_stages")
    return f"--pipeline-schedule {record['schedule']}" + (f" --virtual-stages {v}" if v else "")


def _flags_of(record):
    pp = record["pipeline_parallel_size"]
    return f"--pipeline-parallel-size {pp}" + (f" {_schedule_flags(record)}" if pp else "")


def _experts_flags(experts):
    if not experts:
        return "a dense model (no --moe-experts)"
    return (f"pass --moe-experts {experts['moe_experts']} --moe-blocks {','.join(map(str, experts['moe_blocks']))} "
            f"--moe-top-k {experts['moe_top_k']} --moe-capacity-factor {experts['moe_capacity_factor']:g} "
            f"--moe-aux-coef {experts['moe_aux_coef']:g}")


def _unsplit_model(record):
    """The model a record describes, its head whole: a split head's slices are one layer."""
    model = dict(record["model"])
    if model.pop("vocab_parallel", False):
        model["layers"] -= record["pipeline_parallel_size"] - 1
    return model


def resume_refusal(saved, now):
    """None when a run with record `now` can continue a checkpoint with record `saved` (under any layout),
    else what stops it and how to proceed: another model or optimizer, another order of the data."""
    if _unsplit_model(now) != _unsplit_model(saved):
        want = saved["model"]
        flags = (f"--model deep --deep-width {want['deep_width']} --deep-depth {want['deep_depth']}"
                 if want["model"] == "deep" else f"--model-size {want['model_size']} (with "
                 f"{_unsplit_model(saved)['layers']} layers, the head whole)"
                 + (f" --block-size {want['block_size']}" if want.get("block_size") else ""))
        if _unsplit_model({**now, "model": {**now["model"], "experts": want.get("experts")}}) == \
                _unsplit_model(saved):  # the experts alone differ
            return f"holds another Mixture of Experts: {_experts_flags(want.get('experts'))}"
        return f"holds another model: pass {flags}"
    if now["optimizer"] != saved["optimizer"]:
        return (f"was trained with optimizer {saved['optimizer']}, this run uses {now['optimizer']}: pass "
                f"--optimizer {saved['optimizer'].lower()}")
    mbs = saved.get("micro_batch_size")
    if mbs is not None and now["micro_batch_size"] != mbs:
        return (f"was trained on micro-batches of {mbs} sequences, this run uses {now['micro_batch_size']}: pass "
                f"--micro-batch-size {mbs} (the data order is made of them)")
    if mbs is not None:
        batch = mbs * saved["gradient_accumulation_steps"] * saved["data_parallel_size"]
        per_step = now["micro_batch_size"] * now["data_parallel_size"]
        if now["gradient_accumulation_steps"] * per_step != batch:
            fix = (f"pass --gradient-accumulation-steps {batch // per_step}" if batch % per_step == 0 else
                   f"launch a data-parallel degree that divides {batch // mbs} micro-batches")
            return (f"was trained on {batch} sequences per step, this run takes "
                    f"{now['gradient_accumulation_steps'] * per_step}: {fix} (the same global batch, the same data)")
    return None


def layout_changes(saved, now, cut=None):
    """What differs between the layout a checkpoint was written under and this run's, in flags (empty: the
    same layout, DeepSpeed's own files load). `cut`: this run's layer boundaries, against the saved ones."""
    changes = []
    for key, flag in (("pipeline_parallel_size", "--pipeline-parallel-size"),
                      ("data_parallel_size", "data-parallel degree"), ("zero_stage", "ZeRO stage")):
        if now[key] != saved[key]:
            changes.append(f"{flag} {saved[key]} -> {now[key]}")
    if now["placement"] != saved["placement"] and _schedule_flags(now) != _schedule_flags(saved) and \
            now["pipeline_parallel_size"] and saved["pipeline_parallel_size"]:
        changes.append(f"{_schedule_flags(saved)} -> {_schedule_flags(now)}")
    if now["model"].get("vocab_parallel", False) != saved["model"].get("vocab_parallel", False):
        changes.append("--vocab-parallel " + ("on -> off" if saved["model"].get("vocab_parallel") else "off -> on"))
    if now["bf16"] != saved["bf16"]:
        changes.append("--bf16 " + ("on -> off" if saved["bf16"] else "off -> on"))
    if now.get("expert_parallel_size", 1) != saved.get("expert_parallel_size", 1):
        changes.append(f"--expert-parallel-size {saved.get('expert_parallel_size', 1)} -> "
                       f"{now.get('expert_parallel_size', 1)}")
    if "vocab_rows" in now and saved["model"].get("vocab_parallel") and not changes:
        rows = saved.get("vocab_rows") or split_rows(saved["pipeline_parallel_size"], layout=False)
        if rows != now["vocab_rows"]:
            changes.append(f"the split head's rows {rows} -> {now['vocab_rows']}")
    if changes:
        return changes  # the layers are cut anew anyway
    if cut is not None and saved.get("layer_cut") not in (None, [int(i) for i in cut]):
        return [f"layer cut {saved['layer_cut']} -> {[int(i) for i in cut]}"]  # e.g. a profile measured anew
    if saved.get("layer_cut") is None and now["partition_method"] != saved["partition_method"]:
        return [f"--partition-method {saved['partition_method']} -> {now['partition_method']}"]
    return []


def save_checkpoint(engine, args, record, step):
    """Every rank writes its files; then rank 0 lists them with their sizes in run.json and points
    `latest` at the folder. Both are replaced atomically, after all files exist: a crash mid-save
    leaves `latest` on the previous, complete checkpoint. Each rank's file also names its parameters in
    the optimizer's order (ZeRO 0 keeps its state by position), so that another layout can read them."""
    import torch.distributed as dist
    tag = f"global_step{step}"
    folder = os.path.join(args.save_dir, tag)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(folder, RUN_FILE)):
        os.remove(os.path.join(folder, RUN_FILE))  # re-saving a tag: incomplete until written again
    from schedules.runtime import universal
    engine.save_checkpoint(args.save_dir, tag=tag, client_state={"step": step, **universal.client_state(engine)},
                           save_latest=False)  # ends in a barrier
    if dist.get_rank() == 0:
        files = {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
                 for d, _, names in sorted(os.walk(folder)) for f in sorted(names) if f != RUN_FILE}
        cut = {"layer_cut": [int(i) for i in engine.module.parts]} if args.pipeline_parallel_size else {}
        _write_atomically(os.path.join(folder, RUN_FILE), json.dumps({**record, **cut, "param_names": True,
                                                                      "step": step, "files": files}))
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


def to_universal(folder, record=None, out=None):
    """Write checkpoint folder `folder`'s universal layout into `out` (default `<folder>/zero`); the names
    written. `record`: what the run wrote in run.json (read here if None; a checkpoint without one, e.g.
    written by another DeepSpeed program, converts as it is, with no split head to merge)."""
    from schedules.runtime import universal
    if record is None and os.path.isfile(os.path.join(folder, RUN_FILE)):
        with open(os.path.join(folder, RUN_FILE)) as f:
            record = json.load(f)
    slices, rename = None, None
    if record and record["model"].get("vocab_parallel"):
        pp = record["pipeline_parallel_size"]
        slices = (record["model"]["layers"] - pp, pp)
    if record and not record["pipeline_parallel_size"]:  # the plain model's names -> its layer list's
        model = _plain_model(record["model"])
        rename = universal.layer_names(model, model.to_layers())
    return universal.convert(folder, slices=slices, out=out, rename=rename)


def _plain_model(model):
    """The non-pipelined model a record describes, on the meta device (its names and shapes only)."""
    from dataclasses import replace

    import torch
    with torch.device("meta"):
        if model["model"] == "deep":
            import deep_model
            return deep_model.get_model(width=model["deep_width"], depth=model["deep_depth"])
        import gptlite
        config = replace(gptlite.MODEL_SIZES[model["model_size"]], n_layer=model["layers"] - 3,
                         **({"block_size": model["block_size"]} if model.get("block_size") else {}))
        return gptlite.GPTlite(config)


def load_checkpoint(engine, args, tag, saved, now):
    """Load checkpoint `tag` (validated, record `saved`) into the engine of a run with record `now`; the
    step it was saved at. Under the layout that wrote it, DeepSpeed's own files; under another, the
    universal layout (converted from them once, by rank 0, into `<tag>/zero`)."""
    import time

    import torch.distributed as dist
    start = time.perf_counter()
    changes = layout_changes(saved, now, cut=engine.module.parts if args.pipeline_parallel_size else None)
    if changes and dist.get_rank() == 0:
        print(f"resuming {tag} under another layout ({', '.join(changes)}): from its universal layout "
              f"(written once, in {tag}/zero)", flush=True)
    step = _load_universal(engine, args, tag, saved, now) if changes else _load_native(engine, args, tag)
    if dist.get_rank() == 0:
        print(f"resumed {tag} in {time.perf_counter() - start:.2f} s", flush=True)
    return step


def _load_native(engine, args, tag):
    path, client_state = engine.load_checkpoint(source_dir(args), tag=tag)
    if path is None:
        raise UsageError(f"--resume: DeepSpeed found no checkpoint {tag} in {source_dir(args)}")
    return client_state["step"]


def _load_universal(engine, args, tag, saved, now):
    import torch
    import torch.distributed as dist

    from schedules.runtime import universal
    folder = os.path.join(source_dir(args), tag)
    try:
        if dist.get_rank() == 0 and not universal.is_converted(folder):
            to_universal(folder, saved)
        dist.barrier()
        if now["schedule"] == "1f1b" and now["zero_stage"] >= 1:  # DeepSpeed's own engine reads it itself
            engine._config.load_universal_checkpoint = True
            try:
                path, _ = engine.load_checkpoint(source_dir(args), tag=tag, load_lr_scheduler_states=False)
            finally:
                engine._config.load_universal_checkpoint = False
            if path is None:
                raise ValueError(f"DeepSpeed found no universal checkpoint {tag}")
        else:
            universal.load(engine, folder, None if args.pipeline_parallel_size else engine.module.to_layers())
        state = torch.load(os.path.join(folder, "mp_rank_00_model_states.pt"), map_location="cpu",
                           weights_only=False)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UsageError(f"--resume: cannot read {folder} under this layout ({one_line(e)}); resume with "
                         f"{_flags_of(saved)}") from None
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps, engine.skipped_steps = state["global_steps"], state["skipped_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
    return saved["step"]


def init_from(engine, args):
    """The weights --export wrote (keyed by the unsplit layer list's names), into this run's layout."""
    import torch

    from schedules.runtime import universal
    try:
        weights = torch.load(args.init_from, map_location="cpu", weights_only=True)
        layers = None if args.pipeline_parallel_size else engine.module.to_layers()
        universal.load_weights(engine, weights, layers)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UsageError(f"--init-from {args.init_from}: {one_line(e)}; pass weights --export wrote for this model") \
            from None
