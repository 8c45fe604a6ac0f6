"""The LM head's cross-entropy in slices of the vocabulary (``rankdecay.layers.linear_cross_entropy``), its Triton
kernels, and the models' and trainer's use of it (``fuse_linear_cross_entropy``)."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from rankdecay.layers import linear_cross_entropy
from rankdecay.layers import loss as loss_module
from rankdecay.layers.loss import default_vocab_chunk_size
from tests.conftest import NO_CPU_COMPILE, assert_matches, can_compile_on_cpu, rel_rms
from tests.models.common import random_ids, tiny_model


def _inputs(shape=(3, 37), D=16, V=29, bias=True, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=gen, dtype=dtype, requires_grad=True) if bias else None
    t = torch.randint(0, V, shape, generator=gen)
    if t.numel() > 20:
        t.view(-1)[:9] = -100
        t.view(-1)[20] = -100
    return x, t, w, b


def _grads(loss, leaves, weights):
    return torch.autograd.grad((loss * weights).sum(), [p for p in leaves if p is not None])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("vocab_chunk_size", [1, 7, 64, None])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_the_logits_path(reduction, vocab_chunk_size, bias):
    """Losses and the gradients of x, weight and bias equal F.cross_entropy over F.linear's logits (fp64, exact to
    rounding), with ignored rows, slices that do not divide the 29 entries, one entry a slice, one slice for all,
    and per-row weights on the "none" losses."""
    x, t, w, b = _inputs(bias=bias)
    got = linear_cross_entropy(x, t, w, b, reduction=reduction, vocab_chunk_size=vocab_chunk_size)
    ref = F.cross_entropy(F.linear(x, w, b).flatten(0, 1), t.flatten(), reduction=reduction)
    ref = ref.view(t.shape) if reduction == "none" else ref
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(1))
    assert got.shape == ref.shape and got.dtype == torch.float64
    assert_matches(got, ref, 1e-12, f"{reduction} loss")
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert_matches(g, r, 1e-12, f"{reduction} d{name}")
    if reduction == "none":
        assert (got[t == -100] == 0).all()


@pytest.mark.parametrize("smoothing", [0.1, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_matches_f_cross_entropy(reduction, smoothing):
    """``label_smoothing`` as ``F.cross_entropy``'s: losses and the gradients of x, weight and bias (fp64, exact to
    rounding), with ignored rows and slices that do not divide V; its term is formed in closed form, outside the
    slices."""
    x, t, w, b = _inputs()
    got = linear_cross_entropy(x, t, w, b, reduction=reduction, label_smoothing=smoothing, vocab_chunk_size=7)
    ref = F.cross_entropy(F.linear(x, w, b).flatten(0, 1), t.flatten(), reduction=reduction,
                          label_smoothing=smoothing)
    ref = ref.view(t.shape) if reduction == "none" else ref
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(1))
    assert_matches(got, ref, 1e-12, f"{reduction} loss")
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert_matches(g, r, 1e-12, f"{reduction} d{name}")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_logit_scale_matches_scaled_logits(smoothing):
    """``logit_scale`` (fla's argument) scales the logits, bias included, with and without label smoothing: losses
    and the gradients of x, weight and bias equal ``F.cross_entropy`` of the scaled logits (fp64)."""
    x, t, w, b = _inputs()
    got = linear_cross_entropy(x, t, w, b, reduction="none", label_smoothing=smoothing, logit_scale=0.37,
                               vocab_chunk_size=7)
    ref = F.cross_entropy(0.37 * F.linear(x, w, b).flatten(0, 1), t.flatten(), reduction="none",
                          label_smoothing=smoothing).view(t.shape)
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(2))
    assert_matches(got, ref, 1e-12, "loss")
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert_matches(g, r, 1e-12, f"d{name}")


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_logit_softcapping_matches_capped_logits(smoothing):
    """``logit_softcapping`` c (fla's argument): the logits c tanh(z / c) after ``logit_scale``, with and without
    label smoothing (whose term then sums the capped logits slice by slice): losses and the gradients of x, weight
    and bias equal ``F.cross_entropy`` of the capped logits (fp64), with logits well past the cap (|z| up to ~20
    against c = 2)."""
    x, t, w, b = _inputs()
    x = (x * 4).detach().requires_grad_()
    got = linear_cross_entropy(x, t, w, b, reduction="none", label_smoothing=smoothing, logit_scale=1.3,
                               logit_softcapping=2.0, vocab_chunk_size=7)
    z = 1.3 * F.linear(x, w, b).flatten(0, 1)
    assert z.abs().max() > 10
    ref = F.cross_entropy(2.0 * torch.tanh(z / 2.0), t.flatten(), reduction="none",
                          label_smoothing=smoothing).view(t.shape)
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(3))
    assert_matches(got, ref, 1e-12, "loss")
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert_matches(g, r, 1e-12, f"d{name}")


def test_gradcheck():
    x, t, w, b = _inputs(shape=(2, 5), D=4, V=6)
    t[0, 0] = -100
    assert torch.autograd.gradcheck(lambda x, w, b: linear_cross_entropy(x, t, w, b, reduction="none",
                                                                       vocab_chunk_size=4),
                                    (x, w, b))


def test_every_row_ignored():
    """As F.cross_entropy: the mean is NaN (0 / 0), the sum 0, and no gradient reaches anything."""
    x, t, w, b = _inputs(shape=(4,))
    t[:] = -100
    assert torch.isnan(linear_cross_entropy(x, t, w, b)) and torch.isnan(F.cross_entropy(F.linear(x, w, b), t))
    total = linear_cross_entropy(x, t, w, b, reduction="sum")
    assert total.item() == 0
    assert all((g == 0).all() for g in torch.autograd.grad(total, (x, w, b)))


def test_bf16_autocast_rounds_as_the_logits_path():
    """Under bf16 autocast the products run in bf16, as the head's F.linear does there: the losses agree to the
    fp32 softmax's rounding (the products of a row are the same), the gradients to one unit of bf16's rounding,
    2^-8 (both round the weight's gradient to bf16 once; x's is summed over the slices here in fp32)."""
    x, t, w, b = _inputs(shape=(300,), D=64, V=500, dtype=torch.float32, seed=3)
    weights = torch.rand(300, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(x, t, w, b, reduction="none", vocab_chunk_size=64)
        ref = F.cross_entropy(F.linear(x, w, b).float(), t, reduction="none")
    assert got.dtype == torch.float32
    assert_matches(got, ref, 1e-5, "bf16 losses")
    exact = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), t, reduction="none")
    assert rel_rms(got, exact) > 1e-4, "the products were not in bf16"
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert g.dtype == torch.float32
        assert_matches(g, r, 2 ** -8, f"bf16 d{name}")


def _saved_numel(fn) -> int:
    """The largest tensor autograd keeps for the backward of fn()."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_keeps_no_logits_for_the_backward():
    """Nothing of N x V elements is kept for the backward (the logits path keeps the logits: the check can fail)."""
    x, t, w, b = _inputs(shape=(200,), D=16, V=300)
    N, V = 200, 300
    assert _saved_numel(lambda: F.cross_entropy(F.linear(x, w, b), t)) >= N * V
    assert _saved_numel(lambda: linear_cross_entropy(x, t, w, b, vocab_chunk_size=50)) < N * V / 4


def test_default_vocab_chunk_size():
    """A slice's logits within 2^26 entries (or the budget given), at least 256 wide, evened out over V in
    multiples of 8, at most V."""
    assert default_vocab_chunk_size(8192, 32000) == 8000  # 4 slices, not 3 of 8,192 and one of 7,424
    assert default_vocab_chunk_size(16384, 32000) == 4000
    assert default_vocab_chunk_size(16384, 128256) == 4008  # 32 slices, the last 3,976 wide
    assert default_vocab_chunk_size(1 << 20, 32000) == 256
    assert default_vocab_chunk_size(100, 32000) == 32000
    assert default_vocab_chunk_size(4096, 5) == 5
    assert default_vocab_chunk_size(8192, 32000, 1 << 23) == 1000
    assert default_vocab_chunk_size(2048, 32000, 1 << 23) == 4000


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_kernels_match_the_pytorch_slices(monkeypatch, reduction, autocast, smoothing, softcap):
    """The slices' softmax statistics and gradient in Triton (on the CPU under the interpreter) against the same
    function's PyTorch form and the logits path: losses and the gradients of x, weight and bias, fp32 and under bf16
    autocast, slices that do not divide V = 45, rows narrower than a slice's width (the kernels' column loop, with
    its block held to 8), targets on the slices' edges, and ``ignore_index = 3``, a class index, so that a row
    holding it has no loss and no gradient while class 3 is an ordinary column elsewhere; with and without label
    smoothing (its term is outside the kernels, so both paths take it the same way), and soft-capped logits (then
    the kernels take the cap, its derivative and the smoothing's share of the gradient, and sum the capped
    logits)."""
    from rankdecay.ops.triton import cross_entropy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, t, w, b = _inputs(shape=(2, 19), D=16, V=45, dtype=torch.float32, seed=5)
    t.view(-1)[:6] = torch.tensor([0, 19, 20, 39, 40, 44])  # first and last entries of the slices of 20
    t[t == -100] = 3  # rows 6-8 and 20
    x, t, w, b = (u.detach().to(device).requires_grad_(u.requires_grad) for u in (x, t, w, b))
    weights = torch.rand(t.shape, generator=torch.Generator().manual_seed(6)).to(device)

    def run(kernels):
        monkeypatch.setattr(loss_module, "_triton_kernels", lambda x, dtype: kernels)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            got = linear_cross_entropy(x, t, w, b, ignore_index=3, reduction=reduction, vocab_chunk_size=20,
                                       label_smoothing=smoothing, logit_softcapping=softcap)
        return got, _grads(got, (x, w, b), weights if reduction == "none" else 1.0)

    monkeypatch.setattr(cross_entropy, "MAX_BLOCK", 8)
    (got, grads), (ref, ref_grads) = run(True), run(False)
    # bf16: the gradient over the logits, rounded to bf16, may differ by a unit of bf16's rounding: 2^-8 to nearest
    # (a GPU's); Triton's interpreter rounds toward zero whatever the cast asks, a unit of 2^-7
    tol = (2 ** -7 if os.environ.get("TRITON_INTERPRET") == "1" else 2 ** -8) if autocast else 1e-6
    assert_matches(got, ref, 1e-6, "losses")
    for name, g, r in zip("xwb", grads, ref_grads):
        assert_matches(g, r, tol, f"d{name}")
    if reduction == "none":
        assert (got.view(-1)[[6, 7, 8, 20]] == 0).all() and (got.view(-1)[:6] > 0).all()
    if not autocast:
        z = F.linear(x, w, b).flatten(0, 1)
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        plain = F.cross_entropy(z, t.flatten(), ignore_index=3, reduction=reduction, label_smoothing=smoothing)
        assert_matches(got, plain.view(got.shape), 1e-6, "losses against the logits path")


@pytest.mark.parametrize("call,error,match", [
    (lambda x, t, w, b: linear_cross_entropy(x, t, w[:, :3], b), ValueError, "weight must be \\[V, D\\] with D = 16"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b[:3]), ValueError, "bias must be \\[V\\]"),
    (lambda x, t, w, b: linear_cross_entropy(x, t.float(), w, b), ValueError, "target must be an integer tensor"),
    (lambda x, t, w, b: linear_cross_entropy(x, t[:, :3], w, b), ValueError, "target must be an integer tensor"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b, reduction="avg"), ValueError, "reduction must be one of"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b, label_smoothing=1.5), ValueError,
     "label_smoothing must be a number in \\[0, 1\\]"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b, vocab_chunk_size=0), ValueError,
     "vocab_chunk_size must be a positive"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b, logit_scale=0.0), ValueError,
     "logit_scale must be a finite number > 0; got 0.0"),
    (lambda x, t, w, b: linear_cross_entropy(x, t, w, b, logit_softcapping=-1.0), ValueError,
     "logit_softcapping must be None or a finite number > 0; got -1.0"),
    (lambda x, t, w, b: linear_cross_entropy(x.long(), t, w, b), TypeError, "x must be a floating-point tensor"),
    (lambda x, t, w, b: linear_cross_entropy(x, t.clamp_min(0) + 29, w, b), ValueError, "outside \\[0, 29\\)"),
])
def test_bad_input_is_refused_clearly(call, error, match):
    x, t, w, b = _inputs()
    with pytest.raises(error, match=match):
        call(x, t, w, b)


