"""Times the per-channel products (``rankdecay.ops.triton.channel``) alone, under launch-knob variants.

    cd benchmarks && python channel_variants.py [--shape B T H K] [--variants "bk=64" "warps=8,rows=32" ...]

For GLA (M_QK only, 64-token chunks) and HDLA (M_QK, M_QA, L_BA, L_BK; Rab = 2, 16-token chunks),
the forward (``channel_product``, every product) and backward (``channel_product_bwd``) in ms,
bf16 inputs at matmul precision "medium", for each variant of ``channel._CHANNEL`` (comma-separated
NAME=VALUE; log_cumsum=float64 / float32 sets the log-cumsums' dtype). Prints a Markdown table.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from rankdecay.ops.triton import channel
from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum, fused_chunk_size, log_cumsum_dtype
from rankdecay.ops.triton.fused_recurrent import _pow2

CASES = {  # (x rank, y rank, strict, y has row factors) per product
    "gla": (0, [(1, 1, False, False)]),
    "hdla": (2, [(1, 1, False, False), (1, 2, False, True), (2, 2, True, True), (2, 1, True, False)]),
}


def parse(variant: str) -> dict:
    out = {}
    for kv in filter(None, variant.split(",")):
        name, value = kv.split("=")
        if name not in channel._CHANNEL:
            raise SystemExit(f"unknown knob {name}: channel._CHANNEL has {sorted(channel._CHANNEL)}")
        out[name] = getattr(torch, value) if name == "log_cumsum" else int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=4, type=int, default=[8, 2048, 16, 128], metavar=("B", "T", "H", "K"))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--variants", nargs="+", default=[""])
    args = parser.parse_args()
    torch.set_float32_matmul_precision("medium")
    B, T, H, K = args.shape
    default = dict(channel._CHANNEL)
    for variant in args.variants:  # fail before the first measurement
        parse(variant)
    print("| case | variant | fwd ms | bwd ms |\n|---|---|---:|---:|")
    for case in args.cases:
        rab, products = CASES[case]
        TC = fused_chunk_size(rab, 1, per_channel=True)
        for variant in args.variants:
            knobs = parse(variant)
            channel._CHANNEL.clear()
            channel._CHANNEL.update(default, **knobs)
            g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16
            gc = chunk_log_cumsum(g, TC, log_cumsum_dtype("bf16"))  # channel._CHANNEL["log_cumsum"] included
            NC = gc.shape[2]
            calls_f, calls_b = [], []
            for rx, ry, strict, scaled in products:
                x = torch.randn(B, T, H, rx, K, device="cuda", dtype=torch.bfloat16)
                y = torch.randn(B, T, H, ry, K, device="cuda", dtype=torch.bfloat16)
                sy = torch.rand(B, T, H, ry, device="cuda") if scaled else None
                NX, NY = TC * _pow2(rx), TC * _pow2(ry)
                p = torch.empty(B, H, NC, NX, NY, device="cuda", dtype=torch.bfloat16)
                dx = torch.zeros(B, H, NC, NX, K, device="cuda")
                dy = torch.zeros(B, H, NC, NY, K, device="cuda")
                kw = dict(T=T, TC=TC, strict=strict, precision="bf16")
                calls_f.append(lambda x=x, y=y, p=p, sy=sy, kw=kw: channel.channel_product(
                    x, y, gc, p, lowp=True, y_scale=sy, **kw))
                calls_b.append(lambda x=x, y=y, p=p, dx=dx, dy=dy, sy=sy, kw=kw: channel.channel_product_bwd(
                    x, y, gc, p, dx, dy, acc_x=True, acc_y=True, y_scale=sy, **kw))
            fwd = triton.testing.do_bench(lambda: [f() for f in calls_f], warmup=50, rep=200)
            bwd = triton.testing.do_bench(lambda: [f() for f in calls_b], warmup=50, rep=200)
            print(f"| {case} | {variant or 'default'} | {fwd:.3f} | {bwd:.3f} |", flush=True)
    channel._CHANNEL.clear()
    channel._CHANNEL.update(default)


if __name__ == "__main__":
    main()
