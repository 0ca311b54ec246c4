"""One process, no pipeline: DeepSpeed's own engine against ours (LeanEngine), and GPTlite's two heads, side by side.

    python scripts/benchmark_one_process.py                       # GPTlite small and GPT-2 small's shape
    python scripts/benchmark_one_process.py --models small:4 --rounds 3 --docs

What `train.py --pipeline-parallel-size 0` runs (forward / engine.backward / engine.step over the micro-batches),
one thread, the shipped ds_config.json at its ZeRO stage 1 and at 0, each on DeepSpeed's engine (deepspeed.initialize)
and on LeanEngine (schedules.initialize; schedules/runtime/lean_engine.py), with GPTlite's default head (`--head
chunked`: the projection inside the loss, a chunk of the vocabulary at a time); and the shipped config on LeanEngine
with the other heads (`--head recompute`: the logits computed again in the backward; `--head linear`: nn.Linear and
F.cross_entropy). Each model's configurations run in rounds,
rotated, every engine built afresh from the same seeded weights and trained on the same micro-batches; a
configuration's figure is the median step over its rounds, its first --warmup steps left out. Prints each one's
median against the shipped config on DeepSpeed's engine, the chunked head's against torch's, each head's peak
activation memory (bytes saved for backward over one micro-batch, the model's and the head's with its loss), and
checks that every configuration ends at the same loss.

A model is SIZE:MICRO_BATCH_SIZE[:CONTEXT] (GPTlite's size, sequences per micro-batch, its context length).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as common  # noqa: E402

# (engine, ZeRO stage, GPTlite's head)
CONFIGS = [("DeepSpeed's engine", 1, "chunked"), ("ours", 1, "chunked"), ("DeepSpeed's engine", 0, "chunked"),
           ("ours", 0, "chunked"), ("ours", 1, "recompute"), ("ours", 1, "linear")]
SHIPPED = CONFIGS[0]  # the reference: the shipped config as DeepSpeed's own engine runs it
HEADS = ("chunked", "recompute", "linear")  # on the engine train.py runs without a pipeline (ours, ZeRO 1)
LOSS_TOLERANCE = 1e-4  # in-place accumulation sums in another order: ~1e-6 apart


def parse_args(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--models", nargs="+", default=["small:4", "gpt2:1:64"],
                   help="SIZE:MICRO_BATCH_SIZE[:CONTEXT] each (GPTlite)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6, help="steps per configuration and round")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each left out")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpu-time", action="store_true",
                   help="time each step by the thread's CPU time instead of the clock: on cores other jobs keep busy, "
                        "what they take from it is left out (what they take from its caches is not)")
    common.add(p, "out", "docs", out="runs/one-process", docs="one-process")
    return p.parse_args(argv)


def model_spec(text):
    size, mbs, *context = text.split(":")
    return {"size": size, "micro_batch_size": int(mbs), "block_size": int(context[0]) if context else None}


def config(zero, spec, micro_batches):
    with open(os.path.join(common.ROOT, "ds_config.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=spec["micro_batch_size"], gradient_accumulation_steps=micro_batches,
               zero_optimization={"stage": zero}, steps_per_print=10**9)
    return cfg


def name_of(config):
    engine, zero, head = config
    return f"{engine}, ZeRO {zero}" + (f", --head {head}" if head != HEADS[0] else "")


def gptlite_model(spec, head):
    import gptlite
    overrides = {"block_size": spec["block_size"]} if spec["block_size"] else {}
    return gptlite.get_model(model_size=spec["size"], seed=0, head=head, **overrides)


def run(engine_name, zero, head, spec, args):
    """(each step's seconds, the last step's loss, the engine's class name) of one configuration, built afresh."""
    import deepspeed
    import torch

    import gptlite
    import schedules
    model, criterion = gptlite_model(spec, head), gptlite.head_loss(head)
    cfg = config(zero, spec, args.micro_batches)
    init = deepspeed.initialize if engine_name == SHIPPED[0] else schedules.initialize
    engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg)
    vocab, context = model.config.vocab_size, model.config.block_size
    g = torch.Generator().manual_seed(0)
    times, loss = [], None
    for _ in range(args.steps):
        batches = [(torch.randint(0, vocab, (spec["micro_batch_size"], context), generator=g),
                    torch.randint(0, vocab, (spec["micro_batch_size"], context), generator=g))
                   for _ in range(args.micro_batches)]
        clock = time.thread_time if args.cpu_time else time.perf_counter
        t0 = clock()
        for x, y in batches:
            loss = criterion(engine(x), y)
            engine.backward(loss)
            engine.step()
        times.append(clock() - t0)
    kind = type(engine).__name__
    del engine, model
    return times, loss.item(), kind


