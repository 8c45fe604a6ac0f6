"""Registers, spills and shared memory of the fused kernels on Hopper, compiled on this machine.

    python benchmarks/sm90_resources.py [--shape B T H K V] [--knob NAME=VALUE ...]
    python benchmarks/sm90_resources.py --backward {gdn,hh-gdn,hh-gdn-token,hdla,hdla-fwd,kda,kda-fwd}
        [--shape B T H K V]
        [--knob ch_bk=32 fwd_state_stages=1 bwd_inputs=4 ...]
    python benchmarks/sm90_resources.py --decode [--shape B T H K V]

No GPU needed: runs ``chunk_fwd.chunk_dplr_fwd`` for Gated DeltaNet (tied keys, bf16 inputs, the "medium"
precision, outputs from the state kernel, no backward: the scaled form) on CPU tensors with its Triton
launches captured instead of run, compiles each captured launch for sm_90 (``triton.compile`` on an
``ASTSource`` with ``GPUTarget("cuda", 90, 32)``), and reads the cubin's resource usage with the
``cuobjdump`` that Triton ships. A launch's knobs (``chunk_fwd._KNOBS``: intra_warps, intra_maxnreg,
state_stages, scaled, merge, ...) change what is compiled. Install the Triton version of the GPU you
compare with (the H100 image: 3.6.0); register counts differ between versions.

``--backward``: the kernels of training instead, ``chunk_dplr_fwd(save=True)``'s and then ``chunk_bwd._backward``'s
(every launch captured, so nothing runs), for Gated DeltaNet (tied keys), Head-in-Head Gated DeltaNet r = 4 (a
static mask, or one per token), HDLA (as ``chunk_bwd._HDLA`` runs them) or KDA (as ``ops.kda`` runs them;
``hdla-fwd`` and ``kda-fwd``: their forwards without autograd alone), with bf16 inputs and products, as ``kernels.py
--matmul-precision medium`` times them. Of several launches of one kernel the last is kept (KDA's two per-channel
products with ``--knob kda_pair=0``: L_BK's; by default they take one kernel), but each MODE of a kernel that takes
one (HDLA's products in one product, then by levels) is kept apart. The spill bytes come from ``ptxas -v`` on the
kernel's PTX. (Session 36, Head-in-Head's step 4: 340 bytes of spill stores with its rows a and b
formed in the kernel, where the H100 counted 70 spilled registers and 2.22 ms; 84 for the general rows, 6 and
1.81 ms there; 36 with a and b read and their gradients carried on in the kernel, as now.)

``--decode``: the decode kernel's launches instead (``fused_recurrent``: the delta rule's kernel as Gated DeltaNet's,
KDA's, HDLA's, Gated DeltaProduct's and Head-in-Head's steps call it, with an fp32 and a bf16 state, and the generic
DPLR kernel as GLA's calls it), one token of bf16 inputs (``--shape``'s T is ignored).
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from kernels import KNOB_HELP, apply_knobs  # noqa: E402  (run from benchmarks/)
from rankdecay.ops.triton import channel, chunk_bwd, chunk_fwd, chunk_state, factors

TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float64: "*fp64",
         torch.int32: "*i32", torch.int64: "*i64"}
KERNELS = ("_intra_kernel", "_state_fwd_kernel", "_output_kernel")


def _key(name: str, kw: dict) -> str:
    """A captured launch's name: the kernel's, with its MODE where it takes one (``channel``'s one-level products
    launch twice, MODE 1 and 2, and both are kept)."""
    return f"{name}[MODE={kw['MODE']}]" if "MODE" in kw else name


def capture(shape, knobs: dict) -> dict:
    """The launches ``chunk_dplr_fwd`` makes for GDN on CPU tensors, as {name: (fn, args, kwargs)}."""
    launches, saved = {}, {n: getattr(chunk_fwd, n) for n in KERNELS}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.__setitem__(_key(self.name, kw), (saved[self.name], args, kw))

    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).bfloat16()
    g, beta = -torch.rand(B, T, H, 1, generator=gen), torch.rand(B, T, H, generator=gen)
    k1 = k[..., None, :]
    cfg = dict(precision="bf16", state_precision="bf16", stored=torch.bfloat16, fuse_output=True, **knobs)
    try:
        for n in KERNELS:
            setattr(chunk_fwd, n, Capture(n))
        chunk_fwd.chunk_dplr_fwd(q, k1, v[..., None, :], k1, k1, g, K ** -0.5, None, _config=cfg,
                                 a_scale=(beta * g[..., 0].exp())[..., None], v_scale=beta[..., None])
    finally:
        for n, fn in saved.items():
            setattr(chunk_fwd, n, fn)
    return launches


def capture_training(case: str, shape) -> tuple[dict, dict]:
    """The launches of one case's forward that saves for the backward, and of the backward, on CPU tensors: two
    {name: (fn, args, kwargs)}, every ``*_kernel`` of the fused kernels' modules captured, none run."""
    launches, patched = {}, []

    class Capture:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.__setitem__(_key(self.name, kw), (self.fn, args, kw))

    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(B, T, H, 1, V, generator=gen).bfloat16()
    g, beta = -torch.rand(B, T, H, 1, generator=gen), torch.rand(B, T, H, generator=gen)
    k1 = k[..., None, :]
    sv = beta[..., None].contiguous()
    do = torch.randn(B, T, H, V).bfloat16()
    # the GPU's precision, not the interpreter's stand-in ("bf16_ieee"), so the launches are the H100's
    precision = {m: m._precision for m in (chunk_fwd, chunk_bwd)}
    cfg = dict(_config=dict(stored=torch.bfloat16))
    try:
        for m in precision:
            m._precision = lambda x: "bf16"
        for mod in (chunk_fwd, chunk_bwd, chunk_state, channel, factors):
            for name in dir(mod):
                fn = getattr(mod, name)
                if isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                    patched.append((mod, name, fn))
                    setattr(mod, name, Capture(name, fn))
        extra, tied, save = {}, case == "gdn", not case.endswith("-fwd")
        if case in ("kda", "kda-fwd"):  # as ops.kda: a = k with β, b = e^g ⊙ k (a placeholder, built where read)
            g = -torch.rand(B, T, H, K, generator=gen).bfloat16()
            a = k1
            sa = beta[..., None].contiguous()
            b = factors.placeholder(k1.shape, torch.bfloat16, k.device)
            if save and not chunk_fwd.kda_b_formed(k1, a, g, sa):  # as chunk_bwd.chunk_dplr
                b = factors.kda_factor(k1, g[..., None, :], dtype=torch.bfloat16)
            cfg.update(kda_b=True)
        elif case == "hdla-fwd":  # as chunk_bwd.chunk_hdla without autograd: no rows built, a2 formed in the kernels
            g = -torch.rand(B, T, H, K, generator=gen).bfloat16()
            a, b, sa, sv = factors.placeholder((B, T, H, 2, K), torch.bfloat16, k.device), None, None, None
            cfg.update(hdla_beta=beta, hdla_form_a2=True)
        elif case == "hdla":  # as chunk_bwd._HDLA: a2 alone (its products in one kernel), b None, a per-channel gate
            g = -torch.rand(B, T, H, K, generator=gen).bfloat16()
            a, b, c = chunk_bwd._hdla_factors(q, k, g, beta, with_c=True)
            sa = sv = None
            cfg.update(hdla_beta=beta)
            extra = dict(hdla_beta=beta, hdla_c=c)
        elif tied:
            a = b = k1
            sa = (beta * g[..., 0].exp())[..., None].contiguous()
        else:  # Head-in-Head r = 4: a and b as factors.hh_factors stores them at this precision
            r = 4
            a, b = (torch.zeros(B, T, H, r, K, dtype=torch.bfloat16) for _ in range(2))
            sa = (beta * g[..., 0].exp())[..., None].expand(B, T, H, r).contiguous()
            extra = dict(hh_mask=torch.rand(*((B, T, H) if case == "hh-gdn-token" else (H,)), r, r, generator=gen))
            cfg.update(hh_mask=extra["hh_mask"])  # the intra kernel forms a and b from k and the mask
        out = chunk_fwd.chunk_dplr_fwd(q, k1, v, a, b, g, K ** -0.5, None, save=save, a_scale=sa, v_scale=sv, **cfg)
        forward = dict(launches)
        launches.clear()
        if not save:
            return forward, {}
        saved = out[2]
        if case == "kda":  # as chunk_dplr asks: step 4 forms b and carries its gradient (--knob kda_rows=0: not)
            extra = dict(paired=saved["paired"], kda_rows=chunk_bwd.carries_kda_rows(k1, a, g, sa, True))
        tensors = (q, k1, v, None if tied else a, None if tied else b, g, None, sa, sv,
                   *(saved[n] for n in chunk_bwd._SAVED))
        try:
            # (ut: the forward formed U_n from T, as the autograd nodes pass it on)
            chunk_bwd._backward(tensors, K ** -0.5, saved["TC"], tied, do, None, ut=saved["ut"], **extra)
        except (RuntimeError, IndexError):  # PyTorch work on the (never written) results after the last launch
            pass
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        for m, fn in precision.items():
            m._precision = fn
    return forward, dict(launches)


