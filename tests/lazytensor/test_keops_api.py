"""The KeOps LazyTensor API around the formulas: layouts, several batch dimensions, batched parameters,
transposes and linear-operator use, NumPy in and out, ``out=``, and option errors.

Ported from pykeops's tests (test_lazytensor_gaussian_batch, test_torch.test_LazyTensor_sum / _min /
_min_chunked, test_transpose, test_lazytensor_gaussian_inplace, test_numpy), rewritten here.
"""
import numpy as np
import pytest
import torch

import lazytensor as lt


def test_gaussian_with_broadcast_batch_dims_of_keops_test():
    # pykeops test_lazytensor_gaussian_batch: x (1, B2, M, 1, D), y (B1, B2, 1, N, D), b (B1, 1, N, DV).
    B1, B2, M, N, D, DV = 3, 4, 20, 25, 3, 2
    x = torch.rand(1, B2, M, 1, D) / D**0.5
    y = torch.rand(B1, B2, 1, N, D) / D**0.5
    b = torch.randn(B1, 1, N, DV, requires_grad=True)

    def fun(x, y):
        return (-((x - y) ** 2).sum(dim=4)).exp() @ b

    dense, lazy = fun(x, y), fun(lt.LazyTensor(x), lt.LazyTensor(y))
    assert lazy.shape == dense.shape == (B1, B2, M, DV)
    torch.testing.assert_close(lazy, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad((lazy**2).sum(), b)[0], torch.autograd.grad((dense**2).sum(), b)[0])


def keops_batch_data(dtype):
    A, B, M, N, D = 5, 3, 10, 6, 3
    X = torch.rand(A, B, M, D, dtype=dtype, requires_grad=True)
    L = torch.rand(A, 1, M, 1, dtype=dtype)
    Y = torch.rand(1, B, N, D, dtype=dtype, requires_grad=True)
    S = (torch.rand(A, B, 1, dtype=dtype) + 1).requires_grad_()
    return X, L, Y, S


def keops_layout(X, L, Y, S, lazy):
    x_i, l_i, y_j, s_p = X.unsqueeze(-2), L.unsqueeze(-2), Y.unsqueeze(-3), S.unsqueeze(-2).unsqueeze(-2)
    if lazy:
        x_i, l_i, y_j, s_p = (lt.LazyTensor(t) for t in (x_i, l_i, y_j, s_p))
    return x_i, l_i, y_j, s_p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_with_two_batch_dims_and_second_order_of_keops_test_torch(dtype):
    # pykeops test_LazyTensor_sum: a Gaussian-like kernel with a batched (A, B) parameter, summed over j
    # (KeOps: dim = nbatchdims + 1 = 3; here dim = 1), its gradients and a second-order gradient.
    X, L, Y, S = keops_batch_data(dtype)
    results = []
    for lazy in (True, False):
        x_i, l_i, y_j, s_p = keops_layout(X, L, Y, S, lazy)
        K_ij = (-(0.5 * (l_i * x_i - y_j) ** 2 / s_p).sum(-1)).exp()
        a_i = K_ij.sum(1) if lazy else K_ij.sum(3)
        a_i = a_i.squeeze(-1) if lazy else a_i
        g_x, g_y, g_s = torch.autograd.grad((a_i**2).sum(), [X, Y, S], create_graph=True)
        (g_xx,) = torch.autograd.grad((g_x**2).sum(), [X])
        results.append([a_i, g_x, g_y, g_s, g_xx])
    for a, b in zip(*results):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_min_argmin_with_two_batch_dims_over_i_of_keops_test_torch():
    # pykeops test_LazyTensor_min: min_argmin over i (KeOps: dim = nbatchdims = 2; here dim = 0).
    X, L, Y, S = keops_batch_data(torch.float64)
    outs = []
    for lazy in (True, False):
        x_i, l_i, y_j, s_p = keops_layout(X, L, Y, S, lazy)
        D_ij = (1 + ((l_i * x_i + y_j).relu() * s_p) ** 2).log().sum(-1, keepdim=True)
        K_ij = (D_ij**1.5 + 1).cos() * (D_ij * (3.2 + s_p)).sin()
        outs.append(K_ij.min_argmin(dim=0) if lazy else tuple(K_ij.min(dim=2)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_min_argmin_with_many_features_of_keops_test_torch():
    # pykeops test_LazyTensor_min_chunked: 990 features, min_argmin over i.
    x, y = torch.rand(10, 990), torch.rand(6, 990)
    K = lambda a, b: (-((a + b) ** 2)).exp().sum(-1, keepdim=True)  # noqa: E731
    m, am = K(lt.LazyTensor(x[:, None]), lt.LazyTensor(y[None])).min_argmin(dim=0)
    dm, dam = K(x[:, None], y[None]).min(dim=0)
    torch.testing.assert_close(m, dm)
    torch.testing.assert_close(am, dam)


def test_batched_parameters_broadcast_with_batched_variables():
    x, y = torch.randn(2, 3, 7, 2), torch.randn(3, 5, 2)
    g = (torch.rand(2, 1, 1) + 0.5).requires_grad_()  # (A, 1) batch, one feature: broadcast over B
    out = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(y))).exp().sum(1)
    ref = torch.exp(-g[..., None] * ((x[..., :, None, :] - y[None, :, None, :, :]) ** 2).sum(-1)).sum(-1, keepdim=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), g)[0], torch.autograd.grad(ref.sum(), g)[0])
    with pytest.raises(ValueError, match="batch shapes"):
        (lt.Vi(torch.randn(2, 4, 1)) - lt.Vj(torch.randn(3, 5, 1))).sum(1)


