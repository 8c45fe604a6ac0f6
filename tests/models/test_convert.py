"""fla's Gated DeltaNet, DeltaNet, GLA, Gated DeltaProduct and KDA checkpoints as rankdecay models
(``rankdecay.models.from_fla``, ``rankdecay convert-fla``), checked against fla itself (flash-linear-attention 0.6.0,
in the test extra)."""
import copy
import json

import pytest
import torch

from rankdecay.models import RankDecayForCausalLM, from_fla
from rankdecay.models.convert import fla_config

from ..conftest import rel_rms

fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is in the test extra")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fla_kernels_run_here(monkeypatch):
    """Under Triton's CPU interpreter fla's autotuned kernels cannot time their configs (no driver): take each
    autotuner's first config there. (On a GPU they autotune as usual.)"""
    if DEVICE == "cpu":
        import triton.runtime.autotuner as autotuner

        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config, **k: [0.0, 0.0, 0.0])


def _fla_model(seed=0, kind="gated_deltanet", **overrides):
    """A tiny fla model of type ``kind`` with its gates, decays and norms moved off their initial values."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=264, hidden_size=64, num_hidden_layers=2, num_heads=2, fuse_norm=False, fuse_swiglu=False,
              fuse_cross_entropy=False, initializer_range=0.2, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    if kind == "gated_deltanet":
        kw.update(head_dim=32, expand_v=2, intermediate_size=192)
        model = fla_models.GatedDeltaNetForCausalLM(fla_models.GatedDeltaNetConfig(**{**kw, **overrides}))
    elif kind == "gated_deltaproduct":
        kw.update(head_dim=32, expand_v=2, intermediate_size=192)
        model = fla_models.GatedDeltaProductForCausalLM(fla_models.GatedDeltaProductConfig(**{**kw, **overrides}))
    elif kind == "kda":  # (expand_v 1 by default)
        kw.update(head_dim=32, intermediate_size=192)
        model = fla_models.KDAForCausalLM(fla_models.KDAConfig(**{**kw, **overrides}))
    elif kind == "delta_net":  # the MLP's width from fla's rule (hidden_ratio 4: 2/3 of 256, rounded up to 256)
        kw.update(expand_k=1.0, expand_v=2.0)
        model = fla_models.DeltaNetForCausalLM(fla_models.DeltaNetConfig(**{**kw, **overrides}))
    else:
        kw.update(expand_k=1.0, expand_v=2.0, hidden_ratio=3)
        model = fla_models.GLAForCausalLM(fla_models.GLAConfig(**{**kw, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("A_log", "dt_bias", "norm", "gk_proj", "g_proj.1.bias")):
                p.add_(0.3 * torch.randn_like(p))
    return model.to(DEVICE).eval()


def _batch(T):
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # the first row left-padded
    return ids, mask


@pytest.mark.parametrize("kind,gate,allow_neg_eigval,tie,conv", [
    ("gated_deltanet", True, False, False, True), ("gated_deltanet", True, True, True, True),
    ("gated_deltanet", False, False, True, True), ("delta_net", False, False, False, True),
    ("delta_net", True, True, True, True), ("gla", True, False, False, False), ("gla", False, False, True, False),
    ("gla", True, False, True, True),
])
def test_converted_model_gives_fla_logits(kind, gate, allow_neg_eigval, tie, conv):
    """The converted model's logits are fla's, to fp32 rounding (relative RMS 1e-5; measured 1.4e-6 on the CPU),
    for a left-padded batch: Gated DeltaNet, DeltaNet and GLA, with and without the output gate (fla's
    ``use_gate``, GLA's ``use_output_gate``), β in (0, 1) or (0, 2), the head tied or not, GLA without a short
    convolution (its default: q, k and v as projected) and with one (SiLU'd), and GLA's MLP at hidden_ratio 3. On
    the CPU fla runs its recurrent kernels (T <= 64: 40); on a GPU also its chunked ones (T = 100: their products
    may be TF32, so to 2^-8), but for DeltaNet's, which takes no fp32."""
    extra = dict(use_output_gate=gate, use_short_conv=conv) if kind == "gla" else dict(
        use_gate=gate, allow_neg_eigval=allow_neg_eigval)
    fla = _fla_model(kind=kind, tie_word_embeddings=tie, **extra)
    ours = from_fla(fla)
    assert next(ours.parameters()).device.type == DEVICE
    assert ours.config.mixer == {"gated_deltanet": "gdn", "delta_net": "deltanet", "gla": "gla"}[kind]
    assert ours.config.use_short_conv == conv and (ours.config.qkv_activation is None) == (kind == "gla" and not conv)
    assert ours.config.tie_word_embeddings == tie and ours.config.use_output_gate == gate
    assert bool(ours.config.allow_neg_eigval) == allow_neg_eigval and ours.config.head_v_dim == 64
    assert hasattr(ours.model.layers[0].mixer, "g_proj") == gate
    _assert_same_logits(fla, ours, kind)


def _assert_same_logits(fla, ours, kind, short=40):
    # fla 0.6.0's chunked DeltaNet and Gated DeltaProduct refuse fp32 inputs ("Please use bfloat16"), so they stay
    # at T <= 64 there (fla's recurrent kernels)
    for T in (short,) if DEVICE == "cpu" or kind in ("delta_net", "gated_deltaproduct") else (short, 100):
        ids, mask = _batch(T)
        with torch.no_grad():
            ref = fla(ids, attention_mask=mask).logits
            got = ours(ids, attention_mask=mask).logits
        real = mask.bool()
        # T > 64: fla's chunked kernels, whose fp32 products may be one TF32 pass: eight units of its rounding, as
        # test_gpu_bf16_reduced_matmul_precision bounds "high"
        tol = 1e-5 if T <= 64 else 2 ** -8
        assert rel_rms(got[real], ref[real]) < tol, (T, rel_rms(got[real], ref[real]))


def test_grouped_value_heads_give_fla_logits():
    """fla's Gated DeltaNet with grouped value heads (``num_v_heads`` = 2 x ``num_heads``, GVA: value head h reads
    query and key head h // 2; v, the gate, β, the decay and the state per value head) converts to
    ``num_v_heads`` and gives fla's logits, and decodes token by token as its full forward."""
    fla = _fla_model(kind="gated_deltanet", num_v_heads=4, allow_neg_eigval=True)
    ours = from_fla(fla)
    mixer = ours.model.layers[0].mixer
    assert ours.config.num_v_heads == 4 and mixer.num_v_heads == 4 and mixer.A_log.shape == (4,)
    _assert_same_logits(fla, ours, "gated_deltanet", short=20)
    _assert_decodes_as_full_forward(ours, prompt=6)


def _assert_decodes_as_full_forward(ours, prompt):
    """A prompt of ``prompt`` tokens, then one token a step up to 12: the logits of the full forward."""
    ids = _batch(12)[0]
    with torch.no_grad():
        full = ours(ids, use_cache=False).logits
        out = ours(ids[:, :prompt], use_cache=True)
        steps = [out.logits] + [ours(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True).logits
                                for t in range(prompt, 12)]
    assert rel_rms(torch.cat(steps, 1), full) < 1e-5


@pytest.mark.parametrize("num_householder,forget,tie", [(2, True, False), (3, False, True)])
def test_gated_deltaproduct_gives_fla_logits(num_householder, forget, tie):
    """fla's Gated DeltaProduct: n_h keys, values and βs per token in fla's layout, the forget gate on each token's
    first sub-step (or none: DeltaProduct, fla's default, which then has no decay parameters here either), β in
    (0, 2); logits as in ``test_converted_model_gives_fla_logits``."""
    fla = _fla_model(kind="gated_deltaproduct", num_householder=num_householder, use_forget_gate=forget,
                     allow_neg_eigval=True, tie_word_embeddings=tie)
    ours = from_fla(fla)
    assert ours.config.mixer == "gdp" and ours.config.num_householder == num_householder
    assert ours.config.use_forget_gate == forget and hasattr(ours.model.layers[0].mixer, "A_log") == forget
    _assert_same_logits(fla, ours, "gated_deltaproduct", short=20)  # (n_h sub-steps a token under the interpreter)


@pytest.mark.parametrize("kind,change", [
    ("kda", {}), ("kda", dict(safe_gate=True, lower_bound=-5.0, allow_neg_eigval=True, tie_word_embeddings=True)),
    ("kda", dict(use_short_conv=False, expand_v=2.0)), ("gated_deltanet", dict(output_gate_activation="sigmoid")),
])
def test_sigmoid_output_gates_give_fla_logits(kind, change):
    """fla's KDA (Kimi Linear's mixer): its per-channel gate through the low-rank ``f_proj`` (Kimi Linear's
    ``-exp(A_log) softplus(f + dt_bias)``, or with ``lower_bound`` the bounded ``b sigmoid(exp(A_log) (f +
    dt_bias))``), β in (0, 1) or (0, 2), with and without the short convolution, values twice the keys' width, and
    its output gate, a sigmoid of a low-rank ``g_proj`` with a bias; and Gated DeltaNet with fla's sigmoid output
    gate. Logits as in ``test_converted_model_gives_fla_logits``."""
    fla = _fla_model(kind=kind, **change)
    ours = from_fla(fla)
    mixer = ours.model.layers[0].mixer
    assert ours.config.output_gate_act == "sigmoid" and mixer.o_norm.activation == "sigmoid"
    if kind == "kda":
        assert ours.config.mixer == "kda" and ours.config.gate_lower_bound == change.get("lower_bound")
        assert mixer.g_proj[1].bias is not None and mixer.output_gate_rank == ours.config.head_v_dim
        assert ours.config.head_v_dim == 32 * change.get("expand_v", 1) and ours.config.use_short_conv == change.get(
            "use_short_conv", True)
    _assert_same_logits(fla, ours, kind, short=20)


def _flash_reference(q, k, v, cu_q, cu_k, causal=True, window_size=(-1, -1)):
    """flash-attn's ``flash_attn_varlen_func`` (which fla's ``Attention`` calls and this machine lacks) in PyTorch,
    written from its documented contract: per sequence, causal aligned to the bottom right (query i of Tq sees key
    j of Tk where j <= i + Tk - Tq), a window of ``left`` keys before that, GQA by repeating key/value heads."""
    assert causal and window_size[1] in (-1, 0)
    left, out = window_size[0], torch.empty_like(q)
    for n in range(cu_q.numel() - 1):
        qi, ki, vi = q[cu_q[n]:cu_q[n + 1]], k[cu_k[n]:cu_k[n + 1]], v[cu_k[n]:cu_k[n + 1]]
        G = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(G, 1), vi.repeat_interleave(G, 1)
        i = torch.arange(qi.shape[0], device=q.device)[:, None] + ki.shape[0] - qi.shape[0]
        j = torch.arange(ki.shape[0], device=q.device)[None]
        seen = (j <= i) & ((i - j <= left) if left >= 0 else True)
        scores = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * qi.shape[-1] ** -0.5
        out[cu_q[n]:cu_q[n + 1]] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, -float("inf")).softmax(-1),
                                                vi.float()).to(q.dtype)
    return out


