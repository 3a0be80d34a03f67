"""Gradients of ridge-type fits by implicit differentiation.

For ``coef = A(theta)^{-1} r(theta)`` the vector-Jacobian product needs one
adjoint solve ``lam = A^{-T} grad`` (with the same solver and preconditioner as
the fit) and then ``lam^T (dr - dA coef)``: a contraction of the kernel's
derivative against two thin matrices, which :func:`~solvers.tiling.tile_vjp`
streams tile by tile. Nothing of the CG iterations is kept (no graph through
them) and no ``n x n`` tensor is saved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .kernels import Kernel
from .krylov import KrylovInfo
from .sources import StreamedKernel
from .tiling import tile_vjp

__all__ = ["LinearSystem", "ridge_solve", "landmark_solve"]


@dataclass
class LinearSystem:
    """A symmetric positive definite system and how to solve it.

    ``solve(R) -> (X, info)`` is used for the fit and for the adjoint solve;
    the adjoint diagnostics are recorded in ``adjoint_infos``.
    """

    kernel: Kernel
    solve: Callable[[torch.Tensor], tuple[torch.Tensor, KrylovInfo]]
    chunk_size: int | None = None
    adjoint_infos: list = field(default_factory=list)
    on_adjoint: Callable[[KrylovInfo], None] | None = None

    def adjoint(self, grad: torch.Tensor) -> torch.Tensor:
        lam, info = self.solve(grad.contiguous())
        self.adjoint_infos.append(info)
        if self.on_adjoint is not None:
            self.on_adjoint(info)
        return lam


def _params_grads(*lists):
    """Sum per-parameter gradient lists (``None`` where nothing flows)."""
    out = []
    for grads in zip(*lists):
        present = [g for g in grads if g is not None]
        out.append(sum(present[1:], present[0]) if present else None)
    return out


class _RidgeSolve(torch.autograd.Function):
    """``coef = (K(X, X) + alpha I)^{-1} Y``."""

    @staticmethod
    def forward(ctx, system: LinearSystem, coef, X, Y, alpha, *params):
        ctx.system = system
        ctx.save_for_backward(X, coef)
        return coef.clone()

    @staticmethod
    def backward(ctx, grad):
        X, coef = ctx.saved_tensors
        system = ctx.system
        lam = system.adjoint(grad)
        need_X, need_Y, need_alpha = ctx.needs_input_grad[2:5]

        def contribution(tile, sl):  # -lam^T dK coef, one row block at a time
            return -(lam[sl] * (tile @ coef)).sum()

        d_rows, d_cols, d_params = tile_vjp(system.kernel, X, X, contribution, need_rows=need_X,
                                            need_cols=need_X, chunk_size=system.chunk_size)
        d_X = d_rows + d_cols if need_X else None
        d_alpha = -(lam * coef).sum() if need_alpha else None
        return (None, None, d_X, lam if need_Y else None, d_alpha, *d_params)


def ridge_solve(system: LinearSystem, X: torch.Tensor, Y: torch.Tensor, alpha: torch.Tensor) -> tuple:
    """Solve the ridge system; differentiable in ``X``, ``Y``, ``alpha`` and the kernel parameters."""
    coef, info = system.solve(Y.detach())
    return _RidgeSolve.apply(system, coef, X, Y, alpha, *system.kernel.parameters()), info


class _LandmarkSolve(torch.autograd.Function):
    """``coef = (K_nm^T K_nm + alpha K_mm)^{-1} K_nm^T Y`` with ``K_nm = K(X, L)``."""

    @staticmethod
    def forward(ctx, system: LinearSystem, coef, X, L, Y, alpha, *params):
        ctx.system = system
        ctx.save_for_backward(X, L, Y, coef, alpha)
        return coef.clone()

    @staticmethod
    def backward(ctx, grad):
        X, L, Y, coef, alpha = ctx.saved_tensors
        system = ctx.system
        lam = system.adjoint(grad)
        need_X, need_L, need_Y, need_alpha = ctx.needs_input_grad[2:6]
        Yd, a = Y.detach(), float(alpha)
        kernel, chunk = system.kernel, system.chunk_size

        # lam^T (dK_nm^T Y - dK_nm^T K_nm coef - K_nm^T dK_nm coef), streamed over rows of X.
        def data_term(tile, sl):
            t_lam = tile @ lam
            return (Yd[sl] * t_lam).sum() - (t_lam * (tile @ coef)).sum()

        # -alpha lam^T dK_mm coef over the landmark kernel.
        def prior_term(tile, sl):
            return -a * (lam[sl] * (tile @ coef)).sum()

        d_X, dL_data, p_data = tile_vjp(kernel, X, L, data_term, need_rows=need_X, need_cols=need_L,
                                        chunk_size=chunk)
        dL_rows, dL_cols, p_prior = tile_vjp(kernel, L, L, prior_term, need_rows=need_L, need_cols=need_L,
                                             chunk_size=chunk)
        d_L = dL_data + dL_rows + dL_cols if need_L else None
        d_Y = StreamedKernel(kernel, X.detach(), L.detach(), chunk_size=chunk).matmul_nograd(lam) if need_Y else None
        d_alpha = -(lam * StreamedKernel(kernel, L.detach()).matmul_nograd(coef)).sum() if need_alpha else None
        return (None, None, d_X, d_L, d_Y, d_alpha, *_params_grads(p_data, p_prior))


def landmark_solve(system: LinearSystem, rhs: torch.Tensor, X, L, Y, alpha) -> tuple:
    """Solve the landmark system for a precomputed ``rhs = K_nm^T Y``; differentiable like :func:`ridge_solve`."""
    coef, info = system.solve(rhs)
    return _LandmarkSolve.apply(system, coef, X, L, Y, alpha, *system.kernel.parameters()), info
