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
