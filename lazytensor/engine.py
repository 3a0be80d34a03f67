"""The tile engine: a chunk plan and one loop that feeds consumers.

``stream(problem, consumers)`` walks row blocks of the i-variables and, inside
each, column blocks of the j-variables; every tile is evaluated once by the
(compiled) tile function and every consumer folds it into its state: O(rows)
for reductions over j, O(columns) for sums over i. Nothing of size N x M ever
exists: the largest live buffer is one tile, sized from a memory budget.
Several consumers on one pass ("event streaming") share the formula's
evaluation.

Compiled kernels see fixed shapes and strides: tile sizes are powers of two
(a small bucket set per formula), every block is copied into a fresh
zero-padded buffer, and the formula's float constants are passed as values,
so a new N, M or bandwidth never recompiles.
"""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

import sympy
import torch

from . import compile, ir, threads

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
# Under a sharding, row blocks' reduction states are merged across ranks in batches of about
# this many bytes: one collective per batch instead of one per row block (latency dominates
# small all-reduces), with bounded memory (quantile histograms are large).
MERGE_BYTES = 16 << 20
BACKENDS = ("auto", "compiled", "eager")
# Which route each pass took ("eager", "compiled", "eager, then compiled": the auto tier switched
# mid-pass): tests read it to check the route, never a wall-clock time.
routes: collections.Counter = collections.Counter()


@dataclass
class Problem:
    """Variables of one reduction: IR info and their tensors.

    i/j tensors are (B, N, D) / (B, M, D) with B equal to the batch size or 1;
    parameters are (B, D) (B may be 1). ``order`` fixes the argument order of
    tile kernels.
    """

    info: dict[sympy.Symbol, ir.VarInfo]
    tensors: dict[sympy.Symbol, torch.Tensor]
    order: list[sympy.Symbol] = field(default_factory=list)
    total: int | None = None  # the reduced axis's size over every rank when it is sharded

    def __post_init__(self):
        if not self.order:
            self.order = sorted(self.tensors, key=lambda s: (ir.AXES.index(self.info[s].axis), ir.creation_index(s)))

    def axis_symbols(self, axis: str) -> list[sympy.Symbol]:
        return [s for s in self.order if self.info[s].axis == axis]

    def size(self, axis: str) -> int:
        syms = self.axis_symbols(axis)
        if not syms:
            raise ValueError(f"the formula has no {axis}-indexed variable")
        return self.tensors[syms[0]].shape[1]

    @property
    def reduced_size(self) -> int:
        """How many entries the j axis reduces over (all ranks' when sharded)."""
        return self.size("j") if self.total is None else self.total

    @property
    def batch(self) -> int:
        return max((t.shape[0] for t in self.tensors.values()), default=1)

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.tensors.values())).dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def swapped(self) -> "Problem":
        """The same variables with i and j exchanged: reducing over i."""
        flip = {"i": "j", "j": "i", "p": "p"}
        info = {s: ir.VarInfo(flip[v.axis], v.dim) for s, v in self.info.items()}
        return Problem(info, self.tensors, [])

    def extended(self, extra: dict[sympy.Symbol, tuple[torch.Tensor, str]]) -> "Problem":
        """The problem plus new variables (placed after the existing ones)."""
        info, tensors = dict(self.info), dict(self.tensors)
        for sym, (tensor, axis) in extra.items():
            info[sym] = ir.VarInfo(axis, tensor.shape[-1])
            tensors[sym] = tensor
        return Problem(info, tensors, self.order + list(extra))

    def canonical(self, exprs: list[sympy.Expr]) -> tuple:
        """A structural key for ``exprs``: symbols renamed by axis and position (sympy compares and hashes
        expressions structurally, so the renamed expressions are the key; printing them cost ~1 ms a call)."""
        rename = {s: ir.make_symbol(f"{self.info[s].axis}{k}_{self.info[s].dim}") for k, s in enumerate(self.order)}
        return tuple(e.xreplace(rename) for e in exprs)


@dataclass(frozen=True)
class TilePlan:
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


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'compiled' or 'eager', got {backend!r}")
    return backend


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


