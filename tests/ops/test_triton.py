"""The Triton paths against the PyTorch chunked path: outputs, final states, every gradient.

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on tiny shapes;
on a GPU the same tests run on CUDA, plus the realistic-size bf16 tests at the end.
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from rankdecay import ops

from ..conftest import NO_CPU_COMPILE, assert_matches, autograd_nodes, can_compile_on_cpu, rel_rms

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")
dplr_module = importlib.import_module("rankdecay.ops.dplr")  # the module (rankdecay.ops.dplr is the function)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="realistic sizes need a CUDA GPU (recorded in BENCHMARKS.md)")


def random_inputs(B, T, H, K, V, Rab, Rkv, gate, *, dtype=torch.float32, strong=False, beta_max=1.0, seed=0):
    """Delta-rule-like DPLR inputs (a = βk-ish, b = k, unit keys) that keep the state bounded."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rnd(B, T, H, K)
    k = F.normalize(rnd(B, T, H, Rkv, K), dim=-1)
    v = rnd(B, T, H, Rkv, V)
    a = b = None
    if Rab:
        b = F.normalize(rnd(B, T, H, Rab, K), dim=-1)
        a = b * (beta_max / Rab) * torch.rand(B, T, H, Rab, 1, generator=gen)
    g = None
    if gate is not None:
        shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
        g = -30 * torch.rand(*shape, generator=gen) if strong else F.logsigmoid(rnd(*shape) + 2)
    h0 = rnd(B, H, K, V)
    cast = lambda x: None if x is None else x.to(DEVICE, dtype)  # noqa: E731
    return [cast(x) for x in (q, k, v, a, b, g)] + [h0.to(DEVICE)]


def run(mode, inputs, grads=True, **kw):
    q, k, v, a, b, g, h0 = [None if x is None else x.detach().clone().requires_grad_(grads) for x in inputs]
    o, s = ops.dplr(q, k, v, a, b, g, initial_state=h0, output_final_state=True, mode=mode, **kw)
    if not grads:
        return [o.detach(), s.detach()]
    ((o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() + s.sin().sum()).backward()
    return [o.detach(), s.detach()] + [x.grad for x in (q, k, v, a, b, g, h0) if x is not None]


NAMES = ["o", "final_state", "dq", "dk", "dv", "da", "db", "dg", "dh0"]


def names(inputs):
    present = [x is not None for x in inputs]
    return ["o", "final_state"] + [n for n, p in zip(NAMES[2:], present) if p]


@pytest.fixture(params=["fused", "unfused"])
def path(request, monkeypatch):
    """mode="triton" with autograd: the fused kernels and their written-out backward (ranks <= 4),
    or PyTorch intra-chunk parts around the Triton state kernel (higher ranks, and per-channel
    gates with a low-rank decay on CUDA)."""
    if request.param == "unfused":
        monkeypatch.setattr(dplr_module, "_fused_applies", lambda *args: False)
    return request.param


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("Rkv", [1, 2])
@pytest.mark.parametrize("Rab", [0, 1, 2, 4])
def test_triton_chunk_matches_pytorch_chunk(Rab, Rkv, gate, path):
    inputs = random_inputs(2, 37, 2, 16, 8, Rab, Rkv, gate)  # 37: not a multiple of the chunk
    got, ref = run("triton", inputs, chunk_size=16), run("chunk", inputs, chunk_size=16)
    for name, x, y in zip(names(inputs), got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} gate={gate}: {name}")


@pytest.mark.parametrize("ut", [True, False], ids=["u-from-t", "w-and-u"])
@pytest.mark.parametrize("Rab,Rkv,gate", [(1, 1, "scalar"), (2, 1, "channel"), (4, 2, None), (1, 2, "channel")])
def test_training_forms_u_from_t_either_way(Rab, Rkv, gate, ut, monkeypatch):
    """``chunk_fwd.u_from_t``: the training forward's state kernel forms U_n = T (B̃ S_n + L_BK V) from T (the intra
    kernel stores B̃ in W's place and no Ũ), and the backward's state kernel dX_n = Tᵀ dU_n for the values kernel;
    or W and Ũ come from the intra kernel, as before. Forced each way (the rule takes the first for a per-channel
    gate and Head-in-Head, the second for the rest), the output, final state and every gradient match the PyTorch
    path at fp32 accuracy, with strong decays in one chunk and a partial last chunk, and the forward took the form
    asked for."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "u_from_t", ut)
    taken, forward = [], chunk_bwd.chunk_dplr_fwd

    def spy(*args, **kw):
        out = forward(*args, **kw)
        taken.append(out[2]["ut"])
        return out

    monkeypatch.setattr(chunk_bwd, "chunk_dplr_fwd", spy)
    inputs = random_inputs(2, 37, 2, 16, 8, Rab, Rkv, gate, seed=7)
    if gate is not None:
        inputs[5][:, 17:19] = -30.0
    got, ref = run("triton", inputs, chunk_size=16), run("chunk", inputs, chunk_size=16)
    assert taken == [ut], taken
    for name, x, y in zip(names(inputs), got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} gate={gate} u_from_t={ut}: {name}")


def test_u_from_t_with_t_in_16_bits(monkeypatch):
    """``_KNOBS["u_from_t_16"]``: with the tensors between kernels in 16 bits (bf16, as on a GPU at the "medium"
    precision), T for the state kernels is stored in bf16 too (by default, or forced by the knob; the knob at 0 keeps
    it in fp32), and the backward's state kernel reads that copy. Their
    products round T to bf16 anyway, so every result is the one with T read in fp32, to 1e-6, and within 3e-2 of the
    PyTorch path (relative RMS; with bf16 tiles between kernels da and db reach 2.1e-2 either way). With fp32 tensors
    between kernels (the CPU's default; a GPU's is bf16 at this precision) it does nothing (no copy is made). A copy
    never written fails it."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd

    saved_t, forward = [], chunk_bwd.chunk_dplr_fwd

    def spy(*args, **kw):
        out = forward(*args, **kw)
        saved_t.append(out[2]["tinv"].dtype)
        return out

    monkeypatch.setattr(chunk_bwd, "chunk_dplr_fwd", spy)
    monkeypatch.setitem(chunk_fwd._KNOBS, "u_from_t", True)
    inputs = random_inputs(2, 37, 2, 16, 8, 2, 1, "channel", seed=8)
    inputs[5][:, 17:19] = -30.0
    ref = run("chunk", inputs, chunk_size=16)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        results = {}
        for stored, t16 in ((torch.bfloat16, 0), (torch.bfloat16, 1), (None, 0), (None, 1), (torch.bfloat16, None)):
            if t16 is None:
                monkeypatch.delitem(chunk_fwd._KNOBS, "u_from_t_16", raising=False)
            else:
                monkeypatch.setitem(chunk_fwd._KNOBS, "u_from_t_16", t16)
            if stored is None:
                monkeypatch.delitem(chunk_fwd._KNOBS, "stored", raising=False)
            else:
                monkeypatch.setitem(chunk_fwd._KNOBS, "stored", stored)
            results[stored, t16] = run("triton", inputs, chunk_size=16)
    finally:
        torch.set_float32_matmul_precision(old)
    default = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (``chunk_fwd.stored_dtype`` at "medium")
    # the knob forces it either way; left unset, bf16 between kernels takes it (``chunk_fwd.u_from_t_16``)
    assert saved_t == [torch.float32, torch.bfloat16, torch.float32, default, torch.bfloat16], saved_t
    assert all(torch.equal(x, y) for x, y in zip(results[torch.bfloat16, None], results[torch.bfloat16, 1]))
    for name, x, y, z in zip(names(inputs), results[torch.bfloat16, 1], results[torch.bfloat16, 0], ref):
        assert_matches(x.float(), y.float(), 1e-6, f"T in bf16 against fp32: {name}")
        assert_matches(x.float(), z.float(), 3e-2, f"T in bf16 against the PyTorch path: {name}")


def test_u_from_t_rule():
    """Where the training forward forms U_n from T by default (``chunk_fwd.u_from_t``): a per-channel gate and
    Head-in-Head's rows, not the delta rule's tied keys nor the other scalar-gated ones; the knob forces either way."""
    from rankdecay.ops.triton.chunk_fwd import u_from_t

    assert u_from_t(2, False, False) and u_from_t(1, False, True) and u_from_t(0, False, True)
    assert not u_from_t(1, True, False) and not u_from_t(1, False, False) and not u_from_t(0, False, False)
    assert u_from_t(1, True, False, knob=True) and not u_from_t(2, False, False, knob=False)


def test_values_in_inputs_rule():
    """Where the inputs' kernel also does the values kernel's work by default (``chunk_bwd.values_in_inputs``): a
    low-rank decay with rows of its own at the bf16 products' precision and K, V <= 128, and Head-in-Head's at any
    K, V (session 59); not the delta rule's tied keys, no ranks, fp32 accuracy or other wider heads. The knob forces
    either way."""
    from rankdecay.ops.triton.chunk_bwd import values_in_inputs

    assert values_in_inputs(2, False, "bf16", 128, 128) and values_in_inputs(4, False, "bf16_ieee", 64, 32)
    assert not values_in_inputs(1, True, "bf16", 128, 128) and not values_in_inputs(0, False, "bf16", 128, 128)
    assert not values_in_inputs(2, False, "tf32x3", 128, 128) and not values_in_inputs(2, False, "bf16", 256, 128)
    assert not values_in_inputs(2, False, "bf16", 128, 256)
    assert values_in_inputs(4, False, "bf16", 256, 256, hh=True) and not values_in_inputs(4, False, "tf32", 256, 256,
                                                                                        hh=True)
    assert values_in_inputs(1, True, "ieee", 256, 256, knob=1) and not values_in_inputs(2, False, "bf16", 128, 128,
                                                                                         knob=0)


def test_u_from_t_16_rule():
    """Where T for the state kernels is stored in the 16-bit dtype of the tensors between kernels
    (``chunk_fwd.u_from_t_16``): bf16 by default, not fp16 (T's entries can leave its range) unless forced, never
    fp32 (there is no 16-bit copy to make); the knob forces either way."""
    from rankdecay.ops.triton.chunk_fwd import u_from_t_16

    assert u_from_t_16(torch.bfloat16) and u_from_t_16(torch.float16, knob=1) and u_from_t_16(torch.bfloat16, knob=1)
    assert not u_from_t_16(torch.float16) and not u_from_t_16(torch.bfloat16, knob=0)
    assert not u_from_t_16(torch.float32) and not u_from_t_16(torch.float32, knob=1)


@pytest.fixture(params=["output-kernel", "state-kernel"])
def output_form(request, monkeypatch):
    """Where the fused forward forms its outputs: a kernel of their own, one program per chunk, or the
    state kernel as it walks the chunks (``chunk_fwd.fuse_output`` picks one by the GPU's size)."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "fuse_output", request.param == "state-kernel")
    return request.param


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("Rkv", [1, 2])
@pytest.mark.parametrize("Rab", [0, 1, 2, 3, 4])
def test_fused_forward_matches_pytorch_chunk(Rab, Rkv, gate, output_form):
    """Without autograd mode="triton" is the fused forward (its own chunk size: 64 tokens for
    ranks <= 1, 16 for rank 4; T = 70 leaves a partial chunk either way)."""
    inputs = random_inputs(1, 70, 2, 16, 8, Rab, Rkv, gate)
    with torch.no_grad():
        got, ref = run("triton", inputs, grads=False), run("chunk", inputs, grads=False, chunk_size=16)
    for name, x, y in zip(["o", "final_state"], got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} gate={gate}: {name}")


@pytest.mark.parametrize("Rab,gate", [(1, "scalar"), (3, "channel")])
def test_fused_forward_rank4_writes(Rab, gate, output_form):
    """Rkv = 4: 16-token chunks, and with Rab = 1 a 16-row UT transform (no blocks to merge)."""
    inputs = random_inputs(1, 70, 2, 16, 8, Rab, 4, gate)
    with torch.no_grad():
        got, ref = run("triton", inputs, grads=False), run("chunk", inputs, grads=False, chunk_size=16)
    for name, x, y in zip(["o", "final_state"], got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv=4 gate={gate}: {name}")


def test_fused_forward_extremes(output_form):
    """T = 1; K = V = 20 and 36 (masked key/value tiles); log-gates of -30 per step, one of -1e4; β = 2."""
    for T, gate, K in ((1, "channel", 20), (45, "channel", 20), (45, "scalar", 20), (130, "channel", 36),
                       (130, "scalar", 36)):
        inputs = random_inputs(1, T, 2, K, 20, 2, 1, gate, strong=True, beta_max=2.0)
        if T > 40:
            inputs[5][:, 3] = -1e4
        with torch.no_grad():
            got, ref = run("triton", inputs, grads=False), run("chunk", inputs, grads=False, chunk_size=16)
        for name, x, y in zip(["o", "final_state"], got, ref):
            assert torch.isfinite(x).all(), f"T={T} gate={gate}: {name} not finite"
            assert_matches(x, y, 1e-5, f"T={T} gate={gate} K={K}: {name}")


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_forward_cu_seqlens_and_16bit(dtype, gate, output_form):
    """16-bit inputs: the undecayed products of 16-bit pairs are taken in their dtype (exact)."""
    inputs = random_inputs(1, 50, 2, 16, 16, 1, 1, gate, dtype=dtype)
    inputs[-1] = torch.randn(3, 2, 16, 16, device=DEVICE)
    cu = torch.tensor([0, 7, 7, 50], device=DEVICE)
    with torch.no_grad():
        got = run("triton", inputs, grads=False, cu_seqlens=cu)
        ref = run("chunk", inputs, grads=False, cu_seqlens=cu)
    for name, x, y in zip(["o", "final_state"], got, ref):
        assert x.dtype == y.dtype
        assert_matches(x.float(), y.float(), 1e-5 if name == "final_state" else 2 ** -9, f"cu_seqlens: {name}")  # o: bf16 rounding


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("Rab,Rkv", [(0, 1), (2, 1), (4, 2)])
def test_fused_recurrent_matches_naive(Rab, Rkv, gate):
    inputs = random_inputs(2, 13, 3, 20, 12, Rab, Rkv, gate)  # K, V not powers of two
    with torch.no_grad():
        got, ref = run("fused_recurrent", inputs, grads=False), run("naive", inputs, grads=False)
    for name, x, y in zip(["o", "final_state"], got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} gate={gate}: {name}")


def test_awkward_sizes_and_extremes(path):
    """T = 1, K = V = 20, chunk size 8 (< 16, padded inside the kernel), log-gates of -30 per step
    (and one of -1e4), β = 2: outputs, final states and every gradient."""
    for T, gate in ((1, "channel"), (45, "channel"), (45, "scalar")):
        inputs = random_inputs(1, T, 2, 20, 20, 2, 1, gate, strong=True, beta_max=2.0)
        if T > 40:
            inputs[5][:, 3] = -1e4
        got, ref = run("triton", inputs, chunk_size=8), run("chunk", inputs, chunk_size=8)
        for name, x, y in zip(names(inputs), got, ref):
            assert_matches(x, y, 1e-5, f"T={T} gate={gate}: {name}")


@pytest.mark.parametrize("Rab,Rkv,C", [(4, 2, 32), (3, 2, 64)])
def test_many_rows_per_chunk_are_tiled(Rab, Rkv, C, monkeypatch):
    """C * Rab and C * Rkv beyond one 64-row tile: the state kernels loop over row blocks."""
    monkeypatch.setattr(dplr_module, "_fused_applies", lambda *args: False)  # the unfused path takes chunk_size
    inputs = random_inputs(1, 70, 1, 16, 16, Rab, Rkv, "channel")
    got, ref = run("triton", inputs, chunk_size=C), run("chunk", inputs, chunk_size=C)
    for name, x, y in zip(names(inputs), got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} C={C}: {name}")


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("Rab,Rkv", [(1, 1), (2, 2), (4, 1)])
def test_row_scales_match_factors_multiplied_in(Rab, Rkv, gate, path):
    """a_scale / v_scale (the kernels apply them to products and rows) against the chunk path on
    a_scale ⊙ a and v_scale ⊙ v built by hand: outputs, states, every gradient, the factors' too."""
    _check_row_scales(Rab, Rkv, gate)


@pytest.mark.parametrize("Rab,Rkv,gate", [(2, 2, "channel"), (1, 1, "channel"), (1, 2, "channel"), (4, 1, None),
                                          (2, 1, "scalar")])
def test_row_scales_with_outputs_from_the_state_kernel(Rab, Rkv, gate, monkeypatch):
    """The same with autograd, the fused forward's outputs formed by its state kernel (``fuse_output``),
    which then stores S_n and U_n for the backward too: M_QK's and M_QA's factors on every branch
    (per-channel gate: v's factors in the chunk layout; a decay per row: on M's columns)."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "fuse_output", True)
    _check_row_scales(Rab, Rkv, gate)


def _check_row_scales(Rab, Rkv, gate):
    q, k, v, a, b, g, h0 = random_inputs(2, 37, 2, 16, 8, Rab, Rkv, gate)
    gen = torch.Generator().manual_seed(1)
    sa = (2 * torch.rand(2, 37, 2, Rab, generator=gen)).to(DEVICE)  # up to β = 2
    sv = torch.rand(2, 37, 2, Rkv, generator=gen).to(DEVICE)
    leaves = lambda: [None if x is None else x.detach().clone().requires_grad_() for x in (q, k, v, a, b, g, h0, sa, sv)]  # noqa: E731
    results = []
    for mode, by_hand in (("triton", False), ("chunk", True)):
        q_, k_, v_, a_, b_, g_, h0_, sa_, sv_ = xs = leaves()
        if by_hand:
            o, s = ops.dplr(q_, k_, v_ * sv_[..., None], a_ * sa_[..., None], b_, g_, initial_state=h0_,
                            output_final_state=True, mode=mode, chunk_size=16)
        else:
            o, s = ops.dplr(q_, k_, v_, a_, b_, g_, initial_state=h0_, output_final_state=True, mode=mode,
                            chunk_size=16, a_scale=sa_, v_scale=sv_)
        ((o * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() + s.sin().sum()).backward()
        results.append([o, s] + [x.grad for x in xs if x is not None])
    labels = ["o", "final_state"] + [n for n, x in zip(["dq", "dk", "dv", "da", "db", "dg", "dh0", "da_scale", "dv_scale"],
                                                      (q, k, v, a, b, g, h0, sa, sv)) if x is not None]
    for name, x, y in zip(labels, *results):
        assert_matches(x, y, 1e-5, f"Rab={Rab} Rkv={Rkv} gate={gate}: {name}")


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_16bit_inputs_with_autograd(dtype, tol, gate):
    """16-bit q, k, v, a, b and dO: the products with one 16-bit factor take two TF32 passes
    (``chunk_state._dot_ex``; exact in fp32 under the interpreter, so this checks the algebra).
    Results come back in the inputs' dtype: the tolerance is their rounding (fp16 2^-11, bf16 2^-8)."""
    q, k, v, a, b, g, h0 = random_inputs(1, 45, 2, 16, 16, 2, 1, gate, dtype=dtype)
    sa = torch.rand(1, 45, 2, 2, device=DEVICE)
    results = []
    for mode in ("triton", "chunk"):
        xs = [None if x is None else x.detach().clone().requires_grad_() for x in (q, k, v, a, b, g, h0, sa)]
        o, s = ops.dplr(*xs[:6], initial_state=xs[6], output_final_state=True, mode=mode, chunk_size=16,
                        a_scale=xs[7], v_scale=xs[7][..., 0])
        ((o * torch.linspace(-1, 1, o.shape[-1], device=o.device).to(dtype)).sum() + s.sin().sum()).backward()
        results.append([o, s] + [x.grad for x in xs if x is not None])
    for i, (x, y) in enumerate(zip(*results)):
        assert x.dtype == y.dtype
        assert_matches(x.float(), y.float(), tol, f"{dtype} gate={gate}: output {i}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("grads", [True, False], ids=["autograd", "forward"])
# the outputs from the state kernel too where the keys are tied (a decay per row); with a per-channel gate
# the forward is the general one, covered by test_fused_forward_matches_pytorch_chunk
@pytest.mark.parametrize("gate,output_form", [(None, "output-kernel"), (None, "state-kernel"),
                                              ("scalar", "output-kernel"), ("scalar", "state-kernel"),
                                              ("channel", "output-kernel")], indirect=["output_form"])
@pytest.mark.parametrize("Rkv", [1, 2])
def test_decay_rows_that_are_the_keys(Rkv, gate, grads, dtype, tol, output_form):
    """a and b the same tensor as k (the delta rule's layout: Gated DeltaNet passes k three times,
    β α as a_scale): the state kernel reads k once for both of its products (SAME_AK) and, with
    rank 1 and a decay per row, the backward forms k's three gradients as one (``ties_keys``).
    fp16: results in fp16, the tolerance is their rounding (2^-11). K = 40: two key blocks in the
    backward's step 4, the second one partial. One sequence of two heads (the interpreter's time grows with the
    programs; a batch of two is ``test_triton_chunk_matches_pytorch_chunk``'s)."""
    q, k, v, _, _, g, h0 = random_inputs(1, 75, 2, 40, 16, 0, Rkv, gate, dtype=dtype)
    sa = torch.rand(1, 75, 2, Rkv, device=DEVICE) * 2
    results = []
    for mode in ("triton", "chunk"):
        xs = [None if x is None else x.detach().clone().requires_grad_(grads) for x in (q, k, v, g, h0, sa)]
        with torch.set_grad_enabled(grads):
            o, s = ops.dplr(xs[0], xs[1], xs[2], xs[1], xs[1], xs[3], initial_state=xs[4], output_final_state=True,
                            mode=mode, a_scale=xs[5], v_scale=xs[5] + 0.5)
        out = [o.detach(), s.detach()]
        if grads:
            ((o * torch.linspace(-1, 1, o.shape[-1], device=o.device).to(dtype)).sum() + s.sin().sum()).backward()
            out += [x.grad for x in xs if x is not None]
        results.append(out)
    for i, (x, y) in enumerate(zip(*results)):
        assert x.dtype == y.dtype
        assert_matches(x.float(), y.float(), tol, f"Rkv={Rkv} gate={gate} {dtype}: output {i}")


def test_delta_rule_keys_with_cu_seqlens():
    """Gated DeltaNet with packed sequences through the Triton path: k is packed once and taken as
    a and b too (``ties_keys``); every gradient matches the PyTorch path."""
    B, T, H, K = 1, 50, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta, g = 2 * torch.rand(B, T, H, generator=gen), F.logsigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(3, H, K, K, generator=gen)
    cu = torch.tensor([0, 7, 7, 50], device=DEVICE)
    results = []
    for mode in ("triton", "chunk"):
        xs = [x.to(DEVICE).requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, s = ops.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, mode=mode)
        ((o * torch.linspace(-1, 1, K, device=o.device)).sum() + s.sin().sum()).backward()
        results.append([o, s] + [x.grad for x in xs])
    for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], *results):
        assert_matches(x, y, 1e-5, name)


def test_delta_rule_forward_extremes(output_form):
    """Gated DeltaNet's forward alone (no autograd; with the outputs from the state kernel this is the scaled
    form, ``chunk_fwd.scaled_update``): T = 1, T = 130 (a partial chunk), log-gates of -30 per step over ten
    steps and one of -1e4, β up to 2 and one β = 0, K = V = 36 (masked tiles); outputs and final states
    finite and matching."""
    gen = torch.Generator().manual_seed(7)
    for T in (1, 130):
        q, k, v = (torch.randn(2, T, 2, 36, generator=gen) for _ in range(3))
        k = F.normalize(k, dim=-1)
        g = F.logsigmoid(torch.randn(2, T, 2, generator=gen))
        beta = 2 * torch.rand(2, T, 2, generator=gen)
        if T > 1:
            g[:, 30:40] = -30.0
            g[:, 70] = -1e4
            beta[:, 5] = 0.0
        h0 = torch.randn(2, 2, 36, 36, generator=gen)
        xs = [x.to(DEVICE) for x in (q, k, v, g, beta, h0)]
        with torch.no_grad():
            got = ops.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, mode="triton")
            ref = ops.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, mode="chunk")
        for name, x, y in zip(["o", "final_state"], got, ref):
            assert torch.isfinite(x).all(), f"T={T}: {name} not finite"
            assert_matches(x, y, 1e-5, f"T={T} {output_form}: {name}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("gated", [False, True], ids=["deltanet", "gdn"])
def test_delta_rule_is_one_autograd_node(gated, dtype, tol):
    """(Gated) DeltaNet with autograd on the kernels is one node of autograd (``chunk_bwd._GatedDeltaRule``): it
    forms β e^g itself and carries the factors' gradients on to g and β in its backward (the gate kernel's FOLD,
    or two sums without a gate). Against the PyTorch path: T = 1 and 130, log-gates of -30 per step and one of
    -1e4, β up to 2 and one β = 0, q, k, v and β in fp16 (fp16 results: the tolerance is their rounding), every
    gradient, the initial state's too; and with the final state unused, whose gradient is then None (no zeros
    are made for it) and the state kernel's backward starts from nothing."""
    gen = torch.Generator().manual_seed(11)
    for T, use_state in ((1, True), (130, True), (130, False)):
        q, k, v = (torch.randn(2, T, 2, 20, generator=gen) for _ in range(3))
        k = F.normalize(k, dim=-1)
        g = F.logsigmoid(torch.randn(2, T, 2, generator=gen)) if gated else None
        beta = 2 * torch.rand(2, T, 2, generator=gen)
        if T > 1:
            beta[:, 5] = 0.0
            if gated:
                g[:, 30:40], g[:, 70] = -30.0, -1e4
        h0 = torch.randn(2, 2, 20, 20, generator=gen)
        results = []
        for mode in ("triton", "chunk"):
            xs = [None if x is None else x.to(DEVICE, dtype if i in (0, 1, 2, 4) else torch.float32).clone()
                  .requires_grad_() for i, x in enumerate((q, k, v, g, beta, h0))]  # new leaves for each mode
            o, s = ops.gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode)
            if mode == "triton":
                assert autograd_nodes(o).count("_GatedDeltaRuleBackward") == 1
            loss = (o.float() * torch.linspace(-1, 1, 20, device=o.device)).sum()
            (loss + s.sin().sum() if use_state else loss).backward()
            results.append([o.detach(), s.detach()] + [x.grad for x in xs if x is not None])
        labels = ["o", "final_state", "dq", "dk", "dv"] + ["dg"] * gated + ["dbeta", "dh0"]
        for name, x, y in zip(labels, *results, strict=True):
            assert x.dtype == y.dtype, name
            assert_matches(x.float(), y.float(), tol, f"T={T} {dtype} state used={use_state}: {name}")


@pytest.mark.parametrize("dtype,tol,stored,one_level", [(torch.float32, 1e-5, None, None),
                                                        (torch.float32, 1e-5, None, 60),
                                                        (torch.float16, 2e-3, None, None),
                                                        (torch.float16, 8 * 2 ** -11, torch.float16, None)],
                         ids=["fp32", "fp32-one-level", "fp16", "fp16-16-bit-between"])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_hdla_is_one_autograd_node(gate, dtype, tol, stored, one_level, monkeypatch):
    """HDLA with autograd on the kernels is one node of autograd (``chunk_bwd._HDLA``): it builds a and b itself,
    takes their products as six of token rows (``channel.hdla_products`` and ``hdla_products_bwd``, forced here: by
    default only at the bf16 products' precision) and carries the rows' gradients on to k, g and β. Against the
    PyTorch path: T = 1 and 77 (chunks of 16 tokens: a partial last chunk), log-gates of -30
    per step and one of -1e4, β in [0, 2] with β = 0 and β = 2, a per-channel gate or a per-head one (expanded
    over K), fp16 q, k, v and β, every gradient; and the final state unused (its gradient None; T = 40). ``stored``: the
    tensors between the kernels in 16 bits, as on a GPU at the bf16 products' precision (the products' gradients
    of q, k, a and b among them), within eight units of fp16's rounding (as bf16's in
    ``test_bf16_products_under_medium_matmul_precision``). Step 4 on 16 key channels: K = 20 in two blocks, the
    second partial, whose sums the rows' backward adds up (the last of them to be done: ``chunk_bwd._grad_kernel``'s
    HFIN). ``one_level``: the products' diagonal blocks in one product where the decays allow (by default only on a
    GPU's fp32 log-cumsums, forced here), the chunks with log-gates of -30 by levels."""
    knobs = importlib.import_module("rankdecay.ops.triton.chunk_fwd")._KNOBS
    monkeypatch.setitem(knobs, "hdla_products", True)
    monkeypatch.setitem(importlib.import_module("rankdecay.ops.triton.channel")._CHANNEL, "one_level", one_level)
    monkeypatch.setitem(importlib.import_module("rankdecay.ops.triton.chunk_bwd")._CONFIG, "grad_bk", 16)
    if stored is not None:
        monkeypatch.setitem(knobs, "stored", stored)
    gen = torch.Generator().manual_seed(12)
    K, V = 20, 12
    for T, use_state in ((1, True), (77, True), (40, False)):
        q, k, v = torch.randn(2, T, 2, K, generator=gen), torch.randn(2, T, 2, K, generator=gen), \
            torch.randn(2, T, 2, V, generator=gen)
        k = F.normalize(k, dim=-1)
        g = F.logsigmoid(torch.randn(2, T, 2, *((K,) if gate == "channel" else ()), generator=gen) + 1)
        beta = 2 * torch.rand(2, T, 2, generator=gen)
        if T > 1:
            beta[:, 5], beta[:, 6] = 0.0, 2.0
            g[:, 30:40], g[:, T - 7] = -30.0, -1e4
        h0 = torch.randn(2, 2, K, V, generator=gen)
        results = []
        for mode in ("triton", "chunk"):
            xs = [x.to(DEVICE, dtype if i in (0, 1, 2, 4) else torch.float32).clone().requires_grad_()
                  for i, x in enumerate((q, k, v, g, beta, h0))]  # new leaves for each mode
            o, s = ops.hdla(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode)
            if mode == "triton" and gate == "channel":
                assert autograd_nodes(o).count("_HDLABackward") == 1
            loss = (o.float() * torch.linspace(-1, 1, V, device=o.device)).sum()
            (loss + s.sin().sum() if use_state else loss).backward()
            results.append([o.detach(), s.detach()] + [x.grad for x in xs])
            if mode == "triton":  # the forward alone: a1 and b formed from k in the kernels (a2_only), the scaled
                # form over the update rows [k, a2] (``chunk_fwd``'s hdla_scaled)
                with torch.no_grad():
                    forward = ops.hdla(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode)
        for name, x, y in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], *results, strict=True):
            assert x.dtype == y.dtype, name
            assert torch.isfinite(x).all(), name
            assert_matches(x.float(), y.float(), tol, f"T={T} {gate} {dtype} state used={use_state}: {name}")
        for name, x, y in zip(["o", "final_state"], forward, results[1], strict=False):
            assert_matches(x.float(), y.float(), tol, f"T={T} {gate} {dtype} forward alone: {name}")


def test_hdla_finish_in_step4_matches_its_own_kernel(monkeypatch):
    """HDLA's rows' backward finished inside step 4 (``_KNOBS["hdla_finish"]`` 1, the default: each chunk's last key
    block to be done adds c = kᵀ(λk)'s share to every block's dk and dg and forms dβ) gives the same bits as
    ``factors.hdla_factors_finish`` after step 4 (0), which it replaces: the same sums in the same order. K = 40 on
    16 key channels a block (three, the last partial), T = 37 (a partial last chunk), β up to 2, log-gates of -30;
    the finish kernel runs only where asked for."""
    cb = importlib.import_module("rankdecay.ops.triton.chunk_bwd")
    knobs = importlib.import_module("rankdecay.ops.triton.chunk_fwd")._KNOBS
    monkeypatch.setitem(knobs, "hdla_products", True)
    monkeypatch.setitem(cb._CONFIG, "grad_bk", 16)
    finished = _count_calls(monkeypatch, cb, "hdla_factors_finish")
    q, k, v, g, beta = _channel_gate_inputs(31, B=2, T=37, H=2, K=40, V=24, strong=slice(9, 12))
    beta = 2 * beta
    results = []
    for fin in (1, 0):
        monkeypatch.setitem(knobs, "hdla_finish", fin)
        xs = [x.to(DEVICE).clone().requires_grad_() for x in (q, k, v, g, beta)]
        o, _ = ops.hdla(*xs, mode="triton")
        (o * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum().backward()
        results.append([o.detach()] + [x.grad for x in xs])
        assert len(finished) == 1 - fin, f"hdla_finish={fin}: {len(finished)} finish kernels"
    for name, x, y in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], *results, strict=True):
        assert torch.isfinite(x).all(), name
        assert torch.equal(x, y), f"{name}: finished in step 4 differs from the finish kernel by {(x - y).abs().max()}"


