"""Estimators against scikit-learn, closed forms and dense decompositions; parameters and bad input."""
import warnings

import pytest
import torch

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
    Knm, Kmm = kernel.tile(X, L), kernel.tile(L, L)
    coef = torch.linalg.solve(Knm.T @ Knm + 0.2 * Kmm, Knm.T @ Y)
    est = LandmarkRidge(kernel, 0.2, landmarks=L, source=source, rtol=1e-12, chunk_size=17).fit(X, Y)
    torch.testing.assert_close(est.coef_, coef, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(est.predict(Xq), kernel.tile(Xq, L) @ coef, rtol=1e-8, atol=1e-9)
    if source != "direct":  # the factored m x m normal matrix preconditions CG: one or two iterations
        assert est.info_.converged and est.info_.iterations <= 3


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
    K = RBF(0.3).tile(X, X)
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
    K = kernel.tile(X, X)
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
    K = RBF(0.2).tile(X, Y)
    torch.testing.assert_close(est.singular_values_, torch.linalg.svdvals(K)[:3], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(K @ est.right_vectors_, est.left_vectors_ * est.singular_values_, atol=1e-8, rtol=0)


def test_params_follow_scikit_learn_conventions():
    est = KernelRidge(RBF(1.0), 0.5, rtol=1e-5)
    params = est.get_params()
    assert params["alpha"] == 0.5 and params["rtol"] == 1e-5 and "source" in params
    assert est.set_params(alpha=2.0) is est and est.alpha == 2.0
    with pytest.raises(ValueError, match="invalid parameter"):
        est.set_params(bogus=1)
    for cls in (KernelPCA, KernelSVD, KernelLDA, LandmarkRidge):
        assert "random_state" in cls(RBF(1.0)).get_params()
    X, Y, _ = _regression(n=20)
    assert KernelRidge(RBF(1.0), source="auto").fit(X, Y).source_ == "direct"


def test_bad_input_is_named():
    X, Y, Xq = _regression(n=30)
    with pytest.raises(ValueError, match="X contains NaN"):
        KernelRidge(RBF(1.0)).fit(X.clone().index_fill_(0, torch.tensor([3]), float("nan")), Y)
    with pytest.raises(ValueError, match="Y must have shape"):
        KernelRidge(RBF(1.0)).fit(X, Y[:-1])
    with pytest.raises(TypeError, match="X must be a torch.Tensor"):
        KernelRidge(RBF(1.0)).fit(X.numpy(), Y)
    with pytest.raises(ValueError, match="alpha"):
        KernelRidge(RBF(1.0), alpha=0.0).fit(X, Y)
    with pytest.raises(ValueError, match="source"):
        KernelRidge(RBF(1.0), source="gpu").fit(X, Y)
    with pytest.raises(NotFittedError):
        KernelRidge(RBF(1.0)).predict(Xq)
    with pytest.raises(ValueError, match="features"):
        KernelRidge(RBF(1.0)).fit(X, Y).predict(Xq[:, :2])
    with pytest.raises(ValueError, match="n_components"):
        KernelPCA(RBF(1.0), 31).fit(X)
    with pytest.raises(ValueError, match="n_components"):
        KernelSVD(RBF(1.0), 11).fit(X, Xq[:10])
    with pytest.raises(ValueError, match="two classes"):
        KernelLDA(RBF(1.0)).fit(X, torch.zeros(30, dtype=torch.long))
    with pytest.raises(ValueError, match="n_components"):
        KernelLDA(RBF(1.0), 2).fit(X, torch.arange(30) % 2)
    with pytest.raises(ValueError, match="y must be"):
        KernelLDA(RBF(1.0)).fit(X, torch.arange(29) % 2)


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