def _eager_pairs(problem: Problem, consumers, budget: int) -> int:
    """Pairs per eager tile: its widest intermediate (features or channels, plus two) within ``budget`` bytes."""
    width = max([v.dim for v in problem.info.values()] + [c.dim for c in consumers] + [1])
    return budget // (problem.dtype.itemsize * (width + 2))


def _functorch_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def use_compiled(backend: str, problem: Problem, formula_key=None) -> bool:
    """Whether a pass without a tier switch runs compiled tiles ("auto": once the formula's eager time paid for it)."""
    check_backend(backend)
    if backend == "eager" or not compile.compile_available() or torch.compiler.is_compiling() or _functorch_active():
        return False
    if backend == "compiled":
        return True
    return compile.worth_compiling(formula_key, problem.size("i") * problem.size("j"), compile.eager_seconds(formula_key))


def _block(t: torch.Tensor, start: int, stop: int, extent: int, fixed: bool, features_first: bool = False) -> torch.Tensor:
    """``t[:, start:stop]``; ``fixed``: a fresh zero-padded buffer of ``extent`` rows (fixed shape and strides).

    ``features_first`` stores the block as (B, D, rows): column blocks are read
    by the tile with the column index innermost, and contiguous loads along it
    are what lets the compiler vectorize the tile (a (m, 3) block read with
    stride 3 runs scalar code, ~3x slower).
    """
    part = t[:, start:stop]
    if not (fixed or features_first):
        return part
    width = extent if fixed else part.shape[1]
    buffer = t.new_zeros((t.shape[0], t.shape[2], width) if features_first else (t.shape[0], width, t.shape[2]))
    (buffer.transpose(1, 2) if features_first else buffer)[:, : part.shape[1]] = part
    return buffer


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


def _merged_spans(ranges) -> list[tuple[int, int, list]]:
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

    Dense: every column block. Block-sparse (``clusters`` from ``_merged_spans``):
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


def _sparse_plan(plan: TilePlan, clusters, compiled: bool) -> TilePlan:
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


def _valid(width: int, valid: int, dtype: torch.dtype, device) -> torch.Tensor:
    """1 for the first ``valid`` of ``width`` positions, 0 for padding, in the problem dtype."""
    return (torch.arange(width, device=device) < valid).to(dtype)


def _lifted(problem: Problem, consumers) -> tuple[Problem, list[list[sympy.Expr]]]:
    """Float constants of the consumers' formulas as parameters (one kernel for every value)."""
    exprs = [e for c in consumers for e in c.expressions]
    lifted, constants = ir.lift_constants(exprs)
    if constants:
        values = torch.tensor([v for _, v in constants], dtype=problem.dtype, device=problem.device)
        problem = problem.extended({s: (values[k].reshape(1, 1), "p") for k, (s, _) in enumerate(constants)})
    per_consumer, at = [], 0
    for c in consumers:
        per_consumer.append(lifted[at : at + len(c.expressions)])
        at += len(c.expressions)
    return problem, per_consumer


def _expansion_safe(problem: Problem) -> bool:
    """The norm expansion needs finite inputs (inf - inf is NaN where the exact answer is not)."""
    return all(bool(torch.isfinite(t).all()) for s, t in problem.tensors.items() if problem.info[s].axis != "p")


def _nbytes(state) -> int:
    return 0 if state is None else sum(t.numel() * t.element_size() for t in state)


def _merge_ranks(sharding, consumers, by_column, pending: list, batch: int, results: list) -> None:
    """Merge the pending row blocks' states across ranks, then finalize them (``pending`` is emptied).

    The blocks' states are concatenated along their rows, so a consumer merges
    all of them in one collective; a state whose tensors do not all carry the
    block's rows on dim 1 is merged block by block.
    """
    padded = [rows for _, rows, _ in pending]
    for k, cons in enumerate(consumers):
        if by_column[k]:
            continue
        parts = [states[k] for states, _, _ in pending]
        if all(t.shape[1] == rows for part, rows in zip(parts, padded) for t in part):
            merged = cons.finalize(sharding.merge(cons, tuple(torch.cat(ts, 1) for ts in zip(*parts))), sum(padded), batch)
            blocks = zip(*(o.split(padded, 1) for o in merged))
        else:
            blocks = (cons.finalize(sharding.merge(cons, part), rows, batch) for part, rows in zip(parts, padded))
        results[k].extend(tuple(o[:, :valid] for o in outs) for outs, (_, _, valid) in zip(blocks, pending))
    pending.clear()


