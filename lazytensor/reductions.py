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
    """Broadcast a lowered value to the full tile with padded positions filled.

    ``mask`` is the column mask (1, 1, m, 1) or the row mask (1, n, 1, 1), in the
    problem's dtype: 1 for real columns (rows), 0 for padding.
    """
    if not isinstance(t, torch.Tensor):  # a formula sympy folded to a constant
        t = mask.new_full((), t)
    return torch.where(mask > 0, t, fill)


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
    axis = "i"  # the result is indexed by the tile's rows; "j": by its columns (ColumnSum)

    def combine(self, state, partial, offset: int):
        raise NotImplementedError

    def finalize(self, state, rows: int, batch: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class Sum(Consumer):
    """sum_j F, written as sum of A_i * (S_ij @ W_j) terms when F allows it.

    Terms whose mixed part S is the same expression share one matrix product:
    their W columns are stacked (a column of ones for a bare row sum), so e.g.
    the gradient terms x_i rowsum(c) - c @ y read the tile c once, not twice.
    """

    reduced = 2  # the tile dimension summed over (columns)

    def __init__(self, expr: sympy.Expr, info: dict, dim: int | None = None):
        # ``dim`` widens a feature-size-1 result (e.g. the gradient of x.sum(-1) w.r.t. x)
        self.dim = dim or ir.feature_dim(expr, info)
        self.terms = []  # (kind, index of the shared S or None) per term
        self.expressions = []
        shared: dict[sympy.Expr, int] = {}
        for a, s, w in ir.sum_terms(expr, info):
            if s != 1 and ir.feature_dim(s, info) > 1:  # a vector-valued mixed part: sum the tile
                self.terms.append(("tile", None))
                self.expressions.append(a * s * w)
            else:
                group = shared.setdefault(s, len(shared)) if s != 1 else None
                self.terms.append((("s" if s != 1 else "") + ("w" if w != 1 else ""), group))
                self.expressions.extend([a, s, w])
        self.signature = ("sum", self.dim, tuple(self.terms))

    # The tile's sides: Sum keeps rows and sums columns; ColumnSum the reverse.
    @staticmethod
    def _masked(t, mask):
        return _cols(t, mask, 0.0)

    @staticmethod
    def _kept(t):
        return _rows(t)

    @staticmethod
    def _summed_side(w):
        return w[:, 0]  # a j-side (B, 1, m, D) value as (B, m, D)

    @staticmethod
    def _matrix(s):
        return s[..., 0]  # (B, kept, summed)

    def _products(self, terms, mask) -> dict[int, list]:
        """Each shared S times its stacked W columns, split back per term."""
        stacks: dict[int, tuple] = {}  # group -> (S as a matrix, W column blocks)
        for (kind, group), parts in terms:
            if group is None:  # "tile" terms and terms without a mixed part
                continue
            _, s, w = parts
            if group not in stacks:
                stacks[group] = (self._matrix(self._masked(s, mask)), [])
            stacks[group][1].append(self._summed_side(w) if "w" in kind else None)
        products = {}
        for group, (matrix, columns) in stacks.items():
            columns = [matrix.new_ones(1, matrix.shape[-1], 1) if c is None else c for c in columns]
            batch = max([matrix.shape[0]] + [c.shape[0] for c in columns])
            stacked = torch.cat([c.expand(batch, *c.shape[1:]) for c in columns], -1)
            products[group] = list(torch.matmul(matrix, stacked).split([c.shape[-1] for c in columns], -1))
        return products

    def partial(self, values, mask):
        values = list(values)
        terms, at = [], 0
        for kind, group in self.terms:
            width = 1 if kind == "tile" else 3
            terms.append(((kind, group), values[at : at + width]))
            at += width
        products = self._products(terms, mask)
        total = 0.0
        for (kind, group), parts in terms:
            if kind == "tile":
                total = total + self._masked(parts[0], mask).sum(self.reduced)
                continue
            a, _, w = parts
            if group is not None:
                r = products[group].pop(0)
            elif "w" in kind:
                r = self._masked(w, mask).sum(self.reduced)
            else:
                r = mask.sum(self.reduced) * w
            total = total + self._kept(a) * r
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
    reduced = 1

    def __init__(self, expr: sympy.Expr, info: dict, dim: int | None = None):
        flip = {"i": "j", "j": "i", "p": "p"}
        super().__init__(expr, {s: ir.VarInfo(flip[v.axis], v.dim) for s, v in info.items()}, dim)
        self.signature = ("colsum",) + self.signature[1:]

    @staticmethod
    def _masked(t, rowmask):
        return _cols(t, rowmask, 0.0)

    @staticmethod
    def _kept(t):
        return _column_side(t)

    @staticmethod
    def _summed_side(w):
        return w[:, :, 0]  # an i-side (B, n, 1, D) value as (B, n, D)

    @staticmethod
    def _matrix(s):
        return s[..., 0].transpose(1, 2)  # (B, m, n)

    def combine(self, state, partial, offset: slice):
        """``offset`` is the column block's slice; ``state`` spans every column."""
        columns = state[0][:, offset]
        columns += partial[0][:, : columns.shape[1]].expand_as(columns)  # (B, 1, D) when F is i-only
        return state

    def initial_state(self, batch: int, columns: int, dtype: torch.dtype, device) -> tuple:
        return (torch.zeros(batch, columns, self.dim, dtype=dtype, device=device),)

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
