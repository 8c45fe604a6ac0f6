"""Bad input gets a clear error naming the argument and what was expected."""
import pytest
import torch

from rankdecay import ops

B, T, H, K, V = 2, 10, 3, 8, 4


def x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


q, k, v = x(B, T, H, K), x(B, T, H, K), x(B, T, H, V)
beta, g = torch.rand(B, T, H), -torch.rand(B, T, H)


@pytest.mark.parametrize("call,error,match", [
    (lambda: ops.dplr(x(B, T, H), k, v), ValueError, r"q must have shape \[B, T, H, K\]"),
    (lambda: ops.dplr(q, x(B, T + 1, H, K), v), ValueError, r"k must have shape \[B, T, H, K\]"),
    (lambda: ops.dplr(q, k, x(B, T, H + 1, V)), ValueError, r"v must have shape \[B, T, H, V\]"),
    (lambda: ops.dplr(q, x(B, T, H, 2, K), v), ValueError, "k and v must both"),
    (lambda: ops.dplr(q, k, v, a=x(B, T, H, 1, K)), ValueError, "a and b must be given together"),
    (lambda: ops.dplr(q, k, v, x(B, T, H, 2, K), x(B, T, H, 1, K)), ValueError, r"b must have shape \[B, T, H, Rab, K\]"),
    (lambda: ops.dplr(q, k, v, x(B, T, H, K), x(B, T, H, K)), ValueError, r"a must have shape \[B, T, H, Rab, K\]"),
    (lambda: ops.dplr(q, k, v, g=x(B, T, H, V + 1)), ValueError, r"g must have shape \[B, T, H, K\]"),
    (lambda: ops.dplr(q, k, v, g=x(B, T)), ValueError, r"g must have shape \[B, T, H\] or \[B, T, H, K\]"),
    (lambda: ops.dplr(q, k, v, initial_state=x(B, H, V, K)), ValueError, r"initial_state must have shape \[N, H, K, V\]"),
    (lambda: ops.dplr(q.long(), k, v), TypeError, "q must be a floating-point tensor"),
    (lambda: ops.dplr(q, k.int(), v), TypeError, "k must be a floating-point tensor"),
    (lambda: ops.dplr(q, k, v, g=g.long()), TypeError, "g must be a floating-point tensor"),
    (lambda: ops.dplr(q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda: ops.dplr(q, k, v, mode="fast"), ValueError, "mode must be one of"),
    (lambda: ops.dplr(q, k, v, chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (lambda: ops.dplr(q, k, v, scale="1"), TypeError, "scale must be a float"),
    (lambda: ops.dplr(q, k, v, cu_seqlens=torch.tensor([0, 4, T])), ValueError, "B must be 1"),
    (lambda: ops.dplr(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 6, 4, T])), ValueError, "non-decreasing"),
    (lambda: ops.dplr(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 4])), ValueError, "end at T"),
    (lambda: ops.dplr(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0.0, T])), TypeError, "cu_seqlens must be an int32 or int64"),
    (lambda: ops.dplr(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([[0, T]])), ValueError, r"cu_seqlens must be a 1-D tensor"),
    (lambda: ops.dplr(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 3, T]), initial_state=x(1, H, K, V)),
     ValueError, r"initial_state must have shape \[N, H, K, V\] = \[2, 3, 8, 4\]"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta[:, :, :1]), ValueError, r"beta must have shape \[B, T, H\]"),
    (lambda: ops.gated_delta_rule(q, k, v, g[..., None], beta), ValueError, r"g must have shape \[B, T, H, K\] = \[2, 10, 3, 8\], got \[2, 10, 3, 1\]"),
    (lambda: ops.gla(q, k, v, g), ValueError, r"g must have shape \[B, T, H, K\]"),
    (lambda: ops.kda(q, k, v, None, beta), ValueError, r"g must be a log-decay of shape \[B, T, H, K\]"),
    (lambda: ops.kda(q, k, v, x(B, T, H, K), beta[..., None]), ValueError, r"beta must have shape \[B, T, H\]"),
    (lambda: ops.simple_gla(q, k, v, x(B, T, H, K)), ValueError, r"g must have shape \[B, T, H\]"),
    (lambda: ops.retention(q, k, v, torch.zeros(H + 1)), ValueError, r"log_gamma must have shape \[H\]"),
    (lambda: ops.hdla(q, k, v, x(B, T, H, K), beta.int()), TypeError, "beta must be a floating-point tensor"),
    (lambda: ops.hh_delta_rule(q, k, v, beta, torch.ones(H, 3, 3)), ValueError, "r = 3 must divide the key dimension K = 8"),
    (lambda: ops.hh_delta_rule(q, k, v, beta, torch.ones(H, 2)), ValueError, r"mask must have shape \[H, r, r\] or"),
    (lambda: ops.hh_delta_rule(q, k, v, beta, torch.ones(H + 1, 2, 2)), ValueError, r"mask must have shape \[H, r, r\]"),
    (lambda: ops.hh_delta_rule(q, k, v, beta, torch.ones(B, T, H, 2, 4)), ValueError, r"mask must have shape \[B, T, H, r, r\]"),
    (lambda: ops.gated_delta_product(q, k, v, g, beta, 2), ValueError, r"k must have shape \[B, T \* 2, H, K\]"),
    (lambda: ops.gated_delta_product(q, k, v, g, beta, 0), ValueError, "num_householder must be a positive int"),
    (lambda: ops.head_in_head_mask(torch.ones(3, 2)), ValueError, r"m_org must have shape \[..., r, r\]"),
    # fla 0.6.0's options
    (lambda: ops.gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True), ValueError,
     "allow_neg_eigval=True scales σ\\(beta\\) to \\(0, 2\\) and needs use_beta_sigmoid_in_kernel=True"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True), ValueError,
     r"use_gate_in_kernel=True needs A_log \[H\]"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(H)), ValueError,
     "A_log and dt_bias form the decay only with use_gate_in_kernel=True"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(H + 1)), ValueError,
     r"A_log must have shape \[H\]"),
    (lambda: ops.gated_delta_rule(q, k, v, None, beta, use_gate_in_kernel=True, A_log=torch.zeros(H)), ValueError,
     "use_gate_in_kernel=True forms the decay from g"),
    (lambda: ops.gated_delta_rule(q, k, v, g[..., 0], beta, use_gate_in_kernel=True, A_log=torch.zeros(H)),
     ValueError, r"g must have shape \[B, T, H\]"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta.long(), use_beta_sigmoid_in_kernel=True), TypeError,
     "beta must be a floating-point tensor"),
    (lambda: ops.kda(q, k, v, x(B, T, H, K), beta, use_gate_in_kernel=True, A_log=torch.zeros(H),
                     dt_bias=torch.zeros(H)), ValueError, r"dt_bias must have shape \[H \* K\]"),
    (lambda: ops.kda(q, k, v, x(B, T, H), beta, use_gate_in_kernel=True, A_log=torch.zeros(H)), ValueError,
     r"g must have shape \[B, T, H, K\]"),
    (lambda: ops.gated_delta_rule(q, k, v, g, beta, initial_state=x(B, H, V, K), state_v_first=True,
                                  inplace_final_state=True), ValueError, "not with state_v_first"),
    (lambda: ops.gla(q, k, v, x(B, T, H, K), initial_state=x(H, V, K), state_v_first=True), ValueError,
     r"initial_state must be \[N, H, V, K\] with state_v_first"),
    (lambda: ops.simple_gla(q, k, v), ValueError, r"give one of g \[B, T, H\]"),
    (lambda: ops.simple_gla(q, k, v, g, torch.zeros(H)), ValueError, r"give one of g \[B, T, H\]"),
    (lambda: ops.simple_gla(q, k, v, g_gamma=torch.zeros(H, 1)), ValueError, r"g_gamma must have shape \[H\]"),
], ids=lambda p: None)
def test_bad_input_is_refused_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_devices_must_match():
    meta = torch.randn(B, T, H, K, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        ops.dplr(q, meta, v)