def stream(problem: Problem, consumers: list, *, backend: str = "auto", chunk_size=None, ranges=None, sharding=None):
    """One pass over all tiles; returns each consumer's finalized outputs.

    Consumers reducing over j return (B, N, ...) tensors, column sums (B, M, D).
    ``ranges`` (from ``check_ranges``) restricts the pass to the kept blocks.
    With a ``sharding`` (``lazytensor.distributed``) the j axis is this rank's
    shard: indices are global and the row blocks' states are merged across
    ranks (in batches of ``MERGE_BYTES``) before they are finalized, so every
    rank returns the full result.
    """
    n, m, batch = problem.size("i"), problem.size("j"), problem.batch
    offset, total = 0, m
    if sharding is not None:
        sizes = sharding.sizes(m, problem.device)
        offset, total = sum(sizes[: sharding.rank]), sum(sizes)
    if n == 0 or total == 0:
        return [c.empty(batch, n if c.reduced_axis == "j" else m, problem.dtype, problem.device) for c in consumers]
    problem, exprs = _lifted(problem, consumers)
    expand = _expansion_safe(problem)
    formula_key = (
        tuple(c.signature for c in consumers),
        problem.canonical([e for es in exprs for e in es]),
        tuple(problem.info[s].axis for s in problem.order),
        problem.dtype,
        problem.device.type,
        expand,
    )
    loop = _TileLoop(problem, consumers, exprs, formula_key, expand, offset, sharding)
    with threads.pass_threads(problem.device):
        _run(loop, problem, consumers, backend, chunk_size, ranges, formula_key, sizes if sharding is not None else None)
    return loop.results()


def _run(loop: "_TileLoop", problem: Problem, consumers, backend, chunk_size, ranges, formula_key, sizes) -> None:
    """The pass's route: sharded and block-sparse passes on one plan, the others by ``backend`` (``_auto_tier``)."""
    n, sharding = problem.size("i"), loop.sharding
    if sharding is not None:  # every rank must cut the same row blocks, so nothing may depend on its own shard or history
        compiled = use_compiled("eager" if backend == "eager" else "compiled", problem) and (
            backend == "compiled" or n * sum(sizes) >= compile.AUTO_COMPILE_MIN_PAIRS)
        loop.run(plan_tiles(problem, consumers, chunk_size, compiled, m=max(sizes)), compiled)
        routes["compiled" if compiled else "eager"] += 1
    elif ranges is not None:
        compiled, clusters = use_compiled(backend, problem, formula_key), _merged_spans(ranges)
        plan = plan_tiles(problem, consumers, chunk_size, compiled)
        loop.run(plan if chunk_size is not None else _sparse_plan(plan, clusters, compiled), compiled, clusters=clusters)
        routes["compiled" if compiled else "eager"] += 1
    elif backend != "auto" or not use_compiled("compiled", problem):
        compiled = use_compiled(backend, problem, formula_key)
        loop.run(plan_tiles(problem, consumers, chunk_size, compiled), compiled)
        routes["compiled" if compiled else "eager"] += 1
    else:
        _auto_tier(loop, problem, consumers, chunk_size, formula_key)


