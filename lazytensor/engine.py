"""The tile engine: a chunk plan and one loop that feeds consumers.

``stream(problem, consumers)`` walks row blocks of the i-variables and, inside
each, column blocks of the j-variables; every tile is evaluated once by the
(compiled) tile function and every consumer folds it into O(rows) state.
Nothing of size N x M ever exists: the largest live buffer is one tile,
sized from a memory budget. Several consumers on one pass ("event
streaming") share the formula's evaluation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch

from . import ir, kernels

# Bytes for the widest intermediate of one tile. 4-16 MiB row blocks were
# measured fastest here (cache-resident, big enough for BLAS).
TILE_BUDGET_BYTES = 8 << 20
MAX_TILE_COLS = 4096
MAX_TILE_ROWS = 1024
MIN_TILE_ROWS = 16
# Below this many pairs the eager lowering beats compilation time ("auto").
AUTO_COMPILE_MIN_PAIRS = 1 << 22


@dataclass
class Problem:
    """Variables of one reduction: IR info and their tensors.

    i/j tensors are (B, N, D) / (B, M, D) with B equal to the batch size or 1;
    parameters are (D,). ``order`` fixes the argument order of tile kernels.
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
        sizes = [t.shape[0] for s, t in self.tensors.items() if self.info[s].axis != "p"]
        return max(sizes, default=1)

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

    def canonical(self, exprs: list[sympy.Expr]) -> tuple:
        """A structural key for ``exprs``: symbols renamed by axis and position."""
        rename = {s: ir.make_symbol(f"{self.info[s].axis}{k}_{self.info[s].dim}") for k, s in enumerate(self.order)}
        return tuple(sympy.srepr(e.xreplace(rename)) for e in exprs)


@dataclass(frozen=True)
class TilePlan:
    rows: int
    cols: int


def plan_tiles(problem: Problem, consumers, chunk_size, compiled: bool) -> TilePlan:
    """Tile shape from the memory budget, or from ``chunk_size`` (int or (rows, cols))."""
    n, m = problem.size("i"), problem.size("j")
    if chunk_size is not None:
        rows, cols = (chunk_size, chunk_size) if isinstance(chunk_size, int) else tuple(chunk_size)
        if rows < 1 or cols < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    else:
        width = max([v.dim for v in problem.info.values()] + [c.dim for c in consumers] + [1])
        per_pair = problem.dtype.itemsize * problem.batch * (width + 2)
        cols = min(m, MAX_TILE_COLS)
        rows = max(MIN_TILE_ROWS, min(MAX_TILE_ROWS, TILE_BUDGET_BYTES // (per_pair * cols)))
    if compiled:  # fixed shapes: round small problems up to a power of two, pad the tail
        rows, cols = min(rows, _bucket(n)), min(cols, _bucket(m))
    else:
        rows, cols = min(rows, n), min(cols, m)
    return TilePlan(rows, cols)


def _bucket(size: int) -> int:
    return max(8, 1 << math.ceil(math.log2(max(size, 1))))


def _block(t: torch.Tensor, start: int, stop: int, width: int) -> torch.Tensor:
    """Rows [start, stop) along dim 1, padded to ``width`` by repeating the last row."""
    block = t[:, start:stop]
    short = width - block.shape[1]
    if short > 0:
        block = torch.cat([block, block[:, -1:].expand(-1, short, -1)], 1)
    return block


def use_compiled(backend: str, problem: Problem) -> bool:
    if backend not in ("auto", "compiled", "eager"):
        raise ValueError(f"backend must be 'auto', 'compiled' or 'eager', got {backend!r}")
    if backend == "eager" or not kernels.compile_available() or torch.compiler.is_compiling():
        return False
    if backend == "compiled":
        return True
    return problem.size("i") * problem.size("j") >= AUTO_COMPILE_MIN_PAIRS


def stream(problem: Problem, consumers: list, *, backend: str = "auto", chunk_size=None):
    """One pass over all tiles; returns each consumer's finalized outputs (B, N, ...)."""
    compiled = use_compiled(backend, problem)
    plan = plan_tiles(problem, consumers, chunk_size, compiled)
    key = (
        tuple(c.signature for c in consumers),
        problem.canonical([e for c in consumers for e in c.expressions]),
        tuple(problem.info[s].axis for s in problem.order),
        problem.dtype,
        problem.device.type,
        (plan.rows, plan.cols) if compiled else None,
        problem.batch,
    )
    kernel = kernels.tile_kernel(consumers, problem.info, problem.order, key=key, compiled=compiled)
    i_syms, j_syms, p_syms = (problem.axis_symbols(a) for a in ir.AXES)
    n, m, batch = problem.size("i"), problem.size("j"), problem.batch
    params = [problem.tensors[s] for s in p_syms]
    device = problem.device
    by_column = [c.axis == "j" for c in consumers]  # ColumnSum: its state spans all columns
    results: list[list[tuple]] = [[] for _ in consumers]
    column_states = {k: c.initial_state(batch, m, problem.dtype, device) for k, c in enumerate(consumers) if by_column[k]}
    for r0 in range(0, n, plan.rows):
        r1 = min(r0 + plan.rows, n)
        width = plan.rows if compiled else r1 - r0
        rows = [_block(problem.tensors[s], r0, r1, width) for s in i_syms]
        rowmask = _valid(width, r1 - r0, problem.dtype, device).view(1, width, 1, 1)
        states = [column_states.get(k) for k in range(len(consumers))]
        for c0 in range(0, m, plan.cols):
            c1 = min(c0 + plan.cols, m)
            cwidth = plan.cols if compiled else c1 - c0
            cols = [_block(problem.tensors[s], c0, c1, cwidth) for s in j_syms]
            mask = _valid(cwidth, c1 - c0, problem.dtype, device).view(1, 1, cwidth, 1)
            partials = kernel(rows, cols, params, mask, rowmask)
            where = [slice(c0, c1) if column else c0 for column in by_column]
            states = [c.combine(st, p, at) for c, st, p, at in zip(consumers, states, partials, where)]
        for k, c in enumerate(consumers):
            if not by_column[k]:
                outs = c.finalize(states[k], width, batch)
                results[k].append(tuple(o[:, : r1 - r0] for o in outs))
    for k, state in column_states.items():
        results[k].append(consumers[k].finalize(state, m, batch))
    return [tuple(torch.cat(parts, 1) for parts in zip(*blocks)) for blocks in results]


def _valid(width: int, valid: int, dtype: torch.dtype, device) -> torch.Tensor:
    """1 for the first ``valid`` of ``width`` positions, 0 for padding, in the problem dtype."""
    return (torch.arange(width, device=device) < valid).to(dtype)
