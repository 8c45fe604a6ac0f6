"""Where the fused forward's time goes: its kernels timed with one part replaced by a stub.

    python benchmarks/intra_parts.py gdn [--variants base inv_stub ...] [--json out.json]
                                         [--matmul-precision medium] [--knob stored=bfloat16] [--after-fla]

Each variant runs in its own process (Triton caches a kernel with the helpers it was
compiled with) on ``kernels.py``'s case (B8 T2048 H16 K=V=128 bf16) and prints the
milliseconds per call of every Triton kernel of ``chunk_dplr_fwd``. Stubbed variants give
wrong results on purpose: they bound what making that part free would save. The others
also report ``err``: the largest difference of their output from the same variant's with
fp32 between kernels (no ``--knob``), and ``exact``: from the PyTorch chunked path in fp64,
both relative to the largest entry. ``--after-fla`` runs
fla's ``chunk_gated_delta_rule`` once first in each process (session 13's state-kernel fault
appeared only then).

- ``base``: as shipped.
- ``inv_stub``: the UT inverse returns L as loaded (no forward substitution, no block products).
- ``prod_stub``: the decayed products return zeros (no loads, no tensor-core work).
- ``dot1``: ``_dot_ex`` as one TF32 pass instead of two.
- ``merge_ieee`` / ``merge_tf32``: the UT inverse's 16 x 16 block products in exact fp32 (the default) / one
  TF32 pass (``chunk_fwd._KNOBS["merge"]``).
- ``tf32``: every fp32 product in one TF32 pass (``precision`` and ``state_precision``).
- ``w8`` / ``w2``: the intra kernel on 8 / 2 warps.
- ``state_bv32`` / ``state_w8``: the state kernel with a 32-wide value block / 8 warps.
- ``out_bv128`` / ``out_w8``: the output kernel with a 128-wide value block / 8 warps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import triton
import triton.language as tl

VARIANTS = ["base", "inv_stub", "prod_stub", "dot1", "merge_ieee", "merge_tf32", "tf32", "w8", "w2", "state_bv32",
            "state_w8", "out_bv128", "out_w8"]


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
def _tied_products_stub(q, k, Gq, Gk, Gk_ex, i_b, i_h, i_c, T, H: tl.constexpr, K: tl.constexpr, TC: tl.constexpr,
                        GATE: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, LP_QK: tl.constexpr,
                        LP_KK: tl.constexpr):
    return tl.zeros([TC, TC], dtype=tl.float32), tl.zeros([TC, TC], dtype=tl.float32)


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
        cf._tied_products = _tied_products_stub
    elif variant == "dot1":
        cf._dot_ex = _dot1_stub
    elif variant.startswith("merge_"):
        return dict(merge=variant[6:])
    elif variant == "tf32":
        return dict(precision="tf32", state_precision="tf32")
    elif variant in ("w8", "w2"):
        return dict(intra_warps=int(variant[1:]))
    elif variant == "state_bv32":
        cs._LAUNCH["bv"] = 32
    elif variant == "state_w8":
        cs._LAUNCH["warps"] = 8
    elif variant == "out_bv128":
        return dict(output_bv=128)
    elif variant == "out_w8":
        return dict(output_warps=8)
    return {}


STUBS = ("inv_stub", "prod_stub", "dot1")


def _exact(fwd, args, kw):
    """The output of ``fwd(*args, **kw)`` (``chunk_dplr_fwd``) from the PyTorch chunked path in fp64."""
    import inspect

    import torch

    from rankdecay.ops.chunk import chunk_dplr_core

    bound = inspect.signature(fwd).bind(*args, **kw).arguments
    x = {n: None if bound.get(n) is None else bound[n].double() for n in ("q", "k", "v", "a", "b", "g")}
    if bound.get("a_scale") is not None:
        x["a"] = x["a"] * bound["a_scale"].double()[..., None]
    if bound.get("v_scale") is not None:
        x["v"] = x["v"] * bound["v_scale"].double()[..., None]
    h0 = bound.get("initial_state")
    return chunk_dplr_core(*x.values(), bound["scale"], None if h0 is None else h0.double(), torch.float64)[0]


def _one(case_name: str, variant: str, precision: str, knobs: list[str], after_fla: bool) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import rankdecay.ops.triton as rt
    import rankdecay.ops.triton.chunk_fwd as cf
    from kernels import CASES, apply_knobs

    torch.set_float32_matmul_precision(precision)
    cfg = _patch(variant)
    captured = {}
    orig = cf.chunk_dplr_fwd

    def grab(*args, **kw):
        captured["args"], captured["kw"] = args, kw
        return orig(*args, **kw)

    rt.chunk_dplr_fwd = grab
    case = CASES[case_name]
    x = case.make(8, 2048, 16, 128, 128, "cuda", torch.bfloat16)
    if after_fla:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    with torch.no_grad():
        case.ours(x)
    args, kw = captured["args"], dict(captured["kw"])
    ref = orig(*args, **kw)[0].float()
    apply_knobs(knobs)
    kw["_config"] = cfg
    for _ in range(3):
        out = orig(*args, **kw)[0]
    torch.cuda.synchronize()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    exact = _exact(orig, args, kw)
    err_exact = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            orig(*args, **kw)
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / 1e3 / reps for e in prof.key_averages() if e.key.startswith("_")}
    stub = variant in STUBS
    return {"times": times, "err": None if stub else err, "exact": None if stub else err_exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest")
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE",
                        help="chunk_fwd._KNOBS overrides, as kernels.py's --knob")
    parser.add_argument("--after-fla", action="store_true", help="run fla's chunk_gated_delta_rule once first")
    parser.add_argument("--_child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        res = _one(*args._child, args.matmul_precision, args.knob, args.after_fla)
        print("RESULT " + json.dumps(res), flush=True)
        return
    extra = ["--matmul-precision", args.matmul_precision, *(["--knob", *args.knob] if args.knob else []),
             *(["--after-fla"] if args.after_fla else [])]
    results = {}
    for case in args.cases:
        for variant in args.variants:
            proc = subprocess.run([sys.executable, __file__, case, "--_child", case, variant, *extra],
                                  capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{case} {variant}: failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}", flush=True)
                continue
            res = json.loads(lines[-1][7:])
            results[f"{case}/{variant}"] = res
            times = res["times"]
            err = "" if res["err"] is None else f"; err {res['err']:.1e}, exact {res['exact']:.1e}"
            print(f"{case} {variant}: total {sum(times.values()):.3f} ms; "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(times.items())) + err, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
