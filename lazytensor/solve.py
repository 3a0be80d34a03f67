"""KernelSolve: ``(K + alpha I) a = b`` for a streamed symmetric positive definite ``K_ij``, differentiable.

This module only checks the call and hands it to ``solvers``: the solve takes
the estimators' route for its size (a direct factorization while K's matrix fits
a memory budget, else block conjugate gradients with a Nystrom preconditioner on
the streamed formula), differentiated by their implicit adjoint
(``solvers.formula_solve``; its ``last_solve`` records the route). That late import, inside
the call, is the one deliberate exception to the downward-only layering
(DESIGN section 2): lazytensor imports without solvers, and ``solve`` raises
an ImportError that says so when solvers is missing.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from .lazy_tensor import LazyTensor
from .variables import Variable, require_data, tensor_of_array

SOLVE_OPTIONS = ("rtol", "atol", "maxiter", "source", "backend", "chunk_size", "ranges")


def _dense_rhs(b):
    """KeOps spells the right-hand side ``Vi(b)``: a LazyTensor that is one i-variable stands for its tensor."""
    if not isinstance(b, LazyTensor):
        return b
    (sym, var), *rest = b.variables.items() if b.variables else ((None, None),)
    if rest or b.expr != sym or var.axis != "i" or var.tensor.dim() != 2:
        raise ValueError(f"solve: b must be a dense (N,) or (N, C) tensor or Vi(b) of one (N, C) tensor, got {b!r}")
    return var.tensor.detach().numpy() if var.numpy else var.tensor


def _torch_formula(K: LazyTensor, ranges) -> LazyTensor:
    """K with torch results (NumPy variables are torch tensors inside) and the block sparsity ``ranges``."""
    out = copy.copy(K)
    out.variables = {s: Variable(v.axis, v.tensor, v.follows_dtype) for s, v in K.variables.items()}
    out.ranges = ranges
    return out


def kernel_solve(K: LazyTensor, b, alpha=1e-10, **options):
    """Solve (K + alpha I) a = b; ``K`` a scalar N x N formula, ``b`` (N,), (N, C) or Vi(b).

    ``source``: ``"auto"`` (default: ``"direct"``, a float64 Cholesky of the
    formed matrix, while it takes at most ``solvers.formula_solve.SOLVE_MAX_BYTES``;
    ``"streamed"`` preconditioned CG above), or one of ``"direct"``, ``"stored"``,
    ``"streamed"``. Iterative routes take ``rtol`` (relative residual, default
    1e-6 in float32 and 1e-10 in float64), ``atol`` (absolute, default 0: a
    column stops at the larger) and ``maxiter``; ``backend`` / ``chunk_size`` /
    ``ranges`` (which streams) go to the products. A ``ConvergenceWarning`` says
    when CG stopped short.
    Differentiable in ``b``, ``alpha`` (a tensor) and K's tensors (first order).
    """
    unknown = sorted(set(options) - set(SOLVE_OPTIONS))
    if unknown:
        raise TypeError(f"solve: unexpected option(s) {unknown}; known: {list(SOLVE_OPTIONS)}")
    if K.width != 1:
        raise ValueError(f"solve needs a formula of feature size 1 (a kernel matrix), got {K.width}")
    require_data(K.variables)
    if K.nbatchdims:
        raise ValueError("solve does not support batch dimensions")
    n, m = K.shape[:2]
    if n != m:
        raise ValueError(f"solve needs a square kernel matrix, got {n} x {m}")
    b = _dense_rhs(b)
    as_numpy = isinstance(b, np.ndarray) or K._numpy
    b_t = tensor_of_array(b) if isinstance(b, np.ndarray) else b
    if not isinstance(b_t, torch.Tensor) or b_t.dim() not in (1, 2) or b_t.shape[0] != n:
        raise ValueError(f"solve: b must be ({n},) or ({n}, C), got {getattr(b, 'shape', type(b).__name__)}")
    dtype = next((v.tensor.dtype for v in K.variables.values() if not v.follows_dtype), b_t.dtype)
    if b_t.dtype != dtype:
        raise TypeError(f"solve: b has dtype {b_t.dtype}, the formula {dtype}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, torch.Tensor)) or (
            not isinstance(alpha, torch.Tensor) and alpha < 0):
        raise ValueError(f"solve: alpha must be a non-negative number or a scalar tensor, got {alpha!r}")
    alpha_t = alpha.to(dtype).reshape(()) if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=dtype)
    try:
        from solvers.formula_solve import solve_shifted
    except ImportError as exc:  # pragma: no cover - solvers ships with lazytensor in this project
        raise ImportError("LazyTensor.solve runs the conjugate gradient of the 'solvers' package: it is not importable") from exc
    K = _torch_formula(K, options.pop("ranges", K.ranges))
    products = {k: v for k, v in options.items() if v is not None}
    vector = b_t.dim() == 1
    a = solve_shifted(K, b_t[:, None] if vector else b_t, alpha_t, **products)
    a = a[:, 0] if vector else a
    return a.detach().numpy() if as_numpy else a
