"""Formulas that sympy once rewrote wrongly or that could not be lowered, each against dense torch.

Found by a random-formula differential fuzzer: conditions taken from one feature, conditions built
from other conditions, comparisons of feature sums, ``atan2`` under ``sin``/``cos``, and the
gradients of selections over zero rows.
"""
import pytest
import torch

import lazytensor as lt

F64 = torch.float64


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=gen, dtype=F64) for n, d in ((5, 3), (6, 3), (6, 1), (5, 1))]


def pairs(x, y):
    return x[:, None, :], y[None, :, :]


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_a_condition_on_one_feature_applies_to_every_feature(backend):
    """where((y > 0)[0], x, 0) kept the index out of the condition: each feature of x was tested against its own
    feature of y (sympy folded the indicator out of the feature index)."""
    x, y, _, _ = data()
    X, Y = lt.Vi(x.requires_grad_()), lt.Vj(y)
    xi, yj = pairs(x, y)
    chosen = torch.where(yj[..., :1] > 0, xi, torch.zeros((), dtype=F64))
    formulas = {"comparison": lt.where((Y > 0)[0], X, 0.0), "step": lt.where(Y.step()[0], X, 0.0),
                "ifelse": ((Y >= 0)[0] - 0.5).ifelse(X, 0.0)}
    for name, F in formulas.items():
        lazy = F.sum(1, backend=backend)
        torch.testing.assert_close(lazy, chosen.sum(1), msg=name)
        expected = torch.autograd.grad(chosen.sum(), x, retain_graph=True)[0]
        torch.testing.assert_close(torch.autograd.grad(lazy.sum(), x)[0], expected, msg=name)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_conditions_made_of_conditions_and_selections(backend):
    """A where inside a comparison or a condition became sympy's ITE, which nothing could lower."""
    x, y, y1, x1 = data(1)
    X, Y, Y1, X1 = lt.Vi(x), lt.Vj(y), lt.Vj(y1), lt.Vi(x1)
    xi, yj = pairs(x, y)
    _, y1j = pairs(x, y1)
    x1i, _ = pairs(x1, y)
    zero = torch.zeros((), dtype=F64)
    cases = {
        "where < exp": ((lt.where(X < Y, X, Y) < Y.exp()) * 1.0, (torch.where(xi < yj, xi, yj) < yj.exp()).double()),
        "where of where": (lt.where(lt.where(X > Y, X, Y), Y1, X1),
                           torch.where(torch.where(xi > yj, xi, yj) != 0, y1j, x1i)),
        "step of one feature < x": ((Y.step()[0] < X) * 1.0, (torch.where(yj[..., :1] >= 0, 1.0, zero) < xi).double()),
        "indexed comparison squared": (((Y < X1)[2] < X).square(), ((yj[..., 2:] < x1i).double() < xi).double()),
    }
    for name, (F, dense) in cases.items():
        torch.testing.assert_close(F.sum(1, backend=backend), dense.sum(1), msg=name)


