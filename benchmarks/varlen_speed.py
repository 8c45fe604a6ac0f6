"""Packed sequences (``cu_seqlens``) on the GPU kernels: milliseconds against the same tokens as one sequence.

    python benchmarks/varlen_speed.py [--mechanisms gdn hdla hh-gdn kda rank5] [--windows 8] [--window 2048]
                                      [--mean-doc 600] [--matmul-precision highest] [--decode] [--json out.json]

The batch is what ``rankdecay train --pack varlen`` makes: ``--windows`` windows of ``--window`` tokens along one
row, cut at every window and at every document's end (documents of geometric lengths, mean ``--mean-doc``), so
each window holds several sequences. Each mechanism runs forward and forward+backward (bf16, H=16, K=V=128 unless
told) with those ``cu_seqlens``, and without them on the same tokens (one sequence: no restart, the floor). The
table also gives the tokens the fused kernels walk (the sequences laid from multiples of 64 tokens) and what a
layout padding every sequence to the longest would walk (N x max length). With ``--decode``, the decode kernels
(``mode="fused_recurrent"``: each sequence walked token by token where it lies, a prefill of many prompts) forward
only. ``rank5``: ``dplr`` with a rank-5 decay, ranks above the fused kernels' 4: the unfused path.
"""
from __future__ import annotations

import argparse
import json
import random

import torch
import torch.nn.functional as F

from rankdecay import ops

try:
    from benchmarks.kernels import bench
except ImportError:  # run from benchmarks/
    from kernels import bench


def boundaries(windows: int, window: int, mean_doc: float, seed: int) -> list[int]:
    """cu_seqlens of ``windows`` windows of ``window`` tokens cut at documents' ends (geometric lengths)."""
    rng = random.Random(seed)
    T = windows * window
    cuts, t = set(range(0, T, window)), 0
    while t < T:
        t += 1 + int(rng.expovariate(1 / mean_doc))
        if t < T:
            cuts.add(t)
    return sorted(cuts) + [T]


def inputs(mechanism: str, T: int, H: int, K: int, V: int, dtype) -> dict:
    dev = "cuda"
    q = torch.randn(1, T, H, K, device=dev, dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, device=dev, dtype=dtype)
    beta = torch.rand(1, T, H, device=dev, dtype=dtype)
    if mechanism in ("hdla", "kda"):
        g = F.logsigmoid(torch.randn(1, T, H, K, device=dev) + 3)
    else:
        g = F.logsigmoid(torch.randn(1, T, H, device=dev) + 3)
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    if mechanism == "hh-gdn":
        x["mask"] = ops.head_in_head_mask(torch.rand(H, 4, 4, device=dev) + 0.5)
    if mechanism == "rank5":  # a rank-5 decay (the unfused path): beta's share of k in 5 rows, against k rolled
        x["rows"] = torch.rand(1, T, H, 5, 1, device=dev, dtype=dtype) / 5
    return x


def call(mechanism: str, x: dict, cu, mode: str = "auto"):
    if mechanism == "gdn":
        return ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, mode=mode)[0]
    if mechanism == "hdla":
        return ops.hdla(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, mode=mode)[0]
    if mechanism == "kda":
        return ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, mode=mode)[0]
    if mechanism == "hh-gdn":
        return ops.hh_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["mask"], x["g"], cu_seqlens=cu, mode=mode)[0]
    if mechanism == "rank5":
        a = x["rows"] * x["k"][..., None, :] * x["beta"][..., None, None]
        b = torch.stack([x["k"].roll(j, -1) for j in range(5)], 3)
        return ops.dplr(x["q"], x["k"], x["v"], a, b, x["g"], cu_seqlens=cu, mode=mode)[0]
    raise ValueError(f"--mechanisms: gdn, hdla, kda, hh-gdn or rank5, got {mechanism!r}")


def timed(mechanism: str, x: dict, cu, decode: bool = False) -> tuple[float, float | None]:
    with torch.no_grad():
        fwd = bench(lambda: call(mechanism, x, cu, "fused_recurrent" if decode else "auto"))["ms"]
    if decode:
        return fwd, None
    leaves = {n: t.detach().requires_grad_(t.is_floating_point() and n not in ("mask", "rows")) for n, t in x.items()}
    do = torch.randn_like(x["v"])

    def step():
        call(mechanism, leaves, cu).backward(do)

    return fwd, bench(step)["ms"]


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", nargs="+", default=["gdn", "hdla", "kda", "hh-gdn"])
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--mean-doc", type=float, default=600)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                   help="torch.set_float32_matmul_precision, as benchmarks/kernels.py takes it")
    p.add_argument("--decode", action="store_true", help="the decode kernels (mode='fused_recurrent'), forward only")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_float32_matmul_precision(a.matmul_precision)
    cu_list = boundaries(a.windows, a.window, a.mean_doc, a.seed)
    lengths = [e - s for s, e in zip(cu_list[:-1], cu_list[1:])]
    T, N = cu_list[-1], len(lengths)
    aligned = sum(-(-n // 64) * 64 for n in lengths)
    cu = torch.tensor(cu_list, device="cuda", dtype=torch.int32)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, matmul precision {a.matmul_precision}"
          f"{', decode kernels' if a.decode else ''}; T = "
          f"{T} tokens in {N} sequences (longest {max(lengths)}): {aligned} tokens from multiples of 64, "
          f"{N * max(lengths)} padded to the longest")
    rows = []
    for m in a.mechanisms:
        x = inputs(m, T, a.heads, a.head_dim, a.head_dim, torch.bfloat16)
        packed, whole = timed(m, x, cu, a.decode), timed(m, x, None, a.decode)
        rows.append(dict(mechanism=m, T=T, N=N, fwd_ms=packed[0], fwd_bwd_ms=packed[1], one_sequence_fwd_ms=whole[0],
                         one_sequence_fwd_bwd_ms=whole[1]))
        print(f"{m}: packed {_ms(packed[0])} / {_ms(packed[1])} ms, one sequence {_ms(whole[0])} / {_ms(whole[1])} ms",
              flush=True)
    print("\n| mechanism | cu_seqlens fwd | fwd+bwd | one sequence fwd | fwd+bwd |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mechanism']} | {_ms(r['fwd_ms'])} | {_ms(r['fwd_bwd_ms'])} | {_ms(r['one_sequence_fwd_ms'])} | "
              f"{_ms(r['one_sequence_fwd_bwd_ms'])} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cu_seqlens=cu_list, aligned_tokens=aligned, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
