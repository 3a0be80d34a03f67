"""Estimators against scikit-learn, closed forms and dense decompositions; parameters and bad input."""
import warnings

import numpy as np
import pytest
import torch

import lazytensor as lt
from solvers import (
    RBF,
    ConvergenceWarning,
    KernelLDA,
    KernelPCA,
    KernelRidge,
    KernelSVD,
    LandmarkRidge,
    Laplacian,
    Matern,
    NotFittedError,
)

from .test_kernels import reference

ITERATIVE = ("stored", "streamed")
ALL = ("direct", "stored", "streamed")


def _regression(n=150, d=3, c=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=dtype)
    Y = torch.sin(X @ torch.randn(d, c, generator=g, dtype=dtype)) + 0.1 * torch.randn(n, c, generator=g, dtype=dtype)
    return X, Y, torch.randn(23, d, generator=g, dtype=dtype)


@pytest.mark.parametrize("source", ALL)
@pytest.mark.parametrize("preconditioner", ["nystrom", "jacobi", None])
def test_ridge_matches_scikit_learn(source, preconditioner):
    from sklearn.kernel_ridge import KernelRidge as SkRidge

    X, Y, Xq = _regression()
    ref = SkRidge(alpha=0.3, kernel="rbf", gamma=0.4).fit(X.numpy(), Y.numpy()).predict(Xq.numpy())
    est = KernelRidge(RBF(0.4), 0.3, source=source, preconditioner=preconditioner, rank=40, rtol=1e-11,
                      chunk_size=33).fit(X, Y)
    torch.testing.assert_close(est.predict(Xq), torch.from_numpy(ref), rtol=1e-8, atol=1e-9)
    assert est.info_.converged and est.source_ == source
    assert est.predict(Xq[0:1]).shape == (1, 2)
    assert (est.info_.pairs_per_second > 0) == (source != "direct")  # kernel entries per second of the CG products


def test_ridge_float32_and_vector_targets():
    X, Y, Xq = _regression(dtype=torch.float32)
    ref = KernelRidge(Laplacian(0.5), 1.0, source="direct").fit(X.double(), Y[:, 0].double()).predict(Xq.double())
    for source in ITERATIVE:
        est = KernelRidge(Laplacian(0.5), 1.0, source=source, rtol=1e-5).fit(X, Y[:, 0])
        pred = est.predict(Xq)
        assert pred.shape == (23,) and pred.dtype == torch.float32
        assert (pred.double() - ref).abs().max() < 1e-4
    fast = KernelRidge(Laplacian(0.5), 1.0, source="streamed", tile_dtype=torch.float32,
                       rtol=1e-6).fit(X.double(), Y[:, 0].double())
    assert (fast.predict(Xq.double()) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("source", ALL)
def test_landmark_matches_closed_form(source):
    X, Y, Xq = _regression()
    kernel = Matern(1.5, 0.6)
    L = X[10:40]
    Knm, Kmm = reference(kernel, X, L), reference(kernel, L, L)
    coef = torch.linalg.solve(Knm.T @ Knm + 0.2 * Kmm, Knm.T @ Y)
    est = LandmarkRidge(kernel, 0.2, landmarks=L, source=source, rtol=1e-12, chunk_size=17).fit(X, Y)
    torch.testing.assert_close(est.coef_, coef, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(est.predict(Xq), reference(kernel, Xq, L) @ coef, rtol=1e-8, atol=1e-9)
    if source != "direct":  # the factored m x m normal matrix preconditions CG: one or two iterations
        assert est.info_.converged and est.info_.iterations <= 3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-7), (torch.float32, 3e-3)])
