"""The general operator: gradients, gradcheck, extreme values, memory."""
import pytest
import torch
import torch.nn.functional as F

from rankdecay.ops import dplr, gated_delta_rule, gla, hdla, hh_delta_rule, head_in_head_mask
from rankdecay.ops.chunk import chunk_dplr_core

from ..conftest import assert_matches, autograd_nodes
from . import reference as ref

f64 = torch.float64


def dplr_inputs(B, T, H, K, V, Rab, Rkv, gate, dtype=f64, requires_grad=True):
    """Random, well-conditioned inputs: the transition's spectral norm stays near 1."""
    kv_shape = (B, T, H, Rkv) if Rkv > 1 else (B, T, H)
    x = dict(
        q=torch.randn(B, T, H, K, dtype=dtype),
        k=F.normalize(torch.randn(*kv_shape, K, dtype=dtype), dim=-1),
        v=torch.randn(*kv_shape, V, dtype=dtype),
        a=0.5 * F.normalize(torch.randn(B, T, H, Rab, K, dtype=dtype), dim=-1) / max(Rab, 1) if Rab else None,
        b=F.normalize(torch.randn(B, T, H, Rab, K, dtype=dtype), dim=-1) if Rab else None,
        g={None: None, "scalar": -F.softplus(torch.randn(B, T, H, dtype=dtype)),
           "channel": -F.softplus(torch.randn(B, T, H, K, dtype=dtype))}[gate],
        initial_state=torch.randn(B, H, K, V, dtype=dtype),
    )
    for t in x.values():
        if t is not None:
            t.requires_grad_(requires_grad)
    return x


def grads(x, mode, chunk_size=16, **kw):
    o, s = dplr(**x, output_final_state=True, mode=mode, chunk_size=chunk_size, **kw)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=s.dtype)
    tensors = {n: t for n, t in x.items() if t is not None}
    dx = torch.autograd.grad((o * do).sum() + (s * ds).sum(), list(tensors.values()))
    return o, s, dict(zip(tensors, dx))


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("Rab,Rkv", [(0, 1), (1, 1), (2, 2), (4, 1), (3, 2)])
def test_chunk_gradients_match_naive(Rab, Rkv, gate):
    x = dplr_inputs(2, 45, 2, 8, 6, Rab, Rkv, gate)
    o1, s1, d1 = grads(x, "naive")
    o2, s2, d2 = grads(x, "chunk", chunk_size=32)  # blocks of 32 -> 16 -> 8 -> 4 tokens
    assert_matches(o2, o1, 1e-10, "output")
    assert_matches(s2, s1, 1e-10, "final state")
    assert set(d1) == set(d2) == {n for n, t in x.items() if t is not None}
    for name in d1:
        assert_matches(d2[name], d1[name], 1e-10, f"d{name}")


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("Rkv", [1, 2])
@pytest.mark.parametrize("Rab", [0, 1, 2, 3])
def test_gradcheck_chunk(Rab, Rkv, gate):
    x = dplr_inputs(1, 11, 1, 4, 3, Rab, Rkv, gate)
    names = [n for n, t in x.items() if t is not None]

    def f(*tensors):
        kw = dict(zip(names, tensors))
        args = [kw.get(n) for n in ("q", "k", "v", "a", "b", "g")]
        c = __import__("rankdecay.ops._inputs", fromlist=["canonicalize"]).canonicalize(
            *args, None, kw["initial_state"], None, 8, "chunk")
        # chunk 8: one level of halving above the elementwise leaves, and padding (T = 11)
        return chunk_dplr_core(c.q, c.k, c.v, c.a, c.b, c.g, c.scale, c.initial_state, f64, 8)

    assert torch.autograd.gradcheck(f, tuple(x[n] for n in names), fast_mode=True)


@pytest.mark.parametrize("mode", ["naive", "chunk"])
def test_gradcheck_public_op(mode):
    x = dplr_inputs(1, 7, 2, 4, 3, 2, 2, "channel")
    names = [n for n, t in x.items() if t is not None]

    def f(*tensors):
        return dplr(**dict(zip(names, tensors)), output_final_state=True, mode=mode, chunk_size=4)

    assert torch.autograd.gradcheck(f, tuple(x[n] for n in names))


def _extreme_gate(kind, shape):
    g = -F.softplus(torch.randn(shape, dtype=f64))
    if kind == "-30":
        return torch.full(shape, -30.0, dtype=f64)
    g[:, 9] = -1e4  # one step that wipes the state
    return g


