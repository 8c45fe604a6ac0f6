"""The ``rankdecay`` command line."""
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rankdecay import __version__
from rankdecay.cli import main
from rankdecay.data import ByteTokenizer

from .conftest import NO_CPU_COMPILE, can_compile_on_cpu


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"rankdecay {__version__}" in out
    for word in ("gated_delta_rule", "hdla", "hh_delta_rule", "hh-gdn", "swa", "triton", "chunk"):
        assert word in out


@pytest.mark.slow
@pytest.mark.skipif(not can_compile_on_cpu(), reason=NO_CPU_COMPILE)
def test_generate_compile_decodes_as_without(tmp_path, capsys):
    model_dir = tmp_path / "model"
    assert main(["init", str(model_dir), "--mixer", "gdn", "--set", "initializer_range=0.2"]) == 0
    capsys.readouterr()
    prompts = ["--prompt", "Hello", "--prompt", "Hi, world", "--max-new-tokens", "8"]
    assert main(["generate", str(model_dir), *prompts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["generate", str(model_dir), *prompts, "--compile"]) == 0
    assert capsys.readouterr().out.splitlines() == lines, "the compiled step must decode as model.generate"


def test_init_then_generate_matches_the_library(tmp_path, capsys, monkeypatch):
    model_dir = tmp_path / "model"
    assert main(["init", str(model_dir), "--mixer", "hh-gdn", "--set", "hh_rank=2",
                 "--set", "initializer_range=0.2"]) == 0
    assert (model_dir / "rankdecay_tokenizer.json").exists()
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", "Hello", "--prompt", "Hi, world", "--max-new-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert main(["generate", str(model_dir), "--prompt", "Hello", "--prompt", "Hi, world", "--max-new-tokens", "8",
                 "--cuda-graph"]) == 0
    assert capsys.readouterr().out.splitlines() == lines, "GraphDecoder must decode as model.generate"
    import rankdecay.models

    packs = []

    class Spy(rankdecay.models.GraphDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            packs.append(self.pack_projections)

    monkeypatch.setattr(rankdecay.models, "GraphDecoder", Spy)
    assert main(["generate", str(model_dir), "--prompt", "Hello", "--prompt", "Hi, world", "--max-new-tokens", "8",
                 "--cuda-graph", "--no-pack"]) == 0
    assert capsys.readouterr().out.splitlines() == lines, "without packs too"
    assert packs == [False]

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.config.mixer == "hh-gdn" and model.config.hh_rank == 2
    tok = ByteTokenizer()
    expected = []
    for prompt in ("Hello", "Hi, world"):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        expected.append(prompt + tok.decode(out[0, ids.shape[1]:]))
    assert lines == expected

    # one prompt: streamed as it comes (transformers' TextStreamer), the same line either way
    for extra in ([], ["--cuda-graph"]):
        assert main(["generate", str(model_dir), "--prompt", "Hi, world", "--max-new-tokens", "8", *extra]) == 0
        assert capsys.readouterr().out.splitlines() == expected[1:], extra


def test_generate_an_empty_prompt_starts_a_document(tmp_path, capsys):
    """An empty prompt continues the end-of-text token that ends training's documents (it raised an IndexError)."""
    main(["init", str(tmp_path), "--set", "initializer_range=0.5"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = ByteTokenizer()
    with torch.no_grad():
        out = model.generate(torch.tensor([[tok.eos_token_id]]), max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, 1:])
    assert expected, "the test needs a continuation of bytes"
    for extra in ([], ["--prompt", "Hi"], ["--cuda-graph"], ["--prompt", "Hi", "--cuda-graph"]):
        capsys.readouterr()
        assert main(["generate", str(tmp_path), "--prompt", "", "--max-new-tokens", "8", *extra]) == 0
        assert capsys.readouterr().out.splitlines()[0] == expected, extra


def test_generate_state_dtype_reaches_the_layers(tmp_path, capsys, monkeypatch):
    import rankdecay.layers.mixers as mixers

    seen = []
    original = mixers._state_dtype
    monkeypatch.setattr(mixers, "_state_dtype", lambda x: seen.append(x) or original(x))
    main(["init", str(tmp_path), "--set", "initializer_range=0.2"])
    capsys.readouterr()
    seen.clear()
    assert main(["generate", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "4",
                 "--state-dtype", "bfloat16"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert seen and set(seen) == {"bfloat16"}


def test_generate_sampling_is_seeded(tmp_path, capsys):
    main(["init", str(tmp_path), "--set", "initializer_range=0.5"])
    runs = []
    for seed in ("1", "1", "2"):
        capsys.readouterr()
        main(["generate", str(tmp_path), "--prompt", "abc", "--temperature", "1", "--seed", seed,
              "--max-new-tokens", "20"])
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="not a saved model"):
        main(["generate", str(tmp_path), "--prompt", "x"])
    assert main(["init", str(tmp_path), "--set", "hh_rank"]) == 2
    assert "--set expects key=value" in capsys.readouterr().err
    assert main(["synth", "parity", "--only", "seq_len"]) == 2
    assert "--only expects key=value" in capsys.readouterr().err
    assert main(["init", str(tmp_path), "--mixer", "mamba"]) == 2
    err = capsys.readouterr().err
    assert "unknown mixer 'mamba'" in err and "Traceback" not in err


def test_byte_tokenizer_round_trip_and_left_padding():
    tok = ByteTokenizer()
    text = "naïve — 状態"
    assert tok.decode(tok.encode(text, add_bos=True)) == text
    batch = tok(["ab", "abcd"])
    assert batch["input_ids"].tolist() == [[258, 258, 97, 98], [97, 98, 99, 100]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.skipif(shutil.which("rankdecay") is None, reason="the package is not pip-installed (no console script)")
def test_console_script_is_installed():
    out = subprocess.run(["rankdecay", "info"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("rankdecay ")
    out = subprocess.run([sys.executable, "-m", "rankdecay.cli", "info"], capture_output=True, text=True, check=True)
    assert "execution paths" in out.stdout
