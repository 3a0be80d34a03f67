"""Block CG, block Lanczos and block Golub-Kahan against dense factorizations; failure reporting."""
import numpy as np
import pytest
import torch

from solvers import (
    RBF,
    FunctionOperator,
    Jacobi,
    StoredKernel,
    StreamedKernel,
    cg,
    golub_kahan_svds,
    lanczos_eigsh,
    nystrom,
    pivoted_cholesky,
)

from .test_kernels import reference


def _spd(n, dtype=torch.float64, seed=0, alpha=0.5):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 4, generator=g, dtype=dtype)
    K = reference(RBF(0.25), X, X).to(dtype)
    return X, K, K + alpha * torch.eye(n, dtype=dtype)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_cg_meets_true_residual_per_column(dtype, rtol):
    _, _, A = _spd(97, dtype)
    B = torch.randn(97, 3, dtype=dtype) * torch.tensor([1.0, 1e-3, 1e3], dtype=dtype)
    x, info = cg(A, B, rtol=rtol)
    true = (B - A @ x).norm(dim=0)
    assert info.converged and info.reason == "converged"
    assert (true <= rtol * B.norm(dim=0) * 1.0001).all()
    torch.testing.assert_close(info.residuals, true, rtol=1e-3, atol=1e-30)
    ref = torch.linalg.solve(A.double(), B.double())
    assert ((x.double() - ref).norm(dim=0) / ref.norm(dim=0)).max() < 1e3 * rtol


def test_cg_refines_a_cheap_operator_against_the_exact_one():
    _, _, A = _spd(120, alpha=0.1)
    B = torch.randn(120, 2, dtype=torch.float64)
    cheap = A.float().double()  # float32 entries: CG alone stalls near 1e-7
    _, alone = cg(cheap, B, rtol=1e-12)
    x, refined = cg(cheap, B, rtol=1e-12, exact=A)
    assert refined.converged and ((B - A @ x).norm(dim=0) <= 1e-12 * B.norm(dim=0) * 1.0001).all()
    assert ((B - A @ cg(cheap, B, rtol=1e-12)[0]).norm(dim=0) > 1e-10 * B.norm(dim=0)).all() and alone.converged
    wrong = A + 0.5 * torch.eye(120, dtype=torch.float64)  # too far off to refine: cg finishes on the exact operator
    x, info = cg(wrong, B, rtol=1e-10, exact=A)
    assert info.converged and ((B - A @ x).norm(dim=0) <= 1e-10 * B.norm(dim=0) * 1.0001).all()


