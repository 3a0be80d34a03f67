"""Spectral kernel estimators: PCA (centred kernel), Fisher discriminant (LDA) and SVD, on one _Spectral base."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .base import (
    AUTO_SPECTRAL_DIRECT_MAX_N,
    ClassifierMixin,
    Estimator,
    TransformerMixin,
    as_output,
    check_count,
    check_labels,
    check_points,
    check_positive,
    check_sample_weight,
    one_of,
)
from .krylov import KrylovInfo, cg, fix_signs, golub_kahan_svds, lanczos_eigsh
from .operators import Centred, Shifted
from .preconditioners import LowRankPreconditioner, pivoted_cholesky
from .sources import ShardedKernel, Source

NOT_ALL = "not None: scikit-learn's 'every component' needs all n of them, an n x n matrix that streamed fits never store"

__all__ = ["KernelPCA", "KernelLDA", "KernelSVD"]


def _direct_info(k: int, dtype) -> KrylovInfo:
    return KrylovInfo(residuals=torch.zeros(k, dtype=dtype), converged=True, reason="direct",
                      column_converged=torch.ones(k, dtype=torch.bool))


def _leading_eigh(S: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest eigenpairs of a symmetric matrix, in decreasing order."""
    values, vectors = torch.linalg.eigh(S)
    return values.flip(0)[:k], vectors.flip(1)[:, :k]


class _Spectral(Estimator):
    """What the spectral fits share: their kernel sources and how a fit ends.

    Their iterations evaluate tiles in the data's dtype unless ``tile_dtype``
    asks otherwise (Lanczos and Golub-Kahan do not refine against exact
    products), and ``source="direct"`` is the stored matrix, factored densely.
    """

    _auto_direct_max_n = AUTO_SPECTRAL_DIRECT_MAX_N

    def _kernel_sources(self, X, Y=None, *, m: int | None = None):
        """``(exact, fast)`` sources of ``K(X, Y)``; ``m``: its columns (default: square), for ``source="auto"``."""
        sizes = sorted((X.shape[0], X.shape[0] if m is None else m))
        self.source_ = self._resolve_source(sizes[1], sizes[0], X.element_size())
        return self.make_sources("stored" if self.source_ == "direct" else self.source_, X, Y, fast="asked")

    def _done(self, info, what: str, **learned):
        """Publish the learned attributes and ``info_``; warn if ``what`` did not converge."""
        self._publish(**learned)
        self.info_ = info
        self._report(info, what)
        return self


class _Projection(TransformerMixin, _Spectral):
    """A fit whose ``transform`` projects on ``eigenvectors_``."""

    def get_feature_names_out(self, input_features=None) -> np.ndarray:
        """Names of ``transform``'s columns, scikit-learn's way (``kernelpca0``, ...), e.g. for ``set_output``."""
        self._check_fitted("eigenvectors")
        prefix = type(self).__name__.lower()
        return np.asarray([f"{prefix}{i}" for i in range(self._eigenvectors.shape[1])], dtype=object)


class KernelPCA(_Projection):
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
        self.rtol, self.maxiter, self.chunk_size = rtol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, y=None):
        self._check_common()
        X = self._fit_rows(X)[0].detach()
        K = self._kernel_sources(X)[1]
        X, self._rows = _whole(K, X)
        n = X.shape[0]
        k = check_count(self.n_components, "n_components", n, "at most the number of samples; " + NOT_ALL)
        column_means = K.matmul_nograd(torch.full((n, 1), 1.0 / n, dtype=X.dtype, device=X.device)).squeeze(1)
        if self.source_ == "direct":
            Kc = K.matrix - column_means[:, None] - column_means[None, :] + column_means.mean()
            values, vectors = _leading_eigh(Kc, k)
            vectors = vectors * fix_signs(vectors)
            info = _direct_info(k, X.dtype)
        else:
            values, vectors, info = lanczos_eigsh(Centred(K), k, search_width=self.search_width,
                                                  rtol=self._rtol(X.dtype), maxiter=self.maxiter,
                                                  random_state=self.random_state)
        return self._done(info, "the eigensolver", X_fit=X, eigenvalues=values, eigenvectors=vectors,
                          column_means=column_means)

    def fit_transform(self, X, y=None):
        self.fit(X)
        return as_output(self._eigenvectors * self._eigenvalues.clamp_min(0).sqrt(), self._numpy)

    def transform(self, X):
        self._check_fitted("eigenvectors")
        n, dtype = self._X_fit.shape[0], self._X_fit.dtype
        values, means = self._eigenvalues, self._column_means
        positive = values > 0
        scaled = torch.where(positive, self._eigenvectors / values.clamp_min(torch.finfo(dtype).tiny).sqrt(), 0.0)
        ones = torch.full((n, 1), 1.0 / n, dtype=dtype, device=self._X_fit.device)
        with torch.no_grad():  # projections and row means
            both, numpy_out = self._times(X, self._X_fit, torch.cat([scaled, ones], 1), self._rows)
        projected, row_means = both[:, :-1], both[:, -1:]
        sums = scaled.sum(0)
        return as_output(projected - means @ scaled - row_means * sums + means.mean() * sums, numpy_out)


