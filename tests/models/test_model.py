"""The language model: gradients, Hugging Face integration, generation, padding, configs."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rankdecay.layers import Cache
from rankdecay.models import MIXERS, RankDecayConfig, RankDecayForCausalLM, output_cache
from rankdecay.models.modeling import CACHE_FIELD

from ..conftest import assert_matches
from .common import random_ids, tiny_model


@pytest.mark.parametrize("mixer", MIXERS)
def test_gradients_reach_every_parameter(mixer):
    model = tiny_model(mixer).train()
    ids = random_ids(2, 37)
    model(ids, labels=ids, use_cache=False).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{mixer}: no gradient for {name}"
        assert torch.isfinite(p.grad).all(), f"{mixer}: non-finite gradient for {name}"
        assert p.grad.abs().sum() > 0, f"{mixer}: zero gradient for {name}"


@pytest.mark.parametrize("mixer", MIXERS)
def test_torch_compile_traces_the_model_whole(mixer):
    """Dynamo traces the training loss in one graph, on the PyTorch paths and on the Triton kernels (each entry point
    an opaque operator, ``ops.triton.opaque``): a break splits ``train --compile``'s graph and can make Dynamo compile
    what follows again at every call (session 64), and ``fullgraph=True`` refuses it. Dynamo alone: no C++
    compiler."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(mixer).train().to(device)
    ids = random_ids(2, 37).to(device)
    torch._dynamo.reset()
    try:
        report = torch._dynamo.explain(lambda x: model(x, labels=x, use_cache=False).loss)(ids)
    finally:
        torch._dynamo.reset()
    assert report.graph_break_count == 0, [r.reason[:400] for r in report.break_reasons]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CPU's PyTorch chunked path walks the chunks in a Python "
                    "loop, which Dynamo unrolls: it compiles again for each number of chunks; the Triton ops' part "
                    "is tests/ops/test_triton.py's symbolic-lengths test, in the interpreter")
@pytest.mark.parametrize("mixer", MIXERS)
def test_torch_compile_takes_new_lengths_in_one_graph(mixer):
    """A compiled training step compiles again at its second sequence length, with the length a symbol (automatic
    dynamic shapes), and not at the lengths after it. Until session 73 the Triton ops' opaque operators read the
    sizes in their fake runs, which made each length a constant of the graph: a compiled model compiled again at
    every new length, and past Dynamo's recompile limit (8) ran eagerly. Lengths of three chunks or more, none a
    multiple of 64 (a size of 1 and a padding of 0 compile apart). Dynamo alone: no C++ compiler."""
    model = tiny_model(mixer).train().cuda()
    step = torch.compile(lambda x: model(x, labels=x, use_cache=False).loss, backend="eager")
    torch._dynamo.reset()
    try:
        for i, T in enumerate((150, 170, 190)):
            with torch._dynamo.config.patch(error_on_recompile=i == 2):
                step(random_ids(2, T).cuda()).backward()
    finally:
        torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the mixers reach the Triton kernels on a CUDA GPU; the "
                    "op's part is tests/ops/test_triton.py's cu_seqlens compile test, in the interpreter")
@pytest.mark.parametrize("mixer", MIXERS)
def test_torch_compile_takes_new_packings_in_one_graph(mixer):
    """A compiled training step over packed documents (``cu_seqlens``, as ``rankdecay train --pack varlen`` gives
    them) makes one graph, and compiles again at its second packing (the number of sequences a symbol) and not at the
    third. Until session 74 the mixers' ops read the lengths on the host: a graph break in every layer and a compile
    per packing until Dynamo's recompile limit. Dynamo alone: no C++ compiler."""
    model = tiny_model(mixer).train().cuda()
    step = torch.compile(lambda x, cu: model(x, labels=x, cu_seqlens=cu, use_cache=False).loss, backend="eager",
                         fullgraph=True)
    torch._dynamo.reset()
    try:
        for i, lengths in enumerate([[70, 30, 50, 106], [20, 100, 100, 16, 20], [128, 64, 64]]):
            cu = torch.tensor([0] + lengths).cumsum(0).cuda()
            with torch._dynamo.config.patch(error_on_recompile=i == 2):
                step(random_ids(1, 256).cuda(), cu).backward()
    finally:
        torch._dynamo.reset()


