"""KeOps's elementwise math operations, each against a dense torch twin.

Cases follow pykeops's operation list (keopscore/formulas/maths) and its
tests (test_sinc, test_lazytensor_clamp, test_lazytensor_grad), rewritten:
every operation in float32 and float64, reduced over j and over i, values and
first derivatives; a representative subset also to second order. Where KeOps
defines a convention torch does not share, the test cites it.
"""
import math

import pytest
import torch

import lazytensor as lt

from .dense import assert_sums_like

N, M, D = 7, 9, 3


def data(dtype):
    x = torch.rand(N, D, dtype=dtype, requires_grad=True)
    y = torch.rand(M, D, dtype=dtype, requires_grad=True)
    return x, y


def floor_mod(x, n, d=0.0):
    return x - n * torch.floor((x - d) / n)


def round_away(v, decimals=0):
    """C's round (halves away from zero), what KeOps's Round compiles to."""
    s = 10.0**decimals
    return torch.sign(v * s) * torch.floor((v * s).abs() + 0.5) / s


# name -> (lazy formula of (X, Y), dense formula of (x[:, None], y[None]))
CASES = {
    "asin": (lambda X, Y: ((X - Y) * 0.9).asin(), lambda x, y: torch.asin((x - y) * 0.9)),
    "acos": (lambda X, Y: ((X - Y) * 0.9).acos(), lambda x, y: torch.acos((x - y) * 0.9)),
    "atan": (lambda X, Y: (3 * (X - Y)).atan(), lambda x, y: torch.atan(3 * (x - y))),
    "atan2": (lambda X, Y: (X - 0.5).atan2(Y - 0.4), lambda x, y: torch.atan2(x - 0.5, y - 0.4)),
    "mod": (lambda X, Y: (4 * (X - Y)).mod(0.7, 0.1), lambda x, y: floor_mod(4 * (x - y), 0.7, 0.1)),
    "mod_lazy_modulus": (lambda X, Y: (3 * X).mod(Y + 0.5), lambda x, y: floor_mod(3 * x, y + 0.5)),
    "round": (lambda X, Y: (10 * X * Y).round(), lambda x, y: round_away(10 * x * y) + 0 * (x * y)),
    "round_decimals": (lambda X, Y: (X * Y).round(2), lambda x, y: round_away(x * y, 2) + 0 * (x * y)),
    "floor": (lambda X, Y: (5 * (X - Y)).floor() * X, lambda x, y: torch.floor(5 * (x - y)) * x),
    "xlogx": (lambda X, Y: (X * Y + 0.1).xlogx(), lambda x, y: (x * y + 0.1) * torch.log(x * y + 0.1)),
    "sinxdivx": (lambda X, Y: (5 * (X - Y)).sinxdivx(), lambda x, y: torch.sinc(5 * (x - y) / math.pi)),
    "sinc": (lambda X, Y: (2 * (X - Y)).sinc(), lambda x, y: torch.sinc(2 * (x - y))),
    "power": (lambda X, Y: (X + 0.5).power(Y), lambda x, y: (x + 0.5) ** y),
    "power_number": (lambda X, Y: (X + Y).power(2.5), lambda x, y: (x + y) ** 2.5),
    "clamp_lazy_bounds": (lambda X, Y: (2 * X).clamp(Y - 0.3, Y + 0.3), lambda x, y: torch.clamp(2 * x, y - 0.3, y + 0.3)),
    "ifelse": (lambda X, Y: (X - Y).ifelse(X * Y, Y.exp()), lambda x, y: torch.where(x - y >= 0, x * y, y.exp())),
    "step": (lambda X, Y: (X - Y).step() * X, lambda x, y: (x - y >= 0).to(x.dtype) * x),
}
SECOND_ORDER = ["asin", "atan2", "mod_lazy_modulus", "xlogx", "sinxdivx", "power", "clamp_lazy_bounds", "ifelse"]


@pytest.mark.parametrize("axis", ["j", "i"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_math_op_matches_dense(name, dtype, axis):
    lazy_fn, dense_fn = CASES[name]
    x, y = data(dtype)
    assert_sums_like(lazy_fn(lt.Vi(x), lt.Vj(y)), dense_fn(x[:, None], y[None]), [x, y], axis)


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_math_op_second_order(name):
    lazy_fn, dense_fn = CASES[name]
    x, y = data(torch.float64)
    assert_sums_like(lazy_fn(lt.Vi(x), lt.Vj(y)), dense_fn(x[:, None], y[None]), [x, y], "j", order=2)


def values_of(fn, values):
    """fn applied to given numbers, through a formula: (Vi(v) + Vj(0)) reduced over one j."""
    v = torch.tensor(values, dtype=torch.float64)
    return fn(lt.Vi(v[:, None]) + lt.Vj(torch.zeros(1, 1, dtype=torch.float64))).sum(1)[:, 0]


def test_ifelse_takes_the_first_branch_at_zero():
    # KeOps's IfElse(f, a, b) = a if f >= 0 else b (keopscore/formulas/maths/IfElse.py).
    out = values_of(lambda v: v.ifelse(1.0, -1.0), [-1.0, 0.0, -0.0, 2.0])
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=torch.float64))


def test_step_is_one_at_zero():
    # KeOps's Step: x < 0 ? 0 : 1, so Step(0) = 1 (keopscore/utils/math_functions.py).
    out = values_of(lambda v: v.step(), [-1.0, 0.0, 3.0])
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))