def test_cg_leaves_a_cheap_operator_once_its_recurrence_drifts():
    """Ill-conditioned: float32 entries cannot reach the target, and a cheap cycle run to its recurrence target
    wastes iterations past that floor (2.5x the exact run's here); the drift check hands over to the exact one."""
    _, _, A = _spd(400, alpha=1e-4)
    B = torch.randn(400, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    _, exact = cg(A, B, rtol=1e-10, maxiter=20000)
    x, info = cg(A.float().double(), B, rtol=1e-10, exact=A, maxiter=20000)
    assert info.converged and ((B - A @ x).norm(dim=0) <= 1e-10 * B.norm(dim=0) * 1.01).all()  # |x| ~ 4000: roundoff
    assert exact.converged and info.iterations < 2 * exact.iterations


def test_cg_atol_and_vector_rhs():
    _, _, A = _spd(50)
    b = torch.randn(50, dtype=torch.float64)
    x, info = cg(A, b, rtol=0.0, atol=1e-6)
    assert x.shape == (50,) and info.converged and (b - A @ x).norm() <= 1e-6
    zero, info0 = cg(A, torch.zeros(50, dtype=torch.float64), rtol=1e-8)
    assert info0.converged and info0.matvecs == 0 and zero.abs().max() == 0


def test_nystrom_cuts_iterations_threefold():
    X, K, A = _spd(600)
    S = StreamedKernel(RBF(0.25), X)
    B = torch.randn(600, 2, dtype=torch.float64)
    plain_x, plain = cg(A, B, rtol=1e-8)
    pre_x, pre = cg(A, B, M=nystrom(S, 100, 0.5), rtol=1e-8)
    jac_x, jac = cg(A, B, M=Jacobi(S.diag(), 0.5), rtol=1e-8)
    assert plain.converged and pre.converged and jac.converged
    assert plain.iterations >= 3 * pre.iterations
    # every solution is within ||A^-1|| * rtol ||b|| <= rtol ||b|| / alpha of the exact one
    exact = torch.linalg.solve(A, B)
    for x in (plain_x, pre_x, jac_x):
        assert ((x - exact).norm(dim=0) <= 1e-8 * B.norm(dim=0) / 0.5).all()


def test_cholesky_preconditioner_factors_a_singular_matrix_and_leaves_it_alone():
    from solvers import Cholesky

    g = torch.Generator().manual_seed(0)
    F = torch.randn(6, 2, generator=g, dtype=torch.float64)
    A = F @ F.T  # rank 2: indefinite to roundoff, factors once the jitter has grown
    kept = A.clone()
    R = torch.randn(6, 3, generator=g, dtype=torch.float64)
    assert torch.isfinite(Cholesky(A)(R)).all() and torch.equal(A, kept)
    B = A + torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(Cholesky(B)(R), torch.linalg.solve(B, R), rtol=1e-12, atol=1e-12)
    assert Cholesky(B)(R.float()).dtype == torch.float32  # solved in float64, returned in R's dtype
    with pytest.raises(ValueError, match="not positive semi-definite"):
        Cholesky(-B)
    with pytest.raises(ValueError, match="not finite"):
        Cholesky(torch.full((3, 3), float("nan"), dtype=torch.float64))


def test_low_rank_preconditioner_applies_a_float32_factor_in_float64(monkeypatch):
    """Row blocks of F upcast in turn give the float64 Woodbury formula exactly, with nu above the float64 floor."""
    import solvers.preconditioners
    from solvers import LowRankPreconditioner

    g = torch.Generator().manual_seed(1)
    F = (torch.randn(37, 5, generator=g, dtype=torch.float64) * torch.tensor([10, 1, 0.1, 0.01, 0.001])).float()
    R = torch.randn(37, 2, generator=g, dtype=torch.float64)
    monkeypatch.setattr(solvers.preconditioners, "UPCAST_BYTES", 8 * 5 * 4)  # four rows a block: ten blocks
    M = LowRankPreconditioner(F, 1e-3)
    Fd = F.double()
    lam = torch.linalg.eigvalsh(Fd.T @ Fd)
    nu = 1e-3 + float(lam[0])
    assert M.nu == pytest.approx(nu, rel=1e-12) and M.nu > float(lam[-1]) * 1.5e-8  # float32's floor would be ~1.3
    want = (R - Fd @ torch.linalg.solve(nu * torch.eye(5, dtype=torch.float64) + Fd.T @ Fd, Fd.T @ R)) / nu
    torch.testing.assert_close(M(R), want, rtol=1e-9, atol=0)
    assert M(R.float()).dtype == torch.float32
    empty = LowRankPreconditioner(F[:0], 0.5)  # no rows: P = nu I
    assert empty(R[:0]).shape == (0, 2)


def test_pivoted_cholesky_factor_and_early_stop():
    X, K, _ = _spd(300)
    S = StreamedKernel(RBF(0.25), X)
    F = pivoted_cholesky(S, 120, random_state=3)
    assert F.shape == (300, 120)
    residual = K - F @ F.T
    assert torch.linalg.eigvalsh(residual).min() > -1e-10  # F F^T never exceeds K
    idx = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:120]  # uniformly random landmarks
    uniform = K - K[:, idx] @ torch.linalg.pinv(K[idx][:, idx]) @ K[idx]
    assert residual.diagonal().sum() < 0.5 * uniform.diagonal().sum()  # pivots go where the kernel has mass
    assert torch.equal(F, pivoted_cholesky(S, 120, random_state=3))  # reproducible
    small = pivoted_cholesky(S, 300, tolerance=1.0)  # stops once the missed trace is below the tolerance
    assert small.shape[1] < 300 and (K - small @ small.T).diagonal().sum() <= 1.0 + 1e-9


