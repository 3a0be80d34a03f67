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

import math
import time
from dataclasses import dataclass, field

import sympy
import torch

from . import ir, kernels

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
# "auto" tiers like a JIT: a formula runs eagerly until the eager time it has cost (this
# process, problems of at least AUTO_COMPILE_MIN_PAIRS pairs) exceeds COMPILE_AFTER_SECONDS,
# then compiles; a formula already compiled in this process compiles its new tile shapes at
# once. A one-off call never waits seconds for a compile it cannot amortise; a loop pays one.
AUTO_COMPILE_MIN_PAIRS = 1 << 22
COMPILE_AFTER_SECONDS = 1.0
BACKENDS = ("auto", "compiled", "eager")


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
        """A structural key for ``exprs``: symbols renamed by axis and position."""
        rename = {s: ir.make_symbol(f"{self.info[s].axis}{k}_{self.info[s].dim}") for k, s in enumerate(self.order)}
        return tuple(sympy.srepr(e.xreplace(rename)) for e in exprs)


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
    else:
        gpu = problem.device.type == "cuda"
        cols = min(CUDA_MAX_TILE if gpu else MAX_TILE_COLS, bucket(m))
        pairs = (CUDA_PAIRS_PER_TILE if gpu else PAIRS_PER_TILE) // problem.batch
        if not compiled:
            width = max([v.dim for v in problem.info.values()] + [c.dim for c in consumers] + [1])
            budget = CUDA_TILE_BUDGET_BYTES if gpu else TILE_BUDGET_BYTES
            pairs = min(pairs, budget // (problem.dtype.itemsize * (width + 2)))
        rows = max(MIN_TILE, min(CUDA_MAX_TILE if gpu else MAX_TILE_ROWS, pairs // cols))
        rows = 1 << round(math.log2(rows))  # the nearest power of two: within a factor sqrt(2) of the budget
    if compiled:
        return TilePlan(min(rows, bucket(n)), min(cols, bucket(m)))
    return TilePlan(min(rows, n), min(cols, m))


def _functorch_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def use_compiled(backend: str, problem: Problem, formula_key=None) -> bool:
    check_backend(backend)
    if backend == "eager" or not kernels.compile_available() or torch.compiler.is_compiling() or _functorch_active():
        return False
    if backend == "compiled":
        return True
    if problem.size("i") * problem.size("j") < AUTO_COMPILE_MIN_PAIRS:
        return False
    return kernels.compiled_before(formula_key) or kernels.eager_seconds(formula_key) >= COMPILE_AFTER_SECONDS


def _blocks(t: torch.Tensor, extent: int, total: int, fixed: bool, features_first: bool) -> list[torch.Tensor]:
    """Slices of ``t`` along dim 1; ``fixed``: each a fresh (B, extent, D) buffer, zero-padded.

    ``features_first`` stores each block as (B, D, extent): column blocks are
    read by the tile with the column index innermost, and contiguous loads
    along it are what lets the compiler vectorize the tile (a (m, 3) block
    read with stride 3 runs scalar code, ~5x slower).
    """
    parts = []
    for start in range(0, total, extent):
        part = t[:, start:start + extent]
        width = extent if fixed else part.shape[1]
        shape = (t.shape[0], t.shape[2], width) if features_first else (t.shape[0], width, t.shape[2])
        if fixed or features_first:
            buffer = t.new_zeros(shape)
            (buffer.transpose(1, 2) if features_first else buffer)[:, : part.shape[1]] = part
            part = buffer
        parts.append(part)
    return parts


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


def stream(problem: Problem, consumers: list, *, backend: str = "auto", chunk_size=None, sharding=None):
    """One pass over all tiles; returns each consumer's finalized outputs.

    Consumers reducing over j return (B, N, ...) tensors, column sums (B, M, D).
    With a ``sharding`` (``lazytensor.distributed``) the j axis is this rank's
    shard: indices are global and each row block's states are merged across
    ranks before they are finalized, so every rank returns the full result.
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
    if sharding is None:
        compiled = use_compiled(backend, problem, formula_key)
        plan = plan_tiles(problem, consumers, chunk_size, compiled)
    else:  # every rank must cut the same row blocks, so nothing may depend on its own shard or history
        compiled = use_compiled("eager" if backend == "eager" else "compiled", problem) and (
            backend == "compiled" or n * total >= AUTO_COMPILE_MIN_PAIRS)
        plan = plan_tiles(problem, consumers, chunk_size, compiled, m=max(sizes))
    i_syms, j_syms, p_syms = (problem.axis_symbols(a) for a in ir.AXES)
    tensors = {s: t.detach() for s, t in problem.tensors.items()}
    if m == 0:  # an empty shard takes part with one masked column
        tensors.update({s: tensors[s].new_zeros(tensors[s].shape[0], 1, tensors[s].shape[2]) for s in j_syms})
    shapes = ((plan.rows, plan.cols), tuple(tensors[s].shape[0] for s in problem.order)) if compiled else None
    kernel = kernels.tile_kernel(consumers, exprs, problem.info, problem.order, formula=formula_key, shapes=shapes,
                                 compiled=compiled, expand=expand)
    started = time.perf_counter()
    params = [tensors[s] for s in p_syms]
    device, dtype = problem.device, problem.dtype
    width = max(m, 1)
    col_blocks = [_blocks(tensors[s], min(plan.cols, width) if not compiled else plan.cols, width, compiled, True)
                  for s in j_syms]
    col_masks = [_valid(b.shape[2], max(0, min(plan.cols, m - c0)), dtype, device).view(1, 1, -1, 1)
                 for b, c0 in zip(col_blocks[0], range(0, width, plan.cols))]
    row_blocks = [_blocks(tensors[s], plan.rows, n, compiled, False) for s in i_syms]
    by_column = [c.reduced_axis == "i" for c in consumers]  # column sums: state spans all (local) columns
    results: list[list[tuple]] = [[] for _ in consumers]
    column_states = {k: c.initial_state(batch, width, dtype, device) for k, c in enumerate(consumers) if by_column[k]}
    for r, r0 in enumerate(range(0, n, plan.rows)):
        rows = [blocks[r] for blocks in row_blocks]
        valid_rows = min(plan.rows, n - r0)
        rowmask = _valid(rows[0].shape[1], valid_rows, dtype, device).view(1, -1, 1, 1)
        states = [column_states.get(k) for k in range(len(consumers))]
        for c, c0 in enumerate(range(0, width, plan.cols)):
            cols = [blocks[c] for blocks in col_blocks]
            partials = kernel(rows, cols, params, col_masks[c], rowmask)
            at = [slice(c0, c0 + plan.cols) if column else offset + c0 for column in by_column]
            states = [cons.combine(st, p, a) for cons, st, p, a in zip(consumers, states, partials, at)]
        for k, cons in enumerate(consumers):
            if not by_column[k]:
                state = states[k] if sharding is None else sharding.merge(cons, states[k])
                outs = cons.finalize(state, rows[0].shape[1], batch)
                results[k].append(tuple(o[:, :valid_rows] for o in outs))
    for k, state in column_states.items():
        results[k].append(tuple(o[:, :m] for o in consumers[k].finalize(state, width, batch)))
    if not compiled and n * m >= AUTO_COMPILE_MIN_PAIRS:
        kernels.record_eager(formula_key, time.perf_counter() - started)
    return [tuple(torch.cat(parts, 1) for parts in zip(*blocks)) for blocks in results]
