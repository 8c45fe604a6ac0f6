"""State reduction: exactness of the surgery, the scorers, DRRQR's guarantees, LoRA, the command."""
import math

import pytest
import torch

from rankdecay.layers.modules import ShortConvolution
from rankdecay.models import RankDecayConfig, RankDecayForCausalLM, output_cache
from rankdecay.prune import (
    METHODS, add_lora, apply_pruning, merge_lora, prune, qrcp, rrqr_quantities, strong_rrqr, transform_model,
    zero_channels,
)
from rankdecay.prune.scorers import calibrate, pca_transforms
from rankdecay.prune.core import adaptive_budgets

MIXERS = ["gdn", "deltanet", "kda", "hdla", "hh-gdn", "gla", "gdp", "simple_gla"]


def tiny(mixer, **kw):
    torch.manual_seed(0)
    return RankDecayForCausalLM(RankDecayConfig.from_preset("tiny", mixer=mixer, **kw)).eval()


def calib(n=2, B=2, T=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (B, T), generator=g) for _ in range(n)]


def kept(model):
    return {int(i): [torch.tensor(h) for h in heads] for i, heads in model.config.pruning["kept"].items()}


@pytest.mark.parametrize("mixer", MIXERS)
def test_ratio_zero_reproduces_the_model_exactly(mixer):
    model = tiny(mixer)
    same, _ = prune(model, "l1", 0.0)
    x = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        assert torch.equal(same(x).logits, model(x).logits)
    assert same.config.head_k_dim == model.model.layers[0].mixer.head_k_dim


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("method, budget", [("rand", "uniform"), ("drrqr", "uniform"), ("grad", "adaptive"),
                                            ("s-wanda", "adaptive")])
def test_pruning_equals_zeroing_the_dropped_channels(mixer, method, budget):
    model = tiny(mixer).double()
    small, info = prune(model, method, 0.5, calib(), budget=budget)
    ref = zero_channels(model, kept(small))
    x = torch.randint(0, 256, (2, 41))
    with torch.no_grad():
        a, b = small(x).logits, ref(x).logits
    assert (a - b).abs().max().item() < 1e-10
    assert small.config.head_k_dim < model.model.layers[0].mixer.head_k_dim
    # ... and is not the unpruned model.
    with torch.no_grad():
        assert (a - model(x).logits).abs().max().item() > 1e-4


@pytest.mark.parametrize("method, budget", [("drrqr", "uniform"), ("grad", "adaptive"), ("pca", "uniform")])
def test_grouped_value_heads_prune_per_key_head(method, budget):
    """Grouped value heads (num_v_heads = 2 H): the key space is pruned per query/key head, so every value head that
    reads it keeps the same channels; selections equal zeroing the dropped channels, the model keeps num_v_heads,
    and adaptive budgets take a key head's utilisation as the mean of its value heads'."""
    model = tiny("gdn", num_v_heads=4).double()
    small, info = prune(model, method, 0.5, calib(), budget=budget)
    assert small.config.num_v_heads == 4 and small.model.layers[0].mixer.num_v_heads == 4
    x = torch.randint(0, 256, (2, 41))
    if method != "pca":  # (PCA rotates each key head's space: no channels kept)
        assert all(len(heads) == 2 for heads in small.config.pruning["kept"].values())
        ref = zero_channels(model, kept(small))
        with torch.no_grad():
            assert (small(x).logits - ref(x).logits).abs().max().item() < 1e-10
    budgets = adaptive_budgets(model, 0.5, {0: torch.tensor([1.0, 1.0, 9.0, 9.0]), 1: torch.ones(4)})
    assert budgets[0] == [3, 29] and budgets[1] == [16, 16]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "pca"])
@pytest.mark.parametrize("mixer", ["gdn", "hh-gdn", "gdp"])
def test_every_scorer_gives_valid_distinct_indices(method, mixer):
    model = tiny(mixer)
    small, info = prune(model, method, 0.75, calib())
    K = model.model.layers[0].mixer.head_k_dim
    r = model.config.hh_rank if mixer.startswith("hh-") else 1
    for layer, heads in kept(small).items():
        assert len(heads) == model.config.num_heads
        for idx in heads:
            assert len(idx) == small.config.head_k_dim == K // 4
            assert idx.unique().numel() == len(idx) and 0 <= idx.min() and idx.max() < K
            counts = torch.bincount(idx // (K // r), minlength=r)
            assert (counts == len(idx) // r).all()  # Head-in-Head: equal groups


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, 0.99, float("nan")])
def test_bad_ratios_are_refused(ratio):
    with pytest.raises(ValueError, match="ratio"):
        prune(tiny("gdn"), "l1", ratio)