def test_mod_follows_the_sign_of_the_modulus_and_the_offset():
    # KeOps: Mod(x, n, d) = x - n * floor((x - d) / n), in [d, d + n): NumPy's mod for d = 0.
    values = [-3.5, -0.25, 0.0, 2.0, 3.5]
    torch.testing.assert_close(values_of(lambda v: v.mod(2), values),
                               torch.tensor([0.5, 1.75, 0.0, 0.0, 1.5], dtype=torch.float64))
    torch.testing.assert_close(values_of(lambda v: v.mod(-2), values),
                               torch.tensor([-1.5, -0.25, 0.0, 0.0, -0.5], dtype=torch.float64))
    torch.testing.assert_close(values_of(lambda v: v.mod(2, -1), values),
                               torch.tensor([0.5, -0.25, 0.0, 0.0, -0.5], dtype=torch.float64))


def test_round_takes_halves_away_from_zero_with_decimals():
    # KeOps's Round(f, d) is C's round(f * 10^d) / 10^d: halves go away from zero (torch.round: to even).
    values = [0.5, -0.5, 1.5, 2.5, -2.5, 1.2345]
    torch.testing.assert_close(values_of(lambda v: v.round(), values),
                               torch.tensor([1.0, -1.0, 2.0, 3.0, -3.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(values_of(lambda v: v.round(2), [3.14159, -2.71828, 0.125]),
                               torch.tensor([3.14, -2.72, 0.13], dtype=torch.float64))
    torch.testing.assert_close(values_of(lambda v: v.round(-2), [1250.0, -149.0]),
                               torch.tensor([1300.0, -100.0], dtype=torch.float64))
    with pytest.raises(TypeError, match="decimals"):
        lt.Vi(torch.rand(3, 1)).round(1.5)


def test_sinxdivx_is_one_at_zero_with_finite_derivatives_of_every_order():
    # KeOps's SinXDivX(0) = 1 (x ? sin(x)/x : 1); derivatives at 0: 0, -1/3, 0, 1/5.
    x = torch.tensor([[0.0], [0.7]], dtype=torch.float64, requires_grad=True)
    y = torch.zeros(1, 1, dtype=torch.float64)
    f = (lt.Vi(x) - lt.Vj(y)).sinxdivx().sum(1)
    torch.testing.assert_close(f[:, 0], torch.tensor([1.0, math.sin(0.7) / 0.7], dtype=torch.float64))
    derivatives, current = [], f.sum()
    for _ in range(4):
        (current,) = torch.autograd.grad(current, x, create_graph=True)
        derivatives.append(current[0, 0].item())
        current = current.sum()
    assert derivatives == pytest.approx([0.0, -1 / 3, 0.0, 1 / 5], abs=1e-12)


def test_xlogx_is_zero_at_zero():
    # KeOps's XLogX: x ? x * log(x) : 0.
    torch.testing.assert_close(values_of(lambda v: v.xlogx(), [0.0, 1.0, 2.0]),
                               torch.tensor([0.0, 0.0, 2 * math.log(2.0)], dtype=torch.float64))


def test_sinc_of_keops_test_sinc():
    # pykeops test_sinc: LazyTensor(x[:, None]).sinc().sum(0) against torch.sinc, values and gradient.
    x = (torch.rand(5, 1, dtype=torch.float64) * 2 * math.pi).requires_grad_()
    s = lt.LazyTensor(x[:, None]).sinc().sum(0)
    ref = torch.sinc(x).sum()
    torch.testing.assert_close(s.reshape(()), ref)
    torch.testing.assert_close(torch.autograd.grad(s.sum(), x)[0], torch.autograd.grad(ref, x)[0])


def test_clamp_of_keops_test_lazytensor_clamp():
    # pykeops test_lazytensor_clamp: exp(-(sum_d clamp(x_d y_d, a, b))^2) summed over j, and its gradient.
    x = torch.randn(100, 1, 3, requires_grad=True)
    y = torch.randn(1, 120, 3)

    def fun(x, y):
        dxy = (x * y).clamp(-1.23, 1.54).sum(dim=2)
        return (-(dxy**2)).exp().sum(dim=1)

    dense = fun(x, y)
    lazy = fun(lt.LazyTensor(x), lt.LazyTensor(y)).squeeze(-1)
    torch.testing.assert_close(lazy, dense, rtol=1e-5, atol=1e-5)
    gl = torch.autograd.grad((lazy**2).sum(), x)[0]
    gd = torch.autograd.grad((dense**2).sum(), x)[0]
    torch.testing.assert_close(gl, gd, rtol=1e-3, atol=1e-3)


def test_feature_sum_of_keops_test_lazytensor_grad():
    # pykeops test_lazytensor_grad: (cos x_i - y_j).sum(dim=2) @ b, first and second gradients in x.
    x = torch.rand(30, 1, 3, dtype=torch.float64, requires_grad=True)
    y = torch.rand(1, 40, 1, dtype=torch.float64)
    b = torch.randn(40, 1, dtype=torch.float64)

    def fun(x, y):
        return (x.cos() - y).sum(dim=2) @ b

    outs = [fun(x, y).squeeze(), fun(lt.LazyTensor(x), lt.LazyTensor(y)).squeeze()]
    torch.testing.assert_close(outs[1], outs[0])
    firsts = [torch.autograd.grad((o**2).sum(), x, create_graph=True)[0] for o in outs]
    torch.testing.assert_close(firsts[1], firsts[0])
    seconds = [torch.autograd.grad((g**2).sum(), x)[0] for g in firsts]
    torch.testing.assert_close(seconds[1], seconds[0])