@pytest.mark.parametrize("mixer", ["gdn", "hdla"])
def test_model_with_fused_loss_trains_as_without(mixer):
    """``fuse_linear_cross_entropy``: in training the model returns no logits, and its loss (mean, sum and per
    token) and every parameter's gradient equal the logits path's; in eval mode it returns logits as before."""
    ids = random_ids(2, 21, vocab=264)
    labels = ids.clone()
    labels[0, :4] = -100
    plain, fused = tiny_model(mixer).train(), tiny_model(mixer, fuse_linear_cross_entropy=True).train()
    for reduction in ("mean", "sum", "none"):
        out_p = plain(input_ids=ids, labels=labels, use_cache=False, loss_reduction=reduction)
        out_f = fused(input_ids=ids, labels=labels, use_cache=False, loss_reduction=reduction)
        assert out_f.logits is None and out_p.logits is not None
        assert out_f.loss.shape == out_p.loss.shape == ((2, 20) if reduction == "none" else ())
        assert_matches(out_f.loss, out_p.loss, 1e-6, f"{mixer} {reduction} loss")
    out_p.loss.sum().backward()
    out_f.loss.sum().backward()
    grads = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        assert_matches(p.grad, grads[name].grad, 1e-5, f"{mixer} d{name}")
    fused.eval()
    assert fused(input_ids=ids, labels=labels, use_cache=False).logits is not None
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        fused(input_ids=ids, labels=labels, loss_reduction="avg")


