"""The mixers as layers: Head-in-Head against its base, masks, padding, bad arguments."""
import pytest
import torch

from rankdecay.layers import KDA, DeltaNet, GatedDeltaNet, HeadInHead, SlidingWindowAttention
from rankdecay.layers.modules import GatedRMSNorm, RMSNorm, ShortConvolution

from ..conftest import assert_matches

D, H = 48, 2


def _copy_base_weights(base, hh):
    missing, unexpected = hh.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("mask_") for name in missing), (missing, unexpected)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("mask", ["static", "data"])
def test_head_in_head_rank_one_is_its_base(gated, mask):
    base = (GatedDeltaNet if gated else DeltaNet)(D, H, chunk_size=8)
    hh = HeadInHead(D, H, rank=1, mask=mask, gated=gated, chunk_size=8)
    _copy_base_weights(base, hh)
    with torch.no_grad():  # any M_org: with r = 1 the normalised mask is exactly 1
        for p in (hh.mask_org,) if mask == "static" else hh.mask_proj.parameters():
            p.normal_(0, 3)
    x = torch.randn(2, 29, D)
    assert torch.equal(hh(x)[0], base(x)[0])


@pytest.mark.parametrize("mask", ["static", "data"])
def test_head_in_head_starts_as_its_rank_one_baseline(mask):
    base = GatedDeltaNet(D, H, chunk_size=8)
    hh = HeadInHead(D, H, rank=4, mask=mask, chunk_size=8)
    _copy_base_weights(base, hh)
    x = torch.randn(2, 29, D)
    assert_matches(hh(x)[0], base(x)[0], 1e-6)


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("mask", ["static", "data"])
def test_head_in_head_transitions_have_bounded_eigenvalues(neg, mask):
    """I − β (k kᵀ ⊙ M) with the layer's own M and β: eigenvalues in [0, 1] (β ≤ 1) or [−1, 1] (β ≤ 2)."""
    torch.manual_seed(1)
    hh = HeadInHead(D, H, rank=4, mask=mask, allow_neg_eigval=neg)
    with torch.no_grad():
        for p in (hh.mask_org,) if mask == "static" else hh.mask_proj.parameters():
            p.normal_(0, 3)
        hh.b_proj.weight.normal_(0, 3)  # push β to its extremes
    x = torch.randn(1, 64, D)
    gates = hh.gates(x, None)
    M = gates["mask"].expand(1, 64, H, 4, 4) if mask == "static" else gates["mask"]
    M = M.double().repeat_interleave(6, -1).repeat_interleave(6, -2)  # expand to [.., K, K]; K / r = 6
    k = torch.nn.functional.normalize(torch.randn(1, 64, H, 24, dtype=torch.float64), dim=-1)
    beta = gates["beta"].double()
    assert beta.max() > (1.5 if neg else 0.9), "the test should reach large β"
    A = torch.eye(24, dtype=torch.float64) - beta[..., None, None] * (k[..., :, None] * k[..., None, :]) * M
    eig = torch.linalg.eigvalsh(A)  # A is symmetric: M is PSD, so k kᵀ ⊙ M is too (Schur)
    lo = -1.0 if neg else 0.0
    tol = 1e-6  # M and β come from the layer in fp32
    assert eig.min() >= lo - tol and eig.max() <= 1 + tol, (eig.min().item(), eig.max().item())
    if neg:
        assert eig.min() < -0.3, "β near 2 should give negative eigenvalues"


