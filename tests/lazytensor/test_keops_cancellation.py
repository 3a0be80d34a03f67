"""Gradients of kernels singular at zero distance, on K(X, X): no expansion may cancel there.

GPyTorch's KeOps Matern kernels compute d = sqrt(|x_i - x_j|^2 + 1e-20); the
gradient is c_ij (x_i - x_j) with c ~ 1e10 on the diagonal. Distributed into
x_i rowsum(c) - c @ x it cancelled catastrophically (a wrong sign in float32,
1e-5 relative in float64). Each case is checked at zero distances (x_i and
x_j the same points) and near-zero ones (a copy shifted by 1e-4) against
dense torch autograd in float64.
"""
import math

import pytest
import sympy
import torch

import lazytensor as lt
from lazytensor import ir

N = 60
S5 = math.sqrt(5.0)


def matern25(d, exp):
    return (1 + S5 * d + 5.0 / 3.0 * d * d) * exp(-S5 * d)


def matern15(d, exp):
    return (1 + math.sqrt(3.0) * d) * exp(-math.sqrt(3.0) * d)


def root(d, exp):
    return d


KERNELS = {"matern25": matern25, "matern15": matern15, "sqrt": root}


def lazy_distance(x, y):
    return (lt.Vi(x).sqdist(lt.Vj(y)) + 1e-20).sqrt()


def dense_distance(x, y):
    return (((x[:, None, :] - y[None, :, :]) ** 2).sum(-1) + 1e-20).sqrt()


def points(dtype, d, near):
    """Both sets rounded to ``dtype`` first, so the float64 reference sees the same points."""
    x = torch.randn(N, d, dtype=torch.float64)
    y = x + 1e-4 * torch.randn_like(x) if near else x.clone()
    return x.to(dtype).double(), y.to(dtype).double()


def check(kernel, dtype, d, near):
    x0, y0 = points(dtype, d, near)
    b = torch.randn(N, 2, dtype=torch.float64)
    w = torch.randn(N, 2, dtype=torch.float64)
    scale = torch.tensor([0.75, 1.25, 0.875] * (d // 3), dtype=torch.float64)  # exact in float32

    def run(lazy, cast):
        x, y, s = (t.to(cast).requires_grad_() for t in (x0, y0, scale))
        if lazy:
            out = KERNELS[kernel](lazy_distance(x / s, y / s), lambda t: t.exp()) @ b.to(cast)
        else:
            out = KERNELS[kernel](dense_distance(x / s, y / s), torch.exp) @ b.to(cast)
        return (out, *torch.autograd.grad((out * w.to(cast)).sum(), (x, y, s)))

    ref = run(False, torch.float64)
    got = run(True, dtype)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=0, atol=0)
    for name, a, r in zip(("value", "grad x", "grad y", "grad scale"), got, ref):
        if dtype == torch.float32:  # accumulation tolerance: relative to the largest entry
            tol["atol"] = 2e-4 * float(r.detach().abs().max()) if name != "value" else 1e-5 * float(r.detach().abs().max())
        torch.testing.assert_close(a.double(), r, **tol, msg=lambda m, name=name: f"{kernel} {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("near", [False, True], ids=["zero", "near-zero"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_singular_gradient_on_k_x_x(kernel, dtype, near):
    check(kernel, dtype, 3, near)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_singular_gradient_with_the_norm_expansion_width(dtype):
    """At D >= 8 the norm expansion is on; sqrt(d^2 + 1e-20) must still see the direct difference."""
    check("matern25", dtype, 9, near=False)
    x = torch.randn(5, 9, dtype=dtype)
    assert float(lazy_distance(x, x).min(1).max()) == pytest.approx(1e-10, rel=1e-3)


def test_differences_stay_direct_only_under_a_singular_factor():
    """The RBF gradient keeps its matrix-product form; a 1/d factor keeps x_i - y_j as one tile term."""
    x, y = ir.make_symbol("x"), ir.make_symbol("y")
    info = {x: ir.VarInfo("i", 3), y: ir.VarInfo("j", 3)}
    d2 = ir.feature_sum((x - y) ** 2, 3)
    bounded = sympy.exp(-d2) * (2 * x - 2 * y)
    terms = ir.sum_terms(bounded, info)
    assert len(terms) == 2 and all(ir.feature_dim(s, info) == 1 for _, s, _ in terms)  # x_i rowsum(c) - c @ y
    singular = sympy.exp(-d2) * ir.ZeroSafePow(d2, sympy.Rational(-1, 2)) * (2 * x - 2 * y)
    ((_, s, _),) = ir.sum_terms(singular, info)
    assert ir.feature_dim(s, info) == 3  # the difference is inside the mixed part: summed directly
    inverse = (1 + d2) ** -1 * (x - y)
    assert len(ir.sum_terms(inverse, info)) == 1