def test_landmark_on_a_row_sample_stops_on_the_preconditioned_residual(monkeypatch, dtype, tol):
    """Where the preconditioner's sample is smaller than n (here s = m of 157 rows), CG takes more iterations
    and stops on the preconditioned residual; the answer is the closed form's."""
    import solvers.ridge

    monkeypatch.setattr(solvers.ridge, "SAMPLE_SCALE", 0)
    X, Y, Xq = _regression(n=157)
    L = X[5:45]
    Knm, Kmm = reference(RBF(0.5), X, L), reference(RBF(0.5), L, L)
    coef = torch.linalg.solve(Knm.T @ Knm + 2.0 * Kmm, Knm.T @ Y)
    est = LandmarkRidge(RBF(0.5), 2.0, landmarks=L.to(dtype), source="streamed",
                        rtol=1e-12 if dtype == torch.float64 else None).fit(X.to(dtype), Y.to(dtype))
    assert est.info_.converged and est.info_.iterations > 3 and est.info_.norm == "preconditioned"
    assert est.info_.pairs_per_second > 0 and est.info_.product_seconds > 0
    prediction = reference(RBF(0.5), Xq, L) @ coef
    assert float((est.predict(Xq.to(dtype)).double() - prediction).norm() / prediction.norm()) < tol


def test_streamed_ridge_iterates_in_single_precision_and_converges_in_double(monkeypatch):
    """Float64 data: CG's products are passes all in float32 (tiles and sums), each restart's residual float64's;
    the coefficients still meet a target far below float32's precision."""
    from solvers import sources

    sums, real = [], sources.StreamedKernel._sum
    monkeypatch.setattr(sources.StreamedKernel, "_sum",
                        lambda self, terms, dim: sums.append((self.tile_dtype, self.sum_dtype)) or real(self, terms, dim))
    X, Y, _ = _regression(n=300)
    est = KernelRidge(RBF(0.4), 0.3, source="streamed", rtol=1e-11).fit(X, Y)
    direct = KernelRidge(RBF(0.4), 0.3, source="direct").fit(X, Y)
    assert (torch.float32, torch.float32) in sums and (torch.float64, torch.float64) in sums and est.info_.converged
    assert float((est.dual_coef_ - direct.dual_coef_).norm() / direct.dual_coef_.norm()) < 1e-9
    sums.clear()  # a given tile_dtype keeps its float64 sums
    KernelRidge(RBF(0.4), 0.3, source="streamed", tile_dtype=torch.float32).fit(X, Y)
    assert (torch.float32, torch.float32) not in sums and (torch.float32, torch.float64) in sums


def test_landmark_solves_float32_data_in_float64(monkeypatch):
    """Float32 sums of the normal equations (K_nm's conditioning squared) stall above tight targets; the
    iterative fit sums in float64 and returns float32 coefficients and gradients at float32 data's accuracy."""
    import solvers.ridge

    monkeypatch.setattr(solvers.ridge, "SAMPLE_SCALE", 0)
    X, Y, Xq = _regression(n=157)
    L = X[5:45]
    Knm, Kmm = reference(RBF(0.5), X, L), reference(RBF(0.5), L, L)
    prediction = reference(RBF(0.5), Xq, L) @ torch.linalg.solve(Knm.T @ Knm + 2.0 * Kmm, Knm.T @ Y)
    grads = {}
    for dtype in (torch.float64, torch.float32):  # gradients too: the adjoint solve runs in float64 as well
        x = X.to(dtype).detach().clone().requires_grad_()
        est = LandmarkRidge(RBF(0.5), 2.0, landmarks=L.to(dtype), source="streamed", rtol=1e-10).fit(x, Y.to(dtype))
        assert est.info_.converged and est.coef_.dtype == dtype
        out = est.predict(Xq.to(dtype))
        assert float((out.double() - prediction).norm() / prediction.norm()) < 1e-5
        out.sum().backward()
        grads[dtype] = x.grad.double()
    assert grads[torch.float32].dtype == torch.float64 and x.grad.dtype == torch.float32
    assert float((grads[torch.float32] - grads[torch.float64]).norm() / grads[torch.float64].norm()) < 1e-4


def test_landmark_draws_reproducible_training_points():
    X, Y, _ = _regression()
    a = LandmarkRidge(RBF(0.5), 0.1, n_landmarks=20, source="streamed", random_state=4).fit(X, Y)
    b = LandmarkRidge(RBF(0.5), 0.1, n_landmarks=20, source="stored", random_state=4).fit(X, Y)
    assert torch.equal(a.landmarks_, b.landmarks_) and a.landmarks_.shape == (20, 3)
    assert all(any(torch.equal(row, x) for x in X) for row in a.landmarks_[:3])
    with pytest.raises(ValueError, match="n_landmarks"):
        LandmarkRidge(RBF(0.5), n_landmarks=151).fit(X, Y)
    with pytest.raises(ValueError, match="not both"):
        LandmarkRidge(RBF(0.5), n_landmarks=3, landmarks=X[:3]).fit(X, Y)