@pytest.fixture
def _fla_attention(monkeypatch):
    """fla's ``Attention`` runs here with ``_flash_reference`` for flash-attn's two functions."""
    import fla.layers.attn as attn

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, **kw):
        return _flash_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)

    def padded(q, k, v, **kw):  # [B, T, H, D]: each row a sequence
        B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
        cu_q, cu_k = (torch.arange(0, (B + 1) * T, T, device=q.device) for T in (Tq, Tk))
        return _flash_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, **kw).unflatten(
            0, (B, Tq))

    monkeypatch.setattr(attn, "flash_attn_varlen_func", varlen, raising=False)  # (absent where flash-attn is)
    monkeypatch.setattr(attn, "flash_attn_func", padded)


@pytest.mark.parametrize("kind,attn", [
    ("gated_deltanet", {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True, "window_size": 8}),
    ("gated_deltanet", {"layers": [0], "num_heads": 2}),
    ("kda", [{"layers": [1], "num_heads": 4, "num_kv_heads": 1, "window_size": None, "rope_theta": 500.0}]),
])
def test_hybrids_with_attention_layers_give_fla_logits(_fla_attention, kind, attn, tmp_path, capsys):
    """fla's hybrids (``attn``: its ``Attention`` at the layers named, the rest the linear mixer): a sliding window
    of 8 with 4 query heads over 2 key/value heads and q/k/v biases (Gated DeltaNet-H1's kind of layer), full
    attention (``window_size`` None, fla's default) as the first layer, and one key/value head for 4 (MQA) in a list
    of specs with another RoPE base; the converted model gives fla's logits for a left-padded batch (T = 20, past
    the window) and decodes token by token as its own full forward; ``rankdecay convert-fla`` names the attention
    layers."""
    from rankdecay.cli import main

    with torch.no_grad():
        fla = _fla_model(kind=kind, attn=attn)
        for name, p in fla.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.add_(0.5 * torch.randn_like(p))
    ours = from_fla(fla)
    spec = attn if isinstance(attn, dict) else attn[0]
    cfg = ours.config
    assert cfg.layer_mixers == ["swa" if i in spec["layers"] else cfg.mixer for i in range(2)]
    mixer = ours.model.layers[spec["layers"][0]].mixer
    assert (mixer.num_heads, mixer.num_kv_heads, mixer.head_dim) == (
        spec["num_heads"], spec.get("num_kv_heads", spec["num_heads"]), 64 // spec["num_heads"])
    assert mixer.window_size == spec.get("window_size") and mixer.rope_theta == spec.get("rope_theta", 10000.0)
    assert (mixer.q_proj.bias is not None) == spec.get("qkv_bias", False)
    _assert_same_logits(fla, ours, kind, short=20)
    _assert_decodes_as_full_forward(ours, prompt=5)
    fla.save_pretrained(tmp_path / "fla")
    assert main(["convert-fla", str(tmp_path / "fla"), str(tmp_path / "ours")]) == 0
    assert f"(attention at layers {spec['layers'][0]}) in" in capsys.readouterr().out


@pytest.mark.parametrize("window", [8, None])
def test_attention_layer_with_qk_norm_is_flas(_fla_attention, window):
    """rankdecay's attention layer with fla's ``Attention``'s weights (4 query heads over 2 key/value heads, q/k/v
    biases, and the q/k RMSNorms no fla hybrid builds but its layer has) gives its output for a left-padded batch,
    windowed and full."""
    from fla.layers.attn import Attention

    from rankdecay.layers import SlidingWindowAttention

    torch.manual_seed(0)
    fla = Attention(64, 4, num_kv_heads=2, qkv_bias=True, qk_norm=True, window_size=window).to(DEVICE)
    ours = SlidingWindowAttention(64, 4, window_size=window, num_kv_heads=2, qkv_bias=True, qk_norm=True).to(DEVICE)
    with torch.no_grad():
        for p in fla.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ours.load_state_dict(fla.state_dict())
    x = torch.randn(2, 20, 64, device=DEVICE)
    mask = torch.ones(2, 20, dtype=torch.long, device=DEVICE)
    mask[0, :6] = 0
    with torch.no_grad():
        want, got = fla(x, attention_mask=mask)[0], ours(x, attention_mask=mask)[0]
    real = mask.bool()
    assert rel_rms(got[real], want[real]) < 1e-5, rel_rms(got[real], want[real])


@pytest.mark.parametrize("kind", ["gated_deltanet", "delta_net", "gla", "kda"])
def test_convert_fla_command_and_a_saved_folder(tmp_path, kind, capsys):
    """``rankdecay convert-fla SRC OUT`` on a folder fla saved (fla not needed to read it): the model loads with
    ``from_pretrained``, gives fla's logits, and decodes (``generate(graph_decoder=True)``) the tokens of greedy
    decoding by fla's full forward (each new token fla's argmax after the ones before it); the tokenizer files come
    along. DeltaNet and GLA as fla makes them by default (DeltaNet without the output gate, GLA without a short
    convolution). (fla 0.6.0's own cached ``generate`` under transformers 5.24 leaves that sequence at its second
    token, so it is not the reference.)"""
    from transformers import AutoModelForCausalLM

    from rankdecay.cli import main

    fla = _fla_model(seed=1, kind=kind)
    src = tmp_path / "fla"
    fla.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert main(["convert-fla", str(src), str(tmp_path / "ours")]) == 0
    names = {"gated_deltanet": "Gated DeltaNet", "delta_net": "DeltaNet", "gla": "GLA", "kda": "KDA"}
    assert f"fla's {names[kind]} in" in capsys.readouterr().out
    assert (tmp_path / "ours" / "tokenizer_config.json").exists()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").to(DEVICE).eval()
    assert isinstance(ours, RankDecayForCausalLM)
    ids, mask = _batch(24)
    with torch.no_grad():
        ref, got = fla(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        # each within fp32 rounding (1e-5) of the loaded model run in fp64, so fla's logits are the converted
        # model's function; not each other's within 1e-5 (Gated DeltaNet's on the H200: fla's 7.8e-6 from fp64,
        # ours 3.6e-6, 1.02e-5 from each other; on the CPU 2.7e-6 and 4.1e-6)
        exact = copy.deepcopy(ours).double()(ids, attention_mask=mask).logits
        real = mask.bool()
        fla_err, our_err = rel_rms(ref[real], exact[real]), rel_rms(got[real], exact[real])
        assert fla_err < 1e-5 and our_err < 1e-5, (fla_err, our_err)
        prompt = ids[1:, :12]
    got = ours.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=[], graph_decoder=True)
    assert torch.equal(got[:, :12], prompt)
    with torch.no_grad():  # greedy by fla: each new token fla's argmax after the tokens before it (one causal pass)
        assert torch.equal(fla(got[:, :-1]).logits[:, 11:].argmax(-1), got[:, 12:])
    assert len(set(got[0, 12:].tolist())) > 1, "the test model should not emit a constant"


def test_a_hub_name_is_downloaded(tmp_path, monkeypatch):
    """A source that is no folder here but reads "org/name" is fetched from the Hub (``snapshot_download``, patched
    here to a saved folder: the tests download nothing); a folder that exists is read as it is."""
    import huggingface_hub

    from rankdecay.models.convert import local_folder

    fla = _fla_model(seed=3)
    fla.save_pretrained(tmp_path / "snapshot")
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append((repo, kw["allow_patterns"])) or str(tmp_path / "snapshot"))
    ours = from_fla("fla-hub/gdn-test")
    assert asked and asked[0][0] == "fla-hub/gdn-test" and "*.safetensors" in asked[0][1]
    assert torch.equal(ours.model.embeddings.weight, fla.model.embeddings.weight.cpu())
    assert local_folder(tmp_path / "snapshot") == tmp_path / "snapshot" and len(asked) == 1


