"""``LazyTensor.solve`` (KeOps's KernelSolve): ``(K + alpha I) X = B`` for a lazytensor formula ``K``.

lazytensor's ``kernel_solve`` checks its arguments and calls :func:`solve_shifted`
through the one deliberate late import of the code base (DESIGN section 2):
the solve belongs with the Krylov methods. It is the estimators' machinery, route
included (:func:`~solvers.auto.auto_source`, with this module's thresholds):

* ``"direct"`` while K's float64 matrix takes at most :data:`SOLVE_MAX_BYTES`: the
  matrix formed by lazytensor identity products (in float64 whatever K's dtype),
  factored in place by Cholesky (LU where roundoff leaves it indefinite);
* ``"stored"`` (only when asked, or with :data:`SOLVE_DIRECT_MAX_N` lowered): that
  matrix kept, block CG with a Nystrom preconditioner on it;
* ``"streamed"`` above the budget: block CG on the streamed formula with a
  Nystrom preconditioner (randomly pivoted Cholesky of K's columns, rank
  :func:`~solvers.auto.auto_rank`); float32 formulas refine against float64
  passes. Nothing n x n is formed.

Gradients on every route come from :func:`~solvers.implicit.implicit`: one adjoint
solve by the same route, then the streamed backward of ``K @ X``; no graph
through the iterations or the factorization. The route taken and its diagnostics
are :data:`last_solve` (a :class:`SolveRecord`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

import lazytensor as lt
from lazytensor.variables import Variable

from .auto import auto_rank, auto_source
from .implicit import implicit, requires_grad
from .kernels import COLUMN_BLOCK
from .krylov import KrylovInfo, cg
from .operators import Shifted
from .preconditioners import nystrom
from .sources import Source, StoredKernel

__all__ = ["FormulaMatrix", "solve_shifted", "DEFAULT_RTOL", "SOLVE_MAX_BYTES", "SOLVE_DIRECT_MAX_N", "ROUTES",
           "SolveRecord", "last_solve"]

# Relative residual ||b - A x|| / ||b|| at which CG stops, per dtype. float32 was 1e-4, which left KeOps's own
# test_invkernel case 2.5e-4 off where KeOps (its float32 rule: RMS residual below 1e-6) passes; float32 CG now
# checks its residuals with float64 passes, so 1e-6 is reachable where float32 products alone stall near 1e-5.
DEFAULT_RTOL = {torch.float32: 1e-6, torch.float64: 1e-10}
ROUTES = ("auto", "direct", "stored", "streamed")
# source="auto": direct while K's float64 matrix (formed and factored in place) takes at most SOLVE_MAX_BYTES, i.e.
# N <= 8192; streamed above. KeOps's KernelSolve tutorial (N = 5000, 2-D, Gaussian sigma 0.1, alpha 0.01) took 117 s
# by plain streamed CG, ~2-4 s by Cholesky (docs/keops.md). No stored tier by default: CG on the stored matrix with a
# Nystrom preconditioner took 4 iterations there at alpha = 0.01, but stalled after 4095 (421 s) at KeOps's default
# alpha = 1e-10, where the factorization costs the same ~3 s: below the budget the direct route is never far off.
SOLVE_MAX_BYTES = 512 << 20
SOLVE_DIRECT_MAX_N = None  # None: direct up to the budget; a number: the stored route between it and the budget
DENSE_GROUP_BYTES = 64 << 20  # the dense matrix is formed this many bytes of columns per lazytensor reduction


@dataclass
class SolveRecord:
    """What the last ``LazyTensor.solve`` did: ``route`` (``"direct"``, ``"stored"``, ``"streamed"``), why,
    the system size, the Nystrom rank (0: none) and the forward solve's :class:`~solvers.krylov.KrylovInfo`
    (``reason`` ``"cholesky"`` or ``"lu"`` on the direct route)."""

    route: str
    why: str
    n: int
    rank: int = 0
    info: KrylovInfo = field(default_factory=KrylovInfo)


last_solve: SolveRecord | None = None


def _renamed(K, change):
    """Formula ``K`` (as a core ``lazytensor.LazyTensor``, whatever its flavour) with each variable replaced by
    ``change(variable)`` (symbols name positions: the expression stays), without block sparsity."""
    out = lt.LazyTensor.__new__(lt.LazyTensor)
    out.expr, out.width, out.ranges = K.expr, K.width, None
    out.variables = {s: change(v) for s, v in K.variables.items()}
    return out


class FormulaMatrix(Source):
    """A scalar lazytensor formula ``K_ij`` as a source: ``K @ V`` a sum over j, ``K.T @ U`` a sum over i.

    ``products``: the reductions' options (``backend``, ``chunk_size``); the
    formula's own ``ranges`` (block sparsity) follow it through ``K.T``.
    ``dtype`` is the source's (its operands and results); the formula may be
    evaluated in another (:meth:`cast`). ``diag``, ``columns`` and ``dense`` serve
    the preconditioner and the direct and stored routes (no gradient).
    """

    def __init__(self, K, dtype: torch.dtype, device, **products):
        self.K, self.products = K, products
        self.shape, self.dtype, self.device = tuple(K.shape[:2]), dtype, torch.device(device)
        self.formula_dtype = next((v.tensor.dtype for v in K.variables.values() if not v.follows_dtype), dtype)

    def cast(self, formula_dtype: torch.dtype, dtype: torch.dtype | None = None) -> "FormulaMatrix":
        """The same matrix with the formula evaluated in ``formula_dtype``, its operands and results in ``dtype``
        (default: this source's)."""
        dtype = dtype or self.dtype
        if formula_dtype == self.formula_dtype and dtype == self.dtype:
            return self
        K = self.K
        if formula_dtype != self.formula_dtype:
            K = _renamed(K, lambda v: v if v.follows_dtype else Variable(v.axis, v.tensor.detach().to(formula_dtype)))
            K.ranges = self.K.ranges
        out = FormulaMatrix(K, dtype, self.device, **self.products)
        out.formula_dtype = formula_dtype
        return out

    def matmul(self, V):
        return self.K.matmul(V.to(self.formula_dtype), **self.products).to(self.dtype)

    def rmatmul(self, U):
        return self.K.T.matmul(U.to(self.formula_dtype), **self.products).to(self.dtype)

    def diag(self) -> torch.Tensor:
        """``K_ii``: the formula with every j-variable read at row i, summed over one column."""
        with torch.no_grad():
            Kd = _renamed(self.K, lambda v: Variable("i", v.tensor.detach()) if v.axis == "j" else v)
            one = lt.Vj(torch.ones(1, 1, dtype=self.formula_dtype, device=self.device))
            return (Kd * one).sum(1, **self.products)[:, 0].to(self.dtype)

    def _columns(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[:, idx]`` as ``(batches, n, COLUMN_BLOCK)``: identity products over column blocks, batched (exact,
        as :func:`solvers.kernels.matrix`); the last block is padded with its first column."""
        width = min(len(idx), COLUMN_BLOCK)
        batches = math.ceil(len(idx) / width)
        idx = torch.cat([idx, idx[:1].expand(batches * width - len(idx))])

        def blocked(v):
            if v.follows_dtype or v.axis == "p":
                return v
            t = v.tensor.detach()
            return Variable("i", t[None]) if v.axis == "i" else Variable("j", t[idx].reshape(batches, width, -1))

        eye = torch.eye(width, dtype=self.formula_dtype, device=self.device)
        return (_renamed(self.K, blocked) * lt.Vj(eye)).sum(1, **self.products)

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[:, idx]`` (n x len(idx)) in the source's dtype."""
        with torch.no_grad():
            return self._columns(idx).permute(1, 0, 2).reshape(self.shape[0], -1)[:, :len(idx)].to(self.dtype)

    def dense(self) -> torch.Tensor:
        """The n x m matrix in the formula's dtype, formed ``DENSE_GROUP_BYTES`` of columns at a time (the matrix
        itself is the only n x m buffer)."""
        n, m = self.shape
        out = torch.empty(n, m, dtype=self.formula_dtype, device=self.device)
        itemsize = torch.finfo(self.formula_dtype).bits // 8
        step = max(1, DENSE_GROUP_BYTES // (n * COLUMN_BLOCK * itemsize)) * COLUMN_BLOCK
        with torch.no_grad():
            for start in range(0, m, step):
                stop = min(m, start + step)
                blocks = self._columns(torch.arange(start, stop, device=self.device))
                out[:, start:stop] = blocks.permute(1, 0, 2).reshape(n, -1)[:, :stop - start]
        return out


def choose_route(n: int, source: str = "auto", ranges=None) -> tuple[str, str]:
    """``(route, why)`` for an n x n solve: ``source`` as asked, or for ``"auto"`` the estimators' rule
    (:func:`~solvers.auto.auto_source`) with this module's budget; block sparsity (``ranges``) streams."""
    if source not in ROUTES:
        raise ValueError(f"solve: source must be one of {ROUTES}, got {source!r}")
    if ranges is not None:
        if source not in ("auto", "streamed"):
            raise ValueError(f"solve: a block-sparse formula (ranges) is solved streamed, not source={source!r}")
        return "streamed", "ranges (block sparsity)"
    if source != "auto":
        return source, "asked"
    fits = math.isqrt(SOLVE_MAX_BYTES // 8)
    direct_max_n = fits if SOLVE_DIRECT_MAX_N is None else min(fits, SOLVE_DIRECT_MAX_N)
    route = auto_source(n, itemsize=8, direct_max_n=direct_max_n, stored_max_bytes=SOLVE_MAX_BYTES)
    return route, f"auto: float64 matrix {n * n * 8 / 2**20:.0f} MiB, budget {SOLVE_MAX_BYTES / 2**20:.0f} MiB"


def _direct(A64: FormulaMatrix, shift: float):
    """``(solve, adjoint, info)`` by a factorization of ``A + shift I`` in float64, made in place."""
    factor = A64.dense()
    factor.diagonal().add_(shift)
    status = torch.empty((), dtype=torch.int32, device=factor.device)
    torch.linalg.cholesky_ex(factor, out=(factor, status))
    if int(status) == 0:
        def solve(R):  # two triangular solves: cholesky_solve copied the factor first (0.3 s of 0.36 at N = 5000)
            half = torch.linalg.solve_triangular(factor, R.to(torch.float64), upper=False)
            return torch.linalg.solve_triangular(factor.mT, half, upper=True).to(R.dtype)
        return solve, solve, KrylovInfo(converged=True, reason="cholesky")
    factor = None  # roundoff made K + shift I indefinite (a tiny alpha): LU, as torch.linalg.solve
    matrix = A64.dense()
    matrix.diagonal().add_(shift)
    LU, pivots = torch.linalg.lu_factor(matrix)
    matrix = None
    return (lambda R: torch.linalg.lu_solve(LU, pivots, R.to(torch.float64)).to(R.dtype),
            lambda R: torch.linalg.lu_solve(LU, pivots, R.to(torch.float64), adjoint=True).to(R.dtype),
            KrylovInfo(converged=True, reason="lu"))


def _iterative(route: str, A: FormulaMatrix, shift: float, preconditioned: bool, rtol, atol, maxiter):
    """``(solve, adjoint, rank)`` by block CG on the stored or streamed matrix, Nystrom-preconditioned."""
    exact = None
    if route == "stored":  # the float64 matrix (what the budget counts), CG in float64
        A = StoredKernel(A.cast(torch.float64).dense())
    elif A.formula_dtype != torch.float64:  # float32 passes iterate, float64 passes check (iterative refinement):
        # the iterate is float64, so residuals fall below what a float32 iterate holds (about cond * 6e-8)
        A, exact = A.cast(A.formula_dtype, torch.float64), A.cast(torch.float64, torch.float64)
    low_rank = nystrom(A, auto_rank(A.shape[0]), shift, dtype=torch.float32) if preconditioned and shift > 0 else None

    def run(operator, check, R, what):
        X, info = cg(Shifted(operator, shift), R.to(operator.dtype), M=low_rank, rtol=rtol, atol=atol, maxiter=maxiter,
                     exact=None if check is None else Shifted(check, shift))
        X = X.to(R.dtype)
        if not info.converged:
            from .base import ConvergenceWarning  # here, not at the top: base imports scikit-learn (~1.6 s)

            worst = float((info.residuals / R.norm(dim=0).clamp_min(1e-300)).max())
            warnings.warn(f"LazyTensor.solve: conjugate gradient did not converge{what} ({info.reason}, relative "
                          f"residual {worst:.2e}, rtol {rtol:g}, atol {atol:g})", ConvergenceWarning, stacklevel=6)
        return X, info

    return (lambda R: run(A, exact, R, "")), (lambda R: run(A.T, None if exact is None else exact.T, R,
                                                            " in the adjoint solve")[0]), getattr(low_rank, "rank", 0)


def solve_shifted(K, B: torch.Tensor, alpha: torch.Tensor, *, rtol: float | None = None, atol: float = 0.0,
                  maxiter: int | None = None, source: str = "auto", **products) -> torch.Tensor:
    """``(K + alpha I)^{-1} B`` for a square scalar formula ``K`` (torch results) and a 2-D ``B``.

    ``source``: ``"auto"`` (the module docstring's rule), ``"direct"``,
    ``"stored"`` or ``"streamed"``. Differentiable in ``B``, ``alpha`` (a scalar
    tensor) and the tensors of ``K`` (first order). An iterative column is done
    when its residual is within ``max(rtol ||b||, atol)`` (``rtol`` default
    :data:`DEFAULT_RTOL`); a ``ConvergenceWarning`` says when CG, forward or
    adjoint, stopped short. The route taken is recorded in :data:`last_solve`.
    """
    global last_solve
    A = FormulaMatrix(K, B.dtype, B.device, **products)
    rtol = DEFAULT_RTOL.get(B.dtype, 1e-10) if rtol is None else rtol
    shift = float(alpha.detach())
    route, why = choose_route(A.shape[0], source, K.ranges)
    with torch.no_grad():
        if route == "direct":
            solve, adjoint, info = _direct(A.cast(torch.float64), shift)
            coef, rank = solve(B.detach()), 0
        else:
            forward, adjoint, rank = _iterative(route, A, shift, K.ranges is None, rtol, atol, maxiter)
            coef, info = forward(B.detach())
    last_solve = SolveRecord(route, why, A.shape[0], rank, info)

    def residual(c):  # B - (K + alpha I) c, differentiable in B, alpha and K's tensors
        return B - K.matmul(c, **products) - alpha * c

    return implicit(coef, residual, adjoint, requires_grad(B, alpha, K))