def test_transpose_of_keops_test_transpose():
    # pykeops test_transpose: K.t() @ w against the dense transpose.
    x, y = torch.randn(100, 3), torch.randn(200, 3)
    K = (-((lt.LazyTensor(x[:, None, :]) - lt.LazyTensor(y[None, :, :])) ** 2).sum(2)).exp()
    Kd = (-((x[:, None, :] - y[None, :, :]) ** 2).sum(2)).exp()
    w = torch.rand(100, 2)
    torch.testing.assert_close(K.t() @ w, Kd.t() @ w)
    torch.testing.assert_close(K.T @ w, K.rmatvec(w))
    assert K.shape == (100, 200) and K.T.shape == (200, 100)
    assert (K - K).shape == (100, 200) and K.dim() == 3 and (lt.Vi(x) - lt.Vj(y)).shape == (100, 200, 3)


def test_scipy_linear_operator_from_matvec_rmatvec_shape_dtype():
    from scipy.sparse.linalg import aslinearoperator, eigsh

    x = np.random.default_rng(0).standard_normal((300, 3))
    K = (-lt.LazyTensor(x[:, None, :]).sqdist(lt.LazyTensor(x[None, :, :]))).exp()
    assert K.dtype == np.float64
    values = eigsh(aslinearoperator(K), k=4, return_eigenvectors=False)
    dense = np.exp(-((x[:, None] - x[None]) ** 2).sum(-1))
    np.testing.assert_allclose(np.sort(values), np.linalg.eigvalsh(dense)[-4:], rtol=1e-8)
    v = np.random.default_rng(1).standard_normal(300)
    np.testing.assert_allclose(K.matvec(v), dense @ v, rtol=1e-10)
    np.testing.assert_allclose(K.rmatvec(v), dense.T @ v, rtol=1e-10)


def test_numpy_in_numpy_out_for_every_reduction():
    rng = np.random.default_rng(0)
    x, y, b = rng.random((8, 3)), rng.random((5, 3)), rng.random((5, 2))
    xi, yj = lt.LazyTensor(x[:, None, :]), lt.LazyTensor(y[None, :, :])
    D = xi.sqdist(yj)
    dense = ((x[:, None] - y[None]) ** 2).sum(-1)
    results = {
        "sum": (D.sum(axis=1), dense.sum(1, keepdims=True)),
        "matmul": ((-D).exp() @ b, np.exp(-dense) @ b),
        "logsumexp": ((-D).logsumexp(axis=1), np.log(np.exp(-dense).sum(1, keepdims=True))),
        "min": (D.min(axis=0), dense.min(0)[:, None]),
        "argkmin": (D.argkmin(2, axis=1), np.argsort(dense, 1)[:, :2]),
        "softmax": (D.sumsoftmaxweight(lt.LazyTensor(b[None]), axis=1),
                    (np.exp(dense - dense.max(1, keepdims=True)) / np.exp(dense - dense.max(1, keepdims=True)).sum(1,
                                                                                               keepdims=True)) @ b),
    }
    for name, (out, ref) in results.items():
        assert isinstance(out, np.ndarray), name
        np.testing.assert_allclose(out, ref, rtol=1e-10, err_msg=name)
    mixed = x[:, None, :] * yj  # ndarray * LazyTensor: the LazyTensor's operator runs (__array_ufunc__ = None)
    assert isinstance(mixed, lt.LazyTensor)
    np.testing.assert_allclose(mixed.sum(-1).sum(1), (x @ y.T).sum(1, keepdims=True), rtol=1e-12)
    with pytest.raises(TypeError, match="mixes NumPy arrays and torch tensors"):
        (xi - lt.Vj(torch.rand(5, 3, dtype=torch.float64))).sum(1)