def test_labels_are_shifted_and_ignore_index():
    model = tiny_model("gdn")
    ids = random_ids(2, 12)
    labels = ids.clone()
    labels[:, :4] = -100
    out = model(ids, labels=labels, use_cache=False)
    # position t predicts token t + 1; labels -100 at 0..3 leave tokens 4.. as targets
    ref = torch.nn.functional.cross_entropy(out.logits[:, 3:-1].reshape(-1, out.logits.shape[-1]),
                                            ids[:, 4:].reshape(-1))
    assert torch.allclose(out.loss, ref, atol=1e-6)
    with pytest.raises(ValueError, match=r"labels must be \[B, T\] = \[2, 12\], as the inputs; got \[2, 11\]"):
        model(ids, labels=labels[:, 1:])


@pytest.mark.parametrize("fused", [False, True])
def test_num_items_in_batch_as_transformers_trainer_passes_it(fused):
    """transformers' Trainer sees ``**kwargs`` in the forward, passes ``num_items_in_batch`` (the targets of every
    batch it accumulates) and leaves the loss undivided by the accumulation steps: the accumulated batches' losses
    must add up to the whole batch's mean (the mean of each was the steps' count too large)."""
    import inspect

    model = tiny_model("gdn", fuse_linear_cross_entropy=fused).train()
    assert any(p.kind == p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    ids = random_ids(4, 12)
    labels = ids.clone()
    labels[0, :5] = labels[3, 7:] = -100
    whole = model(ids, labels=labels).loss
    n = (labels[:, 1:] != -100).sum()
    for count in (n, int(n)):
        parts = sum(model(ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=count).loss for i in (0, 2))
        assert_matches(parts, whole, 1e-6)
    with pytest.raises(ValueError, match="num_items_in_batch divides the loss's sum in place of the mean"):
        model(ids, labels=labels, num_items_in_batch=n, loss_reduction="sum")


def test_transformers_trainer_accumulates_gradients_as_one_batch(tmp_path):
    """transformers' Trainer (SGD, no clipping): one step over 4 rows equals one over 2 x 2 accumulated rows, with
    gradient checkpointing too (before ``num_items_in_batch`` was honoured, the accumulated step was twice as large,
    and checkpointing raised)."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (in the test extra)")
    import copy

    from transformers import Trainer, TrainingArguments

    base = tiny_model("gdn+attn").train()
    ids = random_ids(4, 16)
    labels = ids.clone()
    labels[:, :3] = -100
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]

    # transformers 5.24 renamed the argument (the old name warns)
    fields = TrainingArguments.__dataclass_fields__
    checkpoint_arg = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"

    def update(batch, steps, checkpointing=False):
        model = copy.deepcopy(base)
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=steps, max_steps=1, learning_rate=1.0, optim="sgd",
                                 lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, **{checkpoint_arg: checkpointing})
        collate = lambda b: {key: torch.stack([row[key] for row in b]) for key in b[0]}  # noqa: E731
        Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
        assert model.model.gradient_checkpointing == checkpointing
        return torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), base.parameters())])

    one = update(4, 1)
    assert one.norm() > 0
    assert_matches(update(2, 2), one, 1e-5, "accumulated")
    assert_matches(update(2, 2, checkpointing=True), one, 1e-5, "accumulated, with gradient checkpointing")


@pytest.mark.parametrize("mixer", ["gdn", "gdn+attn"])
def test_hidden_states_and_tuples_as_transformers_gives_them(mixer):
    """``output_hidden_states``: each layer's input and the final norm's output (N + 1), in a forward and in
    ``generate``; ``return_dict=False``: the output's tuple."""
    model = tiny_model(mixer)
    ids = random_ids(2, 12)
    out = model(ids, labels=ids, output_hidden_states=True, output_attentions=True)
    hidden, layers = out.hidden_states, model.model.layers
    assert len(hidden) == len(layers) + 1 and out.attentions is None
    assert torch.equal(hidden[0], model.get_input_embeddings()(ids))
    for i, layer in enumerate(layers[:-1]):
        assert_matches(layer(hidden[i]), hidden[i + 1], 1e-6, f"layer {i}")
    assert_matches(model.model.norm(layers[-1](hidden[-2])), hidden[-1], 1e-6, "final norm")
    assert torch.equal(model.lm_head(hidden[-1]), out.logits)
    assert model(ids, labels=ids).hidden_states is None

    as_tuple = model(ids, labels=ids, return_dict=False)  # loss, logits, cache
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 3 and isinstance(as_tuple[2], Cache)
    assert torch.equal(as_tuple[0], out.loss) and torch.equal(as_tuple[1], out.logits)

    gen = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         output_hidden_states=True, output_logits=True)
    assert len(gen.hidden_states) == 3
    for step, (states, logits) in enumerate(zip(gen.hidden_states, gen.logits)):
        assert len(states) == len(layers) + 1 and states[-1].shape[1] == (12 if step == 0 else 1)
        assert_matches(model.lm_head(states[-1][:, -1]), logits, 1e-6, f"step {step}")


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "gdn+attn"])
def test_generate_continues_from_the_cache_it_returned(mixer):
    """A second turn: ``generate`` given the first turn's cache and the whole conversation (a left-padded batch)
    feeds only the new tokens and decodes as from scratch (it raised on the cache's missing attributes)."""
    model = tiny_model(mixer)
    ids, mask = random_ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    kw = dict(do_sample=False, pad_token_id=258, eos_token_id=[])
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **kw)
    cache = output_cache(first)
    assert isinstance(cache, Cache) and cache.get_seq_length() == 9 + 3
    turn = torch.cat([first.sequences, random_ids(2, 5, seed=7)], 1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - 9, dtype=torch.long)], 1)
    fed = []
    hook = model.model.embeddings.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    try:
        got = model.generate(turn, attention_mask=turn_mask, max_new_tokens=6, **{CACHE_FIELD: cache}, **kw)
    finally:
        hook.remove()
    assert fed[0] == turn.shape[1] - 12, f"the continued prompt fed {fed[0]} tokens, not the {turn.shape[1] - 12} new"
    assert torch.equal(got, model.generate(turn, attention_mask=turn_mask, max_new_tokens=6, **kw))


