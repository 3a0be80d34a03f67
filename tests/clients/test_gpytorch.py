"""GPyTorch's KeOps kernels run unchanged on lazytensor.keops, against GPyTorch's dense kernels.

As GPyTorch's own test/kernels/keops suite (forward with x1 == x2 and x1 != x2,
ARD, batched matmul, hyperparameter gradients), rewritten with KeOps forced
on at every size and the LazyTensor actually used (theirs patches it away);
plus an exact GP's marginal log-likelihood, its gradients and predictions.
Float64 to ~1e-9, float32 to its accumulation tolerance.
"""
import math
from unittest import mock

import pytest
import torch

import lazytensor.keops.torch as kt
from benchmarks.clients import exact_gp

KERNELS = ["rbf", "matern05", "matern15", "matern25", "periodic"]


def kernels(gpytorch, name: str, **kwargs):
    """(KeOps kernel, dense kernel) with equal hyperparameters."""
    keops, dense = gpytorch.kernels.keops, gpytorch.kernels
    if name.startswith("matern"):
        nu = {"05": 0.5, "15": 1.5, "25": 2.5}[name[-2:]]
        return keops.MaternKernel(nu=nu, **kwargs), dense.MaternKernel(nu=nu, **kwargs)
    cls = {"rbf": "RBFKernel", "periodic": "PeriodicKernel"}[name]
    return getattr(keops, cls)(**kwargs), getattr(dense, cls)(**kwargs)


def forced(gpytorch):
    """KeOps on from 2 points (GPyTorch uses it from max_cholesky_size on, as its own KeOps tests), with a spy on it."""
    spy = mock.patch("gpytorch.kernels.keops.keops_kernel.LazyTensor", wraps=kt.LazyTensor)
    return gpytorch.settings.max_cholesky_size(2), spy


def direct(name, kernel, x1, x2):
    """The kernel matrix from direct differences in float64 (GPyTorch's dense kernels expand |x|^2 - 2 x.y, which
    rounds zero distances to ~1e-8 under a square root even in float64)."""
    x1, x2 = x1.double(), x2.double()
    ls = kernel.lengthscale.double()
    if name == "periodic":
        p = kernel.period_length.double()
        diff = (x1[:, None] - x2[None]).abs() * math.pi / p
        return torch.exp((-2.0 * torch.sin(diff) ** 2 / ls).sum(-1))
    mean = x1.mean(0) if name.startswith("matern") else 0.0
    d2 = ((((x1 - mean) / ls)[:, None] - ((x2 - mean) / ls)[None]) ** 2).sum(-1)
    if name == "rbf":
        return torch.exp(-d2 / 2)
    d = (d2 + 1e-20).sqrt()
    poly = {"matern05": 1.0, "matern15": 1 + math.sqrt(3) * d, "matern25": 1 + math.sqrt(5) * d + 5.0 / 3.0 * d2}[name]
    return poly * torch.exp(-math.sqrt({"matern05": 1, "matern15": 3, "matern25": 5}[name]) * d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("same", [True, False], ids=["x1==x2", "x1!=x2"])
def test_kernel_products_and_gradients(gpytorch, name, dtype, same):
    """Values and hyperparameter gradients against direct float64 kernels; values against GPyTorch's dense kernels too."""
    x1 = torch.randn(57, 3).to(dtype)
    x2 = x1 if same else torch.randn(41, 3).to(dtype)
    rhs = torch.randn(x2.shape[0], 2).to(dtype)
    w = torch.randn(x1.shape[0], 2).to(dtype)
    k1, k2 = kernels(gpytorch, name, ard_num_dims=3)
    k1, k2 = k1.to(dtype), k2.to(torch.float64)
    with torch.no_grad():
        for k in (k1, k2):
            k.raw_lengthscale.copy_(torch.tensor([[0.3, -0.2, 0.5]]))
    settings, spy = forced(gpytorch)
    names = [n for n, _ in k1.named_parameters()]
    with settings, spy as lazy:
        out1 = k1(x1, x2) @ rhs
        assert lazy.called
        g1 = torch.autograd.grad((out1 * w).sum(), [dict(k1.named_parameters())[n] for n in names])
        diag1 = k1(x1, x1).diagonal(dim1=-1, dim2=-2)
    out2 = direct(name, k2, x1, x2) @ rhs.double()
    g2 = torch.autograd.grad((out2 * w.double()).sum(), [dict(k2.named_parameters())[n] for n in names])
    for a, b in zip((out1, *g1, diag1), (out2, *g2, direct(name, k2, x1, x1).diagonal())):
        scale = float(b.detach().abs().max())
        tol = dict(rtol=1e-10, atol=1e-10 * scale) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4 * scale)
        torch.testing.assert_close(a.double(), b.detach(), **tol)
    dense = k2(x1.double(), x2.double()).to_dense() @ rhs.double()
    torch.testing.assert_close(out1.double(), dense.detach(), rtol=1e-4, atol=1e-5 * float(dense.detach().abs().max()))


@pytest.mark.parametrize("name", ["rbf", "matern25"])
def test_batched_matmul(gpytorch, name):
    x = torch.randn(3, 2, 40, 3, dtype=torch.float64)
    rhs = torch.randn(3, 2, 40, 1, dtype=torch.float64)
    k1, k2 = (k.to(torch.float64) for k in kernels(gpytorch, name))
    settings, spy = forced(gpytorch)
    with settings, spy:
        torch.testing.assert_close(k1(x, x) @ rhs, k2(x, x).to_dense() @ rhs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["rbf", "matern25", "matern05"])
def test_exact_gp_likelihood_gradients_and_prediction(gpytorch, name, dtype):
    """K(X, X) with Matern: the gradient that once came back with a wrong sign (sqrt(d^2 + 1e-20))."""
    torch.manual_seed(0)
    x = torch.rand(80, 3, dtype=dtype)
    y = torch.sin(4 * x).sum(-1) + 0.05 * torch.randn(80, dtype=dtype)
    results = []
    for kernel in kernels(gpytorch, name, ard_num_dims=3):
        model = exact_gp(gpytorch, kernel, x, y).to(dtype)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        torch.manual_seed(1)  # the same probe vectors for both runs
        settings, _ = forced(gpytorch)
        with settings:  # GPyTorch's CG and Lanczos at their defaults: both runs take the same iterations
            model.train()
            loss = -mll(model(x), y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            model.eval()
            with torch.no_grad():
                pred = model.likelihood(model(x[:15] + 0.01))
        results.append((loss.detach(), grads, pred.mean, pred.variance))
    (l1, g1, m1, v1), (l2, g2, m2, v2) = results
    # Both runs stop GPyTorch's CG at its tolerance (which residual crosses it first depends on rounding), so they
    # agree to that tolerance, not to float precision: the arithmetic itself is checked to 1e-10 above.
    tol = dict(rtol=2e-3, atol=2e-4)
    for what, a, b in (("loss", l1, l2), *(("grad", a, b) for a, b in zip(g1, g2)), ("mean", m1, m2), ("variance", v1, v2)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, what=what: f"{what}: {m}")
