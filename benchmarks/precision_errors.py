"""Errors against fp64 of the Triton path and the PyTorch chunked path under each float32 matmul precision.

    python benchmarks/precision_errors.py [--settings highest high medium] [--shape B T H K V] [--json out.json]
                                          [--cases dplr gdn] [--knob stored=bfloat16] [--after-fla]

``torch.set_float32_matmul_precision`` sets the precision of the Triton kernels' products
(``rankdecay.ops.triton.chunk_state._precision``) and of the PyTorch path's fp32 matmuls. For bf16
inputs (the realistic-size test's: delta-rule-like DPLR inputs, Rab = Rkv = 1 with a scalar gate,
Rab = 2 with a per-channel gate, Rab = 0 with a per-channel gate), prints the relative RMS error of
the output, the final state and every gradient against the same computation in fp64; ``gdn``:
Gated DeltaNet itself through ``ops.gated_delta_rule`` (k taken as a and b: the tied kernels).
``--knob``: ``chunk_fwd._KNOBS`` overrides (the tensors between kernels); ``--after-fla``: run fla's
``chunk_gated_delta_rule`` forward and backward once first (BENCHMARKS.md sessions 13-14: a
miscompiled kernel read what fla's kernels had left in shared memory).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import rel_rms  # noqa: E402
from tests.ops.test_triton import names, random_inputs, run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import KNOB_HELP, apply_knobs  # noqa: E402

CASES = [(1, 1, "scalar"), (2, 1, "channel"), (0, 1, "channel")]
COLUMNS = ["o", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dbeta", "dh0"]


def gdn_inputs(B, T, H, K, V, dtype, seed=5):
    """Gated DeltaNet's inputs (q, k, v, g, beta in ``dtype``; h0 fp32), as the GPU test draws them."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3)
    beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return [x.to(dev, dtype) for x in (q, k, v, g, beta)] + [h0.to(dev)]


def gdn_run(mode, inputs, exact=False):
    """o, final state and the gradients of q, k, v, g, beta, h0 through ``ops.gated_delta_rule``."""
    from rankdecay import ops

    xs = [(x.double() if exact else x.clone()).requires_grad_() for x in inputs]
    o, s = ops.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode)
    w = torch.linspace(-1, 1, o.shape[-1], device=o.device, dtype=torch.float64)
    ((o.double() * w).sum() + s.double().sin().sum()).backward()
    return dict(zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], [o, s] + [x.grad for x in xs]))


def run_fla_once():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from kernels import make_gdn

    x = make_gdn(8, 2048, 16, 128, 128, "cuda", torch.bfloat16)
    xs = {n: t.requires_grad_() for n, t in x.items()}
    try:
        chunk_gated_delta_rule(**xs)[0].float().sum().backward()
    except Exception as e:  # fla 0.6.0 refuses this backward on Triton 3.6 / Hopper: the forward has run
        print(f"fla backward: {str(e).splitlines()[0][:100]}")
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["highest", "high", "medium"])
    parser.add_argument("--shape", nargs=5, type=int, metavar=("B", "T", "H", "K", "V"), default=[2, 1000, 4, 128, 128])
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", nargs="+", choices=["dplr", "gdn"], default=["dplr", "gdn"])
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE", help=KNOB_HELP)
    parser.add_argument("--after-fla", action="store_true", help="run fla's chunk_gated_delta_rule once first")
    args = parser.parse_args()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    apply_knobs(args.knob)
    if args.after_fla:
        run_fla_once()
    rows = []
    print("| setting | case | path | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---:|" * len(COLUMNS))

    def report(setting, case, path, errs):
        rows.append(dict(setting=setting, case=case, path=path, dtype=str(dtype), knobs=args.knob, **errs))
        cells = " | ".join(f"{errs[n]:.1e}" if n in errs else "—" for n in COLUMNS)
        print(f"| {setting} | {case} | {path} | {cells} |", flush=True)

    for setting in args.settings:
        torch.set_float32_matmul_precision(setting)
        if "dplr" in args.cases:
            for Rab, Rkv, gate in CASES:
                inputs = random_inputs(*args.shape, Rab, Rkv, gate, dtype=dtype)
                exact = run("chunk", [None if x is None else x.double() for x in inputs])
                for path in ("triton", "chunk"):
                    report(setting, f"{Rab}, {Rkv}, {gate}", path,
                           {n: rel_rms(x, e) for n, x, e in zip(names(inputs), run(path, inputs), exact)})
        if "gdn" in args.cases:
            inputs = gdn_inputs(*args.shape, dtype)
            exact = gdn_run("chunk", inputs, exact=True)
            for path in ("triton", "chunk"):
                report(setting, "gdn", path, {n: rel_rms(x, exact[n]) for n, x in gdn_run(path, inputs).items()})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
