"""Kernel ridge regression, full and with landmarks, differentiable end to end."""
from __future__ import annotations

from dataclasses import replace

import torch

from .base import (
    Estimator,
    RegressorMixin,
    as_output,
    check_count,
    check_points,
    check_positive,
    check_sample_weight,
    check_targets,
    one_of,
)
from .implicit import implicit, requires_grad
from .krylov import KrylovInfo, cg
from .operators import Normal, Shifted
from .preconditioners import Cholesky, Jacobi, nystrom
from .sources import ShardedKernel

__all__ = ["KernelRidge", "LandmarkRidge"]

PRECONDITIONERS = (None, "nystrom", "jacobi")
# Landmark ridge's preconditioner is the normal matrix of a uniform sample of s rows, scaled by n / s (Falkon's is
# the sample of the m landmarks themselves). Its cost, 2 s m^2 dense flops, buys fewer passes of n m kernel entries:
# iterations fell like s^(-1/2) (n = 10^5, m = 4096, RBF: 10 to 1e-4 at s = 16384, 5 at 65536, 31 for Falkon's s = m),
# so the total is least where the sample costs half the iterations, s ~ (SAMPLE_SCALE n / m)^(2/3) (at 2-core rates:
# a dgemm flop is ~300x cheaper than a kernel entry of a pass). s >= n: the normal matrix itself.
SAMPLE_SCALE = 1e5
# Fits on a sampled normal matrix stop on the preconditioned residual sqrt(r^T P^-1 r) relative to the right-hand
# side's: the energy-norm error of the coefficients, which tracked the relative change of held-out predictions
# to within 15% at each of 50 iterations (n = 10^5, m = 4096, docs/solvers.md). 1e-4: predictions within 0.01% of
# the exact minimizer's, 26 iterations there with Falkon's preconditioner where the float64 Euclidean 1e-8 took 97
# (held-out R^2 equal to 6 digits); 11 with the sampled normal matrix.
FALKON_RTOL = 1e-4


def _direct_info(residuals: torch.Tensor) -> KrylovInfo:
    return KrylovInfo(residuals=residuals.detach(), converged=True, reason="direct",
                      column_converged=torch.ones_like(residuals, dtype=torch.bool))


def _merge(infos: list[KrylovInfo], columns: list[torch.Tensor], width: int) -> KrylovInfo:
    """One info for solves over groups of columns (one group per distinct alpha)."""
    if len(infos) == 1:
        return infos[0]
    residuals = infos[0].residuals.new_zeros(width)
    done = torch.zeros(width, dtype=torch.bool)
    for info, cols in zip(infos, columns):
        residuals[cols], done[cols] = info.residuals, info.column_converged
    failed = [i.reason for i in infos if not i.converged]
    return replace(infos[0], iterations=sum(i.iterations for i in infos), matvecs=sum(i.matvecs for i in infos),
                   product_seconds=sum(i.product_seconds for i in infos), residuals=residuals, converged=not failed,
                   column_converged=done,
                   reason=failed[0] if failed else infos[0].reason)


def _alpha(alpha, targets: int, dtype) -> torch.Tensor:
    """``alpha`` as a (targets,) tensor: one number for every target, or one per target."""
    if isinstance(alpha, (str, bytes)):
        raise TypeError(f"alpha must be a positive number or one value per target, got {type(alpha).__name__} {alpha!r}")
    if isinstance(alpha, torch.Tensor) or hasattr(alpha, "__len__"):
        values = alpha if isinstance(alpha, torch.Tensor) else torch.as_tensor(alpha, dtype=torch.float64)
        if values.ndim > 1 or values.numel() not in (1, targets):
            raise ValueError(f"alpha must be a positive number or one value per target ({targets}), "
                             f"got shape {tuple(values.shape)}")
        if not values.is_floating_point():
            values = values.to(torch.float64)
        detached = values.detach()
        if not bool(((detached > 0) & torch.isfinite(detached)).all()):
            raise ValueError(f"alpha must be finite and positive, got {alpha!r}")
        return values.to(dtype).reshape(-1).expand(targets)
    return torch.full((targets,), check_positive(alpha, "alpha"), dtype=dtype)