def test_padding_positions_are_identity_steps():
    layer = GatedDeltaNet(D, H)
    x = torch.randn(1, 10, D)
    padded = torch.cat([torch.randn(1, 3, D), x], 1)
    mask = torch.tensor([[0] * 3 + [1] * 10])
    assert_matches(layer(padded, mask)[0][:, 3:], layer(x)[0], 1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda: HeadInHead(D, H, rank=5), "rank r = 5 must be a positive int dividing head_k_dim = 24"),
    (lambda: HeadInHead(D, H, rank=2, mask="learned"), "mask must be 'static' or 'data'"),
    (lambda: GatedDeltaNet(50, 3), "hidden_size 50 is not divisible by num_heads 3"),
    (lambda: GatedDeltaNet(D, H, mode="parallel"), "mode must be 'chunk' or 'recurrent'"),
    (lambda: GatedDeltaNet(D, 0), "num_heads must be a positive int"),
    (lambda: GatedDeltaNet(D, H, gate_act="tanh"), "gate_act must be 'silu', 'sigmoid' or None, got 'tanh'"),
    (lambda: GatedDeltaNet(D, H, output_gate_rank=0), "output_gate_rank must be None or a positive int, got 0"),
    (lambda: KDA(D, H, gate_lower_bound=0.5), "gate_lower_bound must be None or a negative number, got 0.5"),
    (lambda: GatedDeltaNet(D, H, num_v_heads=3), "num_v_heads must be a multiple of num_heads = 2, got 3"),
    (lambda: DeltaNet(D, H, num_v_heads=1), "num_v_heads must be a multiple of num_heads = 2, got 1"),
    (lambda: KDA(D, H, num_v_heads=4), "num_v_heads = 4: KDA has no grouped value heads"),
    (lambda: HeadInHead(D, H, num_v_heads=4), "num_v_heads = 4: HeadInHead has no grouped value heads"),
    (lambda: SlidingWindowAttention(D, H, window_size=0), "window_size must be a positive int"),
    (lambda: SlidingWindowAttention(D, 16), "head_dim must be even"),
    (lambda: SlidingWindowAttention(D, 4, num_kv_heads=3), "num_kv_heads must be a positive divisor of num_heads = 4"),
    (lambda: SlidingWindowAttention(D, 4, window_size=True), "window_size must be a positive int or None"),
])
def test_bad_layer_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_attention_mask_shape_is_checked():
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\]"):
        GatedDeltaNet(D, H)(torch.randn(2, 5, D), torch.ones(2, 4))


@pytest.mark.parametrize("groups", [None, 2])
def test_short_convolution_steps_equal_the_full_sequence(groups):
    """One call over T equals T single-token steps carrying the state (the decode path)."""
    conv = ShortConvolution(8, 4, groups=groups)
    x = torch.randn(3, 11, 8)
    full, last = conv(x)
    state, steps = None, []
    for t in range(11):
        y, state = conv(x[:, t:t + 1], state)
        steps.append(y)
    assert_matches(torch.cat(steps, 1), full, 1e-6)
    assert_matches(state, last, 1e-7)
    assert conv(x, output_final_state=False)[1] is None


@pytest.mark.parametrize("lengths", [[5, 0, 1, 2, 9], [0, 0]], ids=["mixed", "no-tokens"])
@pytest.mark.parametrize("with_state", [False, True], ids=["from-zeros", "from-states"])
@pytest.mark.parametrize("groups", [None, 2])
def test_short_convolution_packed_sequences_equal_each_alone(groups, with_state, lengths):
    """Sequences packed along T (cu_seqlens; lengths 5, 0, 1, 2, 9: an empty one and two shorter than the 3 past
    inputs the state holds; or T = 0, every sequence empty): outputs, final states ([N, D, 3], each its own
    sequence's last inputs, topped up from its initial state where it is shorter) and the gradients of x, the
    states and the filters are those of each sequence alone."""
    torch.manual_seed(0)
    conv = ShortConvolution(8, 4, groups=groups)
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = torch.randn(1, sum(lengths), 8, requires_grad=True)
    states = torch.randn(len(lengths), 8, 3, requires_grad=True) if with_state else None
    y, final = conv(x, states, cu)
    weights = torch.randn_like(y), torch.randn_like(final)
    grads = torch.autograd.grad((y * weights[0]).sum() + (final * weights[1]).sum(),
                                [x, conv.weight] + ([states] if with_state else []),
                                allow_unused=True, materialize_grads=True)  # T = 0: x is not read
    ys, finals, loss = [], [], 0
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        yn, fn = conv(x[:, a:b], states[n:n + 1] if with_state else None)
        ys.append(yn)
        finals.append(fn)
        loss = loss + (yn * weights[0][:, a:b]).sum() + (fn * weights[1][n:n + 1]).sum()
    ref = torch.autograd.grad(loss, [x, conv.weight] + ([states] if with_state else []))
    assert_matches(y, torch.cat(ys, 1), 1e-6, "outputs")
    assert_matches(final, torch.cat(finals), 1e-7, "final states")
    for name, got, want in zip(("x", "filters", "states"), grads, ref):
        assert_matches(got, want, 1e-6, f"gradient of {name}")
    if with_state and y.shape[1]:  # the states are read: the first tokens differ from a start from zeros
        assert not torch.allclose(y[:, :3], conv(x[:, :3])[0])