def test_other_bad_arguments():
    model = tiny("gdn")
    with pytest.raises(ValueError, match="method"):
        prune(model, "magnitude", 0.5)
    with pytest.raises(ValueError, match="needs calibration"):
        prune(model, "drrqr", 0.5)
    with pytest.raises(ValueError, match="per-channel"):
        prune(tiny("hdla"), "pca", 0.5, calib())


def test_pruned_model_saves_reloads_and_decodes(tmp_path):
    from transformers import AutoModelForCausalLM

    small, _ = prune(tiny("gdn"), "drrqr", 0.5, calib(), budget="adaptive")
    small.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.head_k_dim == small.config.head_k_dim and again.config.attn_scale == small.config.attn_scale
    x = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        full = again(x).logits
        cache, steps = None, []
        for t in range(20):
            out = again(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = output_cache(out)
            steps.append(out.logits)
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        assert torch.equal(small(x).logits, full)


# ----------------------------------------------------------------------------- DRRQR
def kahan(n, c=0.285):
    """Kahan's matrix, its columns scaled by 1 - 1e-7 j so that QRCP's ties fall in the natural order."""
    s = math.sqrt(1 - c * c)
    R = torch.triu(-c * torch.ones(n, n, dtype=torch.float64), 1) + torch.eye(n, dtype=torch.float64)
    return torch.diag(s ** torch.arange(n, dtype=torch.float64)) @ R @ torch.diag(
        1 - 1e-7 * torch.arange(n, dtype=torch.float64))


@pytest.mark.parametrize("case", ["random", "low-rank", "kahan", "scaled"])
@pytest.mark.parametrize("f", [1.0, 1.5])
def test_strong_rrqr_satisfies_its_bounds(case, f):
    g = torch.Generator().manual_seed(3)
    n, k = 24, 12
    A = {"random": lambda: torch.randn(200, n, generator=g, dtype=torch.float64),
         "low-rank": lambda: torch.randn(200, 14, generator=g, dtype=torch.float64)
         @ torch.randn(14, n, generator=g, dtype=torch.float64) + 1e-3 * torch.randn(200, n, generator=g,
                                                                                     dtype=torch.float64),
         "kahan": lambda: kahan(n),
         "scaled": lambda: torch.randn(200, n, generator=g, dtype=torch.float64) * torch.logspace(0, 6, n,
                                                                                                 dtype=torch.float64)}[case]()
    res = strong_rrqr(A, k, f)
    U, gamma, omega, logdet = rrqr_quantities(A, res.indices)
    assert U.abs().max() <= f * (1 + 1e-9)                              # |(A_k^-1 B_k)_ij| <= f
    assert (gamma[None, :] / omega[:, None]).max() <= f * (1 + 1e-9)    # gamma_j(C_k) / omega_i(A_k) <= f
    assert res.indices.unique().numel() == k
    # Never a smaller volume (|det A_k|) than QR with column pivoting, where it starts.
    assert logdet >= rrqr_quantities(A, qrcp(A, k))[3] - 1e-9
    # Gu & Eisenstat Thm 3.2: sigma_i(A_k) >= sigma_i(A) / sqrt(1 + f^2 k (n - k)).
    sel = torch.linalg.svdvals(A[:, res.indices])
    full = torch.linalg.svdvals(A)[:k]
    assert (sel >= full / math.sqrt(1 + f * f * k * (n - k)) * (1 - 1e-9)).all()


def test_strong_rrqr_beats_qrcp_on_the_kahan_matrix():
    """QRCP keeps the Kahan matrix's natural order and its tiny trailing singular value;
    strong RRQR swaps its way to a much better conditioned choice."""
    A = kahan(64)
    k = 63
    plain, strong = qrcp(A, k), strong_rrqr(A, k, 1.0)
    assert plain.tolist() == list(range(k))  # QRCP does not pivot here
    smin = lambda idx: torch.linalg.svdvals(A[:, idx])[-1].item()
    assert strong.swaps >= 1 and smin(strong.indices) > 10 * smin(plain)


# ----------------------------------------------------------------------------- PCA and convolutions
def test_shared_convolution_commutes_with_rotations_and_selection_slices_filters():
    torch.manual_seed(0)
    H, K = 2, 8
    conv = ShortConvolution(H * K, 4, activation=None, groups=H)
    x = torch.randn(1, 10, H * K)
    T = torch.linalg.qr(torch.randn(K, K)).Q
    rot = lambda z: torch.einsum("wk,bthk->bthw", T, z.view(1, 10, H, K)).reshape(1, 10, H * K)
    assert torch.allclose(conv(rot(x))[0], rot(conv(x)[0]), atol=1e-5)  # Lemma D.2
    # A selection's (T * T) W is the sliced filter bank (Proposition 3.2 / D.1).
    model = tiny("gdn", shared_qk_conv=False)
    keep = {i: [torch.tensor([0, 5, 7]), torch.tensor([1, 2, 3])] for i in (0, 1)}
    small = apply_pruning(model, keep)
    W = model.model.layers[0].mixer.q_conv.weight
    assert torch.equal(small.model.layers[0].mixer.q_conv.weight, W[[0, 5, 7, 32 + 1, 32 + 2, 32 + 3]])


def test_pca_keeps_the_top_principal_components():
    model = tiny("gdn", shared_qk_conv=True)
    cal = calibrate(model, calib())
    T = pca_transforms(model, cal, {0: [8, 8], 1: [8, 8]})
    m = model.model.layers[0].mixer
    K = m.head_k_dim
    Wq = m.q_proj.weight.detach().double().reshape(2, K, -1)[0]
    Wk = m.k_proj.weight.detach().double().reshape(2, K, -1)[0]
    cov = Wq @ cal.xx[0] @ Wq.T + Wk @ cal.xx[0] @ Wk.T
    t = T[0][0]
    assert torch.allclose(t @ t.T, torch.eye(8, dtype=torch.float64), atol=1e-10)  # orthonormal rows
    var = torch.diagonal(t @ cov @ t.T)
    top = torch.linalg.eigvalsh(cov).flip(0)[:8]
    assert torch.allclose(var, top, rtol=1e-8)
    small = transform_model(model, T, {"method": "pca"})
    assert small.config.head_k_dim == 8
    assert torch.equal(small.model.layers[0].mixer.q_conv.weight, m.q_conv.weight)  # shared filters: unchanged


# ----------------------------------------------------------------------------- recovery
def test_lora_merges_to_the_same_function_and_recovery_lowers_the_loss():
    model = tiny("gdn")
    x = torch.randint(0, 256, (2, 16))
    add_lora(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.normal_(std=0.01)
        before = model(x).logits
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".A", ".B")) or "_conv." in n for n in trainable)
    merge_lora(model)
    with torch.no_grad():
        assert torch.allclose(model(x).logits, before, atol=1e-5)

    from rankdecay.prune import recover

    teacher = tiny("gdn")
    student, _ = prune(teacher, "rand", 0.75)
    batch = [torch.randint(0, 256, (4, 32))] * 15
    losses = recover(student, teacher, batch, lr=3e-3, progress=False)
    assert losses[-1] < losses[0]
    assert student.config.head_k_dim == 8 and not any("lora" in n or n.endswith(".A") for n, _ in
                                                       student.named_parameters())


