"""The norms' Triton kernels (``rankdecay.ops.triton.norm``): the L2 norm of q and k, RMSNorm, RMSNorm times a
gate's activation. Under the interpreter on the CPU against PyTorch in fp64; on a GPU, that the layers take them
and that in bf16 they are as close to fp64 as PyTorch's own operations are."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from ..conftest import rel_rms

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the norm kernels need Triton (the test extra installs it on Linux)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="realistic sizes need a CUDA GPU (recorded in BENCHMARKS.md)")
ACT = {None: lambda g: g, "silu": F.silu, "sigmoid": torch.sigmoid}


def _rows(shape, seed):
    """Rows of awkward norms: one of zeros, one far below the L2 norm's eps (1e-6), one large, the rest N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x[0, 0] = 0
    x[0, 1] *= 1e-9
    x[1, 0] *= 1e3
    return x, torch.randn(*shape, generator=gen, dtype=torch.float64), gen


def _compare(results, names):
    """results: [kernel (fp32), PyTorch fp32, fp64] lists of tensors; each kernel tensor at least as close to fp64
    as PyTorch's fp32 (twice its error, or within 1e-6)."""
    for name, got, torch_fp32, exp in zip(names, *results, strict=True):
        err, ref = rel_rms(got.double(), exp), rel_rms(torch_fp32.double(), exp)
        assert err < 1e-6 or err <= 2 * ref, (name, err, ref)


@pytest.mark.parametrize("D", [48, 128, 200])
def test_l2norm_kernel(D):
    """``x / max(||x||, 1e-6)`` and its gradient, with the clamp's (rows of zeros and of norms below eps), over 21
    rows (not a block's multiple) of D columns (a power of two and not)."""
    from rankdecay.ops.triton.norm import l2norm

    x, dy, _ = _rows((3, 7, D), D)
    results = []
    for fn, dtype in ((lambda t: l2norm(t, 1e-6), torch.float32),
                      (lambda t: F.normalize(t, dim=-1, eps=1e-6), torch.float32),
                      (lambda t: F.normalize(t, dim=-1, eps=1e-6), torch.float64)):
        leaf = x.to(DEVICE, dtype).requires_grad_()
        y = fn(leaf)
        results.append([y, *torch.autograd.grad(y, leaf, dy.to(DEVICE, dtype))])
    assert results[0][0].dtype == torch.float32 and results[0][0].shape == x.shape
    _compare(results, ["y", "dx"])
    # the clamped rows' gradient is dy / eps, not the unclamped projection's
    torch.testing.assert_close(results[0][1][0, 1].double(), dy[0, 1].to(DEVICE) / 1e-6, rtol=1e-6, atol=0)


@pytest.mark.parametrize("activation", [None, "silu", "sigmoid", "no gate", "no weight"])
@pytest.mark.parametrize("D", [48, 200])
def test_rms_norm_kernel(activation, D):
    """``rms_norm(x) * weight * act(gate)``: the output and the gradients of x, of the weight (summed over the rows in
    blocks) and of the gate, over 21 rows of D columns, one of zeros and one tiny."""
    from rankdecay.ops.triton.norm import rms_norm

    x, dy, gen = _rows((3, 7, D), D)
    w = 1 + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)
    g = 3 * torch.randn(3, 7, D, generator=gen, dtype=torch.float64)
    gated, weighted = activation not in ("no gate", "no weight"), activation != "no weight"
    act = ACT[activation] if gated else None

    def reference(x, w, g):
        y = F.rms_norm(x, (D,), w, 1e-6)
        return y * act(g) if gated else y

    def kernel(x, w, g):
        return rms_norm(x, w, 1e-6, g if gated else None, activation if gated else None)

    results = []
    for fn, dtype in ((kernel, torch.float32), (reference, torch.float32), (reference, torch.float64)):
        leaves = [x.to(DEVICE, dtype).requires_grad_(), w.to(DEVICE, dtype).requires_grad_() if weighted else None,
                  g.to(DEVICE, dtype).requires_grad_()]
        y = fn(*leaves)
        wrt = [t for t in leaves if t is not None and (t is not leaves[2] or gated)]
        results.append([y, *torch.autograd.grad(y, wrt, dy.to(DEVICE, dtype))])
    assert results[0][0].dtype == torch.float32
    _compare(results, ["y", "dx", "dw", "dgate"][:len(results[0])] if weighted else ["y", "dx"])