def measure(spec, args):
    """{configuration name: {'step_s', 'steps_s', 'loss', 'engine', 'zero', 'head'}} of one model, over rotated
    rounds."""
    import gc
    seen = {c: [] for c in CONFIGS}
    last = {}
    for r in range(args.rounds):
        for config in common.rotated(CONFIGS, r):
            times, loss, kind = run(*config, spec, args)
            seen[config] += times[args.warmup:]
            last[config] = (loss, kind)
            gc.collect()
            print(f"  round {r + 1}: {name_of(config)}: {statistics.median(times[args.warmup:]) * 1e3:.0f} ms "
                  f"({kind})", flush=True)
    return {name_of(c): {"engine": last[c][1], "zero": c[1], "head": c[2], "step_s": statistics.median(seen[c]),
                         "steps_s": seen[c], "loss": last[c][0]} for c in CONFIGS}


def peak_memory(spec, head):
    """{'model', 'head'}: the most bytes saved for backward over a forward and backward of one micro-batch (the memory
    tracker's count, parameters left out), of the whole model and of its head with the loss alone."""
    import torch

    import gptlite
    from schedules.observe.memory import SavedTensorTracker
    model, criterion = gptlite_model(spec, head), gptlite.head_loss(head)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, model.config.vocab_size, (spec["micro_batch_size"], model.config.block_size),
                          generator=g) for _ in range(2))
    out = {}
    with SavedTensorTracker(ignore=list(model.parameters())) as tracker:
        criterion(model(x), y).backward()
    out["model"] = tracker.peak_bytes
    with torch.no_grad():
        hidden = model.ln_f(run_trunk(model, x))
    hidden.requires_grad_()
    with SavedTensorTracker(ignore=list(model.parameters())) as tracker:
        criterion(model.lm_head(hidden), y).backward()
    out["head"] = tracker.peak_bytes
    return out


def run_trunk(model, x):
    x = model.emb(x)
    for block in model.blocks:
        x = block(x)
    return x


def lines_of(record):
    clock = "ms of CPU time" if record["args"].get("cpu_time") else "ms"
    out = [record["machine"], f"one process, one thread, the shipped ds_config.json at ZeRO 1 and 0; median step "
           f"({clock}), its speed-up over the shipped config on DeepSpeed's engine"]
    for m in record["models"]:
        spec, rows = m["model"], m["rows"]
        ref = rows[name_of(SHIPPED)]
        context = f", context {spec['block_size']}" if spec["block_size"] else ""
        out.append(f"GPTlite {spec['size']}{context}, {record['args']['micro_batches']} micro-batches of "
                   f"{spec['micro_batch_size']}:")
        for name, r in rows.items():
            out.append(f"  {name:42} {r['step_s'] * 1e3:8.0f} ms  {ref['step_s'] / r['step_s']:5.2f}x  "
                       f"loss {r['loss']:.6f}  ({r['engine']})")
        memory, linear = m["memory"], rows[name_of(("ours", 1, "linear"))]
        for head in HEADS:
            r, mem = rows[name_of(("ours", 1, head))], memory[head]
            out.append(f"  --head {head:9}: {linear['step_s'] / r['step_s']:.2f}x torch's head's step; peak saved for "
                       f"backward per micro-batch, the model {mem['model'] / 2**20:5.1f} MiB, its head and loss "
                       f"{mem['head'] / 2**20:5.1f} ({mem['head'] / memory['linear']['head']:.2f} of torch's)")
        losses = [r["loss"] for r in rows.values()]
        spread = max(losses) - min(losses)
        out.append(f"  every configuration ends at the same loss (within {spread:.1e})" if spread <= LOSS_TOLERANCE
                   else f"  warning: the last losses differ by {spread:.1e}: the configurations train differently")
    return out


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    torch.set_num_threads(1)
    started = time.time()
    record = {"machine": common.machine("benchmark_one_process.py", argparse.Namespace(device="cpu")),
              "args": vars(args), "models": []}
    for text in args.models:
        spec = model_spec(text)
        print(f"GPTlite {text}:", flush=True)
        memory = {head: peak_memory(spec, head) for head in HEADS}
        record["models"].append({"model": spec, "rows": measure(spec, args), "memory": memory})
    record["took_s"] = time.time() - started
    lines = lines_of(record) + [f"took {record['took_s']:.0f} s"]
    print("\n".join(lines))
    common.save(args, "one-process", record, lines)


if __name__ == "__main__":
    main()