def test_short_convolution_checks_its_arguments():
    conv = ShortConvolution(8, 4)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=r"state must have shape \[2, 8, 3\] \(N = 2 sequences\)"):
        conv(torch.randn(1, 5, 8), torch.zeros(1, 8, 3), cu)
    with pytest.raises(ValueError, match=r"with cu_seqlens, sequences are packed along T and B must be 1, got B = 2"):
        conv(torch.randn(2, 5, 8), None, cu)
    with pytest.raises(TypeError, match=r"cu_seqlens must be an int32 or int64 tensor"):
        conv(torch.randn(1, 5, 8), None, cu.float())
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, 8\]"):
        conv(torch.randn(1, 5, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_compute_the_formula_in_fp32(dtype):
    """RMSNorm: x / sqrt(mean(x²) + eps) * w, computed in fp32 and returned in x's dtype; the
    gated one multiplies by SiLU(gate)."""
    norm = GatedRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, gate = 3 * torch.randn(5, 24).to(dtype), torch.randn(5, 24).to(dtype)
    xd = x.double()
    ref = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight.double()
    plain = RMSNorm.forward(norm, x)
    assert plain.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_matches(plain.double(), ref, tol, "RMSNorm")
    assert_matches(norm(x, gate).double(), ref * torch.nn.functional.silu(gate.double()), 2 * tol, "gated")


def test_hdla_gate_logit_normalizer_divides_the_log_decay():
    from rankdecay.layers import HDLA
    from rankdecay.models import RankDecayConfig, RankDecayForCausalLM

    plain, slow = HDLA(D, H, gate_logit_normalizer=1), HDLA(D, H)  # eq. 6 as written; the default, GLA's 16
    slow.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        g1, g16 = plain.gates(x, None)["g"], slow.gates(x, None)["g"]
    assert torch.allclose(g16 * 16, g1) and bool((g1 < 0).all())
    assert float(g1.exp().mean()) < 0.6 < 0.9 < float(g16.exp().mean()), "tau = 16: lambda starts near 0.96"
    with pytest.raises(ValueError, match="gate_logit_normalizer"):
        HDLA(D, H, gate_logit_normalizer=0)
    cfg = RankDecayConfig(vocab_size=16, hidden_size=D, num_hidden_layers=1, num_heads=H, mixer="hdla",
                          gate_logit_normalizer=1)
    assert RankDecayForCausalLM(cfg).model.layers[0].mixer.gate_logit_normalizer == 1
    cfg.mixer, cfg.gate_logit_normalizer = "gla", 8.0  # GLA's default is 16
    assert RankDecayForCausalLM(cfg).model.layers[0].mixer.gate_logit_normalizer == 8


def test_hdla_saved_before_the_normalizer_keeps_its_decay(tmp_path):
    import json

    from rankdecay.models import RankDecayConfig, RankDecayForCausalLM

    cfg = RankDecayConfig(vocab_size=16, hidden_size=D, num_hidden_layers=1, num_heads=H, mixer="hdla")
    RankDecayForCausalLM(cfg).save_pretrained(tmp_path)
    assert RankDecayForCausalLM.from_pretrained(tmp_path).model.layers[0].mixer.gate_logit_normalizer == 16
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["gate_logit_normalizer"]  # a config.json written before the option existed
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert RankDecayForCausalLM.from_pretrained(tmp_path).model.layers[0].mixer.gate_logit_normalizer == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention over packed sequences needs a CUDA GPU "
                    "(the GPU run is in BENCHMARKS.md)")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "rows"])