@pytest.mark.parametrize("mixer", ["gdn", "hh-gdn", "hdla"])
def test_save_pretrained_round_trip(tmp_path, mixer):
    model = tiny_model(mixer)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert AutoConfig.from_pretrained(tmp_path).mixer == mixer
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is RankDecayForCausalLM
    ids = random_ids(2, 20)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embeddings.weight.data_ptr()


def _manual_greedy(model, ids, steps, eos=257, pad=258):
    """Greedy decoding with the cache; rows that emitted eos continue with pad, as generate() does."""
    out = model(ids, use_cache=True)
    done = torch.zeros(ids.shape[0], 1, dtype=torch.bool)
    tokens = []
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True).masked_fill(done, pad)
        tokens.append(nxt)
        done |= nxt == eos
        if done.all():
            break
        out = model(nxt, past_key_values=output_cache(out), use_cache=True)
    return torch.cat([ids, *tokens], 1)


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "gdp", "swa"])
def test_generate_greedy_equals_manual_loop(mixer):
    model = tiny_model(mixer)
    ids = random_ids(2, 9)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=258)
        ref = _manual_greedy(model, ids, 40)
    assert torch.equal(got, ref)
    assert len(set(got[0, 9:].tolist())) > 1, "the test model should not emit a constant"


@pytest.mark.parametrize("mixer,overrides", [
    ("gdn", {}), ("hh-gdn", {}), ("swa", {}),
    # the settings fla's checkpoints convert with (rankdecay.models.convert)
    ("deltanet", {"use_output_gate": False}), ("gdp", {"use_forget_gate": False, "num_householder": 3}),
    ("gla", {"use_short_conv": False, "qkv_activation": None}), ("gdn", {"output_gate_act": "sigmoid"}),
    ("kda", {"output_gate_act": "sigmoid", "output_gate_rank": 16, "gate_lower_bound": -5.0}),
])
def test_generate_sampling_uses_the_cache_correctly(mixer, overrides):
    """With sampling, each step's logits equal a full forward over the sampled sequence."""
    model = tiny_model(mixer, **overrides)
    ids = random_ids(2, 7)
    with torch.no_grad():
        torch.manual_seed(3)
        out = model.generate(ids, max_new_tokens=45, do_sample=True, top_k=0, temperature=1.0,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=258)
        torch.manual_seed(3)
        again = model.generate(ids, max_new_tokens=45, do_sample=True, top_k=0, temperature=1.0, pad_token_id=258)
        full = model(out.sequences, use_cache=False).logits
    assert torch.equal(out.sequences, again), "the same seed must give the same sample"
    step_logits = torch.stack(out.logits, 1)  # [B, new, vocab]
    assert_matches(step_logits, full[:, 6:-1], 1e-5)


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "gla", "swa"])
def test_left_padded_batch_equals_each_prompt_alone(mixer):
    model = tiny_model(mixer)
    lengths = (11, 4, 8)
    prompts = [random_ids(1, n, seed=10 + n) for n in lengths]
    L = max(lengths)
    ids = torch.full((len(prompts), L), 258)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - p.shape[1]:] = p[0]
        mask[i, L - p.shape[1]:] = 1
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=258, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kw)
        for i, p in enumerate(prompts):
            alone = model.generate(p, **kw)
            assert torch.equal(batch.sequences[i, L:], alone.sequences[0, p.shape[1]:]), f"{mixer}: prompt {i}"
            assert_matches(torch.stack(batch.logits, 1)[i], torch.stack(alone.logits, 1)[0], 1e-5, f"{mixer}: {i}")


