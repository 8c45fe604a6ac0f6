"""Switching from fla: each of the README's "Switching from fla" rows against flash-linear-attention's own reference
(its ``naive`` recurrences, plain PyTorch; for KDA's decode step and the fused loss, fla's Triton kernels, interpreted
on the CPU: fla 0.6.0, in the test extra): outputs, final states and the gradients of every input, so that the
table's mapping (names, argument order, layouts, the sign of fla's DPLR term, fla's retention decays) is what a user
gets, in training too."""
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


def _check(ours, ref, inputs, what):
    """ours(*inputs) and ref(*inputs) return (o [B, T, H, V], final state or None): equal outputs and final states,
    and equal gradients of every input under one random weighting of both."""
    results = []
    for fn in (ours, ref):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        o, s = fn(*leaves)
        loss = (o * _rand(*o.shape, seed=20)).sum() + (0 if s is None else (s * _rand(*s.shape, seed=21)).sum())
        results.append([o, s] + list(torch.autograd.grad(loss, leaves)))
    names = ["o", "final state"] + [f"d input {i}" for i in range(len(inputs))]
    for name, got, exp in zip(names, *results):
        if exp is not None:
            assert rel_rms(got, exp) < 1e-5, (what, name, rel_rms(got, exp))


def _head_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def test_linear_attn_is_fla_without_its_normaliser():
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    _check(lambda q, k, v, h0: ops.linear_attn(q, k, v, initial_state=h0, output_final_state=True),
           lambda q, k, v, h0: naive_recurrent_linear_attn(q, k, v, initial_state=h0, output_final_state=True,
                                                          normalize=False),
           _qkv(), "linear_attn")


def test_simple_gla_and_gla():
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    g = F.logsigmoid(_rand(B, T, H, seed=5) + 2)
    _check(lambda q, k, v, h0, g: ops.simple_gla(q, k, v, g, initial_state=h0, output_final_state=True),
           lambda q, k, v, h0, g: naive_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True),
           [*_qkv(), g], "simple_gla")
    gk = F.logsigmoid(_rand(B, T, H, K, seed=6) + 2)
    _check(lambda q, k, v, h0, g: ops.gla(q, k, v, g, initial_state=h0, output_final_state=True),
           lambda q, k, v, h0, g: naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True),
           [*_qkv(), gk], "gla")


def test_retention_with_fla_decays():
    """fla's retention forms each head's decay from its index, γ_h = 1 - 2^(-5-h); ours takes log γ."""
    from fla.ops.retention.naive import naive_retention

    log_gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32, device=DEVICE)))
    _check(lambda q, k, v: (ops.retention(q, k, v, log_gamma)[0], None),
           lambda q, k, v: (naive_retention(*_head_first(q, k, v)).transpose(1, 2), None),
           _qkv()[:3], "retention")


def test_delta_rule_and_gated_delta_rule():
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    beta = torch.sigmoid(_rand(B, T, H, seed=7))

    def fla_delta(q, k, v, h0, beta):
        o, s = delta_rule_recurrence(*_head_first(q, k, v, beta), initial_state=h0)
        return o.transpose(1, 2), s

    _check(lambda q, k, v, h0, beta: ops.delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True),
           fla_delta, [*_qkv(), beta], "delta_rule")
    g = F.logsigmoid(_rand(B, T, H, seed=8) + 2)
    _check(lambda q, k, v, h0, beta, g: ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                             output_final_state=True),
           lambda q, k, v, h0, beta, g: naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0,
                                                                         output_final_state=True),
           [*_qkv(), beta, g], "gated_delta_rule")


def test_kda():
    from fla.ops.kda.naive import naive_recurrent_kda

    g, beta = F.logsigmoid(_rand(B, T, H, K, seed=9) + 2), torch.sigmoid(_rand(B, T, H, seed=10))
    _check(lambda q, k, v, h0, g, beta: ops.kda(q, k, v, g, beta, initial_state=h0, output_final_state=True),
           lambda q, k, v, h0, g, beta: naive_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                                            output_final_state=True),
           [*_qkv(), g, beta], "kda")