def test_out_writes_in_place_of_keops_test_inplace():
    # pykeops test_lazytensor_gaussian_inplace: K @ b with out= a preallocated tensor.
    x, y, b = torch.rand(20, 1, 3), torch.rand(1, 30, 3), torch.randn(30, 1)
    a = torch.empty(20, 1)
    K = (-((lt.LazyTensor(x) - lt.LazyTensor(y)).square()).sum(dim=2)).exp()
    returned = K.__matmul__(b, out=a)
    assert returned is a
    torch.testing.assert_close(a, (-((x - y).square()).sum(dim=2)).exp() @ b)
    value, index = torch.empty(20, 1), torch.empty(20, 1, dtype=torch.int64)
    K.min_argmin(1, out=(value, index))
    torch.testing.assert_close(index, K.argmin(1))
    out = np.empty((20, 1))
    lt.LazyTensor(x.double().numpy()).sqdist(lt.LazyTensor(y.double().numpy())).sum(1, out=out)
    np.testing.assert_allclose(out, ((x.double() - y.double()) ** 2).sum(-1).sum(1, keepdim=True).numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="out must be"):
        K.sum(1, out=torch.empty(3))
    with pytest.raises(ValueError, match="automatic differentiation"):
        (K * lt.Vi(torch.rand(20, 1, requires_grad=True))).sum(1, out=torch.empty(20, 1))
    with pytest.raises(TypeError, match="can't be cast"):  # torch's rule: a float result never lands in integers
        K.sum(1, out=torch.empty(20, 1, dtype=torch.int64))


def test_keops_constructor_conventions():
    x, p = torch.randn(4, 3), torch.randn(3)
    assert lt.LazyTensor(x, axis=0).shape == (4, 1, 3) and lt.LazyTensor(x, 1).shape == (1, 4, 3)
    assert lt.LazyTensor(p[None, None, :]).variables.popitem()[1].axis == "p"  # (1, 1, D): a parameter
    assert lt.LazyTensor([0.5, 1.5]).ndim == 2  # a list of numbers: a parameter that follows the formula's dtype
    y = torch.randn(5, 3, dtype=torch.float64)
    out = (lt.Vi(x.double()) * lt.LazyTensor([2.0, 0.0, 1.0]) - lt.Vj(y)).sum(-1).sum(1)
    scaled = x.double() * torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(out[:, 0], (scaled[:, None] - y).sum((1, 2)))
    K = lt.Vi(x) - lt.Vj(torch.randn(5, 3))
    torch.testing.assert_close(K.sum(-2), K.sum(1))  # -2 / -3: j / i counted from the end
    torch.testing.assert_close(K.sum(-3), K.sum("i"))
    with pytest.raises(ValueError, match="2-D tensor"):
        lt.LazyTensor(x)
    with pytest.raises(ValueError, match="axis must be"):
        lt.LazyTensor(x, axis=3)


def test_reduction_options_are_checked():
    x = torch.randn(2, 4, 3)  # one batch dim
    K = lt.Vi(x).sqdist(lt.Vj(torch.randn(2, 5, 3)))
    with pytest.raises(ValueError, match="batch dimensions are not counted"):
        K.logsumexp(dim=2)  # KeOps: j of a one-batch-dim formula
    with pytest.raises(TypeError, match="unexpected reduction option"):
        K.sum(1, summation="kahan_scheme")  # KeOps's sum_scheme= is accepted (test_keops_suite_fixes.py)
    with pytest.raises(TypeError, match="dtype_acc is an option of sum"):
        K.logsumexp(1, dtype_acc="float64")
    torch.testing.assert_close(K.sum(1, dtype_acc="float64"), K.sum(1).double())  # batch dims too
    torch.testing.assert_close(K.sum(axis=1), K.sum(1))
    torch.testing.assert_close((K * 1.0).sum(dim=-1, keepdim=True).sum(1), K.sum(1))  # KeOps's keepdim on a feature sum