def test_feature_sums_and_indices_compare_and_take_abs():
    """sympy did not know that feature sums and indices are real: comparing them raised 'Invalid comparison of
    non-real', and abs(exp(y[0])) could not be lowered (re(...))."""
    x, y, _, _ = data(2)
    X, Y = lt.Vi(x[:, :2]), lt.Vj(y[:, :1])
    xi, yj = pairs(x[:, :2], y[:, :1])
    joined = torch.cat([xi.expand(-1, 6, -1), yj.expand(5, -1, -1)], -1)
    cases = {
        "concat sum < 0.2": ((X.concat(Y).sum(-1) < 0.2) * 1.0, (joined.sum(-1, keepdim=True) < 0.2).double()),
        "ratio < 0.3": (((X[1] - Y) / (X.abs() + 0.5) < 0.3) * 1.0, ((xi[..., 1:] - yj) / (xi.abs() + 0.5) < 0.3).double()),
        "abs exp index": (lt.Vj(y)[0].exp().abs() * lt.Vi(x[:, :1]), yj.exp().abs() * xi[..., :1]),
    }
    for name, (F, dense) in cases.items():
        torch.testing.assert_close(F.sum(1), dense.sum(1), msg=name)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_sin_and_cos_of_atan2_at_the_origin(backend):
    """sympy rewrote sin(atan2(y, x)) as y / sqrt(x^2 + y^2): NaN at (0, 0), where torch gives sin(0) = 0."""
    x = torch.tensor([[0.0], [1.0], [-2.0]], dtype=F64, requires_grad=True)
    y = torch.tensor([[0.0], [2.0], [0.5]], dtype=F64)
    angle = torch.atan2(y.T, x)
    for fn in ("sin", "cos"):
        lazy = getattr(lt.Vj(y).atan2(lt.Vi(x)), fn)().sum(1, backend=backend)
        dense = getattr(torch, fn)(angle).sum(1, keepdim=True)
        torch.testing.assert_close(lazy, dense, msg=fn)
        rows = slice(1, None)  # the derivative at (0, 0) is 0 / 0 on both sides
        torch.testing.assert_close(torch.autograd.grad(lazy[rows].sum(), x)[0][rows],
                                   torch.autograd.grad(dense[rows].sum(), x, retain_graph=True)[0][rows], msg=fn)


@pytest.mark.parametrize("reduction", ["min", "kmin", "quantile"])
def test_selection_gradients_over_zero_rows(reduction):
    """N = 0: the selection's backward reshaped 0 elements with an inferred dimension and raised."""
    x = torch.randn(0, 2, dtype=F64, requires_grad=True)
    y = torch.randn(7, 2, dtype=F64, requires_grad=True)
    D = lt.Vi(x).sqdist(lt.Vj(y))
    out = {"min": lambda: D.min(1), "kmin": lambda: D.kmin(3, 1), "quantile": lambda: D.quantile(0.5, 1)}[reduction]()
    gx, gy = torch.autograd.grad(out.sum(), (x, y), allow_unused=True)
    assert gx.shape == (0, 2) and (gy is None or (gy.shape == (7, 2) and not gy.any()))


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_a_constant_feature_vector_keeps_its_features(backend):
    """concat of numbers is a constant vector; as a where branch or condition, a clamp bound or an atan2 argument
    its width was not counted, and every feature got one value."""
    x = torch.tensor([[1.0], [2.0]], dtype=F64)
    y = torch.tensor([[1.0], [-1.0], [3.0]], dtype=F64)
    c, dense_c = lt.LazyTensor(1.0).concat(lt.LazyTensor(0.0)), torch.tensor([1.0, 0.0], dtype=F64)
    X, Y = lt.Vi(x), lt.Vj(y)
    xi, yj = pairs(x, y)
    cases = {"branch": (lt.where(X < Y, X, c), torch.where(xi < yj, xi, dense_c)),
             "condition": (lt.where(c, X, Y), torch.where(dense_c != 0, xi, yj)),
             "clamp bound": ((X * Y).clamp(-9.0, c), torch.clamp(xi * yj, torch.tensor(-9.0, dtype=F64), dense_c)),
             "atan2": ((X * Y).atan2(c), torch.atan2(xi * yj, dense_c))}
    for name, (F, dense) in cases.items():
        torch.testing.assert_close(F.sum(1, backend=backend), dense.expand(2, 3, 2).sum(1), msg=name)


def test_indexing_a_where_that_folded_to_its_narrow_branch():
    """A where whose condition folds picks a size-1 branch that broadcasts; indexing feature 1 or 2 of it raised."""
    x, y, _, _ = data(3)
    X, Y = lt.Vi(x), lt.Vj(y[:, :2])
    torch.testing.assert_close((lt.LazyTensor(0.0).ifelse(X[2], X)[1] + Y[0]).sum(1), 6 * x[:, 2:] + y[:, 0].sum())
    torch.testing.assert_close((lt.where(Y[0] < Y[0], X, X[0])[2] + Y[0]).sum(1), 6 * x[:, :1] + y[:, 0].sum())