@pytest.mark.parametrize("gated", [True, False])
def test_gated_delta_product(gated):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    q, _, _, h0 = _qkv()
    n = 2
    k = F.normalize(_rand(B, T * n, H, K, seed=11), dim=-1)
    v, beta = _rand(B, T * n, H, V, seed=12), torch.sigmoid(_rand(B, T * n, H, seed=13))
    inputs = [q, k, v, h0, beta] + ([F.logsigmoid(_rand(B, T, H, seed=14) + 2)] if gated else [])
    _check(lambda q, k, v, h0, beta, g=None: ops.gated_delta_product(q, k, v, g, beta, n, initial_state=h0,
                                                                    output_final_state=True),
           lambda q, k, v, h0, beta, g=None: naive_recurrent_gated_delta_product(
               q, k, v, g, beta, K ** -0.5, initial_state=h0, output_final_state=True, num_householder=n),
           inputs, "gated_delta_product")


def test_dplr_with_fla_sign_and_roles():
    """fla's DPLR is S_t = (Diag(e^gk) + b aᵀ) S_{t-1} + k vᵀ (its ``a`` read against the state, ``b`` written
    back, a plus sign); ours is (Diag(e^g) - a bᵀ) S_{t-1} + k vᵀ with a rank dimension: so fla's (a, b) is ours
    (a=-b, b=a). Here with the delta rule's vectors (fla's a = k, b = -βk) perturbed apart, so that the roles of a
    and b are told apart."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    q, k, v, h0 = _qkv()
    beta = torch.sigmoid(_rand(B, T, H, seed=15))[..., None]
    a_fla = F.normalize(k + 0.3 * _rand(B, T, H, K, seed=17), dim=-1)
    b_fla = -beta * k
    gk = F.logsigmoid(_rand(B, T, H, K, seed=16) + 2)

    def fla_dplr(q, k, v, h0, a, b, gk):
        o, s = dplr_recurrence(*_head_first(q, k, v, a, b, gk), initial_state=h0)
        return o.transpose(1, 2), s

    _check(lambda q, k, v, h0, a, b, gk: ops.dplr(q, k, v, a=-b[..., None, :], b=a[..., None, :], g=gk,
                                                   initial_state=h0, output_final_state=True),
           fla_dplr, [q, k, v, h0, a_fla, b_fla, gk], "dplr")


@pytest.mark.parametrize("lower_bound,neg", [(None, False), (-5.0, True)])
@pytest.mark.parametrize("mode", ["fused_recurrent", "naive"])
def test_kda_decode_is_fla_fused_recurrent_kda(lower_bound, neg, mode):
    """``ops.kda_decode`` against fla's ``fused_recurrent_kda`` with its gate, β's sigmoid and the L2 norms in the
    kernel (its decode step, a Triton kernel: interpreted on the CPU), fla's ``allow_neg_eigval`` as our
    ``beta_max=2``: outputs and final states (no autograd: a decode step), on our kernel and our PyTorch form."""
    from fla.ops.kda import fused_recurrent_kda

    q, k, v, h0 = _qkv()
    a, b = 3 * _rand(B, T, H, K, seed=30), 2 * _rand(B, T, H, seed=31)
    A_log, dt_bias = _rand(H, seed=32), _rand(H * K, seed=33)
    with torch.no_grad():
        ours = ops.kda_decode(q, k, v, a, b, A_log, dt_bias, lower_bound=lower_bound, beta_max=2.0 if neg else 1.0,
                              initial_state=h0, output_final_state=True, mode=mode)
        ref = fused_recurrent_kda(q, k, v, a, b, A_log, dt_bias, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, lower_bound=lower_bound)
    for name, got, exp in zip(["o", "final state"], ours, ref):
        assert rel_rms(got, exp.to(got.dtype)) < 1e-5, (name, rel_rms(got, exp.to(got.dtype)))


def _fla_060_cases():
    """(name, ours(mode), fla's fused_recurrent call): fla 0.6.0's in-kernel options, states V-first."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.gla import fused_recurrent_gla
    from fla.ops.kda import fused_recurrent_kda
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    q, k, v, h0 = _qkv()
    h0 = h0.transpose(-1, -2).contiguous()  # [B, H, V, K]
    beta, A_log, dt = 2 * _rand(B, T, H, seed=40), _rand(H, seed=41), _rand(H, seed=42)
    gdn = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt,
               use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True, initial_state=h0,
               output_final_state=True)
    a = 3 * _rand(B, T, H, seed=43)
    yield ("gated_delta_rule", lambda mode: ops.gated_delta_rule(q, k, v, a, beta, mode=mode, **gdn),
           lambda: fused_recurrent_gated_delta_rule(q, k, v, a, beta=beta, **gdn))
    gdn_no_bias = dict(gdn, dt_bias=None, allow_neg_eigval=False)
    yield ("gated_delta_rule, no dt_bias", lambda mode: ops.gated_delta_rule(q, k, v, a, beta, mode=mode, **gdn_no_bias),
           lambda: fused_recurrent_gated_delta_rule(q, k, v, a, beta=beta, **gdn_no_bias))
    ak, dtk = 3 * _rand(B, T, H, K, seed=44), _rand(H * K, seed=45)
    for lower_bound in (None, -5.0):
        kda = dict(gdn, A_log=A_log, dt_bias=dtk, lower_bound=lower_bound)
        yield (f"kda, lower_bound {lower_bound}", lambda mode, kda=kda: ops.kda(q, k, v, ak, beta, mode=mode, **kda),
               lambda kda=kda: fused_recurrent_kda(q, k, v, ak, beta, **kda))
    # fla's GLA kernels autotune, which the interpreter cannot: on the CPU their reference recurrences, the states
    # transposed by hand (V-first is the [V, K] layout of the same state)
    gk = F.logsigmoid(_rand(B, T, H, K, seed=46) + 2)
    vfirst = dict(initial_state=h0, output_final_state=True, state_v_first=True)
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32, device=DEVICE)))
    if DEVICE == "cuda":
        gla_ref = lambda: fused_recurrent_gla(q, k, v, gk, **vfirst)  # noqa: E731
        simple_ref = lambda: fused_recurrent_simple_gla(q, k, v, g_gamma=gamma, **vfirst)  # noqa: E731
    else:
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

        def k_first(fn, *args):
            o, state = fn(q, k, v, *args, initial_state=h0.transpose(-1, -2), output_final_state=True)
            return o, state.transpose(-1, -2)

        gla_ref = lambda: k_first(naive_recurrent_gla, gk)  # noqa: E731
        simple_ref = lambda: k_first(naive_recurrent_simple_gla, gamma.expand(B, T, H))  # noqa: E731
    yield "gla", lambda mode: ops.gla(q, k, v, gk, mode=mode, **vfirst), gla_ref
    yield ("simple_gla, g_gamma", lambda mode: ops.simple_gla(q, k, v, g_gamma=gamma, mode=mode, **vfirst),
           simple_ref)