@pytest.mark.parametrize("kind", ["window", "grouped-full"])
def test_sliding_window_attention_takes_flash_varlen_on_a_gpu(monkeypatch, packed, kind):
    """bf16 on a GPU: packed documents, or rows (training, a prompt: no cache to read, no padding) take PyTorch's
    flash attention for packed sequences with the window (no [T, T] mask), also under
    torch.compile(fullgraph=True); outputs and the gradients of x are within bf16's error of the fp32 masked path's,
    as close as the bf16 masked path's. Also full attention with 4 query heads over 2 key/value heads."""
    from rankdecay.layers import attention

    calls = []
    flash = attention._varlen_attn
    monkeypatch.setattr(attention, "_varlen_attn", lambda *a, **kw: calls.append(kw["window_size"]) or flash(*a, **kw))
    torch.manual_seed(0)
    layer = SlidingWindowAttention(256, 4, window_size=128) if kind == "window" else SlidingWindowAttention(
        256, 4, window_size=None, num_kv_heads=2, qkv_bias=True, qk_norm=True)
    layer = layer.cuda()
    lengths = [300, 1, 1000, 45, 130]
    cu = torch.tensor([0] + lengths).cumsum(0).cuda() if packed else None
    x = torch.randn(1, sum(lengths), 256, device="cuda") if packed else torch.randn(3, 500, 256, device="cuda")

    def run(module, dtype, compiled=False):
        xi = x.detach().to(dtype).requires_grad_()
        fn = torch.compile(module, backend="eager", fullgraph=True) if compiled else module
        o, _ = fn(xi, cu_seqlens=cu)
        (o.float() * torch.linspace(-1, 1, o.shape[-1], device="cuda")).sum().backward()
        return o.float(), xi.grad.float()

    ref = run(layer, torch.float32)
    assert not calls, "fp32 takes the masked path"
    half = layer.to(torch.bfloat16)
    flash_out = run(half, torch.bfloat16)
    assert calls == [(127, 0) if kind == "window" else (-1, 0)], calls
    compiled = run(half, torch.bfloat16, compiled=True)
    assert len(calls) > 1, "the compiled layer took it too"
    monkeypatch.setattr(attention, "_flash_varlen", lambda q: False)
    masked = run(half, torch.bfloat16)
    for got, name in ((flash_out, "flash"), (compiled, "compiled flash")):
        for a, b, want, part in zip(got, masked, ref, ("output", "grad x")):
            err = ((a - want).norm() / want.norm()).item()
            bound = ((b - want).norm() / want.norm()).item()
            assert err <= 1.5 * bound + 1e-3, f"{name} {part}: {err:.2e} against the masked path's {bound:.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_sliding_window_attention_in_blocks_of_queries_equals_one_block(monkeypatch, packed):
    """A long input takes the masked path in blocks of queries, each over the cache's keys and the tokens' keys in
    its window (masks of block x (lead + block + window - 1), not T x (lead + T)): the outputs, the cache it leaves
    and the gradients of x and of the prompt before it (through the cached keys) are those of one block over every
    key; after a cache with padding, over left-padded rows, over packed sequences of a packed prompt's cache."""
    from rankdecay.layers import attention
    from rankdecay.layers.cache import Cache

    torch.manual_seed(0)
    W, block = 3, 4
    layer = SlidingWindowAttention(16, 2, window_size=W)
    first_cu, cu = torch.tensor([0, 3, 4, 8, 10]), torch.tensor([0, 2, 19, 20, 29])
    x0 = torch.randn(1, 10, 16) if packed else torch.randn(2, 4, 16)
    x = torch.randn(1, 29, 16) if packed else torch.randn(2, 21, 16)
    mask0 = None if packed else torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    padded = torch.ones(2, 21, dtype=torch.long)
    padded[1, :5] = 0
    sdpa, masks = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(*args, attn_mask, **kwargs):
        masks.append(tuple(attn_mask.shape[-2:]))
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recorded)

    def run(query_block):
        monkeypatch.setattr(attention, "_QUERY_BLOCK", query_block)
        a, b = x0.clone().requires_grad_(), x.clone().requires_grad_()
        cache = Cache(1)
        layer(a, mask0, cache=cache, use_cache=True, cu_seqlens=first_cu if packed else None)
        lead = cache.layers[0]["k"].shape[:2].numel() if packed else cache.layers[0]["k"].shape[1]
        masks.clear()
        o, cache = layer(b, None, cache=cache, use_cache=True, cu_seqlens=cu if packed else None)
        got = {"output": o, "masks": list(masks), **{f"cached {name}": z for name, z in cache.layers[0].items()}}
        if not packed:  # no cache: left-padded rows
            got["padded output"] = layer(b, padded)[0]
        loss = sum((got[name] * torch.randn(got[name].shape, generator=torch.Generator().manual_seed(i))).sum()
                   for i, name in enumerate(("output", "cached k", "cached v", "padded output")) if name in got)
        got["grad x0"], got["grad x"] = torch.autograd.grad(loss, [a, b])
        return got, lead

    one, lead = run(10 ** 6)
    blocked, _ = run(block)
    T = x.shape[1]
    assert one["masks"] == [(T, lead + T)], one["masks"]
    assert len(blocked["masks"]) == -(-T // block) and all(
        rows <= block and cols <= lead + block + W - 1 for rows, cols in blocked["masks"]), blocked["masks"]
    for name in one:
        if name != "masks":
            assert_matches(blocked[name], one[name], 1e-6, name)