def _count_calls(monkeypatch, module, name: str) -> list:
    """Wraps ``module.name`` so that each call appends 1 to the list returned (and then runs the original)."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


def _channel_gate_inputs(seed: int, B: int, T: int, H: int, K: int, V: int, strong: slice):
    """(q, k, v, g, β) on the CPU for a per-channel gate: k L2-normalised, log-gates of -30 per step over the tokens
    ``strong``, β in [0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 1)
    g[:, strong] = -30.0
    return q, F.normalize(k, dim=-1), v, g, torch.rand(B, T, H, generator=gen)


@pytest.mark.parametrize("mechanism", ["hdla", "kda", "gla"])
def test_backward_reuses_the_forwards_log_cumsums(mechanism, monkeypatch):
    """A per-channel gate's chunk-local log-cumsums are saved by the forward with autograd and read by the backward,
    which takes none of its own (``chunk_bwd._backward``): one log-cumsum kernel per forward+backward; the
    gradients are the PyTorch path's."""
    taken = _count_calls(monkeypatch, importlib.import_module("rankdecay.ops.triton.chunk_fwd"), "chunk_log_cumsum")
    inputs = _channel_gate_inputs(22, B=1, T=21, H=2, K=16, V=16, strong=slice(5, 7))
    results = []
    for mode in ("triton", "chunk"):
        xs = [x.to(DEVICE).clone().requires_grad_() for x in inputs]
        if mechanism == "gla":
            xs = xs[:4]
        op = dict(hdla=ops.hdla, kda=ops.kda, gla=ops.gla)[mechanism]
        o = op(*xs, mode=mode, chunk_size=16)[0]
        (o * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum().backward()
        results.append([o.detach()] + [x.grad for x in xs])
        if mode == "triton":
            assert taken == [1], f"{len(taken)} log-cumsum kernels for one forward+backward (the forward's alone: 1)"
    for x, y in zip(*results, strict=True):
        assert_matches(x, y, 1e-5, mechanism)


@pytest.mark.parametrize("one_level", [None, 60], ids=["levels", "one-level"])
def test_hdla_forward_alone_builds_no_rows(one_level, monkeypatch):
    """HDLA without autograd, its products in one kernel (as at the bf16 products' precision): no factor kernel
    runs and a is a placeholder; the kernels form a2 from k, the log-cumsums, β and c (``chunk_fwd.chunk_dplr_fwd``'s
    hdla_form_a2), the scaled form's rows Ã and B ⊙ e^{G_{i-1}} in the log-cumsum kernel (its hdla_rows, with all
    of K in one key block or, ``hdla_cumsum_bk`` 16, c from three; with ``_KNOBS["hdla_cumsum_rows"] = 0`` in the
    intra kernel), and the result is the one with a2 built (``_KNOBS["form_a2"] = 0``), a partial last chunk and
    strong decays included. fp32 inputs take fp64 log-cumsums and the products go by levels; with ``one_level`` 60
    (as fp32 log-cumsums would) the products come from those rows (``channel.hdla_row_products``) for the chunks
    within 30 of 0, and by levels for the one with the strong decays (``_KNOBS["hdla_row_products"] = 0``: from q, k
    and the log-cumsums, one product where they allow)."""
    cf = importlib.import_module("rankdecay.ops.triton.chunk_fwd")
    monkeypatch.setitem(importlib.import_module("rankdecay.ops.triton.channel")._CHANNEL, "one_level", one_level)
    from_rows, row_products = [], cf.hdla_row_products
    monkeypatch.setattr(cf, "hdla_row_products", lambda *a, **kw: from_rows.append(1) or row_products(*a, **kw))
    monkeypatch.setitem(cf._KNOBS, "hdla_products", True)
    built = _count_calls(monkeypatch, importlib.import_module("rankdecay.ops.triton.chunk_bwd"), "hdla_factors_fwd")
    rows, cumsum = [], cf.chunk_log_cumsum
    monkeypatch.setattr(cf, "chunk_log_cumsum", lambda *a, **kw: rows.append(kw.get("hdla_rows") is not None)
                        or cumsum(*a, **kw))
    q, k, v, g, beta = _channel_gate_inputs(21, B=1, T=37, H=2, K=40, V=24, strong=slice(10, 13))
    beta = 2 * beta
    beta[:, 4] = 2.0
    h0 = torch.randn(1, 2, 40, 24, generator=torch.Generator().manual_seed(23))
    xs = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    results = []
    for form, cumsum_rows, bk, by_rows in ((1, 1, None, 1), (1, 0, None, 1), (0, 1, None, 1), (1, 1, 16, 1),
                                           (1, 1, None, 0)):
        monkeypatch.setitem(cf._KNOBS, "form_a2", form)
        monkeypatch.setitem(cf._KNOBS, "hdla_cumsum_rows", cumsum_rows)
        monkeypatch.setitem(cf._KNOBS, "hdla_cumsum_bk", bk)
        monkeypatch.setitem(cf._KNOBS, "hdla_row_products", by_rows)
        built.clear()
        rows.clear()
        from_rows.clear()
        with torch.no_grad():
            results.append(ops.hdla(*xs, initial_state=h0.to(DEVICE), output_final_state=True, mode="triton"))
        assert built == ([] if form else [1]), f"form_a2={form}: the factor kernel ran {len(built)} times"
        assert rows == [bool(form and cumsum_rows)], f"form_a2={form}, hdla_cumsum_rows={cumsum_rows}: {rows}"
        expect = bool(form and cumsum_rows and by_rows and one_level and bk is None)
        assert from_rows == [1] * expect, f"{form, cumsum_rows, bk, by_rows}: hdla_row_products ran {from_rows}"
    ref = ops.hdla(*xs, initial_state=h0.to(DEVICE), output_final_state=True, mode="chunk")
    for name, x, w, y, u, n, z in zip(["o", "final_state"], *results, ref):
        assert torch.isfinite(x).all(), name
        assert_matches(x, w, 1e-6, f"{name}: rows from the log-cumsum kernel against the intra kernel's")
        assert_matches(u, w, 1e-6, f"{name}: rows from the log-cumsum kernel's 16-channel blocks")
        assert_matches(x, n, 1e-6, f"{name}: the products from the rows against those from q, k and G")
        assert_matches(x, y, 1e-6, f"{name}: a2 formed against a2 built")
        assert_matches(x, z, 1e-5, f"{name}: a2 formed against the PyTorch path")


def test_hdla_forward_alone_allocates_no_qk_products(monkeypatch):
    """HDLA's scaled forward takes M_QA over its update rows [k, a2] in M_QK's place and inverts I + D L_BA: no M_QK
    [B, H, NC, TC, TC] nor L_BK [B, H, NC, 2 TC, TC] is allocated (a placeholder stands in for M_QK as the kernels'
    dummy pointer), while the training forward, whose backward reads both, allocates them; the result is the PyTorch
    path's. The placeholders' one element is made once per dtype and device (``factors.placeholder``)."""
    from rankdecay.ops.triton.factors import placeholder

    monkeypatch.setitem(importlib.import_module("rankdecay.ops.triton.chunk_fwd")._KNOBS, "hdla_products", True)
    shapes, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: shapes.append(tuple(a[0] if len(a) == 1 else a))
                        or empty(*a, **kw))
    q, k, v, g, beta = _channel_gate_inputs(3, B=1, T=37, H=2, K=40, V=24, strong=slice(10, 13))
    TC, NC = 16, 3
    qk, bk = (1, 2, NC, TC, TC), (1, 2, NC, 2 * TC, TC)
    for grad in (False, True):
        shapes.clear()
        xs = [x.to(DEVICE).requires_grad_(grad) for x in (q, k, v, g, beta)]
        with torch.set_grad_enabled(grad):
            o, _ = ops.hdla(*xs, mode="triton")
        assert (qk in shapes, bk in shapes) == (grad, grad), f"autograd {grad}: {shapes}"
        assert_matches(o.detach(), ops.hdla(*[x.detach() for x in xs], mode="chunk")[0], 1e-5, f"autograd {grad}")
    one, two = placeholder((3, 4), torch.bfloat16, DEVICE), placeholder((5,), torch.bfloat16, DEVICE)
    assert one.shape == (3, 4) and two.shape == (5,) and one.data_ptr() == two.data_ptr()
    assert placeholder((2,), torch.float32, DEVICE).dtype == torch.float32


def test_one_level_span_by_log_cumsum_dtype(monkeypatch):
    """The products' diagonal blocks go in one product within e^60 on fp32 log-cumsums (the bf16 and TF32 products'
    precision), never on fp64 ones (fp32 accuracy); ``_CHANNEL["one_level"]`` overrides both, 0 turning it off."""
    from rankdecay.ops.triton.channel import _CHANNEL, one_level_span

    assert one_level_span(torch.float32) == 60.0
    assert one_level_span(torch.float64) == 0.0
    monkeypatch.setitem(_CHANNEL, "one_level", 0)
    assert one_level_span(torch.float32) == 0.0
    monkeypatch.setitem(_CHANNEL, "one_level", 30)
    assert one_level_span(torch.float64) == 30.0


def test_one_level_backward_for_pairs_alone(monkeypatch):
    """On fp32 log-cumsums ``channel_product_bwd`` takes the one-product form (two launches, MODE 1 and 2) for a pair
    of products (KDA's) and levels (one launch) for a product alone (GLA's), as measured; the gradients agree."""
    from rankdecay.ops.triton import channel

    modes = []

    class Spy:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                modes.append(kw.get("MODE", 0))
                return self.fn[grid](*args, **kw)
            return launch

    monkeypatch.setattr(channel, "_channel_product_bwd_kernel", Spy(channel._channel_product_bwd_kernel))
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum

    gen = torch.Generator().manual_seed(5)
    B, T, H, K, TC = 1, 40, 1, 16, 32
    x, y = (torch.randn(B, T, H, K, generator=gen).to(DEVICE) for _ in range(2))
    gc = chunk_log_cumsum(F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2).to(DEVICE), TC, torch.float32)
    dp = torch.randn(B, H, gc.shape[2], TC, TC, generator=gen).to(DEVICE)
    sy = torch.rand(B, T, H, 1, generator=gen).to(DEVICE)
    grads = lambda: (torch.zeros(B, H, gc.shape[2], TC, K, device=DEVICE) for _ in range(3))  # noqa: E731
    prod = dict(T=T, TC=TC, strict=False, precision="ieee", acc_x=False, acc_y=False)
    dx, dy, _ = grads()
    channel.channel_product_bwd(x, y, gc, dp, dx, dy, **prod)
    assert modes == [0], "a product alone: levels, one launch"
    modes.clear()
    out = []
    for one in (None, 0):
        monkeypatch.setitem(channel._CHANNEL, "one_level", one)
        dx2, dy2, dy3 = grads()
        channel.channel_product_bwd(x, y, gc, dp, dx2, dy2, y_scale=sy, dp_scaled=dp, dy_scaled=dy3, **prod)
        out.append((dx2, dy2, dy3))
    assert modes == [1, 2, 0], "a pair: one product, then the flagged by levels; forced off: levels"
    for a, b in zip(*out):
        assert_matches(a, b, 1e-5, "one product against levels")


@pytest.mark.parametrize("one_level,C", [(0, 32), (60, 32), (60, 16)], ids=["by-levels", "one-level", "one-level-16"])
@pytest.mark.parametrize("pairs", [0, 1], ids=["levels", "pairs"])
@pytest.mark.parametrize("K", [16, 37])
def test_hdla_products_match_the_four_products(K, pairs, one_level, C, monkeypatch):
    """``channel.hdla_products`` (six products of token rows) gives what ``channel_product`` gives for HDLA's
    M_QK, M_QA, L_BA and L_BK from a and b themselves, entry by entry, the zeros above the diagonal included, on
    chunks of C = 32 tokens (two) or 16 (four), the last one partial, with strong decays; and ``hdla_products_bwd`` (twelve) what
    ``channel_product_bwd`` gives for the four, a1 = β k's share taken into k's and β's. ``one_level`` (forced here on
    fp64 log-cumsums; by default only on fp32 ones): diagonal blocks within e^60 of the token before them in one
    product each: the forward's two stacked products (``_hdla_one_stacked``; ``_CHANNEL["hdla_stacked"] = 0``: six,
    ``_hdla_diag_one``, the same within rounding), the backward's twelve (``_hdla_diag_one_bwd``). The one block with
    log-gates of -30 (tokens 16-31) is taken by levels all the same, bit for bit, and the others are not. C = 16: the
    chunk one block (HDLA's default), without the blocks before and after the diagonal."""
    from rankdecay.ops.triton.channel import (_CHANNEL, channel_product, channel_product_bwd, hdla_products,
                                              hdla_products_bwd)
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum
    from rankdecay.ops.triton.factors import hdla_factors_fwd

    gen = torch.Generator().manual_seed(13)
    B, T, H = 1, 50, 2
    q = torch.randn(B, T, H, K, generator=gen).to(DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    g[:, 20:23] = -30.0
    g, beta = g.to(DEVICE), (2 * torch.rand(B, T, H, generator=gen)).to(DEVICE)
    a, b = hdla_factors_fwd(k, g, beta)
    a2_only, none = hdla_factors_fwd(k, g, beta, a2_only=True)  # what the products read: a2, the same
    assert none is None
    # the same formula in two compiles: equal on the CPU, within fp32's rounding on a GPU (FMA contraction may differ)
    assert_matches(a2_only[..., 1, :], a[..., 1, :], 1e-6, "a2 alone")
    gc = chunk_log_cumsum(g, C, torch.float64)
    NC = gc.shape[2]
    full = lambda m, n: torch.full((B, H, NC, m, n), float("nan"), device=DEVICE)  # noqa: E731 (NaN: unwritten)
    ours = [full(C, C), full(C, 2 * C), full(2 * C, 2 * C), full(2 * C, C)]
    monkeypatch.setitem(_CHANNEL, "hdla_pairs", pairs)  # adjacent tokens as row sums, not the last level
    monkeypatch.setitem(_CHANNEL, "hdla_bwd_pairs", pairs)
    monkeypatch.setitem(_CHANNEL, "one_level", one_level)
    hdla_products(q, k, a, gc, beta, *ours, T=T, TC=C, precision="ieee", scale=0.3)
    ref = [full(C, C), full(C, 2 * C), full(2 * C, 2 * C), full(2 * C, C)]
    prod = dict(T=T, TC=C, precision="ieee", lowp=False)
    channel_product(q, k, gc, ref[0], strict=False, scale=0.3, **prod)
    channel_product(q, a, gc, ref[1], strict=False, scale=0.3, **prod)
    channel_product(b, a, gc, ref[2], strict=True, **prod)
    channel_product(b, k, gc, ref[3], strict=True, **prod)
    for name, x, y in zip(["M_QK", "M_QA", "L_BA", "L_BK"], ours, ref):
        assert torch.isfinite(x).all(), f"{name}: entries not written"
        assert_matches(x, y, 1e-6, name)
    # a2 formed in the kernel (the forward without autograd: ``chunk_dplr_fwd``'s hdla_form_a2) from c's key-block
    # shares, which the log-cumsum kernel writes beside the same log-cumsums; a a placeholder never read
    from rankdecay.ops.triton.factors import placeholder

    qd, dch = torch.empty(B, H, NC, C, K, device=DEVICE), torch.empty(B, H, NC, K, device=DEVICE)
    # (on 32-channel key blocks whatever the launch table says, so that K = 37 takes two)
    gc2, parts = chunk_log_cumsum(g, C, torch.float64, prep=(q, k[..., None, :], qd, None, dch, 0.3), c_parts=True,
                                  launch=(32, None))
    assert torch.equal(gc2, gc)
    c = (k * g.exp() * k).sum(-1)  # kᵀ(λ ⊙ k) [B, T, H]
    c_chunks = F.pad(c, (0, 0, 0, NC * C - T)).unflatten(1, (NC, C)).permute(0, 3, 1, 2)  # [B, H, NC, C]
    assert parts.shape[3] == (2 if K == 37 else 1)  # K = 37: two key blocks' shares, summed by the kernels
    assert_matches(parts.sum(3), c_chunks, 1e-6, "c's shares")
    formed = [full(C, C), full(C, 2 * C), full(2 * C, 2 * C), full(2 * C, C)]
    hdla_products(q, k, placeholder((B, T, H, 2, K), torch.float32, DEVICE), gc, beta, *formed, T=T, TC=C,
                  precision="ieee", scale=0.3, c_parts=parts)
    for name, x, y in zip(["M_QK", "M_QA", "L_BA", "L_BK"], formed, ref):
        assert torch.isfinite(x).all(), f"{name}: entries not written (a2 formed)"
        assert_matches(x, y, 1e-6, f"{name} (a2 formed)")
    # the backward (``hdla_products_bwd``) against ``channel_product_bwd``'s four, given the products' gradients
    # everywhere (the entries outside the causal pattern must be ignored), a1 = β k's share folded into k and β
    dps = [torch.randn(x.shape, generator=gen).to(DEVICE) for x in ref]
    monkeypatch.setitem(_CHANNEL, "hdla_bwd_bk", 16)  # K = 37: three key blocks, β's share from the first alone
    grad = lambda m: torch.full((B, H, NC, m, K), float("nan"), device=DEVICE)  # noqa: E731
    mine = [grad(C), grad(C), grad(C), grad(2 * C)]  # pa: a2's rows alone
    dbeta = hdla_products_bwd(q, k, a, gc, beta, *dps, ours[0], ours[3], *mine, T=T, TC=C, precision="ieee",
                              scale=0.3)
    rq, rk, ra, rb = (torch.zeros_like(x) for x in (mine[0], mine[1], mine[3], mine[3]))  # ra: a's 2 C rows
    prod = dict(T=T, TC=C, precision="ieee")
    channel_product_bwd(q, k, gc, dps[0], rq, rk, strict=False, acc_x=False, acc_y=False, **prod)
    channel_product_bwd(q, a, gc, dps[1], rq, ra, strict=False, acc_x=True, acc_y=False, **prod)
    channel_product_bwd(b, a, gc, dps[2], rb, ra, strict=True, acc_x=False, acc_y=True, **prod)
    channel_product_bwd(b, k, gc, dps[3], rb, rk, strict=True, acc_x=True, acc_y=True, **prod)

    def chunks(x):  # [B, T, H, D] -> the chunk layout [B, H, NC, C, D], zeros after T
        return F.pad(x, (0, 0, 0, 0, 0, NC * C - T)).unflatten(1, (NC, C)).permute(0, 3, 1, 2, 4)

    da1 = ra[..., 0::2, :].clone()  # a1 = β k: its share goes to k (times β) and to β (times k)
    rk += chunks(beta.unsqueeze(-1)) * da1
    ra = ra[..., 1::2, :]
    ref_dbeta = (da1 * chunks(k)).sum(-1).flatten(2, 3)[..., :T].transpose(1, 2)
    for name, x, y in zip(["dq", "dk", "da", "db"], mine, (rq, rk, ra, rb)):
        assert torch.isfinite(x).all(), f"{name}: entries not written"
        assert_matches(x, y, 1e-5, f"{name} (backward)")
    assert_matches(dbeta, ref_dbeta, 1e-5, "dbeta (backward)")
    if one_level:  # the six products' form (not stacked) the same within rounding
        monkeypatch.setitem(_CHANNEL, "hdla_stacked", 0)
        six = [full(C, C), full(C, 2 * C), full(2 * C, 2 * C), full(2 * C, C)]
        hdla_products(q, k, a, gc, beta, *six, T=T, TC=C, precision="ieee", scale=0.3)
        for name, x, y in zip(["M_QK", "M_QA", "L_BA", "L_BK"], six, ours):
            assert_matches(x, y, 1e-6, f"{name}: six products against two")
        # against levels everywhere: the strong block the same bits (tokens 16-31)
        monkeypatch.setitem(_CHANNEL, "one_level", 0)
        lev = [full(C, C), full(C, 2 * C), full(2 * C, 2 * C), full(2 * C, C)]
        hdla_products(q, k, a, gc, beta, *lev, T=T, TC=C, precision="ieee", scale=0.3)
        lev_g = [grad(C), grad(C), grad(C), grad(2 * C)]
        hdla_products_bwd(q, k, a, gc, beta, *dps, lev[0], lev[3], *lev_g, T=T, TC=C, precision="ieee", scale=0.3)
        for name, x, y, r in zip(["M_QK", "M_QA", "L_BA", "L_BK", "dq", "dk", "da", "db"], ours + mine, lev + lev_g,
                                 [1, 1, 2, 2, 1, 1, 1, 2]):  # rows per token
            x, y = x.flatten(2, 3), y.flatten(2, 3)  # the chunks' rows in token order
            strong, mild = slice(16 * r, 32 * r), slice(0, 16 * r)
            assert torch.equal(x[:, :, strong], y[:, :, strong]), f"{name}: the strong block not by levels"
            assert not torch.equal(x[:, :, mild], y[:, :, mild]), f"{name}: a mild block by levels"


@pytest.mark.parametrize("grads", [False, True], ids=["forward", "autograd"])
def test_delta_rule_wide_keys(grads, output_form):
    """K = 160 (a 256-wide key tile): the state kernel takes a chunk's rows in two 32-row blocks (not SAME_AK),
    so the forward is not the scaled form (each program would read only part of T'). With the outputs from
    the state kernel, its tied branch once took M_QA U_n for the outputs and skipped the state's Ãᵀ U_n."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 70, 1, 160, generator=gen) for _ in range(3))
    k = F.normalize(k, dim=-1)
    g, beta = F.logsigmoid(torch.randn(1, 70, 1, generator=gen)), 2 * torch.rand(1, 70, 1, generator=gen)
    results = []
    for mode in ("triton", "chunk"):
        xs = [x.to(DEVICE).requires_grad_(grads) for x in (q, k, v, g, beta)]
        with torch.set_grad_enabled(grads):
            o, s = ops.gated_delta_rule(*xs, output_final_state=True, mode=mode)
        out = [o.detach(), s.detach()]
        if grads:
            ((o * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() + s.sin().sum()).backward()
            out += [x.grad for x in xs]
        results.append(out)
    for name, x, y in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"], *results):
        assert_matches(x, y, 1e-5, f"K=160 {output_form}: {name}")


@pytest.fixture
def matmul_precision(request):
    """torch.set_float32_matmul_precision(param) for one test, restored after it."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(request.param)
    yield request.param
    torch.set_float32_matmul_precision(old)


def test_products_precision_follows_pytorch_setting():
    from rankdecay.ops.triton.chunk_state import _precision

    x = torch.zeros(1, device=DEVICE)
    old = torch.get_float32_matmul_precision()
    try:
        got = {}
        for setting in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(setting)
            got[setting] = _precision(x)
    finally:
        torch.set_float32_matmul_precision(old)
    cuda = x.is_cuda
    assert got == {"highest": "tf32x3" if cuda else "ieee", "high": "tf32", "medium": "bf16" if cuda else "bf16_ieee"}


def test_outputs_from_the_state_kernel_where_measured_faster(monkeypatch):
    """``chunk_fwd.fuse_output``: the state kernel forms the outputs on a GPU where its grid fills every SM, and
    for the delta rule's scaled forward (``scalable``) at any grid; not before the backward (``save``) with chunks
    under 64 tokens, nor with a per-channel gate and a low-rank decay at 64; never under the interpreter."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setattr(chunk_fwd, "_sm_count", lambda device: 132)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [chunk_fwd.fuse_output(n, cuda) for n in (32, 131, 132, 256)] == [False, False, True, True]
    assert chunk_fwd.fuse_output(32, cuda, scalable=True)
    assert not chunk_fwd.fuse_output(256, cpu) and not chunk_fwd.fuse_output(32, cpu, scalable=True)
    # saved for the backward: 64-token chunks as without it, shorter ones (HDLA's 32, HH-GDN's 16) never fused
    assert chunk_fwd.fuse_output(256, cuda, save=True, chunk_size=64)
    assert not chunk_fwd.fuse_output(256, cuda, save=True, chunk_size=32)
    assert not chunk_fwd.fuse_output(256, cuda, save=True, chunk_size=16)
    assert chunk_fwd.fuse_output(256, cuda, save=False, chunk_size=32)  # HDLA's forward alone
    # a per-channel gate with a low-rank decay at 64-token chunks (KDA): the output kernel, with or without save
    assert not chunk_fwd.fuse_output(256, cuda, save=False, chunk_size=64, channel_rank=True)
    assert not chunk_fwd.fuse_output(256, cuda, save=True, chunk_size=64, channel_rank=True)
    assert chunk_fwd.fuse_output(256, cuda, save=False, chunk_size=32, channel_rank=True)  # HDLA's forward alone
    # the scaled form: tied keys, the chunk's rows one row block, fused, nothing saved, not turned off
    assert chunk_fwd.scaled_update(True, True, True, False)
    assert not chunk_fwd.scaled_update(False, True, True, False)
    assert not chunk_fwd.scaled_update(True, False, True, False)  # the chunk's rows in two blocks (K > 128)
    assert not chunk_fwd.scaled_update(True, True, False, False)
    assert not chunk_fwd.scaled_update(True, True, True, True)
    assert not chunk_fwd.scaled_update(True, True, True, False, False)
    # its state kernel on a 32-wide value block where 64 leaves SMs idle
    widths = [chunk_fwd.state_value_block(True, 64, bh, 128, cuda) for bh in (16, 32, 65, 66, 128)]
    assert widths == [32, 32, 32, 64, 64]
    assert chunk_fwd.state_value_block(False, 64, 16, 128, cuda) == 64
    assert chunk_fwd.state_value_block(True, 32, 16, 128, cuda) == 32
    assert chunk_fwd.state_value_block(True, 64, 16, 128, cpu) == 64
    # the delta rule's walk before the backward at K > 128 on a 16-wide block (its [K, 32] tiles spill)
    assert chunk_fwd.state_value_block(False, 32, 64, 256, cuda, tied_save=True, K=256) == 16
    assert chunk_fwd.state_value_block(False, 32, 64, 256, cuda, tied_save=False, K=256) == 32
    assert chunk_fwd.state_value_block(False, 64, 64, 128, cuda, tied_save=True, K=128) == 64
    assert chunk_fwd.state_value_block(False, 32, 64, 256, cpu, tied_save=True, K=256) == 32


def test_intra_kernel_register_cap_only_where_measured():
    """The intra kernel runs under a 168-register cap only for the delta rule's scaled forward at the bf16
    products' precision with 16-bit k and v and K <= 128 (``chunk_fwd.intra_registers``): there it compiles
    without spills for sm_90 and was faster on the H100; elsewhere the compiler chooses."""
    from rankdecay.ops.triton.chunk_fwd import intra_registers

    k16, v16 = torch.zeros(1, 1, 1, 1, 128, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 1, 128, dtype=torch.bfloat16)
    assert intra_registers(True, "bf16", k16, v16) == 168
    assert intra_registers(False, "bf16", k16, v16) is None
    assert {intra_registers(True, p, k16, v16) for p in ("tf32x3", "tf32", "ieee", "bf16_ieee")} == {None}
    assert intra_registers(True, "bf16", k16.float(), v16) is None
    assert intra_registers(True, "bf16", torch.zeros(1, 1, 1, 1, 256, dtype=torch.bfloat16), v16) is None


@pytest.mark.parametrize("Rkv", [1, 2])
def test_fused_forward_with_tf32_merges(Rkv, monkeypatch):
    """The inverse's TF32 merges (a benchmarking knob) give the same forward: the 64-row inverse (Rkv = 1: four
    16-row blocks) and the 32-row one (Rkv = 2: 32-token chunks). Under the interpreter a TF32 product is exact, so
    to 1e-5; on a GPU the merges round their operands to TF32, so to one unit of its rounding, 2^-11 (the H200
    measured 2.1e-5 and 1.7e-5; a wrong merge is off by order one)."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "merge", "tf32")
    inputs = random_inputs(1, 70, 2, 16, 8, 1, Rkv, "scalar")
    with torch.no_grad():
        got, ref = run("triton", inputs, grads=False), run("chunk", inputs, grads=False, chunk_size=16)
    tol = 2 ** -11 if got[0].is_cuda else 1e-5
    for name, x, y in zip(["o", "final_state"], got, ref):
        assert_matches(x, y, tol, f"Rkv={Rkv}: {name}")


@pytest.mark.parametrize("neumann", [True, False], ids=["neumann", "substitution"])
@pytest.mark.parametrize("Rab", [1, 2, 3, 4])
def test_ut_inverse_diagonal_blocks_both_ways(Rab, neumann, monkeypatch):
    """The UT inverse's 16-row diagonal blocks as Neumann products (16 / padded Rab tokens per block, so two to
    six batched products: ``chunk_fwd.neumann_blocks``) and by forward substitution: outputs, final state and
    every gradient against mode="chunk", β up to 2, T = 70. The default takes the products (HDLA's fused rows then
    on 4 warps, on 2 with the substitution), and the knob forces either way."""
    from rankdecay.ops.triton import chunk_fwd

    assert chunk_fwd.neumann_blocks() and chunk_fwd.neumann_blocks(True) and not chunk_fwd.neumann_blocks(False)
    assert chunk_fwd.intra_warps(True) == 4 and chunk_fwd.intra_warps(True, neumann=False) == 2
    assert chunk_fwd.intra_warps(False, neumann=False) == 4
    assert chunk_fwd.intra_warps(False, hh=True) == 2  # Head-in-Head's up to K = 128 (BENCHMARKS.md session 58)
    monkeypatch.setitem(chunk_fwd._KNOBS, "neumann", neumann)
    inputs = random_inputs(1, 70, 2, 16, 8, Rab, 1, "scalar", beta_max=2.0, seed=Rab)
    got, ref = run("triton", inputs), run("chunk", inputs, chunk_size=16)
    for name, x, y in zip(names(inputs), got, ref):
        assert_matches(x, y, 1e-5, f"Rab={Rab} neumann={neumann}: {name}")


def test_tensors_between_kernels_16bit_only_where_products_are():
    """bf16 between the fused kernels by default only on a GPU at the bf16 products' precision and
    K <= 128 (``chunk_fwd.stored_dtype``; at K > 128 the state kernel's 32-wide value block was
    miscompiled with bf16 operands on Triton 3.6 / H100)."""
    from rankdecay.ops.triton.chunk_fwd import stored_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert stored_dtype("bf16", 128, cuda) == torch.bfloat16
    assert stored_dtype("bf16", 256, cuda) == torch.float32
    assert {stored_dtype(p, 64, cuda) for p in ("tf32x3", "tf32", "ieee")} == {torch.float32}
    assert stored_dtype("bf16_ieee", 64, cpu) == torch.float32