@pytest.mark.parametrize("source", ALL)
def test_pca_matches_dense_centred_eigh_and_scikit_learn(source):
    from sklearn.decomposition import KernelPCA as SkPCA

    X, _, Xq = _regression(n=120)
    n = X.shape[0]
    K = reference(RBF(0.3), X, X)
    H = torch.eye(n, dtype=torch.float64) - 1.0 / n
    vals, vecs = torch.linalg.eigh(H @ K @ H)
    est = KernelPCA(RBF(0.3), 3, source=source, search_width=5, rtol=1e-11).fit(X)
    torch.testing.assert_close(est.eigenvalues_, vals.flip(0)[:3], rtol=1e-9, atol=1e-10)
    assert torch.linalg.svdvals(est.eigenvectors_.T @ vecs.flip(1)[:, :3]).min() > 1 - 1e-9
    sk = SkPCA(3, kernel="rbf", gamma=0.3, eigen_solver="dense").fit(X.numpy())
    sk_new = torch.from_numpy(sk.transform(Xq.numpy()))
    ours = est.transform(Xq)
    signs = torch.sign((ours * sk_new).sum(0))
    torch.testing.assert_close(ours * signs, sk_new, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(est.fit_transform(X).abs(), torch.from_numpy(sk.transform(X.numpy())).abs(),
                               rtol=1e-6, atol=1e-7)


def _lda_data(n=160, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    X = torch.randn(n, 2, generator=g, dtype=torch.float64) + 2.5 * torch.randn(classes, 2, generator=g,
                                                                               dtype=torch.float64)[labels]
    return X, labels


@pytest.mark.parametrize("source", ALL)
def test_lda_matches_scipy_generalized_eigh(source):
    import scipy.linalg

    X, y = _lda_data()
    kernel, reg, n = RBF(0.5), 0.05, X.shape[0]
    K = reference(kernel, X, X)
    onehot = torch.nn.functional.one_hot(y).double()
    counts = onehot.sum(0)
    means = K @ (onehot / counts)
    diff = means - K.mean(1, keepdim=True)
    M = (diff * counts) @ diff.T
    N = sum(K[:, y == c] @ (torch.eye(int(counts[c]), dtype=torch.float64) - 1 / counts[c]) @ K[:, y == c].T
            for c in range(3))
    vals, vecs = scipy.linalg.eigh(M.numpy(), (N + reg * torch.eye(n, dtype=torch.float64)).numpy())
    ref_vals, ref_vecs = torch.from_numpy(vals[::-1][:2].copy()), torch.from_numpy(vecs[:, ::-1][:, :2].copy())
    est = KernelLDA(kernel, 2, regularization=reg, source=source, rank=60, rtol=1e-12).fit(X, y)
    torch.testing.assert_close(est.eigenvalues_, ref_vals, rtol=1e-7, atol=1e-9)
    signs = torch.sign((est.eigenvectors_ * ref_vecs).sum(0))
    torch.testing.assert_close(est.eigenvectors_ * signs, ref_vecs, rtol=1e-5, atol=1e-6 * ref_vecs.abs().max())
    assert (est.predict(X) == y).float().mean() > 0.8
    assert est.transform(X[:5]).shape == (5, 2)


@pytest.mark.parametrize("source", ALL)
def test_svd_matches_svdvals(source):
    g = torch.Generator().manual_seed(5)
    X, Y = torch.randn(90, 3, generator=g, dtype=torch.float64), torch.randn(40, 3, generator=g, dtype=torch.float64)
    est = KernelSVD(RBF(0.2), 3, source=source, search_width=4, rtol=1e-11).fit(X, Y)
    K = reference(RBF(0.2), X, Y)
    torch.testing.assert_close(est.singular_values_, torch.linalg.svdvals(K)[:3], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(K @ est.right_vectors_, est.left_vectors_ * est.singular_values_, atol=1e-8, rtol=0)


def test_auto_source_is_direct_then_stored_then_streamed(monkeypatch):
    """source="auto" factors small problems, keeps the matrix while it takes at most AUTO_STORED_MAX_BYTES and
    streams above; every route gives the direct answer (thresholds lowered here to keep the problems small)."""
    import solvers.base

    X, Y, Xq = _regression(n=60)
    Z = torch.randn(25, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fits = {  # estimator, fit, its answer, its kernel's entries
        "ridge": (KernelRidge, lambda e: e.fit(X, Y).predict(Xq), 60 * 60, dict(alpha=0.3)),
        "landmark": (LandmarkRidge, lambda e: e.fit(X, Y).predict(Xq), 60 * 20, dict(alpha=0.3, n_landmarks=20)),
        "pca": (KernelPCA, lambda e: e.fit(X).eigenvalues_, 60 * 60, dict(n_components=2)),
        "svd": (KernelSVD, lambda e: e.fit(X, Z).singular_values_, 60 * 25, dict(n_components=2)),
    }
    for cls, answer, entries, params in fits.values():
        assert cls._auto_direct_max_n >= 256  # a few hundred points are factored directly
        expected = answer(cls(RBF(0.4), source="direct", **params))
        monkeypatch.setattr(cls, "_auto_direct_max_n", 59)
        for budget in (60 * 60 * 8, 60 * 60 * 8 - 1, 60 * 20 * 8 - 1):
            monkeypatch.setattr(solvers.base, "AUTO_STORED_MAX_BYTES", budget)
            est = cls(RBF(0.4), rtol=1e-11, **params)
            torch.testing.assert_close(answer(est), expected, rtol=1e-8, atol=1e-9)
            assert est.source_ == ("stored" if entries * 8 <= budget else "streamed")
        monkeypatch.setattr(cls, "_auto_direct_max_n", 60)
        est = cls(RBF(0.4), **params)
        answer(est)
        assert est.source_ == "direct"


def test_params_follow_scikit_learn_conventions():
    est = KernelRidge(RBF(1.0), 0.5, rtol=1e-5)
    params = est.get_params()
    assert params["alpha"] == 0.5 and params["rtol"] == 1e-5 and "source" in params
    assert est.set_params(alpha=2.0) is est and est.alpha == 2.0
    with pytest.raises(ValueError, match="(?i)invalid parameter"):
        est.set_params(bogus=1)
    for cls in (KernelPCA, KernelSVD, KernelLDA, LandmarkRidge):
        assert "random_state" in cls(RBF(1.0)).get_params()
    X, Y, _ = _regression(n=20)
    assert KernelRidge(RBF(1.0), source="auto").fit(X, Y).source_ == "direct"


def _dense_lda(K, y, reg, k):
    import scipy.linalg

    onehot = torch.nn.functional.one_hot(torch.as_tensor(y)).double()
    counts = onehot.sum(0)
    diff = K @ (onehot / counts) - K.mean(1, keepdim=True)
    M = (diff * counts) @ diff.T
    N = K @ (K - onehot @ ((onehot.T @ K) / counts[:, None]))
    vals, vecs = scipy.linalg.eigh(M.numpy(), (N + reg * torch.eye(K.shape[0], dtype=torch.float64)).numpy())
    return torch.from_numpy(vals[::-1][:k].copy()), torch.from_numpy(vecs[:, ::-1][:, :k].copy())


@pytest.mark.parametrize("source", ALL)
def test_every_estimator_takes_a_user_formula(source):
    """KernelRidge(lambda x, y: (1 + x.sqdist(y)).rsqrt(), alpha=0.1) and its siblings equal dense references."""
    kernel = lambda x, y: (1 + x.sqdist(y)).rsqrt()  # noqa: E731 - the inverse multiquadric, no class for it
    X, Y, Xq = _regression(n=80)
    K, Kq = (1 + torch.cdist(X, X) ** 2).rsqrt(), (1 + torch.cdist(Xq, X) ** 2).rsqrt()
    eye = torch.eye(80, dtype=torch.float64)
    common = dict(source=source, rtol=1e-12)
    ridge = KernelRidge(kernel, alpha=0.1, **common).fit(X, Y)
    torch.testing.assert_close(ridge.predict(Xq), Kq @ torch.linalg.solve(K + 0.1 * eye, Y), rtol=1e-8, atol=1e-9)
    L = X[:20]
    coef = torch.linalg.solve(K[:, :20].T @ K[:, :20] + 0.1 * K[:20, :20], K[:, :20].T @ Y)
    landmark = LandmarkRidge(kernel, alpha=0.1, landmarks=L, **common).fit(X, Y)
    torch.testing.assert_close(landmark.predict(Xq), Kq[:, :20] @ coef, rtol=1e-7, atol=1e-8)
    H = eye - 1 / 80
    pca = KernelPCA(kernel, 2, search_width=6, **common).fit(X)
    torch.testing.assert_close(pca.eigenvalues_, torch.linalg.eigvalsh(H @ K @ H).flip(0)[:2], rtol=1e-9, atol=1e-10)
    labels = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
    lda = KernelLDA(kernel, regularization=0.05, **common).fit(X, labels)
    vals, _ = _dense_lda(K, labels, 0.05, 2)
    torch.testing.assert_close(lda.eigenvalues_, vals, rtol=1e-7, atol=1e-9)
    svd = KernelSVD(kernel, 2, **common).fit(X, Xq)
    torch.testing.assert_close(svd.singular_values_, torch.linalg.svdvals(Kq.T)[:2], rtol=1e-9, atol=1e-10)


def test_far_from_origin_float32_fit_matches_float64():
    g = torch.Generator().manual_seed(0)
    X = 1000 + torch.randn(300, 4, generator=g, dtype=torch.float64)
    Y, Xq = torch.sin(X[:, :2] - 1000), 1000 + torch.randn(20, 4, generator=g, dtype=torch.float64)
    exact = KernelRidge(RBF(0.3), 0.5, source="direct").fit(X, Y).predict(Xq)
    for source in ITERATIVE:
        single = KernelRidge(RBF(0.3), 0.5, source=source, rtol=1e-6).fit(X.float(), Y.float()).predict(Xq.float())
        assert (single.double() - exact).abs().max() < 1e-4 * exact.abs().max()


def test_numpy_in_numpy_out_and_types_cast():
    X, Y, Xq = _regression(n=60)
    est = KernelRidge(RBF(0.5), 0.3, source="streamed", rtol=1e-10).fit(X.numpy(), Y[:, 0].numpy())
    assert isinstance(est.dual_coef_, np.ndarray) and est.dual_coef_.shape == (60,) and est.n_features_in_ == 3
    pred = est.predict(Xq.numpy())
    assert isinstance(pred, np.ndarray) and pred.shape == (23,)
    torch.testing.assert_close(torch.from_numpy(pred), est.predict(Xq))  # torch in, torch out
    assert isinstance(est.predict(Xq), torch.Tensor) and est.predict(Xq.tolist()).shape == (23,)
    assert 0 < est.score(X.numpy(), Y[:, 0].numpy()) <= 1
    mixed = KernelRidge(RBF(0.5), 0.3).fit(X.float(), Y.double())  # y cast to X's dtype
    assert mixed.dual_coef_.dtype == torch.float32 and mixed.predict(Xq).dtype == torch.float32
    half = KernelRidge(RBF(0.5), 0.3).fit(X.half(), Y.half())  # float16 computes in float32
    assert half.dual_coef_.dtype == torch.float32
    ints = KernelRidge(RBF(0.5), 0.3).fit((X * 3).round().long(), Y)
    assert ints.dual_coef_.dtype == torch.float64
    lda = KernelLDA(RBF(0.5)).fit(X.numpy(), np.where(X[:, 0].numpy() > 0, "right", "left"))
    assert list(lda.classes_) == ["left", "right"] and set(lda.predict(Xq.numpy())) <= {"left", "right"}


def test_scikit_learn_model_selection():
    from sklearn.base import clone
    from sklearn.model_selection import GridSearchCV, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    X, Y, _ = _regression(n=90)
    X, y = X.numpy(), Y[:, 0].numpy()
    est = KernelRidge(RBF(0.5), 0.3, source="streamed")
    assert clone(est).get_params()["alpha"] == 0.3
    search = GridSearchCV(est, {"alpha": [0.01, 0.1, 1.0], "kernel": [RBF(0.2), Laplacian(0.5)]}, cv=3).fit(X, y)
    assert search.best_params_["alpha"] in (0.01, 0.1, 1.0) and search.best_score_ > 0.5
    scores = cross_val_score(make_pipeline(StandardScaler(), KernelRidge(RBF(0.3), 0.1)), X, y, cv=3)
    assert scores.shape == (3,) and (scores > 0.5).all()
    labels = (X[:, 0] > 0).astype(int)
    assert cross_val_score(KernelLDA(RBF(0.5)), X, labels, cv=3).mean() > 0.8
    pca = make_pipeline(StandardScaler(), KernelPCA(RBF(0.3), 2)).fit(X)
    assert pca.transform(X).shape == (90, 2) and list(pca.get_feature_names_out()) == ["kernelpca0", "kernelpca1"]
    frame = KernelLDA(RBF(0.5)).set_output(transform="pandas").fit(X, labels).transform(X[:3])
    assert list(frame.columns) == ["kernellda0"]


def test_kernel_parameters_tune_and_scores_take_sample_weight():
    from sklearn.base import clone
    from sklearn.metrics import accuracy_score, r2_score
    from sklearn.model_selection import GridSearchCV

    X, Y, _ = _regression(n=90)
    X, Y = X.numpy(), Y.numpy()
    est = KernelRidge(RBF(0.5), 0.1)
    assert est.get_params()["kernel__gamma"] == 0.5 and clone(Matern(2.5, 0.3)).get_params() == {"nu": 2.5, "gamma": 0.3}
    assert est.set_params(kernel__gamma=2.0).kernel.gamma == 2.0
    with pytest.raises(ValueError, match="gamma must be finite and positive"):
        RBF().set_params(gamma=-1.0)
    with pytest.raises(ValueError, match="invalid parameter 'gama'"):
        RBF().set_params(gama=1.0)
    search = GridSearchCV(KernelRidge(RBF(0.5), 0.1), {"kernel__gamma": [0.01, 0.3, 30.0]}, cv=3).fit(X, Y)
    assert search.best_params_ == {"kernel__gamma": 0.3}
    w = np.random.default_rng(0).uniform(size=90)
    fitted = KernelRidge(RBF(0.5), 0.1).fit(X, Y)
    assert fitted.score(X, Y, sample_weight=w) == pytest.approx(r2_score(Y, fitted.predict(X), sample_weight=w), rel=1e-12)
    assert fitted.score(X, Y, sample_weight=w) != pytest.approx(fitted.score(X, Y), rel=1e-6)
    labels = (X[:, 0] + X[:, 1] > 0).astype(int)
    lda = KernelLDA(RBF(2.0)).fit(X[:45], labels[:45])
    expected = accuracy_score(labels[45:], lda.predict(X[45:]), sample_weight=w[45:])
    assert lda.score(X[45:], labels[45:], sample_weight=w[45:]) == pytest.approx(expected, rel=1e-12)
    for bad in (-w, w[:10], np.zeros(90)):
        with pytest.raises(ValueError, match="sample_weight"):
            fitted.score(X, Y, sample_weight=bad)


def test_bad_input_is_named():
    X, Y, Xq = _regression(n=30)
    with pytest.raises(ValueError, match="X contains NaN"):
        KernelRidge(RBF(1.0)).fit(X.clone().index_fill_(0, torch.tensor([3]), float("nan")), Y)
    with pytest.raises(ValueError, match="y must have shape"):
        KernelRidge(RBF(1.0)).fit(X, Y[:-1])
    for estimator in (KernelRidge(RBF(1.0)), KernelRidge(RBF(1.0), source="streamed"), LandmarkRidge(RBF(1.0))):
        with pytest.raises(ValueError, match=r"y with 0 target\(s\)"):  # was an IndexError / torch's min()
            estimator.fit(X, Y[:, :0])
    with pytest.raises(TypeError, match="sparse"):
        import scipy.sparse

        KernelRidge(RBF(1.0)).fit(scipy.sparse.csr_matrix(X.numpy()), Y)
    with pytest.raises(ValueError, match="alpha"):
        KernelRidge(RBF(1.0), alpha=0.0).fit(X, Y)
    with pytest.raises(TypeError, match="alpha must be a positive number or one value per target, got str"):
        KernelRidge(RBF(1.0), alpha="a").fit(X, Y)
    with pytest.raises(ValueError, match=r"alpha must be .* one value per target \(2\)"):
        KernelRidge(RBF(1.0), alpha=torch.tensor([0.1, 0.2, 0.3])).fit(X, Y)
    with pytest.raises(ValueError, match="source"):
        KernelRidge(RBF(1.0), source="gpu").fit(X, Y)
    with pytest.raises(NotFittedError):
        KernelRidge(RBF(1.0)).predict(Xq)
    with pytest.raises(ValueError, match="X has 2 features, but KernelRidge is expecting 3"):
        KernelRidge(RBF(1.0)).fit(X, Y).predict(Xq[:, :2])
    g32 = torch.tensor([0.5], dtype=torch.float32)
    with pytest.raises(TypeError, match="kernel .*float32 tensor"):
        KernelRidge(lambda x, y: (-lt.Pm(g32) * x.sqdist(y)).exp(), source="streamed").fit(X, Y)
    with pytest.raises(ValueError, match="n_components"):
        KernelPCA(RBF(1.0), 31).fit(X)
    with pytest.raises(ValueError, match="n_components"):
        KernelSVD(RBF(1.0), 11).fit(X, Xq[:10])
    for estimator in (KernelPCA(RBF(1.0), None), KernelSVD(RBF(1.0), None)):  # scikit-learn's "all of them"
        with pytest.raises(ValueError, match="n_components .*not None: .*n x n"):
            estimator.fit(X, *(() if isinstance(estimator, KernelPCA) else (Xq,)))
    with pytest.raises(ValueError, match="two classes"):
        KernelLDA(RBF(1.0)).fit(X, torch.zeros(30, dtype=torch.long))
    with pytest.raises(ValueError, match="n_components"):
        KernelLDA(RBF(1.0), 2).fit(X, torch.arange(30) % 2)
    with pytest.raises(ValueError, match="y must be"):
        KernelLDA(RBF(1.0)).fit(X, torch.arange(29) % 2)
    with pytest.raises(ValueError, match="Unknown label type"):
        KernelLDA(RBF(1.0)).fit(X, torch.randn(30))


def test_nonconvergence_is_reported_and_warned():
    X, Y, _ = _regression(n=200)
    with pytest.warns(ConvergenceWarning, match="did not converge"):
        est = KernelRidge(RBF(0.5), 1e-6, source="streamed", preconditioner=None, rtol=1e-14, maxiter=2).fit(X, Y)
    assert not est.info_.converged and est.info_.reason == "maxiter"
    with pytest.warns(ConvergenceWarning):
        pca = KernelPCA(RBF(0.5), 5, source="streamed", search_width=0, rtol=1e-15, maxiter=1).fit(X)
    assert not pca.info_.converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KernelRidge(RBF(0.5), 1.0, source="streamed").fit(X, Y)


def test_errors_and_warnings_are_scikit_learn_s():
    import sklearn.exceptions

    assert issubclass(NotFittedError, sklearn.exceptions.NotFittedError)
    assert issubclass(ConvergenceWarning, sklearn.exceptions.ConvergenceWarning)


def test_a_callers_autocast_does_not_change_a_fit():
    """Inside a training step's bfloat16 autocast, fits and predictions keep their data's precision (their CG
    ran in bfloat16 and stalled at a 4e-3 error before)."""
    gen = torch.Generator().manual_seed(0)
    X, Q = torch.randn(50, 3, generator=gen), torch.randn(20, 3, generator=gen)
    Y = torch.sin(X)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            ridge = KernelRidge(RBF(0.5), alpha=0.1, source="streamed").fit(X, Y)
            pca = KernelPCA(RBF(0.5), 2, source="streamed").fit(X)
            results.append((ridge.predict(Q), pca.transform(Q), ridge.score(X, Y)))
    for plain, autocast in zip(*results):
        torch.testing.assert_close(autocast, plain)