def test_trainer_losses_with_the_fused_loss():
    """``token_losses`` (the trainer's per-token losses) asks the model for them: with the fused loss in training
    they equal the logits path's, ignored targets 0, and ``return_logits`` still gets logits."""
    from rankdecay.train.data import make_batch
    from rankdecay.train.trainer import token_losses

    tokens = random_ids(2, 33, vocab=256).numpy()
    batch = make_batch(tokens, "varlen", 257, "cpu")
    plain, fused = tiny_model().train(), tiny_model(fuse_linear_cross_entropy=True).train()
    (lp, vp), (lf, vf) = token_losses(plain, batch, None), token_losses(fused, batch, None)
    assert torch.equal(vp, vf) and not vf.all() and (lf[~vf] == 0).all()
    assert_matches(lf, lp, 1e-6, "per-token losses")
    *_, logits = token_losses(fused, batch, None, return_logits=True)
    assert logits.shape == (1, 65, 264)


@pytest.mark.slow
def test_rankdecay_train_with_the_fused_loss(tmp_path):
    """``rankdecay train --set fuse_linear_cross_entropy=true`` trains to the same weights as without (3 steps), in
    one process and sharded with FSDP2 over two (the head's weight tied to the embeddings, so both uses' gradients
    meet in one sharded parameter)."""
    from rankdecay.cli import main
    from rankdecay.models import RankDecayForCausalLM
    from tests.train.test_config_data import write_docs
    from tests.train.test_trainer import SMALL, torchrun

    docs = write_docs(tmp_path / "docs", n=40, size=300)
    common = ["train", "--data", str(docs), *SMALL, "--steps", "3", "--eval-every", "0"]
    models = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        assert main(common + ["--out-dir", str(out), "--set", f"fuse_linear_cross_entropy={flag}"]) == 0
        models[flag] = RankDecayForCausalLM.from_pretrained(out)
    torchrun(common + ["--out-dir", str(tmp_path / "fsdp"), "--fsdp", "--set", "fuse_linear_cross_entropy=true"])
    models["fsdp"] = RankDecayForCausalLM.from_pretrained(tmp_path / "fsdp")
    assert models["true"].config.fuse_linear_cross_entropy and not models["false"].config.fuse_linear_cross_entropy
    assert models["true"].config.tie_word_embeddings
    plain = dict(models["false"].named_parameters())
    for run in ("true", "fsdp"):
        for name, p in models[run].named_parameters():
            assert_matches(p, plain[name], 1e-5, f"{run}: {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU memory needs a CUDA GPU (its run: BENCHMARKS.md, session 69)")
