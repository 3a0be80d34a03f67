"""Kernels against explicit formulas and scikit-learn; the fast in-place tiles against the differentiable ones."""
import math

import pytest
import torch

from solvers import RBF, CallableKernel, Laplacian, Matern, as_kernel


def _points(n, m, d, dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.randn(m, d, generator=g, dtype=dtype)


def _reference(kernel, x, y):
    r = torch.cdist(x.double(), y.double())
    g = float(kernel.gamma)
    if isinstance(kernel, RBF):
        return torch.exp(-g * r**2)
    if isinstance(kernel, Laplacian):
        return torch.exp(-g * r)
    s = r * g * math.sqrt(2 * kernel.nu)
    poly = {0.5: torch.ones_like(s), 1.5: 1 + s, 2.5: 1 + s + s**2 / 3}[kernel.nu]
    return poly * torch.exp(-s)


KERNELS = [RBF(0.3), Laplacian(0.7), Matern(0.5, 0.4), Matern(1.5, 0.9), Matern(2.5, 0.6)]


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_tiles_match_formula_and_in_place_path(kernel, dtype, tol):
    x, y = _points(13, 7, 5, dtype)
    ref = _reference(kernel, x, y)
    tile = kernel.tile(x, y)
    assert tile.dtype == dtype and tile.shape == (13, 7)
    assert torch.allclose(tile.double(), ref, atol=tol, rtol=0)
    buf = torch.empty(13, 7, dtype=dtype)
    fast = kernel.tile_into(x, y, buf, kernel.prepare(y))
    assert fast.data_ptr() == buf.data_ptr()
    assert torch.allclose(fast.double(), ref, atol=tol, rtol=0)
    assert torch.allclose(kernel.diag(x), torch.ones(13, dtype=dtype))


def test_matches_scikit_learn():
    from sklearn.gaussian_process.kernels import Matern as SkMatern
    from sklearn.metrics.pairwise import rbf_kernel

    x, y = _points(9, 11, 3, torch.float64)
    assert torch.allclose(RBF(0.2).tile(x, y), torch.from_numpy(rbf_kernel(x.numpy(), y.numpy(), gamma=0.2)))
    for nu in (0.5, 1.5, 2.5):
        sk = SkMatern(length_scale=1 / 0.8, nu=nu)(x.numpy(), y.numpy())
        assert torch.allclose(Matern(nu, 0.8).tile(x, y), torch.from_numpy(sk), atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
def test_gradients_finite_at_coincident_points(kernel):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    kernel.tile(x, x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gamma_gradient_matches_gradcheck():
    x, y = _points(5, 4, 2, torch.float64)
    for make in (RBF, Laplacian, lambda g: Matern(2.5, g)):
        torch.autograd.gradcheck(lambda g, make=make: make(g).tile(x, y),
                                 (torch.tensor(0.5, dtype=torch.float64, requires_grad=True),))


def test_callable_kernel_and_errors():
    x, y = _points(6, 5, 2, torch.float64)
    k = as_kernel(lambda a, b: a @ b.T)
    assert isinstance(k, CallableKernel)
    assert torch.allclose(k.tile(x, y), x @ y.T)
    assert torch.allclose(k.diag(x), (x * x).sum(1))
    with pytest.raises(ValueError, match=r"\(6, 5\)"):
        as_kernel(lambda a, b: a @ a.T).tile(x, y)
    with pytest.raises(TypeError, match="kernel"):
        as_kernel(3)
    with pytest.raises(ValueError, match="gamma"):
        RBF(-1.0)
    with pytest.raises(TypeError, match="gamma"):
        RBF("big")
    with pytest.raises(ValueError, match="nu"):
        Matern(3.5, 1.0)