def _auto_tier(loop: "_TileLoop", problem: Problem, consumers, chunk_size, formula_key) -> None:
    """The "auto" backend: compiled tiles when their kernel is ready, else eager ones while it compiles aside.

    A formula whose eager time (spent so far in this process, plus this call's
    projection from its first row block) reaches ``compile.COMPILE_AFTER_SECONDS``
    on a problem of at least ``compile.AUTO_COMPILE_MIN_PAIRS`` pairs has its kernel
    compiled in a background thread; the pass switches to it at the next row
    block once it is ready, and later calls start compiled. No call waits for a
    compile, and a cheap or one-off formula never pays for one.
    """
    n, m = problem.size("i"), problem.size("j")
    compiled_plan = plan_tiles(problem, consumers, chunk_size, True)
    kernel = loop.kernel(compiled_plan, True, create=False)
    if kernel is not None and kernel.ready:
        loop.run(compiled_plan, True, kernel=kernel)
        routes["compiled"] += 1
        return
    large = n * m >= compile.AUTO_COMPILE_MIN_PAIRS
    spent = compile.eager_seconds(formula_key)
    started = time.perf_counter()

    def start_compile(projected: float) -> None:
        nonlocal kernel
        if kernel is None and compile.worth_compiling(formula_key, n * m, spent + projected):
            kernel = loop.kernel(compiled_plan, True)
            kernel.compile_in_background(loop.example_arguments(compiled_plan))

    def switch(done_rows: int):
        """After each eager row block: start the compile once the time warrants it; the kernel once it is ready.

        Starting it inside the call, not after it, measured better: calls 2-3 at 16384^2 run compiled
        (RBF 0.69 s, k-min 0.18 s) where compiling after call 1 left call 2 eager (5.2 s, 3.9 s)."""
        start_compile((time.perf_counter() - started) * n / max(done_rows, 1))
        return kernel if kernel is not None and kernel.ready else None

    switch(0)  # a formula compiled before (another tile shape) or already worth it starts at once
    at = loop.run(plan_tiles(problem, consumers, chunk_size, False), False, switch=switch)
    if large:
        compile.record_eager(formula_key, time.perf_counter() - started)
    start_compile(time.perf_counter() - started)  # a one-row-block call decides from its whole time
    if at < n:
        loop.run(compiled_plan, True, kernel=kernel, start=at)
    routes["eager" if at == n else "eager, then compiled"] += 1


