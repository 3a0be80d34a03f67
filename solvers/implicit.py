"""Gradients of linear-system fits by implicit differentiation.

A fit solves ``A(theta) coef = b(theta)``. Differentiating the residual
``r(theta) = b(theta) - A(theta) coef`` at the solution (``coef`` held fixed)
gives ``A d(coef) = dr``, so the vector-Jacobian product of ``coef`` is
``lam^T dr`` with ``lam = A^{-T} grad`` (``A^{-1} grad`` for the fits'
symmetric systems). :func:`implicit`
returns ``coef`` as a function of ``r``: its backward is one adjoint solve,
with the fit's own solver and preconditioner, and autograd carries ``lam``
through ``r``. The residual is built from ordinary differentiable kernel
products (lazytensor reductions, whose backward is streamed), so gradients
reach the points, the targets, ``alpha`` and every tensor a kernel formula
closes over without a list of parameters, no graph through the iterations
and no ``n x n`` tensor.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["implicit", "requires_grad"]


class _Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, coef, solve):
        ctx.solve = solve
        return coef.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.solve(grad.contiguous()), None, None


def implicit(coef: torch.Tensor, residual: Callable[[torch.Tensor], torch.Tensor],
             solve: Callable[[torch.Tensor], torch.Tensor], differentiable: bool) -> torch.Tensor:
    """``coef`` (the solution, no graph) with the implicit gradient of ``A coef = b``.

    ``residual(c)`` builds ``b - A c`` differentiably for a fixed ``c``;
    ``solve(G)`` returns ``A^{-T} G`` (the adjoint solve; it reports its own
    convergence, and writes no state). Without ``differentiable`` nothing is built.
    """
    coef = coef.detach()
    if not differentiable:
        return coef
    return _Adjoint.apply(residual(coef), coef, solve)


def requires_grad(*things) -> bool:
    """Whether gradients could flow: grad mode on and any tensor (or formula tensor) requiring grad."""
    if not torch.is_grad_enabled():
        return False
    for thing in things:
        if isinstance(thing, torch.Tensor) and thing.requires_grad:
            return True
        variables = getattr(thing, "variables", None)  # a LazyTensor: the tensors its formula closes over
        if variables and any(v.tensor.requires_grad for v in variables.values()):
            return True
    return False
