"""Sliding-window attention's decode step in two Triton kernels (``ops.triton.swa``): the rotary embedding, the
ring's write in place and the attention split over the ring's slots.

The kernels run on a GPU, or on the CPU under ``TRITON_INTERPRET=1`` (conftest sets it). The interpreter rounds fp32
to bf16 toward zero, so on the CPU bf16 is left to the GPU run (BENCHMARKS.md); fp32 and fp16 round as on a GPU."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from rankdecay.layers import SlidingWindowAttention
from rankdecay.layers.attention import rotary, rotary_frequencies
from rankdecay.layers.cache import Cache

from ..conftest import assert_matches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _ring(B, W, H, D, dtype, generator, max_position, n_real=None):
    """A ring with random keys, values, counts and next slots; 70% of its slots real, or the first n_real."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    real = torch.rand(B, W, generator=generator) > 0.3 if n_real is None else torch.arange(W).expand(B, W) < n_real
    return {"k": rand(B, W, H, D), "v": rand(B, W, H, D), "real": real.contiguous().to(DEVICE),
            "count": torch.randint(0, max_position, (B,), generator=generator).to(DEVICE),
            "next": torch.randint(0, W, (B,), generator=generator).to(DEVICE)}


def _reference(q, k, v, ring, theta):
    """The step in fp64 from the same inputs (the angles in fp32, as ``rotary`` forms them): attention of the
    rotated q over the real slots other than ``next`` and over its own rotated key."""
    pos = ring["count"][:, None]
    q, k = (rotary(z[:, None].double(), pos, theta)[:, 0] for z in (q, k))
    rows = torch.arange(q.shape[0], device=q.device)
    rk, rv, seen = ring["k"].double().clone(), ring["v"].double().clone(), ring["real"].clone()
    rk[rows, ring["next"]], rv[rows, ring["next"]], seen[rows, ring["next"]] = k, v.double(), True
    o = F.scaled_dot_product_attention(q[:, :, None], rk.transpose(1, 2), rv.transpose(1, 2),
                                       attn_mask=seen[:, None, None], enable_gqa=True)
    return o[:, :, 0], k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W, D, max_position, n_real, H, Hkv, wide",
                         [(70, 32, 100, None, 3, 3, False), (64, 64, 200_000, None, 3, 3, False),
                          (1, 16, 10, None, 3, 3, False), (33, 24, 5000, None, 3, 3, False),
                          (300, 16, 50, 5, 3, 3, False), (70, 32, 100, None, 6, 2, False),
                          (600, 16, 50, 300, 3, 3, True), (300, 32, 100, None, 6, 2, True)],
                         ids=["partial-block", "far-positions", "window-1", "head-24", "short-prompt", "grouped",
                              "wide-blocks", "wide-grouped"])
