"""Composed operators the fits hand to the Krylov methods: shifted, centred and normal-equation matrices.

Each is a :class:`~solvers.sources.Source` made of other sources and holds
nothing else, so streamed, stored and sharded sources compose alike (a sharded
source returns whole vectors on every rank, and so does everything built on it).
Products carry no gradient: the fits differentiate through their residuals
(:mod:`solvers.implicit`), never through the iterations.
"""
from __future__ import annotations

import torch

from .sources import Source

__all__ = ["Shifted", "Centred", "Normal"]


class _Composed(Source):
    """Square and symmetric: ``A.T @ U`` is ``A @ U``."""

    def __init__(self, base: Source):
        self.shape, self.dtype, self.device = base.shape, base.dtype, base.device

    def rmatmul(self, U: torch.Tensor) -> torch.Tensor:
        return self.matmul(U)


class Shifted(_Composed):
    """``A + shift I`` for a square symmetric source ``A`` (ridge systems: ``K + alpha I``)."""

    def __init__(self, A: Source, shift: float):
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"Shifted needs a square source, got shape {A.shape}")
        super().__init__(A)
        self.A, self.shift = A, float(shift)

    def matmul(self, V):
        return self.A.matmul_nograd(V) + self.shift * V


class Centred(_Composed):
    """``H A H`` with ``H = I - 11^T / n``: kernel PCA's centred kernel, the centring applied to vectors."""

    def __init__(self, A: Source):
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"Centred needs a square source, got shape {A.shape}")
        super().__init__(A)
        self.A = A

    def matmul(self, V):
        AV = self.A.matmul_nograd(V - V.mean(0))
        return AV - AV.mean(0)


class Normal(_Composed):
    """``A^T A + shift B`` (m x m): landmark ridge's normal equations with ``A = K_nm`` and ``B = K_mm``."""

    def __init__(self, A: Source, B: Source, shift: float):
        if B.shape != (A.shape[1], A.shape[1]):
            raise ValueError(f"Normal needs B of shape {(A.shape[1], A.shape[1])} for A of shape {A.shape}, got {B.shape}")
        self.shape, self.dtype, self.device = B.shape, A.dtype, A.device
        self.A, self.B, self.shift = A, B, float(shift)

    def matmul(self, V):
        return self.A.gram(V) + self.shift * self.B.matmul_nograd(V)
