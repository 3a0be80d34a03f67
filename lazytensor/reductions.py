"""Consumers: fold the tiles of one row block into O(rows) state.

A consumer names the IR expressions it needs on each tile (``expressions``),
reduces one tile to a small partial inside the compiled tile function
(``partial``: traced, so it must depend only on ``signature``), merges
partials across column blocks in Python (``combine``) and returns the row
block's results (``finalize``). Every consumer reduces over the tile's column
axis (dim 2 of a (B, n, m, C) tile); reducing over i swaps the roles of the
variables before lowering, so one mechanism serves both axes.

The column mask (1, 1, m, 1) marks padded columns of ragged tiles; each
consumer fills them with its reduction's neutral element.
"""
from __future__ import annotations

import math

import sympy
import torch

from . import ir


def _cols(t: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """Broadcast a lowered value to the full tile with padded columns filled.

    ``mask`` is (1, 1, m, 1) in the problem's dtype: 1 for real columns, 0 for padding.
    """
    if not isinstance(t, torch.Tensor):  # a formula sympy folded to a constant
        t = mask.new_full((), t)
    return torch.where(mask > 0, t, fill)


def _rows_masked(t, rowmask: torch.Tensor) -> torch.Tensor:
    """A lowered value with padded rows of the tile zeroed (column sums)."""
    if not isinstance(t, torch.Tensor):
        t = rowmask.new_full((), t)
    return torch.where(rowmask > 0, t, 0.0)


def _column_side(t):
    """A j-side value (B, 1, m, C) as (B, m, C); constants and parameters pass through."""
    if isinstance(t, torch.Tensor) and t.dim() == 4:
        return t[:, 0]
    return t


def _rows(t):
    """An i-side value (B, n, 1, C) as (B, n, C); constants and parameters pass through."""
    if isinstance(t, torch.Tensor) and t.dim() == 4:
        return t[:, :, 0]
    return t


class Consumer:
    expressions: list[sympy.Expr]
    signature: tuple

    def combine(self, state, partial, offset: int):
        raise NotImplementedError

    def finalize(self, state, rows: int, batch: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class Sum(Consumer):
    """sum_j F, written as sum of A_i * (S_ij @ W_j) terms when F allows it."""

    def __init__(self, expr: sympy.Expr, info: dict, dim: int | None = None):
        # ``dim`` widens a feature-size-1 result (e.g. the gradient of x.sum(-1) w.r.t. x)
        self.dim = dim or ir.feature_dim(expr, info)
        self.terms = []  # (kind, has A, has S, has W) per term
        self.expressions = []
        for a, s, w in ir.sum_terms(expr, info):
            if s != 1 and ir.feature_dim(s, info) > 1:  # a vector-valued mixed part: sum the tile
                self.terms.append("tile")
                self.expressions.append(a * s * w)
            else:
                self.terms.append(("s" if s != 1 else "") + ("w" if w != 1 else ""))
                self.expressions.extend([a, s, w])
        self.signature = ("sum", self.dim, tuple(self.terms))

    def partial(self, values, mask):
        total = 0.0
        values = iter(values)
        for kind in self.terms:
            if kind == "tile":
                total = total + _cols(next(values), mask, 0.0).sum(2)
                continue
            a, s, w = next(values), next(values), next(values)
            if "s" in kind:
                s = _cols(s, mask, 0.0)[..., 0]
                r = torch.matmul(s, w[:, 0]) if "w" in kind else s.sum(-1, keepdim=True) * w
            elif "w" in kind:
                r = _cols(w, mask, 0.0).sum(2)
            else:
                r = mask.sum(2) * w
            total = total + _rows(a) * r
        return (total,)

    def combine(self, state, partial, offset):
        return partial if state is None else (state[0] + partial[0],)

    def finalize(self, state, rows, batch):
        return (state[0].expand(batch, rows, self.dim).contiguous(),)


class ColumnSum(Sum):
    """sum_i F for every j, folded in the same pass as row reductions (``axis = "j"``).

    A backward pass needs sums over j (gradients of i-variables) and over i
    (gradients of j-variables) of formulas sharing the kernel values; one pass
    with both kinds of consumer evaluates each tile once instead of twice.
    Terms are split as sum_i F = A_j * (S^T @ W_i) (``sum_terms`` on the
    flipped axes). Its state is the whole (B, M, D) result, written per column
    block; padded rows of ragged tiles are masked by ``rowmask`` (1, n, 1, 1).
    """

    axis = "j"

    def __init__(self, expr: sympy.Expr, info: dict, dim: int | None = None):
        flip = {"i": "j", "j": "i", "p": "p"}
        super().__init__(expr, {s: ir.VarInfo(flip[v.axis], v.dim) for s, v in info.items()}, dim)
        self.signature = ("colsum",) + self.signature[1:]

    def partial(self, values, rowmask):
        total = 0.0
        values = iter(values)
        for kind in self.terms:
            if kind == "tile":
                total = total + _rows_masked(next(values), rowmask).sum(1)
                continue
            a, s, w = next(values), next(values), next(values)
            if "s" in kind:
                s = _rows_masked(s, rowmask)[..., 0].transpose(1, 2)  # (B, m, n)
                r = torch.matmul(s, w[:, :, 0]) if "w" in kind else s.sum(-1, keepdim=True) * w
            elif "w" in kind:
                r = _rows_masked(w, rowmask).sum(1)
            else:
                r = rowmask.sum(1) * w
            total = total + _column_side(a) * r
        return (total,)

    def combine(self, state, partial, offset: slice):
        """``offset`` is the column block's slice; ``state`` spans every column."""
        columns = state[0][:, offset]
        columns += partial[0][:, : columns.shape[1]].expand_as(columns)  # (B, 1, D) when F is i-only
        return state

    def initial_state(self, batch: int, columns: int, like: torch.Tensor):
        return (torch.zeros(batch, columns, self.dim, dtype=like.dtype, device=like.device),)

    def finalize(self, state, rows, batch):
        return state


class LogSumExp(Consumer):
    """log sum_j exp F, max-shifted so no tile overflows."""

    def __init__(self, expr: sympy.Expr, info: dict):
        self.dim = ir.feature_dim(expr, info)
        self.expressions = [expr]
        self.signature = ("lse", self.dim)

    def partial(self, values, mask):
        f = _cols(values[0], mask, -math.inf)
        top = f.amax(2, keepdim=True)
        shift = torch.where(torch.isfinite(top), top, 0.0)
        return top[:, :, 0], torch.exp(f - shift).sum(2)

    def combine(self, state, partial, offset):
        if state is None:
            return partial
        (m0, s0), (m1, s1) = state, partial
        top = torch.maximum(m0, m1)
        ref = torch.where(torch.isfinite(top), top, 0.0)
        m0f = torch.where(torch.isfinite(m0), m0, ref)
        m1f = torch.where(torch.isfinite(m1), m1, ref)
        return top, s0 * torch.exp(m0f - ref) + s1 * torch.exp(m1f - ref)

    @staticmethod
    def _lse(top, total):
        shift = torch.where(torch.isfinite(top), top, 0.0)
        return torch.log(total) + shift

    def finalize(self, state, rows, batch):
        return (self._lse(*state).expand(batch, rows, self.dim).contiguous(),)


class SoftmaxWeightedSum(LogSumExp):
    """sum_j softmax_j(F) V_j with an online (rescaled) softmax; also returns the lse."""

    def __init__(self, expr: sympy.Expr, values: sympy.Expr, info: dict):
        if ir.feature_dim(expr, info) != 1:
            raise ValueError("softmax_weighted_sum: the formula must have feature size 1")
        self.dim = ir.feature_dim(values, info)
        self.expressions = [expr, values]
        self.signature = ("softmax", self.dim)

    def partial(self, values, mask):
        f = _cols(values[0], mask, -math.inf)
        top = f.amax(2, keepdim=True)
        shift = torch.where(torch.isfinite(top), top, 0.0)
        p = torch.exp(f - shift)[..., 0]  # (B, n, m)
        v = values[1]
        weighted = torch.matmul(p, v[:, 0]) if v.dim() == 4 and v.shape[1] == 1 else (p[..., None] * _cols(v, mask, 0.0)).sum(2)
        return top[:, :, 0], p.sum(-1, keepdim=True), weighted

    def combine(self, state, partial, offset):
        if state is None:
            return partial
        (m0, s0, w0), (m1, s1, w1) = state, partial
        top = torch.maximum(m0, m1)
        ref = torch.where(torch.isfinite(top), top, 0.0)
        a0 = torch.exp(torch.where(torch.isfinite(m0), m0, ref) - ref) * torch.isfinite(m0)
        a1 = torch.exp(torch.where(torch.isfinite(m1), m1, ref) - ref) * torch.isfinite(m1)
        return top, s0 * a0 + s1 * a1, w0 * a0 + w1 * a1

    def finalize(self, state, rows, batch):
        top, total, weighted = state
        out = (weighted / total).expand(batch, rows, self.dim).contiguous()
        return out, self._lse(top, total).expand(batch, rows, 1).contiguous()


class ArgMin(Consumer):
    """Running minimum and its first index; ``sign=-1`` gives max/argmax."""

    def __init__(self, expr: sympy.Expr, info: dict, sign: int = 1):
        self.dim = ir.feature_dim(expr, info)
        self.sign = sign
        self.expressions = [expr]
        self.signature = ("argmin", self.dim, sign)

    def partial(self, values, mask):
        f = _cols(values[0] * self.sign, mask, math.inf)
        best, where = f.min(2)
        return best, where

    def combine(self, state, partial, offset):
        best, where = partial
        where = where + offset
        if state is None:
            return best, where
        take = best < state[0]  # strict: the earlier index wins ties
        return torch.where(take, best, state[0]), torch.where(take, where, state[1])

    def finalize(self, state, rows, batch):
        best, where = state
        return (best * self.sign).expand(batch, rows, self.dim).contiguous(), where.expand(batch, rows, self.dim).contiguous()


class KMin(Consumer):
    """The k smallest values and their indices per row, sorted ascending."""

    def __init__(self, expr: sympy.Expr, info: dict, k: int):
        self.dim = ir.feature_dim(expr, info)
        self.k = k
        self.expressions = [expr]
        self.signature = ("kmin", self.dim, k)

    def partial(self, values, mask):
        f = _cols(values[0], mask, math.nan)  # NaN sorts after +inf: padding is never preferred
        f = f.expand(f.shape[0], f.shape[1], mask.shape[2], self.dim)
        best, where = torch.topk(f, min(self.k, f.shape[2]), dim=2, largest=False, sorted=True)
        return best, where

    def combine(self, state, partial, offset):
        best, where = partial
        where = where + offset
        if state is not None:
            best = torch.cat([state[0], best], 2)
            where = torch.cat([state[1], where], 2)
        if best.shape[2] > self.k or state is not None:
            best, pick = torch.topk(best, min(self.k, best.shape[2]), dim=2, largest=False, sorted=True)
            where = torch.gather(where, 2, pick)
        return best, where

    def finalize(self, state, rows, batch):
        best, where = state
        shape = (batch, rows, self.k, self.dim)
        return best.expand(shape).contiguous(), where.expand(shape).contiguous()
