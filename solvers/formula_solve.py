"""``LazyTensor.solve`` (KeOps's KernelSolve): ``(K + alpha I) X = B`` for a lazytensor formula ``K``.

lazytensor's ``kernel_solve`` checks its arguments and calls :func:`solve_shifted`
through the one deliberate late import of the code base (DESIGN section 2):
the solve belongs with the Krylov methods. It is the fits' own machinery: block
CG (:func:`~solvers.krylov.cg`) on :class:`~solvers.operators.Shifted`, and the
gradient of :func:`~solvers.implicit.implicit` (one adjoint solve with ``K.T``;
nothing N x N stored, no graph through the iterations).
"""
from __future__ import annotations

import warnings

import torch

from .base import ConvergenceWarning
from .implicit import implicit, requires_grad
from .krylov import cg
from .operators import Shifted
from .sources import Source

__all__ = ["FormulaMatrix", "solve_shifted", "DEFAULT_RTOL"]

# Relative residual ||b - A x|| / ||b|| at which CG stops, per dtype (float32 products stall near 1e-5 at cond ~1e3).
DEFAULT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}


class FormulaMatrix(Source):
    """A scalar lazytensor formula ``K_ij`` as a source: ``K @ V`` a sum over j, ``K.T @ U`` a sum over i.

    ``products``: the reductions' options (``backend``, ``chunk_size``); the
    formula's own ``ranges`` (block sparsity) follow it through ``K.T``.
    """

    def __init__(self, K, dtype: torch.dtype, device, **products):
        self.K, self.products = K, products
        self.shape, self.dtype, self.device = tuple(K.shape[:2]), dtype, torch.device(device)

    def matmul(self, V):
        return self.K.matmul(V, **self.products)

    def rmatmul(self, U):
        return self.K.T.matmul(U, **self.products)


def solve_shifted(K, B: torch.Tensor, alpha: torch.Tensor, *, rtol: float | None = None, atol: float = 0.0,
                  maxiter: int | None = None, **products) -> torch.Tensor:
    """``(K + alpha I)^{-1} B`` for a square scalar formula ``K`` (torch results) and a 2-D ``B``.

    Differentiable in ``B``, ``alpha`` (a scalar tensor) and the tensors of
    ``K`` (first order). A column is done when its residual is within
    ``max(rtol ||b||, atol)`` (``rtol`` default :data:`DEFAULT_RTOL`); a
    ``ConvergenceWarning`` says when CG, forward or adjoint, stopped short.
    """
    A = FormulaMatrix(K, B.dtype, B.device, **products)
    rtol = DEFAULT_RTOL.get(B.dtype, 1e-10) if rtol is None else rtol
    shift = float(alpha.detach())

    def solve(operator, R, what):
        X, info = cg(Shifted(operator, shift), R, rtol=rtol, atol=atol, maxiter=maxiter)
        if not info.converged:
            worst = float((info.residuals / R.norm(dim=0).clamp_min(1e-300)).max())
            warnings.warn(f"LazyTensor.solve: conjugate gradient did not converge{what} ({info.reason}, relative "
                          f"residual {worst:.2e}, rtol {rtol:g}, atol {atol:g})", ConvergenceWarning, stacklevel=5)
        return X

    with torch.no_grad():
        coef = solve(A, B.detach(), "")

    def residual(c):  # B - (K + alpha I) c, differentiable in B, alpha and K's tensors
        return B - K.matmul(c, **products) - alpha * c

    return implicit(coef, residual, lambda G: solve(A.T, G, " in the adjoint solve"), requires_grad(B, alpha, K))
