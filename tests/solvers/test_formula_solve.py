"""``LazyTensor.solve``'s route (solvers.formula_solve): direct while K's float64 matrix fits the budget, stored
when asked or below a lowered direct limit, streamed preconditioned CG above; every route's values and gradients
against a dense solve, in float64 and float32 (budgets lowered here to reach each route on small problems)."""
import pytest
import torch

import lazytensor as lt
import solvers.formula_solve as fs

N = 60
BYTES = N * N * 8  # the system's float64 matrix


def system(dtype, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.rand(n, 2, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    g = torch.tensor([8.0], dtype=dtype, requires_grad=True)
    alpha = torch.tensor(0.05, dtype=dtype, requires_grad=True)
    return x, b, g, alpha


def dense_solution(x, b, g, alpha):
    """The float64 dense solve of the same (float32 or float64) inputs, differentiable."""
    x, b, g, alpha = (t.double() for t in (x, b, g, alpha))
    A = torch.exp(-g * ((x[:, None] - x[None]) ** 2).sum(-1)) + alpha * torch.eye(x.shape[0], dtype=torch.float64)
    return torch.linalg.solve(A, b)


@pytest.fixture
def budget(monkeypatch):
    def set_to(max_bytes, direct_max_n=None):
        monkeypatch.setattr(fs, "SOLVE_MAX_BYTES", max_bytes)
        monkeypatch.setattr(fs, "SOLVE_DIRECT_MAX_N", direct_max_n)
    return set_to


def test_the_route_follows_the_size_and_the_budget(budget):
    assert fs.choose_route(5000)[0] == "direct"  # KeOps's KernelSolve tutorial: its 191 MiB matrix is factored
    assert fs.choose_route(8192)[0] == "direct" and fs.choose_route(8193)[0] == "streamed"  # 512 MiB
    assert fs.choose_route(10, ranges=object())[0] == "streamed"  # block sparsity streams
    with pytest.raises(ValueError, match="ranges"):
        fs.choose_route(10, "direct", ranges=object())
    x, b, g, _ = system(torch.float64)
    K = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp()
    for max_bytes, direct_max_n, route in ((BYTES, None, "direct"), (BYTES - 1, None, "streamed"),
                                           (BYTES, N - 1, "stored"), (BYTES - 1, N - 1, "streamed")):
        budget(max_bytes, direct_max_n)
        K.solve(b, alpha=0.05)
        assert fs.last_solve.route == route and fs.last_solve.n == N
        assert (fs.last_solve.rank > 0) == (route != "direct")
        assert fs.last_solve.info.converged
        assert fs.last_solve.info.reason == ("cholesky" if route == "direct" else "converged")
    K.solve(b, alpha=0.05, source="direct")  # asked for: whatever the budget
    assert fs.last_solve.route == "direct" and fs.last_solve.why == "asked"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("route", ["direct", "stored", "streamed"])
def test_every_route_matches_the_dense_solve_with_gradients(budget, dtype, route):
    budget(*{"direct": (BYTES, None), "stored": (BYTES, N - 1), "streamed": (BYTES - 1, None)}[route])
    x, b, g, alpha = system(dtype)
    K = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp()
    c = K.solve(b, alpha=alpha)
    assert fs.last_solve.route == route and c.dtype == dtype
    ref = dense_solution(x, b, g, alpha)
    # float64: every route to 1e-8; float32: the direct and stored routes solve in float64 and the streamed one
    # refines against float64 passes, so the solution is float64's rounded to float32 (the rtol 1e-6 stop);
    # gradients take one more float32 pass (K's backward).
    value_tol, grad_tol = (1e-8, 1e-8) if dtype == torch.float64 else (2e-6, 2e-4)
    torch.testing.assert_close(c.double(), ref.detach(), rtol=value_tol, atol=value_tol * float(ref.detach().abs().max()))
    e = torch.randn(c.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = torch.autograd.grad((c.double() * e).sum(), (x, b, g, alpha))
    theirs = torch.autograd.grad((ref * e).sum(), (x, b, g, alpha))
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got.double(), want.double(), rtol=grad_tol, atol=grad_tol * float(want.abs().max()))


def test_the_streamed_route_forms_no_matrix(budget, monkeypatch):
    def refuse(self):
        raise AssertionError("an n x n matrix was formed above the budget")

    monkeypatch.setattr(fs.FormulaMatrix, "dense", refuse)
    budget(BYTES - 1)
    x, b, g, alpha = system(torch.float64)
    c = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp().solve(b, alpha=alpha)
    assert fs.last_solve.route == "streamed"
    (grad,) = torch.autograd.grad(c.sum(), x)  # the adjoint solve streams too
    torch.testing.assert_close(grad, torch.autograd.grad(dense_solution(x, b, g, alpha).sum(), x)[0])


def test_an_indefinite_shifted_matrix_is_solved_by_lu_as_torch_does():
    x, b, g, _ = system(torch.float64)
    K = -(-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp()  # -K_gauss + 3 I: indefinite (K_gauss's top eigenvalue > 3)
    c = K.solve(b, alpha=3.0)
    assert fs.last_solve.route == "direct" and fs.last_solve.info.reason == "lu"
    A = -torch.exp(-g * torch.cdist(x, x) ** 2) + 3 * torch.eye(N, dtype=torch.float64)
    ref = torch.linalg.solve(A, b)
    torch.testing.assert_close(c, ref)
    torch.testing.assert_close(torch.autograd.grad(c.sum(), (x, b)), torch.autograd.grad(ref.sum(), (x, b)))


@pytest.mark.parametrize("source", ["auto", "streamed"])
def test_float32_meets_keops_test_invkernel_on_every_seed(source):
    """KeOps's test_invkernel case (10 points in 3-D, a Gaussian with 1/sigma^2 = 0.4, alpha 0.1, 3 right-hand
    sides, float32): solution and x-gradient within 1e-4 of float32 torch.linalg.solve. The old relative 1e-4
    CG stop missed it by up to 2.5e-4."""
    for seed in range(10):
        gen = torch.Generator().manual_seed(seed)
        x = torch.rand(10, 3, generator=gen).requires_grad_()
        a, e = torch.rand(10, 3, generator=gen), torch.rand(10, 3, generator=gen)
        c = (-lt.Pm(torch.tensor([0.4])) * lt.Vi(x).sqdist(lt.Vj(x))).exp().solve(a, alpha=0.1, source=source)
        ref = torch.linalg.solve(0.1 * torch.eye(10) + torch.exp(-0.4 * ((x[:, None] - x[None]) ** 2).sum(-1)), a)
        torch.testing.assert_close(c, ref, rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.autograd.grad(c, x, e)[0], torch.autograd.grad(ref, x, e)[0], rtol=0, atol=1e-4)
