"""KernelSolve: (K + alpha I) a = b for a streamed symmetric positive definite K_ij, differentiable.

Layering: ``solvers`` sits above ``lazytensor``, and lazytensor never
imports it at import time. ``kernel_solve`` imports ``solvers`` when it is
called and runs the project's block conjugate gradient (``solvers.cg``) on
``V -> K @ V + alpha V``: one CG in the code base, and lazytensor works
without solvers until ``solve`` is used (then the ImportError says so).

Gradients by implicit differentiation, as the ridge fits do: with
A = K + alpha I and a = A^-1 b, the adjoint lam = A^-T g is one more CG
solve (with K.T); then dL/db = lam, dL/dalpha = -lam . a, and the
gradients of K's variables are those of -lam^T K a: the streamed backward
of ``K @ a`` with output cotangent -lam. Nothing N x N is stored, no graph
is kept through the iterations; the result is differentiable once (first
order).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .cluster import swap_axes
from .lazy_tensor import LazyTensor
from .variables import Variable as _Variable

# Relative residual ||b - A a|| / ||b|| at which CG stops, per dtype (float32 products stall near 1e-5 at cond ~1e3).
DEFAULT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}
SOLVE_OPTIONS = ("rtol", "maxiter", "backend", "chunk_size", "ranges")


def _rebound(K: LazyTensor, tensors) -> LazyTensor:
    """K over other tensors for its variables (same formula; torch results)."""
    out = LazyTensor.__new__(LazyTensor)
    out.expr, out.width = K.expr, K.width
    out.variables = {s: _Variable(v.axis, t, v.follows_dtype) for (s, v), t in zip(K.variables.items(), tensors)}
    return out


def _cg(K: LazyTensor, rhs: torch.Tensor, alpha: torch.Tensor, options: dict) -> torch.Tensor:
    try:
        from solvers import ConvergenceWarning, FunctionOperator, cg
    except ImportError as exc:  # pragma: no cover - solvers ships with lazytensor in this project
        raise ImportError("LazyTensor.solve runs the conjugate gradient of the 'solvers' package: it is not importable") from exc
    products = {k: options[k] for k in ("backend", "chunk_size", "ranges") if options.get(k) is not None}

    def apply(V):
        with torch.no_grad():
            return K.matmul(V, **products) + alpha * V

    n = rhs.shape[0]
    operator = FunctionOperator((n, n), rhs.dtype, rhs.device, apply)
    rtol = options.get("rtol") or DEFAULT_RTOL.get(rhs.dtype, 1e-10)
    solution, info = cg(operator, rhs, rtol=rtol, maxiter=options.get("maxiter"))
    if not info.converged:
        warnings.warn(f"LazyTensor.solve: conjugate gradient did not converge ({info.reason}, relative residual "
                      f"{float((info.residuals / rhs.norm(dim=0).clamp_min(1e-300)).max()):.2e}, rtol {rtol:g})",
                      ConvergenceWarning, stacklevel=4)
    return solution


class _Solve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, K, options, b, alpha, *tensors):
        a = _cg(K, b, alpha, options)
        ctx.K, ctx.options = K, options
        ctx.save_for_backward(a, alpha, *tensors)
        return a

    @staticmethod
    def backward(ctx, grad):
        a, alpha, *tensors = ctx.saved_tensors
        transposed = {**ctx.options, "ranges": swap_axes(ctx.options.get("ranges"))}
        lam = _cg(ctx.K.T, grad, alpha, transposed)
        needs = ctx.needs_input_grad[4:]
        grads = [None] * len(tensors)
        if any(needs):  # -lam^T dK a: the streamed backward of K @ a
            leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
            with torch.enable_grad():
                products = {k: ctx.options[k] for k in ("backend", "chunk_size", "ranges") if ctx.options.get(k) is not None}
                product = _rebound(ctx.K, leaves).matmul(a, **products)
                wanted = [leaf for leaf, need in zip(leaves, needs) if need]
                found = iter(torch.autograd.grad(product, wanted, grad_outputs=-lam, allow_unused=True))
            grads = [(next(found) if need else None) for need in needs]
            grads = [torch.zeros_like(t) if g is None and need else g for g, t, need in zip(grads, tensors, needs)]
        d_b = lam if ctx.needs_input_grad[2] else None
        d_alpha = -(lam * a).sum().reshape(alpha.shape) if ctx.needs_input_grad[3] else None
        return (None, None, d_b, d_alpha, *grads)


def _dense_rhs(b):
    """KeOps spells the right-hand side ``Vi(b)``: a LazyTensor that is one i-variable stands for its tensor."""
    if not isinstance(b, LazyTensor):
        return b
    (sym, var), *rest = b.variables.items() if b.variables else ((None, None),)
    if rest or b.expr != sym or var.axis != "i" or var.tensor.dim() != 2:
        raise ValueError(f"solve: b must be a dense (N,) or (N, C) tensor or Vi(b) of one (N, C) tensor, got {b!r}")
    return var.tensor.detach().numpy() if var.numpy else var.tensor


def kernel_solve(K: LazyTensor, b, alpha=1e-10, **options):
    """Solve (K + alpha I) a = b by conjugate gradients; ``K`` a scalar N x N formula, ``b`` (N,), (N, C) or Vi(b).

    Options: ``rtol`` (relative residual, default 1e-4 in float32 and 1e-10 in
    float64), ``maxiter``, and ``backend`` / ``chunk_size`` / ``ranges`` for
    the products. A ``ConvergenceWarning`` says when CG stopped short.
    Differentiable in ``b``, ``alpha`` (a tensor) and K's tensors (first order).
    """
    unknown = sorted(set(options) - set(SOLVE_OPTIONS))
    if unknown:
        raise TypeError(f"solve: unexpected option(s) {unknown}; known: {list(SOLVE_OPTIONS)}")
    if K.width != 1:
        raise ValueError(f"solve needs a formula of feature size 1 (a kernel matrix), got {K.width}")
    if K.nbatchdims:
        raise ValueError("solve does not support batch dimensions")
    n, m = K.shape[:2]
    if n != m:
        raise ValueError(f"solve needs a square kernel matrix, got {n} x {m}")
    options = {"ranges": K.ranges, **options}
    b = _dense_rhs(b)
    as_numpy = isinstance(b, np.ndarray) or K._numpy
    b_t = torch.from_numpy(b) if isinstance(b, np.ndarray) else b
    if not isinstance(b_t, torch.Tensor) or b_t.dim() not in (1, 2) or b_t.shape[0] != n:
        raise ValueError(f"solve: b must be ({n},) or ({n}, C), got {getattr(b, 'shape', type(b).__name__)}")
    K = _rebound(K, [v.tensor for v in K.variables.values()])
    dtype = next((v.tensor.dtype for v in K.variables.values() if not v.follows_dtype), b_t.dtype)
    if b_t.dtype != dtype:
        raise TypeError(f"solve: b has dtype {b_t.dtype}, the formula {dtype}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, torch.Tensor)) or (
            not isinstance(alpha, torch.Tensor) and alpha < 0):
        raise ValueError(f"solve: alpha must be a non-negative number or a scalar tensor, got {alpha!r}")
    alpha_t = alpha.to(dtype).reshape(()) if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=dtype)
    vector = b_t.dim() == 1
    tensors = [v.tensor for v in K.variables.values()]
    a = _Solve.apply(K, options, b_t[:, None] if vector else b_t, alpha_t, *tensors)
    a = a[:, 0] if vector else a
    return a.detach().numpy() if as_numpy else a
