"""What every reduction is: a consumer of tiles, a set of outputs, and its derivatives.

A *consumer* names the IR expressions it needs on each tile
(``expressions``), reduces one tile to a small partial inside the compiled
tile function (``partial``: traced, so it must depend only on
``signature``), merges partials across blocks (``combine``) and returns the
block's results (``finalize``). A consumer that ``folds`` has its merge
traced too: the tile function takes its running row state (from
``row_state`` before the first tile) and returns the merged one, so the
merge runs inside the compiled kernel, not as small Python ops per tile. Reductions over j fold the
columns of a (B, n, m, C) tile into per-row state, starting from their first
tile's partial; a sum over i (``reduced_axis = "i"``) folds rows into state
that spans every column, from its ``initial_state``. Under a sharding
(``lazytensor.distributed``) ``merge_ranks`` folds every rank's state of a
row block into one: by ``combine`` in rank order unless the consumer knows a
cheaper collective.

A *reduction* is a consumer that also knows its outputs (which are
differentiable) and how to differentiate them, in both modes, as more
streamed work: ``vjp`` hands a collector either cotangents on the tile
values (run as one streamed pass of sums) or cotangents on selected pairs
(min, k-min, quantile); ``jvp`` asks the collector for sums or selected
values of the formula's tangent. The autograd function in ``autograd.py``
works over a list of reductions and never looks inside one.
"""
from __future__ import annotations

import math

import sympy
import torch

from ..opaque import tracing