def test_gpu_bf16_values_and_peak_memory():
    """On a GPU under bf16 autocast, at a 340m model's head (8,192 tokens, D 1024, V 32,000): the losses as the
    logits path's to the fp32 softmax's rounding, the gradients to one unit of bf16's, 2^-8, and the peak memory
    the loss adds at most a quarter of the logits path's (which holds 0.5 GiB of bf16 logits, 1 GiB in fp32 and
    their gradient)."""
    torch.manual_seed(0)
    N, D, V = 8192, 1024, 32000
    x = torch.randn(N, D, device="cuda", requires_grad=True)
    w = (torch.randn(V, D, device="cuda") * D ** -0.5).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")

    def run(fused):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(x, t, w) if fused else F.cross_entropy(F.linear(x, w).float(), t)
        gx, gw = torch.autograd.grad(loss, (x, w))
        torch.cuda.synchronize()
        return loss.detach(), gx, gw, torch.cuda.max_memory_allocated() - base - gx.numel() * 4 - gw.numel() * 4

    *ref, peak_ref = run(False)
    *got, peak = run(True)
    assert_matches(got[0], ref[0], 1e-5, "loss")
    for name, g, r in zip(("dx", "dw"), got[1:], ref[1:]):
        assert_matches(g, r, 2 ** -8, name)
    assert peak < peak_ref / 4, f"{peak / 2 ** 20:.0f} MiB against the logits path's {peak_ref / 2 ** 20:.0f}"


