"""Column selection by QR with column pivoting and by strong rank-revealing QR (Gu & Eisenstat 1996).

``strong_rrqr(A, k, f)`` is the selection of DRRQR (state-reduction paper, Algorithm 2):
start from QRCP's ``k`` columns, then swap a chosen column ``i`` with a candidate ``j``
while ``rho_ij = sqrt(U_ij^2 + (gamma_j / omega_i)^2) > f`` for some pair, where
``U = A_k^-1 B_k``, ``gamma_j`` is the norm of column ``j`` of ``C_k`` and ``omega_i``
is ``1 / ||row i of A_k^-1||``. Each swap multiplies ``|det A_k|`` by ``rho > f >= 1``,
so it terminates; at the end every ``|U_ij| <= f`` and ``gamma_j / omega_i <= f``.

Everything runs on the ``n x n`` triangular factor of ``A`` (``A = Q R`` has the same
column geometry as ``R``), so a tall activation matrix costs one QR.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _r_factor(A: torch.Tensor) -> torch.Tensor:
    A = A.double()
    if A.shape[0] > A.shape[1]:
        return torch.linalg.qr(A, mode="r").R
    return A


def qrcp(A: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` pivots of Businger-Golub QR with column pivoting (greedy: at each step
    the column with the largest norm orthogonal to the columns already chosen)."""
    R = _r_factor(A).clone()
    n = R.shape[1]
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    chosen: list[int] = []
    rest = list(range(n))
    for _ in range(k):
        norms = R[:, rest].norm(dim=0)
        j = rest.pop(int(norms.argmax()))
        chosen.append(j)
        u = R[:, j] / R[:, j].norm().clamp_min(1e-300)
        R = R - torch.outer(u, u @ R)  # project every column off the chosen one
    return torch.tensor(chosen)


@dataclass
class RRQRResult:
    indices: torch.Tensor  # [k] chosen columns, in pivot order
    swaps: int
    rho_max: float         # the largest rho_ij at the end (<= f)
    u_max: float           # max |U_ij|
    ratio_max: float       # max gamma_j / omega_i
    log_volume: float      # log |det A_k| (the volume of the chosen columns)


def _blocks(R0: torch.Tensor, perm: torch.Tensor, k: int):
    R = torch.linalg.qr(R0[:, perm], mode="r").R
    Ak, Bk, Ck = R[:k, :k], R[:k, k:], R[k:, k:]
    return Ak, Bk, Ck


def rrqr_quantities(A: torch.Tensor, indices: torch.Tensor):
    """``(U, gamma, omega, log|det A_k|)`` for the columns ``indices`` of ``A`` (the others after)."""
    R0 = _r_factor(A)
    n, k = R0.shape[1], len(indices)
    rest = torch.tensor([j for j in range(n) if j not in set(indices.tolist())], dtype=torch.long)
    Ak, Bk, Ck = _blocks(R0, torch.cat([indices.long(), rest]), k)
    inv = torch.linalg.solve_triangular(Ak, torch.eye(k, dtype=Ak.dtype), upper=True)
    U = inv @ Bk
    gamma = Ck.norm(dim=0) if Ck.numel() else torch.zeros(n - k, dtype=Ak.dtype)
    omega = 1.0 / inv.norm(dim=1).clamp_min(1e-300)
    logdet = float(torch.log(Ak.diagonal().abs().clamp_min(1e-300)).sum())
    return U, gamma, omega, logdet


def strong_rrqr(A: torch.Tensor, k: int, f: float = 1.1, max_swaps: int | None = None) -> RRQRResult:
    """``k`` well-conditioned columns of ``A`` [m, n] by strong RRQR with tolerance ``f >= 1``."""
    if f < 1:
        raise ValueError(f"the tolerance f must be >= 1, got {f}")
    R0 = _r_factor(A)
    n = R0.shape[1]
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    chosen = qrcp(R0, k)
    perm = torch.cat([chosen, torch.tensor([j for j in range(n) if j not in set(chosen.tolist())],
                                           dtype=torch.long)])
    swaps = 0
    max_swaps = max_swaps if max_swaps is not None else 100 * n
    while True:
        if k == n:
            U = torch.zeros(k, 0, dtype=torch.float64)
            gamma = omega = torch.zeros(0, dtype=torch.float64)
            rho = torch.zeros(k, 0, dtype=torch.float64)
            break
        U, gamma, omega, _ = rrqr_quantities(R0, perm[:k])
        rho = torch.sqrt(U ** 2 + (gamma[None, :] / omega[:, None]) ** 2)
        flat = int(rho.argmax())
        i, j = divmod(flat, rho.shape[1])
        if float(rho[i, j]) <= f or swaps >= max_swaps:
            break
        perm[i], perm[k + j] = perm[k + j].clone(), perm[i].clone()
        swaps += 1
    logdet = rrqr_quantities(R0, perm[:k])[3]
    ratio = (gamma[None, :] / omega[:, None]) if rho.numel() else rho
    return RRQRResult(indices=perm[:k].clone(), swaps=swaps, rho_max=float(rho.max()) if rho.numel() else 0.0,
                      u_max=float(U.abs().max()) if U.numel() else 0.0,
                      ratio_max=float(ratio.max()) if ratio.numel() else 0.0, log_volume=logdet)
