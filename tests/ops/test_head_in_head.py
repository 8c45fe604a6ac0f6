"""Head-in-Head mask normalisation keeps the transition's spectrum where the paper says (App. A)."""
import pytest
import torch
import torch.nn.functional as F

from rankdecay.ops import head_in_head_mask

f64 = torch.float64


def transitions(r, K, beta_max, draws=500):
    """P = I - beta (k k^T ⊙ expand(M)) for random positive M_org, L2-normalised k, beta in [0, beta_max]."""
    m = head_in_head_mask(torch.rand(draws, r, r, dtype=f64) ** 3)  # skewed, still positive
    group = torch.arange(K) // (K // r)
    k = F.normalize(torch.randn(draws, K, dtype=f64), dim=-1)
    beta = beta_max * torch.rand(draws, 1, 1, dtype=f64)
    kk = k[:, :, None] * k[:, None, :]
    return torch.eye(K, dtype=f64) - beta * kk * m[:, group[:, None], group[None, :]], m


@pytest.mark.parametrize("r,K", [(2, 8), (4, 16), (8, 64)])
def test_mask_entries_and_eigenvalues_in_unit_interval(r, K):
    P, m = transitions(r, K, beta_max=1.0)
    assert (m >= 0).all() and (m <= 1 + 1e-12).all()
    eig = torch.linalg.eigvalsh(P)  # P is symmetric
    assert eig.min() >= -1e-12 and eig.max() <= 1 + 1e-12, (eig.min().item(), eig.max().item())


def test_mask_has_unit_diagonal():
    m = head_in_head_mask(0.05 + torch.rand(100, 4, 4, dtype=f64))
    torch.testing.assert_close(m.diagonal(dim1=-2, dim2=-1), torch.ones(100, 4, dtype=f64))
    torch.testing.assert_close(m, m.transpose(-1, -2))


@pytest.mark.parametrize("r,K", [(2, 8), (4, 16)])
def test_beta_up_to_two_keeps_eigenvalues_in_minus_one_one(r, K):
    P, _ = transitions(r, K, beta_max=2.0)
    eig = torch.linalg.eigvalsh(P)
    assert eig.min() >= -1 - 1e-12 and eig.max() <= 1 + 1e-12
    assert eig.min() < 0, "beta in [0, 2] should reach negative eigenvalues"


def test_unnormalised_mask_can_leave_the_unit_interval():
    """The check above can fail: without the normalisation the spectrum escapes."""
    r, K = 4, 16
    group = torch.arange(K) // (K // r)
    m = 3 * torch.rand(200, r, r, dtype=f64)
    k = F.normalize(torch.randn(200, K, dtype=f64), dim=-1)
    P = torch.eye(K, dtype=f64) - (k[:, :, None] * k[:, None, :]) * m[:, group[:, None], group[None, :]]
    eig = torch.linalg.eigvals(P).real
    assert eig.min() < -1e-6 or eig.max() > 1 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_mask_normalisation_is_scale_free(dtype):
    """Rows of tiny entries (softplus of logits near -40) normalise as well as rows near 1."""
    m_org = 0.05 + torch.rand(50, 3, 3, dtype=dtype)
    ref = head_in_head_mask(m_org)
    for scale in (1e-20, 1e-30, 1e20):
        torch.testing.assert_close(head_in_head_mask(m_org * scale), ref)
    tiny = F.softplus(torch.full((2, 2), -40.0, dtype=dtype))
    torch.testing.assert_close(head_in_head_mask(tiny), torch.ones(2, 2, dtype=dtype))