def test_state_kernel_pipelined_only_where_measured():
    """The forward state kernel's chunk loop on two pipeline stages only at the bf16 products' precision with
    16-bit k and v and K <= 128 (``chunk_fwd.state_stages``), for the delta rule's fused forward, a per-channel
    gate's state kernel without the outputs, the walk that stores the states with a decay per row (Head-in-Head's
    training forward) and a per-channel gate's fused walk without a low-rank decay (GLA), and on three for a
    per-channel gate's scaled form (KDA's and HDLA's forward without autograd): elsewhere it was slower (HDLA's
    fused forward) or ran out of shared memory (fp32 tiles) on the H100. The backward's on two stages at the bf16
    precision with 16-bit tiles and K <= 128 (``chunk_state.bwd_stages``). Since session 59 also the delta rule's walk
    before a separate output kernel, and no longer the walk with the engine's own rows (not Head-in-Head's)."""
    from rankdecay.ops.triton.chunk_fwd import state_stages
    from rankdecay.ops.triton.chunk_state import _LAUNCH, bwd_stages

    bf, f32 = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 128)
    assert state_stages(True, True, "bf16", bf, bf) == 2
    assert state_stages(True, True, "bf16", bf.half(), bf.half()) == 2
    assert state_stages(False, True, "bf16", bf, bf) == 2  # the separate output kernel (session 59)
    assert state_stages(True, False, "bf16", bf, bf) == 1  # not the delta rule
    assert state_stages(False, False, "bf16", bf, bf, per_channel=True) == 2  # HDLA before its backward
    assert state_stages(True, False, "bf16", bf, bf, per_channel=True) == 1  # HDLA's fused forward
    assert state_stages(True, False, "bf16", bf, bf, per_channel=True, low_rank=False) == 2  # GLA's (session 57)
    assert state_stages(False, False, "bf16", bf, bf, hh=True) == 2  # HH-GDN's training forward (session 57)
    assert state_stages(False, False, "bf16", bf, bf) == 1  # the engine's own rows, to the backward (session 59)
    assert state_stages(False, False, "tf32", bf, bf, hh=True) == 1
    assert state_stages(False, True, "tf32", bf, bf) == 1
    assert state_stages(False, False, "bf16", f32, bf, per_channel=True) == 1
    assert state_stages(True, True, "tf32", bf, bf) == 1
    assert state_stages(False, False, "tf32", bf, bf, per_channel=True) == 1
    wide = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert state_stages(True, True, "bf16", wide, bf) == 1
    assert state_stages(False, False, "bf16", wide, bf, per_channel=True) == 1
    for fuse, tied in ((True, False), (True, True)):  # KDA's scaled form, HDLA's (passed as tied)
        assert state_stages(fuse, tied, "bf16", bf, bf, per_channel=True, channel_scaled=True) == 3
    assert state_stages(True, False, "bf16", f32, bf, per_channel=True, channel_scaled=True) == 1
    assert state_stages(True, False, "tf32", bf, bf, per_channel=True, channel_scaled=True) == 1
    assert state_stages(True, False, "bf16", wide, bf, per_channel=True, channel_scaled=True) == 1
    assert _LAUNCH["bwd_stages"] == 0  # the rule below, not a knob
    assert bwd_stages("bf16", 128, True) == 2 and bwd_stages("bf16", 64, True) == 2
    assert bwd_stages("bf16", 256, True) == 1  # wider tiles
    assert bwd_stages("bf16", 128, False) == 1  # fp32 do
    assert bwd_stages("bf16_ieee", 128, True) == 1 and bwd_stages("tf32", 128, True) == 1  # fp32 stored tiles


def test_intra_kernel_width_by_mechanism(monkeypatch):
    """The intra kernel on 2 warps for HDLA's rows formed in the kernel with the UT inverse's diagonal blocks by
    substitution alone (``chunk_fwd.intra_warps``), where it was measured faster (BENCHMARKS.md session 31); with
    the Neumann blocks (the default) on 4 (session 35), as GDN and Gated DeltaProduct. Checked on the launch itself:
    HDLA's at the bf16 precision either way, GDN's, and HDLA's at fp32 accuracy (its rows as given)."""
    from rankdecay.ops.triton import chunk_fwd

    warps = {}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: warps.__setitem__(self.name, kw["num_warps"])

    for name in ("_intra_kernel", "_state_fwd_kernel", "_output_kernel"):
        monkeypatch.setattr(chunk_fwd, name, Capture(name))
    monkeypatch.setattr(chunk_fwd, "hdla_products", lambda *args, **kw: None)
    B, T, H, K = 1, 40, 2, 16  # on DEVICE: the kernels not captured here (the log-cumsum's) run on a GPU too
    q, k, v, g = (torch.randn(B, T, H, K, device=DEVICE) for _ in range(4))
    beta = torch.rand(B, T, H, device=DEVICE)
    a, b = torch.randn(B, T, H, 2, K, device=DEVICE), torch.randn(B, T, H, 2, K, device=DEVICE)
    for prec, neumann, want in (("bf16", None, 4), ("bf16", False, 2), ("ieee", None, 4), ("ieee", False, 4)):
        warps.clear()
        chunk_fwd.chunk_dplr_fwd(q, k[..., None, :], v[..., None, :], a, b, g, 0.1, None, hdla_beta=beta,
                                 _config=dict(precision=prec, neumann=neumann))
        assert warps["_intra_kernel"] == want, (prec, neumann)
    warps.clear()
    k1 = k[..., None, :]
    chunk_fwd.chunk_dplr_fwd(q, k1, v[..., None, :], k1, k1, g[..., :1], 0.1, None)
    assert warps["_intra_kernel"] == 4


def test_log_cumsum_launch_by_chunk_size(monkeypatch):
    """The log-cumsum kernel's key block and warps by tokens per chunk (``chunk_fwd.log_cumsum_launch``): HDLA's
    32-token chunks (at 64-row tiles; KDA's now) on their own launch, measured faster there (BENCHMARKS.md session
    32), and 16-token ones (HDLA's, session 42; with PREP on 64-channel blocks since session 58); 64-token chunks,
    and sizes without a measurement of their own, on 64's. Checked on the launch itself: its grid over key blocks
    and its warps."""
    from rankdecay.ops.triton import chunk_fwd

    seen = []

    class Capture:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid[0], kw["num_warps"], kw["PREP"]))

    monkeypatch.setattr(chunk_fwd, "_chunk_log_cumsum_kernel", Capture())
    B, T, H, K = 1, 40, 2, 128
    g, q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, 1, K)
    for C in (32, 64, 16, 8):
        NC = -(-T // C)
        qd, kd, dch = torch.empty(B, H, NC, C, K), torch.empty(B, H, NC, C, K), torch.empty(B, H, NC, K)
        chunk_fwd.chunk_log_cumsum(g, C, torch.float32)
        chunk_fwd.chunk_log_cumsum(g, C, torch.float32, prep=(q, k, qd, kd, dch, 0.1))
    # K = 128 over the key block: (plain, PREP) at 32 tokens, then at 64, 16, and 8 (64's launch)
    assert seen == [(2, 2, False), (4, 1, True), (8, 2, False), (8, 8, True), (2, 1, False), (2, 1, True),
                    (8, 2, False), (8, 8, True)]


@pytest.mark.parametrize("stored", [None, torch.float16], ids=["fp32-between", "16-bit-between"])
@pytest.mark.parametrize("matmul_precision", ["medium"], indirect=True)
@pytest.mark.parametrize("Rab,Rkv,gate", [(1, 1, "scalar"), (2, 1, "channel"), (0, 1, "channel")])
def test_bf16_products_under_medium_matmul_precision(Rab, Rkv, gate, matmul_precision, stored, monkeypatch):
    """torch.set_float32_matmul_precision("medium"): the kernels take their products in bf16 with fp32
    accumulation (fla's precision), forward and backward. On inputs that bf16 holds exactly, every
    error against fp64 is then bf16-sized: above 2^-12 (the setting took effect; at "highest" they are
    ~1e-7) and at most 2^-5, eight units of bf16's 2^-8 spacing, for chains of a few rounded products.
    ``stored``: the per-chunk tensors between kernels in 16 bits (``chunk_fwd._KNOBS``), which
    changes nothing beyond that rounding."""
    from rankdecay.ops.triton import chunk_fwd

    if stored is not None:
        monkeypatch.setitem(chunk_fwd._KNOBS, "stored", stored)
        q, k, v, a, b, g, h0 = random_inputs(1, 20, 1, 16, 16, Rab, Rkv, gate)
        _, _, saved = chunk_fwd.chunk_dplr_fwd(q, k, v, a, b, None, 1.0, h0, save=True)
        assert {n: saved[n].dtype for n in ("s0", "u", "mqk")} == dict.fromkeys(("s0", "u", "mqk"), stored)
    inputs = [None if x is None else x.bfloat16().float() for x in random_inputs(2, 37, 2, 16, 8, Rab, Rkv, gate)]
    exact = run("chunk", [None if x is None else x.double() for x in inputs], chunk_size=16)
    got = run("triton", inputs, chunk_size=16)
    for name, x, e in zip(names(inputs), got, exact):
        err = rel_rms(x, e)
        assert torch.isfinite(x).all(), f"{name}: not finite"
        assert 2 ** -12 < err <= 2 ** -5, f"Rab={Rab} gate={gate} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("name", ["hh_gated_delta_rule", "kda", "hdla"])
@pytest.mark.parametrize("matmul_precision", ["medium", "highest"], indirect=True)
def test_decay_rows_16bit_only_under_bf16_products(name, matmul_precision, monkeypatch):
    """The mechanisms' decay rows formed in a kernel (Head-in-Head's b = k ⊙ M, KDA's b = e^g ⊙ k, HDLA's a2) keep
    bf16 k's 16 bits where the kernels round them to bf16 for their products anyway ("medium": bf16 inputs, every
    result and gradient within 2^-5 of fp64), and stay fp32 elsewhere ("highest": fp32 inputs, within 1e-5 of the
    PyTorch path). Strong decays (log-gates to -30), β up to 2, T = 37."""
    from rankdecay.ops.triton import chunk_bwd

    seen = []
    dplr_call, dplr_rows, hdla_rows = dplr_module.dplr, dplr_module._dplr, chunk_bwd.hdla_factors_fwd
    monkeypatch.setattr(ops.mechanisms, "dplr", lambda *a, **kw: seen.append(a[4].dtype) or dplr_call(*a, **kw))
    monkeypatch.setattr(ops.mechanisms, "_dplr", lambda *a, **kw: seen.append(a[4].dtype) or dplr_rows(*a, **kw))
    monkeypatch.setattr(chunk_bwd, "hdla_factors_fwd",
                        lambda *a, **kw: (lambda r: seen.append(r[0].dtype) or r)(hdla_rows(*a, **kw)))
    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 1, 37, 2, 16, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = 2 * torch.rand(B, T, H, generator=gen)
    if name == "hh_gated_delta_rule":
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2)
        extra = [ops.head_in_head_mask(torch.rand(H, 4, 4, generator=gen)), g]
        op, names_ = ops.hh_delta_rule, ["dbeta", "dmask", "dg"]
    else:
        extra = [-30 * torch.rand(B, T, H, K, generator=gen) ** 3, beta]  # k, v's gate then β
        op, names_ = (ops.kda if name == "kda" else ops.hdla), ["dg", "dbeta"]
    low = matmul_precision == "medium"
    inputs = [x.bfloat16() if low else x for x in (q, k, v)] + ([beta] if name == "hh_gated_delta_rule" else []) + extra

    def call(mode, dtype=None):
        xs = [(x.to(dtype) if dtype else x).to(DEVICE).clone().requires_grad_() for x in inputs]
        o, s = op(*xs, mode=mode, output_final_state=True, chunk_size=16)
        ((o.double() * torch.linspace(-1, 1, V, device=o.device, dtype=torch.float64)).sum()
         + s.double().sin().sum()).backward()
        return [o, s] + [x.grad for x in xs]

    # the backward's register caps (``chunk_bwd._register_cap``, ``channel.hdla_products_bwd``'s), bf16 alone
    caps, channel = [], importlib.import_module("rankdecay.ops.triton.channel")
    for module in (chunk_bwd, channel):
        cap = module._maxnreg
        monkeypatch.setattr(module, "_maxnreg", lambda n, cap=cap: (caps.append(n) if n else None) or cap(n))
    got = call("triton")
    assert seen[:1] == [torch.bfloat16 if low else torch.float32], seen
    expect = {"hh_gated_delta_rule": [168], "kda": [168, 168, 128, 128], "hdla": [128, 168]}[name] if low else []
    assert sorted(caps) == sorted(expect), f"{name} at {matmul_precision}: register caps {caps}"
    names_ = ["o", "s", "dq", "dk", "dv"] + names_
    if low:
        exact = call("chunk", torch.float64)
        _assert_near_fp64(names_, got, exact, exact, matmul_precision)  # at "medium" the bound is 2^-5 alone
    else:
        for n, x, y in zip(names_, got, call("chunk")):
            assert_matches(x, y, 1e-5, f"{name} {n}")
        seen.clear()  # and bf16 keys at "highest" still get fp32 rows
        call("triton", torch.bfloat16)
        assert seen[:1] == [torch.float32], seen


@pytest.mark.parametrize("Rab", [0, 1])
def test_output_kernel_value_blocks(Rab, monkeypatch, output_form):
    """The output kernel's value block (``output_bv``: 128 with bf16 products, else 64) over
    V = 130: a full block and a partial one, at fp32 accuracy so any misplaced column shows."""
    from rankdecay.ops.triton import chunk_fwd

    inputs = random_inputs(1, 20, 1, 16, 130, Rab, 1, "scalar")
    ref = run("chunk", inputs, grads=False, chunk_size=16)
    for bv in (64, 128):
        monkeypatch.setitem(chunk_fwd._KNOBS, "output_bv", bv)
        got = run("triton", inputs, grads=False, chunk_size=16)
        for name, x, y in zip(("o", "final_state"), got, ref):
            assert_matches(x, y, 1e-5, f"output_bv={bv} Rab={Rab}: {name}")


def test_row_scales_checked():
    q, k, v, a, b, g, h0 = random_inputs(1, 5, 2, 16, 8, 2, 1, "scalar")
    with pytest.raises(ValueError, match=r"a_scale must have shape \[B, T, H\] or \[B, T, H, Rab\]"):
        ops.dplr(q, k, v, a, b, g, a_scale=torch.ones(1, 5, 2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="a_scale scales the rows of a, but a is None"):
        ops.dplr(q, k, v, a_scale=torch.ones(1, 5, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"v_scale must have shape \[B, T, H\]"):
        ops.dplr(q, k[..., 0, :], v[..., 0, :], v_scale=torch.ones(1, 5, 2, 2, device=DEVICE))


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_cu_seqlens(gate, path, monkeypatch):
    """cu_seqlens on mode="triton" against the per-token loop ("naive", which pads each sequence to the longest):
    the fused kernels, and the unfused path (ranks above 4), where the sequences lie along one row from a chunk each
    and one launch of the Triton state kernel walks every sequence by programs of its own (``offsets``: 1, 0, 3 and 1
    chunks of 16 tokens)."""
    from rankdecay.ops.triton import chunk_state

    seen = []
    walk = chunk_state._ChunkStatePassing.apply
    monkeypatch.setattr(chunk_state._ChunkStatePassing, "apply", lambda h0, d, kd, *rest: seen.append(
        (kd.shape[2], rest[-2].tolist(), rest[-1])) or walk(h0, d, kd, *rest))
    inputs = random_inputs(1, 50, 2, 16, 16, 2, 1, gate)
    h0 = torch.randn(4, 2, 16, 16, device=DEVICE)
    inputs[-1] = h0
    cu = torch.tensor([0, 7, 7, 40, 50], device=DEVICE)  # an empty sequence, too
    got, ref = run("triton", inputs, chunk_size=16, cu_seqlens=cu), run("naive", inputs, cu_seqlens=cu)
    for name, x, y in zip(names(inputs), got, ref):
        assert_matches(x, y, 1e-5, f"cu_seqlens: {name}")
    assert seen == ([(5, [0, 16, 16, 64, 80], 16)] if path == "unfused" else []), seen


@pytest.mark.parametrize("mechanism, host", [("gdn", True), ("hdla", True), ("hh", True), ("gdn", False),
                                             ("hh", False)], ids=["gdn", "hdla", "hh", "gdn-compiling", "hh-compiling"])
def test_cu_seqlens_along_one_row(mechanism, host, monkeypatch):
    """With cu_seqlens the fused kernels take the sequences along one row, each from a multiple of 64 tokens
    (``_inputs.varlen_aligned``; the state kernels walk each sequence's chunks from its own initial state,
    ``chunk_state._segment``'s VARLEN), not padded to the longest: sequences of 70, 0, 5 and 125 tokens, several
    chunks each, lie on 320 tokens (not 4 x 125). Gated DeltaNet (64-token chunks), HDLA (a per-channel gate, 16)
    and Head-in-Head (its rows); strong decays and β up to 2; the output, final states and every gradient, the
    initial states' included, against mode="chunk", with autograd and without. While compiling (``host`` False:
    ``canonicalize`` keeps the lengths off the host) the row is as long as any 4 sequences of these 200 tokens may
    need, 512, and the last sequence walks on over the zero tokens to its end (every chunk is walked; Gated DeltaNet,
    and Head-in-Head, whose mask's gradient sums over every chunk)."""
    import rankdecay.ops._inputs as inputs
    import rankdecay.ops.triton as kernels
    from rankdecay.ops.triton import chunk_bwd

    if not host:
        monkeypatch.setattr(inputs, "_compiling", lambda: True)

    seen = []
    forward = chunk_bwd.chunk_dplr_fwd
    for module in (kernels, chunk_bwd):  # (the forward alone, and the autograd Function's)
        monkeypatch.setattr(module, "chunk_dplr_fwd", lambda *a, **kw: seen.append(kw.get("offsets")) or forward(*a,
                                                                                                            **kw))
    gen = torch.Generator().manual_seed(4)
    lengths, H, K, V = [70, 0, 5, 125], 2, 16, 8
    T, N = sum(lengths), len(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
    q, v = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, V, generator=gen)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    g = -30 * torch.rand(1, T, H, *((K,) if mechanism == "hdla" else ()), generator=gen)
    g[:, 100] = -1e4
    beta = 2 * torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(N, H, K, V, generator=gen)
    mask = ops.head_in_head_mask(torch.rand(H, 2, 2, generator=gen) + 0.5)

    def call(mode, xs):
        q, k, v, g, beta, h0 = xs
        kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, mode=mode)
        if mechanism == "gdn":
            return ops.gated_delta_rule(q, k, v, g, beta, **kw)
        if mechanism == "hdla":
            return ops.hdla(q, k, v, g, beta, **kw)
        return ops.hh_delta_rule(q, k, v, beta, mask.to(DEVICE), g, **kw)

    for grad in (False, True):
        results = []
        for mode in ("triton", "chunk"):
            xs = [x.to(DEVICE).clone().requires_grad_(grad) for x in (q, k, v, g, beta, h0)]
            with torch.set_grad_enabled(grad):
                o, s = call(mode, xs)
                if grad:
                    ((o * torch.linspace(-1, 1, V, device=o.device)).sum() + s.sin().sum()).backward()
            results.append([o.detach(), s.detach()] + ([x.grad for x in xs] if grad else []))
        labels = ["o", "final_state"] + (["dq", "dk", "dv", "dg", "dbeta", "dh0"] if grad else [])
        for name, x, y in zip(labels, *results, strict=True):
            assert torch.isfinite(x).all(), name
            assert_matches(x, y, 1e-5, f"{mechanism} cu_seqlens autograd={grad}: {name}")
    row = 320 if host else 512
    assert len(seen) == 2 and all(x is not None and x.tolist() == [0, 128, 128, 192, row] for x in seen), seen


def test_cu_seqlens_of_one_sequence_is_the_plain_call(monkeypatch):
    """cu_seqlens = [0, T] runs as the call without it: no packing, no ``offsets``, so that on a GPU one long
    sequence keeps its walk in segments (``chunk_fwd.segments``, which a packed row goes without); the same
    output and final state, bit for bit. HDLA and KDA."""
    import rankdecay.ops.triton as kernels
    from rankdecay.ops.triton import chunk_bwd

    seen = []
    forward = kernels.chunk_dplr_fwd
    for module in (kernels, chunk_bwd):
        monkeypatch.setattr(module, "chunk_dplr_fwd", lambda *a, **kw: seen.append(kw.get("offsets")) or forward(*a,
                                                                                                            **kw))
    q, k, v, g, beta, h0 = (x.to(DEVICE) for x in _kda_inputs(seed=5, strong=False))
    kw = dict(initial_state=h0, output_final_state=True, mode="triton")
    for fn in (ops.hdla, ops.kda):
        seen.clear()
        with torch.no_grad():
            plain = fn(q, k, v, g, beta, **kw)
            packed = fn(q, k, v, g, beta, cu_seqlens=torch.tensor([0, q.shape[1]], device=DEVICE), **kw)
        assert seen == [None, None] and torch.equal(plain[0], packed[0]) and torch.equal(plain[1], packed[1]), seen


def test_kda_cu_seqlens_without_and_with_autograd(monkeypatch):
    """kda with cu_seqlens on the kernels against mode="chunk": with autograd or without, its b is a placeholder that
    the sequences' packing leaves alone and the fused kernels never read (``chunk_dplr_fwd``'s kda_b), and a stays k
    through the packing, so its products are paired with k's (one product kernel a forward) and no factor kernel
    runs. Three sequences, one empty, strong decays, an initial state per sequence."""
    from rankdecay.ops.triton import chunk_fwd, factors

    factor_fwd, pairs = [], []
    forward, product = factors._KDAFactor.forward, chunk_fwd.channel_product
    monkeypatch.setattr(factors._KDAFactor.function, "forward",
                        staticmethod(lambda ctx, *x: factor_fwd.append(1) or forward(ctx, *x)))
    monkeypatch.setattr(chunk_fwd, "channel_product",
                        lambda *a, **kw: pairs.append(kw.get("x2") is not None) or product(*a, **kw))
    q, k, v, g, beta, _ = _kda_inputs(seed=9, strong=True)
    h0 = torch.randn(3, 2, 16, 8)
    cu = torch.tensor([0, 23, 23, 70])
    for grad in (False, True):
        results = []
        for mode in ("triton", "chunk"):
            xs = [x.to(DEVICE).clone().requires_grad_(grad) for x in (q, k, v, g, beta, h0)]
            with torch.set_grad_enabled(grad):
                o, s = ops.kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu.to(DEVICE),
                               mode=mode)
                if grad:
                    ((o * torch.linspace(-1, 1, 8, device=o.device)).sum() + s.sin().sum()).backward()
            results.append([o.detach(), s.detach()] + ([x.grad for x in xs] if grad else []))
        labels = ["o", "final_state"] + (["dq", "dk", "dv", "dg", "dbeta", "dh0"] if grad else [])
        for name, x, y in zip(labels, *results, strict=True):
            assert torch.isfinite(x).all(), name
            assert_matches(x, y, 1e-5, f"kda cu_seqlens autograd={grad}: {name}")
    assert pairs == [True, True] and not factor_fwd, (pairs, factor_fwd)


def test_mechanisms_route_through_triton():
    """Every mechanism function reaches the kernels through mode="triton"."""
    B, T, H, K = 1, 20, 2, 16
    q, v = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, K, device=DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, device=DEVICE), dim=-1)
    beta, g = torch.rand(B, T, H, device=DEVICE), F.logsigmoid(torch.randn(B, T, H, device=DEVICE))
    lam = F.logsigmoid(torch.randn(B, T, H, K, device=DEVICE))
    mask = ops.head_in_head_mask(torch.rand(H, 4, 4, device=DEVICE))
    calls = {
        "gated_delta_rule": lambda m: ops.gated_delta_rule(q, k, v, g, beta, mode=m, chunk_size=16),
        "hdla": lambda m: ops.hdla(q, k, v, lam, 2 * beta, mode=m, chunk_size=16),
        "hh_delta_rule": lambda m: ops.hh_delta_rule(q, k, v, beta, mask, g, mode=m, chunk_size=16),
        "gla": lambda m: ops.gla(q, k, v, lam, mode=m, chunk_size=16),
        "kda": lambda m: ops.kda(q, k, v, lam, beta, mode=m, chunk_size=16),
        "gated_delta_product": lambda m: ops.gated_delta_product(q[:, :10], k, v, g[:, :10], beta, 2, mode=m,
                                                                 chunk_size=16),
    }
    for name, call in calls.items():
        assert_matches(call("triton")[0], call("chunk")[0], 1e-5, name)
        with torch.no_grad():
            assert_matches(call("fused_recurrent")[0], call("naive")[0], 1e-5, name)


def _kda_inputs(seed, strong):
    """kda's (q, k, v, g, beta, h0) on the CPU at B1 T70 H2 K16 V8 (T = 70 leaves a partial 64-token chunk); strong:
    log-gates of -30 per step and one of -1e4, β up to 2 (and one of 2)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 70, 2, 16, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g = -30 * torch.rand(B, T, H, K, generator=gen) if strong else F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = (2 if strong else 1) * torch.rand(B, T, H, generator=gen)
    if strong:
        g[:, 40], beta[0, 0] = -1e4, 2.0
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen)


@pytest.mark.parametrize("pair,rows,pair_bwd", [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1)],
                         ids=["two-products", "one-kernel", "rows-in-step4", "one-pass-backward"])
@pytest.mark.parametrize("strong", [False, True])
def test_kda_matches_pytorch_chunk(strong, pair, rows, pair_bwd, monkeypatch):
    """kda through the fused kernels against mode="chunk": outputs, final state, every gradient; T = 70 leaves a
    partial 64-token chunk; strong: log-gates of -30 per step, one of -1e4, β up to 2. a is k there, so the
    forward takes two per-channel products, each written with and without β (``out_scaled``), and the backward
    their gradients in two passes (``dp_scaled``): checked. By default the forward takes both in one kernel, L_BK and
    L_BA from k through G_t (``channel_product``'s x2: b = e^g ⊙ k); with ``_KNOBS["kda_pair"] = 0`` in two. By
    default (``_KNOBS["kda_rows"] = 1``) step 4 forms b from k and g and carries a's and b's gradients on to k and g
    itself, so b's factor kernel has no backward to run (checked); with 0, autograd takes them through it. With
    ``_KNOBS["kda_pair_bwd"] = 1`` the backward takes the four products' gradients in one pass too, b's rows as k's
    through G_t (``channel_product_bwd``'s x2), and step 4 reads their share in that form (checked: one pass). With
    all three (the defaults) nothing reads b, which ``kda`` passes as a placeholder, so its factor kernel does not
    run at all (checked; the intra kernel forms B ⊙ e^{G_{t-1}} as K ⊙ e^{G_t}: its KDA_B); else it is built."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd, factors

    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_pair", pair)
    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_rows", rows)
    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_pair_bwd", pair_bwd)
    factor_fwd, factor_bwd = [], []
    forward, backward = factors._KDAFactor.forward, factors._KDAFactor.backward
    monkeypatch.setattr(factors._KDAFactor.function, "forward",
                        staticmethod(lambda ctx, *x: factor_fwd.append(1) or forward(ctx, *x)))
    monkeypatch.setattr(factors._KDAFactor.function, "backward",
                        staticmethod(lambda ctx, *g: factor_bwd.append(1) or backward(ctx, *g)))
    dual, dual_bwd = [], []
    product, product_bwd = chunk_fwd.channel_product, chunk_bwd.channel_product_bwd
    monkeypatch.setattr(chunk_fwd, "channel_product", lambda *a, **kw: dual.append(
        (kw.get("out_scaled") is not None) + (kw.get("out2_scaled") is not None)) or product(*a, **kw))
    monkeypatch.setattr(chunk_bwd, "channel_product_bwd",
                        lambda *a, **kw: dual_bwd.append((kw.get("dp_scaled") is not None) + (kw.get("x2") is not None))
                        or product_bwd(*a, **kw))
    q, k, v, g, beta, h0 = _kda_inputs(seed=3, strong=strong)
    V = v.shape[-1]

    def grads(mode):
        xs = [x.to(DEVICE).clone().requires_grad_() for x in (q, k, v, g, beta, h0)]  # a leaf per call
        o, s = ops.kda(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode)
        ((o * torch.linspace(-1, 1, V, device=o.device)).sum() + s.sin().sum()).backward()
        return [o.detach(), s.detach()] + [x.grad for x in xs]

    got, ref = grads("triton"), grads("chunk")
    assert dual == ([1, 1] if pair == 0 else [2]) and dual_bwd == ([2] if pair_bwd else [1, 1]), (dual, dual_bwd)
    assert factor_fwd == ([] if pair and rows and pair_bwd else [1]), factor_fwd
    assert factor_bwd == ([] if rows else [1]), factor_bwd
    for name, x, y in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
        assert torch.isfinite(x).all(), name
        assert_matches(x, y, 1e-5, f"kda strong={strong} kda_pair={pair} kda_rows={rows} pair_bwd={pair_bwd}: {name}")


@pytest.mark.parametrize("nh,gated,strong,varlen", [(2, True, True, False), (3, False, False, False),
                                                     (2, True, False, True)])
def test_gated_delta_product_interleaved_matches_rank_machinery(nh, gated, strong, varlen, monkeypatch):
    """gated_delta_product on the kernels takes the interleaved sequence (Gated DeltaNet over T * n_h sub-steps,
    the gate on each token's first, the query on its last); mode="chunk" takes the rank machinery (Rab = Rkv = n_h).
    Outputs, final state and every gradient agree; T = 37 leaves partial chunks; strong: log-gates of -30, one of
    -1e4, β up to 2; varlen: cu_seqlens (an empty sequence too) with a state per sequence. Checked: the kernels'
    call saw T * n_h rows."""
    from rankdecay.ops.triton import chunk_bwd

    rows = []
    one_node, dplr_call = chunk_bwd.chunk_gated_delta_rule, dplr_module.dplr
    monkeypatch.setattr(chunk_bwd, "chunk_gated_delta_rule",
                        lambda q, *a, **kw: rows.append(q.shape[1]) or one_node(q, *a, **kw))
    monkeypatch.setattr(ops.mechanisms, "dplr",
                        lambda q, *a, **kw: rows.append(q.shape[1]) or dplr_call(q, *a, **kw))
    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = 1, 37, 2, 16, 8
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T * nh, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T * nh, H, V, generator=gen)
    beta = (2 if strong else 1) * torch.rand(B, T * nh, H, generator=gen)
    g = (-30 * torch.rand(B, T, H, generator=gen) if strong else F.logsigmoid(torch.randn(B, T, H, generator=gen)))
    if strong:
        g[:, 20], beta[0, 0] = -1e4, 2.0
    cu = torch.tensor([0, 11, 11, T]) if varlen else None
    h0 = torch.randn(3 if varlen else B, H, K, V, generator=gen)
    inputs = (q, k, v, g, beta, h0) if gated else (q, k, v, beta, h0)

    def grads(mode):
        xs = [x.to(DEVICE).clone().requires_grad_() for x in inputs]  # a leaf per call
        *qkv, beta_, h0_ = xs
        g_ = qkv.pop() if gated else None
        o, s = ops.gated_delta_product(*qkv, g_, beta_, nh, initial_state=h0_, output_final_state=True, mode=mode,
                                       cu_seqlens=None if cu is None else cu.to(DEVICE))
        ((o * torch.linspace(-1, 1, V, device=o.device)).sum() + s.sin().sum()).backward()
        return [o.detach(), s.detach()] + [x.grad for x in xs]

    got = grads("triton")
    assert rows and set(rows) == {T * nh}, rows  # (twice on a GPU: the call again inside, on heads padded to 16)
    rows.clear()
    ref = grads("chunk")
    assert rows == [T], rows  # the rank machinery: T tokens of n_h rows
    names_ = ["o", "final_state", "dq", "dk", "dv"] + (["dg"] if gated else []) + ["dbeta", "dh0"]
    for name, x, y in zip(names_, got, ref):
        assert torch.isfinite(x).all(), name
        assert_matches(x, y, 1e-5, f"gated_delta_product nh={nh} gated={gated} strong={strong}: {name}")


@pytest.mark.parametrize("strong", [False, True])
def test_kda_forward_scaled_matches_pytorch_chunk(strong, output_form, monkeypatch):
    """kda's forward without the backward takes the scaled form (``chunk_fwd``'s channel_scaled): M_QK and L_BK
    alone from the products (no scaled twins), T' = (I + D L_BK)^{-1} from the intra kernel, the value update
    Y = T' (β ⊙ v - D (B ⊙ e^{G_{i-1}}) S_n) in the state kernel, the outputs from it or from the output kernel
    (VALUES). Outputs and final state against mode="chunk" on ``_kda_inputs``. Checked: the products ran without
    their scaled twins, and b = e^g ⊙ k was never built (``chunk_dplr_fwd``'s kda_b: L_BK as k's product with itself
    through G_t, in M_QK's kernel (``channel_product``'s x2) or, with ``_KNOBS["kda_pair"] = 0``, in a kernel of its
    own (x_at_t); B ⊙ e^{G_{i-1}} as k ⊙ e^G from the log-cumsum kernel). Off the scaled form
    (``_KNOBS["scaled"] = False``) the forward builds b itself, once, and the results are the same."""
    from rankdecay.ops.triton import chunk_fwd, factors

    calls = []  # per channel_product: (scaled twins, x_at_t, x2)
    product = chunk_fwd.channel_product
    monkeypatch.setattr(chunk_fwd, "channel_product", lambda *a, **kw: calls.append(
        (kw.get("out_scaled") is not None, kw.get("x_at_t", False), kw.get("x2") is not None)) or product(*a, **kw))
    built = _count_calls(monkeypatch, factors, "kda_factor")
    *x, h0 = [t.to(DEVICE) for t in _kda_inputs(seed=6, strong=strong)]
    results = {}
    with torch.no_grad():
        for pair, expected in ((1, [(False, False, True)]), (0, [(False, False, False), (False, True, False)])):
            monkeypatch.setitem(chunk_fwd._KNOBS, "kda_pair", pair)
            calls.clear()
            results[pair] = ops.kda(*x, initial_state=h0, output_final_state=True, mode="triton")
            assert calls == expected and built == [], (pair, calls, built)
        ref = ops.kda(*x, initial_state=h0, output_final_state=True, mode="chunk")
        monkeypatch.setitem(chunk_fwd._KNOBS, "scaled", False)
        calls.clear()
        unscaled = ops.kda(*x, initial_state=h0, output_final_state=True, mode="triton")
        assert built == [1] and [c[0] for c in calls] == [True, True], (built, calls)  # b built once, paired
    for name, a, a0, b, c in zip(["o", "final_state"], results[1], results[0], ref, unscaled):
        assert torch.isfinite(a).all(), name
        assert_matches(a, b, 1e-5, f"kda forward strong={strong} {output_form}: {name}")
        assert_matches(a0, b, 1e-5, f"kda forward strong={strong} {output_form}, kda_pair=0: {name}")
        assert_matches(c, b, 1e-5, f"kda forward strong={strong} {output_form}, not scaled: {name}")


@pytest.mark.parametrize("K,dtype", [(16, torch.float32), (20, torch.bfloat16)])
def test_kda_factor_kernel_matches_pytorch(K, dtype):
    """kda's b = e^g ⊙ k from its Triton kernel, forward (fp32) and backward (dk, dg in their dtypes), against fp64;
    log-gates down to -30 and one of -1e4 (e^g = 0 exactly)."""
    from rankdecay.ops.triton.factors import kda_factor

    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 7, 3, 1, K, generator=gen).to(dtype)
    g = -30 * torch.rand(2, 7, 3, 1, K, generator=gen)
    g[0, 0] = -1e4
    w = torch.randn(k.shape, generator=gen)
    kd, gd = (x.to(DEVICE).clone().requires_grad_() for x in (k, g))  # leaves of their own
    b = kda_factor(kd, gd)
    (b * w.to(DEVICE)).sum().backward()
    k64, g64 = (x.double().requires_grad_() for x in (k, g))
    b64 = g64.exp() * k64
    (b64 * w.double()).sum().backward()
    assert b.dtype == torch.float32 and kd.grad.dtype == dtype and gd.grad.dtype == torch.float32
    assert torch.isfinite(gd.grad).all() and (b.cpu()[0, 0] == 0).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, x, y in (("b", b, b64), ("dk", kd.grad, k64.grad), ("dg", gd.grad, g64.grad)):
        assert_matches(x.double().cpu(), y.detach(), tol, name)


