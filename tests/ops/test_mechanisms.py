"""Every mechanism, both paths, against the paper's literal per-token recurrence."""
import pytest
import torch

from ..conftest import assert_matches
from .inputs import MECHANISMS, make_case

MODES = ["naive", "chunk"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MECHANISMS)
def test_fp64_matches_literal_recurrence(name, mode):
    B, T, H, K, V = 2, 100, 2, 16, 12
    call, literal = make_case(name, B, T, H, K, V)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o, s = call(initial_state=h0, output_final_state=True, mode=mode, chunk_size=32)
    o_ref, s_ref = literal(h0)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert_matches(o, o_ref, 1e-10, "output")
    assert_matches(s, s_ref, 1e-10, "final state")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MECHANISMS)
def test_fp32_matches_literal_recurrence(name, mode):
    B, T, H, K, V = 2, 100, 2, 16, 12
    call, literal = make_case(name, B, T, H, K, V, dtype=torch.float32)
    h0 = torch.randn(B, H, K, V)
    o, s = call(initial_state=h0, output_final_state=True, mode=mode, chunk_size=32)
    o_ref, s_ref = literal(h0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_matches(o, o_ref, 1e-5, "output")
    assert_matches(s, s_ref, 1e-5, "final state")


@pytest.mark.parametrize("name", MECHANISMS)
def test_gradients_of_every_input_chunk_vs_naive(name):
    """Gradients reach every input of the mechanism (beta, g, mask, ... and initial_state) alike on both paths."""
    B, T, H, K, V = 2, 45, 2, 16, 8
    leaves = []
    call, _ = make_case(name, B, T, H, K, V, leaves=leaves)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, requires_grad=True)
    leaves.append(h0)
    results = {}
    for mode in MODES:
        o, s = call(initial_state=h0, output_final_state=True, mode=mode, chunk_size=16)
        gen = torch.Generator().manual_seed(3)
        do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
        ds = torch.randn(s.shape, generator=gen, dtype=s.dtype)
        # retain_graph: inputs derived from the leaves (beta_max * u, -softplus(x)) serve both calls
        results[mode] = torch.autograd.grad((o * do).sum() + (s * ds).sum(), leaves, retain_graph=True)
    for i, (g_chunk, g_naive) in enumerate(zip(results["chunk"], results["naive"])):
        assert g_naive.abs().sum() > 0, f"input {i} gets no gradient"
        assert_matches(g_chunk, g_naive, 1e-10, f"gradient of input {i} of {len(leaves)}")


@pytest.mark.parametrize("shape", [
    dict(B=1, T=1, H=1, K=60, V=20),
    dict(B=2, T=63, H=1, K=60, V=20),
    dict(B=1, T=130, H=1, K=60, V=20),
    dict(B=1, T=130, H=3, K=12, V=32),
], ids=["T1", "T63", "T130", "T130-KltV"])
@pytest.mark.parametrize("name", MECHANISMS)
def test_awkward_shapes(name, shape):
    """T = 1, T not a multiple of the chunk (64), K = 60 (not a power of 2), K != V, H = 1."""
    call, literal = make_case(name, r=2 if shape["K"] == 60 else 4, **shape)
    o_ref, s_ref = literal(None)
    for mode in MODES:
        o, s = call(output_final_state=True, mode=mode, chunk_size=64)
        assert_matches(o, o_ref, 1e-10, f"{mode} output")
        assert_matches(s, s_ref, 1e-10, f"{mode} final state")


@pytest.mark.parametrize("nh", [1, 3])
def test_gated_delta_product_num_householder(nh):
    call, literal = make_case("gated_delta_product", 1, 37, 2, 8, 8, nh=nh, beta_max=2.0)
    o_ref, s_ref = literal(None)
    o, s = call(output_final_state=True, chunk_size=16)
    assert_matches(o, o_ref, 1e-10, "output")
    assert_matches(s, s_ref, 1e-10, "final state")


def test_kda_with_one_decay_per_head_is_gated_delta_rule():
    """A per-head gate commutes with the delta step: kda's [B, T, H] gate (routed to gated_delta_rule) and the same
    gate expanded over K (kda's own DPLR form) give one result; a per-channel gate does not commute, and there kda
    and gated_delta_rule differ."""
    from rankdecay import ops

    q, k, v = torch.randn(1, 20, 2, 8), torch.nn.functional.normalize(torch.randn(1, 20, 2, 8), dim=-1), torch.randn(1, 20, 2, 4)
    g, beta = -torch.rand(1, 20, 2), torch.rand(1, 20, 2)
    o1, s1 = ops.kda(q, k, v, g, beta, output_final_state=True)
    o2, s2 = ops.kda(q, k, v, g[..., None].expand(q.shape), beta, output_final_state=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)
    gk = -torch.rand(1, 20, 2, 8)
    assert not torch.allclose(ops.kda(q, k, v, gk, beta)[0], ops.gated_delta_rule(q, k, v, gk, beta)[0], atol=1e-3)


def test_gated_delta_product_with_one_householder_is_gated_delta_rule():
    from rankdecay import ops

    q, k, v = torch.randn(1, 20, 2, 8), torch.nn.functional.normalize(torch.randn(1, 20, 2, 8), dim=-1), torch.randn(1, 20, 2, 4)
    g, beta = -torch.rand(1, 20, 2), torch.rand(1, 20, 2)
    o1, s1 = ops.gated_delta_product(q, k, v, g, beta, 1, output_final_state=True)
    o2, s2 = ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)


def test_head_in_head_data_dependent_mask():
    call, literal = make_case("hh_gated_delta_rule", 2, 45, 2, 16, 8, r=4, data_mask=True)
    o_ref, s_ref = literal(None)
    for mode in MODES:
        o, s = call(output_final_state=True, mode=mode, chunk_size=16)
        assert_matches(o, o_ref, 1e-10, f"{mode} output")
        assert_matches(s, s_ref, 1e-10, f"{mode} final state")


def test_head_in_head_with_full_mask_of_ones_is_delta_rule():
    """r groups with M = all ones is plain (Gated) DeltaNet: the r = 1 baseline."""
    from rankdecay import ops

    q, k, v = torch.randn(1, 30, 2, 8), torch.nn.functional.normalize(torch.randn(1, 30, 2, 8), dim=-1), torch.randn(1, 30, 2, 4)
    g, beta = -torch.rand(1, 30, 2), torch.rand(1, 30, 2)
    o1, s1 = ops.hh_delta_rule(q, k, v, beta, torch.ones(2, 4, 4), g, output_final_state=True)
    o2, s2 = ops.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_fp32(dtype):
    call, literal = make_case("gated_delta_rule", 1, 70, 2, 16, 16, dtype=dtype)
    o, s = call(output_final_state=True)
    o_ref, s_ref = literal(None)
    assert o.dtype == dtype and s.dtype == torch.float32
    # The inputs are the same low-precision numbers; only the output is rounded.
    assert_matches(s, s_ref, 1e-5, "final state")
    assert_matches(o.double(), o_ref, 2 * torch.finfo(dtype).eps, "output")
