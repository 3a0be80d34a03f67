"""Spectral kernel estimators: PCA (centred kernel), Fisher discriminant (LDA) and SVD."""
from __future__ import annotations

import torch

from .base import Estimator, check_count, check_points, check_positive
from .krylov import KrylovInfo, cg, fix_signs, golub_kahan_svds, lanczos_eigsh
from .preconditioners import LowRankShift, nystrom_factor
from .sources import FunctionOperator

__all__ = ["KernelPCA", "KernelLDA", "KernelSVD"]


def _direct_info(k: int, dtype) -> KrylovInfo:
    return KrylovInfo(residuals=torch.zeros(k, dtype=dtype), converged=True, reason="direct",
                      column_converged=torch.ones(k, dtype=torch.bool))


def _check_width(search_width) -> None:
    if not isinstance(search_width, int) or isinstance(search_width, bool) or search_width < 0:
        raise ValueError(f"search_width must be a non-negative int, got {search_width!r}")


class KernelPCA(Estimator):
    """Leading eigenpairs of the centred kernel ``H K H`` (``H = I - 11^T / n``), as in scikit-learn.

    The centring is applied inside the operator (``H (K (H V))``), never to a
    stored matrix. ``eigenvalues_`` are those of ``H K H``; ``eigenvectors_``
    (n x k) are unit vectors with the largest-magnitude entry positive.
    ``transform(x)`` projects the centred ``K(x, X)`` on
    ``eigenvectors_ / sqrt(eigenvalues_)``; ``fit_transform`` returns
    ``eigenvectors_ * sqrt(eigenvalues_)``.
    """

    def __init__(self, kernel, n_components=2, *, search_width=10, source="auto", rtol=None, maxiter=None,
                 chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.n_components, self.search_width, self.source = kernel, n_components, search_width, source
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, 0.0, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, y=None):
        self._check_common()
        _check_width(self.search_width)
        X = check_points(X).detach()
        n = X.shape[0]
        k = check_count(self.n_components, "n_components", n, "at most the number of samples")
        self.source_ = self._resolve_source(n)
        K = self._source("stored" if self.source_ == "direct" else self.source_, X)
        self.column_means_ = K.matmul_nograd(torch.full((n, 1), 1.0 / n, dtype=X.dtype, device=X.device)).squeeze(1)
        if self.source_ == "direct":
            Kc = K.matrix - self.column_means_[:, None] - self.column_means_[None, :] + self.column_means_.mean()
            values, vectors = torch.linalg.eigh(Kc)
            values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
            vectors = vectors * fix_signs(vectors)
            info = _direct_info(k, X.dtype)
        else:
            def centred(V):
                KV = K.matmul_nograd(V - V.mean(0))
                return KV - KV.mean(0)

            operator = FunctionOperator(K.shape, K.dtype, K.device, centred)
            values, vectors, info = lanczos_eigsh(operator, k, search_width=self.search_width,
                                                  rtol=self._rtol(X.dtype), maxiter=self.maxiter,
                                                  random_state=self.random_state)
        self.X_fit_, self.eigenvalues_, self.eigenvectors_, self.info_ = X, values, vectors, info
        self._report(info, "the eigensolver")
        return self

    def fit_transform(self, X, y=None) -> torch.Tensor:
        self.fit(X)
        return self.eigenvectors_ * self.eigenvalues_.clamp_min(0).sqrt()

    def transform(self, X) -> torch.Tensor:
        self._check_fitted("eigenvectors_")
        X = check_points(X, "X", n_features=self.X_fit_.shape[1], dtype=self.X_fit_.dtype).detach()
        n = self.X_fit_.shape[0]
        positive = self.eigenvalues_ > 0
        scaled = torch.where(positive, self.eigenvectors_ / self.eigenvalues_.clamp_min(1e-300).sqrt(), 0.0)
        ones = torch.full((n, 1), 1.0 / n, dtype=X.dtype, device=X.device)
        K_new = self._source("streamed" if self.source_ == "streamed" else "stored", X, self.X_fit_)
        both = K_new.matmul_nograd(torch.cat([scaled, ones], 1))  # one pass: projections and row means
        projected, row_means = both[:, :-1], both[:, -1:]
        sums = scaled.sum(0)
        return projected - self.column_means_ @ scaled - row_means * sums + self.column_means_.mean() * sums


