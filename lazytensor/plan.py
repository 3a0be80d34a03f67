"""Tile plans: tile shapes from memory budgets, ``chunk_size`` checks, and block-sparse schedules.

The tile engine (``engine.stream``) and streamed attention plan their tiles
here. Compiled tiles are powers of two (a small bucket set per formula, so a
new N or M never recompiles); eager tiles are also capped by the bytes of
their widest intermediate. ``ranges`` (KeOps's block-sparse reductions) turn
into a schedule of row blocks, each with the column blocks it reduces over.
"""
from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .problem import Problem

# Tile shape. Compiled tiles hold about PAIRS_PER_TILE pairs (256 x 1024: measured fastest
# here for the RBF product at D = 3 and 32, forward and backward, 1.3-1.6x faster than
# 32 x 4096: the tile's few fused intermediates stay cache-resident and the per-call overhead
# is amortised). Eager tiles materialize every intermediate, (rows, cols, D) ones included,
# so they are also capped by a byte budget for the widest one: TILE_BUDGET_BYTES, or up to
# EAGER_BUDGET_GROWTH times that on a problem whose N x M matrix is EAGER_BUDGET_SHARE times the
# budget or more (per-tile Python costs amortised over more pairs; eager passes at N = M = 16384,
# 32 MiB against 8: k-min 0.77 s against 1.33, softmax-weighted sum 0.60 against 1.06-1.2, RBF
# product 0.61-0.79 against 0.94-1.03, log-sum-exp and distance sum unchanged; the tile stays
# within 1/16 of the dense matrix).
PAIRS_PER_TILE = 1 << 18
TILE_BUDGET_BYTES = 8 << 20
EAGER_BUDGET_GROWTH = 4
EAGER_BUDGET_SHARE = 16
MAX_TILE_COLS = 1024
MAX_TILE_ROWS = 1024
# Those caps shape square-ish problems. A skinny one (k-means' 50 centroids against 50000 points, a
# few queries against a large set) keeps the tile's pairs instead: its narrow axis leaves the other
# the share it does not use (``_widened``). At 1024 rows a tile, argmin of 50000 points against 50
# centroids ran 49 tiles of per-tile overhead a call, 16 ms against dense's 6.8 (4096 rows: 8.7 ms).
MIN_TILE = 16
# A GPU needs far larger tiles to fill its cores and amortise each launch: 4096 x 16384 pairs
# (256 MiB per float32 intermediate; eager tiles within 1 GiB for the widest one).
CUDA_PAIRS_PER_TILE = 1 << 26
CUDA_TILE_BUDGET_BYTES = 1 << 30
CUDA_MAX_TILE = 16384
# Streamed attention (attention.py) tiles (queries x keys) score matrices, every batch-head at
# once, evaluated by batched matrix products: its explicit tiles keep one score tile across all
# batch-heads near the L2 cache (B=1, H=4, L=S=4096, d=64 on 2 cores: 256 x 512 tiles ran 1.08x
# the 1.47x of whole-row tiles); a GPU needs big tiles to fill its cores. Its fused tiles (ATen's
# flash kernel) block their work internally: large square tiles (no causal tile has a query
# without keys) keep the per-tile overhead small.
SCORE_TILE_BYTES = 2 << 20
SCORE_TILE_KEYS = 512
CUDA_SCORE_TILE_BYTES, CUDA_SCORE_TILE_KEYS = 256 << 20, 4096
FUSED_ATTENTION_TILE = 1024


@dataclass(frozen=True)
class TilePlan:
    """One tile shape: ``rows`` kept-axis entries by ``cols`` reduced-axis entries."""

    rows: int
    cols: int


def check_chunk_size(chunk_size) -> tuple[int, int] | None:
    """None, a positive int or a pair of positive ints (rows, cols)."""
    if chunk_size is None:
        return None
    pair = (chunk_size, chunk_size) if not isinstance(chunk_size, (tuple, list)) else tuple(chunk_size)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair):
        raise ValueError(f"chunk_size must be None, a positive int or a pair (rows, cols) of positive ints, got {chunk_size!r}")
    return pair


def bucket(size: int) -> int:
    """The compiled tile extent for ``size``: a power of two, at least MIN_TILE."""
    return max(MIN_TILE, 1 << math.ceil(math.log2(max(size, 1))))


