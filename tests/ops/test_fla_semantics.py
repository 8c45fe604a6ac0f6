"""Switching from fla: each of the README's "Switching from fla" rows against flash-linear-attention's own reference
(its ``naive`` recurrences, plain PyTorch: fla 0.6.0, in the test extra), outputs and final states, so that the
table's mapping (names, argument order, layouts, the sign of fla's DPLR term, fla's retention decays) is what a
user gets."""
import pytest
import torch
import torch.nn.functional as F

from rankdecay import ops

from ..conftest import rel_rms

pytest.importorskip("fla.ops", reason="flash-linear-attention is in the test extra")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, K, V = 2, 13, 3, 8, 6  # T not a multiple of any chunk size


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _qkv():
    q, k, v = _rand(B, T, H, K, seed=1), F.normalize(_rand(B, T, H, K, seed=2), dim=-1), _rand(B, T, H, V, seed=3)
    return q, k, v, _rand(B, H, K, V, seed=4)


def _same(ours, ref, what):
    (o, s), (o_ref, s_ref) = ours, ref
    assert rel_rms(o, o_ref) < 1e-5, (what, "o", rel_rms(o, o_ref))
    if s_ref is not None:
        assert rel_rms(s, s_ref) < 1e-5, (what, "final state", rel_rms(s, s_ref))


def _head_first(*xs):
    return [x.transpose(1, 2).contiguous() for x in xs]


def test_linear_attn_is_fla_without_its_normaliser():
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    q, k, v, h0 = _qkv()
    ref = naive_recurrent_linear_attn(q, k, v, initial_state=h0, output_final_state=True, normalize=False)
    _same(ops.linear_attn(q, k, v, initial_state=h0, output_final_state=True), ref, "linear_attn")


def test_simple_gla_and_gla():
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    q, k, v, h0 = _qkv()
    g = F.logsigmoid(_rand(B, T, H, seed=5) + 2)
    ref = naive_recurrent_simple_gla(q, k, v, g, initial_state=h0.clone(), output_final_state=True)
    _same(ops.simple_gla(q, k, v, g, initial_state=h0, output_final_state=True), ref, "simple_gla")
    gk = F.logsigmoid(_rand(B, T, H, K, seed=6) + 2)
    ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    _same(ops.gla(q, k, v, gk, initial_state=h0, output_final_state=True), ref, "gla")


def test_retention_with_fla_decays():
    """fla's retention forms each head's decay from its index, γ_h = 1 - 2^(-5-h); ours takes log γ."""
    from fla.ops.retention.naive import naive_retention

    q, k, v, _ = _qkv()
    log_gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32, device=DEVICE)))
    o_ref = naive_retention(*_head_first(q, k, v)).transpose(1, 2)
    o, _ = ops.retention(q, k, v, log_gamma)
    assert rel_rms(o, o_ref) < 1e-5


def test_delta_rule_and_gated_delta_rule():
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, h0 = _qkv()
    beta = torch.sigmoid(_rand(B, T, H, seed=7))
    o_ref, s_ref = delta_rule_recurrence(*_head_first(q, k, v, beta), initial_state=h0.clone())
    _same(ops.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True), (o_ref.transpose(1, 2), s_ref),
          "delta_rule")
    g = F.logsigmoid(_rand(B, T, H, seed=8) + 2)
    ref = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0.clone(), output_final_state=True)
    _same(ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True), ref, "gated_delta_rule")


def test_kda():
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, h0 = _qkv()
    g, beta = F.logsigmoid(_rand(B, T, H, K, seed=9) + 2), torch.sigmoid(_rand(B, T, H, seed=10))
    ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
    _same(ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True), ref, "kda")


@pytest.mark.parametrize("gated", [True, False])
def test_gated_delta_product(gated):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    q, _, _, h0 = _qkv()
    n = 2
    k = F.normalize(_rand(B, T * n, H, K, seed=11), dim=-1)
    v, beta = _rand(B, T * n, H, V, seed=12), torch.sigmoid(_rand(B, T * n, H, seed=13))
    g = F.logsigmoid(_rand(B, T, H, seed=14) + 2) if gated else None
    ref = naive_recurrent_gated_delta_product(q, k, v, g, beta, K ** -0.5, initial_state=h0.clone(),
                                              output_final_state=True, num_householder=n)
    _same(ops.gated_delta_product(q, k, v, g, beta, n, initial_state=h0, output_final_state=True), ref, "gdp")


def test_dplr_with_fla_sign_and_roles():
    """fla's DPLR is S_t = (Diag(e^gk) + b aᵀ) S_{t-1} + k vᵀ (its ``a`` read against the state, ``b`` written
    back, a plus sign); ours is (Diag(e^g) - a bᵀ) S_{t-1} + k vᵀ with a rank dimension: so fla's (a, b) is ours
    (a=-b, b=a). Here the delta rule written both ways (fla's a = k, b = -βk)."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    q, k, v, h0 = _qkv()
    beta = torch.sigmoid(_rand(B, T, H, seed=15))[..., None]
    a_fla, b_fla = k, -beta * k
    gk = F.logsigmoid(_rand(B, T, H, K, seed=16) + 2)
    o_ref, s_ref = dplr_recurrence(*_head_first(q, k, v, a_fla, b_fla, gk), initial_state=h0.clone())
    ours = ops.dplr(q, k, v, a=-b_fla[..., None, :], b=a_fla[..., None, :], g=gk, initial_state=h0,
                    output_final_state=True)
    _same(ours, (o_ref.transpose(1, 2), s_ref), "dplr")
