"""Exact streamed quantiles by replay: counting passes, then selection.

A q-quantile of row i needs the order statistics of ranks floor(q (M-1)) and
ceil(q (M-1)) among the M values F_ij; sorting them needs the whole row. We
never hold it. Each value is mapped to an integer *key* that sorts exactly
like the float (IEEE-754 sign-magnitude turned into two's complement order),
and the rank is found radix-select style:

1. Counting passes. A bracket is the set of keys sharing a prefix. One
   streamed pass histograms each row's keys inside its bracket into
   2**BITS buckets by their next BITS bits; the bucket holding the wanted
   rank becomes the new bracket, and the counts before it move to ``below``.
   State per row and rank: prefix, shift, ``below`` - O(N x ranks).
2. Selection. Once every bracket holds at most ``CANDIDATES`` values (or is
   one key: a tie, every value in it equal), a last pass keeps the smallest
   ``CANDIDATES + 1`` in-bracket values per row with their indices, and the
   rank's value is position ``rank - below`` among them. The same pass keeps
   the smallest value above the bracket, so the next rank (torch.quantile's
   upper interpolation end) comes with it: only the lower ranks are searched.

Passes: float32 keys have 32 bits, so at most 3 counting passes (11 bits
each) plus the selection; float64 at most 6 + 1. Typical data stops early:
after one or two counting passes a bracket holds a handful of values. Each
pass costs one evaluation of the formula per pair plus a few integer ops and
a histogram update; memory is one tile plus O(rows x 2**BITS) counts per row
block. The result is interpolated exactly like ``torch.quantile`` (ranks in
the input dtype, ``torch.lerp``; a row containing NaN gives NaN), and its
gradient flows to the selected entries with the interpolation weights,
through the formula's VJP on those (row, index) pairs.
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import engine, ir
from ..opaque import tracing
from ..problem import Problem
from .base import Consumer, Reduction, channels_at_selection, is_nan, masked, maybe_padded, ordered_keys, padded, select_channels
from .selection import smallest

BITS = 11
BUCKETS = 1 << BITS
CANDIDATES = 64


def _by_target(t: torch.Tensor, channels: int) -> torch.Tensor:
    """A lowered i-variable (B, n, 1, R*C) as (B, n, R, C, 1)."""
    return t[:, :, 0].unflatten(-1, (-1, channels)).unsqueeze(-1)


class _PerTarget(Consumer):
    """A pass over the formula plus per-row, per-target (rank x channel) i-variables."""

    name: str
    size: int  # the pass's own constant (histogram bits, candidates kept): part of the kernel key
    reduced_axis = "j"
    # Few rows, many columns: a row block's per-row state (histograms of 2049 counts per target)
    # is merged once per tile, so wide tiles amortise it (N = M = 8192, 2 threads: 6.9 -> 1.55 s).
    tile_hint = (64, 8192)
    compares_values = True

    def __init__(self, expr, *per_row, channels: int, ranks: int):
        self.expressions = [expr, *per_row]
        self.channels, self.ranks = channels, ranks
        self.dim = channels * ranks
        self.signature = (self.name, channels, ranks, self.size)


class Histogram(_PerTarget):
    """Counts each row's in-bracket keys per bucket; finalize picks the rank's bucket.

    Slot 0 counts the keys below the bracket, slots 1..BUCKETS its buckets and
    the last slot the keys above it: one clamp places every key (padded
    columns are sent to slot 0), where a test of both bracket ends and a
    ``torch.where`` took four passes over the (rows, ranks, columns) tile, and
    ATen's CPU ``where`` is slow (eager, 64 x 8192 tiles of 3 ranks: 7 ms a tile).

    ``origin`` is each bracket's base minus one, in int64: the key's slot is
    one subtraction (into the scatter's index type) and a clamp. The
    ``first`` pass's bracket is every rank's (all keys), so one histogram per
    channel serves them all (a third of the scatter work for 3 ranks), and it
    alone of the counting passes looks for NaN: later passes evaluate the
    same values.
    """

    name, size = "quantile-histogram", BITS

    def __init__(self, expr, *per_row, channels: int, ranks: int, first: bool):
        super().__init__(expr, *per_row, channels=channels, ranks=ranks)
        self.first = first
        self.brackets = 1 if first else ranks
        self.signature = (*self.signature, first)

    def partial(self, values, mask):
        f, origin, need, shift = values
        f = masked(f, mask, 0.0)  # padding: a number (eager tiles have none)
        keys = ordered_keys(f).transpose(2, 3).unsqueeze(2)  # (B, n, 1, C, m)
        slot = ((keys >> shift) - _by_target(origin, self.channels)[:, :, : self.brackets]).clamp_(0, BUCKETS + 1)
        if maybe_padded(mask):
            slot = slot * (mask > 0).view(1, 1, 1, 1, -1)  # padded columns count below the bracket
        index = slot.flatten(2, 3)
        hist = torch.zeros(*index.shape[:3], BUCKETS + 2, dtype=torch.int64, device=f.device)
        hist = hist.scatter_add(3, index, torch.ones((), dtype=torch.int64, device=f.device).expand_as(index))
        return hist, need[:, :, 0], is_nan(f).any(2) if self.first else _none_nan(need, self.channels)

    def combine(self, state, partial, offset):
        if state is None:
            return partial
        return state[0] + partial[0], state[1], state[2] | partial[2]

    def merge_ranks(self, state, sharding):
        """Every rank's counts added (one all-reduce, not a gather of every rank's histograms)."""
        hist, need, nan = state
        return sharding.all_reduce(hist), need, sharding.all_reduce(nan, "max")

    def finalize(self, state, rows, batch):
        hist, need, nan = state
        targets = (*hist.shape[:2], self.ranks, self.channels, BUCKETS)
        counts = hist[..., 1:-1].unflatten(2, (self.brackets, self.channels)).expand(targets)
        cum = counts.cumsum(-1)
        bucket = (cum <= need.unflatten(2, (self.ranks, self.channels)).unsqueeze(-1)).sum(-1, keepdim=True)
        bucket = bucket.clamp_max(BUCKETS - 1)
        before = torch.where(bucket > 0, cum.gather(-1, (bucket - 1).clamp_min(0)), 0)
        inside = counts.gather(-1, bucket)
        shape = (batch, rows, self.ranks * self.channels)
        out = (t.flatten(2, 4).expand(shape).contiguous() for t in (bucket, before, inside))
        return (*out, nan.expand(batch, rows, self.channels).contiguous())


class Candidates(_PerTarget):
    """The smallest in-bracket values per row and rank, and the smallest value above the bracket.

    finalize takes position ``need`` (the rank) and the next order statistic
    (rank + 1: position ``need + 1`` while it is inside the bracket, else the
    smallest value above it), so one selection serves both interpolation ends.
    """

    name, size = "quantile-candidates", CANDIDATES

    def partial(self, values, mask):
        f, low, high, need = values
        # Laid out (B, n, R*C, m), columns innermost, so the comparisons with the per-row bounds vectorize
        # along them (laid out (B, n, m, R*C), ATen looped over 3 ranks at a time: the eager pass took 4.9 s
        # of a 3-rank quantile's 7.6 at 8192^2); the keys are taken once and broadcast over the ranks.
        f = masked(f, mask, math.nan).transpose(2, 3)
        if self.channels > 1 and self.ranks > 1:  # one channel broadcasts
            f = f.repeat(1, 1, self.ranks, 1)
        low, high = low.transpose(2, 3), high.transpose(2, 3)
        keys = ordered_keys(f)
        real = ~is_nan(f)
        inside = (keys >= low) & (keys <= high) & real
        if tracing():  # fixed shapes; NaN sorts last, so outsiders are never picked
            count = inside.sum(3)
            best, where = padded(*smallest(torch.where(inside, f, math.nan).transpose(2, 3),
                                           min(CANDIDATES + 1, f.shape[3])), CANDIDATES + 1)
        else:
            best, where, count = _first_in_bracket(f, inside)
        above_key, above_at = _least_selected(keys, (keys > high) & real)
        above = f.expand(*above_at.shape, f.shape[3]).gather(3, above_at.unsqueeze(3)).squeeze(3)
        above = torch.where(above_key == torch.iinfo(keys.dtype).max, math.inf, above)
        return best, where, count, above, above_at, need[:, :, 0], is_nan(masked(values[0], mask, 0.0)).any(2)

    def combine(self, state, partial, offset):
        best, where, count, above, above_at, need, nan = partial
        where, above_at = where + offset, above_at + offset
        if state is None:
            return best, where, count, above, above_at, need, nan
        best, where = torch.cat([state[0], best], 2), torch.cat([state[1], where], 2)
        best, pick = torch.sort(best, dim=2, stable=True)  # earlier columns first among ties
        best, pick = best[:, :, : CANDIDATES + 1], pick[:, :, : CANDIDATES + 1]
        lower = above < state[3]
        return (best, torch.gather(where, 2, pick), state[2] + count, torch.where(lower, above, state[3]),
                torch.where(lower, above_at, state[4]), need, state[6] | nan)

    def finalize(self, state, rows, batch):
        best, where, count, above, above_at, need, nan = state
        where = where.expand(*best.shape)
        shape = (batch, rows, self.ranks * self.channels)

        def at(position):
            pos = position.clamp(0, best.shape[2] - 1).unsqueeze(2).expand(best.shape[0], best.shape[1], 1, best.shape[3])
            return best.gather(2, pos).squeeze(2), where.gather(2, pos).squeeze(2)

        value, index = at(need)
        next_value, next_index = at(need + 1)
        beyond = need + 1 >= count  # rank + 1 lies above the bracket
        next_value, next_index = torch.where(beyond, above, next_value), torch.where(beyond, above_at, next_index)
        out = (t.expand(shape).contiguous() for t in (value, index, next_value, next_index))
        return (*out, nan.expand(batch, rows, self.channels).contiguous())


def _none_nan(need: torch.Tensor, channels: int) -> torch.Tensor:
    """No NaN flags (B, n, C) for a counting pass after the first: the first pass's flags hold for every pass.
    (The selection pass still looks: without that reduction, Inductor recomputed the formula in each of the
    candidates kernel's loops instead of storing it once, 4.9-6.2 -> 8.5 s a pass at 20000^2.)"""
    return torch.zeros_like(need[:, :, 0, :channels], dtype=torch.bool)


def _first_in_bracket(f: torch.Tensor, inside: torch.Tensor):
    """The first CANDIDATES + 1 in-bracket values of each row of ``f`` (B, n, T, m), sorted, with their columns:
    (B, n, CANDIDATES + 1, T), NaN past a row's count; and the counts (B, n, T).

    Eager tiles only: a bracket holds at most CANDIDATES values (or one repeated key), so the few in-bracket
    entries are gathered by ``nonzero`` (row-major: each row's in column order, so ties keep the lowest
    columns) instead of selecting the smallest of every column (a one-off script, eager, one 64 x 8192
    tile of 3 ranks, 1 thread: 9.6 ms for the selection, 2.8-4 ms for ``nonzero``)."""
    batch, n, targets, m = inside.shape
    slots = CANDIDATES + 1
    flat = inside.flatten().nonzero().squeeze(1)
    row = flat // m
    counts = torch.bincount(row, minlength=batch * n * targets)
    position = torch.arange(flat.numel(), device=f.device) - (counts.cumsum(0) - counts)[row]
    keep = position < slots
    row, column = row[keep], flat[keep] % m
    slot = row * slots + position[keep]
    best = f.new_full((batch * n * targets * slots,), math.nan)
    where = torch.zeros(best.shape, dtype=torch.int64, device=f.device)
    best[slot] = f.expand(inside.shape)[row // (n * targets), row // targets % n, row % targets, column]
    where[slot] = column
    best, pick = best.view(batch, n, targets, slots).sort(dim=3, stable=True)
    return best.transpose(2, 3), where.view(batch, n, targets, slots).gather(3, pick).transpose(2, 3), \
        counts.view(batch, n, targets)


def _least_selected(keys: torch.Tensor, selected: torch.Tensor):
    """The least of ``keys`` where ``selected`` along the last dim (the key type's maximum where none is), and
    its index: a ``torch.where`` written as bit operations, because ATen's CPU ``where`` branches per element
    and is slow on the random masks of the keys above a bracket (a one-off script, 64 x 8192 x 3, 1 thread:
    ``where`` and ``min`` 10.7 ms, these ops and ``min`` 4.4-4.8 ms)."""
    drop = selected.to(keys.dtype).sub_(1)  # 0 where selected, all bits set elsewhere
    return drop.bitwise_and_(keys ^ torch.iinfo(keys.dtype).max).bitwise_xor_(keys).min(-1)


def _with_variables(problem: Problem, extra: list[tuple[torch.Tensor, str]]):
    """The problem plus new variables (tensors after the formula's own)."""
    syms = [ir.new_variable_symbol() for _ in extra]
    return problem.extended({s: e for s, e in zip(syms, extra)}), syms


def select_ranks(expr: sympy.Expr, problem: Problem, ranks: torch.Tensor, *, backend="auto", chunk_size=None,
                 sharding=None):
    """Values and indices (B, N, 2R, C) of the order statistics of ranks r and then r + 1 over j, and NaN rows (B, N, C).

    (Rank M is out of range: its entries are +inf with an arbitrary index.)
    """
    channels = ir.feature_dim(expr, problem.info)
    batch, n, m = problem.batch, problem.size("i"), problem.size("j")
    nranks = ranks.numel()
    itype = torch.int32 if problem.dtype == torch.float32 else torch.int64
    nbits = torch.iinfo(itype).bits
    device = problem.device

    def per_target(t: torch.Tensor, dtype=itype) -> torch.Tensor:
        return t.to(dtype).reshape(batch, n, nranks * channels)

    rank = ranks.to(device).view(1, 1, -1, 1).expand(batch, n, nranks, channels)
    below = torch.zeros_like(rank)
    low = torch.full_like(rank, torch.iinfo(itype).min)
    high = torch.full_like(rank, torch.iinfo(itype).max)
    nan = torch.zeros(batch, n, channels, dtype=torch.bool, device=device)
    # The first pass buckets the top BITS bits of all keys (base -2**(BITS-1)).
    shift, base = nbits - BITS, torch.full_like(rank, -(1 << (BITS - 1)))
    count_max = m
    while count_max > CANDIDATES:
        passing, (vb, vn, vs) = _with_variables(
            problem, [(per_target(base - 1, torch.int64), "i"), (per_target(rank - below, torch.int64), "i"),
                      (torch.tensor([[shift]], dtype=itype, device=device), "p")]
        )
        consumer = Histogram(expr, vb, vn, vs, channels=channels, ranks=nranks, first=shift == nbits - BITS)
        ((bucket, before, inside, nan_pass),) = engine.stream(passing, [consumer], backend=backend, chunk_size=chunk_size,
                                                              sharding=sharding)
        unflat = lambda t: t.reshape(batch, n, nranks, channels)  # noqa: E731
        prefix = base + unflat(bucket)
        below = below + unflat(before)
        nan = nan | nan_pass
        low = prefix << shift
        high = low + ((1 << shift) - 1)
        counts = unflat(inside).masked_fill(nan.unsqueeze(2), 0)
        count_max = int(counts.max()) if shift > 0 else 0  # shift 0: a single key, all values equal
        next_shift = max(shift - BITS, 0)
        base, shift = prefix << (shift - next_shift), next_shift
    passing, (vl, vh, vn) = _with_variables(
        problem, [(per_target(low), "i"), (per_target(high), "i"), (per_target(rank - below, torch.int64), "i")]
    )
    consumer = Candidates(expr, vl, vh, vn, channels=channels, ranks=nranks)
    ((value, index, next_value, next_index, nan_pass),) = engine.stream(passing, [consumer], backend=backend,
                                                                       chunk_size=chunk_size, sharding=sharding)
    shape = (batch, n, nranks, channels)
    both = lambda a, b: torch.cat([a.reshape(shape), b.reshape(shape)], 2)  # noqa: E731
    return both(value, next_value), both(index, next_index), nan | nan_pass


def quantile_ranks(q, m: int, dtype: torch.dtype, device):
    """torch.quantile's ranks: q (M-1) in the input dtype, its floor, ceil and weight."""
    if isinstance(q, bool) or not isinstance(q, (int, float, torch.Tensor)):
        raise TypeError(f"q must be a float or a 1-D tensor of floats, got {type(q).__name__}")
    scalar = not isinstance(q, torch.Tensor) or q.dim() == 0
    qt = torch.as_tensor(q, device=device, dtype=None if isinstance(q, torch.Tensor) else dtype)
    if qt.dim() > 1:
        raise ValueError(f"q must be a float or a 1-D tensor, got a tensor of shape {tuple(qt.shape)}")
    if qt.numel() == 0:
        raise ValueError("q must not be empty")
    if isinstance(q, torch.Tensor) and not q.is_floating_point():
        raise TypeError(f"q must hold floats, got dtype {q.dtype}")
    qt = qt.to(dtype).reshape(-1)
    if torch.isnan(qt).any() or (qt < 0).any() or (qt > 1).any():
        raise ValueError(f"q values must be in the range [0, 1], got {qt.tolist()}")
    position = qt * (m - 1)
    lower = position.to(torch.int64)
    upper = position.ceil().to(torch.int64)
    return scalar, lower, upper, position - lower


class Quantile(Reduction):
    """The exact q-quantile over j by replay; outputs (value (B, N, Q, C), selected indices, NaN rows)."""

    name = "quantile"
    differentiable = (True, False, False)
    single_pass = False

    def __init__(self, expr: sympy.Expr, info: dict, q, m: int, dtype: torch.dtype, device):
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"quantile supports float32 and float64 formulas, got {dtype}")
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.expressions = [expr]
        self.scalar, lower, upper, weight = quantile_ranks(q, m, dtype, device)
        # upper is lower or lower + 1: select each distinct lower rank once, with its successor
        self.ranks, self.lo_at = torch.unique(lower, return_inverse=True)
        self.hi_at = self.lo_at + self.ranks.numel() * (upper > lower)
        self.weight = weight.view(1, 1, -1, 1)
        self.signature = ("quantile", self.dim, tuple(self.ranks.tolist()))

    def run(self, problem, backend, chunk_size, sharding=None):
        batch, n, q = problem.batch, problem.size("i"), self.weight.shape[2]
        if (problem.size("j") if sharding is None else sum(sharding.sizes(problem.size("j"), problem.device))) == 0:
            raise ValueError("quantile: cannot take a quantile over an empty axis")
        if n == 0:
            empty = lambda k, dtype: torch.empty(batch, 0, k, self.dim, dtype=dtype, device=problem.device)  # noqa: E731
            return empty(q, problem.dtype), empty(2 * self.ranks.numel(), torch.int64), \
                torch.empty(batch, 0, self.dim, dtype=torch.bool, device=problem.device)
        value, index, nan = select_ranks(self.expr, problem, self.ranks, backend=backend, chunk_size=chunk_size,
                                         sharding=sharding)
        out = torch.lerp(value[:, :, self.lo_at], value[:, :, self.hi_at], self.weight)
        return out.masked_fill(nan.unsqueeze(2), math.nan), index, nan

    def _selected(self, t: torch.Tensor) -> torch.Tensor:
        """Per-quantile cotangents (B, N, Q, C) onto the selected order statistics (B, N, 2R, C)."""
        shape = (*t.shape[:2], 2 * self.ranks.numel(), t.shape[3])
        low = torch.zeros(shape, dtype=t.dtype, device=t.device).index_add(2, self.lo_at, t * (1 - self.weight))
        return low.index_add(2, self.hi_at, t * self.weight)

    def vjp(self, collector, outs, grads):
        _, index, nan = outs
        select_channels(collector, self.expr, index, self._selected(grads[0].masked_fill(nan.unsqueeze(2), 0.0)))

    def jvp(self, collector, outs):
        _, index, nan = outs
        pick = channels_at_selection(collector, self.expr, index)

        def tangent(results):
            t = pick(results)
            out = torch.lerp(t[:, :, self.lo_at], t[:, :, self.hi_at], self.weight)
            return out.masked_fill(nan.unsqueeze(2), math.nan), None, None

        return tangent
