"""Sharded fits on two gloo processes equal the single-process fit on the concatenated data.

Each rank fits on its own rows (uneven, then one rank empty); every rank must
get the single-process coefficients, eigen- / singular vectors, predictions and
transforms (1e-8 relative, float64), identical Krylov diagnostics, and the same
error when one rank's input is bad.
"""
import os

import pytest
import torch

from solvers import RBF, KernelLDA, KernelPCA, KernelRidge, KernelSVD, LandmarkRidge
from tests.ranks import run_on_ranks


def data():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(300, 3, generator=gen, dtype=torch.float64)
    Y = torch.stack([torch.sin(X[:, 0]), torch.cos(X[:, 1])], 1) + 0.05 * torch.randn(300, 2, generator=gen,
                                                                                      dtype=torch.float64)
    return X, Y, torch.randn(40, 3, generator=gen, dtype=torch.float64)


def _close(a, b, what):
    err = float((a - b).norm() / b.norm())
    assert err < 1e-8, f"{what}: relative difference {err:.2e}"


def _same_on_ranks(payload, world_size, what):
    import torch.distributed as dist

    both = [torch.empty_like(payload) for _ in range(world_size)]
    dist.all_gather(both, payload)  # identical on every rank, bit for bit
    assert torch.equal(both[0], both[1]), f"{what}: ranks disagree"


def _eager_tiles():
    """Both sources on eager tiles in this rank: a kernel that the auto tier compiles while a fit runs lands after
    a load-dependent number of products and rounds differently, which moves the iteration count at rtol 1e-12."""
    os.environ["LAZYTENSOR_DISABLE_COMPILE"] = "1"


def _check(rank, world_size):
    _eager_tiles()
    X, Y, Xq = data()
    estimators = {
        "ridge": lambda source: KernelRidge(RBF(0.5), alpha=0.1, source=source, rtol=1e-12, chunk_size=64),
        "ridge-jacobi": lambda source: KernelRidge(RBF(0.5), alpha=0.1, source=source, rtol=1e-12, preconditioner="jacobi"),
        "landmark": lambda source: LandmarkRidge(RBF(0.5), alpha=0.1, n_landmarks=50, source=source, rtol=1e-12),
    }
    for name, make in estimators.items():
        ref = make("streamed").fit(X, Y)
        for split in (170, 300):  # uneven shards, then rank 1 empty
            rows = slice(0, split) if rank == 0 else slice(split, 300)
            model = make("sharded").fit(X[rows], Y[rows])
            label = f"{name} split {split}"
            coef = model.dual_coef_ if name.startswith("ridge") else model.coef_
            _close(coef, ref.dual_coef_ if name.startswith("ridge") else ref.coef_, label)
            _close(model.predict(Xq), ref.predict(Xq), label + " predict")
            assert model.info_.iterations == ref.info_.iterations, label  # the same preconditioner, split over ranks
            scalars = torch.tensor([model.info_.iterations, model.info_.matvecs], dtype=torch.float64)
            _same_on_ranks(torch.cat([scalars, coef.reshape(-1)]), world_size, label)
    # the preconditioner's sample smaller than n (s = m rows): each rank multiplies its own picks
    import solvers.ridge

    solvers.ridge.SAMPLE_SCALE, scale = 0, solvers.ridge.SAMPLE_SCALE
    try:
        ref = estimators["landmark"]("streamed").fit(X, Y)
        rows = slice(0, 170) if rank == 0 else slice(170, 300)
        model = estimators["landmark"]("sharded").fit(X[rows], Y[rows])
        assert ref.info_.norm == model.info_.norm == "preconditioned"
        _close(model.coef_, ref.coef_, "landmark on a sample")
    finally:
        solvers.ridge.SAMPLE_SCALE = scale
    # inside lazytensor's sharded() context (the group comes from it; the fit's own products stay local)
    import lazytensor as lt

    rows = slice(0, 170) if rank == 0 else slice(170, 300)
    expected = estimators["ridge"]("streamed").fit(X, Y).predict(Xq)
    with lt.distributed.sharded():
        model = estimators["ridge"]("sharded").fit(X[rows], Y[rows])
        _close(model.predict(Xq), expected, "ridge inside sharded()")
    # one rank's bad input raises on both ranks, no rank hangs
    bad = X[:150].clone()
    if rank == 1:
        bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN" if rank == 1 else "rank\\(s\\) \\[1\\]"):
        KernelRidge(RBF(0.5), source="sharded").fit(bad, Y[:150])
    with pytest.raises(ValueError, match="same number of features"):
        KernelRidge(RBF(0.5), source="sharded").fit(X[:10, : 2 + rank], Y[:10])
    with pytest.raises(ValueError, match="not differentiable"):
        KernelRidge(RBF(0.5), source="sharded").fit(X[:10].requires_grad_(), Y[:10])


