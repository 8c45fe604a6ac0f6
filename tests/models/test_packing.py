"""Packed projections (rankdecay.layers.packing): a decode step's linear maps of one input as one product."""
import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rankdecay.layers import Cache, PackedLinears, pack
from rankdecay.models import GraphDecoder, RankDecayConfig, RankDecayForCausalLM

from ..conftest import assert_matches
from .common import LINEAR_MIXERS, random_ids, tiny_model


def _model(kind: str) -> RankDecayForCausalLM:
    if kind == "gdn+swa":
        torch.manual_seed(0)
        return RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "swa"],
                                                                initializer_range=0.2)).eval()
    if kind == "hh-gdn-data":
        return tiny_model("hh-gdn", hh_mask="data")
    if kind == "kda-kimi":  # fla's KDA: a sigmoid output gate through a low-rank map with a bias, a bounded decay
        model = tiny_model("kda", output_gate_act="sigmoid", output_gate_rank=16, gate_lower_bound=-5.0)
        for layer in model.model.layers:
            nn.init.normal_(layer.mixer.g_proj[1].bias, 0, 0.5)
        return model
    if kind == "gla-bias":  # a pack with a bias (the gate's low-rank first map gets one here)
        model = tiny_model("gla")
        for layer in model.model.layers:
            old = layer.mixer.gk_proj[0]
            layer.mixer.gk_proj[0] = nn.Linear(old.in_features, old.out_features, bias=True)
            nn.init.normal_(layer.mixer.gk_proj[0].bias, 0, 0.5)
        return model
    return tiny_model(kind)


def _count_calls(model) -> dict:
    """Calls of every linear map a pack would take, by module."""
    calls = {}
    for layer in model.model.layers:
        for module in (layer.mixer, layer.mlp):
            for name in module.input_projections():
                sub = module.get_submodule(name)
                calls[sub] = 0
                sub.register_forward_hook(lambda m, *_: calls.__setitem__(m, calls[m] + 1))
    return calls


@pytest.mark.parametrize("kind", list(LINEAR_MIXERS) + ["swa", "gdn+swa", "hh-gdn-data", "gla-bias"])
def test_packed_step_takes_one_product_and_decodes_as_separate_maps(kind):
    """With the packs no separate map of the input runs in a step, and the step's logits are the separate maps'
    (fp32; one product against the stacked weights rounds as the separate ones up to accumulation order)."""
    model = _model(kind)
    ids = random_ids(2, 9)
    packed, plain = GraphDecoder(model, cuda_graph=False), GraphDecoder(model, cuda_graph=False, pack_projections=False)
    calls = _count_calls(model)
    with torch.no_grad():
        for decoder in (packed, plain):
            decoder.prefill(ids)
        for n in calls:
            calls[n] = 0
        token = ids[:, -1]
        for _ in range(4):
            got = packed.step(token).clone()
            assert not any(calls.values()), "a separate projection ran in a packed step"
            want = plain.step(token)
            assert all(calls.values()), "without packs every projection runs"
            for n in calls:
                calls[n] = 0
            assert_matches(got, want, 1e-5, kind)
            token = want.argmax(-1)
    layer = packed._packs[0]
    assert layer["mlp"] is not None and layer["mixer"] is not None, kind
    assert set(layer["mixer"].names) == set(model.model.layers[0].mixer.input_projections())


