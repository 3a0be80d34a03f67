"""Every reduction, streamed vs dense: values and first gradients, both axes."""
import math

import pytest
import torch

import lazytensor as lt

from .dense import dense_reduce, pm, vi, vj

SIZES = [(1, 1), (1, 9), (9, 1), (13, 29)]
KINDS = ["sum", "lse", "min", "max", "kmin", "softmax"]


def make_inputs(n, m, dtype, batch=None, d=3, requires_grad=True):
    shape = (lambda k: (batch, k, d)) if batch else (lambda k: (k, d))
    x = torch.randn(shape(n), dtype=dtype, requires_grad=requires_grad)
    y = torch.randn(shape(m), dtype=dtype, requires_grad=requires_grad)
    b = torch.randn((batch, m, 2) if batch else (m, 2), dtype=dtype, requires_grad=requires_grad)
    g = torch.tensor([0.7], dtype=dtype, requires_grad=requires_grad)
    return x, y, b, g


def formula_pair(x, y, b, g):
    """A Gaussian kernel times values: exercises sqdist, exp, parameters and products."""
    return (-(pm(g) * vi(x).sqdist(vj(y)))).unary("exp") * vj(b) + vi(x).dot(vj(y)) * 0.1


def run_lazy(f, kind, axis, values=None, **kw):
    if kind == "sum":
        return f.sum(axis, **kw)
    if kind == "lse":
        return f.logsumexp(axis, **kw)
    if kind == "min":
        return f.min(axis, **kw)
    if kind == "max":
        return f.max(axis, **kw)
    if kind == "kmin":
        return f.kmin(kw.pop("k"), axis, **kw)
    if kind == "softmax":
        return f.softmax_weighted_sum(values, axis, **kw)
    raise ValueError(kind)


def tolerance(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)


def check(kind, axis, n, m, dtype, batch=None, chunk=(4, 8), backend="eager"):
    x, y, b, g = make_inputs(n, m, dtype, batch)
    inputs = [x, y, b, g]
    if kind == "softmax":
        f = (-(pm(g) * vi(x).sqdist(vj(y)))).unary("exp") + vi(x).dot(vj(y))
        values = (b if axis == "j" else torch.randn_like(x[..., :2]).requires_grad_())
        inputs.append(values)
        kw = {"values": values if values.dim() == 3 else values.unsqueeze(0)}
        lazy_out = f.lazy.softmax_weighted_sum(values, axis, backend=backend, chunk_size=chunk)
    else:
        f = formula_pair(x, y, b, g)
        kw = {"k": min(2, m if axis == "j" else n)} if kind == "kmin" else {}
        lazy_out = run_lazy(f.lazy, kind, axis, backend=backend, chunk_size=chunk, **dict(kw))
    dense_out = dense_reduce(f.dense(), kind, axis, batch is not None, **kw)
    torch.testing.assert_close(lazy_out, dense_out, **tolerance(dtype))
    weights = torch.randn_like(dense_out)
    grads_lazy = torch.autograd.grad((lazy_out * weights).sum(), inputs, allow_unused=True)
    grads_dense = torch.autograd.grad((dense_out * weights).sum(), inputs, allow_unused=True)
    for gl, gd in zip(grads_lazy, grads_dense):
        if gd is None:
            assert gl is None or gl.abs().max() == 0
        else:
            torch.testing.assert_close(gl, gd, **tolerance(dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("axis", ["j", "i"])
@pytest.mark.parametrize("n,m", SIZES)
def test_reduction_float64(kind, axis, n, m):
    check(kind, axis, n, m, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("axis", ["j", "i"])
def test_reduction_float32_batched(kind, axis):
    check(kind, axis, 11, 17, torch.float32, batch=2)


@pytest.mark.parametrize("kind", KINDS)
def test_reduction_auto_chunks(kind):
    check(kind, "j", 40, 33, torch.float64, chunk=None)


def test_argmin_and_argkmin_indices():
    x, y = torch.randn(23, 2, dtype=torch.float64), torch.randn(31, 2, dtype=torch.float64)
    d = ((x[:, None] - y[None]) ** 2).sum(-1)
    D = lt.Vi(x).sqdist(lt.Vj(y))
    assert torch.equal(D.argmin(1, chunk_size=(5, 7)).squeeze(-1), d.argmin(1))
    assert torch.equal(D.argmax(0, chunk_size=(5, 7)).squeeze(-1), d.argmax(0))
    vals, idx = D.kmin_argkmin(4, 1, chunk_size=(5, 7))
    ref = torch.topk(d, 4, 1, largest=False)
    torch.testing.assert_close(vals, ref.values)
    assert torch.equal(idx, ref.indices)


def test_min_argmin_returns_both():
    x, y = torch.randn(5, 1, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    val, idx = (lt.Vi(x) - lt.Vj(y)).abs().min_argmin(1)
    d = (x - y.T).abs()
    torch.testing.assert_close(val.squeeze(-1), d.min(1).values)
    assert torch.equal(idx.squeeze(-1), d.argmin(1))


def test_matmul_and_keops_layout():
    x, y, b = torch.randn(10, 3), torch.randn(12, 3), torch.randn(12, 4)
    K = (-lt.LazyTensor(x[:, None, :]).sqdist(lt.LazyTensor(y[None, :, :]))).exp()
    ref = torch.exp(-torch.cdist(x, y) ** 2) @ b
    torch.testing.assert_close(K @ b, ref, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    g = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def fn(x, y, b, g):
        f = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)
        return f.sum(1, chunk_size=(3, 2)), f.logsumexp(0, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (x, y, b, g))


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_kmin_through_group_minima_orders_nan_last_and_keeps_infinities(backend):
    """A tile wide enough for the group-minima selection (256 columns: 8 groups of 32 > k), with NaN, +inf and
    -inf entries: the k smallest as a stable ascending sort with NaN last (eager maps NaN with nan_to_num)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 1, generator=gen, dtype=torch.float64)
    w = torch.randn(256, 1, generator=gen, dtype=torch.float64)
    w[[3, 40, 41, 200]] = torch.tensor([[math.nan], [math.inf], [-math.inf], [math.nan]], dtype=torch.float64)
    w[100:140] = 0.0  # ties across groups: lowest index first
    values, indices = (lt.Vi(x) * lt.Vj(w)).kmin_argkmin(5, dim=1, backend=backend)
    dense = x * w.T
    order = torch.sort(dense, dim=1, stable=True).indices[:, :5]
    torch.testing.assert_close(values.reshape(7, 5), torch.gather(dense, 1, order), equal_nan=True)
    assert torch.equal(indices.reshape(7, 5), order)