@pytest.mark.skipif(not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
def test_traces_under_torch_compile_fullgraph(monkeypatch):
    """``torch.compile(fullgraph=True)`` takes it whole (no graph break) as two opaque operators, which run the eager
    slices at every call (so on a GPU its kernels, not inductor's fusion of a traced softmax), with the losses and
    gradients of the eager call; and a compiled model's fused loss (fullgraph) equals the eager one."""
    import torch._dynamo

    from rankdecay.layers import loss as loss_module

    torch._dynamo.reset()
    calls = []
    slices = loss_module._slice_logits
    monkeypatch.setattr(loss_module, "_slice_logits", lambda *a: calls.append(a[-2]) or slices(*a))
    x, t, w, b = _inputs(shape=(3, 37), dtype=torch.float32)
    compiled = torch.compile(lambda x, t, w, b: linear_cross_entropy(x, t, w, b, reduction="none",
                                                                   vocab_chunk_size=8), fullgraph=True)
    compiled(x, t, w, b)  # (compiles: the operators' fake forms run, not the slices)
    calls.clear()
    got, ref = compiled(x, t, w, b), linear_cross_entropy(x, t, w, b, reduction="none", vocab_chunk_size=8)
    V = w.shape[0]
    assert calls == 2 * list(range(0, V, 8)), "the compiled call did not run the eager slices"
    weights = torch.rand(t.shape, generator=torch.Generator().manual_seed(4))
    assert_matches(got, ref, 1e-6, "compiled losses")
    for name, g, r in zip("xwb", _grads(got, (x, w, b), weights), _grads(ref, (x, w, b), weights)):
        assert_matches(g, r, 1e-6, f"compiled d{name}")
    model = tiny_model(fuse_linear_cross_entropy=True).train()
    ids = random_ids(2, 21, vocab=264)
    loss = torch.compile(lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss, fullgraph=True)(ids)
    assert_matches(loss, model(input_ids=ids, labels=ids, use_cache=False).loss, 1e-6, "compiled model loss")