@pytest.mark.parametrize("gate_kind", ["-30", "-1e4"])
@pytest.mark.parametrize("beta_value", [0.0, 2.0])
@pytest.mark.parametrize("mech", ["gated_delta_rule", "gla", "hdla", "hh_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_extreme_values(mech, beta_value, gate_kind, dtype):
    """beta at 0 and 2, log-gates of -30 per step or -1e4 at one step: finite and exact."""
    B, T, H, K, V = 1, 40, 2, 16, 8
    q = torch.randn(B, T, H, K, dtype=f64)
    k = F.normalize(torch.randn(B, T, H, K, dtype=f64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=f64)
    beta = torch.full((B, T, H), beta_value, dtype=f64)
    per_channel = mech in ("gla", "hdla")
    g = _extreme_gate(gate_kind, (B, T, H, K) if per_channel else (B, T, H))
    mask = head_in_head_mask(torch.rand(H, 4, 4, dtype=f64))
    fn, literal = {
        "gated_delta_rule": (lambda *x, **kw: gated_delta_rule(*x, beta, **kw), lambda *x: ref.gated_delta_rule(*x, beta, K ** -0.5, None)),
        "gla": (gla, lambda *x: ref.gla(*x, K ** -0.5, None)),
        "hdla": (lambda *x, **kw: hdla(*x, beta, **kw), lambda *x: ref.hdla(*x, beta, K ** -0.5, None)),
        "hh_delta_rule": (lambda q, k, v, g, **kw: hh_delta_rule(q, k, v, beta, mask, g, **kw),
                          lambda q, k, v, g: ref.hh_delta_rule(q, k, v, beta, mask, g, K ** -0.5, None)),
    }[mech]
    o_ref, s_ref = literal(q, k, v, g)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v, g)]
    tol = 1e-10 if dtype == f64 else 1e-5
    for mode in ("naive", "chunk"):
        o, s = fn(*inputs, output_final_state=True, mode=mode, chunk_size=16)
        assert_matches(o, o_ref, tol, f"{mode} output")
        assert_matches(s, s_ref, tol, f"{mode} final state")
        dx = torch.autograd.grad(o.sum() + s.sum(), inputs)
        assert all(torch.isfinite(d).all() for d in dx), f"{mode}: non-finite gradient"


def test_chunk_size_does_not_change_the_result():
    x = dplr_inputs(1, 100, 2, 16, 8, 2, 1, "channel", requires_grad=False)
    o_ref, s_ref = dplr(**x, output_final_state=True, mode="naive")
    for C in (1, 7, 16, 48, 64, 128):
        o, s = dplr(**x, output_final_state=True, mode="chunk", chunk_size=C)
        assert_matches(o, o_ref, 1e-10, f"chunk {C} output")
        assert_matches(s, s_ref, 1e-10, f"chunk {C} final state")


def test_zero_length_input_returns_initial_state():
    x = dplr_inputs(2, 0, 2, 4, 3, 1, 1, "scalar", requires_grad=False)
    for mode in ("naive", "chunk"):
        o, s = dplr(**x, output_final_state=True, mode=mode)
        assert o.shape == (2, 0, 2, 3)
        torch.testing.assert_close(s, x["initial_state"])


def _saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd keeps for backward while fn() runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("mech", ["gated_delta_rule", "hdla"])
def test_chunk_memory_is_linear_in_T(mech):
    """What autograd keeps grows linearly in T and stays below one [K, V] state per token."""
    B, H, K, V = 1, 2, 64, 64

    def run(T):
        q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for D in (K, K, V))
        beta = torch.rand(B, T, H, requires_grad=True)
        g = -torch.rand(B, T, H, *((K,) if mech == "hdla" else ()), requires_grad=True)
        fn = gated_delta_rule if mech == "gated_delta_rule" else hdla
        return _saved_bytes(lambda: fn(q, k, v, g, beta, mode="chunk"))

    small, large = run(512), run(2048)
    assert 3.6 <= large / small <= 4.4, f"saved bytes grow {large / small:.2f}x for 4x tokens"
    per_token_per_head = large / (2048 * H)
    assert per_token_per_head < K * V * 4, f"{per_token_per_head:.0f} bytes per token and head"


@pytest.mark.parametrize("mode", ["naive", "chunk"])
def test_backward_does_not_index_time_step_by_step(mode):
    """The loops over time (tokens on the naive path, chunks on the chunked one) take their slices by unbind: one
    backward node a tensor, whatever T. Indexing step t inside the loop adds a select node a step, and the backward
    of each allocates and zero-fills the whole input, quadratic in T (the CPU's HDLA forward+backward at T = 8192
    took 1.3x as long chunked, and 2.3-2.8x naive at T = 2048; session 64)."""
    selects = []
    for T in (96, 192):
        x = dplr_inputs(1, T, 2, 8, 8, Rab=2, Rkv=1, gate="channel", dtype=torch.float32)
        o, S = dplr(**x, chunk_size=16, output_final_state=True, mode=mode)
        names = autograd_nodes(o.sum() + S.sum())
        assert "UnbindBackward0" in names
        selects.append(names.count("SelectBackward0"))
    assert selects[0] == selects[1], f"select nodes grow with T: {selects[0]} at T = 96, {selects[1]} at T = 192"
