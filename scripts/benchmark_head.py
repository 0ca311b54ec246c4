"""GPTlite's whole vocabulary head and its loss alone, each way of computing them side by side: one micro-batch's
forward and fused backward, one thread, the weight gradient added in place (as LeanEngine does).

    python scripts/benchmark_head.py                                   # GPTlite small and GPT-2 small's shape
    python scripts/benchmark_head.py --shapes 4:64:128 --chunks 1024 2048 4096 8192 --keeps 0 1

A shape is SEQUENCES:TOKENS:WIDTH (the vocabulary: GPT-2's 50257). The heads: `linear` (nn.Linear and
F.cross_entropy, `--head linear`) and the chunked head (schedules/runtime/chunked_head.py) with each --chunks rows per
block and each --keeps share of rows whose exponentials its forward keeps (0: every block's logits computed again
in the backward, GPTlite's default). Rounds alternate the order; a head's figure is its median over the rounds of
the thread's CPU time (what other processes on the cores take from it is left out; what they take from its caches
is not), and its peak activation memory the most bytes the memory tracker counts over one forward and backward.
This is the measurement CHUNK_ROWS comes from. `--device cuda` times each head on the GPU instead (wall clock
between synchronisations; the thread count does not apply) and adds the CUDA allocator's peak above the weights.
"""
import argparse
import statistics
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4:64:128", "1:64:768"], help="SEQUENCES:TOKENS:WIDTH each")
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192], help="rows per block")
    p.add_argument("--keeps", type=float, nargs="+", default=[0.0, 1.0], help="shares of rows kept")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="hidden states and weight")
    return p.parse_args(argv)


def heads(args):
    """{name: (chunk, keep) or None for nn.Linear + F.cross_entropy}."""
    out = {"linear": None}
    for keep in args.keeps:
        for chunk in args.chunks:
            out[f"chunked {chunk} rows, keep {keep:g}"] = (chunk, keep)
    return out


def measure(shape, args, vocab=50257):
    import torch
    import torch.nn.functional as F

    from schedules.observe.memory import SavedTensorTracker
    from schedules.runtime import weight_grad
    from schedules.runtime.chunked_head import linear_cross_entropy
    sequences, tokens, width = shape
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    hidden = F.layer_norm(torch.randn(sequences, tokens, width, generator=g), (width, ))
    hidden = hidden.to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (sequences, tokens), generator=g).to(device)
    head = weight_grad.Linear(width, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=0.02)
    head.to(device, dtype)

    def clock(fn):
        if not cuda:
            t0 = time.thread_time()
            fn()
            return time.thread_time() - t0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def step(how):
        with weight_grad.accumulate_in_place():
            if how is None:
                loss = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
            else:
                loss = linear_cross_entropy(hidden, head.weight, labels, chunk=how[0], keep=how[1])
            loss.backward()
        return loss.item()
    todo = heads(args)
    rows = {}
    for name, how in todo.items():
        step(how)  # warm-up: the weight's gradient buffer and (on a GPU) the kernels exist before measuring
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with SavedTensorTracker(ignore=[head.weight]) as tracker:
            loss = step(how)
        rows[name] = {"peak_bytes": tracker.peak_bytes, "loss": loss, "cpu_s": [],
                      "cuda_peak_bytes": torch.cuda.max_memory_allocated() - base if cuda else None}
    for r in range(args.rounds):
        for name, how in (list(todo.items()) if r % 2 == 0 else list(todo.items())[::-1]):
            rows[name]["cpu_s"].append(clock(lambda: step(how)))
    return rows


def main(argv=None):
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)
    for text in args.shapes:
        shape = tuple(int(v) for v in text.split(":"))
        rows = measure(shape, args)
        ref = rows["linear"]
        base = statistics.median(ref["cpu_s"])
        where = (f"on {torch.cuda.get_device_name()}, {args.dtype} (median wall ms" if args.device == "cuda"
                 else f"one thread, {args.dtype} (median CPU ms")
        print(f"{shape[0]} x {shape[1]} tokens, width {shape[2]}, 50257 rows: forward + backward, {where} over "
              f"{args.rounds} rounds), peak saved MiB, loss - torch's"
              + (", CUDA allocator's peak MiB" if args.device == "cuda" else ""))
        for name, row in rows.items():
            cpu = statistics.median(row["cpu_s"])
            alloc = row["cuda_peak_bytes"]
            print(f"  {name:32} {cpu * 1e3:7.2f} ms {base / cpu:5.2f}x  {row['peak_bytes'] / 2**20:6.1f} MiB "
                  f"({row['peak_bytes'] / ref['peak_bytes']:.2f})  {row['loss'] - ref['loss']:+.1e}"
                  + (f"  {alloc / 2**20:7.1f} ({alloc / ref['cuda_peak_bytes']:.2f})" if alloc is not None else ""),
                  flush=True)


if __name__ == "__main__":
    main()
