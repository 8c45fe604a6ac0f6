"""Errors against fp64 of the Triton path and the PyTorch chunked path under each float32 matmul precision.

    python benchmarks/precision_errors.py [--settings highest high medium] [--shape B T H K V] [--json out.json]

``torch.set_float32_matmul_precision`` sets the precision of the Triton kernels' products
(``rankdecay.ops.triton.chunk_state._precision``) and of the PyTorch path's fp32 matmuls. For bf16
inputs (the realistic-size test's: delta-rule-like DPLR inputs, Rab = Rkv = 1 with a scalar gate,
Rab = 2 with a per-channel gate, Rab = 0 with a per-channel gate), prints the relative RMS error of
the output, the final state and every gradient against the same computation in fp64.
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

CASES = [(1, 1, "scalar"), (2, 1, "channel"), (0, 1, "channel")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["highest", "high", "medium"])
    parser.add_argument("--shape", nargs=5, type=int, metavar=("B", "T", "H", "K", "V"), default=[2, 1000, 4, 128, 128])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    rows = []
    print("| setting | Rab, Rkv, gate | path | " + " | ".join(n for n in ["o", "final_state", "dq", "dk", "dv", "da",
                                                                   "db", "dg", "dh0"]) + " |")
    print("|---|---|---|" + "---:|" * 9)
    for setting in args.settings:
        torch.set_float32_matmul_precision(setting)
        for Rab, Rkv, gate in CASES:
            inputs = random_inputs(*args.shape, Rab, Rkv, gate, dtype=dtype)
            exact = run("chunk", [None if x is None else x.double() for x in inputs])
            for path in ("triton", "chunk"):
                errs = {n: rel_rms(x, e) for n, x, e in zip(names(inputs), run(path, inputs), exact)}
                rows.append(dict(setting=setting, Rab=Rab, Rkv=Rkv, gate=gate, path=path, dtype=str(dtype), **errs))
                cells = " | ".join(f"{errs[n]:.1e}" if n in errs else "—"
                                   for n in ["o", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dh0"])
                print(f"| {setting} | {Rab}, {Rkv}, {gate} | {path} | {cells} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
