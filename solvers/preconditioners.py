"""Preconditioners for ``(A + shift I) x = b``: callables returning ``~ (A + shift I)^{-1} R``.

:func:`pivoted_cholesky` builds a low-rank factor ``F`` (``F F^T ~ K``) from
kernel columns chosen by randomly pivoted Cholesky: each block of pivots is
drawn in proportion to what the factor still misses on the diagonal, so the
columns go where the kernel has mass (uniformly random columns waste rank on
redundant points). It stops early once the missed trace is below the shift:
the preconditioned system is then already well conditioned.

:class:`LowRankPreconditioner` turns ``F`` into the Nystrom preconditioner of
Frangella, Tropp and Udell (2023): with ``F = U diag(sqrt(lam))`` (thin SVD),

    P^{-1} = (lam_min + shift) U (diag(lam) + shift)^{-1} U^T + (I - U U^T),

whose spectrum lies in ``[(lam_min + shift) / (lam_max + shift), 1]``. Unlike the
Woodbury inverse of ``F F^T + shift I``, nothing is divided by ``shift``: the
directions the factor misses keep their own scale, so a small shift (alpha = 1e-6
in float32) neither amplifies roundoff nor makes a well-conditioned system worse.
:class:`Jacobi` divides by the shifted diagonal; :class:`Cholesky` solves a
small system exactly from its explicitly formed matrix.
"""
from __future__ import annotations

import torch

__all__ = ["LowRankPreconditioner", "Jacobi", "Cholesky", "pivoted_cholesky", "nystrom"]

PIVOT_BLOCK = 32  # pivots drawn per round: one batched column evaluation each


class LowRankPreconditioner:
    """``R -> P^{-1} R`` for ``F F^T + shift I`` (see the module docstring)."""

    def __init__(self, F: torch.Tensor, shift: float):
        if not shift > 0:
            raise ValueError(f"shift must be positive for a low-rank preconditioner, got {shift!r}")
        self.shift = float(shift)
        U, s, _ = torch.linalg.svd(F, full_matrices=False) if F.shape[1] else (F, F.new_zeros(0), None)
        lam = s.square()
        keep = lam > lam.max() * F.shape[0] * torch.finfo(F.dtype).eps if lam.numel() else lam > 0
        self.U, lam = U[:, keep], lam[keep]
        self.scale = (lam.min() + self.shift) / (lam + self.shift) - 1 if lam.numel() else lam

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return R + self.U @ (self.scale.unsqueeze(1) * (self.U.T @ R))

    @property
    def rank(self) -> int:
        return self.U.shape[1]


class Jacobi:
    """``R -> R / (diag + shift)``."""

    def __init__(self, diag: torch.Tensor, shift: float = 0.0):
        scale = diag + shift
        if not bool((scale > 0).all()):
            raise ValueError("Jacobi preconditioner needs a positive shifted diagonal")
        self.inverse = (1.0 / scale).unsqueeze(1)

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return R * self.inverse


class Cholesky:
    """``R -> A^{-1} R`` from the Cholesky factor of a small explicit SPD matrix ``A``.

    A jitter of ``size * eps * max|diag|`` guards against roundoff making ``A``
    numerically indefinite; CG around it still checks the true residual.
    """

    def __init__(self, A: torch.Tensor):
        jitter = A.shape[0] * torch.finfo(A.dtype).eps * A.diagonal().abs().max()
        self.chol = torch.linalg.cholesky(A + jitter * torch.eye(A.shape[0], dtype=A.dtype, device=A.device))

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_solve(R, self.chol)


def _check_rank(rank) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    return rank


def pivoted_cholesky(source, rank: int, *, tolerance: float = 0.0, random_state: int = 0) -> torch.Tensor:
    """``F`` (n x r', r' <= rank) with ``F F^T ~ K`` by block randomly pivoted Cholesky.

    ``source`` offers ``diag()`` and ``columns(idx)``. Rounds of ``PIVOT_BLOCK``
    pivots are drawn with probability proportional to the residual diagonal;
    directions of a round's residual block below roundoff are dropped. Stops
    at ``rank`` columns or when the residual trace is at most ``tolerance``.
    """
    _check_rank(rank)
    n = source.shape[0]
    residual = source.diag().clone().clamp_min_(0)
    F = residual.new_zeros(n, 0)
    gen = torch.Generator().manual_seed(int(random_state))
    eps = torch.finfo(residual.dtype).eps
    while F.shape[1] < min(rank, n):
        total = float(residual.sum())
        if not total > tolerance or not total > 0:
            break
        picks = min(PIVOT_BLOCK, rank - F.shape[1], int((residual > 0).sum()))
        idx = torch.multinomial(residual.cpu().double(), picks, replacement=False, generator=gen).sort().values
        idx = idx.to(residual.device)
        block = source.columns(idx) - F @ F[idx].T
        values, vectors = torch.linalg.eigh((block[idx] + block[idx].T) / 2)
        keep = values > values.max() * picks * eps * 10
        if not keep.any():
            break
        new = block @ (vectors[:, keep] / values[keep].sqrt())
        F = torch.cat([F, new], 1)
        residual = (residual - new.square().sum(1)).clamp_min_(0)
        residual[idx] = 0
    return F


def nystrom(source, rank: int, shift: float, random_state: int = 0) -> LowRankPreconditioner:
    """Nystrom preconditioner for ``source + shift I`` from a rank-``rank`` pivoted Cholesky factor."""
    return LowRankPreconditioner(pivoted_cholesky(source, rank, tolerance=shift, random_state=random_state), shift)