def test_packs_follow_weights_changed_between_generations():
    """Weights changed in place, replaced (a new tensor) or resized between two generations: the packed decoder
    gives what a decoder without packs gives, and records the step again where a tensor moved."""
    model = tiny_model("hdla")
    ids = random_ids(2, 7)
    kw = dict(max_new_tokens=12, eos_token_id=[])
    decoder = GraphDecoder(model, cuda_graph=False)
    first = decoder.generate(ids, **kw)
    mixer = model.model.layers[0].mixer
    key = decoder._key
    with torch.no_grad():
        mixer.q_proj.weight.mul_(-1.5)  # in place: the same storage, a new version
        mixer.lambda_proj.bias.add_(3.0)  # a bias too
    changed = decoder.generate(ids, **kw)
    assert decoder._key == key, "an in-place change needs no new recording"
    assert torch.equal(changed, GraphDecoder(model, cuda_graph=False, pack_projections=False).generate(ids, **kw))
    assert not torch.equal(changed, first), "the change should change the tokens"
    with torch.no_grad():
        up = model.model.layers[1].mlp.up_proj
        up.weight = nn.Parameter(torch.randn_like(up.weight))
    moved = decoder.generate(ids, **kw)
    assert decoder._key != key, "a moved weight records the step again"
    assert torch.equal(moved, GraphDecoder(model, cuda_graph=False, pack_projections=False).generate(ids, **kw))

    class Shifted(nn.Linear):  # a map with a forward of its own (as a LoRA wrapper): it cannot be packed
        def forward(self, x):
            return super().forward(x) + 0.5

    k = mixer.k_proj
    mixer.k_proj = Shifted(k.in_features, k.out_features, bias=False)
    mixer.k_proj.load_state_dict(k.state_dict())
    wrapped = decoder.generate(ids, **kw)
    assert decoder._packs[0]["mixer"] is None and decoder._packs[1]["mixer"] is not None
    assert torch.equal(wrapped, GraphDecoder(model, cuda_graph=False, pack_projections=False).generate(ids, **kw))
    assert not torch.equal(wrapped, moved), "the wrapper should change the tokens"
    mixer.k_proj = k
    decoder.generate(ids, **kw)
    assert decoder._packs[0]["mixer"] is not None, "packed again once it can be"
    old_pack = decoder._packs[0]["mixer"]
    model.model.layers[0].mixer = type(mixer)(mixer.hidden_size, mixer.num_heads, mixer.head_k_dim,
                                              mixer.head_v_dim, layer_idx=mixer.layer_idx).eval()
    replaced = decoder.generate(ids, **kw)
    assert decoder._packs[0]["mixer"] is not old_pack, "a replaced module is packed anew"
    assert torch.equal(replaced, GraphDecoder(model, cuda_graph=False, pack_projections=False).generate(ids, **kw))


def test_packs_are_not_used_with_autograd():
    """A cache with packs under autograd: every map runs on its own, so gradients reach the weights."""
    model = tiny_model("gdn")
    decoder = GraphDecoder(model, cuda_graph=False)
    decoder.generate(random_ids(1, 5), max_new_tokens=2, eos_token_id=[])
    cache = Cache(len(model.model.layers))
    cache.projections = decoder._packs
    calls = _count_calls(model)
    model(random_ids(1, 3), past_key_values=cache, use_cache=True).logits.sum().backward()
    assert all(calls.values())
    mixer = model.model.layers[0].mixer
    assert mixer.q_proj.weight.grad is not None and model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_pack_refuses_what_it_cannot_pack_and_refresh_reallocates_on_new_shapes():
    module = nn.Module()
    module.a, module.b = nn.Linear(8, 3), nn.Linear(8, 5, bias=False)
    packed = pack(module, ["a", "b"])
    assert isinstance(packed, PackedLinears) and packed.weight.shape == (8, 8) and packed.bias is not None
    x = torch.randn(4, 8)
    out = packed(x)
    assert_matches(out["a"], module.a(x), 1e-6, "a")
    assert_matches(out["b"], module.b(x), 1e-6, "b")
    assert not packed.refresh(), "nothing changed"
    module.b = nn.Linear(8, 2)
    assert packed.refresh(), "a new shape allocates anew"
    assert packed.weight.shape == (5, 8) and torch.equal(packed.bias[3:], module.b.bias.detach())
    assert pack(module, ["a"]) is None, "one map: nothing to pack"
    module.c = nn.Linear(7, 3)
    assert pack(module, ["a", "c"]) is None, "different input widths"
    module.d = nn.Linear(8, 3).double()
    assert pack(module, ["a", "d"]) is None, "different dtypes"

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    module.e = Scaled(8, 3)
    assert pack(module, ["a", "e"]) is None, "a subclass with a forward of its own"
    with pytest.raises(ValueError, match="pack_projections must be True or False"):
        GraphDecoder(tiny_model("gdn"), cuda_graph=False, pack_projections="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (recorded in BENCHMARKS.md)")
