"""The decode step's short convolutions in one Triton kernel (``ops.triton.conv``), states shifted in place.

The kernel runs on a GPU, or on the CPU under ``TRITON_INTERPRET=1`` (conftest sets it)."""
import importlib.util

import pytest
import torch

from rankdecay.layers import ShortConvolution
from rankdecay.layers.modules import conv_step
from rankdecay.models import output_cache

from ..conftest import assert_matches
from .common import random_ids, tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B", [1, 3])
def test_the_kernel_steps_three_convolutions_as_the_modules_do(kernel_size, dtype, B):
    """Three convolutions of odd widths (a partial last block, a segment of more than one block), one with shared
    filters and one without an activation, their inputs strided slices of one packed product, as a mixer's q, k
    and v are: the outputs are the modules' step's, and each state is shifted in place exactly."""
    torch.manual_seed(kernel_size * 10 + B)
    convs = [ShortConvolution(40, kernel_size), ShortConvolution(300, kernel_size, groups=5),
             ShortConvolution(17, kernel_size)]
    convs = [c.to(DEVICE, dtype) for c in convs]
    packed = torch.randn(B, 1, 400, device=DEVICE, dtype=dtype)
    xs = [packed[..., :40], packed[..., 40:340], packed[..., 340:357]]
    states = [torch.randn(B, c.dim, kernel_size - 1, device=DEVICE, dtype=dtype) for c in convs]
    with torch.no_grad():
        want = [c(x.double(), s.double()) for c, x, s in zip(convs, xs, states)]  # (filters cast to fp64)
        before = [s.data_ptr() for s in states]
        got = conv_step(convs, xs, states)
    assert got is not None
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp32 sums, rounded once
    for i, (y, s, (wy, ws)) in enumerate(zip(got, states, want)):
        assert y.shape == xs[i].shape and y.dtype == dtype
        assert_matches(y.double(), wy, tol, f"output {i}")
        assert torch.equal(s.double(), ws), f"state {i} is not the shifted one"
    assert [s.data_ptr() for s in states] == before


def test_conv_step_declines_what_the_kernel_does_not_take():
    """Where the kernel does not apply, conv_step returns None and the mixer runs the modules."""
    conv = ShortConvolution(8, 4)
    x, s = torch.randn(2, 1, 8, device=DEVICE), torch.randn(2, 8, 3, device=DEVICE)
    conv.to(DEVICE)
    with torch.no_grad():
        assert conv_step([conv], [x], [s]) is not None
        assert conv_step([conv], [x], [None]) is None  # no state yet
        assert conv_step([conv], [x], [s.transpose(1, 2).contiguous().transpose(1, 2)]) is None  # strided state
        assert conv_step([conv], [x], [s.half()]) is None  # a state in another dtype
        assert conv_step([conv], [torch.randn(2, 2, 8, device=DEVICE)], [s]) is None  # two tokens
        assert conv_step([ShortConvolution(8, 1).to(DEVICE)], [x], [s[..., :0]]) is None  # no state to shift
        assert conv_step([conv, ShortConvolution(8, 3).to(DEVICE)], [x, x], [s, s[..., :2]]) is None  # two sizes
        assert conv_step([conv] * 4, [x] * 4, [s] * 4) is None  # more than three
    assert conv_step([conv], [x], [s]) is None  # autograd


def test_the_kernel_refuses_bad_arguments():
    from rankdecay.ops.triton.conv import short_conv_step

    x, s, w = torch.randn(2, 8, device=DEVICE), torch.randn(2, 8, 3, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="states\\[0\\] must be a contiguous"):
        short_conv_step([x], [s[..., :2]], [w])
    with pytest.raises(ValueError, match="weights\\[0\\] must be a contiguous"):
        short_conv_step([x], [s], [torch.randn(4, 8, device=DEVICE).t()])
    with pytest.raises(ValueError, match="xs\\[0\\] must be"):
        short_conv_step([x.t().contiguous().t()], [s], [w])
    with pytest.raises(ValueError, match="1 to 3 convolutions"):
        short_conv_step([x] * 4, [s] * 4, [w] * 4)
    with pytest.raises(ValueError, match="activation"):
        short_conv_step([x], [s], [w], activation="relu")


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn"])
def test_decode_steps_take_the_kernel_and_keep_the_cache_tensors(mixer, monkeypatch):
    """On the GPU's decode route (forced here; the kernels under the interpreter on the CPU) each layer's three
    convolutions take one launch per token, the cache keeps its conv-state tensors from step to step (a CUDA graph
    copies nothing back), and the logits are the PyTorch route's."""
    import rankdecay.layers.mixers as mixers
    from rankdecay.layers import modules

    model = tiny_model(mixer).to(DEVICE)
    ids = random_ids(2, 20).to(DEVICE)
    with torch.no_grad():
        cache = output_cache(model(ids[:, :12], use_cache=True))
        want = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(12, 20)]
        calls = []
        kernel = modules._short_conv_step
        monkeypatch.setattr(modules, "_short_conv_step", lambda *a: calls.append(1) or kernel(*a))
        monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: "fused_recurrent")
        cache = output_cache(model(ids[:, :12], use_cache=True))
        states = [layer["conv"] for layer in cache.layers]
        got = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(12, 20)]
    layers = model.config.num_hidden_layers
    assert len(calls) == 8 * layers
    assert all(a is b for layer, s in zip(cache.layers, states) for a, b in zip(layer["conv"], s))
    assert_matches(torch.cat(got, 1), torch.cat(want, 1), 1e-5, mixer)


