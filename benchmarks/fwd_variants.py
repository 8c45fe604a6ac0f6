"""Fused-forward variants on one GPU: the three kernels of ``chunk_dplr_fwd`` timed under launch knobs.

    python benchmarks/fwd_variants.py gdn gla     (writes $OUT/fwd_exp.json, or ./fwd_exp.json)

Captures the canonical inputs of one case of ``kernels.py`` and times ``chunk_dplr_fwd`` with
the intra kernel on 4 or 8 warps, every product in plain ``tf32`` (inexact: a speed bound), and
without the 16-bit products; then profiles the default per kernel.
"""
import sys, json, torch
sys.path.insert(0, "benchmarks")
from kernels import CASES
import rankdecay.ops.triton as rt
import rankdecay.ops.triton.chunk_fwd as cf
from torch.profiler import profile, ProfilerActivity

captured = {}
orig = cf.chunk_dplr_fwd
def grab(*a, **k):
    captured["args"] = a
    return orig(*a, **k)
rt.chunk_dplr_fwd = grab

def bench(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]

res = {}
for case in sys.argv[1:]:
    c = CASES[case]
    x = c.make(8, 2048, 16, 128, 128, "cuda", torch.bfloat16)
    with torch.no_grad():
        c.ours(x)
    args = captured["args"]
    print(case, [None if t is None or not hasattr(t, "dtype") else (t.dtype, tuple(t.shape)) for t in args[:6]], flush=True)
    variants = {"base": {}, "w4": dict(intra_warps=4), "w8": dict(intra_warps=8), "tf32": dict(precision="tf32", state_precision="tf32"),
                "state_tf32": dict(state_precision="tf32")}
    for name, cfg in variants.items():
        try:
            ms = bench(lambda: orig(*args, _config=cfg))
        except Exception as ex:
            ms = repr(ex)[:200]
        res[f"{case}/{name}"] = ms
        print(case, name, ms, flush=True)
    if args[1].dtype != torch.float32:
        a2 = list(args); a2[1] = a2[1].float()
        if a2[4] is not None: a2[4] = a2[4].float()
        ms = bench(lambda: orig(*a2)); res[f"{case}/no_lowp"] = ms; print(case, "no_lowp", ms, flush=True)
    ms = bench(lambda: c.ours(x)); res[f"{case}/full_op"] = ms; print(case, "full op", ms, flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): orig(*args)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40), flush=True)
import os
json.dump(res, open(os.environ.get("OUT", ".") + "/fwd_exp.json", "w"), indent=1)