@pytest.mark.parametrize("B, compile", [(3, False), (1, False), (1, True)])
def test_packed_cuda_graph_decodes_as_the_unpacked_one_and_records_again_when_a_weight_moves(B, compile):
    """On a GPU: the packed CUDA graph gives the unpacked graph's tokens (fp32), also after a weight changed in
    place (read by the recorded graph through the refreshed pack) and after one moved (recorded again). At B = 1
    the packed products and the output maps take the one-row kernel, in the compiled graph too."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = RankDecayConfig.from_preset("tiny", layer_mixers=["gdn", "hdla", "hh-gdn", "swa"], num_hidden_layers=4,
                                         hh_rank=2, initializer_range=0.2)
    model = RankDecayForCausalLM(config).cuda().eval()
    ids = random_ids(B, 20).cuda()
    kw = dict(max_new_tokens=24, eos_token_id=[])
    packed = GraphDecoder(model, compile=compile)
    for step in range(3):
        got = packed.generate(ids, **kw)
        assert packed._graph is not None
        assert torch.equal(got, GraphDecoder(model, pack_projections=False).generate(ids, **kw)), step
        with torch.no_grad():
            mixer = model.model.layers[step].mixer
            if step == 0:
                mixer.v_proj.weight.mul_(-1)
            else:
                mixer.q_proj.weight = nn.Parameter(mixer.q_proj.weight * 1.5)


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                            reason="triton is not installed (pip install triton)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under TRITON_INTERPRET=1


@TRITON
@pytest.mark.parametrize("N, K", [(1, 1), (7, 33), (50, 300), (5, 2100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_kernel_matches_f_linear(N, K, dtype, bias):
    """The one-row kernel against F.linear in fp64: odd N (a half-filled last program), K below, at and above one
    1024-wide slice (a partial last slice), bf16 and fp32, with and without a bias; the weight a row slice of a
    wider matrix (strided rows)."""
    from rankdecay.ops.triton.gemv import gemv

    gen = torch.Generator().manual_seed(N * 7 + K)
    wide = torch.randn(N, K + 5, generator=gen).to(DEVICE, dtype)
    w = wide[:, 3:K + 3]
    x = torch.randn(K, generator=gen).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype) if bias else None
    got = gemv(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (N,)
    # fp32 accumulation; the result rounded once to dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert_matches(got.double(), want, tol, f"{N} x {K} {dtype}")


@TRITON
def test_gemv_kernel_refuses_what_it_cannot_take():
    from rankdecay.ops.triton.gemv import gemv

    with pytest.raises(ValueError, match="one contiguous row"):
        gemv(torch.randn(2, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.randn(8, device=DEVICE), torch.randn(8, 3, device=DEVICE).t())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-row kernel's route needs a GPU (BENCHMARKS.md)")
def test_decode_linear_takes_the_kernel_for_one_row_on_a_gpu(monkeypatch):
    """decode_linear: one row without autograd on a GPU goes through the kernel (and gives F.linear's result);
    several rows, autograd and the CPU go to F.linear."""
    from rankdecay.layers import packing

    calls = []
    kernel = packing._gemv
    monkeypatch.setattr(packing, "_gemv", lambda *a: calls.append(1) or kernel(*a))
    w, b = torch.randn(40, 64, device="cuda"), torch.randn(40, device="cuda")
    with torch.no_grad():
        x = torch.randn(1, 1, 64, device="cuda")
        assert_matches(packing.decode_linear(x, w, b), F.linear(x, w, b), 1e-5, "one row")
        assert len(calls) == 1
        packing.decode_linear(torch.randn(2, 1, 64, device="cuda"), w, b)
        packing.decode_linear(x.cpu(), w.cpu(), b.cpu())
    packing.decode_linear(x, w, b)
    assert len(calls) == 1


@TRITON
@pytest.mark.parametrize("K, G", [(64, 32), (96, 32), (2048, 256)])
@pytest.mark.parametrize("x_act, u_act, norm", [(None, None, False), (None, "silu", False), ("silu", None, False),
                                                 (None, "silu", True), (None, None, True), (None, "sigmoid", True),
                                                 (None, "sigmoid", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_prologue_matches_its_pytorch_form(K, G, x_act, u_act, norm, dtype):
    """The kernel's prologue, W (pre(x) * post(u)) + b, against fp64 PyTorch: a mixer's output norm per head with
    its gate (silu, or Kimi Linear's sigmoid), the gate alone (silu, sigmoid or linear), a SwiGLU's silu(gate) * up. K = 96 leaves a slice with a group wholly
    past K (masked, its statistic 0, its share 0); 2048 takes two slices of whole groups."""
    from rankdecay.ops.triton.gemv import gemv

    gen = torch.Generator().manual_seed(K + G)
    N = 5
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    x, u, nw = torch.randn(K, generator=gen) * 3, torch.randn(K, generator=gen), torch.randn(G, generator=gen)
    with_u = u_act is not None or not norm and x_act is None  # the linear gate, or silu(u)
    kw = dict(x_act="rms_norm", norm_weight=nw.to(DEVICE)) if norm else dict(x_act=x_act)
    got = gemv(x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype),
               u=u.to(DEVICE, dtype) if with_u else None, u_act=u_act, **kw)
    xd, ud = x.to(dtype).double(), u.to(dtype).double()
    pre = (F.rms_norm(xd.view(-1, G), (G,), nw.double(), 1e-6).view(-1) if norm
           else F.silu(xd) if x_act == "silu" else xd)
    post = ({"silu": F.silu, "sigmoid": torch.sigmoid}.get(u_act, lambda t: t)(ud)) if with_u else 1.0
    want = F.linear(pre * post, w.to(dtype).double(), b.to(dtype).double())
    assert got.dtype == dtype
    assert_matches(got.double().cpu(), want, 1e-5 if dtype == torch.float32 else 8e-3, f"{K} {G} {x_act} {u_act} {norm}")


@TRITON
@pytest.mark.parametrize("K", [64, 96, 2100])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_row_norm_with_residual_matches_its_pytorch_form(K, add, dtype):
    """A block's first product: W rms_norm(x + r) + b with the norm over the whole row and x + r written out (by
    the first program, rounded to x's dtype as PyTorch's sum), against fp64. K = 96 masks part of its one slice;
    2100 spans three slices, so the row's statistic gathers over them."""
    from rankdecay.ops.triton.gemv import gemv

    gen = torch.Generator().manual_seed(K + add)
    N = 7
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    x, r, nw = torch.randn(K, generator=gen) * 3, torch.randn(K, generator=gen), 0.5 + torch.rand(K, generator=gen)
    x, r = x.to(dtype), r.to(dtype)
    s = torch.full((K,), float("nan"), dtype=dtype, device=DEVICE)
    got = gemv(x.to(DEVICE), w.to(DEVICE, dtype), b.to(DEVICE, dtype), x_act="rms_norm_row", norm_weight=nw.to(DEVICE),
               eps=1e-5, residual=r.to(DEVICE) if add else None, out_sum=s if add else None)
    xs = (x + r if add else x).double()  # (x + r rounded to dtype)
    want = F.linear(F.rms_norm(xs, (K,), nw.double(), 1e-5), w.to(dtype).double(), b.to(dtype).double())
    assert got.dtype == dtype
    assert_matches(got.double().cpu(), want, 1e-5 if dtype == torch.float32 else 8e-3, f"{K} {add} {dtype}")
    if add and (dtype == torch.float32 or DEVICE == "cuda"):
        assert torch.equal(s.cpu(), x + r), "the sum written out is not x + r"
    elif add:  # Triton's interpreter rounds fp32 to bf16 by truncation: within one unit of bf16's last place
        assert torch.allclose(s.float(), (x + r).float(), rtol=2 ** -7, atol=0), "the sum written out is not x + r"


@TRITON
def test_gemv_prologue_refuses_what_it_cannot_take():
    from rankdecay.ops.triton.gemv import gemv

    x, w = torch.randn(64, device=DEVICE), torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x_act must be"):
        gemv(x, w, x_act="gelu")
    with pytest.raises(ValueError, match="a power of two dividing K"):
        gemv(x, w, x_act="rms_norm", norm_weight=torch.ones(24, device=DEVICE))
    with pytest.raises(ValueError, match="a power of two dividing K"):
        gemv(x, w, x_act="rms_norm")
    with pytest.raises(ValueError, match="u must be one contiguous row"):
        gemv(x, w, u=torch.randn(32, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight \\[K = 64\\]"):
        gemv(x, w, x_act="rms_norm_row", norm_weight=torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match="residual and out_sum"):
        gemv(x, w, x_act="rms_norm_row", norm_weight=torch.ones(64, device=DEVICE), residual=torch.randn(64, device=DEVICE))
    with pytest.raises(ValueError, match="a tensor of its own"):
        gemv(x, w, residual=torch.randn(64, device=DEVICE), out_sum=x)


@TRITON
@pytest.mark.parametrize("kind", ["gdn", "hdla", "hh-gdn", "gla", "kda", "kda-kimi", "gdn+swa"])
def test_one_row_steps_take_norms_and_gates_inside_the_products(kind, monkeypatch):
    """A B = 1 packed step on the GPU's route (on a GPU, or forced on the CPU with the kernels interpreted): each
    block's residual adds and input norms go into its packed products (the add written out as the residual stream,
    the norm over the whole row), the mixers' output norm and gate and the SwiGLU's silu(gate) * up into their output
    maps' kernel, so no RMSNorm runs but the final one; the logits are those of the step without packs (fp32),
    over steps that carry the last add from block to block. Two rows keep the separate kernels."""
    from rankdecay.layers import modules, packing

    model = _model(kind).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():  # weights of their own, so that a norm's weight left out shows
        if isinstance(module, modules.RMSNorm):
            module.weight.data.copy_(0.5 + torch.rand(module.weight.shape, generator=gen))
    ids = random_ids(1, 9).to(DEVICE)
    calls = {"prologue": 0, "row_norm": 0, "add": 0, "gated_norm": 0, "norm": 0}
    kernel = packing._gemv

    def gemv(*a, **kw):
        calls["prologue"] += bool(kw.get("u") is not None or kw.get("x_act"))
        calls["row_norm"] += kw.get("x_act") == "rms_norm_row"
        calls["add"] += kw.get("residual") is not None
        return kernel(*a, **kw)

    monkeypatch.setattr(packing, "_on_kernel_device", lambda x: True)
    monkeypatch.setattr(packing, "_gemv", gemv)
    def counted(forward, key):  # GatedRMSNorm's own forward (its kernel on a GPU, else RMSNorm's and the gate)
        def run(self, *a):
            calls[key] += key == "gated_norm" or type(self) is not modules.GatedRMSNorm
            return forward(self, *a)
        return run

    monkeypatch.setattr(modules.RMSNorm, "forward", counted(modules.RMSNorm.forward, "norm"))
    monkeypatch.setattr(modules.GatedRMSNorm, "forward", counted(modules.GatedRMSNorm.forward, "gated_norm"))
    packed, plain = GraphDecoder(model, cuda_graph=False), GraphDecoder(model, cuda_graph=False, pack_projections=False)
    layers = model.config.num_hidden_layers
    mixers = sum(hasattr(layer.mixer, "o_norm") or getattr(layer.mixer, "use_output_gate", False)
                 for layer in model.model.layers)
    gated_norms = sum(isinstance(getattr(layer.mixer, "o_norm", None), modules.GatedRMSNorm)
                      for layer in model.model.layers)
    with torch.no_grad():
        packed.prefill(ids), plain.prefill(ids)
        token = ids[:, -1]
        for _ in range(3):
            calls.update(prologue=0, row_norm=0, add=0, gated_norm=0, norm=0)
            got = packed.step(token).clone()
            # each block: its two packed products (norm; the add but in the first) and its two output maps
            assert calls == {"prologue": 3 * layers + mixers, "row_norm": 2 * layers, "add": 2 * layers - 1,
                             "gated_norm": 0, "norm": 1}, calls
            calls.update(norm=0, gated_norm=0)
            want = plain.step(token)
            assert calls["norm"] == 2 * layers + 1 and calls["gated_norm"] == gated_norms, calls
            assert_matches(got, want, 1e-5, kind)
            token = want.argmax(-1)
    calls.update(prologue=0)
    two = GraphDecoder(model, cuda_graph=False)
    with torch.no_grad():
        two.prefill(random_ids(2, 9).to(DEVICE))
        two.step(torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert calls["prologue"] == 0, "two rows take F.linear and the separate kernels"


@TRITON
def test_decode_benchmark_turns_the_prologues_off(monkeypatch):
    """``benchmarks/decode_gpu.py --no-fused-norms`` (the "off" side of an A/B of the prologues): every call site it
    names exists, and with them patched a packed B = 1 step on the one-row route takes no prologue and still gives
    the unpacked step's logits."""
    import importlib

    from benchmarks import decode_gpu
    from rankdecay.layers import packing

    for module_name, attr in decode_gpu.FUSED:  # each call site exists; undone at the end of the test
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"decode_gpu.FUSED names {module_name}.{attr}, which no longer exists"
        monkeypatch.setattr(module, attr, getattr(module, attr))
    assert decode_gpu.no_fused_norms() == [f"{m}.{a}" for m, a in decode_gpu.FUSED]
    prologues = []
    kernel = packing._gemv
    monkeypatch.setattr(packing, "_on_kernel_device", lambda x: True)
    monkeypatch.setattr(packing, "_gemv", lambda *a, **kw: prologues.append(kw) or kernel(*a, **kw))
    model = _model("gdn").to(DEVICE)
    ids = random_ids(1, 9).to(DEVICE)
    packed, plain = GraphDecoder(model, cuda_graph=False), GraphDecoder(model, cuda_graph=False, pack_projections=False)
    with torch.no_grad():
        packed.prefill(ids), plain.prefill(ids)
        prologues.clear()
        got = packed.step(ids[:, -1])
        assert prologues and not any(prologues), "a prologue ran with the prologues off"
        assert_matches(got, plain.step(ids[:, -1]), 1e-5, "prologues off")
