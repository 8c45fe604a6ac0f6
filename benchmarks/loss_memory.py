"""Peak memory and time of the LM head's loss, forward and backward: the logits path against
``rankdecay.layers.linear_cross_entropy`` (chunks of tokens, no logits kept).

    python benchmarks/loss_memory.py [--tokens N ...] [--hidden D] [--vocab V] [--dtype float32|bfloat16]
                                     [--device cpu|cuda] [--repeats R] [--paths P ...]
                                     [--vocab-chunk-size W] [--json PATH]

Each (path, N) runs in a process of its own. The memory is what the loss adds to the inputs at its peak: on a
GPU ``torch.cuda.max_memory_allocated`` less what the inputs hold, on the CPU the process's peak resident set
(``ru_maxrss``) after the pass less before it. The time is the median of ``--repeats`` passes after one untimed.
"bfloat16" runs the products under bf16 autocast with fp32 inputs, as a training step does. The paths ending in
"-compile" are the same functions through ``torch.compile`` (as in a compiled training step; the first, untimed pass
compiles).
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


def _run(path: str, N: int, D: int, V: int, dtype: str, device: str, repeats: int, vocab_chunk_size, queue
         ) -> None:
    from rankdecay.layers import linear_cross_entropy

    torch.manual_seed(0)
    x = torch.randn(N, D, device=device, requires_grad=True)
    w = (torch.randn(V, D, device=device) * D ** -0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device=device)
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    if path == "chunked-torch":  # our function with the slices' elementwise work in PyTorch, not Triton
        from rankdecay.layers import loss as loss_module

        loss_module._triton_kernels = lambda x, dtype: False
    if path == "fla":
        from fla.modules import FusedLinearCrossEntropyLoss

        fla_loss = FusedLinearCrossEntropyLoss()

    def loss_fn(x, t, w):
        if path.startswith("logits"):
            return F.cross_entropy(F.linear(x, w).float(), t)
        return linear_cross_entropy(x, t, w, vocab_chunk_size=vocab_chunk_size)

    if path.endswith("-compile"):
        loss_fn = torch.compile(loss_fn)

    def step():
        with amp:
            if path.endswith("-compile"):
                loss = loss_fn(x, t, w)
            elif path == "logits":
                loss = F.cross_entropy(F.linear(x, w).float(), t)
            elif path == "fla":
                loss = fla_loss(x, t, w)
            else:
                loss = linear_cross_entropy(x, t, w, vocab_chunk_size=vocab_chunk_size)
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
               "vocab_chunk_size": vocab_chunk_size,
               "extra_mib": extra / 2 ** 20, "ms": 1e3 * statistics.median(times), "loss": loss})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vocab-chunk-size", type=int, default=None,
                   help="linear_cross_entropy's vocab_chunk_size (default: its default_vocab_chunk_size)")
    p.add_argument("--paths", nargs="+", default=["logits", "chunked"],
                   choices=["logits", "chunked", "chunked-torch", "fla", "logits-compile", "chunked-compile"],
                   help="chunked: rankdecay.layers.linear_cross_entropy; chunked-torch: the same with its slices' "
                        "elementwise work in PyTorch (on a GPU: without its Triton kernels); fla: flash-linear-"
                        "attention's FusedLinearCrossEntropyLoss (installed separately); logits-compile, "
                        "chunked-compile: logits and chunked through torch.compile")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for N in args.tokens:
        for path in args.paths:
            queue = ctx.Queue()
            proc = ctx.Process(target=_run, args=(path, N, args.hidden, args.vocab, args.dtype, args.device,
                                                  args.repeats, args.vocab_chunk_size, queue))
            proc.start()
            proc.join()
            if proc.exitcode:
                print(f"failed: {path} N={N} (exit code {proc.exitcode})", flush=True)
                continue
            rows.append(queue.get())
            print(f"done: {path} N={N}", flush=True)
    print(f"\nD = {args.hidden}, V = {args.vocab}, {args.dtype}, {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; memory in MiB, time in ms, loss difference against the logits path\n")
    print("| tokens | path | memory | time | loss difference |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        ref = next((a for a in rows if a["tokens"] == r["tokens"] and a["path"] == "logits"), None)
        ref = ref or next((a for a in rows if a["tokens"] == r["tokens"] and a["path"] == "logits-compile"), None)
        diff = "" if ref is None else f"{abs(r['loss'] - ref['loss']):.1e}"
        print(f"| {r['tokens']} | {r['path']} | {r['extra_mib']:.0f} | {r['ms']:.1f} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