def _check_spectral(rank, world_size):
    """KernelPCA, KernelLDA (string labels) and KernelSVD (square, and against a replicated second point set)."""
    _eager_tiles()
    X, Y, Xq = data()
    labels = ["abc"[int(v)] for v in (3 * torch.sigmoid(4 * X[:, 0])).floor().clamp(max=2)]
    Z = X[:70] + 0.5
    fits = {
        "pca": (lambda s: KernelPCA(RBF(0.5), n_components=3, source=s, rtol=1e-12), (), "eigenvectors_"),
        "pca-float32-tiles": (lambda s: KernelPCA(RBF(0.5), n_components=2, source=s, rtol=1e-6,
                                                  tile_dtype=torch.float32), (), "eigenvectors_"),
        "lda": (lambda s: KernelLDA(RBF(0.5), source=s, rtol=1e-12), (labels,), "eigenvectors_"),
        "svd": (lambda s: KernelSVD(RBF(0.5), n_components=3, source=s, rtol=1e-12), (), "left_vectors_"),
        "svd-rectangular": (lambda s: KernelSVD(RBF(0.5), n_components=3, source=s, rtol=1e-12), (Z,), "right_vectors_"),
    }
    for name, (make, extra, vectors) in fits.items():
        ref = make("streamed").fit(X, *extra)
        for split in (170, 300):  # uneven shards, then rank 1 empty
            rows = slice(0, split) if rank == 0 else slice(split, 300)
            mine = [e[rows] if name == "lda" else e for e in extra]
            model = make("sharded").fit(X[rows], *mine)
            label = f"{name} split {split}"
            _close(getattr(model, vectors), getattr(ref, vectors), label)
            if name.startswith("svd"):
                _close(model.singular_values_, ref.singular_values_, label + " values")
                _close(model.left_vectors_, ref.left_vectors_, label + " left")
            else:
                _close(model.eigenvalues_, ref.eigenvalues_, label + " values")
                _close(model.transform(Xq), ref.transform(Xq), label + " transform")
            if name == "lda":
                assert list(model.classes_) == list(ref.classes_) and list(model.predict(Xq)) == list(ref.predict(Xq))
            assert model.info_.iterations == ref.info_.iterations, label  # the same preconditioner, split over ranks
            scalars = torch.tensor([model.info_.iterations, model.info_.matvecs], dtype=torch.float64)
            _same_on_ranks(torch.cat([scalars, getattr(model, vectors).reshape(-1)]), world_size, label)
    with pytest.raises(ValueError, match="at least two classes"):  # counted over every rank's labels
        KernelLDA(RBF(0.5), source="sharded").fit(X[:10], ["a"] * 10)
    with pytest.raises(ValueError, match="n_components"):
        KernelPCA(RBF(0.5), n_components=25, source="sharded").fit(X[:10])  # 20 points over both ranks


def _check_size_gathers(rank, world_size):
    """Shard sizes are gathered once per sharded source (and once for the landmark draw), never per product:
    each gloo collective costs 1.6-4 ms here."""
    from lazytensor.distributed import Sharding

    X, Y, _ = data()
    rows = slice(0, 170) if rank == 0 else slice(170, 300)
    calls, sizes = [], Sharding.sizes

    def counted(self, *args):
        calls.append(1)
        return sizes(self, *args)

    Sharding.sizes = counted
    try:
        landmark = LandmarkRidge(RBF(0.5), alpha=0.1, n_landmarks=50, source="sharded").fit(X[rows], Y[rows])
        assert landmark.info_.matvecs >= 2 and len(calls) == 3, (landmark.info_.matvecs, len(calls))  # K_nm, K_mm, draw
        calls.clear()
        ridge = KernelRidge(RBF(0.5), alpha=0.1, source="sharded", rtol=1e-12).fit(X[rows], Y[rows])
        assert ridge.info_.matvecs > 5 and len(calls) <= 2, (ridge.info_.matvecs, len(calls))  # K, the preconditioner
    finally:
        Sharding.sizes = sizes


def test_sharded_fits_gather_shard_sizes_once_per_source():
    run_on_ranks(_check_size_gathers)


@pytest.mark.slow
def test_sharded_ridge_fits_equal_single_process():
    run_on_ranks(_check)


@pytest.mark.slow
def test_sharded_spectral_fits_equal_single_process():
    run_on_ranks(_check_spectral)


def test_sharded_fit_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        KernelRidge(RBF(0.5), source="sharded").fit(torch.randn(10, 2), torch.randn(10))
