"""Where the fused forward's time goes: its kernels timed with one part replaced by a stub.

    python benchmarks/intra_parts.py gdn [--variants base inv_stub ...] [--json out.json]

Each variant runs in its own process (Triton caches a kernel with the helpers it was
compiled with) on ``kernels.py``'s case (B8 T2048 H16 K=V=128 bf16) and prints the
milliseconds per call of every Triton kernel of ``chunk_dplr_fwd``. Stubbed variants give
wrong results on purpose: they bound what making that part free would save.

- ``base``: as shipped.
- ``inv_stub``: the UT inverse returns L as loaded (no forward substitution, no block products).
- ``prod_stub``: the decayed products return zeros (no loads, no tensor-core work).
- ``dot1``: ``_dot_ex`` as one TF32 pass instead of two.
- ``tf32``: every fp32 product in one TF32 pass (``precision`` and ``state_precision``).
- ``w8`` / ``w2``: the intra kernel on 8 / 2 warps.
- ``state_bv64`` / ``state_w8``: the state kernel with a 64-wide value block / 8 warps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import triton
import triton.language as tl

VARIANTS = ["base", "inv_stub", "prod_stub", "dot1", "tf32", "w8", "w2", "state_bv64", "state_w8"]


@triton.jit
def _inverse_stub(lptr, sptr, N: tl.constexpr):
    r = tl.arange(0, N)
    return tl.load(lptr + r[:, None] * N + r[None, :])


@triton.jit
def _products_stub(x, y, g, Gx, Gy, i_b, i_h, i_c, T, H: tl.constexpr, K: tl.constexpr, KG: tl.constexpr,
                   TC: tl.constexpr, RX: tl.constexpr, RXP: tl.constexpr, RY: tl.constexpr, RYP: tl.constexpr,
                   STRICT: tl.constexpr, GATE: tl.constexpr, LEVELS: tl.constexpr, BK: tl.constexpr,
                   PRECISION: tl.constexpr, LP: tl.constexpr):
    return tl.zeros([TC * RXP, TC * RYP], dtype=tl.float32)


@triton.jit
def _dot1_stub(X, Y, PRECISION: tl.constexpr, EXACT: tl.constexpr):
    return tl.dot(X, Y, input_precision="tf32")


def _patch(variant: str) -> dict:
    """Apply one variant's stub; return the ``_config`` overrides of ``chunk_dplr_fwd``."""
    import rankdecay.ops.triton.chunk_fwd as cf
    import rankdecay.ops.triton.chunk_state as cs

    if variant == "inv_stub":
        cf._unit_lower_inverse = _inverse_stub
    elif variant == "prod_stub":
        cf._products = _products_stub
    elif variant == "dot1":
        cf._dot_ex = _dot1_stub
    elif variant == "tf32":
        return dict(precision="tf32", state_precision="tf32")
    elif variant in ("w8", "w2"):
        return dict(intra_warps=int(variant[1:]))
    elif variant == "state_bv64":
        cs._LAUNCH["bv"] = 64
    elif variant == "state_w8":
        cs._LAUNCH["warps"] = 8
    return {}


def _one(case_name: str, variant: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import rankdecay.ops.triton as rt
    import rankdecay.ops.triton.chunk_fwd as cf
    from kernels import CASES

    cfg = _patch(variant)
    captured = {}
    orig = cf.chunk_dplr_fwd

    def grab(*args, **kw):
        captured["args"], captured["kw"] = args, kw
        return orig(*args, **kw)

    rt.chunk_dplr_fwd = grab
    case = CASES[case_name]
    x = case.make(8, 2048, 16, 128, 128, "cuda", torch.bfloat16)
    with torch.no_grad():
        case.ours(x)
    args, kw = captured["args"], dict(captured["kw"])
    kw["_config"] = cfg
    for _ in range(3):
        orig(*args, **kw)
    torch.cuda.synchronize()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            orig(*args, **kw)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 1e3 / reps for e in prof.key_averages() if e.key.startswith("_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--_child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print("RESULT " + json.dumps(_one(*args._child)), flush=True)
        return
    results = {}
    for case in args.cases:
        for variant in args.variants:
            proc = subprocess.run([sys.executable, __file__, case, "--_child", case, variant],
                                  capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{case} {variant}: failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}", flush=True)
                continue
            times = json.loads(lines[-1][7:])
            results[f"{case}/{variant}"] = times
            print(f"{case} {variant}: total {sum(times.values()):.3f} ms; "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(times.items())), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