@pytest.fixture(scope="module")
def fla_060():
    """Each case's name, our call and fla's results (its kernels, interpreted on the CPU, run once for every mode)."""
    with torch.no_grad():
        return [(name, ours, ref()) for name, ours, ref in _fla_060_cases()]


@pytest.mark.parametrize("mode", ["naive", "chunk", "fused_recurrent"])
def test_fla_060_options_are_fla_fused_recurrent(mode, fla_060):
    """fla 0.6.0's options of its ops (the gate and β's sigmoid formed in the kernel, negative eigenvalues, V-first
    states, simple GLA's ``g_gamma``) against fla's ``fused_recurrent_*`` kernels (interpreted on the CPU; they have
    no backward: ``test_fla_060_options_gradients`` checks ours through autograd), on each of our paths."""
    for name, ours, exp in fla_060:
        if mode == "fused_recurrent" and name.startswith(("gla", "simple_gla")):
            continue  # their decode path is the chunked one at T > 1
        with torch.no_grad():
            got = ours(mode)
        for what, x, y in zip(["o", "final state"], got, exp):
            assert x.shape == y.shape and rel_rms(x, y.to(x.dtype)) < 1e-5, (name, what, rel_rms(x, y.to(x.dtype)))


def test_fla_060_options_gradients():
    """Through autograd the options are what fla's reference gate (``naive_gdn_gate``, ``naive_kda_gate``) and β's
    sigmoid give, formed first: every input's gradient (A_log's, dt_bias's and β's logits' among them)."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.kda.gate import naive_kda_gate

    q, k, v, h0 = _qkv()
    h0 = h0.transpose(-1, -2).contiguous()
    beta, A_log = 2 * _rand(B, T, H, seed=50), _rand(H, seed=51)
    a, dt = 3 * _rand(B, T, H, seed=52), _rand(H, seed=53)
    options = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                   state_v_first=True, output_final_state=True)

    def v_first(out):
        return out[0], out[1].transpose(-1, -2)

    _check(lambda q, k, v, h0, a, b, A, d: ops.gated_delta_rule(q, k, v, a, b, A_log=A, dt_bias=d, initial_state=h0,
                                                                **options),
           lambda q, k, v, h0, a, b, A, d: v_first(ops.gated_delta_rule(
               q, k, v, naive_gdn_gate(a, A, d), 2 * b.sigmoid(), initial_state=h0.transpose(-1, -2),
               output_final_state=True)),
           [q, k, v, h0, a, beta, A_log, dt], "gated_delta_rule")
    ak, dtk = 3 * _rand(B, T, H, K, seed=54), _rand(H * K, seed=55)
    _check(lambda q, k, v, h0, a, b, A, d: ops.kda(q, k, v, a, b, A_log=A, dt_bias=d, initial_state=h0, **options),
           lambda q, k, v, h0, a, b, A, d: v_first(ops.kda(
               q, k, v, naive_kda_gate(a, A, d), 2 * b.sigmoid(), initial_state=h0.transpose(-1, -2),
               output_final_state=True)),
           [q, k, v, h0, ak, beta, A_log, dtk], "kda")


@pytest.mark.parametrize("smoothing,scale", [(0.0, 1.0), (0.1, 0.5)])
def test_linear_cross_entropy_is_fla_fused_linear_cross_entropy(smoothing, scale):
    """``layers.linear_cross_entropy`` against fla's ``FusedLinearCrossEntropyLoss`` (Triton: interpreted on the
    CPU) with the same ``label_smoothing`` and ``logit_scale``: the mean loss over the rows not ignored and the
    gradients of x, weight and bias. (fla's ``logit_softcapping`` calls libdevice's tanh, which Triton's interpreter
    lacks; ours is checked against ``F.cross_entropy`` of the capped logits in tests/models/test_loss.py.)"""
    from fla.modules import FusedLinearCrossEntropyLoss

    from rankdecay.layers import linear_cross_entropy

    x, w, b = _rand(37, 16, seed=40), _rand(29, 16, seed=41), _rand(29, seed=42)
    t = torch.randint(0, 29, (37,), generator=torch.Generator().manual_seed(43)).to(DEVICE)
    t[:3] = -100
    kw = dict(label_smoothing=smoothing, logit_scale=scale)
    _check(lambda x, w, b: (linear_cross_entropy(x, t, w, b, **kw)[None], None),
           lambda x, w, b: (FusedLinearCrossEntropyLoss(**kw)(x, t, w, b)[None], None), (x, w, b), "linear_cross_entropy")
