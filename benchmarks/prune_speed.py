"""Sequence-mixer forward speed-up and peak memory of pruned Gated DeltaNet layers (state-reduction Table 2).

    python benchmarks/prune_speed.py [--batches 8 16 32] [--ratios 0.5 0.75] [--json out.json]

Gated DeltaNet 1.3B-shaped mixers (hidden 2048, 16 heads, d_v = 128, T = 2048, bf16 on CUDA;
fp32 on CPU): the layer at head_k_dim 128 and at the pruned sizes 128 (1 - ratio). Pruning only
changes head_k_dim, so the pruned layer is built at that size (weights do not affect speed).
Median of --repeats forward passes under no_grad, after warm-up; peak memory of one forward
(minus the input) on CUDA.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rankdecay.layers import GatedDeltaNet


def measure(K: int, B: int, T: int, device, dtype, repeats: int) -> tuple[float, float | None]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(2048, 16, head_k_dim=K, head_v_dim=128, scale=128 ** -0.5).to(device, dtype).eval()
    x = torch.randn(B, T, 2048, device=device, dtype=dtype)
    times, peak = [], None
    with torch.no_grad():
        for i in range(repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
                if i == repeats + 1:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            layer(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return 1e3 * statistics.median(times[1:repeats + 1]), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[8, 16, 32])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}, {dtype}, T={args.seq_len}, hidden 2048, 16 heads, d_v 128")
    rows = []
    print("| B | pruned | head_k_dim | ms | speed-up | peak MB | memory |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for B in args.batches:
        base_ms, base_mem = measure(128, B, args.seq_len, device, dtype, args.repeats)
        for ratio in [0.0] + args.ratios:
            K = round(128 * (1 - ratio))
            ms, mem = (base_ms, base_mem) if ratio == 0 else measure(K, B, args.seq_len, device, dtype, args.repeats)
            row = {"batch": B, "ratio": ratio, "head_k_dim": K, "ms": ms, "speedup": base_ms / ms, "peak_mb": mem,
                   "mem_ratio": mem / base_mem if mem else None, "device": name, "torch": torch.__version__}
            rows.append(row)
            memtxt = f"{mem:.0f} | {row['mem_ratio']:.2f}x" if mem else "- | -"
            print(f"| {B} | {ratio:.0%} | {K} | {ms:.2f} | {row['speedup']:.2f}x | {memtxt} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
