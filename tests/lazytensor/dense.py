"""Dense twins of lazy formulas: the same arithmetic on broadcast torch tensors.

``Pair`` carries a LazyTensor and a function computing the identical formula
as a dense (B, N, M, C) tensor, so every streamed result has a reference that
shares no code with the lowering.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import lazytensor as lt


@dataclass
class Pair:
    lazy: lt.LazyTensor
    dense: Callable[[], torch.Tensor]  # (B, N, M, C)

    def _bin(self, other, fl, fd):
        if isinstance(other, Pair):
            return Pair(fl(self.lazy, other.lazy), lambda: fd(self.dense(), other.dense()))
        return Pair(fl(self.lazy, other), lambda: fd(self.dense(), other))

    def __add__(self, o):
        return self._bin(o, lambda a, b: a + b, lambda a, b: a + b)

    def __sub__(self, o):
        return self._bin(o, lambda a, b: a - b, lambda a, b: a - b)

    def __mul__(self, o):
        return self._bin(o, lambda a, b: a * b, lambda a, b: a * b)

    def __truediv__(self, o):
        return self._bin(o, lambda a, b: a / b, lambda a, b: a / b)

    def __neg__(self):
        return Pair(-self.lazy, lambda: -self.dense())

    def __gt__(self, o):
        return Pair(self.lazy > o, lambda: self.dense() > o)

    def unary(self, name, dense_fn=None):
        dense_fn = dense_fn or getattr(torch, name)
        return Pair(getattr(self.lazy, name)(), lambda: dense_fn(self.dense()))

    def sqdist(self, o):
        return Pair(self.lazy.sqdist(o.lazy), lambda: ((self.dense() - o.dense()) ** 2).sum(-1, keepdim=True))

    def dot(self, o):
        return Pair(self.lazy | o.lazy, lambda: (self.dense() * o.dense()).sum(-1, keepdim=True))


def vi(x):
    """x: (N, D) or (B, N, D) -> Pair of Vi and its (B, N, 1, D) view."""
    xb = x if x.dim() == 3 else x.unsqueeze(0)
    return Pair(lt.Vi(x), lambda: xb.unsqueeze(2))


def vj(y):
    yb = y if y.dim() == 3 else y.unsqueeze(0)
    return Pair(lt.Vj(y), lambda: yb.unsqueeze(1))


def pm(p):
    return Pair(lt.Pm(p), lambda: p.reshape(-1))


def dense_reduce(f: torch.Tensor, kind: str, axis: str, batched: bool, **kw):
    """Reference reductions of a dense (B, N, M, C) tile over j (dim 2) or i (dim 1)."""
    dim = 2 if axis == "j" else 1
    if kind == "sum":
        out = f.sum(dim)
    elif kind == "lse":
        out = torch.logsumexp(f, dim)
    elif kind == "min":
        out = f.min(dim).values
    elif kind == "max":
        out = f.max(dim).values
    elif kind == "argmin":
        out = f.argmin(dim)
    elif kind == "kmin":
        out = torch.topk(f, kw["k"], dim=dim, largest=False, sorted=True).values.movedim(dim, -2)
        if out.shape[-1] == 1:
            out = out.squeeze(-1)
    elif kind == "softmax":
        w = torch.softmax(f, dim)
        v = kw["values"]  # (B, M, E) for j
        out = torch.einsum("bnmc,bme->bne", w, v) if axis == "j" else torch.einsum("bnmc,bne->bme", w, v)
    else:
        raise ValueError(kind)
    return out if batched else out.squeeze(0)


TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-4)}


def _grads(out, inputs, weight, create_graph):
    if not out.requires_grad:  # nothing flows (piecewise-constant formulas): zero derivatives
        return [torch.zeros_like(x) for x in inputs]
    found = torch.autograd.grad((out * weight).sum(), inputs, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(found, inputs)]


def assert_sums_like(lazy: lt.LazyTensor, dense: torch.Tensor, inputs, axis: str = "j", order: int = 1, **options):
    """``lazy.sum(axis)`` against the dense (N, M, C) twin summed the same way: values and derivatives up to ``order``.

    Second order: the gradient of <first gradients, random directions>, i.e.
    Hessian-vector products through the streamed backward.
    """
    options = {"backend": "eager", "chunk_size": (3, 4), **options}
    out = lazy.sum(axis, **options)
    ref = dense.sum(1 if axis == "j" else 0)
    tol = TOLERANCE[ref.dtype]
    torch.testing.assert_close(out, ref, **tol)
    weight = torch.randn_like(ref)
    first_lazy = _grads(out, inputs, weight, order > 1)
    first_dense = _grads(ref, inputs, weight, order > 1)
    for a, b in zip(first_lazy, first_dense):
        torch.testing.assert_close(a, b, **tol)
    if order > 1:
        directions = [torch.randn_like(g) for g in first_dense]
        second_lazy = _grads(sum((g * v).sum() for g, v in zip(first_lazy, directions)), inputs, 1.0, False)
        second_dense = _grads(sum((g * v).sum() for g, v in zip(first_dense, directions)), inputs, 1.0, False)
        for a, b in zip(second_lazy, second_dense):
            torch.testing.assert_close(a, b, **tol)