def plan_tiles(problem: Problem, consumers, chunk_size, compiled: bool, m: int | None = None) -> TilePlan:
    """Tile shape from the pair and memory budgets, or from ``chunk_size`` (int or (rows, cols)).

    Budget-derived extents are powers of two and compiled kernels round the
    last tile up (padded), so every N and M maps to one of a few buckets; a
    given ``chunk_size`` is one fixed shape already. ``m`` overrides the
    number of columns (a sharded reduction plans for its largest shard).
    """
    n, m = problem.size("i"), problem.size("j") if m is None else m
    width = max([v.dim for v in problem.info.values()] + [c.dim for c in consumers] + [1])
    hints = tuple(c.tile_hint for c in consumers if c.tile_hint)
    budget = min(EAGER_BUDGET_GROWTH * TILE_BUDGET_BYTES,
                 max(TILE_BUDGET_BYTES, problem.batch * n * m * problem.dtype.itemsize // EAGER_BUDGET_SHARE))
    limits = (PAIRS_PER_TILE, budget, MAX_TILE_ROWS, MAX_TILE_COLS, MIN_TILE,
              CUDA_PAIRS_PER_TILE, CUDA_TILE_BUDGET_BYTES, CUDA_MAX_TILE)  # read now: tests and sweeps patch them
    return _plan(n, m, check_chunk_size(chunk_size), compiled, problem.device.type, problem.batch,
                 problem.dtype.itemsize * (width + 2), hints, limits)


@functools.lru_cache(maxsize=1024)
def _plan(n: int, m: int, given, compiled: bool, device_type: str, batch: int, pair_bytes: int, hints: tuple,
          limits: tuple) -> TilePlan:
    """``plan_tiles`` from what it depends on (cached: small problems ask for the same plan call after
    call); ``pair_bytes``: an eager tile's bytes per pair, its widest intermediate plus two."""
    (PAIRS_PER_TILE, TILE_BUDGET_BYTES, MAX_TILE_ROWS, MAX_TILE_COLS, MIN_TILE,  # noqa: N806 - the module's limits
     CUDA_PAIRS_PER_TILE, CUDA_TILE_BUDGET_BYTES, CUDA_MAX_TILE) = limits
    # an eager CPU tile is never padded: its plan takes the sizes as they are (measured on CPU only; a GPU keeps buckets)
    span_n, span_m = (max(n, 1), max(m, 1)) if not compiled and device_type == "cpu" else (bucket(n), bucket(m))
    if given is not None:
        rows, cols = given
    elif device_type == "cpu" and hints:
        rows, cols = max(h[0] for h in hints), max(h[1] for h in hints)
        pairs, short = rows * cols, span_n  # the measured pairs per tile, kept by a narrow axis (_widened)
        cols = min(cols, span_m)
        rows = max(rows, min(_widened(MAX_TILE_ROWS, MAX_TILE_COLS, cols), pairs // cols))
        if short < rows:
            cols = min(span_m, max(cols, min(_widened(MAX_TILE_COLS, MAX_TILE_ROWS, short), pairs // short)))
        if not compiled:
            rows = max(MIN_TILE, min(rows, TILE_BUDGET_BYTES // pair_bytes // cols))
    else:
        gpu = device_type == "cuda"
        max_rows, max_cols = (CUDA_MAX_TILE, CUDA_MAX_TILE) if gpu else (MAX_TILE_ROWS, MAX_TILE_COLS)
        pairs = (CUDA_PAIRS_PER_TILE if gpu else PAIRS_PER_TILE) // batch
        if not compiled:
            pairs = min(pairs, (CUDA_TILE_BUDGET_BYTES if gpu else TILE_BUDGET_BYTES) // pair_bytes)
        cols = min(span_m, max(max_cols, pairs // span_n), _widened(max_cols, max_rows, span_n))
        rows = max(MIN_TILE, min(_widened(max_rows, max_cols, cols), pairs // cols))
        rows = 1 << round(math.log2(rows))  # the nearest power of two: within a factor sqrt(2) of the budget
    if compiled:
        return TilePlan(min(rows, bucket(n)), min(cols, bucket(m)))
    return TilePlan(min(rows, n), min(cols, m))


def _widened(cap: int, other_cap: int, other: int) -> int:
    """An axis's cap where the other axis spans only ``other`` of its ``other_cap`` (see MAX_TILE_ROWS)."""
    return cap * max(1, other_cap // max(other, 1))


def attention_tiles(queries: int, keys: int, groups: int, itemsize: int, device: torch.device, given, fused: bool) -> TilePlan:
    """The (queries, keys) tile of streamed attention over ``groups`` batch-heads, or ``given`` (rows, cols)."""
    if given is not None:
        rows, cols = given
    elif fused:
        rows = cols = FUSED_ATTENTION_TILE
    else:
        gpu = device.type == "cuda"
        cols = max(1, min(keys, CUDA_SCORE_TILE_KEYS if gpu else SCORE_TILE_KEYS))
        budget = CUDA_SCORE_TILE_BYTES if gpu else SCORE_TILE_BYTES
        rows = max(MIN_TILE, budget // (max(groups, 1) * cols * itemsize))
    return TilePlan(max(1, min(rows, queries)), max(1, min(cols, keys)))  # empty L or S: no tiles


def tile_schedule(n: int, m: int, plan: TilePlan, start: int = 0) -> list[tuple[tuple[int, int], list]]:
    """Row blocks covering [start, n) in order, each with every column block (at most one tile each)."""
    columns = _pieces(0, m, plan.cols)
    return [(r, columns) for r in _pieces(start, n, plan.rows)]


def _pieces(start: int, stop: int, extent: int) -> list[tuple[int, int]]:
    return [(a, min(a + extent, stop)) for a in range(start, stop, extent)]


# -- block-sparse reductions (KeOps's ``ranges``) ---------------------------------------------
# A block-sparse pass packs its kept blocks into tiles: an *entry* is one row piece (at most
# ``rows`` rows of one cluster) by one column piece (at most ``cols`` of the cluster's kept columns,
# gathered across its ranges; within one range where a reduction places indices by offset), and a
# tile holds ``per_tile`` entries along the kernel's batch dimension, each with its own masks.
# GeomLoss's multiscale sinkhorn keeps ~5e5 blocks of 4-15 x 4-15 points: one tile per block cost a
# kernel call each (17-21 s per reduction at n = 20000); packed, a reduction is a few hundred tiles.
# Costs in pairs of the tile: the Python loop and kernel call per tile (~0.2 ms), and the gathers of
# each entry's rows and columns with their masks and states (fitted on the multiscale log-sum-exp at
# n = 20000, unlocked: 16 x 1024 entries ran 1.03 s, 2 x 512 ones 2.7 s: ~12 pairs' time per gathered
# row or column).
TILE_OVERHEAD_PAIRS = 1 << 17
GATHER_PAIRS = 12
MIN_SPARSE_COLS = 8
# Checked ranges, while their tensors live (GeomLoss reuses each for dozens of passes; a schedule
# takes ~4 bytes per kept column of each cluster and column padding: 45 MB at n = 20000).
_CHECKED: OrderedDict = OrderedDict()
_CHECKED_SIZE = 16


@dataclass(frozen=True)
class SparseSchedule:
    """The tiles of a block-sparse pass, ``per_tile`` entries each: (tiles, per_tile) row starts, row counts
    and column pieces (rows of ``columns``, (pieces + 1, cols) int32 column indices, ``m`` for padding;
    ``firsts``: each piece's first column). Empty slots have no rows and the all-padding last piece.

    A row piece meets each of its column pieces in successive *rounds* (round t: its t-th piece) and a
    tile never spans two rounds, so no row appears twice in one tile and the pass can gather and
    scatter row states per tile. ``first[t]``: tile t is in round 0 (its rows' states start there).
    """

    plan: TilePlan
    per_tile: int
    row_start: torch.Tensor
    row_count: torch.Tensor
    piece: torch.Tensor
    columns: torch.Tensor
    firsts: torch.Tensor
    first: list


class BlockSparsity:
    """A checked ``ranges`` for one reduction axis: row clusters (sorted, with the rows in none as clusters
    without ranges) and each cluster's column ranges merged where they touch, as int64 tensors."""

    def __init__(self, starts: torch.Tensor, ends: torch.Tensor, owner: torch.Tensor, run_start: torch.Tensor,
                 run_end: torch.Tensor, n: int, m: int):
        self.starts, self.ends, self.owner, self.run_start, self.run_end, self.n, self.m = (
            starts, ends, owner, run_start, run_end, n, m)
        self._schedules: dict = {}
        self._pieces: dict = {}
        self._kept: dict = {}

    def kept(self, device) -> torch.Tensor:
        """How many columns each row keeps, (n,) int64 on ``device`` (cached): rows with none reduce over nothing."""
        if device not in self._kept:
            with torch._C._DisableFuncTorch():  # kept beyond this call: plain tensors, not a torch.func level's wrappers
                lengths = self.run_end - self.run_start
                per_cluster = torch.zeros(len(self.starts), dtype=torch.int64).index_add_(0, self.owner, lengths)
                self._kept[device] = torch.repeat_interleave(per_cluster, self.ends - self.starts).to(device)
        return self._kept[device]

    def schedule(self, area: int, fixed: TilePlan | None, packed: bool) -> SparseSchedule:
        """The pass's tiles (cached: the forward and backward passes and later calls share them).

        ``fixed``: one entry per tile of that shape (a given ``chunk_size``);
        else the entry shape with the least padded pairs plus overheads, and
        ``area // (rows * cols)`` entries per tile when ``packed``.
        """
        key = (area, fixed, packed)
        if key not in self._schedules:
            plan = fixed or self._entry_shape(area, packed)
            per_tile = max(1, area // (plan.rows * plan.cols)) if packed and fixed is None else 1
            self._schedules[key] = self._tiles(plan, per_tile, gathered=packed and fixed is None)
        return self._schedules[key]

    def _entry_shape(self, area: int, packed: bool) -> TilePlan:
        sizes = (self.ends - self.starts).to(torch.float64)
        lengths = (self.run_end - self.run_start).to(torch.float64)
        if packed:  # an entry's columns are gathered from all its cluster's ranges
            lengths = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, self.owner, lengths)
        biggest = min(bucket(int(sizes.max())), area)
        longest = max(bucket(int(lengths.max())) if len(lengths) else 1, MIN_SPARSE_COLS)
        best = None
        for r in (1 << e for e in range(int(math.log2(biggest)) + 1)):
            row_pieces = torch.ceil(sizes / r)
            for c in (1 << e for e in range(int(math.log2(MIN_SPARSE_COLS)), int(math.log2(longest)) + 1)):
                if r * c > area:
                    break
                pieces = torch.ceil(lengths / c)
                if not packed:
                    pieces = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, self.owner, pieces)
                entries = float((row_pieces * pieces.clamp_min(1)).sum())
                tiles = entries / (max(1, area // (r * c)) if packed else 1)
                cost = entries * (r * c + GATHER_PAIRS * (r + c)) + tiles * TILE_OVERHEAD_PAIRS
                if best is None or cost < best[0]:
                    best = (cost, r, c)
        return TilePlan(best[1], best[2])

    def _column_pieces(self, cols: int, gathered: bool):
        """Each cluster's column pieces: (pieces per cluster, at least 1; the (pieces + 1, cols) int32 table of
        each piece's columns, ``m`` where padded, the last row all padding; each piece's first column).

        ``gathered``: a piece is ``cols`` consecutive columns of the concatenation of the cluster's ranges;
        else a piece lies in one range (its columns are ``first + 0, 1, ...``: what index offsets need).
        """
        lengths = self.run_end - self.run_start
        clusters = len(self.starts)
        if gathered:
            length = torch.zeros(clusters, dtype=torch.int64).index_add_(0, self.owner, lengths)
            base = torch.cumsum(length, 0) - length
            per = (length + cols - 1) // cols
            owner = torch.repeat_interleave(torch.arange(clusters), per)
            within = torch.arange(len(owner)) - (torch.cumsum(per, 0) - per)[owner]
            start = base[owner] + within * cols
            count = torch.minimum(base[owner] + length[owner] - start, torch.tensor(cols))
            first = torch.cumsum(lengths, 0) - lengths
            flat = torch.repeat_interleave(self.run_start - first, lengths) + torch.arange(int(lengths.sum()))
        else:
            per_run = (lengths + cols - 1) // cols
            run = torch.repeat_interleave(torch.arange(len(per_run)), per_run)
            within = torch.arange(len(run)) - (torch.cumsum(per_run, 0) - per_run)[run]
            start = self.run_start[run] + within * cols
            count = torch.minimum(self.run_end[run] - start, torch.tensor(cols))
            owner = self.owner[run]
        steps = torch.arange(cols, dtype=torch.int32)  # int32 throughout: the table is the schedule's bulk
        at = start.to(torch.int32)[:, None] + steps
        if gathered and len(flat):
            at = torch.index_select(flat.to(torch.int32), 0, at.clamp_max_(len(flat) - 1).view(-1)).view(at.shape)
        table = torch.where(steps < count.to(torch.int32)[:, None], at, self.m)
        firsts = torch.where(count > 0, start if not gathered else table[:, 0].long(), 0)
        per = torch.zeros(clusters, dtype=torch.int64).index_add_(0, owner, torch.ones_like(owner))
        empty = per == 0  # a cluster without ranges: one empty piece (the last row)
        pieces = torch.full((int(torch.where(empty, 1, per).sum()),), len(table), dtype=torch.int64)
        pieces[torch.repeat_interleave(~empty, torch.where(empty, 1, per))] = torch.arange(len(table))
        table = torch.cat([table, torch.full((1, cols), self.m, dtype=torch.int32)])
        return torch.where(empty, 1, per), pieces, table, torch.cat([firsts, torch.zeros(1, dtype=torch.int64)])

    def _tiles(self, plan: TilePlan, per_tile: int, gathered: bool) -> SparseSchedule:
        rows = plan.rows
        if (plan.cols, gathered) not in self._pieces:  # passes with other tiles (forward, backward) share them
            self._pieces[plan.cols, gathered] = self._column_pieces(plan.cols, gathered)
        pieces_of, pieces, table, firsts = self._pieces[plan.cols, gathered]
        slot = torch.cumsum(pieces_of, 0) - pieces_of  # cluster k's pieces at pieces[slot[k]:slot[k] + pieces_of[k]]
        clusters = len(self.starts)
        sizes = self.ends - self.starts
        per_cluster = (sizes + rows - 1) // rows
        cluster_of_row = torch.repeat_interleave(torch.arange(clusters), per_cluster)
        within = torch.arange(len(cluster_of_row)) - (torch.cumsum(per_cluster, 0) - per_cluster)[cluster_of_row]
        row_start = self.starts[cluster_of_row] + within * rows
        row_count = torch.minimum(self.ends[cluster_of_row] - row_start, torch.tensor(rows))
        # entries: each row piece with each column piece of its cluster, round-major
        meets = pieces_of[cluster_of_row]
        entry_row = torch.repeat_interleave(torch.arange(len(meets)), meets)
        entry_round = torch.arange(len(entry_row)) - (torch.cumsum(meets, 0) - meets)[entry_row]
        order = torch.argsort(entry_round * len(meets) + entry_row)
        entry_row, entry_round = entry_row[order], entry_round[order]
        entry_piece = pieces[slot[cluster_of_row[entry_row]] + entry_round]
        per_round = torch.bincount(entry_round)
        tiles_per_round = (per_round + per_tile - 1) // per_tile
        rank = torch.arange(len(entry_row)) - (torch.cumsum(per_round, 0) - per_round)[entry_round]
        tile = (torch.cumsum(tiles_per_round, 0) - tiles_per_round)[entry_round] + rank // per_tile
        position = tile * per_tile + rank % per_tile
        tiles = int(tiles_per_round.sum())
        out = [torch.full((tiles * per_tile,), fill, dtype=torch.int64) for fill in (self.n, 0, len(table) - 1)]
        for target, values in zip(out, (row_start[entry_row], row_count[entry_row], entry_piece)):
            target[position] = values
        first = (torch.arange(tiles) < int(tiles_per_round[0])).tolist()
        return SparseSchedule(plan, per_tile, *(t.view(tiles, per_tile) for t in out), table, firsts, first)


def check_ranges(ranges, problem: Problem, axis: str) -> BlockSparsity | None:
    """KeOps's ``ranges`` 6-tuple -> this reduction's ``BlockSparsity``.

    ``(ranges_i, slices_i, redranges_j)`` serve reductions over j,
    ``(ranges_j, slices_j, redranges_i)`` reductions over i (``problem`` is
    already oriented so that its rows are the kept axis): row cluster k
    ([start, end) rows) reduces over the column ranges
    ``redranges[slices[k-1]:slices[k]]`` only; rows in no cluster reduce over
    nothing. Checked once per ranges object and pass geometry (the last few are kept).
    """
    if ranges is None:
        return None
    if not isinstance(ranges, (tuple, list)) or len(ranges) != 6:
        raise ValueError("ranges must be KeOps's 6-tuple (ranges_i, slices_i, redranges_j, ranges_j, slices_j, redranges_i)")
    parts = ranges[:3] if axis == "j" else ranges[3:]
    rows, cols = problem.size("i"), problem.size("j")
    key = None
    if all(isinstance(r, torch.Tensor) for r in parts):
        key = (tuple((id(r), r._version) for r in parts), rows, cols)
        hit = _CHECKED.get(key)
        if hit is not None:
            _CHECKED.move_to_end(key)
            return hit
    checked = _checked(parts, rows, cols)
    if key is not None:
        _CHECKED[key] = checked
        for r in parts:  # dropped with the caller's tensors, before their ids can be reused
            weakref.finalize(r, _CHECKED.pop, key, None)
        while len(_CHECKED) > _CHECKED_SIZE:
            _CHECKED.popitem(last=False)
    return checked


def _checked(parts, rows: int, cols: int) -> BlockSparsity:
    clusters, slices, spans = (torch.as_tensor(r).detach().to("cpu", torch.int64) for r in parts)
    for name, pairs, size in (("ranges (row clusters)", clusters, rows), ("ranges (reduction ranges)", spans, cols)):
        if pairs.numel() == 0:
            pairs = pairs.reshape(0, 2)
        bad = None if pairs.dim() == 2 and pairs.shape[1] == 2 else pairs
        if bad is None:
            wrong = (pairs[:, 0] < 0) | (pairs[:, 0] > pairs[:, 1]) | (pairs[:, 1] > size)
            bad = pairs[wrong][:1] if bool(wrong.any()) else None
        if bad is not None:
            raise ValueError(f"{name} must be [start, end) pairs inside [0, {size}], got {bad.tolist()}")
    clusters, spans, slices = clusters.reshape(-1, 2), spans.reshape(-1, 2), slices.reshape(-1)
    ends = torch.cat([torch.zeros(1, dtype=torch.int64), slices])
    if len(slices) != len(clusters) or bool((ends[1:] < ends[:-1]).any()) or (len(slices) and int(slices[-1]) > len(spans)):
        shown = slices.tolist() if len(slices) <= 20 else f"{slices[:20].tolist()}..."
        raise ValueError(f"ranges: slices must be {len(clusters)} non-decreasing ends into the {len(spans)} reduction ranges, "
                         f"got {shown}")
    owner = torch.repeat_interleave(torch.arange(len(clusters)), ends[1:] - ends[:-1])
    spans = spans[: len(owner)]
    # clusters sorted by start, empty ones dropped; rows in none become clusters without ranges
    keep = clusters[:, 1] > clusters[:, 0]
    index = torch.nonzero(keep).flatten()
    index = index[torch.argsort(clusters[index, 0], stable=True)]
    starts, stops = clusters[index, 0], clusters[index, 1]
    if bool((starts[1:] < stops[:-1]).any()):
        raise ValueError("ranges: row clusters overlap")
    rank = torch.full((len(clusters),), -1, dtype=torch.int64)
    rank[index] = torch.arange(len(index))
    gap_starts = torch.cat([torch.zeros(1, dtype=torch.int64), stops])
    gap_ends = torch.cat([starts, torch.tensor([rows])])
    gaps = gap_ends > gap_starts
    all_starts, all_ends = torch.cat([starts, gap_starts[gaps]]), torch.cat([stops, gap_ends[gaps]])
    by_start = torch.argsort(all_starts)
    position = torch.empty_like(by_start)
    position[by_start] = torch.arange(len(by_start))
    # each kept cluster's ranges sorted by start, merged where they touch
    span_owner = rank[owner]
    real = (span_owner >= 0) & (spans[:, 1] > spans[:, 0])
    span_owner, spans = position[span_owner[real]], spans[real]
    stride = cols + 1
    key = span_owner * stride + spans[:, 0]
    order = torch.argsort(key)
    span_owner, key, end_key = span_owner[order], key[order], (span_owner * stride + spans[:, 1])[order]
    reach = torch.cummax(end_key, 0).values
    new_run = torch.ones(len(key), dtype=torch.bool)
    new_run[1:] = key[1:] > reach[:-1]
    last = torch.ones(len(key), dtype=torch.bool)
    last[:-1] = new_run[1:]
    run_owner = span_owner[new_run]
    return BlockSparsity(all_starts[by_start], all_ends[by_start], run_owner, key[new_run] - run_owner * stride,
                         reach[last] - run_owner * stride, rows, cols)