@pytest.mark.parametrize("K,dtype,strong,scalar_gate", [(16, torch.float32, False, False),
                                                       (37, torch.bfloat16, True, False),
                                                       (20, torch.float32, False, True)])
def test_hdla_factor_kernel_matches_pytorch_construction(K, dtype, strong, scalar_gate):
    """hdla's a and b from the Triton kernel (forward and backward) against the PyTorch construction in fp64;
    with a per-head gate (expanded over K), hdla through it (mode="triton") against mode="chunk", gradients
    of k, g and β included."""
    from rankdecay.ops.triton.factors import hdla_factors

    B, T, H = 2, 13, 3
    gen = torch.Generator().manual_seed(1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    g = -30 * torch.rand(B, T, H, K, generator=gen) if strong else F.logsigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = 2 * torch.rand(B, T, H, generator=gen)
    beta[0, 0] = 2.0
    wa, wb = torch.randn(B, T, H, 2, K, generator=gen), torch.randn(B, T, H, 2, K, generator=gen)

    def grads(k, g, beta, build):
        k, g, beta = (x.detach().clone().requires_grad_() for x in (k, g, beta))
        a, b = build(k, g, beta)
        ((a * wa.to(a)).sum() + (b * wb.to(b)).sum()).backward()
        return [a.detach(), b.detach(), k.grad, g.grad, beta.grad]

    def reference(k, g, beta):
        k_, lam, be = k.double(), g.double().exp(), beta.double()[..., None]
        lk = lam * k_
        a = torch.stack([be * k_, be * (lk - be * (k_ * lk).sum(-1, keepdim=True) * k_)], dim=3)
        return a, torch.stack([lk, k_], dim=3)

    dev = lambda x: x.to(DEVICE)  # noqa: E731
    ours = grads(dev(k), dev(g), dev(beta), hdla_factors)
    ref = grads(k, g, beta, reference)
    for name, x, y in zip(["a", "b", "dk", "dg", "dbeta"], ours, ref):
        want = {"a": torch.float32, "b": torch.float32, "dk": dtype, "dg": g.dtype, "dbeta": beta.dtype}[name]
        assert x.dtype == want, name
        assert_matches(x.double().cpu(), y, 1e-5 if dtype == torch.float32 else 1e-2, name)

    if not scalar_gate:  # hdla with a per-channel gate through the kernel: test_mechanisms_route_through_triton
        return
    q, v, gate = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, 8, generator=gen), g[..., 0]

    def mechanism(mode):
        x = [dev(t).detach().clone().requires_grad_() for t in (q, k.float(), v, gate, beta)]
        o, s = ops.hdla(*x, mode=mode, output_final_state=True)
        (o.sum() + s.square().sum()).backward()
        return [o.detach(), s.detach()] + [t.grad for t in x]

    for name, x, y in zip(["o", "state", "dq", "dk", "dv", "dg", "dbeta"], mechanism("triton"), mechanism("chunk")):
        assert_matches(x, y, 1e-5, f"hdla {name}")


@pytest.mark.parametrize("K,r,dtype,static", [(16, 4, torch.float32, True), (20, 4, torch.bfloat16, False),
                                             (12, 3, torch.float32, False)])
def test_hh_factor_kernel_matches_pytorch_construction(K, r, dtype, static):
    """Head-in-Head's a and b from the Triton kernel against the PyTorch construction in fp64, with the
    gradients of k and of the mask (static [H, r, r]: summed over tokens; per token [B, T, H, r, r]); and b alone
    from ``hh_update_rows``."""
    from rankdecay.ops.triton.factors import hh_factors, hh_update_rows

    B, T, H = 2, 7, 3
    gen = torch.Generator().manual_seed(2)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    mask = ops.head_in_head_mask(torch.rand(*((H,) if static else (B, T, H)), r, r, generator=gen))
    wa, wb = torch.randn(B, T, H, r, K, generator=gen), torch.randn(B, T, H, r, K, generator=gen)

    def grads(k, mask, build):
        k, mask = (x.detach().clone().requires_grad_() for x in (k, mask))
        a, b = build(k, mask)
        ((a.float() * wa.to(a.device)).sum() + (b * wb.to(b)).sum()).backward()
        return [a.detach(), b.detach(), k.grad, mask.grad]

    def reference(k, mask):
        group = torch.arange(K) // (K // r)
        onehot = (group[None, :] == torch.arange(r)[:, None]).double()
        return k.double()[..., None, :] * onehot, k.double()[..., None, :] * mask.double()[..., group]

    ours = grads(k.to(DEVICE), mask.to(DEVICE), hh_factors)
    ref = grads(k, mask, reference)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, x, y, want in zip(["a", "b", "dk", "dmask"], ours, ref, [dtype, torch.float32, dtype, torch.float32]):
        assert x.dtype == want and x.shape == y.shape, name
        assert_matches(x.double().cpu(), y, tol, name)
    # b alone (the grouped forward's: ``hh_update_rows``), the same entries, and a a placeholder of a's shape and dtype
    a1, b1 = hh_update_rows(k.to(DEVICE), mask.to(DEVICE), torch.float32)
    assert torch.equal(b1, ours[1]) and a1.shape == ours[0].shape and a1.dtype == dtype
    if static and dtype == torch.float32:  # the mechanism through the kernel, with gradients
        q, v, beta = torch.randn(B, T, H, K), torch.randn(B, T, H, 8), torch.rand(B, T, H)
        g = F.logsigmoid(torch.randn(B, T, H))

        def mechanism(mode):
            x = [t.to(DEVICE).detach().clone().requires_grad_() for t in (q, k, v, beta, mask, g)]
            o, s = ops.hh_delta_rule(*x[:5], x[5], mode=mode, output_final_state=True)
            (o.sum() + s.square().sum()).backward()
            return [o.detach(), s.detach()] + [t.grad for t in x]

        for name, x, y in zip(["o", "state", "dq", "dk", "dv", "dbeta", "dmask", "dg"], mechanism("triton"),
                              mechanism("chunk")):
            assert_matches(x, y, 1e-5, f"hh_delta_rule {name}")


_HH_STEP4_CASES = [(16, 4, True, False, 0), (24, 3, False, False, 0), (40, 2, True, True, 0), (48, 4, False, True, 0),
                   (32, 2, True, False, 0), (48, 3, False, True, 0), (64, 4, True, True, 0), (64, 4, False, False, 0),
                   (64, 2, False, True, 16)]


# the inputs' kernel by groups (hh_inputs = 1, 2: with every rank's rows of U read, 3: with step 4 reading the
# products' tiles again per key block, ``hh_products`` 0) only where step 4 runs by groups (K / r a multiple of 16):
# elsewhere the knobs change nothing
_HH_INPUTS = ("inputs-general", "inputs-by-groups", "inputs-by-groups-dense", "inputs-by-groups-tiles-per-block")


@pytest.mark.parametrize("K,r,static,varlen,cap,hh_inputs", [
    pytest.param(*case, hh_inputs, id="-".join([_HH_INPUTS[hh_inputs], *map(str, case)]))
    for case in _HH_STEP4_CASES for hh_inputs in (0, 1, 2, 3)
    if not hh_inputs or (case[0] // case[1]) % 16 == 0 and (hh_inputs == 1 or case[:2] == (64, 4)
                                                            or hh_inputs == 3 and case[:2] == (48, 3))])
def test_hh_backward_carries_rows_gradients_in_step4(K, r, static, varlen, cap, hh_inputs, monkeypatch):
    """Head-in-Head with a scalar gate on the fused kernels: step 4 carries the gradients of its rows a and b on to
    k and the mask itself (``chunk_bwd._hh_rows_bwd``), with no factor backward and no da or db. Against
    mode="chunk" at fp32 accuracy: outputs, final state and every gradient (the mask's included), static masks and
    per-token ones, r = 2, 3, 4, K = 40 and 48 with groups that straddle step 4's 32-channel key blocks, log-gates
    to -30 and one of -1e4, β up to 2, T = 37 (a partial chunk), and cu_seqlens with an empty sequence. Where K / r
    is a multiple of 16 (32 / 2, 48 / 3, 64 / 4), step 4 runs by groups (``_grad_hh_kernel``), with key blocks of
    16 channels inside one group (two blocks per group where the block is capped at 16 with K / r = 32: ``cap``),
    and with ``hh_inputs`` the inputs' kernel too (``_grad_inputs_kernel``'s HG), reading only its key block's
    groups' rows of U (NG: two groups a block, or one for K / r = 32), or with 2 all of them
    (``_KNOBS["hh_sparse_inputs"] = 0``); step 4 then takes each group's Gram before its loop over the ranks (its
    HP), or with 3 the products' share of the mask's gradient per key block (``_CONFIG["hh_products"] = 0``);
    elsewhere it is the general kernel. No hh_factors runs: the kernels form the rows from k and the mask."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd, factors

    monkeypatch.setitem(chunk_bwd._CONFIG, "hh_bk", cap)
    monkeypatch.setitem(chunk_bwd._CONFIG, "hh_inputs", int(hh_inputs > 0))
    monkeypatch.setitem(chunk_fwd._KNOBS, "hh_sparse_inputs", int(hh_inputs != 2))
    monkeypatch.setitem(chunk_bwd._CONFIG, "hh_products", 0 if hh_inputs == 3 else None)  # None: the rule

    taken, factor_bwd = _hh_rows_spy(monkeypatch), []
    blocks = _hh_key_block_spy(monkeypatch)
    hp = _spy_warps(monkeypatch, chunk_bwd, "_grad_hh_kernel", key="HP")
    monkeypatch.setattr(factors._HHFactors.function, "backward", staticmethod(lambda ctx, *g: factor_bwd.append(1)))
    _no_hh_factors(monkeypatch)
    gen = torch.Generator().manual_seed(K + r)
    B, T, H, V = (1, 37, 2, 8)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = 2 * torch.rand(B, T, H, generator=gen)
    beta[0, 3] = 2.0
    g = -30 * torch.rand(B, T, H, generator=gen) ** 3
    g[0, 20] = -1e4
    shape = (*((H,) if static else (B, T, H)), r, r)
    # not symmetric (``hh_delta_rule`` takes any mask; ``head_in_head_mask``'s are): M[j, i] and M[i, j] told apart
    mask = ops.head_in_head_mask(torch.rand(*shape, generator=gen)) * (0.5 + torch.rand(*shape, generator=gen))
    cu = torch.tensor([0, 11, 11, T]) if varlen else None
    h0 = torch.randn(3 if varlen else B, H, K, V, generator=gen)
    w = torch.linspace(-1, 1, V, dtype=torch.float64)

    def call(mode):
        x = [t.to(DEVICE).clone().requires_grad_() for t in (q, k, v, beta, mask, g, h0)]
        o, s = ops.hh_delta_rule(*x[:6], initial_state=x[6], output_final_state=True, mode=mode, chunk_size=16,
                                 cu_seqlens=None if cu is None else cu.to(DEVICE))
        ((o.double() * w.to(o.device)).sum() + s.double().sin().sum()).backward()
        return [o, s] + [t.grad for t in x]

    got = call("triton")
    assert taken == [True] and not factor_bwd, (taken, factor_bwd)
    n = K // r  # channels per group: the key block is the largest power of two dividing it, capped
    assert blocks == [None if n % 16 else min(n & -n, cap or 64)], blocks
    assert hp == ({} if n % 16 else {"_grad_hh_kernel": hh_inputs in (1, 2)}), hp
    ref = call("chunk")
    for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dbeta", "dmask", "dg", "dh0"], got, ref):
        assert torch.isfinite(x).all(), name
        assert_matches(x, y, 1e-5, f"K={K} r={r} static={static}: {name}")


def test_hh_mask_only_for_head_in_head_rows():
    """``chunk_bwd.chunk_dplr``'s hh_mask (step 4 carrying Head-in-Head's rows' gradients on to k and the mask)
    refuses a per-channel gate, which scales a's rows, and a call without rows."""
    from rankdecay.ops.triton.chunk_bwd import chunk_dplr

    q, k, v, a, b, g, _ = random_inputs(1, 5, 2, 16, 8, 2, 1, "channel")
    with pytest.raises(ValueError, match="hh_mask: Head-in-Head's rows a and b with a scalar gate or none only"):
        chunk_dplr(q, k, v, a, b, g, 0.25, None, hh_mask=torch.ones(2, 2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="hh_mask: Head-in-Head's rows a and b"):
        chunk_dplr(q, k, v, None, None, None, 0.25, None, hh_mask=torch.ones(2, 2, 2, device=DEVICE))


@pytest.mark.parametrize("K,r,static", [(64, 4, True), (48, 4, False), (24, 3, True)])
def test_hh_training_forms_rows_from_k(K, r, static):
    """Head-in-Head's training kernels (``chunk_dplr`` with ``hh_mask``) form the rows a_j = k ⊙ 1[group j] and
    b_j = k ⊙ M[j, group(·)] from k and the mask wherever they need them (the intra kernel, both state kernels and
    step 4, grouped or general), so rows filled with NaN change nothing: outputs, final state and every gradient
    come out bit for bit as with the rows ``factors.hh_factors`` forms. K / r = 16 takes the grouped step 4,
    12 and 8 the general one; r = 3 pads the rank to 4."""
    from rankdecay.ops.triton.chunk_bwd import chunk_dplr
    from rankdecay.ops.triton.factors import hh_factors

    gen = torch.Generator().manual_seed(K * r)
    B, T, H, V = 1, 37, 2, 8
    q, k = torch.randn(B, T, H, K, generator=gen), F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v, g = torch.randn(B, T, H, 1, V, generator=gen), -5 * torch.rand(B, T, H, 1, generator=gen)
    sa = 2 * torch.rand(B, T, H, r, generator=gen)
    mask = ops.head_in_head_mask(torch.rand(*((H,) if static else (B, T, H)), r, r, generator=gen))
    h0 = torch.randn(B, H, K, V, generator=gen)

    def call(nan_rows):
        x = [t.to(DEVICE).clone().requires_grad_() for t in (q, k, v, g, sa, mask, h0)]
        qx, kx, vx, gx, sax, mx, hx = x
        a, b = hh_factors(kx.detach(), mx.detach())
        if nan_rows:
            a, b = torch.full_like(a, float("nan")), torch.full_like(b, float("nan"))
        o, s = chunk_dplr(qx, kx[..., None, :], vx, a, b, gx, K ** -0.5, hx, a_scale=sax, hh_mask=mx)
        (o.sum() + s.sin().sum()).backward()
        return [o, s] + [t.grad for t in x]

    ref, got = call(False), call(True)
    for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dsa", "dmask", "dh0"], got, ref):
        assert torch.isfinite(y).all(), name
        assert torch.equal(x, y), f"K={K} r={r} static={static}: {name}"


def _no_hh_factors(monkeypatch) -> None:
    """From now on ``factors.hh_factors`` fails the test: Head-in-Head on the fused kernels (a scalar gate or none,
    r <= 4) forms its rows from k and the mask in the kernels, with placeholders (``factors.hh_placeholders``) for a
    and b, or without autograd for a alone (b from ``factors.hh_update_rows``)."""
    from rankdecay.ops.triton import factors

    def fail(*args, **kw):
        raise AssertionError("hh_factors built Head-in-Head's rows, which the fused kernels form themselves")

    monkeypatch.setattr(factors, "hh_factors", fail)


def _hh_rows_spy(monkeypatch) -> list:
    """One entry per fused backward from now on: whether step 4 took Head-in-Head's rows (``chunk_bwd._backward``'s
    ``hh_mask``)."""
    from rankdecay.ops.triton import chunk_bwd

    taken = []
    backward = chunk_bwd._backward
    monkeypatch.setattr(chunk_bwd, "_backward",
                        lambda *a, **kw: taken.append(kw.get("hh_mask") is not None) or backward(*a, **kw))
    return taken


def _hh_key_block_spy(monkeypatch) -> list:
    """The list of ``chunk_bwd.hh_key_block``'s answers, one per Head-in-Head backward from now on: step 4's key
    block by groups (``_grad_hh_kernel``), or None for the general step 4."""
    from rankdecay.ops.triton import chunk_bwd

    blocks, key_block = [], chunk_bwd.hh_key_block
    monkeypatch.setattr(chunk_bwd, "hh_key_block", lambda *a: blocks.append(key_block(*a)) or blocks[-1])
    return blocks


def _grouped_spy(monkeypatch) -> list:
    """The list of ``chunk_fwd.grouped_update``'s answers, one per fused forward from now on."""
    from rankdecay.ops.triton import chunk_fwd

    taken = []
    grouped_update = chunk_fwd.grouped_update
    monkeypatch.setattr(chunk_fwd, "grouped_update",
                        lambda *a, **kw: taken.append(grouped_update(*a, **kw)) or taken[-1])
    return taken


@pytest.mark.parametrize("K,r,gate,static,dtype,strong,varlen", [
    (16, 4, "scalar", True, torch.float32, False, False),
    (16, 4, "scalar", False, torch.float32, True, False),
    (24, 3, None, True, torch.float32, True, False),  # r = 3: a padded rank; K = 24: a masked key block
    (16, 2, "scalar", True, torch.float16, False, False),
    (16, 4, "scalar", False, torch.float32, True, True),
])
def test_hh_forward_grouped_matches_pytorch_chunk(K, r, gate, static, dtype, strong, varlen, monkeypatch):
    """hh_delta_rule's forward without the backward takes the scaled form over a's rows, which sum to k
    (``chunk_fwd.grouped_update``): the intra kernel forms M_QA and T' = (I + D L_BA)^{-1} alone, the state kernel
    Y = T' (β ⊙ v - D e^{G_{i-1}} ⊙ B S_n), the state and the outputs, a's rows formed from k. Outputs and final
    state against mode="chunk" from an initial state, T = 37 (a partial chunk); strong: log-gates of -30 per step
    and one of -1e4, β up to 2; varlen: three sequences packed by cu_seqlens, one of them empty. Checked: the
    kernels were told the rows are grouped, and took that form, with a formed from k (a zero placeholder given) and
    b alone built (``factors.hh_update_rows``, not ``hh_factors``)."""
    from rankdecay.ops.triton import chunk_fwd

    taken = _grouped_spy(monkeypatch)
    _no_hh_factors(monkeypatch)
    B, T, H, V = (1 if varlen else 2), 37, 2, 8
    cu = torch.tensor([0, 10, 10, T], device=DEVICE) if varlen else None
    N = 3 if varlen else B
    gen = torch.Generator().manual_seed(11)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = (2 if strong else 1) * torch.rand(B, T, H, generator=gen)
    g = None
    if gate:
        g = -30 * torch.rand(B, T, H, generator=gen) if strong else F.logsigmoid(torch.randn(B, T, H, generator=gen))
        if strong:
            g[:, 20] = -1e4
    if strong:
        beta[0, 0] = 2.0
    mask = ops.head_in_head_mask(torch.rand(*((H,) if static else (B, T, H)), r, r, generator=gen))
    h0 = torch.randn(N, H, K, V, generator=gen)
    x = [None if t is None else t.to(DEVICE) for t in (q, k, v, beta, mask, g)]
    x[:4] = [t.to(dtype) for t in x[:4]]
    with torch.no_grad():
        kw = dict(initial_state=h0.to(DEVICE), output_final_state=True, cu_seqlens=cu)
        got = ops.hh_delta_rule(*x, mode="triton", **kw)
        assert taken == [True]
        ref = ops.hh_delta_rule(*x, mode="chunk", **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(["o", "final_state"], got, ref):
        assert torch.isfinite(a).all(), name
        assert_matches(a.float(), b.float(), tol, f"hh forward grouped K={K} r={r} gate={gate}: {name}")
    if varlen:  # groups of channels must be equal: a clear error otherwise
        q1, k1, v1 = torch.zeros(1, 4, 1, 18), torch.zeros(1, 4, 1, 1, 18), torch.zeros(1, 4, 1, 1, 8)
        with pytest.raises(ValueError, match="Rab must divide K = 18"):
            chunk_fwd.chunk_dplr_fwd(*(t.to(DEVICE) for t in (q1, k1, v1)), torch.zeros(1, 4, 1, 4, 18, device=DEVICE),
                                     torch.zeros(1, 4, 1, 4, 18, device=DEVICE), None, 1.0, None, grouped=True,
                                     a_scale=torch.ones(1, 4, 1, 4, device=DEVICE))


def _mechanism_case(mechanism: str, B: int, T: int, H: int, K: int, V: int, seed: int, r: int = 2):
    """Random inputs [q, k, v, g, beta, h0] on DEVICE (k L2-normalised, β up to 2) and fn(q, k, v, g, beta, h0,
    mode) -> (o, final state) of one mechanism: "gdn", "hh" (a static mask of rank r), "hdla", "kda" and "gla" (a
    per-channel gate; GLA reads no β) or "dplr" (two rows of a and b, values of rank one: the general fused path)."""
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(*((B, T, H, K) if mechanism in ("hdla", "kda", "gla") else (B, T, H)), generator=gen))
    beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    inputs = [x.to(DEVICE) for x in (q, k, v, g, beta, h0)]
    if mechanism == "hh":
        mask = ops.head_in_head_mask(torch.rand(H, r, r, generator=gen)).to(DEVICE)
        fn = lambda q, k, v, g, beta, h0, mode: ops.hh_delta_rule(  # noqa: E731
            q, k, v, beta, mask, g, initial_state=h0, output_final_state=True, mode=mode)
    elif mechanism == "gla":
        fn = lambda q, k, v, g, beta, h0, mode: ops.gla(  # noqa: E731
            q, k, v, g, initial_state=h0, output_final_state=True, mode=mode)
    elif mechanism == "dplr":
        a = F.normalize(torch.randn(B, T, H, 2, K, generator=gen), dim=-1).to(DEVICE)
        fn = lambda q, k, v, g, beta, h0, mode: ops.dplr(  # noqa: E731
            q, k[..., None, :], v[..., None, :], a * beta[..., None, None], a, g, initial_state=h0,
            output_final_state=True, mode=mode)
    else:
        op = dict(gdn=ops.gated_delta_rule, hdla=ops.hdla, kda=ops.kda)[mechanism]
        fn = lambda q, k, v, g, beta, h0, mode: op(q, k, v, g, beta, initial_state=h0,  # noqa: E731
                                                   output_final_state=True, mode=mode)
    return inputs, fn


def _spy_chunk_sizes(monkeypatch) -> list:
    """The tokens per chunk each fused forward takes, as ``chunk_dplr_fwd`` asks ``fused_chunk_size`` (its call
    names the gate and the knobs: four arguments), appended to the list returned."""
    from rankdecay.ops.triton import chunk_fwd

    chunks, size = [], chunk_fwd.fused_chunk_size
    monkeypatch.setattr(chunk_fwd, "fused_chunk_size",
                        lambda *a: (lambda tc: len(a) == 4 and chunks.append(tc) or tc)(size(*a)))
    return chunks


def _spy_warps(monkeypatch, module, *names, warps=None, key: str = "num_warps") -> dict:
    """The warps (or another launch argument, ``key``) of each launch of ``module``'s kernels ``names`` (launched as
    usual), by kernel name, in the dict returned (``warps``, or a new one)."""
    warps = {} if warps is None else warps

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                warps[self.kernel.fn.__name__] = kw[key]
                return self.kernel[grid](*args, **kw)
            return launch

    for name in names:
        monkeypatch.setattr(module, name, Spy(getattr(module, name)))
    return warps


def _spy_segments(monkeypatch, module) -> list:
    """The segments of each segmented walk that ``module`` (``chunk_fwd``: the forward's, ``chunk_bwd``: the
    backward's) chains through ``chain_segments``, appended to the list returned."""
    walks, chain = [], module.chain_segments
    monkeypatch.setattr(module, "chain_segments", lambda *a, **kw: walks.append(a[1].shape[0]) or chain(*a, **kw))
    return walks


@pytest.mark.parametrize("padded", ["values", "keys", "both"])
@pytest.mark.parametrize("mechanism", ["gdn", "hh", "hdla", "kda", "dplr"])
def test_narrow_heads_padded_exactly(mechanism, padded, monkeypatch):
    """On a GPU the fused kernels take value heads narrower than 64 and key heads narrower than 32 padded with zero
    columns (``chunk_bwd.padded_heads``, against Triton 3.6 miscompiles of narrow tiles). Here the padding is forced
    on the CPU (V = 8 -> 32, K = 16 -> 24; Head-in-Head's two groups of keys 8 -> 12 each): the output, final state
    and every gradient match the PyTorch path at fp32 accuracy, with autograd and without, the results have K's and
    V's widths, the delta rule's keys stay tied (a = b = k) through the padding, and KDA's a stays k with ``kda_b``
    passed on (b = e^g ⊙ k holds on the zero channels), so that its per-channel products keep their one kernel."""
    import rankdecay.ops.triton as rt
    from rankdecay.ops.triton import chunk_bwd

    widths = []  # the (key, value) widths each run of the fused forward saw, whether a was k, and kda_b
    forward = chunk_bwd.chunk_dplr_fwd

    def spy(q, k, v, *args, **kw):
        widths.append((k.shape[-1], v.shape[-1], args[0] is k, kw.get("kda_b", False)))
        return forward(q, k, v, *args, **kw)

    # the padding this case asks for, and none other (on a GPU too)
    values, keys = padded != "keys", padded != "values"
    monkeypatch.setattr(chunk_bwd, "value_padding", lambda v: 24 if values and v.shape[-1] == 8 else 0)
    monkeypatch.setattr(chunk_bwd, "key_padding",
                        lambda k, groups=1: -(-24 // groups) * groups - 16 if keys and k.shape[-1] == 16 else 0)
    monkeypatch.setattr(chunk_bwd, "chunk_dplr_fwd", spy)  # the autograd nodes' forward
    monkeypatch.setattr(rt, "chunk_dplr_fwd", spy)  # dplr's forward without autograd
    B, T, H, K, V = 1, 19, 2, 16, 8
    inputs, fn = _mechanism_case(mechanism, B, T, H, K, V, seed=21, r=2)
    for grads in (True, False):
        widths.clear()
        got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs, grads=grads)
        wide = (16 if padded == "values" else 24, 8 if padded == "keys" else 32, mechanism in ("gdn", "kda"),
                mechanism == "kda")
        assert widths == [wide], f"{mechanism}: the kernels saw (K, V, a is k, kda_b) {widths}, not {[wide]}"
        ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, grads=grads)
        assert got[0].shape[-1] == V and got[1].shape[-2:] == (K, V)
        for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
            assert_matches(x, y, 1e-5, f"{mechanism} padded {padded}, grads={grads}: {name}")


@pytest.mark.parametrize("mechanism", ["hh", "hdla"])
def test_rows_knob_takes_128_row_tiles(mechanism, monkeypatch):
    """``chunk_fwd._KNOBS["rows"] = 128`` (a benchmarking knob, measured slower on the H100: BENCHMARKS.md session
    39; with ``channel_rows`` = 128 for HDLA's per-channel gate): chunk tiles of 128 rows, so Head-in-Head with r = 4
    takes 32-token chunks and HDLA 64, and the UT inverse runs at N = 128 (its third level of merges). Output, final
    state and every gradient match the PyTorch path at fp32 accuracy, with autograd and without, T = 70 not a
    multiple of the chunk."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "rows", 128)
    monkeypatch.setitem(chunk_fwd._KNOBS, "channel_rows", 128)
    chunks = _spy_chunk_sizes(monkeypatch)
    inputs, fn = _mechanism_case(mechanism, 1, 70, 1, 16, 8, seed=128, r=4)
    for grads in (True, False):
        got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs, grads=grads)
        ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, grads=grads)
        for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
            assert_matches(x, y, 1e-5, f"{mechanism} at 128-row tiles, grads={grads}: {name}")
    assert chunks and set(chunks) == {32 if mechanism == "hh" else 64}, chunks


@pytest.mark.parametrize("rows,mechanism,tokens", [(None, "hdla", 16), (None, "kda", 32), (None, "gdn", 64),
                                                   (64, "hdla", 32), (64, "kda", 64)])
def test_channel_rows_per_channel_chunks(rows, mechanism, tokens, monkeypatch):
    """A per-channel gate with a low-rank decay takes chunk tiles of 32 rows by default (``fused_chunk_size``,
    measured faster on the H100: BENCHMARKS.md sessions 42, 43), so HDLA 16-token chunks and KDA 32, while a scalar
    gate (Gated DeltaNet) keeps its 64; ``chunk_fwd._KNOBS["channel_rows"] = 64`` gives HDLA 32 and KDA 64. Output,
    final state and every gradient match the PyTorch path at fp32 accuracy, with autograd and without (the scaled
    forms), T = 70 not a multiple of the chunk, mild gates with a -30 span in them."""
    from rankdecay.ops.triton import chunk_fwd

    if rows is not None:
        monkeypatch.setitem(chunk_fwd._KNOBS, "channel_rows", rows)
    chunks = _spy_chunk_sizes(monkeypatch)
    inputs, fn = _mechanism_case(mechanism, 1, 70, 1, 16, 8, seed=42)
    inputs[3][:, 20:24] = -30.0
    for grads in (True, False):
        got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs, grads=grads)
        ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, grads=grads)
        for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
            assert torch.isfinite(x).all(), name
            assert_matches(x, y, 1e-5, f"{mechanism} at channel_rows={rows}, grads={grads}: {name}")
    assert chunks and set(chunks) == {tokens}, chunks


def test_fused_chunk_size_by_gate_and_rank():
    """Tokens per chunk of the fused path (``chunk_fwd.fused_chunk_size``): 64 rows over the padded rank for a decay
    per row or a per-channel gate without a low-rank decay (GLA), 32 rows for a per-channel gate with one but never
    fewer than 16 tokens, so that a padded rank of 4 keeps the 16-token chunks it took before; None past rank 4."""
    from rankdecay.ops.triton.chunk_fwd import fused_chunk_size

    scalar = {(0, 1): 64, (1, 1): 64, (2, 1): 32, (2, 2): 32, (3, 1): 16, (4, 4): 16, (5, 1): None}
    channel = {(0, 1): 64, (1, 1): 32, (2, 1): 16, (2, 2): 16, (3, 1): 16, (4, 1): 16, (4, 4): 16, (1, 8): None}
    assert {r: fused_chunk_size(*r) for r in scalar} == scalar
    assert {r: fused_chunk_size(*r, per_channel=True) for r in channel} == channel
    old = {(1, 1): 64, (2, 1): 32, (4, 1): 16}  # channel_rows = 64: the tiles before session 43
    assert {r: fused_chunk_size(*r, True, {"channel_rows": 64}) for r in old} == old
    assert fused_chunk_size(2, 1, True, {"rows": 128}) == 16  # rows does not reach a per-channel gate's tiles


def test_backward_widths_by_chunk_size(monkeypatch):
    """The backward's launches chosen by tokens per chunk, measured on the H100 (BENCHMARKS.md session 43): HDLA's
    16-token chunks take the inputs' kernel on 2 warps and its step 4 (which carries the rows' gradients on) on 4;
    KDA's 32-token chunks and Head-in-Head's 16-token ones (a scalar gate) keep the inputs' kernel on 4, and HDLA in
    32-token chunks (``channel_rows`` = 64) its step 4 on 8. The per-channel products' forward at 16 tokens on 2
    warps, at 32 on 4. Measured on the H200 (session 58): step 4 with a per-channel gate on 2 warps without a
    low-rank decay (GLA) and on 4 with one (KDA), ``_CONFIG["grad_channel"]`` over both, and Head-in-Head's intra
    kernel on 2 (HDLA's on 4). Checked on the launches themselves, the kernels run as usual."""
    from rankdecay.ops.triton import channel, chunk_bwd, chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "hdla_products", True)  # HDLA's fused rows, as at the bf16 precision
    warps = _spy_warps(monkeypatch, chunk_bwd, "_grad_inputs_kernel", "_grad_kernel")
    warps = _spy_warps(monkeypatch, chunk_fwd, "_intra_kernel", warps=warps)
    cases = [("hdla", None, None, dict(_grad_inputs_kernel=2, _grad_kernel=4, _intra_kernel=4)),
             ("hdla", 64, None, dict(_grad_inputs_kernel=4, _grad_kernel=8)),
             ("kda", None, None, dict(_grad_inputs_kernel=4, _grad_kernel=4)),
             ("hh", None, None, dict(_grad_inputs_kernel=4, _intra_kernel=2)),
             ("gla", None, None, dict(_grad_kernel=2)), ("gla", None, 8, dict(_grad_kernel=8))]
    for mechanism, rows, grad_channel, want in cases:
        monkeypatch.setitem(chunk_fwd._KNOBS, "channel_rows", rows or 32)
        monkeypatch.setitem(chunk_bwd._CONFIG, "grad_channel", grad_channel or 0)
        warps.clear()
        inputs, fn = _mechanism_case(mechanism, 1, 40, 1, 16, 8, seed=43, r=4)
        _grads_of(lambda *x: fn(*x, mode="triton"), inputs)
        assert {k: warps[k] for k in want} == want, (mechanism, rows, warps)
    assert channel._knob("warps", 16) == 2 and channel._knob("warps", 32) == 4


