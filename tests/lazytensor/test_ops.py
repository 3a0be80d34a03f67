"""Every operator of the formula language, lowered and compared with dense torch."""
import pytest
import torch

import lazytensor as lt

from .dense import Pair, dense_reduce, pm, vi, vj

UNARY = ["exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "tanh", "sigmoid", "relu", "square"]


def dense_unary(name):
    return {"rsqrt": torch.rsqrt, "relu": torch.relu, "sigmoid": torch.sigmoid}.get(name, getattr(torch, name))


def check_sum(pair, inputs, dtype=torch.float64, axis="j", chunk=(3, 4), backend="eager"):
    out = pair.lazy.sum(axis, chunk_size=chunk, backend=backend)
    ref = dense_reduce(pair.dense(), "sum", axis, False)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn_like(ref)
    gl = torch.autograd.grad((out * w).sum(), inputs)
    gd = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(gl, gd):
        torch.testing.assert_close(a, b, **tol)


def positive_inputs(n=7, m=10, d=3, dtype=torch.float64):
    x = (torch.rand(n, d, dtype=dtype) + 0.5).requires_grad_()
    y = (torch.rand(m, d, dtype=dtype) + 0.5).requires_grad_()
    return x, y


@pytest.mark.parametrize("name", UNARY)
def test_unary(name):
    x, y = positive_inputs()
    inner = vi(x) * vj(y) - vj(y) * 0.3 if name not in ("log", "sqrt", "rsqrt") else vi(x) * vj(y)
    check_sum(inner.unary(name, dense_unary(name)), [x, y])


def test_arithmetic_and_powers():
    x, y = positive_inputs()
    p = torch.tensor([1.5, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    X, Y, P = vi(x), vj(y), pm(p)
    f = Pair(X.lazy ** 3 / Y.lazy - 2.0 * X.lazy ** 0.5 + (Y.lazy ** -1.5) * P.lazy + X.lazy ** Y.lazy,
             lambda: X.dense() ** 3 / Y.dense() - 2.0 * X.dense() ** 0.5 + Y.dense() ** -1.5 * P.dense() + X.dense() ** Y.dense())
    check_sum(f, [x, y, p])


def test_feature_contractions():
    x, y = positive_inputs(d=9)
    X, Y = vi(x), vj(y)
    f = Pair(X.lazy.sqnorm2() * Y.lazy.norm2() + X.lazy.sqdist(Y.lazy) + (X.lazy | Y.lazy) + (X.lazy * Y.lazy).sum(-1),
             lambda: (X.dense() ** 2).sum(-1, keepdim=True) * Y.dense().norm(dim=-1, keepdim=True)
             + ((X.dense() - Y.dense()) ** 2).sum(-1, keepdim=True) + 2 * (X.dense() * Y.dense()).sum(-1, keepdim=True))
    check_sum(f, [x, y])


def test_clamp_where_and_comparisons():
    x, y = torch.randn(8, 2, dtype=torch.float64, requires_grad=True), torch.randn(9, 2, dtype=torch.float64, requires_grad=True)
    X, Y = lt.Vi(x), lt.Vj(y)
    diff = X - Y
    f = lt.where(diff > 0, diff.clamp(-0.5, 0.8), diff * diff) + (X <= Y) * 1.0
    out = f.sum(1, chunk_size=3)
    d = x[:, None] - y[None]
    ref = (torch.where(d > 0, d.clamp(-0.5, 0.8), d * d) + (x[:, None] <= y[None]).double()).sum(1)
    torch.testing.assert_close(out, ref)
    gl = torch.autograd.grad(out.sum(), [x, y])
    gd = torch.autograd.grad(ref.sum(), [x, y])
    for a, b in zip(gl, gd):
        torch.testing.assert_close(a, b)


def test_formulas_sympy_folds_keep_their_feature_size():
    """x - x folds to 0 and sqdist(x, x) to 0 in sympy; the results keep D and the dtype."""
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    X, Y = lt.Vi(x), lt.Vj(y)
    folded = X - X + Y * 0.0
    assert folded.ndim == 3
    out = folded.sum(1, backend="eager")
    assert out.shape == (5, 3) and out.dtype == torch.float64 and out.abs().max() == 0
    ones = ((X - X + 1.0).sum(-1) + X.sqdist(X)) * Y
    torch.testing.assert_close(ones.sum(1, backend="eager"), 3 * y.sum(0).expand(5, 3))
    text = lt.formula("(sum(x - x + 1) + sqdist(x, x)) * y", x=X, y=Y)
    torch.testing.assert_close(text.sum(1, backend="eager"), 3 * y.sum(0).expand(5, 3))
    assert lt.formula("x - x", x=X).ndim == 3


def test_string_formula_matches_operators():
    x, y, b = torch.randn(6, 3), torch.randn(7, 3), torch.randn(7, 2)
    g = torch.tensor(0.3)
    a = lt.formula("exp(-g * sqdist(x, y)) * b + relu(dot(x, y))", x=lt.Vi(x), y=lt.Vj(y), b=lt.Vj(b), g=lt.Pm(g))
    c = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b) + (lt.Vi(x) | lt.Vj(y)).relu()
    torch.testing.assert_close(a.sum(1), c.sum(1))


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: lt.Vi(torch.randn(4, 3)) + lt.Vj(torch.randn(5, 2)), ValueError),
        (lambda: (lt.Vi(torch.randn(4, 3)) + lt.Vj(torch.randn(5, 3, dtype=torch.float64))).sum(1), TypeError),
        (lambda: (lt.Vi(torch.randn(2, 4, 3)) + lt.Vj(torch.randn(3, 5, 3))).sum(1), ValueError),
        (lambda: lt.Vi(torch.randn(4, 3)).exp().sum(1), ValueError),
        (lambda: lt.formula("foo(x)", x=lt.Vi(torch.randn(3, 1))), ValueError),
        (lambda: lt.formula("x + z", x=lt.Vi(torch.randn(3, 1))), ValueError),
        (lambda: (lt.Vi(torch.randn(4, 1)) - lt.Vj(torch.randn(3, 1))).kmin(4, 1), ValueError),
        (lambda: (lt.Vi(torch.randn(4, 1)) - lt.Vj(torch.randn(3, 1))).sum(5), ValueError),
        (lambda: (lt.Vi(torch.randn(4, 1)) - lt.Vj(torch.randn(3, 1))).sum(1, backend="gpu"), ValueError),
        (lambda: lt.Vi(torch.arange(4)), TypeError),
    ],
)
def test_bad_input_errors(make, error):
    with pytest.raises(error):
        make()