@pytest.mark.parametrize("norm", ["l2", "rms", "gated"])
def test_norm_kernels_in_16_bits_round_once(norm):
    """fp16 inputs: the kernels keep every sum in fp32 and round once, so their outputs and gradients are at least
    as close to fp32's as PyTorch's own fp16 operations (the layers' forms: the cast up, the norm, the cast back,
    the gate's product in fp16) are."""
    from rankdecay.layers.modules import GatedRMSNorm, RMSNorm
    from rankdecay.ops.triton import norm as kernels

    x, dy, gen = _rows((4, 9, 64), 7)
    g = 3 * torch.randn(4, 9, 64, generator=gen, dtype=torch.float64)
    module = RMSNorm(64) if norm == "rms" else GatedRMSNorm(64, activation="silu")
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(64, generator=gen))
    module = module.to(DEVICE)

    def plain(x, g):
        if norm == "l2":
            return F.normalize(x.float(), dim=-1, eps=1e-6).to(x.dtype)
        return module(x) if norm == "rms" else module(x, g)

    def fused(x, g):
        if norm == "l2":
            return kernels.l2norm(x)
        return kernels.rms_norm(x, module.weight, module.eps, None if norm == "rms" else g,
                                None if norm == "rms" else "silu")

    runs = []
    for fn, dtype in ((fused, torch.float16), (plain, torch.float16), (plain, torch.float32)):
        leaves = [x.to(DEVICE, dtype).requires_grad_(), g.to(DEVICE, dtype).requires_grad_()]
        y = fn(*leaves)
        wrt = leaves[:1] if norm != "gated" else leaves
        runs.append([y, *torch.autograd.grad(y, wrt, dy.to(DEVICE, dtype))])
    assert runs[0][0].dtype == torch.float16
    for name, a, b, want in zip(["y", "dx", "dgate"], *runs):
        err, bound = rel_rms(a.float(), want), rel_rms(b.float(), want)
        assert err <= bound * 1.01 + 1e-7, f"{norm}: {name}: {err:.2e} against PyTorch's {bound:.2e}"


def test_swiglu_kernel():
    """``silu(gate) * up`` and both gradients against PyTorch's in fp64 (3,001 elements, not a block's multiple; the
    gate out to ±40), and in fp16 at least as close to fp32's as PyTorch's two fp16 operations."""
    from rankdecay.ops.triton.norm import swiglu

    gen = torch.Generator().manual_seed(11)
    g, u, dy = (4 * torch.randn(3, 1000, 1, generator=gen, dtype=torch.float64) for _ in range(3))
    g[0, :4, 0] = torch.tensor([40.0, -40.0, 0.0, 1e-3], dtype=torch.float64)
    for dtype, ref_dtype in ((torch.float32, torch.float64), (torch.float16, torch.float32)):
        runs = []
        for fn, dt in ((swiglu, dtype), (lambda a, b: F.silu(a) * b, dtype), (lambda a, b: F.silu(a) * b, ref_dtype)):
            leaves = [t.to(DEVICE, dt).requires_grad_() for t in (g, u)]
            y = fn(*leaves)
            runs.append([y, *torch.autograd.grad(y, leaves, dy.to(DEVICE, dt))])
        assert runs[0][0].dtype == dtype
        for name, a, b, want in zip(["y", "dgate", "dup"], *runs):
            err, bound = rel_rms(a.double(), want), rel_rms(b.double(), want)
            assert err < 1e-6 or err <= 2 * bound, (dtype, name, err, bound)
    with pytest.raises(ValueError, match="up must have gate's shape"):
        swiglu(g, u[:, :5])