def test_wide_keys_launch_widths(monkeypatch):
    """Launches at K > 128 (BENCHMARKS.md sessions 59 and 60, H200 at K = V = 256). Head-in-Head's intra kernel on 4
    warps (on 2 it spills; at K <= 128 it takes 2), its forward state kernel on 8, with autograd (the walk that stores
    the states) and without (the scaled form over a's rows), and its step 4 by groups on 2 (1 up to K = 128), which
    reads the products' tiles per key block there (``hh_tiles_once``: once up to K = 128; session 61); Gated
    DeltaNet's state kernel keeps 4 at the same K; HDLA's inputs' kernel on 4 (2 up to K = 128). Checked on the
    launches themselves, with the outputs and gradients against the PyTorch path. (The delta rule's 16-wide value
    block at that K, a rule for CUDA tensors alone, is checked in
    ``test_outputs_from_the_state_kernel_where_measured_faster``.)"""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "hdla_products", True)  # HDLA's fused rows, as at the bf16 precision
    warps = _spy_warps(monkeypatch, chunk_fwd, "_intra_kernel", "_state_fwd_kernel")
    warps = _spy_warps(monkeypatch, chunk_bwd, "_grad_hh_kernel", "_grad_inputs_kernel", warps=warps)
    assert chunk_fwd.intra_warps(False, hh=True, K=256) == 4 and chunk_fwd.intra_warps(False, hh=True, K=128) == 2
    assert chunk_fwd.state_warps(True, 256) == 8 and chunk_fwd.state_warps(True, 128) == 4
    assert chunk_fwd.state_warps(False, 256) == 4
    assert chunk_bwd._grad_hh_warps(256) == 2 and chunk_bwd._grad_hh_warps(128) == 1
    assert chunk_bwd.hh_tiles_once(128) and not chunk_bwd.hh_tiles_once(256)  # (session 61)
    assert chunk_bwd.hh_tiles_once(256, 1) and not chunk_bwd.hh_tiles_once(128, 0)
    assert chunk_bwd._inputs_warps(16, 2, 256) == 4 and chunk_bwd._inputs_warps(16, 2, 128) == 2
    cases = (("hh", dict(_intra_kernel=4, _state_fwd_kernel=8)), ("gdn", dict(_state_fwd_kernel=4)),
             ("hdla", dict()))
    for mechanism, want in cases:
        inputs, fn = _mechanism_case(mechanism, 1, 20, 1, 256, 8, seed=44, r=4)
        for grads in (True, False):
            warps.clear()
            expect = dict(want, _grad_hh_kernel=2) if grads and mechanism == "hh" else want
            expect = dict(expect, _grad_inputs_kernel=4) if grads and mechanism == "hdla" else expect
            with torch.set_grad_enabled(grads):
                got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs) if grads else fn(*inputs, mode="triton")
                ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs) if grads else fn(*inputs, mode="chunk")
            assert {k: warps.get(k) for k in expect} == expect, (mechanism, grads, warps)
            assert mechanism == "hh" and grads or "_grad_hh_kernel" not in warps, (mechanism, grads, warps)
            for x, y in zip(got, ref):
                if y is not None:
                    assert_matches(x, y, 1e-5, f"{mechanism} grads={grads}")


@pytest.mark.parametrize("mechanism", ["gdn", "hh", "hdla", "dplr"])
def test_segmented_state_walk(mechanism, monkeypatch):
    """``chunk_fwd.segments``: the state kernel walks each sequence's chunks as segments in parallel, twice (first
    every segment's state from 0 and transition, [H | P], then every segment from its entering state). Forced here
    to 3 segments (the delta rule's 4 chunks fall into 2 of 2, HH's and HDLA's 7 into 3 of 3, 3 and 1), forward and
    backward (whose state kernel walks dS the same way in reverse): the output, final state and every gradient match
    the PyTorch path at fp32 accuracy, with autograd (the outputs from the output kernel) and without (from either
    kernel; Head-in-Head's and HDLA's scaled forms always take the state kernel's), with and without an initial
    state. The gates are mild (the state remembers across segments, so a
    wrong entering state shows) but for three steps of -30 inside the second segment, whose transition they nearly
    zero."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "segments", 3)
    walks, back = _spy_segments(monkeypatch, chunk_fwd), _spy_segments(monkeypatch, chunk_bwd)
    inputs, fn = _mechanism_case(mechanism, 2, 200, 1, 16, 8, seed=41, r=2)
    inputs[3] = 0.02 * inputs[3]
    inputs[3][:, 150:153] = -30.0
    runs = [(True, False), (False, False)] + ([(False, True)] if mechanism in ("gdn", "dplr") else [])
    for grads, fuse in runs:
        monkeypatch.setitem(chunk_fwd._KNOBS, "fuse_output", fuse)
        got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs, grads=grads)
        ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, grads=grads)
        for name, x, y in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
            assert_matches(x, y, 1e-5, f"{mechanism}, 3 segments, grads={grads}, fused outputs={fuse}: {name}")
    got = fn(*inputs[:5], None, mode="triton")
    ref = fn(*inputs[:5], None, mode="chunk")
    for name, x, y in zip(["o", "s"], got, ref):
        assert_matches(x, y, 1e-5, f"{mechanism}, 3 segments, no initial state: {name}")
    assert walks == [2 if mechanism == "gdn" else 3] * (len(runs) + 1), walks
    assert back == [2 if mechanism == "gdn" else 3], back  # the one backward


@pytest.mark.parametrize("K", [16, 160], ids=["state-in-registers", "rows-by-blocks"])
def test_segment_starts_kernel(K):
    """``chunk_state._segment_starts_kernel``: S_0 = h0 (or 0), S_{i+1} = P_i S_i + H_i for [H_i | P_i] in ends (or in
    reverse from S_{NS-1} = h0, as the backward chains them), at fp32 accuracy; K = 160 (a 256-wide key block) takes
    P's rows 32 at a time."""
    import triton

    from rankdecay.ops.triton.chunk_state import _segment_starts_kernel

    B, H, NS, V = 2, 3, 3, 24
    gen = torch.Generator().manual_seed(3)
    ends = (torch.randn(NS, B, H, K, V + K, generator=gen) / K ** 0.5).to(DEVICE)
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    BK = triton.next_power_of_2(K)
    for init, reverse in ((h0, False), (None, False), (h0, True)):
        starts = torch.empty(NS, B, H, K, V, device=DEVICE)
        _segment_starts_kernel[(triton.cdiv(V, 16), B * H)](
            ends if init is None else init, ends, starts, NS, K=K, V=V, BK=BK, BV=16, BR=BK if BK <= 128 else 32,
            HAS_H0=init is not None, PRECISION="tf32x3" if ends.is_cuda else "ieee", REVERSE=reverse)
        S = torch.zeros(B, H, K, V, dtype=torch.float64, device=DEVICE) if init is None else init.double()
        for i in (reversed(range(NS)) if reverse else range(NS)):
            assert_matches(starts[i], S, 1e-5, f"K = {K}, h0 {init is not None}, reverse {reverse}: S_{i}")
            S = ends[i, ..., V:].double() @ S + ends[i, ..., :V].double()


def test_segments_rule(monkeypatch):
    """``chunk_fwd.segments``: off on the CPU, forced by its knob (at most one segment per chunk, none empty); on a GPU
    of 132 SMs (the H100) with K = V = 128 and H = 16, the measured rule (BENCHMARKS.md session 41): 8 segments at
    B = 1 from T = 4k (64-token chunks) up, 4 at B = 2, none where two segments are all the grid leaves room for (B = 4)
    or the grid is full (B = 8), nor for walks under 64 chunks; none above K = 128 (H200, session 60)."""
    from rankdecay.ops.triton import chunk_fwd

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert chunk_fwd.segments(512, 16, 128, cpu) == (1, 0)
    assert chunk_fwd.segments(7, 4, 8, cpu, knob=3) == (3, 3)
    assert chunk_fwd.segments(4, 4, 8, cpu, knob=3) == (2, 2)
    assert chunk_fwd.segments(2, 4, 8, cpu, knob=5) == (2, 1)
    assert chunk_fwd.segments(4, 4, 8, cpu, knob=1) == (1, 0)
    monkeypatch.setattr(chunk_fwd, "_sm_count", lambda device: 132)
    assert chunk_fwd.segments(512, 16, 128, gpu) == (8, 64)  # B1 T32k
    assert chunk_fwd.segments(64, 16, 128, gpu) == (4, 16)  # B1 T4k: segments of 16 chunks at least
    assert chunk_fwd.segments(128, 32, 128, gpu) == (4, 32)  # B2 T8k
    assert chunk_fwd.segments(63, 16, 128, gpu) == (1, 0)  # a short walk
    assert chunk_fwd.segments(256, 64, 128, gpu) == (1, 0)  # B4: two segments at most
    assert chunk_fwd.segments(512, 128, 128, gpu) == (1, 0)  # B8: the grid is full
    assert chunk_fwd.segments(512, 16, 256, gpu) == (4, 128)  # B1 T32k, V = 256
    assert chunk_fwd.segments(512, 16, 256, gpu, K=256) == (1, 0)  # and K = 256: the first walk costs too much
    assert chunk_fwd.segments(512, 16, 256, gpu, knob=4, K=256) == (4, 128)  # (the knob still forces them)


def test_knob_names_are_the_ones_read(monkeypatch):
    """``chunk_fwd.KNOB_NAMES`` is every name the kernels' wrappers read from ``_KNOBS`` or ``chunk_dplr_fwd``'s
    ``_config`` (found in their source), no more, no fewer; a name outside it is refused with a ValueError that names
    it, from either, rather than silently doing nothing (a benchmark would time the default and call it a variant)."""
    import pathlib
    import re

    from rankdecay.ops.triton import chunk_fwd

    read = re.compile(r'(?:\bcfg|_KNOBS|\bknobs|\(_KNOBS if \w+ is None else \w+\))(?:\.get\(|\[)"([a-z0-9_]+)"')
    names = set()
    for path in pathlib.Path(chunk_fwd.__file__).parent.glob("*.py"):
        for line in path.read_text().splitlines():
            names.update(read.findall(line.split("#", 1)[0]))
    assert names == chunk_fwd.KNOB_NAMES, (sorted(names - chunk_fwd.KNOB_NAMES), sorted(chunk_fwd.KNOB_NAMES - names))
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    k1, v1 = q[..., None, :], q[..., None, :]
    with pytest.raises(ValueError, match="_config: no knob named 'state_warps'"):
        chunk_fwd.chunk_dplr_fwd(q, k1, v1, k1, k1, None, 1.0, None, _config=dict(state_warps=8))
    monkeypatch.setitem(chunk_fwd._KNOBS, "segmnets", 1)
    with pytest.raises(ValueError, match="_KNOBS: no knob named 'segmnets'"):
        chunk_fwd.chunk_dplr_fwd(q, k1, v1, k1, k1, None, 1.0, None)


def test_clear_errors():
    q = torch.randn(1, 4, 1, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="computes in fp32"):
        ops.dplr(q, q, q, mode="triton")
    q = q.float().requires_grad_()
    with pytest.raises(RuntimeError, match="no backward"):
        ops.dplr(q, q, q, mode="fused_recurrent")


@pytest.mark.parametrize("lower_bound,with_A,with_dt", [(None, True, True), (None, True, False), (-5.0, True, True),
                                                       (-5.0, False, True), (-3.0, False, False)])
def test_kda_gate_kernel(lower_bound, with_A, with_dt):
    """KDA's log-decay kernel (``ops.triton.gate``, which ``kda_log_decay`` takes on a GPU) against the PyTorch form:
    the gate and the gradients of the projection, ``A_log`` and ``dt_bias`` (summed over rows in blocks: 300 rows,
    two programs' worth), 60 columns (not a block's width), projections out to ±30 (softplus's and the sigmoid's
    tails), the parameters not contiguous."""
    from rankdecay.ops.mechanisms import _kda_log_decay
    from rankdecay.ops.triton.gate import kda_gate

    gen = torch.Generator().manual_seed(40)
    B, T, H, K = 2, 150, 3, 20
    a = 4 * torch.randn(B, T, H, K, generator=gen)
    a[0, 0, 0, :4] = torch.tensor([30.0, -30.0, 25.0, -25.0])
    # the parameters as strided views (ops.kda takes a caller's A_log and dt_bias)
    A_log = torch.randn(H, 2, generator=gen)[:, 0] if with_A else None
    dt_bias = torch.randn(H * K, 2, generator=gen)[:, 1] if with_dt else None
    weights = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(DEVICE)
    results = []
    for fn, dtype in ((kda_gate, torch.float32), (_kda_log_decay, torch.float32), (_kda_log_decay, torch.float64)):
        leaves = [None if x is None else x.to(DEVICE, dtype).requires_grad_() for x in (a, A_log, dt_bias)]
        g = fn(*leaves, lower_bound)
        grads = torch.autograd.grad((g * weights.to(g.dtype)).sum(), [x for x in leaves if x is not None])
        results.append([g, *grads])
    assert results[0][0].dtype == torch.float32
    # against fp64: the elementwise results to fp32 rounding, the sums over rows (6,000 terms for A_log's) as close
    # as PyTorch's fp32 sums in another order
    for name, got, torch_fp32, exp in zip(["g", "d a", "d A_log" if with_A else "d dt_bias", "d dt_bias"], *results):
        err, ref = rel_rms(got.double(), exp), rel_rms(torch_fp32.double(), exp)
        assert err < 1e-6 or err <= 2 * ref, (name, err, ref)


def test_logsigmoid_gate_kernel():
    """GLA's and HDLA's log-decay kernel, ``logsigmoid(z) / τ`` (``ops.triton.gate``, which the layers take on a
    GPU), against PyTorch's in fp64: the gate and z's gradient, z out to ±40, 3,001 elements (not a block's
    multiple)."""
    from rankdecay.ops.triton.gate import logsigmoid_gate

    gen = torch.Generator().manual_seed(42)
    z = 6 * torch.randn(3001, generator=gen, dtype=torch.float64)
    z[:4] = torch.tensor([40.0, -40.0, 20.5, -20.5], dtype=torch.float64)
    weights = torch.randn(3001, generator=gen, dtype=torch.float64).to(DEVICE)
    results = []
    for fn, dtype in ((lambda x: logsigmoid_gate(x, 16.0), torch.float32),
                      (lambda x: F.logsigmoid(x) / 16.0, torch.float32), (lambda x: F.logsigmoid(x) / 16.0, None)):
        leaf = z.to(DEVICE, dtype or z.dtype).requires_grad_()
        g = fn(leaf)
        results.append([g, *torch.autograd.grad((g * weights.to(g.dtype)).sum(), [leaf])])
    assert results[0][0].dtype == torch.float32
    for name, got, torch_fp32, exp in zip(["g", "d z"], *results):
        err, ref = rel_rms(got.double(), exp), rel_rms(torch_fp32.double(), exp)
        assert err < 1e-6 or err <= 2 * ref, (name, err, ref)


@pytest.mark.parametrize("Rab,gate", [(1, "scalar"), (2, "channel")])
def test_double_backward_through_the_kernels_raises(Rab, gate):
    """A gradient penalty through the Triton path (a backward with ``create_graph=True``, then a backward of that
    gradient) raises, where it would silently drop the kernels' second derivatives; the PyTorch chunked path takes
    it (its second derivatives are autograd's)."""
    inputs = random_inputs(1, 5, 1, 16, 16, Rab, 1, gate)
    for mode in ("triton", "chunk"):
        q, k, v, a, b, g, h0 = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
        o, _ = ops.dplr(q, k, v, a, b, g, initial_state=h0, mode=mode)
        weight = torch.randn(o.shape, device=o.device, requires_grad=True)  # an incoming gradient with a graph
        (dq,) = torch.autograd.grad((o * weight).sum(), q, create_graph=True)
        if mode == "triton":
            with pytest.raises(RuntimeError, match="once_differentiable"):
                dq.square().sum().backward()
        else:
            dq.square().sum().backward()
            assert k.grad is not None and k.grad.abs().sum() > 0


@pytest.mark.parametrize("with_bias", [True, False])
def test_mamba2_gate_kernel(with_bias):
    """Gated DeltaNet's gate ``-exp(A_log) softplus(a + dt_bias)`` per head, as ``ops.mechanisms.mamba2_log_decay``
    takes it on a GPU: KDA's gate kernel with one channel a head. The gate and the gradients of a, A_log and
    dt_bias against PyTorch's in fp64, over 1,001 rows (not a block's multiple) of 5 heads, a out to ±30."""
    from rankdecay.ops.mechanisms import mamba2_log_decay
    from rankdecay.ops.triton.gate import kda_gate

    gen = torch.Generator().manual_seed(43)
    a = 8 * torch.randn(1001, 5, generator=gen, dtype=torch.float64)
    a[0] = torch.tensor([30.0, -30.0, 20.5, -20.5, 0.0], dtype=torch.float64)
    A_log, dt_bias = torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    weights = torch.randn(1001, 5, generator=gen, dtype=torch.float64).to(DEVICE)
    results = []
    for fn, dtype in ((lambda x, A, dt: kda_gate(x.unsqueeze(-1), A, dt).squeeze(-1), torch.float32),
                      (mamba2_log_decay, torch.float32), (mamba2_log_decay, None)):
        leaves = [t.to(DEVICE, dtype or t.dtype).requires_grad_() for t in (a, A_log, dt_bias)]
        g = fn(leaves[0], leaves[1], leaves[2] if with_bias else None)
        wrt = leaves if with_bias else leaves[:2]
        results.append([g, *torch.autograd.grad((g * weights.to(g.dtype)).sum(), wrt)])
    assert results[0][0].dtype == torch.float32 and results[0][0].shape == a.shape
    for name, got, torch_fp32, exp in zip(["g", "d a", "d A_log", "d dt_bias"], *results):
        err, ref = rel_rms(got.double(), exp), rel_rms(torch_fp32.double(), exp)
        assert err < 1e-6 or err <= 2 * ref, (name, err, ref)


# --- GPU only: realistic sizes, bf16 -------------------------------------------------


@GPU
def test_gpu_gla_and_hdla_gates_take_the_kernel():
    """On a GPU the GLA and HDLA layers' log-decay is the kernel's."""
    from rankdecay.ops.mechanisms import logsigmoid_log_decay
    from rankdecay.ops.triton.gate import logsigmoid_gate

    z = torch.randn(2, 100, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(logsigmoid_log_decay(z, 16.0), logsigmoid_gate(z, 16.0))
    assert rel_rms(logsigmoid_log_decay(z, 16.0), F.logsigmoid(z.float()) / 16.0) < 1e-6


@GPU
def test_gpu_mamba2_log_decay_takes_the_kernel():
    """On a GPU Gated DeltaNet's and Head-in-Head's gate is KDA's kernel with one channel a head; gate shapes the
    kernel does not index (A_log not [H]) keep PyTorch's form, which broadcasts them."""
    from rankdecay.ops.mechanisms import mamba2_log_decay
    from rankdecay.ops.triton.gate import kda_gate

    a = torch.randn(4, 1000, 16, device=DEVICE, dtype=torch.bfloat16)
    A_log, dt_bias = torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE)
    want = -A_log.exp() * F.softplus(a.float() + dt_bias)
    assert torch.equal(mamba2_log_decay(a, A_log, dt_bias), kda_gate(a.unsqueeze(-1), A_log, dt_bias).squeeze(-1))
    assert rel_rms(mamba2_log_decay(a, A_log, dt_bias), want) < 1e-6
    assert rel_rms(mamba2_log_decay(a, A_log[:1], dt_bias), -A_log[:1].exp() * F.softplus(a.float() + dt_bias)) < 1e-6


@GPU
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gpu_kda_log_decay_takes_the_kernel(lower_bound):
    """On a GPU ``kda_log_decay`` is the kernel's; with a bf16 projection its gradient is as close to fp64's as the
    PyTorch form's (one rounding to bf16 each)."""
    from rankdecay.ops.mechanisms import _kda_log_decay, kda_log_decay
    from rankdecay.ops.triton.gate import kda_gate

    gen = torch.Generator().manual_seed(41)
    B, T, H, K = 2, 1000, 4, 128
    a = (4 * torch.randn(B, T, H, K, generator=gen)).to(DEVICE, torch.bfloat16)
    A_log, dt_bias = torch.randn(H, generator=gen).to(DEVICE), torch.randn(H * K, generator=gen).to(DEVICE)
    weights = torch.randn(B, T, H, K, generator=gen).to(DEVICE)
    grads = []
    for fn, dtype in ((kda_log_decay, None), (_kda_log_decay, None), (_kda_log_decay, torch.float64)):
        leaves = [x.to(dtype or x.dtype).requires_grad_() for x in (a, A_log, dt_bias)]
        g = fn(*leaves, lower_bound)
        grads.append([g, *torch.autograd.grad((g * weights.to(g.dtype)).sum(), leaves)])
    with torch.no_grad():
        assert torch.equal(grads[0][0], kda_gate(a, A_log, dt_bias, lower_bound))
    for i, name in enumerate(["g", "d a", "d A_log", "d dt_bias"]):
        err, ref = rel_rms(grads[0][i].double(), grads[2][i]), rel_rms(grads[1][i].double(), grads[2][i])
        assert err <= 1.05 * ref + 1e-6, (name, err, ref)


@GPU
@pytest.mark.parametrize("Rab,Rkv,gate", [(1, 1, "scalar"), (2, 1, "channel"), (4, 1, "scalar"), (0, 1, "channel"),
                                          (2, 2, "scalar")])
@pytest.mark.parametrize("grads", [True, False], ids=["autograd", "fused-forward"])
def test_gpu_bf16_realistic_sizes(Rab, Rkv, gate, grads, output_form):
    """bf16 inputs: the Triton path's error (against fp64) is no worse than the fp32 PyTorch path's."""
    inputs = random_inputs(2, 1000, 4, 128, 128, Rab, Rkv, gate, dtype=torch.bfloat16)
    with torch.set_grad_enabled(grads):
        exact = run("chunk", [None if x is None else x.double() for x in inputs], grads=grads)
        got, ref = run("triton", inputs, grads=grads), run("chunk", inputs, grads=grads)
    for name, x, y, e in zip(names(inputs), got, ref, exact):
        err, ref_err = rel_rms(x, e), rel_rms(y, e)
        assert err <= 1.5 * ref_err + 1e-6, f"{name}: triton {err:.2e} vs PyTorch chunk {ref_err:.2e}"


@GPU
@pytest.mark.parametrize("matmul_precision", ["high", "medium"], indirect=True)
@pytest.mark.parametrize("Rab,Rkv,gate", [(1, 1, "scalar"), (2, 1, "channel"), (0, 1, "channel"), (4, 1, "scalar"),
                                          (2, 2, "scalar")])