def test_nystrom_is_safe_in_float32_with_a_tiny_shift():
    # a well-conditioned kernel (gamma 0.5 in 8-D) with alpha = 1e-6: dividing the unresolved directions
    # by the shift (the Woodbury inverse) made CG break down; the Nystrom preconditioner must not hurt
    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 8, generator=g)
    S = StreamedKernel(RBF(0.5), X)
    A = FunctionOperator(S.shape, S.dtype, S.device, lambda V: S.matmul_nograd(V) + 1e-6 * V)
    B = torch.sin(X[:, :2])
    _, plain = cg(A, B, rtol=1e-4)
    x, pre = cg(A, B, M=nystrom(S, 100, 1e-6), rtol=1e-4)
    assert plain.converged and pre.converged and pre.iterations <= plain.iterations
    exact = torch.linalg.solve(reference(RBF(0.5), X, X) + 1e-6 * torch.eye(400, dtype=torch.float64), B.double())
    assert (x.double() - exact).norm() / exact.norm() < 1e-2

def test_cg_reports_maxiter_and_breakdown():
    _, _, A = _spd(80, alpha=1e-6)
    B = torch.randn(80, 2, dtype=torch.float64)
    _, info = cg(A, B, rtol=1e-12, maxiter=3)
    assert not info.converged and info.reason == "maxiter" and info.iterations == 3
    assert not info.column_converged.any()
    indefinite = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64))
    _, bad = cg(indefinite, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    assert not bad.converged and "positive definite" in bad.reason


def test_cg_argument_errors():
    _, _, A = _spd(10)
    with pytest.raises(ValueError, match="10 rows"):
        cg(A, torch.ones(9, dtype=torch.float64))
    with pytest.raises(ValueError, match="rtol"):
        cg(A, torch.ones(10, dtype=torch.float64), rtol=-1)
    with pytest.raises(TypeError, match="rtol must be a non-negative number, got str"):
        cg(A, torch.ones(10, dtype=torch.float64), rtol="a")
    with pytest.raises(ValueError, match=r"A must be a square operator, got shape \(10, 9\)"):
        cg(A[:, :9], torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN"):
        cg(A, torch.full((10,), float("nan"), dtype=torch.float64))
    with pytest.raises(TypeError, match="source"):
        cg([[1.0]], torch.ones(1))
    b = torch.ones(10, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="M must map"):
        cg(A, b, M=lambda R: R[:, :1])
    with pytest.raises(TypeError, match="M must be a callable"):
        cg(A, b, M=torch.eye(10))
    with pytest.raises(ValueError, match="x0"):
        cg(A, b, x0=torch.zeros(10, dtype=torch.float64))


@pytest.mark.parametrize("k,width", [(1, 0), (3, 4), (5, 10)])
def test_lanczos_matches_eigh(k, width):
    _, K, _ = _spd(150)
    vals, vecs, info = lanczos_eigsh(StoredKernel(K), k, search_width=width, rtol=1e-10, max_basis=4 * (k + width))
    ref_vals, ref_vecs = torch.linalg.eigh(K)
    torch.testing.assert_close(vals, ref_vals.flip(0)[:k], rtol=1e-9, atol=1e-10)
    assert info.converged
    overlap = torch.linalg.svdvals(vecs.T @ ref_vecs.flip(1)[:, :k])
    assert overlap.min() > 1 - 1e-8
    assert (vecs.gather(0, vecs.abs().argmax(0, keepdim=True)) > 0).all()


def test_lanczos_is_deterministic_and_handles_low_rank_and_magnitude():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(60, 3, generator=g, dtype=torch.float64)
    A = W @ W.T - 5 * torch.outer(W[:, 0], W[:, 0]) / W[:, 0].norm() ** 2  # rank 3, one negative eigenvalue
    a = lanczos_eigsh(A, 3, search_width=4, which="LM", random_state=7)
    b = lanczos_eigsh(A, 3, search_width=4, which="LM", random_state=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ref = torch.linalg.eigvalsh(A)
    expect = ref[ref.abs().argsort(descending=True)][:3]
    torch.testing.assert_close(a[0], expect, rtol=1e-8, atol=1e-9)


def test_lanczos_nonconvergence_and_bad_k():
    _, K, _ = _spd(200)
    _, _, info = lanczos_eigsh(K, 4, search_width=0, rtol=1e-14, maxiter=2)
    assert not info.converged and info.reason == "maxiter"
    with pytest.raises(ValueError, match="k must be"):
        lanczos_eigsh(K, 201)
    assert lanczos_eigsh(K, np.int64(2), maxiter=2)[0].shape == (2,)  # a NumPy integer is an int
    with pytest.raises(ValueError, match="NaN"):
        lanczos_eigsh(K.clone().fill_diagonal_(float("nan")), 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_unreachable_tolerance_keeps_the_best_ritz_pairs(dtype):
    """Hundreds of restarts near an invariant subspace: the basis stays orthonormal and the values right."""
    g = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))[0]
    A = Q @ torch.diag(torch.logspace(0, -3, 50, dtype=torch.float64)) @ Q.T
    A = ((A + A.T) / 2).to(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    vals, vecs, info = lanczos_eigsh(A, 3, rtol=0.0, maxiter=1000)
    assert not info.converged and info.iterations == 1000
    torch.testing.assert_close(vals, torch.linalg.eigvalsh(A).flip(0)[:3], rtol=tol, atol=tol)
    torch.testing.assert_close(vecs.T @ vecs, torch.eye(3, dtype=dtype), rtol=0, atol=tol)
    s, left, right, info = golub_kahan_svds(A[:, :40], 3, rtol=0.0, maxiter=1000)
    torch.testing.assert_close(s, torch.linalg.svdvals(A[:, :40])[:3], rtol=tol, atol=tol)
    for side in (left, right):
        torch.testing.assert_close(side.T @ side, torch.eye(3, dtype=dtype), rtol=0, atol=tol)


@pytest.mark.parametrize("shape", [(120, 45), (45, 120)])
def test_golub_kahan_matches_svd(shape):
    g = torch.Generator().manual_seed(2)
    X = torch.randn(shape[0], 3, generator=g, dtype=torch.float64)
    Y = torch.randn(shape[1], 3, generator=g, dtype=torch.float64)
    S = StreamedKernel(RBF(0.3), X, Y, chunk_size=16)
    s, left, right, info = golub_kahan_svds(S, 4, search_width=3, rtol=1e-10, max_basis=14)
    K = reference(RBF(0.3), X, Y)
    torch.testing.assert_close(s, torch.linalg.svdvals(K)[:4], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(K @ right, left * s, atol=1e-8, rtol=0)
    torch.testing.assert_close(K.T @ left, right * s, atol=1e-8, rtol=0)
    assert info.converged and info.matvecs == 2 * info.iterations


def test_operators_compose():
    _, K, _ = _spd(30)
    shifted = FunctionOperator(K.shape, K.dtype, K.device, lambda V: K @ V + 2.0 * V)
    vals, _, _ = lanczos_eigsh(shifted, 2, search_width=5)
    torch.testing.assert_close(vals, torch.linalg.eigvalsh(K).flip(0)[:2] + 2.0)


def test_cg_preconditioned_norm_bounds_the_energy_error():
    """norm="preconditioned" stops on sqrt(r^T M r) / sqrt(b^T M b): with M ~ A^-1 the relative A-norm error."""
    X, K, A = _spd(300, alpha=1e-3)
    M = nystrom(StreamedKernel(RBF(0.25), X), 60, 1e-3)
    B = torch.randn(300, 2, dtype=torch.float64)
    x, info = cg(A, B, M=M, rtol=1e-6, norm="preconditioned")
    assert info.converged and info.norm == "preconditioned"
    R = B - A @ x
    measured = (R * M(R)).sum(0).sqrt()
    torch.testing.assert_close(info.residuals, measured, rtol=1e-3, atol=1e-30)
    assert (measured <= 1e-6 * (B * M(B)).sum(0).sqrt() * 1.0001).all()
    exact = torch.linalg.solve(A, B)
    energy = lambda E: (E * (A @ E)).sum(0).sqrt()  # noqa: E731
    assert (energy(x - exact) / energy(exact)).max() < 1e-4
    _, euclidean = cg(A, B, M=M, rtol=1e-6)
    assert euclidean.norm == "euclidean"
    with pytest.raises(ValueError, match="needs M"):
        cg(A, B, norm="preconditioned")
    with pytest.raises(ValueError, match="norm"):
        cg(A, B, M=M, norm="energy")
