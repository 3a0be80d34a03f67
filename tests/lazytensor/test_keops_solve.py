"""``LazyTensor.solve``: KeOps's KernelSolve, (K + alpha I) a = b by the project's conjugate gradient.

Ported from pykeops test_torch.test_invkernel (Gaussian kernel, alpha = 0.1, solution and its gradient
in x against torch.linalg.solve), plus gradients in b, alpha and a kernel parameter, NumPy, and the
package layering (lazytensor does not import solvers at import time).
"""
import ast
import pathlib

import numpy as np
import pytest
import torch

import lazytensor as lt


def gaussian_system(n=40, dtype=torch.float64, alpha=0.1):
    x = torch.rand(n, 3, dtype=dtype, requires_grad=True)
    a = torch.rand(n, 2, dtype=dtype, requires_grad=True)
    g = torch.tensor([2.5], dtype=dtype, requires_grad=True)
    K = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp()
    dense = torch.exp(-g * ((x[:, None] - x[None]) ** 2).sum(-1)) + alpha * torch.eye(n, dtype=dtype)
    return x, a, g, K, dense


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_solve_and_gradients_of_keops_test_invkernel(dtype):
    x, a, g, K, dense = gaussian_system(dtype=dtype)
    c = K.solve(a, alpha=0.1)
    c_ = torch.linalg.solve(dense, a)
    # float32: CG stops at a relative residual of 1e-4 (the default), gradients take a second solve
    tol = dict(rtol=1e-8, atol=1e-8) if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-3)
    grad_tol = tol if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(c, c_, **tol)
    e = torch.randn_like(c)
    for v in (x, a, g):
        torch.testing.assert_close(torch.autograd.grad(c, v, e, retain_graph=True)[0],
                                   torch.autograd.grad(c_, v, e, retain_graph=True)[0], **grad_tol)


def test_solve_gradient_in_alpha_and_vector_rhs():
    x, a, g, K, _ = gaussian_system()
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    b = a[:, 0]
    c = K.solve(b, alpha=alpha)
    assert c.shape == b.shape
    dense = torch.exp(-g * ((x[:, None] - x[None]) ** 2).sum(-1)) + alpha * torch.eye(40, dtype=torch.float64)
    c_ = torch.linalg.solve(dense, b)
    torch.testing.assert_close(c, c_)
    torch.testing.assert_close(torch.autograd.grad(c.sum(), alpha)[0], torch.autograd.grad(c_.sum(), alpha)[0])


def test_solve_with_numpy_and_residual():
    rng = np.random.default_rng(0)
    x, b = rng.random((80, 2)), rng.random((80, 1))
    K = (-lt.LazyTensor(x[:, None, :]).sqdist(lt.LazyTensor(x[None, :, :])) * 4.0).exp()
    a = K.solve(b, alpha=0.5)
    assert isinstance(a, np.ndarray)
    dense = np.exp(-4.0 * ((x[:, None] - x[None]) ** 2).sum(-1)) + 0.5 * np.eye(80)
    assert np.linalg.norm(dense @ a - b) <= 1e-9 * np.linalg.norm(b)


def test_solve_errors_and_convergence_warning():
    x = torch.rand(10, 2, dtype=torch.float64)
    K = (-lt.Vi(x).sqdist(lt.Vj(x))).exp()
    with pytest.raises(ValueError, match="square"):
        (-lt.Vi(x).sqdist(lt.Vj(x[:5]))).exp().solve(torch.rand(10, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="feature size 1"):
        (lt.Vi(x) - lt.Vj(x)).solve(torch.rand(10, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="b must be"):
        K.solve(torch.rand(9, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="alpha"):
        K.solve(torch.rand(10, 1, dtype=torch.float64), alpha=-1.0)
    with pytest.raises(TypeError, match="unexpected option"):
        K.solve(torch.rand(10, 1, dtype=torch.float64), eps=1e-6)
    from solvers import ConvergenceWarning

    with pytest.raises(ValueError, match="source"):
        K.solve(torch.rand(10, 1, dtype=torch.float64), source="dense")
    with pytest.warns(ConvergenceWarning, match="did not converge"):  # iterative routes only: direct ones do not iterate
        K.solve(torch.rand(10, 1, dtype=torch.float64), alpha=1e-10, maxiter=1, source="streamed")


def test_lazytensor_does_not_import_solvers_at_import_time():
    """No module of lazytensor imports solvers at module level (solve imports it inside the call)."""
    for path in pathlib.Path(lt.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "solvers" for n in names), f"{path.name} imports solvers at import time"
