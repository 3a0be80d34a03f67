"""String formulas: every operation of the language, KeOps's operation names, and errors that say where."""
import pytest
import torch

import lazytensor as lt


@pytest.fixture
def variables():
    torch.manual_seed(0)
    x, y = torch.rand(5, 3, dtype=torch.float64), torch.rand(6, 3, dtype=torch.float64)
    a, m = torch.rand(5, 6, dtype=torch.float64), torch.rand(6, 9, dtype=torch.float64)
    return dict(x=lt.Vi(x), y=lt.Vj(y), a=lt.Vi(a), m=lt.Vj(m), p=lt.Pm(torch.tensor([0.5, 2.0], dtype=torch.float64)))


# text -> the same formula from methods
CASES = {
    "asin(x - y) + acos(y - x) + atan(x) + atan2(x, y)":
        lambda x, y, **_: (x - y).asin() + (y - x).acos() + x.atan() + x.atan2(y),
    "mod(5 * x, 0.3, 0.1) + round(10 * y, 1) + floor(4 * x)": lambda x, y, **_: (5 * x).mod(0.3, 0.1) + (10 * y).round(1)
    + (4 * x).floor(),
    "xlogx(x) * sinxdivx(x - y) + sinc(y) + power(x, y) + step(x - y) + sign(x - y)":
        lambda x, y, **_: x.xlogx() * (x - y).sinxdivx() + y.sinc() + x.power(y) + (x - y).step() + (x - y).sign(),
    "clamp(x, y - 0.1, y + 0.1) + ifelse(x - y, x, y) + where(x > y, 1.0, -1.0)":
        lambda x, y, **_: x.clamp(y - 0.1, y + 0.1) + (x - y).ifelse(x, y) + lt.where(x > y, 1.0, -1.0),
    "normalize(x - y) * norm2(x) + weightedsqnorm(x, p[1]) + weightedsqdist(x, y, y)":
        lambda x, y, p, **_: (x - y).normalize() * x.norm2() + x.weightedsqnorm(p[1]) + x.weightedsqdist(y, y),
    "x[0] * y[1:3] + elem(x, 2) + extract(y, 0, 2) + sum(x) + min(y) + max(x - y) + argmin(y) + argmax(x)":
        lambda x, y, **_: x[0] * y[1:3] + x.elem(2) + y.extract(0, 2) + x.sum(-1) + y.min(-1) + (x - y).max(-1)
        + y.argmin(-1) + x.argmax(-1),
    "x[..., 1] * y[..., 0:2] | y[..., 1:3]": lambda x, y, **_: x[..., 1] * y[..., 0:2] | y[..., 1:3],
    "concat(x, y, x * y) + one_hot(round(3 * elem(y, 0)), 9)":
        lambda x, y, **_: lt.LazyTensor.cat((x, y, x * y)) + (3 * y.elem(0)).round().one_hot(9),
    "matvecmult(a, elem(y, 0) * p) + vecmatmult(x, m)[0:3] + tensorprod(x, elem(y, 1))":
        lambda x, y, a, m, p, **_: a.matvecmult(y.elem(0) * p) + x.vecmatmult(m)[0:3] + x.tensorprod(y.elem(1)),
    "keops_tensordot(x, y, (3,), (3,), (0,), (0,)) + sum(keops_kron(x, y, (3,), (3,))) + sum(difference_matrix(x, y))":
        lambda x, y, **_: x.keops_tensordot(y, (3,), (3,), (0,), (0,)) + x.keops_kron(y, (3,), (3,)).sum(-1)
        + x.difference_matrix(y).sum(-1),
    "sqdist(x, y) + dot(x, y) + (x | y) + sqnorm2(x) + rsqrt(y) * sqrt(x) - log(x) ** 2 / exp(-y) + x ** -1.5":
        lambda x, y, **_: x.sqdist(y) + x.dot(y) + (x | y) + x.sqnorm2() + y.rsqrt() * x.sqrt() - x.log() ** 2 / (-y).exp()
        + x ** -1.5,
    "Exp(-SqDist(x, y)) * Elem(p, 0) + IfElse(x - y, Sum(x), Norm2(y)) + Concat(x, y)[4] + OneHot(Step(x[0]), 2)[1]":
        lambda x, y, p, **_: (-x.sqdist(y)).exp() * p.elem(0) + (x - y).ifelse(x.sum(-1), y.norm2()) + x.concat(y)[4]
        + x[0].step().one_hot(2)[1],
}


@pytest.mark.parametrize("text", sorted(CASES))
def test_every_operation_parses_as_the_method(text, variables):
    parsed = lt.formula(text, **variables)
    built = CASES[text](**variables)
    assert parsed.ndim == built.ndim
    torch.testing.assert_close(parsed.sum(1), built.sum(1))
    torch.testing.assert_close(parsed.sum(0), built.sum(0))


@pytest.mark.parametrize(
    "text, match",
    [
        ("exp(x", "position 3: syntax error"),  # not a raw TokenError
        ("x + * 2", "position 4: syntax error"),
        ("x; 1", "position 1: syntax error"),
        ("x if y else y", "IfExp is not part of the formula language"),
        ("x and y", "BoolOp"),
        ("x ^ 2", "use \\*\\* for powers"),
        ("x + zz", "position 4: unknown variable 'zz'"),
        ("sqdist(x, q)", "position 10: unknown variable 'q'"),
        ("foo(x)", "unknown function 'foo'"),
        ("x.exp()", "only named functions"),
        ("exp(x=y)", "positional arguments only"),
        ("x + 'a'", "only numbers"),
        ("exp", "'exp' is a function"),
        ("lambda: x", "Lambda"),
        ("elem(x, 7)", "elem: index must be an int in \\[0, 3\\)"),
        ("x + a", "feature sizes"),
        ("0 < x < 1", "chained comparisons"),
        ("[x for x in y]", "ListComp"),
        ("x * IntInv(0)", "position 4: division by zero"),
        ("exp(x, y)", "position 0: exp\\(\\) takes 1 positional argument but 2 were given"),  # not a closure's name
    ],
)
def test_errors_say_what_and_where(text, match, variables):
    with pytest.raises(ValueError, match=match):
        lt.formula(text, **variables)


def test_formula_arguments_are_checked(variables):
    with pytest.raises(ValueError, match="non-empty"):
        lt.formula("  ")
    with pytest.raises(ValueError, match="shadows"):
        lt.formula("exp(x)", exp=variables["x"])
    with pytest.raises(TypeError, match="formula variable 'x'"):
        lt.formula("x", x="text")
    torch.testing.assert_close(lt.formula("pi * x", x=variables["x"]).sum(0), (3.141592653589793 * variables["x"]).sum(0))