def _whole(K, X):
    """``(every rank's points, this rank's rows)`` of a sharded source ``K``; ``(X, None)`` for any other."""
    return (K.Y, K.rows) if isinstance(K, ShardedKernel) else (X, None)


class _WithinClass(Source):
    """``N = K H K`` (``H`` removes class means): CG's operator, and pivoted Cholesky's diagonal and columns."""

    def __init__(self, K, onehot, counts, class_sums):
        self.K, self.onehot, self.counts, self.class_sums = K, onehot, counts, class_sums
        self.shape, self.dtype, self.device = K.shape, K.dtype, K.device

    def centre(self, V):
        return V - self.onehot @ ((self.onehot.T @ V) / self.counts[:, None])

    def matmul(self, V):
        return self.K.matmul_nograd(self.centre(self.K.matmul_nograd(V)))

    rmatmul = matmul

    def diag(self):  # ||H K e_i||^2 = sum_k K_ik^2 - sum_c (sum_{k in c} K_ik)^2 / n_c
        return self.K.squared_row_norms() - (self.class_sums.square() / self.counts).sum(1)

    def columns(self, idx):
        return self.K.matmul_nograd(self.centre(self.K.columns(idx)))


class KernelLDA(ClassifierMixin, _Projection):
    """Kernel Fisher discriminant (Mika et al. 1999).

    With class means of kernel columns ``m_c`` and their mean ``m``, the
    between-class matrix is ``M = sum_c n_c (m_c - m)(m_c - m)^T`` and the
    within-class matrix ``N = K H K`` (``H`` removes class means). The leading
    generalized eigenpairs of ``(M, N + regularization I)`` live in
    ``span((N + reg I)^{-1} (m_c - m))``, so the fit is one block CG solve with
    one right-hand side per class (each product two streamed passes) and a
    C x C eigenproblem. CG is preconditioned by a Nystrom factor of ``N``
    itself (randomly pivoted Cholesky on N's diagonal and columns, one
    streamed pass per block of pivots): a factor of ``K`` misses ``N`` by
    ``||K|| ||K - F F^T||``, far above a small regularization.
    ``eigenvectors_`` are normalized so that ``v^T (N + reg I) v = 1`` (as
    ``scipy.linalg.eigh``); ``transform(x) = K(x, X) eigenvectors_``;
    ``predict`` picks the nearest projected class mean.
    """

    def __init__(self, kernel, n_components=None, *, regularization=1e-3, source="auto", preconditioner="nystrom",
                 rank="auto", rtol=None, atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.n_components, self.regularization = kernel, n_components, regularization
        self.source, self.preconditioner, self.rank = source, preconditioner, rank
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, atol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    _parameters = {"preconditioner": one_of(None, "nystrom")}
    _auto_direct_max_n = 2 * AUTO_SPECTRAL_DIRECT_MAX_N  # the direct solve forms K H K and one Cholesky, no eigh

    def fit(self, X, y):
        self._check_common()
        reg = check_positive(self.regularization, "regularization")
        X, classes, labels = self._fit_rows(X, lambda X: check_labels(y, X.shape[0]))
        X = X.detach()
        K, fast = self._kernel_sources(X)  # N = K H K squares K's conditioning: float32 tiles cost more iterations
        X, self._rows = _whole(K, X)
        if self._rows is not None:  # every rank's labels, in rank order
            classes, labels = _gather_labels(classes[labels.numpy()] if isinstance(classes, np.ndarray)
                                             else classes[labels], self._sharding)
        n = X.shape[0]
        C = len(classes)
        if C < 2:
            raise ValueError(f"y must contain at least two classes, got {C} class")
        k = check_count(C - 1 if self.n_components is None else self.n_components, "n_components", C - 1,
                        "a C-class discriminant has at most C - 1 directions")
        onehot = torch.nn.functional.one_hot(labels.to(X.device), C).to(X.dtype)
        counts = onehot.sum(0)
        class_sums = K.matmul_nograd(onehot)
        rhs = (class_sums / counts - class_sums.sum(1, keepdim=True) / n) * counts.sqrt()  # M = rhs rhs^T
        within = _WithinClass(K, onehot, counts, class_sums)
        fast_within = within if fast is K else _WithinClass(fast, onehot, counts, class_sums)
        if self.source_ == "direct":
            S = within.matmul(torch.eye(n, dtype=X.dtype, device=X.device))
            S.diagonal().add_(reg)
            Z = torch.cholesky_solve(rhs, torch.linalg.cholesky((S + S.T) / 2))
            info = _direct_info(C, X.dtype)
        else:
            M = None
            if self.preconditioner == "nystrom":
                factor = pivoted_cholesky(fast_within, self._rank(n), tolerance=reg, random_state=self.random_state,
                                          dtype=getattr(fast, "tile_dtype", X.dtype))
                M = LowRankPreconditioner(factor, reg)
            Z, info = cg(Shifted(fast_within, reg), rhs, M=M, rtol=self._rtol(X.dtype), atol=self.atol,
                         maxiter=self.maxiter, exact=Shifted(within, reg))
        small = rhs.T @ Z
        values, vectors = _leading_eigh((small + small.T) / 2, k)
        directions = Z @ vectors / values.clamp_min(torch.finfo(X.dtype).tiny).sqrt()
        directions = directions * fix_signs(directions)
        projected = K.matmul_nograd(directions)
        self.classes_ = classes if isinstance(classes, np.ndarray) else as_output(classes, self._numpy)
        return self._done(info, "the within-class solve", X_fit=X, eigenvalues=values, eigenvectors=directions,
                          class_means=(onehot.T @ projected) / counts[:, None])

    def _project(self, X) -> tuple[torch.Tensor, bool]:
        self._check_fitted("eigenvectors")
        with torch.no_grad():
            return self._times(X, self._X_fit, self._eigenvectors, self._rows)

    def transform(self, X):
        projected, numpy_out = self._project(X)
        return as_output(projected, numpy_out)

    def predict(self, X):
        projected, numpy_out = self._project(X)
        nearest = torch.cdist(projected, self._class_means).argmin(1)
        if isinstance(self.classes_, np.ndarray):
            return self.classes_[nearest.cpu().numpy()]
        return as_output(self.classes_[nearest], numpy_out)

    def score(self, X, y, sample_weight=None) -> float:
        """Accuracy of ``predict``, weighted by ``sample_weight`` where given (scikit-learn's ``accuracy_score``)."""
        predicted = self.predict(X)
        if isinstance(predicted, torch.Tensor):
            right = (predicted == torch.as_tensor(y, device=predicted.device)).cpu().double()
        else:
            right = torch.from_numpy(np.asarray(predicted == np.asarray(y), dtype=np.float64))
        if right.shape != (len(predicted),):
            raise ValueError(f"y must be a 1-D array of {len(predicted)} labels, got shape {tuple(np.shape(y))}")
        w = check_sample_weight(sample_weight, right.shape[0], torch.float64)
        return float((w * right).sum() / w.sum())


def _gather_labels(mine, sharding):
    """Classes and codes of every rank's labels (NumPy or torch, any type NumPy holds), concatenated in rank order."""
    parts = [None] * sharding.size
    dist.all_gather_object(parts, mine, group=sharding.group)
    parts = [p for p in parts if len(p)]
    whole = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts)
    return check_labels(whole, len(whole))


