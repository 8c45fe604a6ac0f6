"""What one matrix-vector product per shared input would save in a decode step (GPU, CUDA graph).

    python benchmarks/packed_projections.py [--batches 1 64] [--layers 24]

The 340m preset's decode-step projections alone, layer after layer, recorded as one CUDA graph: the mixer's
input projections (q, k, v, output gate, β, α: six products of the same x), the output projection, the
SwiGLU's gate and up projections (two of the same x) and its down projection. ``separate`` takes them one
product each, as the model does; ``packed`` takes each group that reads the same x as one product against the
concatenated weights, then splits the result. Prints µs per step (median of --rounds replays of --reps steps).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    D, L = args.hidden, args.layers
    H, K, V, inter = 4, 128, 256, 256 * -(-int(D * 8 / 3) // 256)
    widths = [H * K, H * K, H * V, H * V, H, H]  # q, k, v, g, beta, alpha
    dev, dt = "cuda", torch.bfloat16
    w_in = [[torch.randn(n, D, device=dev, dtype=dt) / D ** 0.5 for n in widths] for _ in range(L)]
    w_o = [torch.randn(D, H * V, device=dev, dtype=dt) / D ** 0.5 for _ in range(L)]
    w_gu = [[torch.randn(inter, D, device=dev, dtype=dt) / D ** 0.5 for _ in range(2)] for _ in range(L)]
    w_dn = [torch.randn(D, inter, device=dev, dtype=dt) / inter ** 0.5 for _ in range(L)]
    p_in = [torch.cat(ws) for ws in w_in]
    p_gu = [torch.cat(ws) for ws in w_gu]

    def step(x, packed):
        for i in range(L):
            if packed:
                q, k, v, g, b, a = F.linear(x, p_in[i]).split(widths, -1)
            else:
                q, k, v, g, b, a = (F.linear(x, w) for w in w_in[i])
            h = F.linear(v * g, w_o[i])  # stand-in for the mixer's output
            x = x + h
            if packed:
                gate, up = F.linear(x, p_gu[i]).split(inter, -1)
            else:
                gate, up = (F.linear(x, w) for w in w_gu[i])
            x = x + F.linear(F.silu(gate) * up, w_dn[i])
        return x

    print(f"| B | separate µs | packed µs | saved |\n|---:|---:|---:|---:|")
    for B in args.batches:
        x0 = torch.randn(B, D, device=dev, dtype=dt)
        res = {}
        for packed in (False, True):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step(x0, packed)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(x0, packed)
            times = []
            for _ in range(args.rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.reps):
                    g.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.reps)
            res[packed] = statistics.median(times)
        print(f"| {B} | {res[False]:.1f} | {res[True]:.1f} | {res[False] - res[True]:.1f} |")


if __name__ == "__main__":
    main()
