"""Min / max / argmin and k-min: reductions that select pairs.

Their values are the formula at the selected pairs, so their derivatives are
the formula's derivatives at those pairs only (``select_channels``,
``channels_at_selection``). Ties go to the lowest index, in values and in
order, as ``torch.argmin`` and KeOps do: within a tile the k-th value's ties
are taken in index order, and blocks are merged by a stable sort of the
running selection (lower indices) followed by the new block.
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import ir
from .base import Reduction, channels_at_selection, masked, select_channels


def _empty_axis(name: str, batch: int, rows: int, shape: tuple, dtype, device):
    if rows > 0:
        raise ValueError(f"{name}: cannot reduce over an empty axis (no entries to select from)")
    return torch.empty(batch, 0, *shape, dtype=dtype, device=device), torch.empty(batch, 0, *shape, dtype=torch.int64,
                                                                                  device=device)


class ArgMin(Reduction):
    """Running minimum and its first index; ``sign=-1`` gives max/argmax. NaN propagates like torch.min."""

    differentiable = (True, False)

    def __init__(self, expr: sympy.Expr, info: dict, sign: int = 1):
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.sign = sign
        self.name = "min_argmin" if sign == 1 else "max_argmax"
        self.expressions = [expr]
        self.signature = ("argmin", self.dim, sign)

    def partial(self, values, mask):
        return masked(values[0] * self.sign, mask, math.inf).min(2)

    def combine(self, state, partial, at):
        best, where = partial
        where = where + at
        if state is None:
            return best, where
        take = (best < state[0]) | (torch.isnan(best) & ~torch.isnan(state[0]))  # strict: earlier index wins ties
        return torch.where(take, best, state[0]), torch.where(take, where, state[1])

    def finalize(self, state, rows, batch):
        best, where = state
        shape = (batch, rows, self.dim)
        return (best * self.sign).expand(shape).contiguous(), where.expand(shape).contiguous()

    def empty(self, batch, rows, dtype, device):
        return _empty_axis(self.name, batch, rows, (self.dim,), dtype, device)

    def vjp(self, collector, outs, grads):
        select_channels(collector, self.expr, outs[1].unsqueeze(2), grads[0].unsqueeze(2))

    def jvp(self, collector, outs):
        pick = channels_at_selection(collector, self.expr, outs[1].unsqueeze(2))
        return lambda results: (pick(results).squeeze(2), None)


def _stable_smallest(f: torch.Tensor, k: int):
    """The k smallest of ``f`` along dim 2, ascending, lowest index first among ties (NaN last)."""
    kth = torch.topk(f, k, dim=2, largest=False, sorted=True).values[:, :, -1:]
    less = f < kth
    equal = (f == kth) | (torch.isnan(f) & torch.isnan(kth))
    need = k - less.sum(2, keepdim=True)
    chosen = less | (equal & (equal.cumsum(2) <= need))
    positions = torch.arange(f.shape[2], 0, -1, device=f.device).view(1, 1, -1, 1)
    where = torch.topk(torch.where(chosen, positions, 0), k, dim=2).indices  # chosen, in index order
    values, order = torch.sort(torch.gather(f, 2, where), dim=2, stable=True)
    return values, torch.gather(where, 2, order)


class KMin(Reduction):
    """The k smallest values and their indices per row, ascending; ties to the lowest index."""

    name = "kmin_argkmin"
    differentiable = (True, False)

    def __init__(self, expr: sympy.Expr, info: dict, k: int):
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.k = k
        self.expressions = [expr]
        self.signature = ("kmin", self.dim, k)

    def partial(self, values, mask):
        f = masked(values[0], mask, math.nan)  # NaN sorts after +inf: padding is never preferred
        f = f.expand(f.shape[0], f.shape[1], mask.shape[2], self.dim)
        return _stable_smallest(f, min(self.k, f.shape[2]))

    def combine(self, state, partial, at):
        best, where = partial
        where = where + at
        if state is not None:  # the running selection holds lower indices: a stable sort keeps them first
            best, where = torch.cat([state[0], best], 2), torch.cat([state[1], where], 2)
            best, order = torch.sort(best, dim=2, stable=True)
            best, where = best[:, :, : self.k], torch.gather(where, 2, order[:, :, : self.k])
        return best, where

    def finalize(self, state, rows, batch):
        best, where = state
        shape = (batch, rows, self.k, self.dim)
        return best.expand(shape).contiguous(), where.expand(shape).contiguous()

    def empty(self, batch, rows, dtype, device):
        return _empty_axis("kmin", batch, rows, (self.k, self.dim), dtype, device)

    def vjp(self, collector, outs, grads):
        select_channels(collector, self.expr, outs[1], grads[0])

    def jvp(self, collector, outs):
        pick = channels_at_selection(collector, self.expr, outs[1])
        return lambda results: (pick(results), None)