def test_gpu_bf16_reduced_matmul_precision(Rab, Rkv, gate, matmul_precision):
    """At a reduced precision every error against fp64 stays within eight units of the products'
    rounding: 8 * 2^-11 = 2^-8 for one TF32 pass ("high"), 8 * 2^-8 = 2^-5 for bf16 ("medium"), as on the CPU.
    (bf16 outputs alone cost ~2e-3: see BENCHMARKS.md, ``benchmarks/precision_errors.py``.)"""
    inputs = random_inputs(2, 1000, 4, 128, 128, Rab, Rkv, gate, dtype=torch.bfloat16)
    exact = run("chunk", [None if x is None else x.double() for x in inputs])
    got = run("triton", inputs)
    bound = 2 ** -8 if matmul_precision == "high" else 2 ** -5
    for name, x, e in zip(names(inputs), got, exact):
        err = rel_rms(x, e)
        assert err <= bound, f"{matmul_precision} {name}: triton {err:.2e} > {bound:.1e}"


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
def test_gpu_gated_delta_rule_realistic_size(matmul_precision, output_form):
    """Gated DeltaNet itself (k taken as a and b: the tied forward and backward, ``ties_keys``), bf16
    inputs at B2 T1000 H4 K=V=128, against fp64 on the same (bf16-rounded) inputs: at "highest" no
    worse than the PyTorch path on the bf16 inputs, at "medium" within 2^-5, for the output, final
    state and every gradient."""
    inputs = _gdn_realistic_inputs(seed=5)

    def call(mode, exact=False):
        return _grads_of(lambda *x: ops.gated_delta_rule(*x[:5], initial_state=x[5], output_final_state=True,
                                                         mode=mode), inputs, exact)

    exact = call("chunk", exact=True)
    got, ref = call("triton"), call("chunk")
    _assert_near_fp64(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
def test_gpu_gated_delta_rule_forward_realistic_size(matmul_precision, output_form):
    """Gated DeltaNet's forward alone (no autograd: with the state kernel's outputs, S_n and U_n are not
    stored), bf16 at B2 T1000 H4 K=V=128 against fp64: the same bounds as with autograd."""
    inputs = _gdn_realistic_inputs(seed=6)
    with torch.no_grad():
        exact = ops.gated_delta_rule(*[x.double() for x in inputs[:5]], initial_state=inputs[5].double(),
                                     output_final_state=True, mode="chunk")
        got = ops.gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True, mode="triton")
        ref = ops.gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True, mode="chunk")
    _assert_near_fp64(["o", "s"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
@pytest.mark.parametrize("static", [True, False], ids=["static-mask", "token-mask"])
def test_gpu_hh_forward_realistic_size(matmul_precision, static, monkeypatch):
    """Head-in-Head Gated DeltaNet's forward alone, r = 4 (the scaled form over a's rows: ``chunk_fwd.grouped_update``,
    checked taken), bf16 at B2 T1000 H4 K=V=128, β up to 2, against fp64: the bounds of ``_assert_near_fp64``."""
    taken = _grouped_spy(monkeypatch)
    q, k, v, g, beta, h0 = _gdn_realistic_inputs(seed=8)
    B, T, H = q.shape[:3]
    gen = torch.Generator().manual_seed(8)
    mask = ops.head_in_head_mask(torch.rand(*((H,) if static else (B, T, H)), 4, 4, generator=gen)).to(DEVICE)
    with torch.no_grad():
        exact = ops.hh_delta_rule(*[x.double() for x in (q, k, v, beta, mask, g)], initial_state=h0.double(),
                                  output_final_state=True, mode="chunk")
        got = ops.hh_delta_rule(q, k, v, beta, mask, g, initial_state=h0, output_final_state=True, mode="triton")
        assert taken == [True]
        ref = ops.hh_delta_rule(q, k, v, beta, mask, g, initial_state=h0, output_final_state=True, mode="chunk")
    _assert_near_fp64(["o", "s"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
@pytest.mark.parametrize("static", [True, False], ids=["static-mask", "token-mask"])
def test_gpu_hh_realistic_size(matmul_precision, static, monkeypatch):
    """Head-in-Head Gated DeltaNet with autograd, r = 4 (step 4 carries the rows' gradients on to k and the mask:
    ``chunk_bwd._hh_rows_bwd``, checked taken, by groups of 32 channels: ``_grad_hh_kernel``), bf16 at B2 T1000 H4
    K=V=128, β up to 2, against fp64: the bounds of ``_assert_near_fp64`` for the output, final state and every
    gradient, the mask's too."""
    taken, blocks = _hh_rows_spy(monkeypatch), _hh_key_block_spy(monkeypatch)
    q, k, v, g, beta, h0 = _gdn_realistic_inputs(seed=9)
    B, T, H, D = q.shape
    gen = torch.Generator().manual_seed(9)
    mask = ops.head_in_head_mask(torch.rand(*((H,) if static else (B, T, H)), 4, 4, generator=gen)).to(DEVICE)
    inputs = [q, k, v, beta, mask, g, h0]

    def call(mode, exact=False):
        return _grads_of(lambda *x: ops.hh_delta_rule(*x[:6], initial_state=x[6], output_final_state=True,
                                                      mode=mode), inputs, exact)

    exact = call("chunk", exact=True)
    got = call("triton")
    assert taken == [True] and blocks == [32], (taken, blocks)
    ref = call("chunk")
    _assert_near_fp64(["o", "s", "dq", "dk", "dv", "dbeta", "dmask", "dg", "dh0"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
def test_gpu_gated_delta_product_realistic_size(matmul_precision):
    """Gated DeltaProduct, n_h = 2, on the kernels (the interleaved sequence through Gated DeltaNet's one node),
    bf16 inputs at B2 T500 (1000 sub-steps) H4 K=V=128, β up to 2, against fp64 through the rank machinery
    (mode="chunk"): the bounds of ``_assert_near_fp64`` for the output, final state and every gradient."""
    q, k, v, g, beta, h0 = _gdn_realistic_inputs(seed=7)
    inputs = [q[:, :500], k, v, g[:, :500], beta, h0]

    def call(mode, exact=False):
        return _grads_of(lambda *x: ops.gated_delta_product(*x[:5], 2, initial_state=x[5], output_final_state=True,
                                                            mode=mode), inputs, exact)

    exact = call("chunk", exact=True)
    got, ref = call("triton"), call("chunk")
    _assert_near_fp64(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
@pytest.mark.parametrize("grads", [True, False], ids=["autograd", "forward"])
def test_gpu_hdla_realistic_size(matmul_precision, grads):
    """HDLA itself (one autograd node, its products as six of token rows: ``chunk_bwd._HDLA``), bf16 inputs at
    B2 T1000 H4 K=V=128 with a per-channel gate and β up to 2, against fp64 on the same inputs: at "highest" no
    worse than the PyTorch path on the bf16 inputs, at "medium" within 2^-5, for the output, final state and
    every gradient."""
    gen = torch.Generator().manual_seed(7)
    B, T, H, D = 2, 1000, 4, 128
    q, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(B, T, H, D, generator=gen) + 3)
    beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, D, D, generator=gen)
    inputs = [x.to(DEVICE, torch.bfloat16) for x in (q, k, v, g, beta)] + [h0.to(DEVICE)]

    def call(mode, exact=False):
        return _grads_of(lambda *x: ops.hdla(*x[:5], initial_state=x[5], output_final_state=True, mode=mode), inputs,
                         exact, grads)

    exact = call("chunk", exact=True)
    got, ref = call("triton"), call("chunk")
    if grads:
        assert type(got[0].grad_fn).__name__ == "_HDLABackward"
    _assert_near_fp64(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref, exact, matmul_precision)


@GPU
@pytest.mark.parametrize("kda_pair,kda_rows,kda_pair_bwd", [(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1)],
                         ids=["two-products", "one-kernel", "rows-in-step4", "one-pass-backward"])  # (1, 1, 0): defaults
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
def test_gpu_kda_realistic_size(matmul_precision, kda_pair, kda_rows, kda_pair_bwd, monkeypatch):
    """Kimi Delta Attention (a = k with β as its factors: two per-channel products in the forward), bf16 inputs
    at B2 T1000 H4 K=V=128 with a per-channel gate and β up to 2, against fp64 on the same inputs: the bounds of
    ``_assert_near_fp64`` for the output, final state and every gradient. Where fla is installed, its
    ``chunk_kda`` on the same inputs agrees with fp64 no better than ours at "medium" (fla's precision).
    ``kda_pair``: the forward's per-channel products in two kernels (0) or one (1, the default); ``kda_rows``: step 4
    forms b and carries a's and b's gradients on to k and g (1, the default) or returns them to autograd (0);
    ``kda_pair_bwd``: the backward's four product gradients in one pass (1, the default) or two (0)."""
    from rankdecay.ops.triton import chunk_fwd

    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_pair", kda_pair)
    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_rows", kda_rows)
    monkeypatch.setitem(chunk_fwd._KNOBS, "kda_pair_bwd", kda_pair_bwd)
    gen = torch.Generator().manual_seed(8)
    inputs = _gdn_realistic_inputs(seed=8)
    B, T, H, D = inputs[0].shape
    inputs[3] = F.logsigmoid(torch.randn(B, T, H, D, generator=gen) + 3).to(DEVICE, torch.bfloat16)

    def call(fn, exact=False):
        return _grads_of(lambda *x: fn(*x[:5], initial_state=x[5], output_final_state=True), inputs, exact)

    names = ["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    exact = call(lambda *x, **kw: ops.kda(*x, mode="chunk", **kw), exact=True)
    got = call(lambda *x, **kw: ops.kda(*x, mode="triton", **kw))
    _assert_near_fp64(names, got, call(lambda *x, **kw: ops.kda(*x, mode="chunk", **kw)), exact, matmul_precision)
    with torch.no_grad():  # the forward alone takes the scaled form (``chunk_fwd``'s channel_scaled)
        fwd = ops.kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, mode="triton")
        ref = ops.kda(*inputs[:5], initial_state=inputs[5], output_final_state=True, mode="chunk")
    _assert_near_fp64(["o (forward alone)", "s (forward alone)"], fwd, ref, exact[:2], matmul_precision)
    if importlib.util.find_spec("fla") is None or matmul_precision != "medium":
        return
    from fla.ops.kda import chunk_kda  # the recurrence fla calls KDA, with fla's own kernels

    fla = call(lambda *x, **kw: chunk_kda(*x, **kw))
    for name, x, y, e in zip(names + ["o (forward alone)", "s (forward alone)"], got + list(fwd), fla + fla[:2],
                             exact + exact[:2]):
        assert rel_rms(y.float(), e) < 2 ** -5, f"fla {name}: {rel_rms(y.float(), e):.2e}: not the same recurrence"
        assert rel_rms(x, e) <= 2 * rel_rms(y.float(), e) + 1e-4, f"{name}: ours {rel_rms(x, e):.2e}"


@GPU
@pytest.mark.parametrize("matmul_precision,K,V", [("medium", 32, 32), ("highest", 32, 32), ("medium", 64, 16),
                                                  ("medium", 128, 32), ("medium", 48, 80), ("medium", 256, 256),
                                                  ("medium", 16, 64), ("medium", 16, 8)],
                         indirect=["matmul_precision"])
@pytest.mark.parametrize("mechanism", ["gdn", "hh", "hdla", "kda", "gla"])
def test_gpu_awkward_head_sizes(mechanism, K, V, matmul_precision):
    """Each mechanism's kernels at head sizes other than K = V = 128: small value heads (narrow value tiles, which
    Triton 3.6 compiled into illegal memory accesses at K >= 64, so that the kernels take them padded to 64:
    ``chunk_bwd.padded_heads``; BENCHMARKS.md sessions 13, 14, 37), small key heads (K = 16, whose 16-wide key tiles
    it compiled into wrong results for Head-in-Head and an illegal access for HDLA, so that keys narrower than 32
    are padded to 32; session 38), K != V, sizes that are not powers of two, and K = V = 256. bf16 at B2 T300 H2, β
    up to 2, against fp64 within the bounds of ``_assert_near_fp64``: the output, final state and every gradient,
    and the forward without autograd (each mechanism's own forward form), and the recurrent kernel of decoding over
    the same tokens."""
    gen = torch.Generator().manual_seed(K + V)
    B, T, H = 2, 300, 2
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    per_channel = mechanism in ("hdla", "kda", "gla")
    g = F.logsigmoid(torch.randn(*((B, T, H, K) if per_channel else (B, T, H)), generator=gen) + 3)
    beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    inputs = [x.to(DEVICE, torch.bfloat16) for x in (q, k, v, g, beta)] + [h0.to(DEVICE)]
    names = ["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    if mechanism == "hh":
        mask = ops.head_in_head_mask(torch.rand(H, 4, 4, generator=gen)).to(DEVICE)
        inputs.insert(5, mask)
        names.insert(7, "dmask")
        fn = lambda q, k, v, g, beta, mask, h0, mode: ops.hh_delta_rule(  # noqa: E731
            q, k, v, beta, mask, g, initial_state=h0, output_final_state=True, mode=mode)
    elif mechanism == "gla":  # no β
        del inputs[4], names[6]
        fn = lambda q, k, v, g, h0, mode: ops.gla(  # noqa: E731
            q, k, v, g, initial_state=h0, output_final_state=True, mode=mode)
    else:
        op = dict(gdn=ops.gated_delta_rule, hdla=ops.hdla, kda=ops.kda)[mechanism]
        fn = lambda q, k, v, g, beta, h0, mode: op(q, k, v, g, beta, initial_state=h0,  # noqa: E731
                                                   output_final_state=True, mode=mode)
    for grads in (True, False):
        exact = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, exact=True, grads=grads)
        got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs, grads=grads)
        ref = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, grads=grads)
        label = "" if grads else " (forward alone)"
        _assert_near_fp64([f"{mechanism} K={K} V={V} {n}{label}" for n in names], got, ref, exact, matmul_precision)
    # the recurrent kernel of decoding, over the same tokens
    got = _grads_of(lambda *x: fn(*x, mode="fused_recurrent"), inputs, grads=False)
    _assert_near_fp64([f"{mechanism} K={K} V={V} {n} (fused_recurrent)" for n in names[:2]], got, ref[:2], exact,
                      matmul_precision)


def _gdn_realistic_inputs(seed):
    """Gated DeltaNet's (q, k, v, g, beta) in bf16 and an fp32 initial state at B2 T1000 H4 K=V=128, β up to 2."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, D = 2, 1000, 4, 128
    q, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3)
    beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, D, D, generator=gen)
    return [x.to(DEVICE, torch.bfloat16) for x in (q, k, v, g, beta)] + [h0.to(DEVICE)]


def _grads_of(fn, inputs, exact=False, grads=True):
    """fn(*xs) -> (o, s) on copies xs of the inputs (fp64 where exact) that require their gradients (with grads), then
    the loss Σ o ⊙ linspace(-1, 1, V) + Σ sin(s) backward: [o, s] and the inputs' gradients ([o, s] without grads)."""
    xs = [(x.double() if exact else x.clone()).requires_grad_(grads) for x in inputs]
    with torch.set_grad_enabled(grads):
        o, s = fn(*xs)
    if not grads:
        return [o, s]
    ((o.double() * torch.linspace(-1, 1, o.shape[-1], device=o.device, dtype=torch.float64)).sum()
     + s.double().sin().sum()).backward()
    return [o, s] + [x.grad for x in xs]


def _assert_near_fp64(names, got, ref, exact, matmul_precision):
    """Each result finite, and against fp64: at "highest" no worse than the PyTorch path on the same bf16 inputs
    (ref), at "medium" within 2^-5."""
    for name, x, y, e in zip(names, got, ref, exact):
        assert torch.isfinite(x).all(), f"{name}: not finite"
        err, ref_err = rel_rms(x, e), rel_rms(y, e)
        bound = 1.5 * ref_err + 1e-6 if matmul_precision == "highest" else 2 ** -5
        assert err <= bound, f"{matmul_precision} {name}: triton {err:.2e} vs PyTorch chunk {ref_err:.2e}"


@GPU
def test_gpu_long_sequence_stays_finite():
    inputs = random_inputs(1, 65536, 2, 64, 64, 1, 1, "scalar", beta_max=2.0, strong=False)
    with torch.no_grad():
        (o, s), (o_ref, s_ref) = run("triton", inputs, grads=False), run("chunk", inputs, grads=False)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_matches(o, o_ref, 1e-5, "o")
    assert_matches(s, s_ref, 1e-5, "final state")


@GPU
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"], indirect=True)
@pytest.mark.parametrize("mechanism", ["gdn", "hh", "hdla", "gla"])
def test_gpu_segmented_walk_long_sequence(mechanism, matmul_precision, monkeypatch):
    """At B = 1, H = 2 and T = 16k the forward walks its chunks as segments by ``chunk_fwd.segments``' own rule (Gated
    DeltaNet's and GLA's 256 chunks, Head-in-Head's at r = 4 1024, HDLA's 512): bf16 q, k, v at K = V = 128, mild
    gates (the state carries across segments), β up to 2. The outputs and final state, against fp64 through the
    PyTorch path, are no worse than the unsegmented walk's (``_KNOBS["segments"] = 1``) beyond 1.5x plus 1e-6;
    finite."""
    from rankdecay.ops.triton import chunk_fwd

    walks = _spy_segments(monkeypatch, chunk_fwd)
    inputs, fn = _mechanism_case(mechanism, 1, 16384, 2, 128, 128, seed=5, r=4)
    inputs[3] = 0.05 * inputs[3]
    inputs = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]
    with torch.no_grad():
        exact = fn(*[x.double() for x in inputs], mode="chunk")
        got = fn(*inputs, mode="triton")
        assert walks and walks[0] > 1, walks
        monkeypatch.setitem(chunk_fwd._KNOBS, "segments", 1)
        plain = fn(*inputs, mode="triton")
    assert len(walks) == 1, walks
    for name, x, y, e in zip(["o", "s"], got, plain, exact):
        assert torch.isfinite(x).all(), f"{name}: not finite"
        err, ref_err = rel_rms(x, e), rel_rms(y, e)
        assert err <= 1.5 * ref_err + 1e-6, f"{mechanism} {name}: segmented {err:.2e} vs one walk {ref_err:.2e}"


@GPU
@pytest.mark.parametrize("mechanism", ["gdn", "hh", "hdla", "gla"])
def test_gpu_segmented_walks_with_autograd(mechanism, monkeypatch):
    """With autograd at B = 1, H = 2, T = 4096 both state kernels walk segments by ``chunk_fwd.segments``' own rule,
    the forward's and the backward's in reverse (Gated DeltaNet's and GLA's 64 chunks in 4, Head-in-Head's 256 at
    r = 4 in 16, HDLA's 256 at 16 tokens in 16): bf16 q, k, v at K = V = 128, mild gates, β up to 2, the "highest"
    precision. The output, final state and every gradient, against fp64 through the PyTorch path, are no worse than
    with one walk each (``_KNOBS["segments"] = 1``) beyond 1.5x plus 1e-6 (GLA has no β to take a gradient of)."""
    from rankdecay.ops.triton import chunk_bwd, chunk_fwd

    back = _spy_segments(monkeypatch, chunk_bwd)
    inputs, fn = _mechanism_case(mechanism, 1, 4096, 2, 128, 128, seed=6, r=4)
    inputs[3] = 0.05 * inputs[3]
    inputs = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]
    exact = _grads_of(lambda *x: fn(*x, mode="chunk"), inputs, exact=True)
    got = _grads_of(lambda *x: fn(*x, mode="triton"), inputs)
    assert back == [dict(gdn=4, hh=16, hdla=16, gla=4)[mechanism]], back
    monkeypatch.setitem(chunk_fwd._KNOBS, "segments", 1)
    plain = _grads_of(lambda *x: fn(*x, mode="triton"), inputs)
    assert len(back) == 1, back
    for name, x, y, e in zip(["o", "s", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, plain, exact):
        if e is None:  # GLA reads no β
            assert (mechanism, name, x, y) == ("gla", "dbeta", None, None), name
            continue
        assert torch.isfinite(x).all(), f"{name}: not finite"
        err, ref_err = rel_rms(x, e), rel_rms(y, e)
        assert err <= 1.5 * ref_err + 1e-6, f"{mechanism} {name}: segmented {err:.2e} vs one walk {ref_err:.2e}"


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_gated_delta_rule_decode_fast_path(gate):
    """gated_delta_rule(mode="fused_recurrent") takes its own kernel (no DPLR factors)."""
    B, T, H, K, V = 2, 9, 3, 20, 24
    q, v = torch.randn(B, T, H, K, device=DEVICE), torch.randn(B, T, H, V, device=DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, device=DEVICE), dim=-1)
    beta = 2 * torch.rand(B, T, H, device=DEVICE)
    g = None if gate is None else F.logsigmoid(torch.randn((B, T, H) if gate == "scalar" else (B, T, H, K),
                                                           device=DEVICE))
    h0 = torch.randn(B, H, K, V, device=DEVICE)
    with torch.no_grad():
        o, s = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, mode="fused_recurrent")
        o_ref, s_ref = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, mode="naive")
    assert_matches(o, o_ref, 1e-5, "o")
    assert_matches(s, s_ref, 1e-5, "final state")


def test_gated_delta_rule_decode_fast_path_errors():
    """The fast path checks what dplr would, with the same messages."""
    q = torch.randn(1, 1, 2, 16, device=DEVICE)
    beta = torch.rand(1, 1, 2, device=DEVICE)
    call = lambda **kw: ops.gated_delta_rule(**{"q": q, "k": q, "v": q, "g": None, "beta": beta,  # noqa: E731
                                                "mode": "fused_recurrent", **kw})
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\] = \[1, 2, 16, 16\]"):
        call(initial_state=torch.zeros(1, 2, 16, 8, device=DEVICE))
    with pytest.raises(TypeError, match="scale must be a float"):
        call(scale="0.1")
    with pytest.raises(ValueError, match="computes in fp32"):
        call(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(RuntimeError, match="no backward"):
        call(q=q.clone().requires_grad_())
    with torch.no_grad():
        o, s = call(scale=0.5, output_final_state=True)
        ref, s_ref = ops.gated_delta_rule(q, q, q, None, beta, scale=0.5, output_final_state=True, mode="naive")
    assert_matches(o, ref, 1e-5, "o with scale")
    assert_matches(s, s_ref, 1e-5, "state")


@pytest.mark.parametrize("mode", ["fused_recurrent", "chunk", "naive"])
def test_qk_l2norm_in_kernel(mode):
    """use_qk_l2norm_in_kernel (fla's argument) equals normalising q and k first, on every path."""
    B, T, H, K, V = 1, 19, 2, 20, 12
    gen = torch.Generator().manual_seed(3)
    q, k = [(3 * torch.randn(B, T, H, K, generator=gen)).to(DEVICE) for _ in range(2)]
    v, beta = torch.randn(B, T, H, V, generator=gen).to(DEVICE), 2 * torch.rand(B, T, H, generator=gen).to(DEVICE)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen)).to(DEVICE)
    k[0, 4, 1] = 0.0  # a zero key stays zero (the norm is clamped at 1e-6)
    kw = dict(initial_state=torch.randn(B, H, K, V, generator=gen).to(DEVICE), output_final_state=True, chunk_size=16)
    with torch.no_grad():
        got = ops.gated_delta_rule(q, k, v, g, beta, mode=mode, use_qk_l2norm_in_kernel=True, **kw)
        ref = ops.gated_delta_rule(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v, g, beta,
                                   mode="naive", **kw)
    for name, x, y in zip(["o", "final state"], got, ref):
        assert_matches(x, y, 1e-5, f"{mode}: {name}")


@pytest.mark.parametrize("gated", [True, False], ids=["gdn", "deltanet"])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_gated_delta_rule_decode_forms_the_gates(gated, beta_max):
    """gated_delta_rule_decode's kernel forms β = beta_max σ(b) and g = -e^{A_log} softplus(a + dt_bias)
    (softplus linear above 20, accurate far below 0: a from -60 to 60) as the layers do in PyTorch."""
    B, T, H, K, V = 2, 5, 3, 20, 24
    gen = torch.Generator().manual_seed(4)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    b = 4 * rnd(B, T, H)
    a = torch.linspace(-60, 60, B * T * H).view(B, T, H).to(DEVICE) if gated else None
    A_log, dt_bias = (rnd(H), rnd(H)) if gated else (None, None)
    h0 = rnd(B, H, K, V)
    g = -A_log.exp() * F.softplus(a + dt_bias) if gated else None
    kw = dict(initial_state=h0, output_final_state=True)
    with torch.no_grad():
        got = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, beta_max=beta_max, mode="fused_recurrent",
                                          **kw)
        naive = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, beta_max=beta_max, mode="naive", **kw)
        ref = ops.gated_delta_rule(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v, g,
                                   beta_max * b.sigmoid(), mode="naive", **kw)
    for name, x, y, z in zip(["o", "final state"], got, naive, ref):
        assert_matches(x, z, 1e-5, f"kernel: {name}")
        assert_matches(y, z, 1e-6, f"naive: {name}")


def test_kda_decode_kernel_matches_the_recurrence():
    """kda(mode="fused_recurrent") takes the delta rule's decode kernel with the per-channel decay before the
    reflection (Kimi Delta Attention's order, not gated_delta_rule's after it): outputs and final state against the
    naive recurrence, strong decays (log-gates to -30) and β up to 2 among them; and the two orders differ here."""
    B, T, H, K, V = 2, 9, 3, 20, 24
    gen = torch.Generator().manual_seed(6)
    q, v = torch.randn(B, T, H, K, generator=gen).to(DEVICE), torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE)
    beta = (2 * torch.rand(B, T, H, generator=gen)).to(DEVICE)
    g = (-30 * torch.rand(B, T, H, K, generator=gen) ** 4).to(DEVICE)
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    kw = dict(initial_state=h0, output_final_state=True)
    with torch.no_grad():
        got = ops.kda(q, k, v, g, beta, mode="fused_recurrent", **kw)
        ref = ops.kda(q, k, v, g, beta, mode="naive", **kw)
        other = ops.gated_delta_rule(q, k, v, g, beta, mode="naive", **kw)
    for name, x, y in zip(["o", "final state"], got, ref):
        assert torch.isfinite(x).all(), name
        assert_matches(x, y, 1e-5, name)
    assert rel_rms(other[0], ref[0]) > 1e-2, "the test cannot tell the two orders apart"


def _assert_decode_kernel_matches_naive(call, h0, label):
    """``call(mode=, initial_state=, output_final_state=, **kw) -> (o, final state)``: the decode kernel, writing
    the state into initial_state, against the naive recurrence from the same state (outputs, final state)."""
    with torch.no_grad():
        h = h0.clone()
        got = call(mode="fused_recurrent", initial_state=h, output_final_state=True, inplace_final_state=True)
        ref = call(mode="naive", initial_state=h0, output_final_state=True)
    assert got[1] is h, f"{label}: the final state was not written into initial_state"
    for name, x, y in zip(["o", "final state"], got, ref):
        assert torch.isfinite(x).all(), f"{label}: {name}"
        assert_matches(x, y, 1e-5, f"{label}: {name}")


def _varlen_decode_calls(lengths, H=2, K=16, V=8, seed=11):
    """Every entry with a decode kernel, as ``call(mode, **kwargs)`` (the entry's own keywords) on inputs packed
    along T = sum(lengths) (B = 1), strong decays and β up to 2 where the entry takes them."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, b, a = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, V), rnd(1, T, H), rnd(1, T, H, K)
    kn = F.normalize(k, dim=-1)
    beta = 2 * torch.rand(1, T, H, generator=gen).to(DEVICE)
    g = -10 * torch.rand(1, T, H, generator=gen).to(DEVICE)
    gk = -10 * torch.rand(1, T, H, K, generator=gen).to(DEVICE)
    k2, v2, b2 = (torch.stack([x, x.flip(-1)], 2).flatten(1, 2) for x in (kn, v, beta))  # two sub-steps a token
    mask = ops.head_in_head_mask(torch.rand(1, T, H, 4, 4, generator=gen) + 0.5).to(DEVICE)
    a_log, bias, bias_k, m_org = rnd(H), rnd(H), rnd(H * K), rnd(H, 4, 4)
    x = random_inputs(1, T, H, K, V, 2, 2, "channel", beta_max=2.0, seed=seed)[:6]
    return {
        "dplr Rab=2 Rkv=2": lambda m, **kw: ops.dplr(*x, mode=m, **kw),
        "gated_delta_rule": lambda m, **kw: ops.gated_delta_rule(q, kn, v, g, beta, mode=m, **kw),
        "gated_delta_rule GVA": lambda m, **kw: ops.gated_delta_rule(q[:, :, :1], kn[:, :, :1], v, g, beta, mode=m,
                                                                     **kw),
        "kda": lambda m, **kw: ops.kda(q, kn, v, gk, beta, mode=m, **kw),
        "hdla": lambda m, **kw: ops.hdla(q, kn, v, gk, beta, mode=m, **kw),
        "hh_delta_rule per token": lambda m, **kw: ops.hh_delta_rule(q, kn, v, beta, mask, g, mode=m, **kw),
        "gated_delta_product": lambda m, **kw: ops.gated_delta_product(q, k2, v2, g, b2, 2, mode=m, **kw),
        "gated_delta_rule_decode": lambda m, **kw: ops.gated_delta_rule_decode(q, k, v, b, b, a_log, bias, mode=m,
                                                                               **kw),
        "kda_decode": lambda m, **kw: ops.kda_decode(q, k, v, a, b, a_log, bias_k, lower_bound=-5.0, mode=m,
                                                     **kw),
        "hdla_decode": lambda m, **kw: ops.hdla_decode(q, k, v, a, b, mode=m, **kw),
        "hh_delta_rule_decode": lambda m, **kw: ops.hh_delta_rule_decode(q, k, v, b, b, m_org, a_log, bias,
                                                                         mode=m, **kw),
        "gated_delta_product_decode": lambda m, **kw: ops.gated_delta_product_decode(
            q, torch.stack([k, k.flip(-1)], 2).flatten(1, 2), v2, b, torch.stack([b, -b], 2).flatten(1, 2), 2,
            a_log, bias, mode=m, **kw),
    }


VARLEN_DECODE_ENTRIES = ("dplr Rab=2 Rkv=2", "gated_delta_rule", "gated_delta_rule GVA", "kda", "hdla",
                         "hh_delta_rule per token", "gated_delta_product", "gated_delta_rule_decode", "kda_decode",
                         "hdla_decode", "hh_delta_rule_decode", "gated_delta_product_decode")


def test_varlen_decode_entries_are_every_call():
    """The parametrize below names the entries without building their inputs at collection."""
    assert tuple(_varlen_decode_calls([1])) == VARLEN_DECODE_ENTRIES


@pytest.mark.parametrize("name", VARLEN_DECODE_ENTRIES)
def test_fused_recurrent_cu_seqlens(name, monkeypatch):
    """cu_seqlens on the decode kernels: each program walks its own sequence where it lies in the packed input
    (``fused_recurrent._sequence``), so nothing is padded or gathered (``pack_varlen`` never runs), against the
    per-token loop (mode="naive", which pads each sequence to the longest); sequences of 5, 0, 13 and 1 tokens (the
    empty one passes its initial state through), the final states also written in place."""
    lengths = [5, 0, 13, 1]
    N, H, K, V = len(lengths), 2, 16, 8
    call = _varlen_decode_calls(lengths)[name]
    cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        o_ref, s_ref = call("naive", initial_state=h0, output_final_state=True, cu_seqlens=cu)
        packs = []
        monkeypatch.setattr(dplr_module, "pack_varlen", lambda *a: packs.append(a) or pytest.fail("padded"))
        o, s = call("fused_recurrent", initial_state=h0, output_final_state=True, cu_seqlens=cu)
        cache = h0.clone()
        o2, s2 = call("fused_recurrent", initial_state=cache, output_final_state=True, cu_seqlens=cu.int(),
                      inplace_final_state=True)
    assert o.shape == o_ref.shape == (1, sum(lengths), H, V) and s.shape == (N, H, K, V) and not packs
    assert_matches(o.float(), o_ref.float(), 1e-5, f"{name}: o")
    assert_matches(s, s_ref, 1e-5, f"{name}: final states")
    assert torch.equal(s[1], h0[1]), "the empty sequence's state passes through"
    assert s2 is cache and torch.equal(s2, s) and torch.equal(o2, o), "in place, int32 offsets"


def test_fused_recurrent_cu_seqlens_errors():
    """The decode kernels' entries check cu_seqlens as dplr does, and the states against the number of sequences."""
    q = torch.randn(1, 6, 2, 16, device=DEVICE)
    beta = torch.rand(1, 6, 2, device=DEVICE)
    call = lambda **kw: ops.gated_delta_rule(**{"q": q, "k": q, "v": q, "g": None, "beta": beta,  # noqa: E731
                                                "mode": "fused_recurrent", **kw})
    cu = torch.tensor([0, 2, 6], device=DEVICE)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\] = \[2, 2, 16, 16\]"):
        call(cu_seqlens=cu, initial_state=torch.zeros(1, 2, 16, 16, device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T = 6"):
        call(cu_seqlens=torch.tensor([0, 2, 5], device=DEVICE))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        call(cu_seqlens=torch.tensor([0, 4, 2, 6], device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 or int64 tensor"):
        call(cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="B must be 1"):
        ops.gated_delta_rule_decode(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), None,
                                    beta.expand(2, -1, -1), cu_seqlens=cu, mode="fused_recurrent")


def test_decode_steps_take_the_delta_rule_kernel(monkeypatch):
    """Each mechanism's decode step (mode="fused_recurrent") reaches the delta rule's decode kernel in the form its
    step needs (no DPLR factors built): KDA's decay first, its gates formed inside (bounded or not), HDLA's two
    reflections, Gated DeltaProduct's interleaved sub-steps, Head-in-Head's mask (static or per token); GLA keeps the
    generic kernel. (``benchmarks/sm90_resources.py --decode`` compiles these launches for Hopper.)"""
    from rankdecay.ops.triton import fused_recurrent as fr

    kernel, seen = fr._fused_recurrent_gdn_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw) or kernel[grid](*a, **kw)

    monkeypatch.setattr(fr, "_fused_recurrent_gdn_kernel", Recorder())
    B, H, K, V = 1, 2, 16, 8
    gen = torch.Generator().manual_seed(10)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, b, a = rnd(B, 1, H, K), rnd(B, 1, H, K), rnd(B, 1, H, V), rnd(B, 1, H), rnd(B, 1, H, K)
    s = torch.rand(B, 1, H, generator=gen).to(DEVICE)  # β
    g, gk, mask = -rnd(B, 1, H).abs(), -rnd(B, 1, H, K).abs(), ops.head_in_head_mask(torch.rand(H, 4, 4)).to(DEVICE)
    calls = {
        "kda": (lambda m: ops.kda(q, k, v, gk, s, mode=m), dict(DECAY_FIRST=True, RAW_GATES=False)),
        "kda_decode": (lambda m: ops.kda_decode(q, k, v, a, b, rnd(H), rnd(H * K), mode=m),
                       dict(DECAY_FIRST=True, RAW_GATES=True, BOUNDED=False, GATE=2)),
        "kda_decode bounded": (lambda m: ops.kda_decode(q, k, v, a, b, rnd(H), rnd(H * K), lower_bound=-5.0, mode=m),
                               dict(DECAY_FIRST=True, RAW_GATES=True, BOUNDED=True)),
        "hdla": (lambda m: ops.hdla(q, k, v, gk, 2 * s, mode=m), dict(HOUSEHOLDER=True, GATE=2)),
        "hdla_decode": (lambda m: ops.hdla_decode(q, k, v, a, b, mode=m),
                        dict(HOUSEHOLDER=True, RAW_GATES=True, LOGSIGMOID=True, QK_L2NORM=2)),
        "gdp": (lambda m: ops.gated_delta_product(q, torch.cat([k, k], 1), torch.cat([v, v], 1), g,
                                                  torch.cat([s, s], 1), 2, mode=m),
                dict(HOUSEHOLDER=False, GROUPS=0, NH=2, RAW_GATES=False)),
        "gated_delta_product_decode": (
            lambda m: ops.gated_delta_product_decode(q, torch.cat([k, k], 1), torch.cat([v, v], 1), b,
                                                     torch.cat([b, b], 1), 2, rnd(H), rnd(H), mode=m),
            dict(NH=2, RAW_GATES=True, QK_L2NORM=1, GATE=1)),
        "hh": (lambda m: ops.hh_delta_rule(q, k, v, s, mask, g, mode=m), dict(GROUPS=4, MASK_PER_TOKEN=False)),
        "hh per token": (lambda m: ops.hh_delta_rule(q, k, v, s, mask.expand(B, 1, H, 4, 4), g, mode=m),
                         dict(GROUPS=4, MASK_PER_TOKEN=True)),
        "hh_delta_rule_decode": (lambda m: ops.hh_delta_rule_decode(q, k, v, b, b, mask, rnd(H), rnd(H), mode=m),
                                 dict(GROUPS=4, MASK_RAW=True, RAW_GATES=True, QK_L2NORM=1, GATE=1)),
    }
    with torch.no_grad():
        for name, (call, flags) in calls.items():
            seen.clear()
            call("fused_recurrent")
            assert len(seen) == 1 and all(seen[0][f] == value for f, value in flags.items()), (name, seen)
        seen.clear()
        ops.gla(q, k, v, gk, mode="fused_recurrent")
        assert not seen, "GLA has no delta step: the generic kernel"


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_hdla_decode_kernel_matches_the_recurrence(gate):
    """hdla(mode="fused_recurrent") takes the delta rule's decode kernel with HDLA's step, the decay between two
    reflections and the write unscaled (no DPLR factors built): outputs and the final state, written in place,
    against the naive recurrence, with log-gates to -30 and β up to 2."""
    B, T, H, K, V = 2, 9, 3, 20, 24
    gen = torch.Generator().manual_seed(8)
    q, v = torch.randn(B, T, H, K, generator=gen).to(DEVICE), torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE)
    beta = (2 * torch.rand(B, T, H, generator=gen)).to(DEVICE)
    g = (-30 * torch.rand((B, T, H) if gate == "scalar" else (B, T, H, K), generator=gen) ** 4).to(DEVICE)
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    _assert_decode_kernel_matches_naive(lambda **kw: ops.hdla(q, k, v, g, beta, **kw), h0, gate)


@pytest.mark.parametrize("K,r,gate,per_token", [(16, 4, "scalar", False), (32, 2, "channel", True),
                                             (16, 1, None, False), (32, 4, "scalar", True), (24, 4, "scalar", False)])
def test_head_in_head_decode_kernel_matches_the_recurrence(K, r, gate, per_token):
    """hh_delta_rule(mode="fused_recurrent") takes the delta rule's decode kernel with the r x r mask between the
    key's groups ((k kᵀ ⊙ expand(M)) S as k ⊙ expand(M P), P_j the group's share of kᵀ S), no factors built, for a
    static mask or one per token, a scalar, per-channel or no gate, r from 1 to 4 (K = 24, not a power of two,
    keeps the generic kernel): outputs and the final state, written in place, against the naive recurrence, with
    log-gates to -30 and β up to 2."""
    B, T, H, V = 2, 6, 3, 12
    gen = torch.Generator().manual_seed(K + r)
    q, v = torch.randn(B, T, H, K, generator=gen).to(DEVICE), torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE)
    beta = (2 * torch.rand(B, T, H, generator=gen)).to(DEVICE)
    g = None if gate is None else (-30 * torch.rand((B, T, H) if gate == "scalar" else (B, T, H, K), generator=gen)
                                   ** 4).to(DEVICE)
    shape = (B, T, H, r, r) if per_token else (H, r, r)
    # not symmetric (head_in_head_mask's are), so that the mask's orientation shows
    mask = (ops.head_in_head_mask(torch.rand(*shape, generator=gen)) + 0.3 * torch.rand(*shape, generator=gen))
    mask = mask.to(DEVICE)
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    _assert_decode_kernel_matches_naive(lambda **kw: ops.hh_delta_rule(q, k, v, beta, mask, g, **kw), h0,
                                        f"K={K} r={r} {gate} {per_token}")


