"""Derivatives of any order and torch.func transforms, against dense autograd in float64.

The backward of a streamed reduction is itself a streamed reduction, so
``create_graph=True`` gives a differentiable gradient; forward mode and vmap
have their own rules, so ``torch.func`` composes with every reduction.
"""
import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import lazytensor as lt

TOL = dict(rtol=1e-9, atol=1e-10)
REDUCTIONS = ["sum", "lse", "softmax", "min", "max", "kmin", "quantile"]


def make(n=6, m=7, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(m, d, generator=gen, dtype=torch.float64)
    b = torch.randn(m, 2, generator=gen, dtype=torch.float64)
    g = torch.tensor([0.6], dtype=torch.float64)
    return x, y, b, g


def streamed(x, y, b, g, kind, chunk=(4, 3)):
    sq = lt.Vi(x).sqdist(lt.Vj(y))
    kw = dict(backend="eager", chunk_size=chunk)
    if kind == "sum":
        return ((-lt.Pm(g) * sq).exp() * lt.Vj(b)).sum(1, **kw)
    if kind == "lse":
        return (-lt.Pm(g) * sq + lt.Vj(b)).logsumexp(1, **kw)
    if kind == "softmax":
        return (-lt.Pm(g) * sq).softmax_weighted_sum(b, 1, **kw)
    if kind in ("min", "max"):
        return getattr(sq * lt.Vj(b) + lt.Pm(g) * lt.Vi(x).sum(-1), kind)(1, **kw)
    if kind == "kmin":
        return (sq * lt.Pm(g)).kmin(3, 1, **kw)
    return (sq * lt.Pm(g)).quantile(torch.tensor([0.3, 0.7], dtype=x.dtype), 1, **kw)


def dense(x, y, b, g, kind):
    sq = ((x[:, None] - y[None]) ** 2).sum(-1)
    if kind == "sum":
        return torch.exp(-g * sq) @ b
    if kind == "lse":
        return torch.logsumexp(-g * sq[..., None] + b[None], 1)
    if kind == "softmax":
        return torch.softmax(-g * sq, 1) @ b
    if kind in ("min", "max"):
        f = sq[..., None] * b[None] + g * x.sum(-1)[:, None, None]
        return getattr(f, kind)(1).values
    if kind == "kmin":
        return torch.topk(sq * g, 3, dim=1, largest=False).values
    return torch.quantile(sq * g, torch.tensor([0.3, 0.7], dtype=x.dtype), dim=1).T


@pytest.mark.parametrize("kind", REDUCTIONS)
def test_second_order_matches_dense(kind):
    x, y, b, g = (t.requires_grad_() for t in make())
    inputs = [x, y, b, g]
    outs = [f(x, y, b, g, kind) for f in (streamed, dense)]
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    w = torch.randn_like(outs[1])
    firsts = [torch.autograd.grad((o * w).sum(), inputs, create_graph=True, allow_unused=True) for o in outs]
    penalties = [sum((gr**2).sum() for gr in first if gr is not None and gr.requires_grad) for first in firsts]
    seconds = [torch.autograd.grad(p, inputs, allow_unused=True) for p in penalties]
    for a, c in zip(firsts[0], firsts[1]):
        if c is not None:
            torch.testing.assert_close(a, c, **TOL)
    for a, c in zip(seconds[0], seconds[1]):
        if c is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, c, **TOL)


def test_hessian_vector_product_of_a_kernel_sum():
    x, y, b, g = make()
    x.requires_grad_()
    v = torch.randn_like(x)
    hvps = []
    for f in (streamed, dense):
        (gx,) = torch.autograd.grad(f(x, y, b, g, "sum").sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((gx * v).sum(), x)[0])
    torch.testing.assert_close(hvps[0], hvps[1], **TOL)


def test_mixed_graph_keeps_every_term():
    """Streamed and dense terms in one loss: second derivatives through both."""
    x, y, b, g = make()
    x.requires_grad_()
    results = []
    for f in (streamed, dense):
        loss = f(x, y, b, g, "sum").pow(2).sum() + (x.sin() * f(x, y, b, g, "lse").sum()).sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        results.append(torch.autograd.grad(gx.pow(3).sum(), x)[0])
    torch.testing.assert_close(results[0], results[1], **TOL)


@pytest.mark.parametrize("kind", ["sum", "lse", "softmax", "min", "kmin"])
def test_torch_func_transforms(kind):
    x, y, b, g = make()
    fs = [lambda x_, f=f: f(x_, y, b, g, kind) for f in (streamed, dense)]
    scalars = [lambda x_, f=f: f(x_).sum() for f in fs]
    for transform in (jacrev, jacfwd):
        torch.testing.assert_close(transform(fs[0])(x), transform(fs[1])(x), **TOL)
    torch.testing.assert_close(grad(scalars[0])(x), grad(scalars[1])(x), **TOL)
    torch.testing.assert_close(hessian(scalars[0])(x), hessian(scalars[1])(x), **TOL)
    t = torch.randn_like(x)
    (_, d0), (_, d1) = jvp(fs[0], (x,), (t,)), jvp(fs[1], (x,), (t,))
    torch.testing.assert_close(d0, d1, **TOL)
    (out, pull), (_, pull1) = vjp(fs[0], x), vjp(fs[1], x)
    w = torch.randn_like(out)
    torch.testing.assert_close(pull(w)[0], pull1(w)[0], **TOL)
    xs = torch.randn(4, *x.shape, dtype=x.dtype)
    torch.testing.assert_close(vmap(fs[0])(xs), vmap(fs[1])(xs), **TOL)
    ys = torch.randn(3, *y.shape, dtype=y.dtype)
    by_y = [lambda y_, f=f: f(x, y_, b, g, kind) for f in (streamed, dense)]
    torch.testing.assert_close(vmap(by_y[0])(ys), vmap(by_y[1])(ys), **TOL)


def test_vmap_over_batched_parameters_and_batched_variables():
    x, y, b, g = make()
    xb = torch.randn(2, *x.shape, dtype=x.dtype)
    gs = torch.rand(5, 1, dtype=x.dtype)

    def both(f):
        return vmap(lambda g_: f(xb, y, b, g_, "sum"))(gs)

    torch.testing.assert_close(both(streamed), both(lambda x_, y_, b_, g_, k: torch.stack(
        [dense(x_[i], y_, b_, g_, k) for i in range(2)])), **TOL)


@pytest.mark.parametrize("kind", ["lse", "softmax"])
def test_third_order_matches_dense(kind):
    """Each derivative pass numbers its variables after those of the pass it differentiates (its softmax
    placeholders included): a third derivative nests three collectors' symbols in one formula."""
    x, y, b, g = make(n=4, m=5)
    outs = []
    for f in (streamed, dense):
        xi = x.clone().requires_grad_()
        (first,) = torch.autograd.grad(f(xi, y, b, g, kind).sin().sum(), xi, create_graph=True)
        (second,) = torch.autograd.grad((first**2).sum(), xi, create_graph=True)
        outs.append(torch.autograd.grad((second.cos()).sum(), xi)[0])
    torch.testing.assert_close(outs[0], outs[1], **TOL)
