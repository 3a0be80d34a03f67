"""Kernel ridge regression, full and with landmarks, differentiable end to end."""
from __future__ import annotations

import torch

from .base import Estimator, check_count, check_points, check_positive, check_targets
from .implicit import LinearSystem, landmark_solve, ridge_solve
from .krylov import KrylovInfo, cg
from .preconditioners import Cholesky, Jacobi, nystrom
from .sources import FunctionOperator, StreamedKernel

__all__ = ["KernelRidge", "LandmarkRidge"]

PRECONDITIONERS = (None, "nystrom", "jacobi")
NORMAL_FACTOR_MAX = 4096  # landmarks up to which the m x m normal matrix (128 MiB in float64) is factored


def _direct_info(residuals: torch.Tensor) -> KrylovInfo:
    return KrylovInfo(residuals=residuals.detach(), converged=True, reason="direct",
                      column_converged=torch.ones_like(residuals, dtype=torch.bool))


def _as_alpha(alpha, dtype) -> torch.Tensor:
    check_positive(alpha, "alpha")
    return alpha.to(dtype).reshape(()) if isinstance(alpha, torch.Tensor) else torch.tensor(float(alpha), dtype=dtype)


class _Ridge(Estimator):
    """Fit bookkeeping shared by both ridge estimators: targets, solver settings, prediction."""

    def _targets(self, X, Y):
        Y = check_targets(Y, X.shape[0], X.dtype)
        self._vector_targets = Y.ndim == 1
        return Y.reshape(X.shape[0], -1)

    def _system(self, operator, kernel, preconditioner, rtol) -> LinearSystem:
        def solve(R):
            return cg(operator, R, M=preconditioner, rtol=rtol, atol=self.atol, maxiter=self.maxiter)

        def on_adjoint(info):
            self.adjoint_info_ = info
            self._report(info, "the adjoint solve of the backward pass")

        return LinearSystem(kernel, solve, chunk_size=self.chunk_size, on_adjoint=on_adjoint)

    def _predict(self, X, centres: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        X = check_points(X, "X", n_features=centres.shape[1], dtype=centres.dtype)
        if self.source_ == "streamed":
            out = StreamedKernel(self._kernel, X, centres, chunk_size=self.chunk_size) @ coef
        else:
            out = self._kernel.tile(X, centres) @ coef
        return out.squeeze(1) if self._vector_targets else out


class KernelRidge(_Ridge):
    """Kernel ridge regression: ``(K + alpha I) dual_coef_ = Y``, ``predict(x) = K(x, X) dual_coef_``.

    ``source``: ``"streamed"`` (tiles regenerated per product, nothing n x n
    stored), ``"stored"`` (kernel matrix kept, same CG), ``"direct"`` (Cholesky)
    or ``"auto"`` (direct up to ``AUTO_DIRECT_MAX_N`` points). The iterative fit is
    block CG with a rank-``rank`` Nystrom (or Jacobi) preconditioner. Fit and
    predictions are differentiable with respect to ``X``, ``Y``, query points,
    ``alpha`` (when a tensor) and kernel parameters (implicit differentiation).
    """

    def __init__(self, kernel, alpha=1.0, *, source="auto", preconditioner="nystrom", rank=256, rtol=None,
                 atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.alpha, self.source, self.preconditioner, self.rank = kernel, alpha, source, preconditioner, rank
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, atol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, Y):
        self._check_common()
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(f"preconditioner must be one of {PRECONDITIONERS}, got {self.preconditioner!r}")
        X = check_points(X)
        Y = self._targets(X, Y)
        alpha = _as_alpha(self.alpha, X.dtype)
        n = X.shape[0]
        self.source_ = self._resolve_source(n)
        if self.source_ == "direct":
            A = self._kernel.tile(X, X) + alpha * torch.eye(n, dtype=X.dtype, device=X.device)
            coef = torch.cholesky_solve(Y, torch.linalg.cholesky(A))
            info = _direct_info((Y - A @ coef).norm(dim=0))
        else:
            K = self._source(self.source_, X)
            a = float(alpha.detach())
            operator = FunctionOperator(K.shape, K.dtype, K.device, lambda V: K.matmul_nograd(V) + a * V)
            if self.preconditioner == "nystrom":
                precondition = nystrom(K, min(self.rank, n), a, self.random_state)
            elif self.preconditioner == "jacobi":
                precondition = Jacobi(K.diag(), a)
            else:
                precondition = None
            system = self._system(operator, self._kernel, precondition, self._rtol(X.dtype))
            coef, info = ridge_solve(system, X, Y, alpha)
        self.X_fit_, self.dual_coef_, self.info_ = X, coef, info
        self._report(info, "the fit")
        return self

    def predict(self, X) -> torch.Tensor:
        self._check_fitted("dual_coef_")
        return self._predict(X, self.X_fit_, self.dual_coef_)


class LandmarkRidge(_Ridge):
    """Ridge regression on landmark features: ``(K_nm^T K_nm + alpha K_mm) coef_ = K_nm^T Y``.

    Landmarks are given (``landmarks``, an (m, d) tensor) or drawn as
    ``n_landmarks`` distinct training points (default ``min(n, 256)``,
    reproducible through ``random_state``). ``predict(x) = K(x, landmarks_) coef_``.
    The iterative fit runs CG on the m x m normal equations, each product one
    streamed pass over the n x m tiles (``K_nm^T (K_nm v)`` from the same tile);
    ``source="direct"`` solves the augmented least-squares problem by QR.
    Differentiable like :class:`KernelRidge` (and in the landmarks).
    """

    def __init__(self, kernel, alpha=1.0, *, n_landmarks=None, landmarks=None, source="auto", rtol=None,
                 atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.alpha, self.n_landmarks, self.landmarks = kernel, alpha, n_landmarks, landmarks
        self.source, self.rtol, self.atol, self.maxiter = source, rtol, atol, maxiter
        self.chunk_size, self.tile_dtype, self.random_state = chunk_size, tile_dtype, random_state

    def _choose_landmarks(self, X):
        n = X.shape[0]
        if self.landmarks is not None:
            if self.n_landmarks is not None:
                raise ValueError("give either landmarks or n_landmarks, not both")
            return check_points(self.landmarks, "landmarks", n_features=X.shape[1], dtype=X.dtype)
        m = check_count(self.n_landmarks if self.n_landmarks is not None else min(n, 256), "n_landmarks", n,
                        "at most the number of training points")
        gen = torch.Generator().manual_seed(int(self.random_state))
        idx = torch.randperm(n, generator=gen)[:m].sort().values.to(X.device)
        return X[idx]

    def fit(self, X, Y):
        self._check_common()
        X = check_points(X)
        Y = self._targets(X, Y)
        alpha = _as_alpha(self.alpha, X.dtype)
        L = self._choose_landmarks(X)
        m = L.shape[0]
        self.source_ = self._resolve_source(X.shape[0])
        if self.source_ == "direct":
            # min ||K_nm c - Y||^2 + alpha ||R c||^2 with K_mm = R^T R, by QR of the stacked matrix.
            K_nm, K_mm = self._kernel.tile(X, L), self._kernel.tile(L, L)
            jitter = m * torch.finfo(X.dtype).eps * K_mm.diagonal().abs().max().detach()
            R = torch.linalg.cholesky(K_mm + jitter * torch.eye(m, dtype=X.dtype, device=X.device)).mT
            Q, T = torch.linalg.qr(torch.cat([K_nm, alpha.sqrt() * R]))
            coef = torch.linalg.solve_triangular(T, Q.T @ torch.cat([Y, Y.new_zeros(m, Y.shape[1])]), upper=True)
            info = _direct_info((K_nm.T @ (Y - K_nm @ coef) - alpha * (K_mm @ coef)).norm(dim=0))
        else:
            K_nm, K_mm = self._source(self.source_, X, L), self._source(self.source_, L)
            a = float(alpha.detach())
            operator = FunctionOperator((m, m), X.dtype, X.device,
                                        lambda V: K_nm.gram(V) + a * K_mm.matmul_nograd(V))
            system = self._system(operator, self._kernel, self._normal_factor(operator), self._rtol(X.dtype))
            coef, info = landmark_solve(system, K_nm.rmatmul_nograd(Y.detach()), X, L, Y, alpha)
        self.landmarks_, self.coef_, self.info_ = L, coef, info
        self._report(info, "the fit")
        return self

    @staticmethod
    def _normal_factor(operator) -> Cholesky | None:
        """The m x m normal matrix, formed in one streamed pass, factored as CG's preconditioner.

        It makes CG converge in one or two iterations (unpreconditioned, the
        squared conditioning of K_nm took ~800 at n=2048, m=256). Above
        ``NORMAL_FACTOR_MAX`` landmarks, or if roundoff defeats the factorization,
        CG runs without it.
        """
        m = operator.shape[0]
        if m > NORMAL_FACTOR_MAX:
            return None
        normal = operator.matmul_nograd(torch.eye(m, dtype=operator.dtype, device=operator.device))
        try:
            return Cholesky((normal + normal.T) / 2)
        except torch.linalg.LinAlgError:
            return None

    def predict(self, X) -> torch.Tensor:
        self._check_fitted("coef_")
        return self._predict(X, self.landmarks_, self.coef_)