def capture_decode(shape) -> dict:
    """The decode kernels' launches for one token of each mechanism's step on CPU tensors, as {name: (fn, args,
    kwargs)}: the ops run with their launches captured instead of run (and the check that a GPU is there off)."""
    from rankdecay import ops
    import importlib

    from rankdecay.ops import mechanisms
    from rankdecay.ops.triton import fused_recurrent as fr

    B, _, H, K, V = shape
    launches = {}
    names = {"_fused_recurrent_gdn_kernel": None, "_fused_recurrent_fwd_kernel": None}
    dplr = importlib.import_module("rankdecay.ops.dplr")  # (the package's ``dplr`` is the function)
    saved = {n: getattr(fr, n) for n in names} | {"check": mechanisms.check_triton_mode}  # (dplr's is the same)
    current = [""]

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.__setitem__(current[0], (saved[self.name], args, kw))

    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = (rnd(B, 1, H, d).bfloat16() for d in (K, K, V))
    b, a = rnd(B, 1, H).bfloat16(), rnd(B, 1, H, K).bfloat16()
    g, gk = -torch.rand(B, 1, H, generator=gen), -torch.rand(B, 1, H, K, generator=gen)
    mask = ops.head_in_head_mask(torch.rand(H, 4, 4, generator=gen))
    s1 = b.float().sigmoid()
    cases = {  # each called with initial_state=h, inplace_final_state=True: the cache's step
        "gdn (gates in the kernel)": lambda **kw: ops.gated_delta_rule_decode(q, k, v, b, b, rnd(H), rnd(H), **kw),
        "gdn, grouped value heads x2 (gates in the kernel)": lambda **kw: ops.gated_delta_rule_decode(
            q[:, :, :H // 2], k[:, :, :H // 2], v, b, b, rnd(H), rnd(H), **kw),
        "kda (gates in the kernel)": lambda **kw: ops.kda_decode(q, k, v, a, b, rnd(H), rnd(H * K), **kw),
        "kda (bounded gate)": lambda **kw: ops.kda_decode(q, k, v, a, b, rnd(H), rnd(H * K), lower_bound=-5.0, **kw),
        "hdla": lambda **kw: ops.hdla(q, k, v, gk, s1, **kw),
        "hdla (gates in the kernel)": lambda **kw: ops.hdla_decode(q, k, v, a, b, **kw),
        "gdp n_h=2": lambda **kw: ops.gated_delta_product(q, torch.cat([k, k], 1), torch.cat([v, v], 1), g,
                                                          torch.cat([s1, s1], 1), 2, **kw),
        "gdp n_h=2 (gates in the kernel)": lambda **kw: ops.gated_delta_product_decode(
            q, torch.cat([k, k], 1), torch.cat([v, v], 1), b, torch.cat([b, b], 1), 2, rnd(H), rnd(H), **kw),
        "hh-gdn r=4": lambda **kw: ops.hh_delta_rule(q, k, v, s1, mask, g, **kw),
        "hh-gdn r=4, mask per token": lambda **kw: ops.hh_delta_rule(q, k, v, s1, mask.expand(B, 1, H, 4, 4), g,
                                                                     **kw),
        "hh-gdn r=4 (gates and mask in the kernel)": lambda **kw: ops.hh_delta_rule_decode(
            q, k, v, b, b, torch.rand(H, 4, 4, generator=gen), rnd(H), rnd(H), **kw),
        "gla (generic kernel)": lambda **kw: ops.gla(q, k, v, gk, **kw),
    }
    try:
        for n in names:
            setattr(fr, n, Capture(n))
        mechanisms.check_triton_mode = dplr.check_triton_mode = lambda *a, **kw: None
        with torch.no_grad():
            for state in (torch.float32, torch.bfloat16):
                for name, call in cases.items():
                    current[0] = f"{name}, {str(state).removeprefix('torch.')} state"
                    h = torch.zeros(B, H, K, V, dtype=state)
                    try:
                        call(initial_state=h, inplace_final_state=True, mode="fused_recurrent")
                    except (TypeError, ValueError, AttributeError, RuntimeError):
                        pass  # the capture returns nothing: what the op does with its result fails here
    finally:
        for n in names:
            setattr(fr, n, saved[n])
        mechanisms.check_triton_mode = dplr.check_triton_mode = saved["check"]
    return launches


def spill_bytes(kernel) -> str:
    """``ptxas -v``'s spill line for a compiled kernel's PTX (sm_90a), as Triton ships ptxas."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    return next((ln.split(":")[-1].strip() for ln in out.stderr.splitlines() if "spill" in ln), "?")


def compile_sm90(fn, args, kw, with_kernel: bool = False) -> tuple:
    """Compile one captured launch for sm_90, as the JIT would on an H100 (16-bit products in their dtype,
    16-byte aligned pointers); returns (cuobjdump's resource line, shared bytes, warps, stages)."""
    kw = dict(kw)
    options = {o: kw.pop(o) for o in ("num_warps", "num_stages", "maxnreg") if o in kw}
    for flag in ("LP_QK", "LP_QA", "LP_BA", "LP_BK"):  # the interpreter's bf16 stand-in turns these off
        if flag in kw and kw.get("RAB", 1) > 0:
            kw[flag] = True
    values = dict(zip(fn.arg_names, args), **kw)
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        x = values.get(name, param.default)
        if param.is_constexpr or x is None:
            signature[name], constants[name] = "constexpr", x
        elif isinstance(x, torch.Tensor):
            signature[name], attrs[(i,)] = TYPES[x.dtype], [["tt.divisibility", 16]]
        elif isinstance(x, bool):
            signature[name] = "i1"
        elif isinstance(x, int):
            signature[name] = "i32"
            if x % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    if constants.get("PRECISION") == "bf16_ieee":
        constants["PRECISION"] = "bf16"
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln.strip() for ln in usage.splitlines() if "REG:" in ln)
    result = line, kernel.metadata.shared, options.get("num_warps", 4), options.get("num_stages", 3)
    return result + (kernel,) if with_kernel else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs=5, type=int, default=[1, 256, 2, 128, 128], metavar=("B", "T", "H", "K", "V"))
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE",
                        help="chunk_fwd._KNOBS, Python literals; with --backward, kernels.py's --knob: " + KNOB_HELP)
    parser.add_argument("--decode", action="store_true", help="the decode kernels (one token) instead")
    parser.add_argument("--backward", choices=["gdn", "hh-gdn", "hh-gdn-token", "hdla", "hdla-fwd", "kda", "kda-fwd"],
                        default=None,
                        help="this case's forward that saves for the backward and its backward, instead of the GDN "
                             "forward alone (kda-fwd, hdla-fwd: their forward without autograd alone)")
    args = parser.parse_args()
    if args.decode:
        print(f"Triton {triton.__version__}, sm_90, decode kernels, B H K V = {args.shape[0]} {args.shape[2:]}, bf16 "
              "inputs, the state updated in place")
        for name, (fn, a, kw) in capture_decode(args.shape).items():
            line, shared, warps, stages, kernel = compile_sm90(fn, a, kw, with_kernel=True)
            print(f"  {name}: {line.split()[0]} | {spill_bytes(kernel)} | shared {shared} B, {warps} warps")
        return
    if args.backward:
        apply_knobs(args.knob)
        print(f"Triton {triton.__version__}, sm_90, {args.backward} forward+backward {args.shape}, bf16 products"
              + (f", knobs {args.knob}" if args.knob else ""))
        parts = ("forward (no autograd)" if args.backward.endswith("-fwd") else "forward (saving)", "backward")
        for part, launches in zip(parts, capture_training(args.backward, args.shape)):
            if not launches:
                continue
            print(f"{part}:")
            for name, (fn, a, kw) in sorted(launches.items()):
                line, shared, warps, stages, kernel = compile_sm90(fn, a, kw, with_kernel=True)
                print(f"  {name}: {line.split()[0]} | {spill_bytes(kernel)} | shared {shared} B, {warps} warps, "
                      f"{stages} stages")
        return
    knobs = {name: ast.literal_eval(value) for name, value in (kv.split("=", 1) for kv in args.knob)}
    print(f"Triton {triton.__version__}, sm_90, GDN forward {args.shape}, knobs {knobs or 'none'}")
    for name, (fn, a, kw) in capture(args.shape, knobs).items():
        line, shared, warps, stages = compile_sm90(fn, a, kw)
        print(f"{name}: {line} | shared {shared} B, {warps} warps, {stages} stages")


if __name__ == "__main__":
    main()
