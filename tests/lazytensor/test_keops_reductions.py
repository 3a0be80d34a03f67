"""KeOps's reductions we lacked: LogSumExp with a weight, Max_SumShiftExp(Weight), and formulas with one
kind of index only; each against dense torch, both axes, float32 and float64, first and second order.

Conventions from pykeops/common/operations.py: ``logsumexp(weight=w)`` is log sum_j exp(F_ij) w_ij per
feature of w (LogSumExpWeight), and Max_SumShiftExpWeight returns (m_i, s_i) with m_i = max_j F_ij and
s_i = sum_j exp(F_ij - m_i) w_ij, concatenated on the last axis. A formula without j-variables has
j-size 1 (pykeops/common/parse_type.py, get_sizes).
"""
import pytest
import torch

import lazytensor as lt

from .dense import TOLERANCE

N, M = 7, 9


def problem(dtype, e=2):
    x = torch.randn(N, 3, dtype=dtype, requires_grad=True)
    y = torch.randn(M, 3, dtype=dtype, requires_grad=True)
    w = (torch.rand(M, e, dtype=dtype) + 0.2).requires_grad_()
    return x, y, w


def dense_f(x, y):
    return -((x[:, None] - y[None]) ** 2).sum(-1) / 2  # (N, M)


def compare(lazy_out, dense_out, inputs, order=1):
    tol = TOLERANCE[dense_out.dtype]
    torch.testing.assert_close(lazy_out, dense_out, **tol)
    weight = torch.randn_like(dense_out)
    gl = torch.autograd.grad((lazy_out * weight).sum(), inputs, create_graph=order > 1)
    gd = torch.autograd.grad((dense_out * weight).sum(), inputs, create_graph=order > 1)
    for a, b in zip(gl, gd):
        torch.testing.assert_close(a, b, **tol)
    if order > 1:
        v = [torch.randn_like(g) for g in gd]
        hl = torch.autograd.grad(sum((g * u).sum() for g, u in zip(gl, v)), inputs)
        hd = torch.autograd.grad(sum((g * u).sum() for g, u in zip(gd, v)), inputs)
        for a, b in zip(hl, hd):
            torch.testing.assert_close(a, b, **tol)


def lse_weight_dense(f, w, dim):
    """log sum exp(f) w over dim, per feature of w: f (N, M), w (M, E) on j or (N, E) on i."""
    wb = w[None] if dim == 1 else w[:, None]
    return torch.logsumexp(f[..., None] + torch.log(wb), dim)


def max_sumshiftexp_dense(f, w, dim):
    m = f.max(dim, keepdim=True).values
    wb = w[None] if dim == 1 else w[:, None]
    s = (torch.exp(f - m)[..., None] * wb).sum(dim)
    return torch.cat([m.squeeze(dim)[..., None], s], -1)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logsumexp_with_weight(dtype, axis):
    x, y, w = problem(dtype)
    if axis == 0:
        w = (torch.rand(N, 2, dtype=dtype) + 0.2).requires_grad_()
    K = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
    out = K.logsumexp(axis, weight=w, chunk_size=(3, 4))
    compare(out, lse_weight_dense(dense_f(x, y), w, axis), [x, y, w], order=2 if dtype == torch.float64 else 1)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_max_sumshiftexp(dtype, axis, weighted):
    x, y, w = problem(dtype)
    if axis == 0:
        w = (torch.rand(N, 2, dtype=dtype) + 0.2).requires_grad_()
    K = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
    out = K.max_sumshiftexp(axis, weight=w if weighted else None, chunk_size=(3, 4))
    ones = torch.ones(w.shape[0], 1, dtype=dtype)
    dense = max_sumshiftexp_dense(dense_f(x, y), w if weighted else ones, axis)
    inputs = [x, y, w] if weighted else [x, y]
    compare(out, dense, inputs, order=2 if dtype == torch.float64 else 1)


def test_max_sumshiftexp_gives_logsumexp_and_softmax():
    x, y, w = problem(torch.float64)
    K = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
    ms = K.max_sumshiftexp(1, weight=lt.Vj(w).concat(1.0))
    m, s = ms[:, :1], ms[:, 1:]
    torch.testing.assert_close(m + torch.log(s[:, 2:]), K.logsumexp(1))
    torch.testing.assert_close(s[:, :2] / s[:, 2:], K.softmax_weighted_sum(w, 1))


def test_new_reductions_under_torch_func_jvp_and_vmap():
    x, y, w = problem(torch.float64)
    tx = torch.randn_like(x)

    def lazy(x):
        K = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
        return K.logsumexp(1, weight=w.detach()), K.max_sumshiftexp(1, weight=w.detach())

    def dense(x):
        f = dense_f(x, y)
        return lse_weight_dense(f, w.detach(), 1), max_sumshiftexp_dense(f, w.detach(), 1)

    _, tl = torch.func.jvp(lazy, (x.detach(),), (tx,))
    _, td = torch.func.jvp(dense, (x.detach(),), (tx,))
    for a, b in zip(tl, td):
        torch.testing.assert_close(a, b)
    xs = torch.stack([x.detach(), x.detach() + 0.5])  # vmap: the mapped dimension joins the batch
    for a, b in zip(torch.func.vmap(lazy)(xs), torch.func.vmap(dense)(xs)):
        torch.testing.assert_close(a, b)