def _groups(alpha: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
    """Targets sharing an alpha share a solve: (alpha, column indices) per distinct value."""
    values = alpha.detach().cpu()
    return [(float(a), (values == a).nonzero().squeeze(1)) for a in torch.unique(values)]


class _Ridge(RegressorMixin, Estimator):
    """Fit bookkeeping shared by both ridge estimators: targets, grouped solves, prediction, score."""

    def _fit_data(self, X, y, *tensors):
        """Checked training points and (n, targets) targets (this rank's rows in a sharded fit)."""
        def targets(X):
            Y = check_targets(y, X.shape[0], X.dtype, self)
            self._vector_targets = Y.ndim == 1
            return (Y.unsqueeze(1) if Y.ndim == 1 else Y,)

        return self._fit_rows(X, targets, *tensors)

    def _solve(self, Y: torch.Tensor, alpha: torch.Tensor, make_solver, pairs: int):
        """Solve every group of targets sharing an alpha; returns the solution, the info and the adjoint solve.

        ``make_solver(a)`` returns ``solve(R) -> (X, info)`` for shift ``a``; ``pairs``: kernel entries
        one product evaluates (the info's ``pairs_per_second``).
        """
        groups = [(cols, make_solver(a)) for a, cols in _groups(alpha)]
        coef, infos = torch.empty_like(Y), []
        for cols, solve in groups:
            out, info = solve(Y[:, cols].contiguous())
            coef[:, cols] = out.to(coef.dtype)
            infos.append(info)

        def adjoint(G):  # the backward pass's solve: reports non-convergence, writes nothing on the estimator
            lam, adjoint_infos = torch.empty_like(G), []
            for cols, solve in groups:  # a float32 fit solves in float64 (LandmarkRidge): cotangents keep their dtype
                out, info = solve(G[:, cols].contiguous())
                lam[:, cols] = out.to(lam.dtype)
                adjoint_infos.append(info)
            self._report(_merge(adjoint_infos, [c for c, _ in groups], G.shape[1]), "the adjoint solve of the backward pass")
            return lam

        info = _merge(infos, [c for c, _ in groups], Y.shape[1])
        if info.product_seconds > 0:
            info.pairs_per_second = info.matvecs * pairs / info.product_seconds
        return coef, info, adjoint

    def _cg(self, operator, preconditioner, rtol, norm="euclidean", cheap=None):
        """``solve(R)`` by CG with this fit's settings (taken now: the adjoint solve of a later backward uses them too).

        ``operator(cheap)`` is the system on the exact sources or on cheaper ones. With ``cheap`` (default:
        a ``tile_dtype`` was given) CG iterates on the cheaper system and computes each restart's true residual
        on the exact one: iterative refinement, converged in the exact system's precision. Float32 tiles summed
        in float64 were no cheaper than float64 tiles (1.0-1.3x slower: RBF at d = 3 and 8, Matern, Laplacian;
        16384^2 and the landmark product); passes all in single precision are (``KernelRidge``).
        """
        atol, maxiter = self.atol, self.maxiter
        cheap = self.tile_dtype is not None if cheap is None else cheap
        A, exact = (operator(True), operator(False)) if cheap else (operator(False), None)
        return lambda R: cg(A, R, M=preconditioner, rtol=rtol, atol=atol, maxiter=maxiter, exact=exact, norm=norm)

    def _predict_with(self, X, centres: torch.Tensor, coef: torch.Tensor, rows: slice | None = None):
        out, numpy_out = self._times(X, centres, coef, rows)
        return as_output(out.squeeze(1) if self._vector_targets else out, numpy_out)

    def score(self, X, y, sample_weight=None) -> float:
        """R^2 of the predictions, averaged over targets (scikit-learn's ``r2_score``)."""
        pred = self.predict(X)
        pred = pred if isinstance(pred, torch.Tensor) else torch.from_numpy(pred)
        Y = check_targets(y, pred.shape[0], pred.dtype, self).reshape(pred.shape[0], -1).detach()
        pred = pred.detach().reshape(Y.shape)
        w = check_sample_weight(sample_weight, Y.shape[0], Y.dtype).to(Y.device).unsqueeze(1)
        residual = (w * (Y - pred).square()).sum(0)
        total = (w * (Y - (w * Y).sum(0) / w.sum()).square()).sum(0)
        r2 = torch.where(total > 0, 1 - residual / torch.where(total > 0, total, 1), (residual == 0).to(Y.dtype))
        return float(r2.mean())

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags

    def _more_tags(self):  # scikit-learn < 1.6
        return {**super()._more_tags(), "multioutput": True}


class KernelRidge(_Ridge):
    """Kernel ridge regression: ``(K + alpha I) dual_coef_ = y``, ``predict(x) = K(x, X) dual_coef_``.

    ``kernel``: ``RBF``, ``Laplacian``, ``Matern``, any ``k(x, y) -> LazyTensor``
    or a formula string. ``alpha``: a positive number or one per target.
    ``source``: ``"streamed"`` (each product a lazytensor sum, nothing n x n
    stored), ``"stored"`` (kernel matrix kept, same CG), ``"direct"``
    (Cholesky) or ``"auto"`` (direct up to ``AUTO_DIRECT_MAX_N`` points, then stored while the matrix takes at
    most ``AUTO_STORED_MAX_BYTES``, streamed above). The
    iterative fit is block CG with a rank-``rank`` Nystrom preconditioner from
    randomly pivoted Cholesky (or Jacobi); for float64 data its products are
    single-precision passes, refined against float64 residuals. Fit and predictions are
    differentiable with respect to ``X``, ``y``, query points, ``alpha`` (when
    a tensor) and every tensor the kernel formula closes over (implicit
    differentiation: one adjoint solve).
    """

    def __init__(self, kernel, alpha=1.0, *, source="auto", preconditioner="nystrom", rank="auto", rtol=None,
                 atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.alpha, self.source, self.preconditioner, self.rank = kernel, alpha, source, preconditioner, rank
        self.rtol, self.atol, self.maxiter, self.chunk_size = rtol, atol, maxiter, chunk_size
        self.tile_dtype, self.random_state = tile_dtype, random_state

    _parameters = {"preconditioner": one_of(*PRECONDITIONERS)}

    def fit(self, X, y):
        self._check_common()
        X, Y = self._fit_data(X, y, self.alpha)
        alpha = _alpha(self.alpha, Y.shape[1], X.dtype)
        self.source_ = self._resolve_source(X.shape[0], itemsize=X.element_size())
        if self.source_ == "direct":
            n = X.shape[0]
            K = self.make_sources("stored", X)[0].matrix

            def make_solver(a):
                chol = torch.linalg.cholesky(K + a * torch.eye(n, dtype=X.dtype, device=X.device))

                def solve(R):
                    out = torch.cholesky_solve(R, chol)
                    return out, _direct_info((R - K @ out - a * out).norm(dim=0))
                return solve
        else:
            K, fast = self.make_sources(self.source_, X.detach(), fast="preconditioner")
            if self.source_ == "sharded":  # Krylov vectors are whole on every rank
                X, Y = K.Y, K.gather(Y)  # K's columns: every rank's points
            n = X.shape[0]
            low_rank = None
            if self.preconditioner == "nystrom":
                smallest = float(alpha.detach().min())
                low_rank = nystrom(fast, self._rank(n), smallest, self.random_state, dtype=getattr(fast, "tile_dtype", X.dtype))
            diag = K.diag() if self.preconditioner == "jacobi" else None
            iterate = self._iteration_source(K, fast)

            def make_solver(a):
                M = low_rank.with_shift(a) if low_rank is not None else Jacobi(diag, a) if diag is not None else None
                return self._cg(lambda cheap: Shifted(iterate if cheap else K, a), M, self._rtol(X.dtype),
                                cheap=iterate is not K)

        with torch.no_grad():
            coef, info, adjoint = self._solve(Y.detach(), alpha, make_solver, n * n)

        def residual(c):  # y - (K + alpha I) c, differentiable in X, y, alpha and the kernel's tensors
            return Y - self.make_sources("streamed", X)[0] @ c - alpha * c

        self._rows = K.rows if self.source_ == "sharded" else None  # predictions: this rank's share of the points
        if self.source_ != "sharded":
            coef = implicit(coef, residual, adjoint, requires_grad(X, Y, alpha, self.make_sources("streamed", X)[0].K))
        self._publish(X_fit=X, dual_coef=coef.squeeze(1) if self._vector_targets else coef)
        self.info_ = info
        self._report(info, "the fit")
        return self

    def _iteration_source(self, exact, fast):
        """What CG iterates on: ``fast`` where a ``tile_dtype`` was given (summed in the data's dtype); by
        default, for float64 data, the kernel all in single precision (``sum_dtype``: a pass 2x faster than
        float64's), refined against ``exact``; else ``exact``. n = 8192, d = 8, one target, one thread (a
        ``/tmp`` script): 17 single-precision iterations and 2 exact passes, 2.1 s, against 14 exact iterations,
        2.8 s; with the harness's 2 targets, docs/solvers.md."""
        if self.tile_dtype is not None or fast is exact or fast.tile_dtype == exact.dtype:
            return fast
        return fast.with_tile_dtype(fast.tile_dtype, sum_dtype=fast.tile_dtype)

    def predict(self, X):
        self._check_fitted("dual_coef")
        coef = self._dual_coef.unsqueeze(1) if self._vector_targets else self._dual_coef
        return self._predict_with(X, self._X_fit, coef, self._rows)


class LandmarkRidge(_Ridge):
    """Ridge regression on landmark features: ``(K_nm^T K_nm + alpha K_mm) coef_ = K_nm^T y``.

    Landmarks are given (``landmarks``, an (m, d) array) or drawn as
    ``n_landmarks`` distinct training points (default ``min(n, 256)``,
    reproducible through ``random_state``). ``predict(x) = K(x, landmarks_) coef_``.
    The iterative fit runs CG on the m x m normal equations (each product one
    streamed pass that evaluates every ``K_nm`` tile once for ``K_nm^T K_nm v``),
    preconditioned by the factored normal matrix of s sampled rows (``SAMPLE_SCALE``).
    Where s covers every row that is the normal matrix itself: CG stops after one
    or two iterations, ``rtol`` (default 1e-8 in float64) bounding the Euclidean
    residual. Larger fits stop on the preconditioned residual, the coefficients'
    energy-norm error: predictions within about ``rtol`` (default
    ``FALKON_RTOL`` = 1e-4) relative of the exact minimizer's; ``info_.norm``
    says which. ``source="direct"`` solves the augmented least-squares problem
    by QR. Differentiable like :class:`KernelRidge` (and in the landmarks).
    """

    # The stored fit (the whole normal matrix preconditions: one CG iteration) matched the QR at n = 256 and was
    # 1.2-2.6x faster at 512-2048 (m = 256; `python -m harness ml --case landmark --variants stored,direct`).
    _auto_direct_max_n = 256

    def __init__(self, kernel, alpha=1.0, *, n_landmarks=None, landmarks=None, source="auto", rtol=None,
                 atol=0.0, maxiter=None, chunk_size=None, tile_dtype=None, random_state=0):
        self.kernel, self.alpha, self.n_landmarks, self.landmarks = kernel, alpha, n_landmarks, landmarks
        self.source, self.rtol, self.atol, self.maxiter = source, rtol, atol, maxiter
        self.chunk_size, self.tile_dtype, self.random_state = chunk_size, tile_dtype, random_state

    def _choose_landmarks(self, X):
        """Given landmarks, or ``n_landmarks`` distinct training points; in a sharded fit the indices are
        drawn over every rank's rows (the same draw as one process) and each rank contributes its picks."""
        if self.landmarks is not None:
            if self.n_landmarks is not None:
                raise ValueError("give either landmarks or n_landmarks, not both")
            return self._agreed(lambda: check_points(self.landmarks, "landmarks", estimator=self,
                                                     n_features=X.shape[1], dtype=X.dtype)[0])
        sizes = self._sharding.sizes(X.shape[0], X.device) if self.source == "sharded" else [X.shape[0]]
        n = sum(sizes)
        m = self._agreed(lambda: check_count(self.n_landmarks if self.n_landmarks is not None else min(n, 256),
                                             "n_landmarks", n, "at most the number of training points"))
        idx = self._draw(n, m).to(X.device)
        if self.source != "sharded":
            return X[idx]
        ends = torch.tensor(sizes).cumsum(0)
        picks = torch.bucketize(idx.cpu(), ends, right=True).bincount(minlength=len(sizes)).tolist()  # per rank
        start = sum(sizes[:self._sharding.rank])
        mine = idx[(idx >= start) & (idx < start + X.shape[0])] - start
        return self._sharding.gather_rows(X[mine], picks)[0]  # rank order is index order

    def _draw(self, n: int, k: int) -> torch.Tensor:
        """The first ``k`` of a permutation of ``n`` rows fixed by ``random_state``, sorted: drawn landmarks are
        its first m, the preconditioner's sample its first s (the landmarks among them)."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(int(self.random_state)))[:k].sort().values

    def fit(self, X, y):
        self._check_common()
        X, Y = self._fit_data(X, y, self.alpha, self.landmarks)
        alpha = _alpha(self.alpha, Y.shape[1], X.dtype)
        L = self._choose_landmarks(X)
        m = L.shape[0]
        self.source_ = self._resolve_source(X.shape[0], m)  # 8-byte entries: iterative routes solve in float64
        # Float32 data is solved as float64 data, except directly: the normal equations square K_nm's conditioning,
        # and float32 sums stalled above the default target (n = 10^5, m = 1024: 189 iterations and 44 s without
        # converging, where float64 data took 5 and 4.2 s). The coefficients come back in the data's dtype.
        wide = X.dtype if self.source_ == "direct" else torch.float64
        Xw, Lw, Yw = (t.detach().to(wide) for t in (X, L, Y))
        K_nm, fast_nm = self.make_sources(self.source_, Xw, Lw, fast="preconditioner")
        if self.source_ == "sharded":  # K_mm's rows split over the ranks too; vectors by row are whole
            Yw = K_nm.gather(Yw)
            share = slice(m * self._sharding.rank // self._sharding.size, m * (self._sharding.rank + 1) // self._sharding.size)
            K_mm = ShardedKernel(self._kernel, Lw[share], Lw, sharding=self._sharding, chunk_size=self.chunk_size)
            fast_mm = K_mm.with_tile_dtype(fast_nm.tile_dtype)
        else:
            K_mm, fast_mm = self.make_sources(self.source_, Lw, fast="preconditioner")
        eye = torch.eye(m, dtype=X.dtype, device=X.device)
        with torch.no_grad():
            rhs = K_nm.rmatmul_nograd(Yw)
            if self.source_ == "direct":
                # min ||K_nm c - y||^2 + alpha ||R c||^2 with K_mm = R^T R, by QR of the stacked matrix.
                Kmm = K_mm.matrix
                jitter = m * torch.finfo(X.dtype).eps * Kmm.diagonal().abs().max()
                R = torch.linalg.cholesky(Kmm + jitter * eye).mT

                def make_solver(a):
                    T = torch.linalg.qr(torch.cat([K_nm.matrix, a ** 0.5 * R]), mode="r")[1]

                    def solve(G):  # (T^T T)^{-1} G
                        out = torch.cholesky_solve(G, T.mT)
                        return out, _direct_info((G - K_nm.gram(out) - a * (Kmm @ out)).norm(dim=0))
                    return solve
            else:
                n = K_nm.shape[0]
                s = min(n, max(m, round((SAMPLE_SCALE * n / m) ** (2 / 3))))
                gram = fast_nm.row_gram(self._draw(n, s).to(X.device)).mul_(n / s)
                Kmm = fast_mm.columns(torch.arange(m, device=X.device))  # entries to the tile dtype

                def make_solver(a):
                    """The sampled normal matrix, factored, preconditions CG. All rows: the normal matrix itself,
                    CG stops after one or two iterations at the Euclidean ``rtol``; sampled, on the preconditioned
                    residual."""
                    M = Cholesky(torch.add(gram, Kmm, alpha=a))
                    normal = lambda cheap: Normal(fast_nm, fast_mm, a) if cheap else Normal(K_nm, K_mm, a)  # noqa: E731
                    if s == n:
                        return self._cg(normal, M, self._rtol(X.dtype))
                    return self._cg(normal, M, self.rtol if self.rtol is not None else FALKON_RTOL, norm="preconditioned")

            coef, info, adjoint = self._solve(rhs, alpha, make_solver, K_nm.shape[0] * m + m * m)  # entries a product evaluates
            coef = coef.to(X.dtype)

        def residual(c):  # K_nm^T (y - K_nm c) - alpha K_mm c, differentiable
            K_nm, K_mm = self.make_sources("streamed", X, L)[0], self.make_sources("streamed", L)[0]
            return K_nm.T @ (Y - K_nm @ c) - alpha * (K_mm @ c)

        if self.source_ != "sharded":
            coef = implicit(coef, residual, adjoint, requires_grad(X, Y, L, alpha, self.make_sources("streamed", X, L)[0].K))
        self._publish(landmarks=L, coef=coef.squeeze(1) if self._vector_targets else coef)
        self.info_ = info
        self._report(info, "the fit")
        return self

    def predict(self, X):
        self._check_fitted("coef")
        coef = self._coef.unsqueeze(1) if self._vector_targets else self._coef
        return self._predict_with(X, self._landmarks, coef)