def masked(t, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """A lowered value broadcast to the tile with padded positions set to ``fill``.

    ``mask`` is the column mask (1, 1, m, 1) or the row mask (1, n, 1, 1), in
    the problem's dtype: 1 for real columns (rows), 0 for padding.
    """
    if not isinstance(t, torch.Tensor):  # a formula sympy folded to a constant
        t = mask.new_full((), t)
    elif _covers(t.shape, mask.shape) and not maybe_padded(mask):
        return t  # an eager tile without padding: nothing to mask, and a pass over the tile saved
    return torch.where(mask > 0, t, fill)


def maybe_padded(mask: torch.Tensor) -> bool:
    """Whether a tile may have padded positions: always when compiled (one kernel serves every
    tile), else unless ``mask`` is all ones, as the engine marked it (``engine._valid``) or the tensor says."""
    if tracing():
        return True
    known = getattr(mask, "unpadded", None)
    return not (bool(mask.all()) if known is None else known)


def _covers(shape: torch.Size, mask: torch.Size) -> bool:
    """Whether ``shape`` is already the broadcast of itself and ``mask`` (``torch.broadcast_shapes`` costs ~50 us)."""
    return len(shape) >= len(mask) and all(m in (1, s) for s, m in zip(shape[len(shape) - len(mask):], mask))


def is_nan(t: torch.Tensor) -> torch.Tensor:
    """``torch.isnan`` as a comparison: Inductor's CPU code vectorizes ``t != t``, not ``isnan`` (a scalar loop)."""
    return t != t


def row_side(t):
    """An i-side value (B, n, 1, C) as (B, n, C); constants pass through."""
    return t[:, :, 0] if isinstance(t, torch.Tensor) and t.dim() == 4 else t


def column_side(t):
    """A j-side value (B, 1, m, C) as (B, m, C); constants pass through."""
    return t[:, 0] if isinstance(t, torch.Tensor) and t.dim() == 4 else t


def ordered_keys(f: torch.Tensor) -> torch.Tensor:
    """Integers ordered like the floats ``f`` (negatives: magnitude bits flipped; positive NaN above +inf).

    """
    itype, top = (torch.int32, 31) if f.dtype == torch.float32 else (torch.int64, 63)
    bits = f.view(itype)  # same element size: any strides
    return bits ^ ((bits >> top) & ((1 << top) - 1))


def padded(values: torch.Tensor, where: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A selection of fewer than k entries (a tile narrower than k) padded to k along dim 2 with NaN.

    NaN sorts after every real value, so padding is never preferred; fixed
    shapes let states of different tiles (and ranks) merge.
    """
    short = k - values.shape[2]
    if short <= 0:
        return values, where
    shape = (*values.shape[:2], short, *values.shape[3:])
    return torch.cat([values, values.new_full(shape, math.nan)], 2), torch.cat([where, where.new_zeros(shape)], 2)


class Consumer:
    """Folds tiles into state; see the module docstring."""

    reduced_axis = "j"
    expressions: list[sympy.Expr]
    signature: tuple
    dim: int  # channels of the widest output (sizes the tile budget)
    tile_hint: tuple[int, int] | None = None  # (rows, cols) measured best on CPU, where the pair budget is not
    reads_pairs = False  # True: ``partial`` also gets ``at(columns)``, the expressions at chosen pairs (lower.py)
    compile_options: dict = {}  # Inductor options for kernels that run this consumer (torch.compile(options=))
    folds = False  # True: ``combine(state, partial, 0)`` runs in the tile function, from ``row_state``
    # True for selections (min, k-min, quantile passes): ties decide the answer, so contractions are
    # direct differences, where equal points give equal values (the norm expansion rounds them apart).
    compares_values = False

    @property
    def tile_masks(self) -> str:
        """The masks ``partial`` takes after the values: the reduced axis's (rows over i, columns over j)."""
        return "rowmask" if self.reduced_axis == "i" else "mask"

    def partial(self, values, mask):
        raise NotImplementedError

    def combine(self, state, partial, at):
        raise NotImplementedError

    def finalize(self, state, rows: int, batch: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def row_state(self, batch: int, rows: int, dtype: torch.dtype, device) -> tuple:
        """A folding reduction's state of ``rows`` rows before any tile (merging a tile into it gives the tile's partial)."""
        raise NotImplementedError(f"{type(self).__name__} does not fold: its state starts from its first tile's partial")

    def initial_state(self, batch: int, columns: int, dtype: torch.dtype, device) -> tuple:
        """A sum over i's state before any tile: zeros spanning every column (only ``reduced_axis = "i"`` has one)."""
        raise NotImplementedError(f"{type(self).__name__} reduces over j: its state starts from its first tile's partial")

    def merge_ranks(self, state: tuple, sharding) -> tuple:
        """Every rank's ``state`` folded into one in rank order by ``combine`` (indices are already global)."""
        gathered = [sharding.gather(t) for t in state]
        merged = tuple(g[0] for g in gathered)
        for r in range(1, sharding.size):
            merged = self.combine(merged, tuple(g[r] for g in gathered), 0)
        return merged

    def empty(self, batch: int, rows: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """The outputs when the kept axis (``rows``) or the reduced axis is empty."""
        raise NotImplementedError

    def nothing(self, batch: int, rows: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """The outputs of ``rows`` rows that reduce over the empty set (block-sparse rows that keep no pair).

        ``empty``'s values; selections, which refuse a whole empty axis as torch does, override it.
        """
        return self.empty(batch, rows, dtype, device)


class Reduction(Consumer):
    """A consumer with differentiable outputs; see the module docstring."""

    name: str
    differentiable: tuple[bool, ...]  # one flag per output
    single_pass = True  # False: ``run`` makes several passes (quantile)

    def run(self, problem, backend, chunk_size, sharding=None) -> tuple[torch.Tensor, ...]:
        """The outputs of a multi-pass reduction (single-pass ones share ``engine.stream``)."""
        raise NotImplementedError

    def over_nothing(self, outs: tuple, kept: torch.Tensor) -> tuple:
        """``outs`` with the entries over no pair set to their value over the empty set (``nothing``).

        ``kept`` (N,) counts each row's kept pairs (block-sparse). The tile pass
        gives such rows whatever its padding makes of them (k-min: NaN) and its
        backward divides by their zero total (log-sum-exp: 0 / 0); replaced by
        ``torch.where`` after the pass, they are constants to every autograd mode:
        their cotangents never reach the pass, their gradients and tangents are 0,
        as the dense reduction's with the dropped pairs masked out.
        """
        fills = self.nothing(1, len(kept), outs[0].dtype, outs[0].device)
        return tuple(torch.where(self.unkept(kept, o), f.to(o.dtype), o) for o, f in zip(outs, fills))

    def unkept(self, kept: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Where ``out`` (1, N, ...) reduces over no pair: its rows that keep none."""
        return (kept == 0).view(1, -1, *(1,) * (out.dim() - 2))

    def vjp(self, collector, outs, grads) -> None:
        raise NotImplementedError

    def jvp(self, collector, outs):
        """Schedules tangent work on ``collector``; returns results -> output tangents."""
        raise NotImplementedError


def select_channels(collector, expr, index: torch.Tensor, grad: torch.Tensor) -> None:
    """Cotangents ``grad`` (B, N, K, C) on the values of ``expr`` at pairs (i, index[i, k, c]), channel c.

    Each (k, c) is one selected pair whose cotangent lives on channel c only.
    """
    batch, n, k, channels = index.shape
    one_hot = torch.eye(channels, dtype=grad.dtype, device=grad.device).repeat(k, 1)  # (K*C, C)
    cot = grad.reshape(batch, n, k * channels, 1) * one_hot
    collector.selected(expr, index.reshape(batch, n, k * channels), cot)


def channels_at_selection(collector, expr, index: torch.Tensor):
    """Schedules ``expr``'s tangent at pairs (i, index[i, k, c]), channel c; returns results -> (B, N, K, C)."""
    batch, n, k, channels = index.shape
    handle = collector.at_selection(collector.tangent(expr), index.reshape(batch, n, k * channels))

    def pick(results):
        values = results[handle].reshape(batch, n, k, channels, -1).expand(-1, -1, -1, -1, channels)
        return values.diagonal(dim1=-2, dim2=-1)

    return pick
