"""Min / max / argmin and k-min: reductions that select pairs.

Their values are the formula at the selected pairs, so their derivatives are
the formula's derivatives at those pairs only (``select_channels``,
``channels_at_selection``). Ties go to the lowest index, in values and in
order, as ``torch.argmin`` and KeOps do.

k-min selects within a tile in two stages (inside the compiled tile
function): the minimum of each group of ``GROUP`` consecutive columns (one
vectorized pass over the tile, fused with the formula), the k groups with the
smallest minima (ties to the lower group), then a stable sort of those k
groups' entries in column order. The k smallest entries always lie in those
groups: an entry outside them is preceded, in (value, column) order, by the
minima of k groups. The chosen groups' entries are recomputed from the points
(``reads_pairs``), so the tile itself is never stored. Selections compare
direct differences at any D (``compares_values``): the norm expansion would
round exactly tied distances apart.
Blocks are merged by a stable sort of the running selection (earlier columns)
followed by the new block.
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import ir
from ..opaque import tracing
from .base import Reduction, channels_at_selection, is_nan, masked, padded, select_channels


def _empty_axis(name: str, batch: int, rows: int, shape: tuple, dtype, device):
    if rows > 0:
        raise ValueError(f"{name}: cannot reduce over an empty axis (no entries to select from)")
    return _nothing(batch, rows, shape, math.inf, dtype, device)


def _nothing(batch: int, rows: int, shape: tuple, value: float, dtype, device):
    """A selection over the empty set: ``value`` (+inf for a minimum, -inf for a maximum) at index 0, as KeOps
    (whose running selection starts there) and the dense argmin of a row masked to +inf give."""
    return (torch.full((batch, rows, *shape), value, dtype=dtype, device=device),
            torch.zeros(batch, rows, *shape, dtype=torch.int64, device=device))


def reader(at, mask: torch.Tensor, padding: float):
    """``read(columns)``: the formula recomputed at pairs (i, columns[i, s, c]), channel c; padding -> ``padding``.

    ``at`` is the tile function's pair evaluator (``reads_pairs``); columns
    are (B, n, S, C) positions in the tile.
    """
    def read(columns):
        batch, rows, picks, channels = columns.shape
        v = at(columns.flatten(2))[0]
        v = (v if isinstance(v, torch.Tensor) else mask.new_full((), v)).expand(batch, rows, picks * channels, channels)
        own = torch.arange(channels, device=columns.device).view(1, 1, 1, channels, 1)  # (not diagonal: Inductor warns)
        v = torch.gather(v.unflatten(2, (picks, channels)), 4, own.expand(batch, rows, picks, channels, 1))
        return masked(v.squeeze(4), mask.view(-1)[columns], padding)

    return read


class ArgMin(Reduction):
    """Running minimum and its first index. NaN propagates like torch.min."""

    name = "min_argmin"
    sign = 1  # the values are minimised times ``sign`` (ArgMax: -1)
    differentiable = (True, False)
    tile_hint = (256, 8192)  # wide tiles, fewer merges (min_argmin, N = M = 16384, 2 threads: 0.080 s at 256 x 4096, 0.062 s)
    reads_pairs = True  # the best group's entries are recomputed, so the tile is never stored
    compares_values = True

    def __init__(self, expr: sympy.Expr, info: dict):
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.expressions = [expr]
        self.signature = ("argmin", self.dim, self.sign)

    def partial(self, values, mask, at):
        """The minimum of each group of GROUP columns, then the best group's entries recomputed.

        The first group holding the row's minimum (NaN included, as torch.min)
        holds its first position, so ties and NaN resolve as one ``min`` would.
        """
        f = masked(values[0] if self.sign == 1 else -values[0], mask, math.inf)
        m = f.shape[2]
        if m % GROUP:
            return f.min(2)
        best_group = f.unflatten(2, (m // GROUP, GROUP)).amin(3).argmin(2, keepdim=True)  # (B, n, 1, C)
        columns = (best_group * GROUP + torch.arange(GROUP, device=f.device).view(1, 1, GROUP, 1)).expand(
            *f.shape[:2], GROUP, f.shape[3])
        read = reader(at, mask, self.sign * math.inf)  # padding: inf once signed
        best, where = (read(columns) * self.sign).min(2)
        return best, torch.gather(columns, 2, where.unsqueeze(2)).squeeze(2)

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

    def nothing(self, batch, rows, dtype, device):
        return _nothing(batch, rows, (self.dim,), self.sign * math.inf, dtype, device)

    def vjp(self, collector, outs, grads):
        select_channels(collector, self.expr, outs[1].unsqueeze(2), grads[0].unsqueeze(2))

    def jvp(self, collector, outs):
        pick = channels_at_selection(collector, self.expr, outs[1].unsqueeze(2))
        return lambda results: (pick(results).squeeze(2), None)


class ArgMax(ArgMin):
    """Running maximum and its first index: the minimum of the negated values, negated back."""

    name = "max_argmax"
    sign = -1


GROUP = 32


def _stable_smallest(f: torch.Tensor, k: int):
    """The k smallest of ``f`` along dim 2, ascending, lowest index first among ties (NaN last)."""
    kth = torch.topk(f, k, dim=2, largest=False, sorted=True).values[:, :, -1:]
    nan, nan_kth = is_nan(f), is_nan(kth)
    less = (f < kth) | (~nan & nan_kth)  # NaN ranks above every number
    equal = (f == kth) | (nan & nan_kth)
    need = k - less.sum(2, keepdim=True)
    chosen = less | (equal & (equal.cumsum(2) <= need))
    positions = torch.arange(f.shape[2], 0, -1, device=f.device).view(1, 1, -1, 1)
    where = torch.topk(torch.where(chosen, positions, 0), k, dim=2).indices  # chosen, in index order
    values, order = torch.sort(torch.gather(f, 2, where), dim=2, stable=True)
    return values, torch.gather(where, 2, order)


def _first_k(values: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the k smallest (value, position) pairs along dim 2, ascending.

    ``positions`` ascend along dim 2. For float32 one exact topk: a value's
    ordered 32-bit key and its 32-bit position make one int64 key, unique and
    ordered like the pair, NaN above +inf; otherwise a stable sort.
    """
    if values.dtype != torch.float32:
        return torch.gather(positions, 2, torch.sort(values, dim=2, stable=True).indices[:, :, :k])
    bits = torch.where(is_nan(values), math.nan, values).view(torch.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) << 32 | positions
    return torch.topk(keys, k, dim=2, largest=False).values & 0xFFFFFFFF