def test_hybrid_stack_gdn_h1():
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "swa"], initializer_range=0.2)
    model = RankDecayForCausalLM(config).eval()
    assert [layer.mixer_name for layer in model.model.layers] == ["gdn", "swa"]
    ids = random_ids(1, 50)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :30], use_cache=True)
        cache = output_cache(out)
        steps = [out.logits]
        for t in range(30, 50):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert_matches(torch.cat(steps, 1), full, 1e-5)
    swa_cache = cache.layers[1]
    assert swa_cache["k"].shape[1] == config.swa_window, "the SWA cache must stay bounded (a ring of a window)"


@pytest.mark.parametrize("mixer", ["gdn", "gdn+attn"])
@pytest.mark.parametrize("use_cache", [False, None, True])
def test_gradient_checkpointing_gives_the_same_gradients(mixer, use_cache):
    """With the config's default (``use_cache=None`` -> True) too, as transformers' Trainer calls it: the backward
    runs each layer again, which must not read a cache the forward wrote (it raised, or read the wrong state)."""
    model = tiny_model(mixer).train()
    ids = random_ids(2, 30)
    model(ids, labels=ids, use_cache=False).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    out = model(ids, labels=ids, use_cache=use_cache)
    out.loss.backward()
    assert output_cache(out) is None, "a checkpointed training forward returns no cache"
    for n, p in model.named_parameters():
        assert_matches(p.grad, ref[n], 1e-5, n)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mixer="hh-gdn", hidden_size=64, num_heads=2, hh_rank=3), "hh_rank 3 must divide head_k_dim 32"),
    (dict(mixer="mamba"), "unknown mixer 'mamba'"),
    (dict(layer_mixers=["gdn", "transformer"], num_hidden_layers=2), "unknown mixer 'transformer'"),
    (dict(hidden_size=100, num_heads=3), "hidden_size 100 is not divisible by num_heads 3"),
    (dict(layer_mixers=["gdn"], num_hidden_layers=2), "layer_mixers has 1 entries"),
    (dict(mixer="hh-dn", hh_mask="dynamic"), "hh_mask must be 'static' or 'data'"),
    (dict(output_gate_act="gelu"), "output_gate_act must be None \\(each mechanism's\\), 'silu' or 'sigmoid'"),
])
def test_bad_configs_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankDecayConfig(**{"hidden_size": 64, "num_heads": 2, "num_hidden_layers": 2, **kwargs})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        RankDecayConfig.from_preset("huge")


@pytest.mark.parametrize("mixer", MIXERS)
def test_num_params_and_flops(mixer):
    model = tiny_model(mixer)
    counted = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.num_params() == counted
    emb = model.model.embeddings.weight.numel()
    assert model.num_params(exclude_embeddings=True) == counted - emb
    short, long = model.flops_per_token(seq_len=64), model.flops_per_token(seq_len=4096)
    assert 2 * model.num_params(exclude_embeddings=True) * 3 < short <= long
    assert model.flops_per_token(training=False) * 3 == pytest.approx(model.flops_per_token(training=True))