@pytest.mark.parametrize("gated", [True, False], ids=["gdp", "deltaproduct"])
def test_gated_delta_product_decode_kernel_matches_the_recurrence(gated):
    """gated_delta_product(mode="fused_recurrent") takes the delta rule's decode kernel with its n_h sub-steps a token
    (the gate once, the query read after the last), reading k, v and β's rows as given: outputs and the final state,
    written in place, against the naive recurrence (the rank machinery), n_h = 3, log-gates to -30, β up to 2."""
    B, T, H, K, V, nh = 2, 7, 3, 20, 24, 3
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(B, T, H, K, generator=gen).to(DEVICE)
    k = F.normalize(torch.randn(B, T * nh, H, K, generator=gen), dim=-1).to(DEVICE)
    v, beta = torch.randn(B, T * nh, H, V, generator=gen).to(DEVICE), (2 * torch.rand(B, T * nh, H, generator=gen))
    beta = beta.to(DEVICE)
    g = (-30 * torch.rand(B, T, H, generator=gen) ** 4).to(DEVICE) if gated else None
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    _assert_decode_kernel_matches_naive(lambda **kw: ops.gated_delta_product(q, k, v, g, beta, nh, **kw), h0,
                                        "gdp" if gated else "deltaproduct")


@pytest.mark.parametrize("mode", ["fused_recurrent", "triton", "chunk", "naive"])
@pytest.mark.parametrize("gated", [True, False], ids=["gdn", "deltanet"])
def test_grouped_value_heads(mode, gated):
    """fla's grouped value heads (GVA): q and k with H heads, v, g, β and the state with HV = 3H, value head h reading
    key head h // 3. Every path matches the same op on q and k repeated to HV heads (repeat_interleave): outputs,
    final states and (where autograd runs) every gradient, q's and k's summed over their groups; strong decays, β
    up to 2, T = 7 (not a multiple of the chunk), the norms in the kernel."""
    B, T, H, G, K, V = 2, 7, 2, 3, 16, 8
    gen = torch.Generator().manual_seed(14)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, h0 = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H * G, V), rnd(B, H * G, K, V)
    beta = (2 * torch.rand(B, T, H * G, generator=gen)).to(DEVICE)
    g = (-30 * torch.rand(B, T, H * G, generator=gen) ** 4).to(DEVICE) if gated else None
    grads = mode != "fused_recurrent"

    def call(q, k, repeat):
        inputs = [x.detach().clone().requires_grad_(grads) if x is not None else None for x in (q, k, v, g, beta, h0)]
        qq, kk = (x.repeat_interleave(G, dim=2) for x in inputs[:2]) if repeat else inputs[:2]
        o, s = ops.gated_delta_rule(qq, kk, *inputs[2:5], initial_state=inputs[5], output_final_state=True,
                                    mode=mode if not repeat else "naive", use_qk_l2norm_in_kernel=True)
        if not grads:
            return [o, s]
        ((o * torch.linspace(-1, 1, V, device=o.device)).sum() + s.sin().sum()).backward()
        return [o.detach(), s.detach()] + [x.grad for x in inputs if x is not None]

    with torch.set_grad_enabled(grads):
        got, ref = call(q, k, repeat=False), call(q, k, repeat=True)
    for name, x, y in zip(["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"], got, ref):
        assert_matches(x, y, 1e-5, f"{mode}: {name}")
    with pytest.raises(ValueError, match="v must have q's H = 2 heads or a multiple of them"):
        ops.gated_delta_rule(q, k, v[:, :, :5], None, beta[:, :, :5], mode=mode)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\] = \[2, 7, 6\]"):
        ops.gated_delta_rule(q, k, v, g, beta[:, :, :H], mode=mode)


def test_grouped_value_heads_decode_forms_the_gates():
    """gated_delta_rule_decode with grouped value heads: a, b, A_log and dt_bias per value head, q and k per key head;
    its kernel against its PyTorch form."""
    B, T, H, G, K, V = 2, 3, 2, 2, 16, 8
    gen = torch.Generator().manual_seed(15)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, h = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H * G, V), rnd(B, H * G, K, V)
    a, b, A_log, dt_bias = 4 * rnd(B, T, H * G), 4 * rnd(B, T, H * G), rnd(H * G), rnd(H * G)
    with torch.no_grad():
        naive = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, beta_max=2.0, initial_state=h.clone(),
                                            output_final_state=True, mode="naive")
        got = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, beta_max=2.0, initial_state=h,
                                          output_final_state=True, inplace_final_state=True, mode="fused_recurrent")
    assert got[1] is h
    for name, x, y in zip(["o", "final state"], got, naive):
        assert_matches(x, y, 1e-5, name)
    with pytest.raises(ValueError, match=r"A_log must be \[H\] = \[4\]"):
        ops.gated_delta_rule_decode(q, k, v, a, b, A_log[:H], dt_bias)


@pytest.mark.parametrize("gated,nh,T", [(True, 2, 5), (False, 3, 1), (True, 1, 3)])
def test_gated_delta_product_decode_forms_the_gates(gated, nh, T):
    """gated_delta_product_decode's kernel forms the L2 norms of q and of each sub-step's key, the β's = beta_max σ(b)
    and g = -e^{A_log} softplus(a + dt_bias) (a from -60 to 60) as the Gated DeltaProduct layer does in PyTorch, and
    runs the n_h sub-steps; its naive mode forms them in PyTorch; n_h = 1 is Gated DeltaNet's step; the state updated
    in place is the state returned."""
    B, H, K, V = 2, 3, 20, 24
    gen = torch.Generator().manual_seed(13 + nh)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, b = rnd(B, T, H, K), 3 * rnd(B, T * nh, H, K), rnd(B, T * nh, H, V), 4 * rnd(B, T * nh, H)
    a = torch.linspace(-60, 60, B * T * H)[torch.randperm(B * T * H, generator=gen)].view(B, T, H).to(DEVICE)
    a, A_log, dt_bias = (a, rnd(H), rnd(H)) if gated else (None, None, None)
    g = -A_log.exp() * F.softplus(a + dt_bias) if gated else None
    kw = dict(beta_max=2.0, output_final_state=True)
    with torch.no_grad():
        h = rnd(B, H, K, V)
        start = h.clone()
        got = ops.gated_delta_product_decode(q, k, v, a, b, nh, A_log, dt_bias, mode="fused_recurrent",
                                             initial_state=h, inplace_final_state=True, **kw)
        naive = ops.gated_delta_product_decode(q, k, v, a, b, nh, A_log, dt_bias, mode="naive", initial_state=start,
                                               **kw)
        ref = ops.gated_delta_product(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v, g,
                                      2.0 * b.sigmoid(), nh, mode="naive", initial_state=start, output_final_state=True)
    assert got[1] is h, "inplace_final_state: the state returned is initial_state itself"
    for name, x, y, z in zip(["o", "final state"], got, naive, ref):
        assert_matches(x, z, 1e-5, f"kernel: {name}")
        assert_matches(y, z, 1e-6, f"naive: {name}")
    rows = r"\[B, T, H\]" if nh == 1 else rf"\[B, T \* {nh}, H\]"
    with pytest.raises(ValueError, match="b must have shape " + rows):
        ops.gated_delta_product_decode(q, k, v, a, b[:, 1:], nh, A_log, dt_bias)
    with pytest.raises(ValueError, match="num_householder must be a positive int, got 0"):
        ops.gated_delta_product_decode(q, k, v, a, b, 0, A_log, dt_bias)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_kda_decode_forms_the_gates(lower_bound, beta_max):
    """kda_decode's kernel forms β = beta_max σ(b) and the per-channel g = -e^{A_log} softplus(a + dt_bias), or
    fla's bounded lower_bound σ(e^{A_log} (a + dt_bias)), with dt_bias per channel ([H * K], fla's shape) and a from
    -60 to 60, as the KDA layer does in PyTorch; its naive mode forms them in PyTorch; the state updated in place
    is the state returned."""
    B, T, H, K, V = 2, 5, 3, 20, 24
    gen = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    b = 4 * rnd(B, T, H)
    a = torch.linspace(-60, 60, B * T * H * K)[torch.randperm(B * T * H * K, generator=gen)].view(B, T, H, K)
    a = a.to(DEVICE)
    A_log, dt_bias = rnd(H), rnd(H * K)
    f = a + dt_bias.view(H, K)
    g = (-A_log.exp()[:, None] * F.softplus(f) if lower_bound is None
         else lower_bound * torch.sigmoid(A_log.exp()[:, None] * f))
    kw = dict(lower_bound=lower_bound, beta_max=beta_max, output_final_state=True)
    with torch.no_grad():
        h = rnd(B, H, K, V)
        start = h.clone()
        got = ops.kda_decode(q, k, v, a, b, A_log, dt_bias, mode="fused_recurrent", initial_state=h,
                             inplace_final_state=True, **kw)
        naive = ops.kda_decode(q, k, v, a, b, A_log, dt_bias, mode="naive", initial_state=start, **kw)
        ref = ops.kda(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v, g,
                      beta_max * b.sigmoid(), mode="naive", initial_state=start, output_final_state=True)
    assert got[1] is h, "inplace_final_state: the state returned is initial_state itself"
    for name, x, y, z in zip(["o", "final state"], got, naive, ref):
        assert_matches(x, z, 1e-5, f"kernel: {name}")
        assert_matches(y, z, 1e-6, f"naive: {name}")


@pytest.mark.parametrize("beta_max", [1.0, 2.0])
def test_hdla_decode_forms_the_gates(beta_max):
    """hdla_decode's kernel forms k's L2 norm (q's not), β = beta_max σ(b) and log λ = logsigmoid(a) / τ (a from -60
    to 60, τ = 16) as the HDLA layer does in PyTorch; its naive mode forms them in PyTorch; the state updated in
    place is the state returned."""
    B, T, H, K, V = 2, 5, 3, 20, 24
    gen = torch.Generator().manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, b = rnd(B, T, H, K), 3 * rnd(B, T, H, K), rnd(B, T, H, V), 4 * rnd(B, T, H)
    a = torch.linspace(-60, 60, B * T * H * K)[torch.randperm(B * T * H * K, generator=gen)].view(B, T, H, K)
    a = a.to(DEVICE)
    kw = dict(gate_logit_normalizer=16.0, beta_max=beta_max, output_final_state=True)
    with torch.no_grad():
        h = rnd(B, H, K, V)
        start = h.clone()
        got = ops.hdla_decode(q, k, v, a, b, mode="fused_recurrent", initial_state=h, inplace_final_state=True, **kw)
        naive = ops.hdla_decode(q, k, v, a, b, mode="naive", initial_state=start, **kw)
        ref = ops.hdla(q, F.normalize(k, dim=-1, eps=1e-6), v, F.logsigmoid(a) / 16.0, beta_max * b.sigmoid(),
                       mode="naive", initial_state=start, output_final_state=True)
    assert got[1] is h, "inplace_final_state: the state returned is initial_state itself"
    for name, x, y, z in zip(["o", "final state"], got, naive, ref):
        assert_matches(x, z, 1e-5, f"kernel: {name}")
        assert_matches(y, z, 1e-6, f"naive: {name}")
    with pytest.raises(ValueError, match="gate_logit_normalizer must be a number > 0, got 0"):
        ops.hdla_decode(q, k, v, a, b, gate_logit_normalizer=0)
    with pytest.raises(ValueError, match=r"a must have shape \[B, T, H, K\]"):
        ops.hdla_decode(q, k, v, b, b)


@pytest.mark.parametrize("gated,per_token", [(True, False), (False, True)])
def test_hh_delta_rule_decode_forms_the_gates_and_the_mask(gated, per_token):
    """hh_delta_rule_decode's kernel forms the L2 norms, β = beta_max σ(b), g = -e^{A_log} softplus(a + dt_bias) and
    the mask head_in_head_mask(softplus(m_org)) (m_org from -60 to 8: rows of softplus entries whose squares
    underflow fp32 normalise scale-free), static or per token, as the Head-in-Head layer does in PyTorch; its naive mode forms them in
    PyTorch."""
    B, T, H, K, V, r = 2, 5, 3, 16, 12, 4
    gen = torch.Generator().manual_seed(12)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, b = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V), 4 * rnd(B, T, H)
    a, A_log, dt_bias = (4 * rnd(B, T, H), rnd(H), rnd(H)) if gated else (None, None, None)
    shape = (B, T, H, r, r) if per_token else (H, r, r)
    m_org = (68 * torch.rand(*shape, generator=gen) - 60).to(DEVICE)
    g = -A_log.exp() * F.softplus(a + dt_bias) if gated else None
    kw = dict(beta_max=2.0, output_final_state=True)
    with torch.no_grad():
        h = rnd(B, H, K, V)
        start = h.clone()
        got = ops.hh_delta_rule_decode(q, k, v, a, b, m_org, A_log, dt_bias, mode="fused_recurrent", initial_state=h,
                                       inplace_final_state=True, **kw)
        naive = ops.hh_delta_rule_decode(q, k, v, a, b, m_org, A_log, dt_bias, mode="naive", initial_state=start,
                                         **kw)
        ref = ops.hh_delta_rule(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v,
                                2.0 * b.sigmoid(), ops.head_in_head_mask(F.softplus(m_org)), g, mode="naive",
                                initial_state=start, output_final_state=True)
    assert got[1] is h, "inplace_final_state: the state returned is initial_state itself"
    for name, x, y, z in zip(["o", "final state"], got, naive, ref):
        assert_matches(x, z, 1e-5, f"kernel: {name}")
        assert_matches(y, z, 1e-6, f"naive: {name}")
    with pytest.raises(ValueError, match=r"m_org must be \[H, r, r\] or \[B, T, H, r, r\] with r dividing K = 16"):
        ops.hh_delta_rule_decode(q, k, v, a, b, m_org[..., :3, :3], A_log, dt_bias)
    with pytest.raises(ValueError, match=r"A_log must be \[H\] = \[3\] with a decay projection a, got None"):
        ops.hh_delta_rule_decode(q, k, v, b, b, m_org)


def test_kda_decode_errors():
    q, b = torch.randn(1, 1, 2, 16, device=DEVICE), torch.randn(1, 1, 2, device=DEVICE)
    A, bias = torch.zeros(2, device=DEVICE), torch.zeros(32, device=DEVICE)
    with pytest.raises(ValueError, match=r"a must have shape \[B, T, H, K\]"):
        ops.kda_decode(q, q, q, b, b, A, bias)
    with pytest.raises(ValueError, match=r"dt_bias must be \[H \* K\] = \[32\], got \[2\]"):
        ops.kda_decode(q, q, q, q, b, A, A)
    with pytest.raises(ValueError, match=r"A_log must be \[H\] = \[2\], got None"):
        ops.kda_decode(q, q, q, q, b, None, bias)
    with pytest.raises(ValueError, match="lower_bound must be None or a negative number, got 5"):
        ops.kda_decode(q, q, q, q, b, A, bias, lower_bound=5)
    with pytest.raises(ValueError, match="mode must be 'auto', 'fused_recurrent' or 'naive'"):
        ops.kda_decode(q, q, q, q, b, A, bias, mode="chunk")


def _rounding(x: torch.Tensor, dtype: torch.dtype, ulps: float) -> torch.Tensor:
    """``ulps`` units in the last place of ``dtype`` at each entry of x (fp32): half an ulp is one
    round-to-nearest; at the smallest exponents, the spacing of the subnormals."""
    if dtype == torch.float32:
        return torch.zeros_like(x)
    bits, tiny = {torch.bfloat16: (8, 2.0 ** -133), torch.float16: (11, 2.0 ** -24)}[dtype]
    _, e = torch.frexp(x)  # |x| in [2^(e-1), 2^e): the spacing there is 2^(e - bits)
    return ulps * torch.ldexp(torch.ones_like(x), e - bits).clamp_min(tiny)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("mode", ["fused_recurrent", "naive"])
def test_gated_delta_rule_decode_state_in_place(mode, state_dtype):
    """inplace_final_state (vLLM's argument): the state is updated in initial_state itself, which is
    returned, and a 16-bit cache is read in its dtype, stepped in fp32 and rounded once when stored:
    every entry within one rounding of the fp32 steps from the same start."""
    B, T, H, K, V = 2, 3, 3, 20, 24
    gen = torch.Generator().manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    q, k, v, a, b, A_log, dt_bias = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V), rnd(B, T, H), rnd(B, T, H), \
        rnd(H), rnd(H)
    h = rnd(B, H, K, V).to(state_dtype)
    start = h.clone()
    with torch.no_grad():
        o_ref, s_ref = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, initial_state=start.float(),
                                                   output_final_state=True, mode="naive")
        o, s = ops.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, initial_state=h, output_final_state=True,
                                           inplace_final_state=True, mode=mode)
    assert s is h and s.dtype == state_dtype
    assert_matches(o, o_ref, 1e-5, "o")
    # Triton's interpreter converts fp32 to bf16 by truncation (a whole ulp; checked when this test
    # was written); the GPU and PyTorch round to nearest (half an ulp)
    truncates = mode == "fused_recurrent" and state_dtype == torch.bfloat16 and not torch.cuda.is_available()
    err = (s.float() - s_ref).abs()
    bound = _rounding(s_ref, state_dtype, 1.0 if truncates else 0.5) + 1e-6 * s_ref.abs().max()  # + fp32's order
    assert (err <= bound).all(), f"state: {(err - bound).max().item():.3e} past one rounding"
    assert not torch.equal(s.float(), start.float()), "the state was not updated"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["fused_recurrent", "triton", "chunk", "naive"])
def test_dplr_state_in_place(mode, state_dtype):
    """dplr(inplace_final_state=True) on every path, rank-2 decay with a per-channel gate and rank-2
    writes (HDLA's and Gated DeltaProduct's decode): the fused_recurrent kernel writes the state into
    initial_state, the others copy their result in; within one rounding of the fp32 result."""
    q, k, v, a, b, g, h0 = random_inputs(2, 5, 2, 16, 8, 2, 2, "channel")
    h = h0.to(state_dtype)
    start = h.clone()
    with torch.no_grad():
        o_ref, s_ref = ops.dplr(q, k, v, a, b, g, initial_state=start.float(), output_final_state=True, mode="naive")
        o, s = ops.dplr(q, k, v, a, b, g, initial_state=h, output_final_state=True, mode=mode,
                        inplace_final_state=True, chunk_size=16)
    assert s is h and s.dtype == state_dtype
    assert_matches(o, o_ref, 1e-5, "o")
    err = (s.float() - s_ref).abs()
    bound = _rounding(s_ref, state_dtype, 0.5) + 1e-6 * s_ref.abs().max()
    assert (err <= bound).all(), f"state: {(err - bound).max().item():.3e} past one rounding"


def test_decode_state_in_place_errors():
    q, b = torch.randn(1, 1, 2, 16, device=DEVICE), torch.randn(1, 1, 2, device=DEVICE)
    call = lambda h, **kw: ops.gated_delta_rule_decode(q, q, q, None, b, initial_state=h,  # noqa: E731
                                                        inplace_final_state=True, **kw)
    with pytest.raises(ValueError, match="needs an initial_state"):
        call(None)
    with pytest.raises(ValueError, match=r"contiguous fp32, bf16 or fp16 initial_state, got torch.float32 \(not"):
        call(torch.zeros(1, 2, 16, 32, device=DEVICE)[..., ::2])
    with pytest.raises(ValueError, match="got torch.float64"):
        call(torch.zeros(1, 2, 16, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(RuntimeError, match="no backward"):
        call(torch.zeros(1, 2, 16, 16, device=DEVICE, requires_grad=True))
    with torch.no_grad(), pytest.raises(ValueError, match=r"got torch.float32 \(not contiguous\)"):  # the kernels'
        call(torch.zeros(1, 2, 16, 32, device=DEVICE)[..., ::2], mode="fused_recurrent")
    with torch.no_grad(), pytest.raises(ValueError, match="needs an initial_state"):
        ops.gated_delta_rule(q, q, q, None, b, mode="fused_recurrent", inplace_final_state=True)
    with torch.no_grad(), pytest.raises(ValueError, match="got torch.float64"):
        ops.dplr(q, q, q, initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64, device=DEVICE),
                 mode="fused_recurrent", inplace_final_state=True)


def test_gated_delta_rule_decode_errors():
    q, b = torch.randn(1, 1, 2, 16, device=DEVICE), torch.randn(1, 1, 2, device=DEVICE)
    A = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match=r"b must have shape \[B, T, H\]"):
        ops.gated_delta_rule_decode(q, q, q, None, b[..., None])
    with pytest.raises(ValueError, match=r"a must have shape \[B, T, H\]"):
        ops.gated_delta_rule_decode(q, q, q, q, b, A, A)
    with pytest.raises(ValueError, match=r"dt_bias must be \[H\] = \[2\]"):
        ops.gated_delta_rule_decode(q, q, q, b, b, A)
    with pytest.raises(ValueError, match="mode must be"):
        ops.gated_delta_rule_decode(q, q, q, None, b, mode="chunk")


