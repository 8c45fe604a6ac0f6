"""CPU figures of the engine: chunked vs naive time, and memory growth in T.

    python benchmarks/engine_cpu.py [--T 2048] [--repeats 3] [--json out.json]

Times `gated_delta_rule` and `hdla` at B=1, H=4, K=V=64, fp32, forward and
forward+backward, in mode="naive" and mode="chunk"; then the memory of
chunk-mode forward+backward at T=2048 and T=8192: the bytes autograd keeps for
backward (exact, from saved-tensor hooks) and the process's peak RSS growth
(measured in a fresh subprocess per T).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from rankdecay.ops import gated_delta_rule, hdla

OPS = {"gated_delta_rule": (gated_delta_rule, False), "hdla": (hdla, True)}


def inputs(op: str, B: int, T: int, H: int, K: int, V: int, requires_grad: bool):
    per_channel = OPS[op][1]
    x = [torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1), torch.randn(B, T, H, V),
         F.logsigmoid(torch.randn(B, T, H, *((K,) if per_channel else ()))), torch.rand(B, T, H)]
    return [t.requires_grad_(requires_grad) for t in x]


def run_once(op: str, mode: str, x, backward: bool) -> float:
    fn = OPS[op][0]
    start = time.perf_counter()
    o, _ = fn(*x, mode=mode)
    if backward:
        o.sum().backward()
    return time.perf_counter() - start


def timing(op: str, mode: str, T: int, backward: bool, repeats: int) -> float:
    x = inputs(op, 1, T, 4, 64, 64, backward)
    run_once(op, mode, x, backward)  # warm-up
    return min(run_once(op, mode, x, backward) for _ in range(repeats))


def saved_bytes(op: str, T: int) -> int:
    x = inputs(op, 1, T, 4, 64, 64, True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        OPS[op][0](*x, mode="chunk")
    return sum(storages.values())


def peak_rss_growth(op: str, T: int) -> int:
    """Peak RSS during forward+backward minus the RSS before it, in a fresh process (Linux).

    The kernel's high-water mark is reset first (/proc/self/clear_refs), so the
    transient peak of importing torch does not hide the run's own.
    """
    code = (
        "import re, torch, benchmarks.engine_cpu as b\n"
        "def status(key):\n"
        "    return int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
        f"x = b.inputs({op!r}, 1, {T}, 4, 64, 64, True)\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = status('VmRSS')\n"
        f"o, _ = b.OPS[{op!r}][0](*x, mode='chunk'); o.sum().backward()\n"
        "print(status('VmHWM') - base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "time_ms": {}, "memory": {}}
    print(f"B=1 T={args.T} H=4 K=V=64 fp32, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| op | pass | naive ms | chunk ms | speedup |\n|---|---|---|---|---|")
    for op in OPS:
        for backward in (False, True):
            naive = timing(op, "naive", args.T, backward, args.repeats) * 1e3
            chunk = timing(op, "chunk", args.T, backward, args.repeats) * 1e3
            name = "fwd+bwd" if backward else "fwd"
            results["time_ms"][f"{op}/{name}"] = {"naive": naive, "chunk": chunk}
            print(f"| {op} | {name} | {naive:.1f} | {chunk:.1f} | {naive / chunk:.1f}x |", flush=True)
    print("\nchunk-mode forward+backward memory, B=1 H=4 K=V=64 fp32\n")
    print("| op | T | saved for backward (MB) | peak RSS growth (MB) |\n|---|---|---|---|")
    for op in OPS:
        for T in (2048, 8192):
            saved, rss = saved_bytes(op, T), peak_rss_growth(op, T)
            results["memory"][f"{op}/{T}"] = {"saved_bytes": saved, "peak_rss_growth_bytes": rss}
            print(f"| {op} | {T} | {saved / 2**20:.1f} | {rss / 2**20:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