class KernelLDA(Estimator):
    """Kernel Fisher discriminant (Mika et al. 1999).

    With class means of kernel columns ``m_c`` and their mean ``m``, the
    between-class matrix is ``M = sum_c n_c (m_c - m)(m_c - m)^T`` and the
    within-class matrix ``N = sum_c K_c (I - 1/n_c) K_c^T``. The leading
    generalized eigenpairs of ``(M, N + regularization I)`` live in
    ``span((N + reg I)^{-1} (m_c - m))``, so the fit is one block CG solve with
    one right-hand side per class (each product two streamed passes,
    Nystrom-preconditioned) and a C x C eigenproblem. ``eigenvectors_`` are
    normalized so that ``v^T (N + reg I) v = 1`` (as ``scipy.linalg.eigh``);
    ``transform(x) = K(x, X) eigenvectors_``; ``predict`` picks the nearest
    projected class mean.
    """

    def __init__(self, kernel, n_components=None, *, regularization=1e-3, source="auto", preconditioner="nystrom",
                 rank=256, rtol=None, atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.n_components, self.regularization = kernel, n_components, regularization
        self.source, self.preconditioner, self.rank = source, preconditioner, rank
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, atol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, y):
        self._check_common()
        if self.preconditioner not in (None, "nystrom"):
            raise ValueError(f"preconditioner must be None or 'nystrom', got {self.preconditioner!r}")
        check_positive(self.regularization, "regularization")
        X = check_points(X).detach()
        n = X.shape[0]
        if not isinstance(y, torch.Tensor) or y.ndim != 1 or y.shape[0] != n:
            raise ValueError(f"y must be a 1-D tensor of {n} class labels, got "
                             f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
        self.classes_, labels = torch.unique(y, return_inverse=True)
        C = len(self.classes_)
        if C < 2:
            raise ValueError(f"y must contain at least two classes, got {C}")
        k = check_count(C - 1 if self.n_components is None else self.n_components, "n_components", C - 1,
                        "a C-class discriminant has at most C - 1 directions")
        reg = float(self.regularization)
        onehot = torch.nn.functional.one_hot(labels, C).to(X.dtype)
        counts = onehot.sum(0)
        centred_means = onehot / counts - 1.0 / n  # K @ this = m_c - m, one column per class
        self.source_ = self._resolve_source(n)
        K = self._source("stored" if self.source_ == "direct" else self.source_, X)
        G = K.matmul_nograd(centred_means)
        rhs = G * counts.sqrt()  # M = rhs rhs^T

        def within(V):  # K (I - class averaging) K V
            KV = K.matmul_nograd(V)
            return K.matmul_nograd(KV - onehot @ ((onehot.T @ KV) / counts[:, None]))

        if self.source_ == "direct":
            S = within(torch.eye(n, dtype=X.dtype, device=X.device))
            S.diagonal().add_(reg)
            Z = torch.cholesky_solve(rhs, torch.linalg.cholesky((S + S.T) / 2))
            info = _direct_info(C, X.dtype)
        else:
            operator = FunctionOperator(K.shape, K.dtype, K.device, lambda V: within(V) + reg * V)
            Z, info = cg(operator, rhs, M=self._preconditioner(K, onehot, counts, reg), rtol=self._rtol(X.dtype),
                         atol=self.atol, maxiter=self.maxiter)
        small = rhs.T @ Z
        values, vectors = torch.linalg.eigh((small + small.T) / 2)
        values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
        directions = Z @ vectors / values.clamp_min(torch.finfo(X.dtype).tiny).sqrt()
        directions = directions * fix_signs(directions)
        self.X_fit_, self.eigenvalues_, self.eigenvectors_, self.info_ = X, values, directions, info
        projected = K.matmul_nograd(directions)
        self.class_means_ = (onehot.T @ projected) / counts[:, None]
        self._report(info, "the within-class solve")
        return self

    def _preconditioner(self, K, onehot, counts, reg):
        """``N ~ F (F^T H_c F) F^T`` from K's Nystrom factor F, applied by Woodbury."""
        if self.preconditioner is None:
            return None
        F = nystrom_factor(K, min(self.rank, K.shape[0]), self.random_state)
        HF = F - onehot @ ((onehot.T @ F) / counts[:, None])
        core_values, core_vectors = torch.linalg.eigh(HF.T @ HF)
        return LowRankShift(F @ (core_vectors * core_values.clamp_min(0).sqrt()), reg)

    def transform(self, X) -> torch.Tensor:
        self._check_fitted("eigenvectors_")
        X = check_points(X, "X", n_features=self.X_fit_.shape[1], dtype=self.X_fit_.dtype).detach()
        kind = "streamed" if self.source_ == "streamed" else "stored"
        return self._source(kind, X, self.X_fit_).matmul_nograd(self.eigenvectors_)

    def predict(self, X) -> torch.Tensor:
        distances = torch.cdist(self.transform(X), self.class_means_)
        return self.classes_[distances.argmin(1)]


class KernelSVD(Estimator):
    """Leading singular triplets of the rectangular kernel ``K(X, Y)`` by block Golub-Kahan-Lanczos.

    ``singular_values_`` (k,), ``left_vectors_`` (n x k), ``right_vectors_``
    (m x k), the largest-magnitude entry of each left vector positive.
    """

    def __init__(self, kernel, n_components=2, *, search_width=10, source="auto", rtol=None, maxiter=None,
                 chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.n_components, self.search_width, self.source = kernel, n_components, search_width, source
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, 0.0, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, Y):
        self._check_common()
        _check_width(self.search_width)
        X = check_points(X).detach()
        Y = check_points(Y, "Y", n_features=X.shape[1], dtype=X.dtype).detach()
        k = check_count(self.n_components, "n_components", min(X.shape[0], Y.shape[0]),
                        "at most min(n_X, n_Y)")
        self.source_ = self._resolve_source(max(X.shape[0], Y.shape[0]))
        if self.source_ == "direct":
            U, s, Vt = torch.linalg.svd(self._kernel.tile(X, Y), full_matrices=False)
            signs = fix_signs(U[:, :k])
            s, left, right, info = s[:k], U[:, :k] * signs, Vt[:k].T * signs, _direct_info(k, X.dtype)
        else:
            s, left, right, info = golub_kahan_svds(self._source(self.source_, X, Y), k,
                                                    search_width=self.search_width, rtol=self._rtol(X.dtype),
                                                    maxiter=self.maxiter, random_state=self.random_state)
        self.singular_values_, self.left_vectors_, self.right_vectors_, self.info_ = s, left, right, info
        self._report(info, "the singular value solver")
        return self