# ----------------------------------------------------------------------------- the command
def test_prune_command_end_to_end(tmp_path, capsys):
    from rankdecay.cli import main
    from tests.train.test_config_data import write_docs
    from tests.train.test_trainer import SMALL

    docs = write_docs(tmp_path / "docs", n=60, size=600)
    run = tmp_path / "run"
    assert main(["train", "--data", str(docs), *SMALL, "--steps", "3", "--out-dir", str(run)]) == 0
    out = tmp_path / "pruned"
    assert main(["prune", str(run), "--method", "drrqr", "--ratio", "0.5", "--calib-samples", "8", "--rft", "2",
                 "--rft-batch-size", "2", "--eval-windows", "4", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "after recovery" in text and "head_k_dim 16 -> 8" in text and "Rank utilisation" in text
    import json

    report = json.loads((out / "prune_report.json").read_text())
    assert report["after"]["bpb"] > 0 and report["after_rft"]["bpb"] > 0 and (out / "prune_spectra.png").exists()
    assert set(report["rank"]) == {"baseline", "drrqr 50%", "drrqr 50% + RFT"}
    assert main(["generate", str(out), "--prompt", "alpha", "--max-new-tokens", "4"]) == 0
    assert main(["prune", str(run), "--method", "l1", "--ratio", "1.0", "--out", str(tmp_path / "x")]) == 2
    assert "ratio" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA GPU (run recorded in BENCHMARKS.md)")
@pytest.mark.parametrize("mixer", ["gdn", "hdla", "hh-gdn"])
def test_cuda_pruned_model_runs_on_the_kernels_and_decodes(mixer):
    model = tiny(mixer)
    small, _ = prune(model, "drrqr", 0.5, calib(), budget="adaptive")
    x = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        ref = small(x).logits
        gpu = small.cuda()
        out = gpu(x.cuda()).logits.cpu()                       # chunked path with the Triton kernels
        assert (out - ref).abs().max().item() < 1e-3
        cache, steps = None, []
        for t in range(100):                                   # fused recurrent decode kernel
            o = gpu(x[:, t:t + 1].cuda(), past_key_values=cache, use_cache=True)
            cache = output_cache(o)
            steps.append(o.logits.cpu())
        assert (torch.cat(steps, 1) - ref).abs().max().item() < 1e-3