def test_the_kernels_attend_over_the_ring_and_write_its_slot(monkeypatch, dtype, W, D, max_position, n_real, H, Hkv,
                                                             wide):
    """Against fp64 from the same inputs: the output, within the dtype's rounding of it; the ring's slot ``next``
    holds the rotated key (rounded once), the value and the token's flag, and every other slot is untouched. q, k
    and v are strided slices of one packed product; positions up to 200,000 (angles far past 2 pi); a window of
    70 (a partial block of slots), of 1 (only the token's own key); a head of 24 (neither it nor its half a power
    of two); a ring of 300 with only its first 5 slots real (a short prompt: blocks with no real slot, skipped); 6
    query heads over 2 key/value heads (GQA: head h reads head h // 3, each slot written once); ``wide``: the
    partial kernel's wider blocks for narrow heads (taken where the programs stay many: forced here), 256 slots a
    program for heads of 16 and 32 (a ring of 600, its first 300 real: a full block, a partial one, an empty one
    skipped; a ring of 300 in two blocks); a padding token still sees itself."""
    from rankdecay.ops.triton import swa
    from rankdecay.ops.triton.swa import swa_step

    monkeypatch.setattr(swa, "PROGRAMS", 1 if wide else swa.PROGRAMS)
    assert (swa._block_w(5, H, W, D) == 256) == wide

    g = torch.Generator().manual_seed(W + D)
    B, theta = 5, 10000.0
    packed = torch.randn(B, (H + 2 * Hkv) * D + 8, generator=g).to(DEVICE, dtype)
    q = packed[:, :H * D].view(B, H, D)
    k, v = (packed[:, (H + i * Hkv) * D:(H + (i + 1) * Hkv) * D].view(B, Hkv, D) for i in range(2))
    ring = _ring(B, W, Hkv, D, dtype, g, max_position, n_real)
    real = torch.tensor([True, False, True, True, False], device=DEVICE)
    before = {name: t.clone() for name, t in ring.items()}
    want, rotated_k = _reference(q, k, v, ring, theta)
    got = swa_step(q, k, v, ring, real, rotary_frequencies(D, theta, DEVICE))
    assert got.shape == (B, H, D) and got.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert_matches(got.double(), want, 2e-6 if dtype == torch.float32 else 2 * eps, "output")
    rows = torch.arange(B, device=DEVICE)
    assert_matches(ring["k"][rows, before["next"]].double(), rotated_k, 1e-6 if dtype == torch.float32 else eps,
                   "rotated key in its slot")
    assert torch.equal(ring["v"][rows, before["next"]], v)
    assert torch.equal(ring["real"][rows, before["next"]], real)
    others = torch.ones(B, W, dtype=torch.bool, device=DEVICE)
    others[rows, before["next"]] = False
    for name in ("k", "v", "real"):
        assert torch.equal(ring[name][others], before[name][others]), f"ring {name}: another slot was written"
    assert torch.equal(ring["count"], before["count"]) and torch.equal(ring["next"], before["next"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["window", "grouped-full"])
def test_the_layer_decodes_with_the_kernels_as_with_pytorch(monkeypatch, dtype, kind):
    """A prompt with a left-padded row, then steps past the window (the ring wraps; one step pads a row): outputs
    and the cache (keys, values, flags, counts, next slot) match the PyTorch step's. Also full attention with 4
    query heads over 2 key/value heads, q/k norms and biases, whose ring of 16 slots doubles after its 12th step
    (4 prompt tokens) and holds every key."""
    from rankdecay.layers import attention

    torch.manual_seed(0)
    if kind == "window":
        layer = SlidingWindowAttention(32, 2, 16, window_size=5)
    else:
        layer = SlidingWindowAttention(32, 4, 16, window_size=None, num_kv_heads=2, qk_norm=True, qkv_bias=True)
        with torch.no_grad():
            for p in (layer.q_norm.weight, layer.k_norm.weight, layer.q_proj.bias, layer.k_proj.bias):
                p.add_(torch.randn_like(p) * 0.5)
    layer = layer.to(DEVICE, dtype)
    x = torch.randn(3, 4, 32, device=DEVICE, dtype=dtype)
    steps = torch.randn(9 if kind == "window" else 14, 3, 1, 32, device=DEVICE, dtype=dtype)
    mask = torch.ones(3, 4, dtype=torch.long, device=DEVICE)
    mask[1, :2] = 0

    def decode(kernel):
        monkeypatch.setattr(attention, "_on_kernel_device", lambda t: kernel)
        calls = []
        monkeypatch.setattr(attention._swa_kernels, "swa_step", lambda *a: calls.append(1) or step(*a))
        cache, outs = Cache(1), []
        with torch.no_grad():
            layer(x, mask, cache=cache, use_cache=True)
            for t, xt in enumerate(steps):
                real = torch.ones(3, 1, dtype=torch.long, device=DEVICE)
                real[2] = int(t != 3)
                o, cache = layer(xt, real, cache=cache, use_cache=True)
                outs.append(o)
        assert len(calls) == (len(steps) if kernel else 0)
        return torch.cat(outs, 1), cache.layers[0]

    step = attention._swa_kernels.swa_step
    got, got_cache = decode(True)
    want, want_cache = decode(False)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert_matches(got.float(), want.float(), tol, "outputs")
    assert got_cache["k"].shape[1] == (5 if kind == "window" else 32)
    for name in ("k", "v"):
        assert_matches(got_cache[name].float(), want_cache[name].float(), tol, f"cached {name}")
    for name in ("real", "count", "next"):
        assert torch.equal(got_cache[name], want_cache[name]), name


def test_the_kernels_are_left_out_with_autograd_an_odd_head_size_or_compiling_if_told(monkeypatch):
    """With autograd, a head size the kernels do not take (below 8), or under torch.compile with
    ``_STEP_KERNELS_COMPILED`` off (inductor then fuses the PyTorch step itself), the step is PyTorch's."""
    from rankdecay.layers import attention

    monkeypatch.setattr(attention, "_STEP_KERNELS_COMPILED", False)
    monkeypatch.setattr(attention, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(attention._swa_kernels, "swa_step", lambda *a: pytest.fail("the kernels ran"))
    for head_dim, grad in ((16, True), (6, False)):
        layer = SlidingWindowAttention(48, 2, head_dim, window_size=4).to(DEVICE)
        cache = Cache(1)
        with torch.set_grad_enabled(grad):
            layer(torch.randn(2, 3, 48, device=DEVICE), cache=cache, use_cache=True)
            o, _ = layer(torch.randn(2, 1, 48, device=DEVICE), cache=cache, use_cache=True)
        assert o.shape == (2, 1, 48) and torch.isfinite(o).all()
    assert not attention._swa_kernels.takes(torch.zeros(2, 2, 6), cache.layers[0]["k"])
    layer = SlidingWindowAttention(48, 2, 16, window_size=4).to(DEVICE)
    cache = Cache(1)
    with torch.no_grad():
        layer(torch.randn(2, 3, 48, device=DEVICE), cache=cache, use_cache=True)
        step = torch.compile(lambda x: layer(x, cache=cache, use_cache=True)[0], backend="eager", fullgraph=True)
        assert torch.isfinite(step(torch.randn(2, 1, 48, device=DEVICE))).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: Triton's CPU interpreter cannot run under torch.compile")
def test_a_compiled_step_calls_the_kernels(monkeypatch):
    """By default a compiled step (inductor, one graph) calls the two kernels (at B = 64 they measured 1.8x faster
    than the PyTorch step inductor fuses: BENCHMARKS.md, session 79), and decodes as the eager PyTorch step:
    outputs and rings over steps that wrap the ring, one row a padding step."""
    from torch._inductor.utils import run_and_get_code

    from rankdecay.layers import attention

    torch.manual_seed(0)
    layer = SlidingWindowAttention(64, 2, 32, window_size=6).to(DEVICE)
    x = torch.randn(3, 4, 64, device=DEVICE)
    steps = torch.randn(9, 3, 1, 64, device=DEVICE)
    real = torch.ones(9, 3, 1, dtype=torch.long, device=DEVICE)
    real[3, 2] = 0

    def decode(compiled):
        monkeypatch.setattr(attention, "_on_kernel_device", lambda t: compiled)
        cache = Cache(1)
        with torch.no_grad():
            layer(x, cache=cache, use_cache=True)
            one = lambda xt, r: layer(xt, r, cache=cache, use_cache=True)[0]  # noqa: E731
            if not compiled:
                return torch.cat([one(xt, r) for xt, r in zip(steps, real)], 1), cache.layers[0], ""
            one = torch.compile(one, fullgraph=True)
            first, code = run_and_get_code(one, steps[0], real[0])
            outs = [first] + [one(xt, r) for xt, r in zip(steps[1:], real[1:])]
            return torch.cat(outs, 1), cache.layers[0], "\n".join(code)

    got, got_ring, code = decode(True)
    for kernel in ("_swa_partial_kernel", "_swa_combine_kernel"):
        assert kernel in code, f"the compiled step does not call {kernel}"
    want, want_ring, _ = decode(False)
    assert_matches(got, want, 1e-5, "outputs")
    for name in ("k", "v"):
        assert_matches(got_ring[name], want_ring[name], 1e-5, f"ring {name}")
    for name in ("real", "count", "next"):
        assert torch.equal(got_ring[name], want_ring[name]), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("positions", ["rows", "one-row", "1-D"])
@pytest.mark.parametrize("D", [32, 24])
def test_the_rotary_kernel_rotates_as_pytorch_forward_and_backward(monkeypatch, dtype, positions, D):
    """``rotary`` on the kernel's device (one Triton kernel each way) against PyTorch's operations: x a strided
    slice of a packed product [B, T, H, D] with T = 37 (a partial block of tokens), D = 32 or 24 (half of it not a
    power of two), positions per row, one row broadcast, or 1-D, up to 100,000; the output and the gradient of x."""
    from rankdecay.layers import attention

    g = torch.Generator().manual_seed(D)
    B, T, H = 3, 37, 2
    packed = torch.randn(B, T, 3 * H * D, generator=g).to(DEVICE, dtype)
    pos = torch.randint(0, 100_000, {"rows": (B, T), "one-row": (1, T), "1-D": (T,)}[positions], generator=g)
    pos = pos.to(DEVICE)
    weight = torch.randn(B, T, H, D, generator=g).to(DEVICE)

    def run(kernel):
        monkeypatch.setattr(attention, "_on_kernel_device", lambda t: kernel)
        x = packed.clone().requires_grad_()
        y = attention.rotary(x[..., H * D:2 * H * D].view(B, T, H, D), pos, 10000.0)
        (y.float() * weight).sum().backward()
        return y, x.grad

    calls = []
    launch = attention._rotary_kernel._launch
    monkeypatch.setattr(attention._rotary_kernel, "_launch", lambda *a: calls.append(1) or launch(*a))
    got, want = run(True), run(False)
    assert len(calls) == 2, "the kernel ran forward and backward"
    tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert got[0].dtype == dtype
    assert_matches(got[0].float(), want[0].float(), tol, "output")
    assert_matches(got[1].float(), want[1].float(), tol, "gradient of x")


def test_rotary_frequencies_are_remembered_and_trainable_after_inference_mode(monkeypatch):
    """``rotary_frequencies`` forms each (D, theta, device)'s tensor once (a decode step would otherwise form it in
    every layer); the first call under ``torch.inference_mode`` (generation before training) still gives a tensor
    that the rotary kernel's autograd may save."""
    from rankdecay.layers import attention

    monkeypatch.setattr(attention, "_FREQUENCIES", {})
    monkeypatch.setattr(attention, "_on_kernel_device", lambda t: True)
    with torch.inference_mode():
        first = rotary_frequencies(16, 12345.0, DEVICE)
    assert rotary_frequencies(16, 12345.0, DEVICE) is first
    assert rotary_frequencies(16, 10000.0, DEVICE) is not first
    want = 12345.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert_matches(first.double().cpu(), want, 1e-7, "frequencies")
    x = torch.randn(1, 5, 2, 16, device=DEVICE, requires_grad=True)
    attention.rotary(x, torch.arange(5, device=DEVICE), 12345.0).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
