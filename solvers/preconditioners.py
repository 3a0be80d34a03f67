"""Preconditioners for ``(K + shift I) x = b``: callables returning ``~ (K + shift I)^{-1} R``.

:class:`LowRankShift` applies ``(F F^T + shift I)^{-1}`` exactly by the
Woodbury identity with one ``r x r`` Cholesky factor; :func:`nystrom` builds
``F`` from ``rank`` landmark columns of the kernel (``K ~ C K_rr^+ C^T``), so
CG only has to resolve what the landmarks miss. :class:`Jacobi` divides by the
shifted diagonal. :class:`Cholesky` solves a small system exactly from its
explicitly formed matrix (the landmark normal equations).
"""
from __future__ import annotations

import torch

__all__ = ["LowRankShift", "Jacobi", "Cholesky", "nystrom", "nystrom_factor"]


class LowRankShift:
    """``R -> (F F^T + shift I)^{-1} R`` through ``(shift I + F^T F)``'s Cholesky factor."""

    def __init__(self, F: torch.Tensor, shift: float):
        if not shift > 0:
            raise ValueError(f"shift must be positive for a low-rank-plus-shift preconditioner, got {shift!r}")
        self.F, self.shift = F, float(shift)
        core = F.T @ F
        core.diagonal().add_(self.shift)
        self.chol = torch.linalg.cholesky(core)

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return (R - self.F @ torch.cholesky_solve(self.F.T @ R, self.chol)) / self.shift

    @property
    def rank(self) -> int:
        return self.F.shape[1]


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


def nystrom_factor(source, rank: int, random_state: int = 0) -> torch.Tensor:
    """``F`` (n x r') with ``F F^T = C K_rr^+ C^T`` on ``rank`` random landmark columns.

    Eigen-directions of ``K_rr`` below ``sqrt(eps)`` of the largest are dropped
    (they would only amplify roundoff), so ``r' <= rank``.
    """
    n = source.shape[0]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    gen = torch.Generator().manual_seed(int(random_state))
    idx = torch.randperm(n, generator=gen)[:min(rank, n)].sort().values.to(source.device)
    C = source.columns(idx)
    evals, evecs = torch.linalg.eigh((C[idx] + C[idx].T) / 2)
    keep = evals > evals.max() * torch.finfo(C.dtype).eps ** 0.5
    return C @ (evecs[:, keep] / evals[keep].sqrt())


def nystrom(source, rank: int, shift: float, random_state: int = 0) -> LowRankShift:
    """Nystrom preconditioner for ``source + shift I`` (rank ``rank``, Woodbury applied)."""
    return LowRankShift(nystrom_factor(source, rank, random_state), shift)