KERNELS = {  # log-kernels of pykeops test_torch.test_logSumExp_kernels_feature
    "gaussian": (lambda xi, yj, s: -lt.Pm(1 / s**2) * xi.sqdist(yj), lambda d2, s: -d2 / s**2),
    "laplacian": (lambda xi, yj, s: -(lt.Pm(1 / s**2) * xi.sqdist(yj)).sqrt(), lambda d2, s: -(d2 / s**2).sqrt()),
    "cauchy": (lambda xi, yj, s: (1 + lt.Pm(1 / s**2) * xi.sqdist(yj)).power(-1).log(), lambda d2, s: -torch.log1p(d2 / s**2)),
    "inverse_multiquadric": (lambda xi, yj, s: (1 + lt.Pm(1 / s**2) * xi.sqdist(yj)).sqrt().power(-1).log(),
                             lambda d2, s: -0.5 * torch.log1p(d2 / s**2)),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_logsumexp_weight_kernels_of_keops_test_torch(kernel):
    # log sum_j K(x_i, y_j) exp(g_j), with weight Vj(g.exp()), against log-sum-exp of log K + g.
    x, y = torch.rand(10, 3), torch.rand(6, 3)
    g, sigma = torch.rand(6, 1), torch.tensor([0.4])
    lazy_k, log_k = KERNELS[kernel]
    out = lazy_k(lt.Vi(x), lt.Vj(y), sigma).logsumexp(dim=1, weight=lt.Vj(g.exp()))
    ref = torch.logsumexp(log_k(torch.cdist(x, y) ** 2, sigma) + g.T, dim=1)
    torch.testing.assert_close(out.ravel(), ref, rtol=1e-5, atol=1e-5)


def test_logsumexp_gradient_of_keops_test_torch():
    # pykeops test_logSumExp_gradient_kernels_feature: F_ij = p0 f_i + p1 g_j, gradients of sum_i LSE_j F in f and g.
    p = torch.rand(2, dtype=torch.float64)
    f = torch.rand(10, 1, dtype=torch.float64, requires_grad=True)
    g = torch.rand(6, 1, dtype=torch.float64, requires_grad=True)
    out = (lt.Pm(p).elem(0) * lt.Vi(f) + lt.Pm(p).elem(1) * lt.Vj(g)).logsumexp(1)
    gf, gg = torch.autograd.grad(out.sum(), [f, g])
    softmax = torch.softmax(p[0] * f + p[1] * g.T, dim=1)
    torch.testing.assert_close(gf.ravel(), p[0] * torch.ones(10, dtype=torch.float64))
    torch.testing.assert_close(gg.ravel(), p[1] * softmax.sum(0))


# -- formulas with one kind of index -------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_i_only_formula_reduces_over_i_into_one_row(dtype):
    x = torch.randn(N, 3, dtype=dtype, requires_grad=True)
    out = lt.Vi(x).exp().sum(0)
    assert out.shape == (1, 3)
    torch.testing.assert_close(out, x.exp().sum(0, keepdim=True))
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(g, x.exp())
    torch.testing.assert_close(lt.Vi(x).sqnorm2().logsumexp(0), torch.logsumexp((x**2).sum(-1), 0).reshape(1, 1))
    torch.testing.assert_close(lt.Vi(x).sqnorm2().min(0), (x**2).sum(-1).min().reshape(1, 1))


def test_j_only_formula_reduces_over_j_into_one_row():
    y = torch.randn(M, 2, dtype=torch.float64)
    b = torch.randn(M, 3, dtype=torch.float64)
    out = (-lt.Vj(y).sqnorm2()).exp() @ b
    torch.testing.assert_close(out, torch.exp(-(y**2).sum(-1, keepdim=True)).T @ b)


@pytest.mark.parametrize("axis, size", [(1, "M"), (0, "N")])
def test_reducing_an_axis_without_variables_names_the_missing_size(axis, size):
    lone = lt.Vi(torch.randn(5, 2)) if axis == 1 else lt.Vj(torch.randn(5, 2))
    with pytest.raises(ValueError, match=f"reduced size {size}"):
        lone.exp().sum(axis)
    with pytest.raises(ValueError, match="reduced size M"):  # parameters only
        lt.Pm(torch.randn(2)).exp().sum(1)


def test_logsumexp_with_two_batch_dims_of_keops_test_torch():
    # pykeops test_LazyTensor_logsumexp: batch dims (A, B) broadcast between x (A, B, M, D), l (A, 1, M, 1),
    # y (1, B, N, D) and a batched parameter s (A, B, 1, 1, 1); value, gradients and one second derivative.
    # KeOps counts batch dims in ``dim`` (here 3 = j); lazytensor does not (dim=1 is j).
    A, B, Mx, Ny, D = 5, 3, 10, 6, 3
    X = torch.rand(A, B, Mx, D, dtype=torch.float64, requires_grad=True)
    L = torch.rand(A, 1, Mx, 1, dtype=torch.float64)
    Y = torch.rand(1, B, Ny, D, dtype=torch.float64, requires_grad=True)
    S = (torch.rand(A, B, 1, dtype=torch.float64) + 1).requires_grad_()
    results = []
    for lazy in (True, False):
        x_i, l_i, y_j, s_p = X.unsqueeze(-2), L.unsqueeze(-2), Y.unsqueeze(-3), S.unsqueeze(-2).unsqueeze(-2)
        if lazy:
            x_i, l_i, y_j, s_p = (lt.LazyTensor(t) for t in (x_i, l_i, y_j, s_p))
        K_ij = -1 / (1 + ((l_i * x_i + y_j).relu() * s_p / 9).sum(-1))
        a_i = K_ij.logsumexp(1) if lazy else K_ij.logsumexp(3)
        a_i = a_i.squeeze(-1)
        g_x, g_y, g_s = torch.autograd.grad(a_i.sum(), [X, Y, S], create_graph=True)
        (g_xs,) = torch.autograd.grad(g_x.abs().sum(), [S])
        results.append([a_i, g_x, g_y, g_s, g_xs])
    for a, b in zip(*results):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)