@pytest.mark.parametrize("kind,change,match", [
    ("gated_deltanet", dict(output_gate_activation="relu"), "output_gate_activation = 'relu'"),
    ("kda", dict(num_v_heads=4), "num_v_heads = 4"),
    ("kda", dict(attn=[{"layers": [0], "num_heads": 2}, {"layers": [1], "num_heads": 2, "window_size": 4}]),
     "attention layers of different settings"),
    ("gated_deltanet", dict(conv_bias=True), "conv_bias = True"),
    ("gated_deltanet", dict(attn={"layers": [1], "num_heads": 2, "qk_norm": True}), "attn has \\['qk_norm'\\]"),
    ("gated_deltanet", dict(attn={"layers": [1]}), "each with 'layers' and 'num_heads'"),
    ("gated_deltanet", dict(attn={"layers": [1], "num_heads": 3}), "num_heads = 3 does not divide hidden_size"),
    ("gated_deltanet", dict(model_type="rwkv7"), "only fla's Gated DeltaNet, DeltaNet, GLA, Gated DeltaProduct and KDA"),
    ("delta_net", dict(use_beta=False), "use_beta = False"),
    ("delta_net", dict(qk_norm="sum"), "qk_norm = 'sum'"),
    ("delta_net", dict(qk_activation="relu"), "qk_activation = 'relu'"),
    ("delta_net", dict(expand_k=0.3), "hidden_size \\* expand_k = 19.2"),
    ("gla", dict(num_kv_heads=1), "num_kv_heads = 1"),
    ("gla", dict(feature_map="relu"), "feature_map = 'relu'"),
    ("gla", dict(clamp_min=-1.0), "clamp_min = -1.0"),
    ("gla", dict(elementwise_affine=False), "elementwise_affine = False"),
    ("gla", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_what_has_no_counterpart_is_refused_by_name(kind, change, match):
    config = {**_fla_model(kind=kind).config.to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        fla_config(config)


def test_gla_saved_with_fused_norms():
    """fla's GLA names its output norm ``g_norm_swish_gate`` with ``fuse_norm=True`` (its default, so its released
    checkpoints) and ``g_norm`` without: a fused-norm model converts (its weights, no fla forward needed) to the
    logits of the same weights in fla's unfused model."""
    fused = _fla_model(kind="gla", fuse_norm=True, seed=4)
    ours = from_fla(fused)
    plain = _fla_model(kind="gla", seed=5)
    state = {k.replace("g_norm_swish_gate", "g_norm"): v for k, v in fused.state_dict().items()}
    plain.load_state_dict(state)
    _assert_same_logits(plain, ours, "gla")