@pytest.mark.parametrize("T", [1, 37])
def test_chunk_log_cumsum(T):
    """The per-channel decays' log-cumsums: fp64, restarting every chunk, gates past T counted as 0
    (every entry of a chunk past T equals the last real one)."""
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum

    B, H, K, C = 2, 3, 20, 16
    g = F.logsigmoid(torch.randn(B, T, H, K, device=DEVICE))
    gc = chunk_log_cumsum(g, C)
    NC = -(-T // C)
    assert gc.shape == (B, H, NC, C, K) and gc.dtype == torch.float64
    padded = torch.zeros(B, NC * C, H, K, dtype=torch.float64, device=DEVICE)
    padded[:, :T] = g.double()
    ref = padded.view(B, NC, C, H, K).cumsum(2).permute(0, 3, 1, 2, 4)
    torch.testing.assert_close(gc, ref, rtol=1e-12, atol=1e-12)


def _channel_product_reference(x, y, g, TC, strict):
    """P[p, q] = Σ_k x_pk y_qk exp(G^x_pk - G^y_qk) per chunk, in fp64, in the kernels' chunk layout
    ([B, H, NC, TC*Rxp, TC*Ryp], ranks padded to powers of two, rows past T zero)."""
    B, T, H, RX, K = x.shape
    RY = y.shape[-2]
    NC = -(-T // TC)
    pad = lambda z, R: F.pad(z.double(), (0, 0, 0, R - z.shape[-2], 0, 0, 0, NC * TC - T))  # noqa: E731
    RXP, RYP = (1 << (r - 1).bit_length() for r in (RX, RY))
    X = pad(x, RXP).view(B, NC, TC, H, RXP, K).permute(0, 3, 1, 2, 4, 5)  # [B, H, NC, TC, R, K]
    Y = pad(y, RYP).view(B, NC, TC, H, RYP, K).permute(0, 3, 1, 2, 4, 5)
    gp = F.pad(g.double(), (0, 0, 0, 0, 0, NC * TC - T)).view(B, NC, TC, H, K).permute(0, 3, 1, 2, 4)
    G = gp.cumsum(3)  # [B, H, NC, TC, K]
    Gx = G - gp if strict else G
    tok = torch.arange(TC, device=x.device)
    causal = tok[:, None] > tok[None, :] if strict else tok[:, None] >= tok[None, :]
    diff = Gx[:, :, :, :, None, :] - G[:, :, :, None, :, :]  # [B, H, NC, TC, TC, K]
    decay = torch.where(causal[:, :, None], diff, -torch.inf).exp()
    P = torch.einsum("bhnprk,bhnqsk,bhnpqk->bhnprqs", X, Y, decay)
    return P.reshape(B, H, NC, TC * RXP, TC * RYP)


@pytest.mark.parametrize("R,scaled,T,strong,one_level", [(1, False, 45, False, None), (1, False, 45, False, 60),
                                                          (1, True, 37, True, None), (2, True, 45, True, None),
                                                          (2, True, 45, True, 60)])
def test_channel_product_pair_matches_two_products(R, scaled, T, strong, one_level, monkeypatch):
    """``channel.channel_product``'s x2: x's product with y (inclusive, with scale) and x2's (strict, through G_t,
    no scale) from one kernel, with y's factors and their scaled twins (out_scaled / out2_scaled) or without,
    against the two products taken apart (x2's with ``x_at_t``); a partial last chunk, log-gates of -30 per step.
    Bad combinations are refused. ``one_level``: the diagonal blocks in one product where the decays allow (forced
    on fp64 log-cumsums; both sides of the comparison take it)."""
    from rankdecay.ops.triton.channel import _CHANNEL, channel_product
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum

    monkeypatch.setitem(_CHANNEL, "one_level", one_level)

    B, H, K, TC = 1, 2, 20, 32
    gen = torch.Generator().manual_seed(R + T)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    x, x2, y = rnd(B, T, H, R, K), rnd(B, T, H, R, K), rnd(B, T, H, R, K)
    g = -30 * torch.rand(B, T, H, K, generator=gen).to(DEVICE) if strong else F.logsigmoid(rnd(B, T, H, K) + 2)
    sy = rnd(B, T, H, R) if scaled else None
    gc = chunk_log_cumsum(g, TC)
    RP = 1 << (R - 1).bit_length()
    new = lambda: torch.full((B, H, gc.shape[2], TC * RP, TC * RP), float("nan"), device=DEVICE)  # noqa: E731
    got = [new() for _ in range(4 if scaled else 2)]
    want = [new() for _ in range(4 if scaled else 2)]
    kw = dict(T=T, TC=TC, precision="ieee", lowp=False, y_scale=sy)
    channel_product(x, y, gc, got[0], strict=False, scale=0.5, out_scaled=got[2] if scaled else None, x2=x2,
                    out2=got[1], out2_scaled=got[3] if scaled else None, **kw)
    channel_product(x, y, gc, want[0], strict=False, scale=0.5, out_scaled=want[2] if scaled else None, **kw)
    channel_product(x2, y, gc, want[1], strict=True, x_at_t=True, out_scaled=want[3] if scaled else None, **kw)
    # the entries the kernels write: each row block's columns up to its diagonal block's end
    for i, (a, b) in enumerate(zip(got, want)):
        written = ~torch.isnan(b)
        assert torch.equal(written, ~torch.isnan(a)), f"output {i}: written elsewhere"
        torch.testing.assert_close(a[written], b[written], rtol=1e-6, atol=1e-6, msg=f"output {i}")
    for bad in (dict(strict=True, x2=x2, out2=got[1]), dict(strict=False, x2=x2, out2=None),
                dict(strict=False, x2=x2[..., :-1], out2=got[1])):
        with pytest.raises(ValueError, match="x2 takes"):
            channel_product(x, y, gc, got[0], T=T, TC=TC, precision="ieee", lowp=False, **bad)


@pytest.mark.parametrize("T,strong,rows,one_level", [(45, False, 32, None), (45, False, 32, 60), (37, True, 32, None),
                                                     (37, True, 32, 60), (70, True, 64, None)])
def test_channel_product_bwd_pair_matches_autograd(T, strong, rows, one_level, monkeypatch):
    """``channel.channel_product_bwd``'s x2: the gradients of the four products KDA's forward takes in one kernel,
    P(x, y) and P(x, sy ⊙ y) inclusive, P(x2, y) and P(x2, sy ⊙ y) strict with x2's rows through G_t, from one pass,
    against fp64 autograd (x2 through G_t is e^g ⊙ x2 through G_{t-1}: the reference's strict product on it). dx,
    dx2, dy (through the unscaled products) and dy_scaled (with respect to sy ⊙ y) on the real rows; chunks in two
    row blocks and more, a partial last chunk, log-gates of -30 per step. Bad combinations are refused.
    ``one_level``: the diagonal blocks in one product where the decays allow (forced on fp64 log-cumsums)."""
    from rankdecay.ops.triton.channel import _CHANNEL, channel_product_bwd
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum, fused_chunk_size

    monkeypatch.setitem(_CHANNEL, "one_level", one_level)

    B, H, K = 1, 2, 20
    TC = fused_chunk_size(1, 1, True, {"channel_rows": rows})
    gen = torch.Generator().manual_seed(T + rows)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    x, x2, y = rnd(B, T, H, 1, K), rnd(B, T, H, 1, K), rnd(B, T, H, 1, K)
    g = -30 * torch.rand(B, T, H, K, generator=gen).to(DEVICE) if strong else F.logsigmoid(rnd(B, T, H, K) + 2)
    sy = rnd(B, T, H, 1)
    gc = chunk_log_cumsum(g, TC)
    NC = gc.shape[2]
    xr, x2r, yr = (z.double().requires_grad_() for z in (x, x2, y))
    ysr = (y.double() * sy.double()[..., None]).requires_grad_()  # sy ⊙ y as its own leaf
    b = x2r * g.double().exp()[..., None, :]
    dps = [rnd(B, H, NC, TC, TC) for _ in range(4)]  # P(x, y), P(x, sy y), P(x2, y), P(x2, sy y)
    refs = [_channel_product_reference(xr, yr, g, TC, False), _channel_product_reference(xr, ysr, g, TC, False),
            _channel_product_reference(b, yr, g, TC, True), _channel_product_reference(b, ysr, g, TC, True)]
    loss = sum((r * d.double()).sum() for r, d in zip(refs, dps))
    ref_dx, ref_dx2, ref_dy, ref_dys = torch.autograd.grad(loss, (xr, x2r, yr, ysr))
    new = lambda: torch.full((B, H, NC, TC, K), float("nan"), device=DEVICE)  # noqa: E731
    dx, dx2, dy, dys = new(), new(), new(), new()
    channel_product_bwd(x, y, gc, dps[0], dx, dy, T=T, TC=TC, strict=False, precision="ieee", acc_x=False,
                        acc_y=False, y_scale=sy, dp_scaled=dps[1], dy_scaled=dys, x2=x2, dp2=dps[2],
                        dp2_scaled=dps[3], dx2=dx2)

    def chunked(z):  # [B, T, H, 1, K] -> the chunk layout, rows past T zero
        return F.pad(z, (0, 0, 0, 0, 0, 0, 0, NC * TC - T)).view(B, NC, TC, H, K).permute(0, 3, 1, 2, 4)

    real = chunked(torch.ones_like(ref_dx)).bool()
    for name, got, want in (("dx", dx, ref_dx), ("dx2", dx2, ref_dx2), ("dy", dy, ref_dy), ("dy_scaled", dys, ref_dys)):
        assert torch.isfinite(got[real]).all(), name
        torch.testing.assert_close(got.double()[real], chunked(want)[real], rtol=1e-5, atol=1e-5, msg=name)
    kw = dict(T=T, TC=TC, precision="ieee", acc_x=False, acc_y=False, y_scale=sy, dp_scaled=dps[1], dy_scaled=dys)
    for bad in (dict(strict=True, x2=x2, dp2=dps[2], dp2_scaled=dps[3], dx2=dx2),
                dict(strict=False, x2=x2, dp2=dps[2], dp2_scaled=None, dx2=dx2),
                dict(strict=False, x2=x2[..., :-1], dp2=dps[2], dp2_scaled=dps[3], dx2=dx2)):
        with pytest.raises(ValueError, match="x2 takes"):
            channel_product_bwd(x, y, gc, dps[0], dx, dy, **kw, **bad)


@pytest.mark.parametrize("RX,RY,strict,scaled", [(1, 1, False, False), (1, 2, False, True), (2, 2, True, True),
                                                 (3, 1, True, False), (4, 4, True, False)])
@pytest.mark.parametrize("T,strong", [(45, False), (37, True)])
@pytest.mark.parametrize("rows,one_level", [(64, None), (32, None), (32, 60)], ids=["64", "32", "32-one-level"])
def test_channel_products_forward_and_backward(RX, RY, strict, scaled, T, strong, rows, one_level, monkeypatch):
    """``channel.channel_product`` (sub-blocks through a reference token, levels on the diagonal) and its
    backward against the fp64 reference and its autograd; awkward T, padded ranks, log-gates of -30 per
    step; the chunk sizes the fused path takes for these ranks with a per-channel gate at either tile height
    (``fused_chunk_size``'s ``channel_rows``: 64 or 32 rows over the largest padded rank, at least 16 tokens).
    ``one_level``: the diagonal blocks in one product where the decays allow, forward and backward
    (``_channel_diag_one`` and its backward; forced here on fp64 log-cumsums), the blocks with strong decays by
    levels."""
    from rankdecay.ops.triton.channel import _CHANNEL, channel_product, channel_product_bwd
    from rankdecay.ops.triton.chunk_fwd import chunk_log_cumsum, fused_chunk_size

    monkeypatch.setitem(_CHANNEL, "one_level", one_level)

    B, H, K = 1, 2, 20
    TC = fused_chunk_size(RX, RY, True, {"channel_rows": rows})
    gen = torch.Generator().manual_seed(RX + 10 * RY + T)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    x, y = rnd(B, T, H, RX, K), rnd(B, T, H, RY, K)
    g = -30 * torch.rand(B, T, H, K, generator=gen).to(DEVICE) if strong else F.logsigmoid(rnd(B, T, H, K) + 2)
    sy = rnd(B, T, H, RY) if scaled else None
    gc = chunk_log_cumsum(g, TC)
    NC = gc.shape[2]
    RXP, RYP = (1 << (r - 1).bit_length() for r in (RX, RY))
    out = torch.full((B, H, NC, TC * RXP, TC * RYP), float("nan"), device=DEVICE)
    channel_product(x, y, gc, out, T=T, TC=TC, strict=strict, precision="ieee", lowp=False, scale=0.5, y_scale=sy)
    xr = x.double().requires_grad_()
    yr = (y.double() if sy is None else y.double() * sy.double()[..., None]).requires_grad_()  # sy ⊙ y
    ref = _channel_product_reference(xr, yr, g, TC, strict)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), 0.5 * ref.detach(), rtol=1e-5, atol=1e-5)

    dp = rnd(*out.shape)
    ref_dx, ref_dy = torch.autograd.grad((ref * dp.double()).sum(), (xr, yr))  # dy: with respect to sy ⊙ y
    dx = torch.full((B, H, NC, TC * RXP, K), 1.0, device=DEVICE)  # added to (ACC_X)
    dy = torch.full((B, H, NC, TC * RYP, K), float("nan"), device=DEVICE)  # overwritten
    channel_product_bwd(x, y, gc, dp, dx, dy, T=T, TC=TC, strict=strict, precision="ieee", acc_x=True, acc_y=False,
                        y_scale=sy)

    def chunked(z, R, RP):  # [B, T, H, R, K] -> the chunk layout, rows past T and padded ranks zero
        z = F.pad(z, (0, 0, 0, RP - R, 0, 0, 0, NC * TC - T))
        return z.view(B, NC, TC, H, RP, K).permute(0, 3, 1, 2, 4, 5).reshape(B, H, NC, TC * RP, K)

    # compared on real rows only: the rows past T and the padded ranks' are never read back
    vx, vy = (chunked(torch.ones_like(z), R, RP).bool() for z, R, RP in ((ref_dx, RX, RXP), (ref_dy, RY, RYP)))
    torch.testing.assert_close(dx.double()[vx], 1.0 + chunked(ref_dx, RX, RXP)[vx], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dy.double()[vy], chunked(ref_dy, RY, RYP)[vy], rtol=1e-5, atol=1e-5)


def _check_fused_form(monkeypatch, knob: str, kernel: str, fn, pt, labels, what: str) -> None:
    """``fn()`` (-> outputs and gradients) with ``chunk_bwd._CONFIG[knob]`` 0 and 1: with 1 the kernel ``kernel`` of
    ``chunk_bwd`` must not launch (with 0 it must), and every result must match the unfused form's (bit-equal under
    the interpreter, where both forms take the same operations; on a GPU their products' layouts differ, so to 1e-6)
    and ``pt()``'s, the PyTorch path's, at 1e-5."""
    from rankdecay.ops.triton import chunk_bwd

    calls, launch = [], getattr(chunk_bwd, kernel)

    class Spy:  # kernel[grid](...) counted
        def __getitem__(self, grid):
            calls.append(grid)
            return launch[grid]

    monkeypatch.setattr(chunk_bwd, kernel, Spy())
    results = {}
    for fused in (0, 1):
        monkeypatch.setitem(chunk_bwd._CONFIG, knob, fused)
        before = len(calls)
        results[fused] = fn()
        assert (len(calls) > before) != bool(fused), f"{what}: {kernel} ran {len(calls) - before} times"
    ref = pt()
    for name, x, y, z in zip(labels, results[1], results[0], ref):
        if DEVICE == "cpu":
            assert torch.equal(x, y), f"{what}: {name} differs from the unfused form's by {(x - y).abs().max()}"
        else:
            assert_matches(x, y, 1e-6, f"{what}: {name} against the unfused form")
        assert_matches(x, z, 1e-5, f"{what}: {name} against the PyTorch path")


@pytest.mark.parametrize("case", ["dplr-scalar-ut", "dplr-scalar-w", "dplr-channel-r2", "gdn", "hh", "hdla", "kda",
                                  "gla"])
def test_values_in_the_inputs_kernel(case, monkeypatch):
    """``chunk_bwd._CONFIG["values_in_inputs"]``: the values kernel's work (dV, d sv, the tied keys' d sa and, without
    u_from_t, dX = Tᵀ dU) done by the inputs' kernel (``_grad_inputs_kernel``'s VALUES), each value block by one of
    its chunk's key-block programs (two key blocks of 16 at K = 32 and two value blocks of 64 at V = 72, the second
    partial: each program owns one). Every
    gradient matches the values kernel's (bit-equal under the interpreter, where both kernels take the same
    operations; on a GPU their products' layouts differ, so to fp32 rounding) and the PyTorch path at fp32 accuracy;
    the values kernel does not run."""
    from rankdecay.ops.triton import chunk_bwd

    monkeypatch.setitem(chunk_bwd._CONFIG, "inputs_bk", 16)
    if case.startswith("dplr"):
        Rab, gate = (2, "channel") if case == "dplr-channel-r2" else (1, "scalar")
        monkeypatch.setitem(chunk_bwd._KNOBS, "u_from_t", not case.endswith("-w"))
        inputs = random_inputs(2, 37, 2, 32, 72, Rab, 1, gate, seed=3)
        fn, pt = (lambda: run("triton", inputs, chunk_size=16)), (lambda: run("chunk", inputs, chunk_size=16))
        labels = names(inputs)
    else:
        mech = dict(gla="kda")  # GLA: KDA's inputs with β and the rows dropped
        xs, op = _mechanism_case(mech.get(case, case), 2, 37, 2, 32, 72, seed=3)
        if case == "gla":
            xs = xs[:4] + xs[5:]
            op = lambda q, k, v, g, h0, mode: ops.gla(q, k, v, g, initial_state=h0,  # noqa: E731
                                                     output_final_state=True, mode=mode)
        if case in ("gla", "hdla", "kda"):  # strong decays inside a chunk
            xs[3][:, 20:22] = -30.0
        fn = lambda: _grads_of(lambda *x: op(*x, mode="triton"), xs)  # noqa: E731
        pt = lambda: _grads_of(lambda *x: op(*x, mode="chunk"), xs)  # noqa: E731
        labels = ["o", "final_state"] + [f"d{i}" for i in range(len(xs))]
    _check_fused_form(monkeypatch, "values_in_inputs", "_grad_values_kernel", fn, pt, labels, case)


def _compile_inputs(T: int, seed: int, B: int = 1, H: int = 2, K: int = 16, V: int = 16, dtype=torch.float32):
    """(q, k, v, g, beta, lam, a, h0) for ``_every_mechanism``: a [B, T, H, 5, K], a rank past the fused kernels'."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, v = rnd(B, T, H, K), rnd(B, T, H, V)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    g, beta = F.logsigmoid(rnd(B, T, H) + 2), torch.rand(B, T, H, generator=gen)
    lam = F.logsigmoid(rnd(B, T, H, K) + 2)
    a = 0.1 * F.normalize(rnd(B, T, H, 5, K), dim=-1)
    return [x.to(DEVICE, dtype) for x in (q, k, v, g, beta, lam, a)] + [rnd(B, H, K, V).to(DEVICE)]


def _every_mechanism(mask, every: bool = True):
    """A loss through every kind of entry point on the Triton kernels: Gated DeltaNet (with an initial and a final
    state), Head-in-Head, HDLA, KDA and GLA (the fused kernels) and a rank-5 DPLR (the unfused path's state passing,
    an autograd Function that saves its own outputs). ``every=False``: the first two and the last."""
    def loss(q, k, v, g, beta, lam, a, h0):
        o1, s1 = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, mode="triton")
        o = o1.sin() + ops.hh_delta_rule(q, k, v, beta, mask, g, mode="triton")[0] ** 2
        if every:
            o = o + ops.hdla(q, k, v, lam, 2 * beta, mode="triton")[0].cos() + ops.kda(q, k, v, lam, beta,
                                                                                      mode="triton")[0]
            o = o + ops.gla(q, k, v, lam, mode="triton")[0].sin()
        o = o + ops.dplr(q, k, v, a, F.normalize(a, dim=-1), lam, mode="triton")[0]
        return o.float().sum() + s1.sin().sum()
    return loss


def _compiled_matches(backend: str, lengths: tuple[int, ...], recompile_check: bool = False,
                      every: bool = True, dynamic: bool | None = None) -> None:
    """``_every_mechanism``'s loss and gradients through ``torch.compile(fullgraph=True, dynamic=dynamic)`` against
    eager ones at each of ``lengths`` in turn (from the second, or with ``dynamic=True`` from the first, Dynamo
    traces T as a symbol; with ``dynamic=True`` the later lengths may not compile again), then its value without
    autograd (each entry point's forward one operator)."""
    mask = ops.head_in_head_mask(torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    loss = _every_mechanism(mask, every)
    compiled = torch.compile(loss, fullgraph=True, backend=backend, dynamic=dynamic)

    def gradients(fn, T, seed):
        inputs = [x.requires_grad_() for x in _compile_inputs(T, seed=seed)]
        value = fn(*inputs)
        value.backward()
        return [value.detach()] + [x.grad for x in inputs]

    torch._dynamo.reset()
    try:
        for i, T in enumerate(lengths):
            with torch._dynamo.config.patch(error_on_recompile=bool(dynamic and i)):
                want, got = gradients(loss, T, 0), gradients(compiled, T, 0)
            for name, x, ref in zip(["loss", "dq", "dk", "dv", "dg", "dbeta", "dlam", "da", "dh0"], got, want):
                assert_matches(x, ref, 1e-6, f"{backend} T={T} {name}")
        if recompile_check:  # the same shapes on new values run what was compiled
            with torch._dynamo.config.patch(error_on_recompile=True):
                gradients(compiled, lengths[-1], 1)
        if backend == "aot_eager" or DEVICE == "cuda":  # (on the CPU, inductor's second compile is left out)
            with torch.no_grad():
                inputs = _compile_inputs(lengths[-1], seed=2)
                assert_matches(compiled(*inputs), loss(*inputs), 1e-6, f"{backend} without autograd")
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cpu" and not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
def test_kernels_under_torch_compile_fullgraph():
    """``torch.compile(fullgraph=True)`` (inductor) takes every mechanism on the Triton kernels whole, each entry
    point an opaque operator (``triton.opaque``): the same loss and gradients as eagerly, and (on a GPU; on the CPU
    the test below checks it) without autograd the same loss; the same shapes again run what was compiled. Traced into the graph, inductor launched the kernels
    itself and they did not compile (session 63)."""
    _compiled_matches("inductor", (20,), recompile_check=True)


@pytest.mark.slow
def test_kernels_under_torch_compile_symbolic_lengths():
    """The same with ``dynamic=True`` at two lengths, one graph for both: the operators' fake runs take symbolic
    sizes without making them constants (their context's descriptors read the sizes, and so compiled a graph for
    each new length until session 73), and the default query scale ``K ** -0.5`` (K a symbol there too) is a
    constant of the graph (it raised). Lengths of two chunks or more: PyTorch compiles a size of 1 apart. AOT
    autograd without inductor, which the test above covers: needs no C++ compiler. Gated DeltaNet, Head-in-Head
    (with its update rows' kernel without autograd) and the rank-5 path: every kind of operator, in half the
    interpreter's time."""
    _compiled_matches("aot_eager", (70, 90), every=False, dynamic=True)


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_cu_seqlens_under_torch_compile_new_packings_in_one_graph(path):
    """cu_seqlens on the kernels through ``torch.compile(fullgraph=True)``: no graph break (the lengths are never
    read on the host while compiling: ``canonicalize`` checks them on the device and the row is as long as any
    packing of T tokens in N sequences needs, ``_inputs.aligned_row``), a second compile at the second packing (its
    N a symbol), none at the third; the loss and every gradient as eagerly. Gated DeltaNet on the fused kernels, and
    rank 5 on the unfused path (the PyTorch intra-chunk parts around one launch of the state kernel, which finds each
    sequence's chunks from the offsets on the device). Until session 74 the lengths' ``.tolist()`` broke the graph
    and the pieces after it compiled again for each new packing (the unfused path's until session 75)."""
    rows = torch.rand(1, 200, 2, 5, 1, generator=torch.Generator().manual_seed(9)).to(DEVICE) / 5

    def loss(q, k, v, g, beta, cu):
        if path == "fused":
            o, s = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, mode="triton")
        else:  # a rank-5 decay: beta's share of k in five rows, against k's channels rolled
            a = rows * k[..., None, :] * beta[..., None, None]
            b = torch.stack([k.roll(j, -1) for j in range(5)], 3)
            o, s = ops.dplr(q, k, v, a, b, g, cu_seqlens=cu, output_final_state=True, mode="triton", chunk_size=16)
        return (o * o).sum() + s.sin().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    T, H, K = 200, 2, 16
    torch._dynamo.reset()
    try:
        for i, lengths in enumerate([[70, 0, 5, 125], [100, 50, 30, 10, 10], [64, 64, 72]]):
            cu = torch.tensor([0] + lengths).cumsum(0).to(DEVICE)
            gen = torch.Generator().manual_seed(i)
            x = [torch.randn(1, T, H, K, generator=gen), F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
                 torch.randn(1, T, H, K, generator=gen), -5 * torch.rand(1, T, H, generator=gen),
                 2 * torch.rand(1, T, H, generator=gen)]
            results = []
            for fn in (compiled, loss):
                leaves = [t.to(DEVICE).requires_grad_() for t in x]
                with torch._dynamo.config.patch(error_on_recompile=i == 2):
                    value = fn(*leaves, cu)
                value.backward()
                results.append([value.detach()] + [t.grad for t in leaves])
            for name, got, want in zip(["loss", "dq", "dk", "dv", "dg", "dbeta"], *results, strict=True):
                assert_matches(got, want, 1e-6, f"packing {i}: {name}")
    finally:
        torch._dynamo.reset()


def _laid_out(x: torch.Tensor, layout: str):
    """(storage, view): a contiguous tensor laid out otherwise and a view of it that holds x's values, not contiguous:
    "split" (x among other maps' outputs along the last axis: q, k and v split from one projection), "head_first"
    (tokens and heads swapped underneath: fla's [B, H, T, ...] layout) or "transposed" (the last two axes swapped)."""
    if layout == "split":
        storage = torch.cat([x, torch.zeros_like(x[..., :3])], -1)
        return storage, lambda t: t[..., :x.shape[-1]]
    dims = (1, 2) if layout == "head_first" else (-1, -2)
    return x.transpose(*dims).contiguous(), lambda t: t.transpose(*dims)


_LAYOUTS = dict(q="split", k="head_first", v="split", g="head_first", beta="split", lam="head_first", a="head_first",
                b="split", h0="transposed", mask="transposed", k2="split", v2="head_first", beta2="head_first")

_ENTRY_POINTS = {  # each: (o, final state) of the op on the named inputs (a dict), on the path ``mode``
    "gated_delta_rule": lambda x, mode="triton": ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                                      initial_state=x["h0"], output_final_state=True,
                                                                      mode=mode),
    "delta_rule": lambda x, mode="triton": ops.delta_rule(x["q"], x["k"], x["v"], x["beta"], initial_state=x["h0"],
                                                          output_final_state=True, mode=mode),
    "retention": lambda x, mode="triton": ops.retention(x["q"], x["k"], x["v"], x["lg"], initial_state=x["h0"],
                                                        output_final_state=True, mode=mode),
    "gla": lambda x, mode="triton": ops.gla(x["q"], x["k"], x["v"], x["lam"], initial_state=x["h0"],
                                            output_final_state=True, mode=mode),
    "kda": lambda x, mode="triton": ops.kda(x["q"], x["k"], x["v"], x["lam"], x["beta"], initial_state=x["h0"],
                                            output_final_state=True, mode=mode),
    "hdla": lambda x, mode="triton": ops.hdla(x["q"], x["k"], x["v"], x["lam"], 2 * x["beta"], initial_state=x["h0"],
                                              output_final_state=True, mode=mode),
    "hh_delta_rule": lambda x, mode="triton": ops.hh_delta_rule(x["q"], x["k"], x["v"], x["beta"], x["mask"], x["g"],
                                                                initial_state=x["h0"], output_final_state=True,
                                                                mode=mode),
    "gated_delta_product": lambda x, mode="triton": ops.gated_delta_product(x["q"], x["k2"], x["v2"], x["g"],
                                                                            x["beta2"], 2, initial_state=x["h0"],
                                                                            output_final_state=True, mode=mode),
    "dplr-2": lambda x, mode="triton": ops.dplr(x["q"], x["k"], x["v"], x["a"][..., :2, :], x["b"][..., :2, :],
                                                x["lam"], initial_state=x["h0"], output_final_state=True, mode=mode),
    "dplr-5": lambda x, mode="triton": ops.dplr(x["q"], x["k"], x["v"], x["a"], x["b"], x["g"], initial_state=x["h0"],
                                                output_final_state=True, mode=mode, chunk_size=16),
}


@pytest.mark.parametrize("case", list(_ENTRY_POINTS))
def test_inputs_that_are_views_give_their_copies_results(case):
    """Inputs that are not contiguous (q, k, v split from one projection, fla's head-first layouts, a transposed
    initial state; retention's per-head decay expanded over [B, T, H] by the op itself) give the outputs, final
    states and gradients that their contiguous copies give (retention: ``simple_gla`` on the decay expanded into a
    tensor of its own), on the kernels with autograd. Until session 81 the forward copied what it read but the
    backward's kernels read the tensors saved as given, strides ignored: wrong dq and dk for Gated DeltaNet on split
    projections and for retention on a GPU, NaN under the interpreter."""
    B, T, H, K = 2, 20, 2, 16
    q, k, v, g, beta, lam, a, h0 = _compile_inputs(T, seed=3, B=B, H=H, K=K)
    gen = torch.Generator().manual_seed(4)
    values = dict(q=q, k=k, v=v, g=g, beta=beta, lam=lam, a=a, b=F.normalize(a.roll(1, -1), dim=-1), h0=h0,
                  lg=-torch.rand(H, generator=gen).to(DEVICE) / 4,
                  mask=ops.head_in_head_mask(torch.rand(H, 2, 2, generator=gen)).to(DEVICE),
                  k2=F.normalize(torch.randn(B, 2 * T, H, K, generator=gen), dim=-1).to(DEVICE),
                  v2=torch.randn(B, 2 * T, H, K, generator=gen).to(DEVICE),
                  beta2=torch.rand(B, 2 * T, H, generator=gen).to(DEVICE))
    op = _ENTRY_POINTS[case]
    w = torch.randn(B, T, H, K, generator=gen).to(DEVICE)

    def results(strided: bool):
        leaves, views, unview = {}, {}, {}  # unview: a leaf's gradient in x's layout
        for name, x in values.items():
            if strided and name in _LAYOUTS:
                storage, unview[name] = _laid_out(x, _LAYOUTS[name])
                leaves[name] = storage.requires_grad_()
                views[name] = unview[name](leaves[name])
                assert not views[name].is_contiguous(), name
            else:
                leaves[name] = views[name] = x.clone().requires_grad_()
                unview[name] = lambda t: t  # noqa: E731
        if case == "retention" and not strided:  # the decay as a tensor of its own, for simple_gla
            o, s = ops.simple_gla(views["q"], views["k"], views["v"], views["lg"].expand(B, T, H).contiguous(),
                                  initial_state=views["h0"], output_final_state=True, mode="triton")
        else:
            o, s = op(views)
        ((o * w).sum() + s.sin().sum()).backward()
        return [o.detach(), s.detach()] + [unview[n](x.grad) for n, x in leaves.items() if x.grad is not None]

    got, want = results(True), results(False)
    assert len(got) == len(want) > 3
    for i, (x, ref) in enumerate(zip(got, want, strict=True)):
        assert_matches(x, ref, 1e-6, f"{case}: result {i}")


@pytest.mark.parametrize("B, T", [(2, 0), (0, 5)])
@pytest.mark.parametrize("case", ["gated_delta_rule", "hdla", "kda", "hh_delta_rule", "gla", "dplr-5"])
def test_inputs_without_tokens(case, B, T):
    """No tokens (T = 0, or B = 0) with autograd, asked for the kernels: an empty output, the state as it came in,
    and its gradient as the final state's; empty gradients for the rest (the PyTorch chunked path takes them: the
    kernels' backward raised a reshape error)."""
    H, K = 2, 16
    *tokens, h0 = _compile_inputs(max(T, 1), seed=5, B=max(B, 1), H=H, K=K)
    (q, k, v, g, beta, lam, a), h0 = (t[:B, :T] for t in tokens), h0[:B]
    x = dict(q=q, k=k, v=v, g=g, beta=beta, lam=lam, a=a, b=F.normalize(a, dim=-1), h0=h0,
             mask=ops.head_in_head_mask(torch.rand(H, 2, 2, generator=torch.Generator().manual_seed(6))).to(DEVICE))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = _ENTRY_POINTS[case](leaves)
    (o.sum() + (s * s).sum()).backward()
    assert o.shape == (B, T, H, K) and torch.equal(s, h0.float())
    assert_matches(leaves["h0"].grad, 2 * h0, 1e-7, "dh0")
    assert all(t.grad is None or t.grad.shape == t.shape for t in leaves.values())


@pytest.mark.parametrize("mode", ["chunk", "triton"])
@pytest.mark.parametrize("case", ["gated_delta_rule", "gla", "kda", "hdla", "dplr-5"])
def test_gates_of_zero(case, mode):
    """Log-gates of -inf (a gate of 0: forget) and -1e30 at a few tokens, inside chunks and on a chunk's first token:
    the chunked paths give the per-token recurrence's outputs, final state and gradients (they count log-gates below
    -1000 as -1000, ``backends.LOG_GATE_FLOOR``; -inf gave NaN and -1e30 swallowed the other gates of its chunk)."""
    x = list(_compile_inputs(40, seed=7, B=1, H=2, K=16))
    for i, strong in ((3, float("-inf")), (16, float("-inf")), (17, -1e30), (33, -1e30)):
        x[3][:, i], x[5][:, i, :, ::2] = strong, strong  # the scalar gate; half the per-channel gate's channels
    names = ["q", "k", "v", "g", "beta", "lam", "a", "h0"]  # ``_compile_inputs``' order; b from a, through autograd

    def fn(*t, mode):
        return _ENTRY_POINTS[case](dict(zip(names, t), b=F.normalize(t[6], dim=-1)), mode)

    want, got = _grads_of(lambda *t: fn(*t, mode="naive"), x), _grads_of(lambda *t: fn(*t, mode=mode), x)
    for name, r, w in zip(["o", "state", "dq", "dk", "dv", "dg", "dbeta", "dlam", "da", "dh0"], got, want, strict=True):
        if w is not None:
            assert_matches(r, w, 1e-5, f"{case} {mode}: {name}")


def test_mechanisms_trace_whole_on_the_kernels():
    """Traced by Dynamo, the mechanism functions on the Triton kernels make one graph, with and without autograd:
    no graph break (a break splits a compiled model and can make Dynamo compile what follows it again at every
    call: the precision query did, session 64), every entry point an opaque operator. Dynamo alone, with no
    inductor: needs no C++ compiler."""
    mask = ops.head_in_head_mask(torch.rand(2, 2, 2, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    loss = _every_mechanism(mask)
    for grads in (True, False):
        inputs = [x.requires_grad_(grads) for x in _compile_inputs(6, seed=0)]
        torch._dynamo.reset()
        try:
            report = torch._dynamo.explain(loss)(*inputs)
        finally:
            torch._dynamo.reset()
        assert report.graph_break_count == 0, [r.reason[:400] for r in report.break_reasons]
        calls = [str(n.target) for graph in report.graphs for n in graph.graph.nodes if n.op == "call_function"]
        if grads:  # the autograd Functions: Dynamo records their forward and backward as subgraphs
            assert any("autograd_function_apply" in c for c in calls), calls
        else:  # one operator for each entry point's forward, and one for Head-in-Head's update rows
            assert sum("rankdecay.opaque_forward" in c for c in calls) == 7, calls


def test_opaque_operators_fake_matches_real():
    """``torch.library.opcheck`` on the two opaque operators: their fake runs (the kernels' Python with every launch
    a no-op) give the real results' shapes, dtypes and strides, and they register with autograd and AOT as they
    should. Gated DeltaNet's autograd Function (saved tensors that are views of its inputs) and the rank-5 path's
    state passing (saved tensors that are its own outputs), on one sequence a row and on two packed along it."""
    from rankdecay.ops.triton import opaque
    from rankdecay.ops.triton.chunk_bwd import _GatedDeltaRule
    from rankdecay.ops.triton.chunk_state import _ChunkStatePassing

    q, k, v, g, beta, *_ = _compile_inputs(20, seed=0, K=32, V=64)  # (no padding on a GPU)
    tensors, statics = opaque._split((q, k, v, g, beta, None, 0.25))
    forward = torch.ops.rankdecay.opaque_forward
    torch.library.opcheck(forward, (_GatedDeltaRule.name, tensors, statics))
    flat = forward(_GatedDeltaRule.name, tensors, statics)
    assert len(flat) > 3 and flat[-1].device.type == "cpu"  # o, state, saved tensors, the context
    o, state = ops.gated_delta_rule(q.clone().requires_grad_(), k, v, g, beta, scale=0.25, output_final_state=True,
                                    mode="triton")  # (with autograd: the same Function, the same kernels)
    assert torch.equal(flat[0], o) and torch.equal(flat[1], state)

    gen = torch.Generator().manual_seed(0)
    B, H, NC, C, K, V = 1, 2, 3, 4, 16, 16
    rows = [torch.randn(*s, generator=gen).to(DEVICE) for s in [(B, H, K, V), (B, H, NC, 1), (B, H, NC, C, K),
                                                                 (B, H, NC, C, V), (B, H, NC, C, K),
                                                                 (B, H, NC, C, V), (B, H, NC, C, K)]]
    rows[1] = rows[1].sigmoid()
    packed = [torch.randn(2, H, K, V, generator=gen).to(DEVICE)] + rows[1:] + [
        torch.tensor([0, C, NC * C], dtype=torch.int32, device=DEVICE), C]  # sequences of one and two chunks
    for args in (rows + [None, C], packed):
        tensors, statics = opaque._split(args)
        torch.library.opcheck(forward, (_ChunkStatePassing.name, tensors, statics))
        flat = forward(_ChunkStatePassing.name, tensors, statics)
        attributes, codes = opaque._unmeta(flat[-1])
        assert attributes == {"gate": 1, "chunk_size": C} and 2 in codes  # s0 and u: views of the outputs
        assert flat[2].shape == args[0].shape  # the final state: one per sequence