def test_sliding_window_ring_cache_of_fewer_slots_than_the_window():
    """``ring_cache(entry, slots)``: the entry's last ``slots - 1`` keys after padding slots, the free slot last;
    slots checked (1 to the window); a window of 1 keeps a ring of one free slot. Steps on a ring of 6 slots then
    attend as on the window's ring while the tokens fit."""
    from rankdecay.layers import Cache

    torch.manual_seed(0)
    layer = SlidingWindowAttention(16, 2, 8, window_size=12).eval()
    x, steps = torch.randn(2, 3, 16), torch.randn(3, 2, 1, 16)
    with torch.no_grad():
        _, cache = layer(x, cache=Cache(1), use_cache=True)
        entry = cache.layers[0]
        padded = {**entry, **{n: torch.cat([torch.zeros_like(entry[n][:, :4]), entry[n]], 1) for n in ("k", "v")},
                  "real": torch.cat([torch.zeros_like(entry["real"][:, :4]), entry["real"]], 1)}
        ring = layer.ring_cache(padded, 6)  # 7 columns, the first 4 padding: the last 5 kept
        assert ring["k"].shape[1] == 6 and torch.equal(ring["k"][:, 2:5], entry["k"])
        assert ring["real"].tolist() == [[False, False, True, True, True, False]] * 2
        assert ring["next"].tolist() == [5, 5]
        outs = {}
        for slots in (12, 6):
            c = Cache(1)
            c.layers = [layer.ring_cache(entry, slots)]
            outs[slots] = torch.cat([layer(s, cache=c, use_cache=True)[0] for s in steps], 1)
            assert c.layers[0]["k"].shape[1] == slots
        assert_matches(outs[6], outs[12], 1e-6, "steps on a ring of 6")
    for bad in (0, 13, True, 2.0):
        with pytest.raises(ValueError, match="slots must be an int from 1 to window_size = 12"):
            layer.ring_cache(entry, bad)
    one = SlidingWindowAttention(16, 2, 8, window_size=1)
    with torch.no_grad():
        _, cache = one(x, cache=Cache(1), use_cache=True)
    assert one.ring_cache(cache.layers[0])["k"].shape[1] == 1