class _TileLoop:
    """The row-block loop of one pass, its consumers' states and results.

    ``run`` walks row blocks from ``start`` with one tile plan and kernel; a
    ``switch`` callback may end it at a row-block boundary, and the caller
    continues from there with another plan (the auto tier's eager -> compiled
    switch): per-row states are finished block by block and column states
    span every column, so neither depends on the plan.
    """

    def __init__(self, problem: Problem, consumers, exprs, formula_key, expand: bool, offset: int, sharding):
        self.problem, self.consumers, self.exprs = problem, consumers, exprs
        self.formula_key, self.expand, self.offset, self.sharding = formula_key, expand, offset, sharding
        self.n, self.m, self.batch = problem.size("i"), problem.size("j"), problem.batch
        self.width = max(self.m, 1)  # an empty shard takes part with one masked column
        self.i_syms, self.j_syms, self.p_syms = (problem.axis_symbols(a) for a in ir.AXES)
        tensors = {s: t.detach() for s, t in problem.tensors.items()}
        if self.m == 0:
            tensors.update({s: tensors[s].new_zeros(tensors[s].shape[0], 1, tensors[s].shape[2]) for s in self.j_syms})
        self.tensors = tensors
        self.by_column = [c.reduced_axis == "i" for c in consumers]  # column sums: state spans all (local) columns
        self.outputs: list[list[tuple]] = [[] for _ in consumers]
        dtype, device = problem.dtype, problem.device
        self.column_states = {k: c.initial_state(self.batch, self.width, dtype, device)
                              for k, c in enumerate(consumers) if self.by_column[k]}
        self.pending: list[tuple] = []  # sharded: row blocks' states waiting to be merged across ranks together
        self.pending_bytes = 0

    def kernel(self, plan: TilePlan, compiled: bool, create: bool = True):
        """The tile kernel for ``plan`` (``create=False``: only a cached one, else None)."""
        shapes = ((plan.rows, plan.cols), tuple(self.tensors[s].shape[0] for s in self.problem.order)) if compiled else None
        if not create:
            return compile.cached_kernel(self.formula_key, shapes, compiled)
        return compile.tile_kernel(self.consumers, self.exprs, self.problem.info, self.problem.order,
                                   formula=self.formula_key, shapes=shapes, compiled=compiled, expand=self.expand)

    def _rows(self, plan: TilePlan, compiled: bool, r0: int, r1: int):
        rows = [_block(self.tensors[s], r0, r1, plan.rows, compiled) for s in self.i_syms]
        rowmask = _valid(rows[0].shape[1], r1 - r0, self.problem.dtype, self.problem.device).view(1, -1, 1, 1)
        return rows, rowmask

    def _columns(self, plan: TilePlan, compiled: bool, c0: int, c1: int):
        """The j-blocks (features first) and column mask of [c0, c1); (0, 0) is one fully padded tile."""
        stop = c1 if c1 > c0 else min(plan.cols, self.width)
        blocks = [_block(self.tensors[s], c0, stop, plan.cols, compiled, features_first=True) for s in self.j_syms]
        mask = _valid(blocks[0].shape[2], max(0, min(c1, self.m) - c0), self.problem.dtype, self.problem.device)
        return blocks, mask.view(1, 1, -1, 1)

    def example_arguments(self, plan: TilePlan) -> tuple:
        """A compiled kernel's first tile, copied: what a background compile traces and runs once."""
        rows, rowmask = self._rows(plan, True, 0, min(plan.rows, self.n))
        cols, mask = self._columns(plan, True, 0, min(plan.cols, self.width))
        return rows, cols, [self.tensors[s].clone() for s in self.p_syms], mask, rowmask

    def run(self, plan: TilePlan, compiled: bool, *, kernel=None, start: int = 0, clusters=None, switch=None) -> int:
        """Row blocks from ``start`` on; returns the first row not done (``n`` unless ``switch`` took over)."""
        kernel = kernel or self.kernel(plan, compiled)
        column_blocks: dict[tuple[int, int], tuple] = {}
        params = [self.tensors[s] for s in self.p_syms]
        consumers, by_column = self.consumers, self.by_column
        for (r0, r1), column_ranges in tile_schedule(self.n, self.width, plan, clusters, start):
            threads.follow_load()
            rows, rowmask = self._rows(plan, compiled, r0, r1)
            states = [self.column_states.get(k) for k in range(len(consumers))]
            for c0, c1 in column_ranges:
                if (c0, c1) not in column_blocks:
                    column_blocks[(c0, c1)] = self._columns(plan, compiled, c0, c1)
                cols, mask = column_blocks[(c0, c1)]
                partials = kernel(rows, cols, params, mask, rowmask)
                at = [slice(c0, c1) if column else self.offset + c0 for column in by_column]
                states = [cons.combine(st, p, a) for cons, st, p, a in zip(consumers, states, partials, at)]
            self._finish_rows(states, rows[0].shape[1], r1 - r0)
            if switch is not None and r1 < self.n and switch(r1) is not None:
                return r1
        return self.n

    def _finish_rows(self, states, padded: int, valid: int) -> None:
        if self.sharding is None:
            for k, cons in enumerate(self.consumers):
                if not self.by_column[k]:
                    self.outputs[k].append(tuple(o[:, :valid] for o in cons.finalize(states[k], padded, self.batch)))
            return
        self.pending.append((states, padded, valid))
        self.pending_bytes += sum(_nbytes(st) for st, column in zip(states, self.by_column) if not column)
        if self.pending_bytes >= MERGE_BYTES:
            _merge_ranks(self.sharding, self.consumers, self.by_column, self.pending, self.batch, self.outputs)
            self.pending_bytes = 0

    def results(self) -> list[tuple]:
        if self.pending:
            _merge_ranks(self.sharding, self.consumers, self.by_column, self.pending, self.batch, self.outputs)
        for k, state in self.column_states.items():
            self.outputs[k].append(tuple(o[:, : self.m] for o in self.consumers[k].finalize(state, self.width, self.batch)))
        return [tuple(torch.cat(parts, 1) for parts in zip(*blocks)) for blocks in self.outputs]
