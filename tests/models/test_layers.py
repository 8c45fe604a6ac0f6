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
])
def test_bad_layer_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_attention_mask_shape_is_checked():
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\]"):
        GatedDeltaNet(D, H)(torch.randn(2, 5, D), torch.ones(2, 4))


@pytest.mark.parametrize("groups", [None, 2])
def test_short_convolution_steps_equal_the_full_sequence(groups):
    """One call over T equals T single-token steps carrying the state (the decode path), and a
    one-token sequence packed with cu_seqlens starts fresh whatever state is passed."""
    conv = ShortConvolution(8, 4, groups=groups)
    x = torch.randn(3, 11, 8)
    full, last = conv(x)
    state, steps = None, []
    for t in range(11):
        y, state = conv(x[:, t:t + 1], state)
        steps.append(y)
    assert_matches(torch.cat(steps, 1), full, 1e-6)
    assert_matches(state, last, 1e-7)
    y, _ = conv(x[:, :1], torch.randn(3, 8, 3), starts=torch.zeros(1, dtype=torch.long))
    assert_matches(y, conv(x[:, :1])[0], 1e-7, "a packed sequence's first token")


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