def _conv_case(case, kernel_size, activation, groups, dtype):
    torch.manual_seed(0)
    conv = ShortConvolution(150, kernel_size, activation, groups=groups).to(DEVICE)
    if case.startswith("packed"):
        lengths = [37, 0, 1, 2, 50]  # an empty sequence, two shorter than the taps, blocks that straddle starts
        cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
        x = torch.randn(1, sum(lengths), 150, device=DEVICE, dtype=dtype)
        rows = len(lengths)
    else:
        cu, x, rows = None, torch.randn(2, 45, 150, device=DEVICE, dtype=dtype), 2
    given = case.endswith(("state", "fixed"))
    state = torch.randn(rows, 150, kernel_size - 1, device=DEVICE, dtype=dtype) if given else None
    return conv, x, state, cu


def _conv_run(conv, x, state, cu, state_grad=True):
    """y, the final state and the gradients of x and the filters, and of the state where there is one and
    ``state_grad`` (the state's own gradient, and through the final state, which holds its last inputs where a row
    is shorter than the taps)."""
    x = x.detach().requires_grad_()
    state = None if state is None else state.detach().requires_grad_(state_grad)
    y, final = conv(x, state, cu)
    dy = torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape)
    dfinal = torch.linspace(1, -0.5, final.numel(), device=y.device).view(final.shape)
    leaves = [x, conv.weight] + ([state] if state is not None and state_grad else [])
    # (one tap: the PyTorch path never reads the state of no slots)
    grads = torch.autograd.grad((y.float() * dy).sum() + (final.float() * dfinal).sum(), leaves, allow_unused=True,
                                materialize_grads=True)
    return (y.float(), final.float()) + tuple(g.float() for g in grads)


@pytest.mark.parametrize("groups", [None, 5])
@pytest.mark.parametrize("kernel_size,activation", [(4, "silu"), (3, None), (2, "silu"), (1, "silu")])
@pytest.mark.parametrize("case", ["rows", "rows-state", "rows-fixed", "packed", "packed-state", "packed-fixed"])
def test_the_sequence_kernel_matches_the_pytorch_path(case, kernel_size, activation, groups, monkeypatch):
    """Training's and prefill's convolution in one Triton kernel (``ops.triton.conv.short_conv``, forward, and two
    kernels backward): the outputs, final states and the gradients of x, of the filters (shared ones too) and of
    the initial state are the PyTorch path's (fp32), for rows (B = 2) and for packed sequences (lengths 37, 0, 1, 2,
    50: sequences shorter than the taps, whose state reaches the next ones' outputs not at all and their own through
    fewer taps), from zeros, from initial states and from initial states that take no gradient ("fixed"); 150
    channels (partial blocks); 4, 3, 2 taps and 1 (a state of no slots)."""
    from rankdecay.layers import modules

    conv, x, state, cu = _conv_case(case, kernel_size, activation, groups, torch.float32)
    state_grad = not case.endswith("fixed")
    want = _conv_run(conv, x, state, cu, state_grad)
    calls = []
    kernel = modules._short_conv
    monkeypatch.setattr(modules, "_on_kernel_device", lambda x: True)
    monkeypatch.setattr(modules, "_short_conv", lambda *a: calls.append(1) or kernel(*a))
    got = _conv_run(conv, x, state, cu, state_grad)
    assert calls == [1]
    assert len(got) == len(want) == (5 if state is not None and state_grad else 4)
    names = ("y", "final state", "grad x", "grad filters", "grad state")[:len(got)]
    for a, b, name in zip(got, want, names, strict=True):
        assert_matches(a, b, 1e-5, f"{case}: {name}")


@pytest.mark.parametrize("case", ["rows-state", "packed"])
def test_the_sequence_kernel_in_16_bits_rounds_once(case, monkeypatch):
    """fp16: the kernel's sums are fp32, rounded once, so its outputs and gradients are at least as close to the
    fp32 path's as PyTorch's fp16 operations (a rounding per product and per sum) are."""
    from rankdecay.layers import modules

    conv, x, state, cu = _conv_case(case, 4, "silu", None, torch.float16)
    ref = _conv_run(conv.float(), x.float(), None if state is None else state.float(), cu)
    conv = conv.half()
    plain = _conv_run(conv, x, state, cu)
    monkeypatch.setattr(modules, "_on_kernel_device", lambda x: True)
    fused = _conv_run(conv, x, state, cu)
    for a, b, want, name in zip(fused, plain, ref, ("y", "final state", "grad x", "grad filters", "grad state")):
        err, bound = ((a - want).norm() / want.norm()).item(), ((b - want).norm() / want.norm()).item()
        assert err <= bound * 1.01 + 1e-7, f"{case}: {name}: {err:.2e} against PyTorch's {bound:.2e}"
