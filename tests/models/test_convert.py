"""fla's Gated DeltaNet checkpoints as rankdecay models (``rankdecay.models.from_fla``, ``rankdecay convert-fla``),
checked against fla itself (flash-linear-attention 0.6.0, in the test extra)."""
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


def _fla_model(seed=0, **overrides):
    """A tiny fla Gated DeltaNet with its gates, decays and norms moved off their initial values."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=264, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=2,
              intermediate_size=192, fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False,
              initializer_range=0.2, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    model = fla_models.GatedDeltaNetForCausalLM(fla_models.GatedDeltaNetConfig(**{**kw, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name or "dt_bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(DEVICE).eval()


def _batch(T):
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # the first row left-padded
    return ids, mask


@pytest.mark.parametrize("allow_neg_eigval,tie", [(False, False), (True, True)])
def test_converted_model_gives_fla_logits(allow_neg_eigval, tie):
    """The converted model's logits are fla's, to fp32 rounding (relative RMS 1e-5; measured 1.4e-6 on the CPU),
    for a left-padded batch: β in (0, 1) or (0, 2), the head tied or not. On the CPU fla runs its recurrent
    kernel (T <= 64: 40); on a GPU also its chunked one (T = 100: its products may be TF32, so to 2^-8)."""
    fla = _fla_model(allow_neg_eigval=allow_neg_eigval, tie_word_embeddings=tie)
    ours = from_fla(fla)
    assert next(ours.parameters()).device.type == DEVICE
    assert ours.config.mixer == "gdn" and ours.config.tie_word_embeddings == tie
    assert ours.config.allow_neg_eigval == allow_neg_eigval and ours.config.head_v_dim == 64
    for T in (40,) if DEVICE == "cpu" else (40, 100):
        ids, mask = _batch(T)
        with torch.no_grad():
            ref = fla(ids, attention_mask=mask).logits
            got = ours(ids, attention_mask=mask).logits
        real = mask.bool()
        # T > 64: fla's chunked kernels, whose fp32 products may be one TF32 pass: eight units of its rounding, as
        # test_gpu_bf16_reduced_matmul_precision bounds "high"
        tol = 1e-5 if T <= 64 else 2 ** -8
        assert rel_rms(got[real], ref[real]) < tol, (T, rel_rms(got[real], ref[real]))


def test_convert_fla_command_and_a_saved_folder(tmp_path):
    """``rankdecay convert-fla SRC OUT`` on a folder fla saved (fla not needed to read it): the model loads with
    ``from_pretrained``, gives fla's logits, and decodes (``generate(graph_decoder=True)``) the tokens of greedy
    decoding by fla's full forward, token by token; the tokenizer files come along. (fla 0.6.0's own cached
    ``generate`` under transformers 5.24 leaves that sequence at its second token, so it is not the reference.)"""
    from transformers import AutoModelForCausalLM

    from rankdecay.cli import main

    fla = _fla_model(seed=1)
    src = tmp_path / "fla"
    fla.save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert main(["convert-fla", str(src), str(tmp_path / "ours")]) == 0
    assert (tmp_path / "ours" / "tokenizer_config.json").exists()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").to(DEVICE).eval()
    assert isinstance(ours, RankDecayForCausalLM)
    ids, mask = _batch(24)
    with torch.no_grad():
        ref, got = fla(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        assert rel_rms(got[mask.bool()], ref[mask.bool()]) < 1e-5
        prompt = ref = ids[1:, :12]
        for _ in range(6):
            ref = torch.cat([ref, fla(ref).logits[:, -1].argmax(-1, keepdim=True)], 1)
    got = ours.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=[], graph_decoder=True)
    assert torch.equal(got, ref)
    assert len(set(ref[0, 12:].tolist())) > 1, "the test model should not emit a constant"


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


@pytest.mark.parametrize("change,match", [
    (dict(num_v_heads=4), "num_v_heads = 4"),
    (dict(use_gate=False), "use_gate = False"),
    (dict(output_gate_activation="sigmoid"), "output_gate_activation = 'sigmoid'"),
    (dict(conv_bias=True), "conv_bias = True"),
    (dict(attn={"layers": [1], "num_heads": 2}), "attn = "),
    (dict(model_type="gla"), "only fla's Gated DeltaNet"),
])
def test_what_has_no_counterpart_is_refused_by_name(change, match):
    config = {**_fla_model().config.to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        fla_config(config)
