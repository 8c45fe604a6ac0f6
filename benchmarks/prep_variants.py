"""The chunk log-cumsum kernel alone and with PREP (GLA's Q̃, K̃, e^{G_C}) under launch knobs.

    python benchmarks/prep_variants.py [--shape B T H K] [--chunk 64]

Times ``chunk_log_cumsum`` (fp32 log-cumsums, bf16 q and k, as at matmul precision "medium") for
every (key block, warps) pair, plain and with PREP; prints a Markdown table of microseconds.
"""
from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

import rankdecay.ops.triton.chunk_fwd as cf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=4, type=int, default=[8, 2048, 16, 128], metavar=("B", "T", "H", "K"))
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    B, T, H, K = args.shape
    C = args.chunk
    dev = dict(device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, **dev)) / 16
    q, k = torch.randn(B, T, H, K, **dev), torch.randn(B, T, H, 1, K, **dev)  # k: rank 1
    NC = -(-T // C)
    qd, kd = (torch.empty(B, H, NC, C, K, **dev) for _ in range(2))
    dch = torch.empty(B, H, NC, K, device="cuda", dtype=torch.float32)
    print("| kernel | key block | warps | µs |\n|---|---:|---:|---:|")
    for mode, bk, warps in itertools.product(("plain", "prep"), (16, 32, 64, 128), (1, 2, 4, 8)):
        cf._LOG_CUMSUM.setdefault(C, dict(cf._LOG_CUMSUM[64]))[mode] = (bk, warps)
        prep = (q, k, qd, kd, dch, 0.1) if mode == "prep" else None
        us = 1e3 * do_bench(lambda: cf.chunk_log_cumsum(g, C, torch.float32, prep=prep), warmup=5, rep=40)
        print(f"| {mode} | {bk} | {warps} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