@pytest.mark.parametrize("preset, nominal, tol", [("340m", 340e6, 0.02), ("1.3b", 1.3e9, 0.06)])
def test_paper_presets_have_the_papers_sizes(preset, nominal, tol):
    """Head-in-Head Table 9 shapes with a 4d² mixer; HH-GDN adds only H r² per layer."""
    def build(mixer, **kw):
        with torch.device("meta"):
            return RankDecayForCausalLM(RankDecayConfig.from_preset(preset, mixer=mixer, **kw))

    gdn, hh = build("gdn"), build("hh-gdn", hh_rank=4)
    assert abs(gdn.num_params() / nominal - 1) < tol, gdn.num_params()
    config = gdn.config
    assert hh.num_params() - gdn.num_params() == config.num_hidden_layers * config.num_heads * 16


@pytest.mark.parametrize("mixer", ["gdn", "gdn+attn"])
def test_block_norms_under_autocast_give_the_same_logits(mixer):
    """A block's norms write autocast's dtype under autocast (``RMSNorm.autocast_output``) instead of leaving each
    linear map to cast them: the logits are the same to the bit, and the gradients, whose maps' input gradients are
    now summed in bf16, are as close to the fp32 model's as before: on average over the parameters within 5 %, each
    within 1.5x (a gradient term lost would be off by its whole size, 10-20x bf16's error here)."""
    from rankdecay.layers.modules import RMSNorm

    model = tiny_model(mixer).train()
    ids = random_ids(2, 30)
    norms = [m for n, m in model.named_modules() if n.endswith(("attn_norm", "mlp_norm"))]
    assert norms and all(isinstance(m, RMSNorm) and m.autocast_output for m in norms)
    model(ids, labels=ids).loss.backward()
    exact = {n: p.grad.clone() for n, p in model.named_parameters()}
    runs = []
    for on in (True, False):
        for m in norms:
            m.autocast_output = on
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits, grads), (logits_cast, grads_cast) = runs
    assert torch.equal(logits, logits_cast)
    ratios = {}
    for n, want in exact.items():
        err, before = (((g[n] - want).norm() / want.norm()).item() for g in (grads, grads_cast))
        ratios[n] = err / before
    # bf16 rounding: each parameter's error moves by a few % either way (0.97-1.16 measured), on average not at all
    mean = sum(ratios.values()) / len(ratios)
    assert mean < 1.05 and max(ratios.values()) < 1.5, (mean, max(ratios.items(), key=lambda kv: kv[1]))


@pytest.mark.parametrize("mixer", ["gdn", "hdla"])
def test_training_forward_with_the_cache_on_takes_the_chunked_path(mixer, monkeypatch):
    """A training forward of <= 64 tokens that leaves ``use_cache`` on (the config's default, as transformers'
    Trainer calls the model) runs the chunked path, not the per-token loop (on a GPU that loop is PyTorch's under
    autograd): the same loss and gradients as with ``use_cache=False``; without autograd a cache still takes the
    per-token path."""
    from rankdecay.layers import mixers

    model = tiny_model(mixer).train()
    ids = random_ids(2, 40)
    model(ids, labels=ids, use_cache=False).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []
    recurrent = mixers._recurrent_mode
    monkeypatch.setattr(mixers, "_recurrent_mode", lambda x: calls.append(1) or recurrent(x))
    out = model(ids, labels=ids)
    assert output_cache(out) is not None and not calls
    out.loss.backward()
    for n, p in model.named_parameters():
        assert_matches(p.grad, want[n], 1e-6, n)
    with torch.no_grad():
        model(ids)
    assert len(calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn", "attn"])
def test_the_model_runs_on_the_meta_device(mixer):
    """A forward of a model on the meta device (shapes only, as memory planners and FLOP counters run it) gives the
    logits' shape: nothing on the way asks the meta device for what it cannot have (autocast's state: the block
    norms asked it once, which raised)."""
    model = tiny_model(mixer).to("meta")
    ids = torch.zeros(2, 10, dtype=torch.long, device="meta")
    assert model(ids, labels=ids, use_cache=False).logits.shape == (2, 10, model.config.vocab_size)
