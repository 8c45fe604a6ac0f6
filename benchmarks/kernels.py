"""Kernel benchmarks: rankdecay's ops against fla and PyTorch SDPA on one GPU.

    python benchmarks/kernels.py [--cases gdn hdla ...] [--json out.json] [--scaling] [--matmul-precision medium]
                                 [--knob stored=bfloat16]
    python benchmarks/kernels.py --cases hdla --variants "" ch_warps=4 fwd_state_stages=1 --rounds 2 --no-peers

A registry of (op, shapes); one runner prints, for forward and forward+backward, the
median milliseconds (calls back to back, as do_bench times them, and each call alone on an
idle GPU: see ``bench``), TFLOP/s from an explicit FLOP count (``rankdecay.ops.
chunk_flops_per_token``; backward counted as twice the forward), peak memory, and
the ratio to each peer present (fla if importable, SDPA causal attention). Decode steps
are timed as plain calls and as a CUDA graph's replay ("fwd graph", ours and fla's alike:
the GPU's time once no host launches are left in the loop). Results
as a Markdown table and, with --json, a JSON file. bf16 inputs; B=8, T=2048, H=16,
K=V=128 unless --shape says otherwise.

``--variants`` compares launch knobs in one process: each variant (comma-separated ``--knob`` pairs, "" for the
defaults, on top of ``--knob``) is applied, the cases run, and the knobs restored, variants alternating over
``--rounds`` rounds; a summary table lists each variant's milliseconds round by round. One process compiles
each variant once and imports once, where a shell loop of runs pays both every time.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rankdecay import ops


@dataclass
class Case:
    name: str
    make: callable  # (B, T, H, K, V, device, dtype) -> dict of tensors
    ours: callable  # (inputs) -> o
    flops_per_token_head: callable  # (K, V, C) -> float
    peers: dict = field(default_factory=dict)  # name -> (inputs) -> o; missing imports are skipped
    decode: bool = False


def _qkv(B, T, H, K, V, device, dtype, nh=1):
    q = torch.randn(B, T, H, K, device=device, dtype=dtype)
    k = F.normalize(torch.randn(B, T * nh, H, K, device=device, dtype=torch.float32), dim=-1).to(dtype)
    v = torch.randn(B, T * nh, H, V, device=device, dtype=dtype)
    return q, k, v


def make_gdn(B, T, H, K, V, device, dtype):
    q, k, v = _qkv(B, T, H, K, V, device, dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device=device) + 3)
    beta = torch.rand(B, T, H, device=device, dtype=dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def make_hdla(B, T, H, K, V, device, dtype):
    x = make_gdn(B, T, H, K, V, device, dtype)
    x["g"] = F.logsigmoid(torch.randn(B, T, H, K, device=device) + 3)
    x["beta"] = 2 * x["beta"]
    return x


def make_kda(B, T, H, K, V, device, dtype):
    """Kimi Delta Attention: HDLA's nearest peer in fla, a diagonal plus rank-1 decay where HDLA's is diagonal
    plus rank 2."""
    x = make_gdn(B, T, H, K, V, device, dtype)
    x["g"] = F.logsigmoid(torch.randn(B, T, H, K, device=device) + 3)
    return x


def make_hh(B, T, H, K, V, device, dtype):
    x = make_gdn(B, T, H, K, V, device, dtype)
    x["mask"] = ops.head_in_head_mask(torch.rand(H, 4, 4, device=device))
    return x


def make_gla(B, T, H, K, V, device, dtype):
    q, k, v = _qkv(B, T, H, K, V, device, dtype)
    return dict(q=q, k=k, v=v, g=F.logsigmoid(torch.randn(B, T, H, K, device=device) + 3) / 16)


def make_gdp(B, T, H, K, V, device, dtype):
    q, k, v = _qkv(B, T, H, K, V, device, dtype, nh=2)
    return dict(q=q, k=k, v=v, g=F.logsigmoid(torch.randn(B, T, H, device=device) + 3),
                beta=torch.rand(B, 2 * T, H, device=device, dtype=dtype))


def make_dplr(rab, rkv):
    """The engine itself (``ops.dplr``) at rank ``rab`` of decay and ``rkv`` of writes, with a scalar gate: a decay
    Diag(e^g) - Σ_r (β_r / 2) k_r k_rᵀ over unit keys of its own and writes Σ_j k_j v_jᵀ. These are the general
    kernels that no mechanism above reaches (Head-in-Head forms its rows in the kernels, Gated DeltaProduct runs as
    Gated DeltaNet over its sub-steps)."""
    def make(B, T, H, K, V, device, dtype):
        q = torch.randn(B, T, H, K, device=device, dtype=dtype)
        ka = F.normalize(torch.randn(B, T, H, rab, K, device=device), dim=-1)
        beta = torch.rand(B, T, H, rab, 1, device=device)
        k = F.normalize(torch.randn(B, T, H, rkv, K, device=device), dim=-1)
        return dict(q=q, k=k.to(dtype), v=torch.randn(B, T, H, rkv, V, device=device, dtype=dtype),
                    a=(beta / 2 * ka).to(dtype), b=ka.to(dtype),
                    g=F.logsigmoid(torch.randn(B, T, H, device=device) + 3))
    return make


def make_decode(B, T, H, K, V, device, dtype):
    x = make_gdn(B, 1, H, K, V, device, dtype)
    x["initial_state"] = torch.randn(B, H, K, V, device=device)
    return x


def make_decode_raw(B, T, H, K, V, device, dtype, state_dtype=torch.float32):
    """The layer's decode step (``ops.gated_delta_rule_decode``): projections in, gates formed in the kernel,
    the state updated in place in ``state_dtype``."""
    x = {n: torch.randn(B, 1, H, d, device=device, dtype=dtype) for n, d in (("q", K), ("k", K), ("v", V))}
    x.update(a=torch.randn(B, 1, H, device=device, dtype=dtype), b=torch.randn(B, 1, H, device=device, dtype=dtype),
             A_log=torch.rand(H, device=device).log(), dt_bias=torch.randn(H, device=device),
             initial_state=torch.randn(B, H, K, V, device=device).to(state_dtype))
    return x


def make_kda_decode_raw(B, T, H, K, V, device, dtype):
    """KDA's decode step (``ops.kda_decode``): projections in (a per channel, dt_bias [H * K]), gates formed in the
    kernel, the fp32 state updated in place."""
    x = make_decode_raw(B, T, H, K, V, device, dtype)
    x.update(a=torch.randn(B, 1, H, K, device=device, dtype=dtype), dt_bias=torch.randn(H * K, device=device))
    return x


def _fla_kda_decode(x):
    """fla's ``fused_recurrent_kda`` on the same projections, its gate and β formed in its kernel (its public
    function writes a new final state: it has no in-place argument)."""
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                               initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)[0]


def _fla(path, fn):
    def call(x, **kw):
        import importlib

        return getattr(importlib.import_module(path), fn)(**x, **kw)[0]
    return call


def _sdpa(x):
    q = x["q"].transpose(1, 2)
    return F.scaled_dot_product_attention(q, x["k"].transpose(1, 2), x["v"].transpose(1, 2), is_causal=True)


CASES = {
    "gdn": Case("Gated DeltaNet", make_gdn, lambda x: ops.gated_delta_rule(**x)[0],
                lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 1, 1),
                {"fla": _fla("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), "sdpa": _sdpa}),
    "hdla": Case("HDLA", make_hdla, lambda x: ops.hdla(**x)[0], lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 2, 1),
                 {"sdpa": _sdpa}),
    "kda": Case("KDA", make_kda, lambda x: ops.kda(**x)[0],
                lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 1, 1),
                {"fla": _fla("fla.ops.kda", "chunk_kda")}),
    "hh-gdn": Case("HH-GDN r=4", make_hh, lambda x: ops.hh_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["mask"], x["g"])[0],
                   lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 4, 1), {"sdpa": _sdpa}),
    "gla": Case("GLA", make_gla, lambda x: ops.gla(**x)[0], lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 0, 1),
                {"fla": _fla("fla.ops.gla", "chunk_gla"), "sdpa": _sdpa}),
    "gdp": Case("Gated DeltaProduct n_h=2", make_gdp, lambda x: ops.gated_delta_product(**x, num_householder=2)[0],
                lambda K, V, C: ops.chunk_flops_per_token(K, V, C, 2, 2),
                {"fla": lambda x: __import__("fla.ops.gated_delta_product", fromlist=["x"]).chunk_gated_delta_product(
                    **x, num_householder=2)[0]}),
    **{f"dplr-{rab}-{rkv}": Case(f"dplr, scalar gate, Rab {rab}, Rkv {rkv}", make_dplr(rab, rkv),
                                 lambda x: ops.dplr(**x)[0],
                                 lambda K, V, C, rab=rab, rkv=rkv: ops.chunk_flops_per_token(K, V, C, rab, rkv))
       for rab, rkv in ((1, 1), (2, 1), (2, 2), (4, 1))},
    "gdn-decode": Case("GDN decode step", make_decode,
                       lambda x: ops.gated_delta_rule(**x, output_final_state=True, mode="fused_recurrent")[0],
                       lambda K, V, C: 4.0 * K * V + 4 * K * V,
                       # fla writes the new state only when asked, as a decode step must
                       {"fla": lambda x: _fla("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")(
                           x, output_final_state=True)}, decode=True),
    # the layers' step: state read and written back in place, fp32 or a bf16 cache (state_dtype)
    "gdn-decode-inplace": Case("GDN decode step, state in place", make_decode_raw,
                               lambda x: ops.gated_delta_rule_decode(**x, inplace_final_state=True)[0],
                               lambda K, V, C: 4.0 * K * V + 4 * K * V, {}, decode=True),
    "gdn-decode-bf16": Case("GDN decode step, bf16 state in place",
                            lambda *a: make_decode_raw(*a, state_dtype=torch.bfloat16),
                            lambda x: ops.gated_delta_rule_decode(**x, inplace_final_state=True)[0],
                            lambda K, V, C: 4.0 * K * V + 4 * K * V, {}, decode=True),
    "kda-decode": Case("KDA decode step, state in place", make_kda_decode_raw,
                       lambda x: ops.kda_decode(**x, inplace_final_state=True)[0],
                       lambda K, V, C: 4.0 * K * V + 4 * K * V, {"fla": _fla_kda_decode}, decode=True),
}


def bench(fn, warmup=5, reps=20) -> dict:
    """Median milliseconds per call, measured two ways:

    - ``ms``: calls back to back, as in training and as ``triton.testing.do_bench`` times them
      (no L2 flush): an event pair around each call, one synchronisation at the end, so the
      host prepares call i + 1 while the GPU runs call i. This is GPU time whenever the host
      keeps ahead;
    - ``sync_ms``: each call started on an idle GPU and waited for, so the host's own time
      before the first kernel (argument checks, allocation, launches) counts too;

    and ``host_ms``, the host's time per call in the back-to-back loop: its own work when that is
    well below ``ms``; near ``ms`` the host also waited on the GPU (a full launch queue, or an
    operation that synchronises), and the op is GPU bound or has such a wait.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    t0 = time.perf_counter()
    for start, end in events:
        start.record()
        fn()
        end.record()
    host = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    back_to_back = statistics.median(s.elapsed_time(e) for s, e in events)
    times = []
    for start, end in events:
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": back_to_back, "sync_ms": statistics.median(times), "host_ms": host}


