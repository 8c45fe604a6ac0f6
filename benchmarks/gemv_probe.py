"""Would a Triton matrix-vector product beat cuBLAS in a decode step? (GPU, CUDA graph)

    python benchmarks/gemv_probe.py [--rows 1] [--preset 340m | 1.3b] [--grid wide | narrow] [--kernel gemv | dot]

For a preset's four decode products per layer (340m: packed input maps 3080 x 1024, output 1024 x 1024, packed
SwiGLU 5632 x 1024, down 1024 x 2816; 1.3b: twice as wide), 24 distinct weights each (more bytes than L2 holds),
one CUDA graph of the 24 products: µs per product for ``F.linear`` (cuBLAS) and for a plain Triton kernel under a
sweep of launches. The kernel here takes several rows (``--rows``); the library's (``rankdecay.ops.triton.gemv``)
is its one-row case at the launch that won here.
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _dot_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, K_SPLIT,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # y[split] = x[:, split's K] W[n block, split's K]^T on the tensor cores (all M rows in one tile), fp32
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in tl.range(split * K_SPLIT, tl.minimum(K, (split + 1) * K_SPLIT), BLOCK_K, num_stages=STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                    other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + split * M * N + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _splits_sum_kernel(p_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * MN + i, mask=i < MN, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=i < MN)


def dot(x, w, block_n, block_k, splits, warps, stages):
    """The tensor-core form: one [rows, BLOCK_N] tile a program, K split over ``splits`` programs (fp32 partials
    summed by a second kernel)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _dot_kernel[(triton.cdiv(N, block_n), splits)](x, w, out, M, N, K, x.stride(0), w.stride(0), N, k_split,
                                                   BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                                   BLOCK_K=block_k, STAGES=stages, num_warps=warps)
    if splits > 1:
        _splits_sum_kernel[(triton.cdiv(M * N, 1024),)](out, y, M * N, SPLITS=splits, BLOCK=1024)
    return y


def gemv(x, w, block_n, block_k, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                             BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def graph_us(fn, reps=20, rounds=15) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--preset", choices=["340m", "1.3b"], default="340m")
    p.add_argument("--grid", choices=["wide", "narrow"], default="wide",
                   help="narrow: the launches that won at 340m's shapes and their neighbours")
    p.add_argument("--kernel", choices=["gemv", "dot"], default="gemv",
                   help="dot: tiles of every row on the tensor cores, K split over programs (for 16-64 rows)")
    args = p.parse_args()
    shapes = {"340m": [(3080, 1024), (1024, 1024), (5632, 1024), (1024, 2816)],
              "1.3b": [(6160, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]}[args.preset]
    grid = (list(itertools.product([1, 2, 4], [512, 1024], [1, 2, 4], [1, 3])) if args.grid == "wide"
            else list(itertools.product([1, 2, 4], [1024, 2048], [1, 2], [3])))
    run = gemv
    if args.kernel == "dot":  # (BLOCK_N, BLOCK_K, splits, warps, stages)
        grid = list(itertools.product([16, 32, 64], [128, 256], [1, 2, 4], [4], [3, 4]))
        run = dot
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, rows {args.rows}")
    columns = "BN, BK, splits, warps, stages" if args.kernel == "dot" else "BN, BK, warps, stages"
    print(f"| N x K | MB | cuBLAS µs | best Triton µs | launch ({columns}) | Triton TB/s |")
    print("|---|---:|---:|---:|---|---:|")
    for N, K in shapes:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        base = graph_us(lambda: [F.linear(x, w) for w in ws]) / args.layers  # noqa: B023
        best = (float("inf"), None)
        for launch in grid:
            if launch[1] > triton.next_power_of_2(K):
                continue
            try:
                got = run(x, ws[0], *launch).float()
            except triton.runtime.errors.OutOfResources:  # the tiles' stages need more shared memory than there is
                continue
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()):
                print(f"  wrong result at {launch}")
                continue
            us = graph_us(lambda: [run(x, w, *launch) for w in ws]) / args.layers  # noqa: B023
            best = min(best, (us, launch))
        mb = N * K * 2 / 1e6
        print(f"| {N} x {K} | {mb:.1f} | {base:.2f} | {best[0]:.2f} | {best[1]} | {mb / best[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