class KernelSVD(_Spectral):
    """Leading singular triplets of the rectangular kernel ``K(X, Y)`` by block Golub-Kahan-Lanczos.

    ``fit(X, Y)`` with ``Y`` a second point set ((m, d)); ``Y=None`` factors
    ``K(X, X)``. ``singular_values_`` (k,), ``left_vectors_`` (n x k),
    ``right_vectors_`` (m x k), the largest-magnitude entry of each left
    vector positive.
    """

    def __init__(self, kernel, n_components=2, *, search_width=10, source="auto", rtol=None, maxiter=None,
                 chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.n_components, self.search_width, self.source = kernel, n_components, search_width, source
        self.rtol, self.maxiter, self.chunk_size = rtol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    def fit(self, X, Y=None):
        self._check_common()
        X = self._fit_rows(X)[0].detach()
        if Y is not None:  # a second point set, replicated on every rank of a sharded fit
            Y = self._agreed(lambda: check_points(Y, "Y", estimator=self, n_features=X.shape[1], dtype=X.dtype)[0].detach())
        K = self._kernel_sources(X, Y, m=None if Y is None else Y.shape[0])[1]
        k = check_count(self.n_components, "n_components", min(K.shape), "at most min(n_X, n_Y); " + NOT_ALL)
        if self.source_ == "direct":
            U, s, Vt = torch.linalg.svd(K.matrix, full_matrices=False)
            signs = fix_signs(U[:, :k])
            s, left, right, info = s[:k], U[:, :k] * signs, Vt[:k].T * signs, _direct_info(k, X.dtype)
        else:
            s, left, right, info = golub_kahan_svds(K, k,
                                                    search_width=self.search_width, rtol=self._rtol(X.dtype),
                                                    maxiter=self.maxiter, random_state=self.random_state)
        return self._done(info, "the singular value solver", singular_values=s, left_vectors=left, right_vectors=right)