def graphed(fn):
    """``fn`` recorded once as a CUDA graph (after warm-up on a side stream); returns its replay.
    What a decode loop pays per step once the host's launches are out of the way."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def make_step(call, inputs, backward: bool):
    """One forward (+ backward) of ``call`` on leaf copies of ``inputs`` (floating tensors other than a mask
    take gradients), as a function of no arguments; the gradients are cleared after each call, so that a
    later call does not add to them."""
    leaves = {k: (v.detach().requires_grad_(backward) if v.is_floating_point() and k != "mask" else v)
              for k, v in inputs.items()}

    def step():
        if not backward:
            with torch.no_grad():
                call(leaves)
            return
        o = call(leaves)
        o.backward(torch.ones_like(o))
        for v in leaves.values():
            v.grad = None

    return step


def measure(call, inputs, backward: bool, graph: bool = False) -> dict:
    """``bench``'s times and the peak memory above the inputs (MB) of forward (+ backward);
    with ``graph``, of the forward recorded as a CUDA graph and replayed."""
    step = make_step(call, inputs, backward)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = bench(graphed(step) if graph else step)
    return {**times, "peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}


def run_case(key, B, T, H, K, V, C=64, dtype=torch.bfloat16, peers: bool = True) -> list[dict]:
    case = CASES[key]
    inputs = case.make(B, T, H, K, V, "cuda", dtype)
    tokens = B * (1 if case.decode else T)
    flops_fwd = tokens * H * case.flops_per_token_head(K, V, C)
    rows = []
    for passes in (("fwd", "fwd graph") if case.decode else ("fwd", "fwd+bwd")):
        backward, graph = passes == "fwd+bwd", passes == "fwd graph"
        row = dict(case=key, op=case.name, shape=dict(B=B, T=T, H=H, K=K, V=V), dtype=str(dtype), pass_=passes,
                   matmul_precision=torch.get_float32_matmul_precision())
        flops = flops_fwd * (3 if backward else 1)
        try:
            m = measure(case.ours, inputs, backward, graph)
            row.update(m, tflops=flops / m["ms"] / 1e9)
        except Exception as e:  # noqa: BLE001 - a failing case is a result too
            row.update(error=f"{type(e).__name__}: {e}"[:200])
        for peer, call in (case.peers.items() if peers else ()):
            try:
                m = measure(call, inputs, backward, graph)
                row[f"{peer}_ms"], row[f"{peer}_sync_ms"] = m["ms"], m["sync_ms"]
                if "ms" in row:
                    row[f"vs_{peer}"] = m["ms"] / row["ms"]
            except Exception as e:  # noqa: BLE001
                row[f"{peer}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(markdown_row(row), flush=True)
    return rows


HEADER = ("| op | shape | pass | ms | synced ms | host ms | TFLOP/s | peak MB | fla ms | fla synced ms | x fla "
          "| SDPA ms | x SDPA |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def markdown_row(r: dict) -> str:
    f = lambda key, fmt: (fmt.format(r[key]) if key in r else ("err" if key.replace("_ms", "_error") in r else "—"))  # noqa: E731
    shape = "B{B} T{T} H{H} K{K} V{V}".format(**r["shape"])
    ours = f("ms", "{:.3f}") if "error" not in r else "error: " + r["error"][:60]
    return (f"| {r['op']} | {shape} | {r['pass_']} | {ours} | {f('sync_ms', '{:.3f}')} | {f('host_ms', '{:.3f}')} | "
            f"{f('tflops', '{:.1f}')} | {f('peak_mb', '{:.0f}')} | {f('fla_ms', '{:.3f}')} | "
            f"{f('fla_sync_ms', '{:.3f}')} | {f('vs_fla', '{:.2f}')} | "
            f"{f('sdpa_ms', '{:.3f}')} | {f('vs_sdpa', '{:.2f}')} |")


KNOB_HELP = ("chunk_fwd._KNOBS overrides: stored=bfloat16 / stored_state=bfloat16 (the tensors between kernels), "
             "output_bv=128, output_warps=8, intra_warps=8; channel._CHANNEL's with a ch_ prefix: ch_rows=32, "
             "ch_bk=64, ch_warps=8, ch_bwd_bk=64, ch_bwd_warps=8 (the per-channel products); chunk_bwd._CONFIG's "
             "with bwd_: bwd_grad_hh=1; chunk_state._LAUNCH's with state_: state_warps=8; rows=128 (chunk tiles); "
             "form_a2=0 (HDLA's forward builds a2 with the factor kernel); kda_pair=0 (KDA's per-channel products "
             "in two kernels: M_QK and L_BK apart, with autograd with their scaled twins); kda_rows=0 (KDA's a and b "
             "gradients returned to autograd, not carried on to k and g in step 4); kda_pair_bwd=0 (KDA's four "
             "products' gradients in two passes); hdla_finish=0 (HDLA's dβ and c's share in a kernel after step 4); "
             "hh_sparse_inputs=0 (Head-in-Head's inputs' kernel reads every rank's rows of U); hh_grams=0 "
             "(Head-in-Head's products in the intra kernel from its rows, not per-group Grams); u_from_t=0 / 1 "
             "(training: W and Ũ from the intra kernel / U_n formed from T by the state kernels); u_from_t_16=0 / 1 "
             "(with it, T for the state kernels in fp32 / in the 16-bit dtype of the tensors between kernels); "
             "register caps (Triton's maxnreg, 0: none): bwd_inputs_maxnreg, bwd_products_maxnreg, "
             "bwd_grad_maxnreg, bwd_grad_hh_maxnreg, bwd_state_bwd_maxnreg, ch_maxnreg, ch_hdla_maxnreg, "
             "ch_hdla_bwd_maxnreg, fwd_state_maxnreg; "
             "fwd_ names chunk_fwd._KNOBS explicitly where a prefix would take the name: fwd_state_stages=1; "
             "the log-cumsum kernel's launch (key block x warps) as lc_<chunk>_<plain|prep|hdla>: lc_16_prep=64x2")


def _prefixed_tables() -> dict[str, dict]:
    """The launch-knob tables ``--knob`` reaches by prefix (``chunk_fwd._KNOBS`` takes the names without one)."""
    from rankdecay.ops.triton import channel, chunk_bwd, chunk_state

    return {"ch_": channel._CHANNEL, "bwd_": chunk_bwd._CONFIG, "state_": chunk_state._LAUNCH}


def _knob_value(value: str):
    """A ``chunk_fwd._KNOBS`` value as ``--knob`` spells it: a Python literal (1, True, None, 'x'), a torch dtype's
    name (bfloat16), or else the string itself (merge=tf32)."""
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        dtype = getattr(torch, value, None)
        return dtype if isinstance(dtype, torch.dtype) else value


def apply_knobs(pairs: list[str]) -> None:
    """``NAME=VALUE`` pairs into ``chunk_fwd._KNOBS`` (``_knob_value``'s: a literal, a torch dtype or a string), or
    with the prefix
    ``ch_`` into ``channel._CHANNEL``, ``bwd_`` into ``chunk_bwd._CONFIG`` and ``state_`` into
    ``chunk_state._LAUNCH`` (integers); ``fwd_`` names ``chunk_fwd._KNOBS`` explicitly (``fwd_state_stages``);
    ``lc_<chunk>_<plain|prep|hdla>=BKxWARPS`` sets the log-cumsum kernel's launch (``chunk_fwd._LOG_CUMSUM``, e.g.
    ``lc_16_prep=64x2``: key block 64 on 2 warps at 16-token chunks with PREP)."""
    from rankdecay.ops.triton import chunk_fwd

    tables = _prefixed_tables()
    for kv in pairs:
        name, value = kv.split("=")
        prefix = next((p for p in tables if name.startswith(p)), None)
        if name.startswith("lc_"):
            size, _, kind = name.removeprefix("lc_").partition("_")
            table = chunk_fwd._LOG_CUMSUM.get(int(size)) if size.isdigit() else None
            if table is None or kind not in table:
                raise SystemExit(f"--knob {name}: lc_<chunk>_<kind> with chunk in {sorted(chunk_fwd._LOG_CUMSUM)}"
                                 " and kind in ['hdla', 'plain', 'prep']")
            table[kind] = tuple(int(x) for x in value.split("x"))
        elif prefix is not None:
            table, key = tables[prefix], name.removeprefix(prefix)
            if key not in table:
                raise SystemExit(f"--knob {name}: the {prefix} table has {sorted(table)}")
            table[key] = int(value)
        else:
            key = name.removeprefix("fwd_")
            try:
                chunk_fwd.check_knobs({key: value}, f"--knob {name}: chunk_fwd._KNOBS (no prefix, or fwd_)")
            except ValueError as e:
                raise SystemExit(f"{e}; the prefixed tables are {sorted(tables)} and lc_") from None
            chunk_fwd._KNOBS[key] = _knob_value(value)


@contextlib.contextmanager
def knobs_restored():
    """Every knob table ``apply_knobs`` reaches, put back as it was on leaving the block."""
    from rankdecay.ops.triton import chunk_fwd

    tables = [chunk_fwd._KNOBS, *_prefixed_tables().values()]
    saved = [dict(t) for t in tables]
    log_cumsum = copy.deepcopy(chunk_fwd._LOG_CUMSUM)
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        for size, launches in log_cumsum.items():
            chunk_fwd._LOG_CUMSUM[size].update(launches)


def run_variants(variants: list[str], rounds: int, run) -> list[dict]:
    """``run(label)`` (-> result rows) under each variant's knobs (comma-separated ``NAME=VALUE`` pairs as ``--knob``
    takes them; "" the knobs as they are), variants alternating over ``rounds`` rounds. The knob tables are put
    back as they were after each variant. Each row gains its ``variant`` and ``round``: ``label`` holds the two,
    for a ``run`` that records rows as they come (``RowLog``)."""
    rows = []
    for r in range(1, rounds + 1):
        for spec in variants:
            print(f"variant {spec or 'default'!r}, round {r} of {rounds}", flush=True)
            with knobs_restored():
                apply_knobs([kv for kv in spec.split(",") if kv])
                label = dict(variant=spec or "default", round=r)
                rows += [dict(row, **label) for row in run(label)]
    return rows


class RowLog:
    """The result rows so far, written whole to ``path`` (JSON) after each ``add``, through a temporary file and a
    rename: a run stopped part way (a timeout, an error in a later case) leaves every row it measured, and never a
    half-written file. ``path`` None: nothing is written."""

    def __init__(self, path: str | None):
        self.path, self.rows = path, []

    def add(self, rows: list[dict]) -> None:
        self.rows += rows
        if self.path:
            tmp = f"{self.path}.part"
            with open(tmp, "w") as f:
                json.dump(self.rows, f, indent=1)
            os.replace(tmp, self.path)


def variant_summary(rows: list[dict]) -> str:
    """A Markdown table of ``run_variants``' rows: per op, pass and variant, the ms of each round and peak MB."""
    out = ["| op | pass | variant | ms, round by round | peak MB |", "|---|---|---|---|---:|"]
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["op"], row["pass_"], row["variant"]), []).append(row)
    for (op, passes, variant), group in groups.items():
        ms = " / ".join(f"{r['ms']:.3f}" if "ms" in r else "error" for r in group)
        peak = max((r["peak_mb"] for r in group if "peak_mb" in r), default=float("nan"))
        out.append(f"| {op} | {passes} | {variant} | {ms} | {peak:.0f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--shape", nargs=5, type=int, metavar=("B", "T", "H", "K", "V"), default=[8, 2048, 16, 128, 128])
    parser.add_argument("--decode-batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--scaling", action="store_true",
                        help="also T = 2k, 8k, 32k at 16k tokens per batch (B = 1 at 32k), for every case among "
                             "--cases but the decode steps")
    parser.add_argument("--json", default=None,
                        help="also write the rows as JSON, rewritten after each case (a run cut short keeps its rows)")
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                        help="torch.set_float32_matmul_precision: the precision of our kernels' products "
                             "(highest: fp32-accurate; high: one TF32 pass; medium: bf16, as fla)")
    parser.add_argument("--knob", nargs="*", default=[], metavar="NAME=VALUE", help=KNOB_HELP)
    parser.add_argument("--variants", nargs="+", default=None, metavar="SPEC",
                        help='knob sets compared in this one process, each comma-separated NAME=VALUE pairs as '
                             '--knob takes them ("" the defaults), on top of --knob; a summary table follows')
    parser.add_argument("--rounds", type=int, default=1, help="with --variants: rounds, the variants alternating")
    parser.add_argument("--no-peers", action="store_true", help="time ours alone (no fla, no SDPA)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds takes a count of at least 1, got {args.rounds}")
    import triton

    apply_knobs(args.knob)
    torch.set_float32_matmul_precision(args.matmul_precision)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"float32 matmul precision {args.matmul_precision}" + (f", knobs {args.knob}" if args.knob else ""))
    try:
        import fla

        print(f"fla {getattr(fla, '__version__', '?')}")
    except ImportError as e:
        print(f"fla not importable ({e}): no fla column")
    print(HEADER)
    B, T, H, K, V = args.shape
    peers = not args.no_peers

    log = RowLog(args.json)

    def run(label: dict | None = None) -> list[dict]:
        shapes = []  # (case, B, T) in the order run
        for key in args.cases:
            shapes += [(key, b, 1) for b in args.decode_batches] if CASES[key].decode else [(key, B, T)]
        if args.scaling:
            shapes += [(key, max(1, 16384 // t), t) for key in args.cases if not CASES[key].decode
                       for t in (2048, 8192, 32768)]
        rows = []
        for key, b, t in shapes:
            case_rows = run_case(key, b, t, H, K, V, peers=peers)
            log.add([dict(row, **(label or {})) for row in case_rows])
            rows += case_rows
        return rows

    if args.variants is None:
        run()
    else:
        print(variant_summary(run_variants(args.variants, args.rounds, run)))


if __name__ == "__main__":
    main()
