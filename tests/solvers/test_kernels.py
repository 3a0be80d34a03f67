"""Kernels are lazytensor formula factories: values against explicit formulas and scikit-learn, K(x, x) == 1,
far-from-origin float32 accuracy, gradients, user formulas and errors."""
import math

import pytest
import torch

import lazytensor as lt
from solvers import RBF, FormulaKernel, Laplacian, Matern, StreamedKernel, as_kernel


def _points(n, m, d, dtype, shift=0.0):
    g = torch.Generator().manual_seed(1)
    return (shift + torch.randn(n, d, generator=g, dtype=torch.float64)).to(dtype), \
        (shift + torch.randn(m, d, generator=g, dtype=torch.float64)).to(dtype)


def reference(kernel, x, y):
    """The kernel matrix from torch.cdist in float64 (no lazytensor)."""
    r = torch.cdist(x.double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist")
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
@pytest.mark.parametrize("d", [3, 9])  # below and above lazytensor's norm-expansion threshold
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_matrix_matches_formula(kernel, d, dtype, tol):
    x, y = _points(13, 7, d, dtype)
    K = StreamedKernel(kernel, x, y).dense()
    assert K.dtype == dtype and K.shape == (13, 7)
    assert torch.allclose(K.double(), reference(kernel, x, y), atol=tol, rtol=0)


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_self_similarity_is_exactly_one(kernel, dtype):
    x, _ = _points(40, 1, 9, dtype, shift=100.0)
    S = StreamedKernel(kernel, x)
    assert torch.equal(S.diag(), torch.ones(40, dtype=dtype))
    if not isinstance(kernel, RBF):  # distances under a square root are exact differences
        assert torch.equal(S.dense().diagonal(), torch.ones(40, dtype=dtype))
    else:  # exp(-g d^2) with lazytensor's centred norm expansion (d >= 8): a few ulps of the points' spread
        assert (S.dense().diagonal() - 1).abs().max() <= 64 * torch.finfo(dtype).eps


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
def test_far_from_origin_float32_matches_float64(kernel):
    x, y = _points(50, 30, 8, torch.float64, shift=1000.0)
    v = torch.randn(30, 2, dtype=torch.float64)
    exact = StreamedKernel(kernel, x, y) @ v
    single = StreamedKernel(kernel, x.float(), y.float()) @ v.float()
    # the points themselves round at 1000 * 6e-8: the kernel is only that well defined in float32
    assert ((single.double() - exact).abs().max() / exact.abs().max()) < 1e-4


def test_matches_scikit_learn():
    from sklearn.gaussian_process.kernels import Matern as SkMatern
    from sklearn.metrics.pairwise import rbf_kernel

    x, y = _points(9, 11, 3, torch.float64)
    assert torch.allclose(StreamedKernel(RBF(0.2), x, y).dense(), torch.from_numpy(rbf_kernel(x.numpy(), y.numpy(), gamma=0.2)))
    for nu in (0.5, 1.5, 2.5):
        sk = SkMatern(length_scale=1 / 0.8, nu=nu)(x.numpy(), y.numpy())
        assert torch.allclose(StreamedKernel(Matern(nu, 0.8), x, y).dense(), torch.from_numpy(sk), atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
def test_gradients_finite_at_coincident_points(kernel):
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (StreamedKernel(kernel, x) @ torch.ones(4, 1, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gamma_gradient_matches_gradcheck():
    x, y = _points(5, 4, 2, torch.float64)
    v = torch.randn(4, 2, dtype=torch.float64)
    for make in (RBF, Laplacian, lambda g: Matern(2.5, g)):
        torch.autograd.gradcheck(lambda g, make=make: StreamedKernel(make(g), x, y) @ v,
                                 (torch.tensor(0.5, dtype=torch.float64, requires_grad=True),))


def test_user_formulas_are_kernels():
    x, y = _points(6, 5, 2, torch.float64)
    expected = (1 + torch.cdist(x, y) ** 2).rsqrt()
    for kernel in (lambda a, b: (1 + a.sqdist(b)).rsqrt(), "rsqrt(1 + sqdist(x, y))", FormulaKernel("(1 + sqdist(x, y))**-0.5")):
        assert torch.allclose(StreamedKernel(kernel, x, y).dense(), expected)
    g = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    closes_over = StreamedKernel(lambda a, b: (-lt.Pm(g) * a.sqdist(b)).exp(), x, y)
    closes_over.dense().sum().backward()
    assert torch.allclose(g.grad, -(torch.cdist(x, y) ** 2 * torch.exp(-0.3 * torch.cdist(x, y) ** 2)).sum())
    assert isinstance(as_kernel("exp(-sqdist(x, y))"), FormulaKernel) and as_kernel(KERNELS[0]) is KERNELS[0]


def test_kernel_errors_name_the_kernel():
    x, y = _points(6, 5, 2, torch.float64)
    with pytest.raises(TypeError, match="kernel .* LazyTensor"):
        StreamedKernel(lambda a, b: a @ b.T, x, y)  # a dense tile function is not a formula
    with pytest.raises(TypeError, match="must return a LazyTensor"):
        StreamedKernel(lambda a, b: 1.0, x, y)
    with pytest.raises(ValueError, match="scalar formula"):
        StreamedKernel(lambda a, b: a - b, x, y)
    g32 = torch.tensor([0.5], dtype=torch.float32)
    with pytest.raises(TypeError, match="float32 tensor but the kernel is evaluated in torch.float64"):
        StreamedKernel(lambda a, b: (-lt.Pm(g32) * a.sqdist(b)).exp(), x, y)
    with pytest.raises(TypeError, match="kernel must be"):
        as_kernel(3)
    with pytest.raises(ValueError, match="gamma"):
        RBF(-1.0)
    with pytest.raises(TypeError, match="gamma"):
        RBF("big")
    with pytest.raises(ValueError, match="gamma"):
        RBF(torch.ones(2))
    with pytest.raises(ValueError, match="nu"):
        Matern(3.5, 1.0)


# ------------------------------------------------------------ kernels called on plain tensors
def _sklearn_reference(kernel, x, y):
    """scikit-learn's pairwise kernels where they define ours (RBF, Matern); the Euclidean formula otherwise."""
    from sklearn.gaussian_process.kernels import Matern as SkMatern
    from sklearn.metrics.pairwise import rbf_kernel

    a, b = x.double().numpy(), y.double().numpy()
    if isinstance(kernel, RBF):
        return torch.from_numpy(rbf_kernel(a, b, gamma=float(kernel.gamma)))
    if isinstance(kernel, Matern):
        return torch.from_numpy(SkMatern(length_scale=1 / float(kernel.gamma), nu=kernel.nu)(a, b))
    return reference(kernel, x, y)  # Laplacian: scikit-learn's laplacian_kernel is L1, ours Euclidean


@pytest.mark.parametrize("kernel", KERNELS, ids=repr)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_tensor_call_is_the_dense_matrix(kernel, dtype, tol):
    x, y = _points(37, 45, 5, dtype)  # 45 columns: one full block of 32 and a ragged one
    K = kernel(x, y)
    assert isinstance(K, torch.Tensor) and K.dtype == dtype and K.shape == (37, 45)
    assert torch.allclose(K.double(), _sklearn_reference(kernel, x, y), atol=tol, rtol=0)
    square = kernel(x)  # Y defaults to X, as in scikit-learn's pairwise kernels
    assert square.shape == (37, 37) and torch.allclose(square.double(), _sklearn_reference(kernel, x, x), atol=tol, rtol=0)
    assert kernel(x[:0], y).shape == (0, 45) and kernel(x[:1], y[:1]).shape == (1, 1)


def test_tensor_call_on_formulas_and_gradients():
    x, y = _points(6, 5, 2, torch.float64)
    expected = (1 + torch.cdist(x, y) ** 2).rsqrt()
    assert torch.allclose(FormulaKernel("rsqrt(1 + sqdist(x, y))")(x, y), expected)
    assert torch.allclose(as_kernel(lambda a, b: (1 + a.sqdist(b)).rsqrt())(x, y), expected)
    g = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    xg = x.clone().requires_grad_()
    RBF(g)(xg, y).sum().backward()
    dense = torch.exp(-g * torch.cdist(xg, y) ** 2).sum()
    gx, gg = torch.autograd.grad(dense, (xg, g))
    assert torch.allclose(xg.grad, gx) and torch.allclose(g.grad, gg)
    lazy = RBF(0.3)(lt.Vi(x), lt.Vj(y))  # LazyTensors still give the formula
    assert isinstance(lazy, lt.LazyTensor)
    assert torch.allclose(lazy.sum(1).squeeze(1), torch.exp(-0.3 * torch.cdist(x, y) ** 2).sum(1))


def test_tensor_call_rejects_other_arguments():
    x, y = _points(6, 5, 2, torch.float64)
    for args in ((x.numpy(), y.numpy()), (x, lt.Vj(y)), (lt.Vi(x),), ([[1.0]], [[2.0]])):
        with pytest.raises(TypeError, match="takes two LazyTensors .* or torch tensors X"):
            RBF(0.5)(*args)
    with pytest.raises(ValueError, match="X must be a floating"):
        Matern(1.5)(x[0])
    with pytest.raises(ValueError, match=r"X must be a floating \(n, d\) tensor with d >= 1, got shape \(4, 0\)"):
        RBF()(torch.randn(4, 0))
    with pytest.raises(ValueError, match="Y must be a floating"):
        Laplacian()(x, torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="Y must match X"):
        RBF()(x, y.float())
