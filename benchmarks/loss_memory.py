"""Peak memory and time of the LM head's loss, forward and backward: the logits path against
``rankdecay.layers.linear_cross_entropy`` (chunks of tokens, no logits kept).

    python benchmarks/loss_memory.py [--tokens N ...] [--hidden D] [--vocab V] [--dtype float32|bfloat16]
                                     [--device cpu|cuda] [--repeats R] [--json PATH]

Each (path, N) runs in a process of its own. The memory is what the loss adds to the inputs at its peak: on a
GPU ``torch.cuda.max_memory_allocated`` less what the inputs hold, on the CPU the process's peak resident set
(``ru_maxrss``) after the pass less before it. The time is the median of ``--repeats`` passes after one untimed.
"bfloat16" runs the products under bf16 autocast with fp32 inputs, as a training step does.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time

import torch
import torch.nn.functional as F


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _run(path: str, N: int, D: int, V: int, dtype: str, device: str, repeats: int, queue) -> None:
    from rankdecay.layers import linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(N, D, device=device, requires_grad=True)
    w = (torch.randn(V, D, device=device) * D ** -0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def step():
        with amp:
            if path == "logits":
                loss = F.cross_entropy(F.linear(x, w).float(), t)
            else:
                loss = linear_cross_entropy(x, t, w)
        loss.backward()
        x.grad = w.grad = None
        return loss

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    before = _peak_rss()
    loss = step().item()
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        extra = _peak_rss() - before
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    queue.put({"path": path, "tokens": N, "hidden": D, "vocab": V, "dtype": dtype, "device": device,
               "extra_mib": extra / 2 ** 20, "ms": 1e3 * statistics.median(times), "loss": loss})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for N in args.tokens:
        for path in ("logits", "chunked"):
            queue = ctx.Queue()
            proc = ctx.Process(target=_run, args=(path, N, args.hidden, args.vocab, args.dtype, args.device,
                                                  args.repeats, queue))
            proc.start()
            rows.append(queue.get())
            proc.join()
            print(f"done: {path} N={N}", flush=True)
    print(f"\nD = {args.hidden}, V = {args.vocab}, {args.dtype}, {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| tokens | logits path: MiB | chunked: MiB | logits path: ms | chunked: ms | loss difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for N in args.tokens:
        a, b = (next(r for r in rows if r["tokens"] == N and r["path"] == k) for k in ("logits", "chunked"))
        print(f"| {N} | {a['extra_mib']:.0f} | {b['extra_mib']:.0f} | {a['ms']:.0f} | {b['ms']:.0f} | "
              f"{abs(a['loss'] - b['loss']):.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