@pytest.mark.parametrize("kernel", ["l2norm", "rms_norm", "swiglu", "logsigmoid_gate"])
def test_kernels_refuse_double_backward(kernel):
    """The kernels' backward passes are not differentiable themselves: a gradient penalty through them (a backward
    with ``create_graph=True``, then a backward of that gradient) raises instead of silently dropping their second
    derivatives (PyTorch's forms, on the CPU or under ``torch.compile``, are differentiable twice)."""
    from rankdecay.ops.triton import gate, norm

    x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    scale = torch.randn(4, 16, device=DEVICE, requires_grad=True)  # makes the incoming gradient need a graph
    y = {"l2norm": lambda: norm.l2norm(x), "rms_norm": lambda: norm.rms_norm(x, None, 1e-6),
         "swiglu": lambda: norm.swiglu(x, x), "logsigmoid_gate": lambda: gate.logsigmoid_gate(x, 2.0)}[kernel]()
    (dx,) = torch.autograd.grad((y * scale).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dx.square().sum().backward()


def test_kernels_take_empty_batches():
    """No rows (a batch of zero sequences): empty outputs and gradients, and the weight's gradient zero."""
    from rankdecay.ops.triton.norm import l2norm, rms_norm, swiglu

    x, g = (torch.randn(0, 5, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    (rms_norm(x, w, 1e-6, g, "silu").sum() + l2norm(x).sum() + swiglu(x, g).sum()).backward()
    assert x.grad.shape == g.grad.shape == (0, 5, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_norm_kernels_refuse_bad_arguments():
    from rankdecay.ops.triton.norm import rms_norm

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="activation must be"):
        rms_norm(x, None, 1e-6, x, "relu")
    with pytest.raises(ValueError, match="gate must have x's shape"):
        rms_norm(x, None, 1e-6, x[:, :4], "silu")
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        rms_norm(x, torch.ones(4), 1e-6)


def test_layers_take_the_norm_kernels_on_their_device(monkeypatch):
    """Where the layers' kernels run (a GPU; here the interpreter), ``RMSNorm``, ``GatedRMSNorm`` and the SwiGLU's
    product take them, with the same result as PyTorch's forms up to rounding; inside ``torch.compile`` they keep
    PyTorch's."""
    from rankdecay.layers import modules

    x, _, gen = _rows((2, 5, 32), 3)
    x, g = x.to(DEVICE, torch.float32), torch.randn(2, 5, 32, generator=gen).to(DEVICE)
    norm, gated = modules.RMSNorm(32).to(DEVICE), modules.GatedRMSNorm(32, activation="sigmoid").to(DEVICE)
    want = norm(x), gated(x, g)
    calls = []
    kernel = modules._norm.rms_norm
    monkeypatch.setattr(modules, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(modules._norm, "rms_norm", lambda *a: calls.append(len(a)) or kernel(*a))
    got = norm(x), gated(x, g)
    assert calls == [6, 6]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    swiglu = modules._norm.swiglu
    monkeypatch.setattr(modules._norm, "swiglu", lambda *a: calls.append("swiglu") or swiglu(*a))
    torch.testing.assert_close(modules.swiglu(x, g), F.silu(x) * g, rtol=1e-5, atol=1e-6)
    assert calls == [6, 6, "swiglu"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    norm(x), gated(x, g), modules.swiglu(x, g)
    assert calls == [6, 6, "swiglu"]


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "kernel"])
def test_autocast_output_rounds_the_norm_once_to_autocast_dtype(monkeypatch, kernel):
    """``RMSNorm(autocast_output=True)`` (a block's norms) returns autocast's dtype under autocast: the fp32 norm
    rounded once to bf16, what each linear map reading it would have cast it to; outside autocast, and by default,
    x's dtype. The gradient reaches x in fp32 either way."""
    from rankdecay.layers import modules

    if kernel:
        monkeypatch.setattr(modules, "_on_kernel_device", lambda t: True)
    x, _, gen = _rows((3, 7, 48), 11)
    x = x.to(DEVICE, torch.float32)
    norm, plain = modules.RMSNorm(48, autocast_output=True).to(DEVICE), modules.RMSNorm(48).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
        plain.weight.copy_(norm.weight)
    want = plain(x)
    assert norm(x).dtype == torch.float32 and torch.equal(norm(x), want)
    leaf = x.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y, y_plain = norm(leaf), plain(x)
    assert y.dtype == torch.bfloat16 and y_plain.dtype == torch.float32
    if kernel:  # the interpreter rounds fp32 to bf16 toward zero: within one bf16 step
        torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(y, want.to(torch.bfloat16))
    dy = torch.randn(y.shape, generator=gen).to(DEVICE, torch.bfloat16)
    (dx,) = torch.autograd.grad(y, leaf, dy)
    leaf32 = x.clone().requires_grad_()
    (dx_want,) = torch.autograd.grad(plain(leaf32), leaf32, dy.float())
    assert dx.dtype == torch.float32
    torch.testing.assert_close(dx, dx_want, rtol=1e-5, atol=1e-6)


# --- GPU only: realistic sizes, bf16 -------------------------------------------------


@GPU
def test_gpu_norms_take_the_kernels():
    """On a GPU, ``ops.mechanisms.l2norm`` and the layers' norms are the kernels'; in bf16 (q and k of [8, 2048, 4,
    128], a mixer's output [8, 2048, 4, 256] and its gate, a residual stream [8, 2048, 1024] in fp32) their outputs
    and gradients are as close to fp64 as PyTorch's forms are."""
    from rankdecay.layers.modules import GatedRMSNorm, RMSNorm
    from rankdecay.ops import mechanisms
    from rankdecay.ops.triton import norm as kernels

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(8, 2048, 4, 128, generator=gen).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(mechanisms.l2norm(q), kernels.l2norm(q))
    o = torch.randn(8, 2048, 4, 256, generator=gen).to(DEVICE, torch.bfloat16)
    gate = torch.randn(8, 2048, 4, 256, generator=gen).to(DEVICE, torch.bfloat16)
    h = torch.randn(8, 2048, 1024, generator=gen).to(DEVICE)
    gated, norm = GatedRMSNorm(256).to(DEVICE), RMSNorm(1024).to(DEVICE)
    with torch.no_grad():
        gated.weight.uniform_(0.5, 1.5)
        norm.weight.uniform_(0.5, 1.5)
    cases = {
        "l2": ((q,), mechanisms.l2norm, lambda t: F.normalize(t.double(), dim=-1, eps=1e-6),
               lambda t: F.normalize(t.float(), dim=-1, eps=1e-6).to(t.dtype)),
        "gated": ((o, gate), gated, lambda t, u: F.rms_norm(t.double(), (256,), gated.weight.double(), 1e-6)
                  * F.silu(u.double()), lambda t, u: RMSNorm.forward(gated, t) * F.silu(u)),
        "rms": ((h,), norm, lambda t: F.rms_norm(t.double(), (1024,), norm.weight.double(), 1e-6),
                lambda t: F.rms_norm(t, (1024,), norm.weight, 1e-6)),
    }
    for name, (inputs, fn, exact, pytorch) in cases.items():
        dy = torch.randn(inputs[0].shape, generator=gen).to(DEVICE)
        runs = []
        for f, dtype in ((fn, None), (pytorch, None), (exact, torch.float64)):
            leaves = [t.to(dtype or t.dtype).requires_grad_() for t in inputs]
            y = f(*leaves)
            runs.append([y, *torch.autograd.grad(y, leaves, dy.to(y.dtype))])
        for part, a, b, want in zip(["y", "dx", "dgate"], *runs):
            err, bound = rel_rms(a.double(), want), rel_rms(b.double(), want)
            assert err <= bound * 1.01 + 1e-7, f"{name}: {part}: {err:.2e} against PyTorch's {bound:.2e}"
