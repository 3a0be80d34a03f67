"""Tile plans: tile shapes from memory budgets, ``chunk_size`` checks, and block-sparse schedules.

The tile engine (``engine.stream``) and streamed attention plan their tiles
here. Compiled tiles are powers of two (a small bucket set per formula, so a
new N or M never recompiles); eager tiles are also capped by the bytes of
their widest intermediate. ``ranges`` (KeOps's block-sparse reductions) turn
into a schedule of row blocks, each with the column blocks it reduces over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .problem import Problem

# Tile shape. Compiled tiles hold about PAIRS_PER_TILE pairs (256 x 1024: measured fastest
# here for the RBF product at D = 3 and 32, forward and backward, 1.3-1.6x faster than
# 32 x 4096: the tile's few fused intermediates stay cache-resident and the per-call overhead
# is amortised). Eager tiles materialize every intermediate, (rows, cols, D) ones included,
# so they are also capped by a byte budget for the widest one.
PAIRS_PER_TILE = 1 << 18
TILE_BUDGET_BYTES = 8 << 20
MAX_TILE_COLS = 1024
MAX_TILE_ROWS = 1024
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
    given = check_chunk_size(chunk_size)
    if given is not None:
        rows, cols = given
    elif problem.device.type == "cpu" and any(c.tile_hint for c in consumers):
        hints = [c.tile_hint for c in consumers if c.tile_hint]
        rows, cols = max(h[0] for h in hints), max(h[1] for h in hints)
        narrow = min(cols, bucket(m))  # fewer columns than the hint: more rows, the measured pairs per tile
        rows, cols = max(rows, min(MAX_TILE_ROWS, rows * cols // narrow)), narrow
        if not compiled:
            rows = max(MIN_TILE, min(rows, _eager_pairs(problem, consumers, TILE_BUDGET_BYTES) // cols))
    else:
        gpu = problem.device.type == "cuda"
        cols = min(CUDA_MAX_TILE if gpu else MAX_TILE_COLS, bucket(m))
        pairs = (CUDA_PAIRS_PER_TILE if gpu else PAIRS_PER_TILE) // problem.batch
        if not compiled:
            pairs = min(pairs, _eager_pairs(problem, consumers, CUDA_TILE_BUDGET_BYTES if gpu else TILE_BUDGET_BYTES))
        rows = max(MIN_TILE, min(CUDA_MAX_TILE if gpu else MAX_TILE_ROWS, pairs // cols))
        rows = 1 << round(math.log2(rows))  # the nearest power of two: within a factor sqrt(2) of the budget
    if compiled:
        return TilePlan(min(rows, bucket(n)), min(cols, bucket(m)))
    return TilePlan(min(rows, n), min(cols, m))


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


def _eager_pairs(problem: Problem, consumers, budget: int) -> int:
    """Pairs per eager tile: its widest intermediate (features or channels, plus two) within ``budget`` bytes."""
    width = max([v.dim for v in problem.info.values()] + [c.dim for c in consumers] + [1])
    return budget // (problem.dtype.itemsize * (width + 2))

# -- block-sparse reductions (KeOps's ``ranges``) ---------------------------------------------
def check_ranges(ranges, problem: Problem, axis: str):
    """KeOps's ``ranges`` 6-tuple -> this reduction's (row clusters, slices, column ranges), as lists.

    ``(ranges_i, slices_i, redranges_j)`` serve reductions over j,
    ``(ranges_j, slices_j, redranges_i)`` reductions over i (``problem`` is
    already oriented so that its rows are the kept axis): row cluster k
    ([start, end) rows) reduces over the column ranges
    ``redranges[slices[k-1]:slices[k]]`` only; rows in no cluster reduce over nothing.
    """
    if ranges is None:
        return None
    if not isinstance(ranges, (tuple, list)) or len(ranges) != 6:
        raise ValueError("ranges must be KeOps's 6-tuple (ranges_i, slices_i, redranges_j, ranges_j, slices_j, redranges_i)")
    clusters, slices, spans = (torch.as_tensor(r).tolist() for r in (ranges[:3] if axis == "j" else ranges[3:]))
    rows, cols = problem.size("i"), problem.size("j")
    for name, pairs, size in (("ranges (row clusters)", clusters, rows), ("ranges (reduction ranges)", spans, cols)):
        if any(len(p) != 2 or not 0 <= p[0] <= p[1] <= size for p in pairs):
            raise ValueError(f"{name} must be [start, end) pairs inside [0, {size}], got {pairs}")
    if len(slices) != len(clusters) or any(b < a for a, b in zip([0] + slices, slices)) or (slices and slices[-1] > len(spans)):
        raise ValueError(f"ranges: slices must be {len(clusters)} non-decreasing ends into the {len(spans)} reduction ranges, "
                         f"got {slices}")
    return clusters, slices, spans


def merged_spans(ranges) -> list[tuple[int, int, list]]:
    """Each row cluster with its column ranges sorted and merged where they touch, clusters by start."""
    clusters, slices, spans = ranges
    out = []
    for k, (a, b) in enumerate(clusters):
        merged: list[list[int]] = []
        for c0, c1 in sorted(spans[(slices[k - 1] if k else 0): slices[k]]):
            if c1 <= c0:
                continue
            if merged and c0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], c1)
            else:
                merged.append([c0, c1])
        out.append((a, b, merged))
    out.sort()
    if any(a1 < b0 for (_, b0, _), (a1, _, _) in zip(out, out[1:])):
        raise ValueError("ranges: row clusters overlap")
    return out


def _pieces(start: int, stop: int, extent: int) -> list[tuple[int, int]]:
    return [(a, min(a + extent, stop)) for a in range(start, stop, extent)]


def tile_schedule(n: int, m: int, plan: TilePlan, clusters, start: int = 0) -> list[tuple[tuple[int, int], list]]:
    """Row blocks covering [start, n) in order, each with the column blocks it reduces over (at most one tile each).

    Dense: every column block. Block-sparse (``clusters`` from ``merged_spans``):
    a cluster's rows visit its own column ranges only; rows in no cluster get
    one fully padded tile, (0, 0), so every reduction returns its empty value.
    """
    if clusters is None:
        columns = _pieces(0, m, plan.cols)
        return [(r, columns) for r in _pieces(start, n, plan.rows)]
    schedule, at = [], 0
    for a, b, merged in clusters:
        schedule += [(r, [(0, 0)]) for r in _pieces(at, a, plan.rows)]
        columns = [p for c0, c1 in merged for p in _pieces(c0, c1, plan.cols)] or [(0, 0)]
        schedule += [(r, columns) for r in _pieces(a, b, plan.rows)]
        at = b
    return schedule + [(r, [(0, 0)]) for r in _pieces(at, n, plan.rows)]


# Per-tile cost of the Python loop and the kernel call, in pairs of the tile (~0.2 ms measured).
TILE_OVERHEAD_PAIRS = 1 << 17


def sparse_plan(plan: TilePlan, clusters, compiled: bool) -> TilePlan:
    """The tile shape for a block-sparse pass: least padded pairs plus per-tile overhead over the kept blocks.

    Candidates are powers of two within the dense plan's area (compiled tiles
    are padded to them); the eager lowering pads nothing, so it just takes the
    largest tile the blocks fill.
    """
    sizes = [b - a for a, b, _ in clusters]
    spans = [c1 - c0 for _, _, merged in clusters for c0, c1 in merged]
    if not compiled or not spans:
        return TilePlan(min(plan.rows, max(sizes + [1])), min(plan.cols, max(spans + [1])))
    rows, lengths = torch.tensor(sizes, dtype=torch.float64), torch.tensor(spans, dtype=torch.float64)
    owner = torch.tensor([k for k, (_, _, merged) in enumerate(clusters) for _ in merged], dtype=torch.int64)
    best = None
    for r in (1 << e for e in range(int(math.log2(MIN_TILE)), int(math.log2(plan.rows)) + 1)):
        row_pieces = torch.ceil(rows / r)
        for c in (1 << e for e in range(int(math.log2(MIN_TILE)), int(math.log2(plan.cols)) + 1)):
            if r * c > plan.rows * plan.cols:
                break
            column_pieces = torch.zeros(len(clusters), dtype=torch.float64).index_add_(0, owner, torch.ceil(lengths / c))
            cost = float((row_pieces * column_pieces).sum()) * (r * c + TILE_OVERHEAD_PAIRS)
            if best is None or cost < best[0]:
                best = (cost, r, c)
    return TilePlan(best[1], best[2])