def _nan_as_inf(f: torch.Tensor) -> torch.Tensor:
    """f with NaN as +inf. Eager, ATen's ``fmin`` against a 0-dim tensor runs a scalar loop (4.2 ms on a
    128 x 16384 tile, ``nan_to_num`` 0.7 ms: a fifth of an eager k-min pass); compiled, ``fmin`` is one
    fused op, which keeps the group minima's loads few (``KMin.compile_options``)."""
    if tracing():
        return torch.fmin(f, f.new_full((), math.inf))
    return torch.nan_to_num(f, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def smallest(f: torch.Tensor, k: int, read=None):
    """``_stable_smallest`` through the k best groups of GROUP columns (see the module docstring).

    ``read(columns)`` gives f at ``columns`` (B, n, S, C) of each row; by default
    they are gathered from ``f``, which must then be stored. A reader that
    recomputes them lets the tile's formula fuse with the group minima.
    """
    m = f.shape[2]
    if m % GROUP or m // GROUP <= k:
        return _stable_smallest(f, k)
    read = read or (lambda columns: torch.gather(f, 2, columns))
    groups = _nan_as_inf(f).unflatten(2, (m // GROUP, GROUP))  # (B, n, G, GROUP, C)
    lows = groups.amin(3)
    group_ids = torch.arange(lows.shape[2], device=f.device).view(1, 1, -1, 1).expand_as(lows)
    first = _first_k(lows, group_ids, k).sort(2).values * GROUP  # the best groups in column order
    columns = (first.unsqueeze(3) + torch.arange(GROUP, device=f.device).view(1, 1, 1, GROUP, 1)).flatten(2, 3)
    chosen = _first_k(read(columns), columns, k)
    return read(chosen), chosen


class KMin(Reduction):
    """The k smallest values and their indices per row, ascending; ties to the lowest index."""

    name = "kmin_argkmin"
    differentiable = (True, False)
    # Wide tiles: each tile selects from its best groups, so fewer tiles per row mean less selection work
    # (N = M = 16384, 2 threads: 0.33 s at 256 x 4096, 0.19 s at 128 x 16384).
    tile_hint = (128, 16384)
    reads_pairs = True  # the selected entries are recomputed, so the tile is never stored
    compares_values = True
    # Inductor stores a pointwise value read by two ops when it has more than 4 loads (the NaN test
    # reads the formula twice): raised, the formula is fused into the group minima instead (CSE
    # computes it once; exp/log and large formulas are still stored by Inductor's own rules).
    # N = M = 16384: compiled tile 0.07-0.14 s -> 0.058 s.
    compile_options = {"realize_reads_threshold": 64}

    def __init__(self, expr: sympy.Expr, info: dict, k: int):
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.k = k
        self.expressions = [expr]
        self.signature = ("kmin", self.dim, k)

    def partial(self, values, mask, at):
        f = masked(values[0], mask, math.nan)  # NaN sorts after +inf: padding is never preferred
        f = f.expand(f.shape[0], f.shape[1], mask.shape[2], self.dim)
        return padded(*smallest(f, min(self.k, f.shape[2]), reader(at, mask, math.nan)), self.k)

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

    def nothing(self, batch, rows, dtype, device):
        return _nothing(batch, rows, (self.k, self.dim), math.inf, dtype, device)

    def unkept(self, kept, out):
        """The slots past a row's kept pairs (all k of a row that keeps none): the tile pass leaves its NaN padding there."""
        return (torch.arange(self.k, device=kept.device) >= kept[:, None]).view(1, len(kept), self.k, 1)

    def vjp(self, collector, outs, grads):
        select_channels(collector, self.expr, outs[1], grads[0])

    def jvp(self, collector, outs):
        pick = channels_at_selection(collector, self.expr, outs[1])
        return lambda results: (pick(results), None)
