"""The tile engine: one loop that feeds tiles to consumers, and the choice of its route.

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
so a new N, M or bandwidth never recompiles. Tile shapes and block-sparse
schedules come from ``plan``; kernels and the "auto" tier's compile rule
from ``compile``.
"""
from __future__ import annotations

import collections
import functools
import time

import torch

from . import allocator, compile, ir, lower, threads
from .kept import Kept
from .opaque import tracing
from .plan import TilePlan, plan_tiles, tile_schedule
from .problem import Problem

# Under a sharding, row blocks' reduction states are merged across ranks in batches of about
# this many bytes: one collective per batch instead of one per row block (latency dominates
# small all-reduces), with bounded memory (quantile histograms are large).
MERGE_BYTES = 16 << 20
BACKENDS = ("auto", "compiled", "eager")
# An eager tile of fewer rows reads its column blocks where they lie (a (B, D, m) view) instead of a
# features-first copy: the copy is a pass over the block, as much work as a one-row tile's own (one
# query against 200000 points, D = 3, with 4 weight columns: the copies were 2.9 ms of a 4.2 ms product;
# from 4 rows on the copy's contiguous reads paid for it, benchmarks/skinny.py's sizes). Measured on CPU only:
# a GPU keeps its copies.
EAGER_FEATURES_FIRST_MIN_ROWS = 4
# Which route each pass took ("eager", "compiled", "eager, then compiled": the auto tier switched
# mid-pass): tests read it to check the route, never a wall-clock time.
routes: collections.Counter = collections.Counter()


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'compiled' or 'eager', got {backend!r}")
    return backend


def _functorch_active() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None


def use_compiled(backend: str, problem: Problem, formula_key=None) -> bool:
    """Whether a pass without a tier switch runs compiled tiles ("auto": once the formula's eager time paid for it)."""
    check_backend(backend)
    if backend == "eager" or not compile.compile_available() or tracing() or _functorch_active():
        return False
    if backend == "compiled":
        return True
    return compile.worth_compiling(formula_key, problem.size("i") * problem.size("j"), compile.eager_seconds(formula_key),
                                   problem.device)


def _block(t: torch.Tensor, start: int, stop: int, extent: int, fixed: bool, features_first: bool = False) -> torch.Tensor:
    """``t[:, start:stop]``; ``fixed``: a fresh zero-padded buffer of ``extent`` rows (fixed shape and strides).

    ``features_first`` stores the block as (B, D, rows): column blocks are read
    by the tile with the column index innermost, and contiguous loads along it
    are what lets the compiler vectorize the tile (a (m, 3) block read with
    stride 3 runs scalar code, ~3x slower).
    """
    part = t[:, start:stop]
    if not fixed:
        return part.transpose(1, 2).contiguous() if features_first else part
    buffer = t.new_zeros((t.shape[0], t.shape[2], extent) if features_first else (t.shape[0], extent, t.shape[2]))
    (buffer.transpose(1, 2) if features_first else buffer)[:, : part.shape[1]] = part
    return buffer


def _valid(width: int, valid: int, problem: Problem, dim: int) -> torch.Tensor:
    """1 for the first ``valid`` of ``width`` positions, 0 for padding, in the problem dtype, along ``dim``
    of a (1, 1, 1, 1) view (1: the row mask, 2: the column mask).

    Cached (read-only): a pass asks for the same few masks tile after tile, and call after call; a traced
    pass's are the trace's own. ``unpadded`` tells an eager tile's ``reductions.base.masked`` that there is
    nothing to mask without asking the tensor (``mask.all()``: ~25 us a tile)."""
    made = _mask.__wrapped__ if problem.traced else _mask
    return made(width, valid, problem.dtype, problem.device, dim)


@functools.lru_cache(maxsize=256)
def _mask(width: int, valid: int, dtype: torch.dtype, device, dim: int) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = width
    mask = (torch.arange(width, device=device) < valid).to(dtype).view(shape)
    mask.unpadded = valid == width
    return mask


class _Setup:
    """What a pass derives from its consumers and its variables' structure alone, kept for the calls that repeat
    it (``_setup``): the formulas with float constants lifted to parameters (one kernel for every value), the
    constants' values, whether the norm expansion is possible and the kernels' formula keys. A traced pass
    (``Problem.traced``) keeps no tensor here: its constants are the trace's own, and it never expands (the
    finiteness check reads values)."""

    def __init__(self, problem: Problem, consumers):
        self.consumers = consumers
        lifted, self.constant_values = ir.lift_constants([e for c in consumers for e in c.expressions])
        self.exprs, at = [], 0
        for c in consumers:
            self.exprs.append(lifted[at : at + len(c.expressions)])
            at += len(c.expressions)
        self.constants = None  # the lifted constants' tensors, made at the first pass that is not traced
        self.may_expand = lower.may_expand(lifted)
        self.keys: dict[bool, tuple] = {}

    def problem(self, problem: Problem) -> Problem:
        if not self.constant_values:
            return problem
        if problem.traced or self.constants is None:
            values = torch.tensor([v for _, v in self.constant_values], dtype=problem.dtype, device=problem.device)
            constants = {s: (values[k].reshape(1, 1), "p") for k, (s, _) in enumerate(self.constant_values)}
            if problem.traced:
                return problem.extended(constants)
            self.constants = constants
        return problem.extended(self.constants)

    def expand(self, problem: Problem) -> bool:
        """The norm expansion needs finite inputs (inf - inf is NaN where the exact answer is not); checked
        only where a contraction is wide enough for it (the check costs two ATen calls per input)."""
        indexed = (t for s, t in problem.tensors.items() if problem.info[s].axis != "p")
        return self.may_expand and not problem.traced and all(bool(torch.isfinite(t).all()) for t in indexed)

    def formula_key(self, problem: Problem, expand: bool) -> tuple:
        if expand not in self.keys:
            self.keys[expand] = compile.formula_key(problem, self.consumers, self.exprs, expand)
        return self.keys[expand]


_SETUPS = Kept()


def _setup(problem: Problem, consumers) -> _Setup:
    """The pass's ``_Setup``, kept by its consumers (the same objects when a call repeats: ``run._built``),
    its variables' structure and the global state its kernels depend on (``compile.formula_key``)."""
    key = (tuple(consumers), tuple((s, problem.info[s]) for s in problem.order), problem.dtype, problem.device,
           torch.get_default_dtype(),
           torch.is_autocast_enabled(problem.device.type) and torch.get_autocast_dtype(problem.device.type))
    return _SETUPS.get(key, lambda: _Setup(problem, consumers))


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
            merged = cons.finalize(cons.merge_ranks(tuple(torch.cat(ts, 1) for ts in zip(*parts)), sharding), sum(padded), batch)
            blocks = zip(*(o.split(padded, 1) for o in merged))
        else:
            blocks = (cons.finalize(cons.merge_ranks(part, sharding), rows, batch) for part, rows in zip(parts, padded))
        results[k].extend(tuple(o[:, :valid] for o in outs) for outs, (_, _, valid) in zip(blocks, pending))
    pending.clear()


def stream(problem: Problem, consumers: list, *, backend: str = "auto", chunk_size=None, ranges=None, sharding=None):
    """One pass over all tiles; returns each consumer's finalized outputs.

    Consumers reducing over j return (B, N, ...) tensors, column sums (B, M, D).
    ``ranges`` (from ``plan.check_ranges``) restricts the pass to the kept blocks.
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
    if problem.device.type == "cpu":
        allocator.keep_tile_buffers()
    setup = _setup(problem, consumers)
    problem = setup.problem(problem)
    expand = setup.expand(problem)
    formula_key = setup.formula_key(problem, expand)
    loop = _TileLoop(problem, consumers, setup.exprs, formula_key, expand, offset, sharding)
    with threads.pass_threads(problem.device):
        _run(loop, problem, consumers, backend, chunk_size, ranges, formula_key, sizes if sharding is not None else None)
    return loop.results()


def _run(loop: "_TileLoop", problem: Problem, consumers, backend, chunk_size, ranges, formula_key, sizes) -> None:
    """The pass's route: sharded and block-sparse passes on one plan, the others by ``backend`` (``_auto_tier``)."""
    n, sharding = problem.size("i"), loop.sharding
    if problem.traced:  # a compiler traces an inlined reduction (``library``): its graph holds one tile, no loop
        if sharding is not None or ranges is not None:
            raise ValueError("a sharded or block-sparse reduction cannot be traced into a compiled graph")
        loop.run(TilePlan(n, loop.width), False)
        routes["traced"] += 1
    elif sharding is not None:  # every rank must cut the same row blocks, so nothing may depend on its own shard or history
        compiled = use_compiled("eager" if backend == "eager" else "compiled", problem) and (
            backend == "compiled" or n * sum(sizes) >= compile.SHARDED_COMPILE_MIN_PAIRS)
        loop.run(plan_tiles(problem, consumers, chunk_size, compiled, m=max(sizes)), compiled)
        routes["compiled" if compiled else "eager"] += 1
    elif ranges is not None:
        compiled = use_compiled(backend, problem, formula_key)
        plan = plan_tiles(problem, consumers, chunk_size, compiled)
        started = time.perf_counter()
        loop.run_sparse(ranges, plan, compiled, fixed=chunk_size is not None)
        if not compiled and problem.size("i") * problem.size("j") >= compile.AUTO_COMPILE_MIN_PAIRS:
            compile.record_eager(formula_key, time.perf_counter() - started)  # the auto tier compiles it once worth it
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
    projection from its first row block) reaches ``compile.compile_after(device)``
    on a problem of at least ``compile.AUTO_COMPILE_MIN_PAIRS`` pairs has its kernel
    built aside (by a niced child process, ``aot``; in a background thread where
    that is off or fails); the pass switches to it at the next row block once it
    is ready, and later calls start compiled. A kernel an earlier process built
    is loaded from disk at the first call. No call waits for a compile, and a
    cheap or one-off formula never pays for one.
    """
    n, m = problem.size("i"), problem.size("j")
    large = n * m >= compile.AUTO_COMPILE_MIN_PAIRS
    if large or compile.compiled_before(formula_key):  # else no kernel of it can be ready
        compiled_plan = plan_tiles(problem, consumers, chunk_size, True)
        kernel = loop.kernel(compiled_plan, True, create=large)
        if kernel is not None and (kernel.ready or large and kernel.from_disk(loop.example_arguments(compiled_plan))):
            loop.run(compiled_plan, True, kernel=kernel)  # compiled in this process, or by a build it finds on disk
            routes["compiled"] += 1
            return
    if not large:  # too small to compile: eager tiles, without the switch's bookkeeping
        loop.run(plan_tiles(problem, consumers, chunk_size, False), False)
        routes["eager"] += 1
        return
    spent = compile.eager_seconds(formula_key)
    started = time.perf_counter()

    def start_compile(projected: float) -> None:
        nonlocal kernel
        if (kernel is None or kernel.background is None) and compile.worth_compiling(formula_key, n * m, spent + projected,
                                                                                     problem.device):
            kernel = kernel or loop.kernel(compiled_plan, True)
            kernel.compile_in_background(loop.example_arguments(compiled_plan))

    def switch(done_rows: int):
        """After each eager row block: start the compile once the time warrants it; the kernel once it is ready;
        leave its build a core once the formula's eager time says so (``compile.BUILD_CORE_AFTER_SECONDS``).

        Starting it inside the call, not after it, measured better: calls 2-3 at 16384^2 run compiled
        (RBF 0.69 s, k-min 0.18 s) where compiling after call 1 left call 2 eager (5.2 s, 3.9 s)."""
        ran = time.perf_counter() - started
        start_compile(ran * n / max(done_rows, 1))
        ready = kernel is not None and kernel.ready
        leave_core(not ready and kernel is not None and kernel.background is not None
                   and spent + ran >= compile.BUILD_CORE_AFTER_SECONDS)
        return kernel if ready else None

    with compile.eager_pass() as leave_core:
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
        tensors = {s: t.detach() if t.requires_grad else t for s, t in problem.tensors.items()}
        if self.m == 0:
            tensors.update({s: tensors[s].new_zeros(tensors[s].shape[0], 1, tensors[s].shape[2]) for s in self.j_syms})
        self.tensors = tensors
        self.by_column = [c.reduced_axis == "i" for c in consumers]  # column sums: state spans all (local) columns
        self.folds = [lower.folds(c) for c in consumers]  # the tile merges their row state (lower.folds)
        self.outputs: list[list[tuple]] = [[] for _ in consumers]
        self.stored = [0] * len(consumers)  # rows of each consumer's whole-pass buffers written (``_store``)
        dtype, device = problem.dtype, problem.device
        self.column_states = {k: c.initial_state(self.batch, self.width, dtype, device)
                              for k, c in enumerate(consumers) if self.by_column[k]}
        self.pending: list[tuple] = []  # sharded: row blocks' states waiting to be merged across ranks together
        self.pending_bytes = 0

    def kernel(self, plan: TilePlan, compiled: bool, create: bool = True, entries: int | None = None):
        """The tile kernel for ``plan`` (``create=False``: only a cached one, else None); ``entries``: a
        block-sparse tile's batch of blocks (gathered, so its column blocks have their own strides)."""
        shapes = ((plan.rows, plan.cols), tuple(self.tensors[s].shape[0] for s in self.problem.order))
        shapes = None if not compiled else shapes if entries is None else (*shapes, "blocks", entries)
        if not create:
            return compile.cached_kernel(self.formula_key, shapes, compiled)
        return compile.tile_kernel(self.consumers, self.exprs, self.problem.info, self.problem.order,
                                   formula=self.formula_key, shapes=shapes, compiled=compiled, expand=self.expand)

    def _rows(self, plan: TilePlan, compiled: bool, r0: int, r1: int):
        rows = [_block(self.tensors[s], r0, r1, plan.rows, compiled) for s in self.i_syms]
        rowmask = _valid(rows[0].shape[1], r1 - r0, self.problem, 1)
        return rows, rowmask

    def _columns(self, plan: TilePlan, compiled: bool, c0: int, c1: int):
        """The j-blocks (features first) and column mask of [c0, c1)."""
        first = compiled or plan.rows >= EAGER_FEATURES_FIRST_MIN_ROWS or self.problem.device.type != "cpu"
        blocks = [_block(self.tensors[s], c0, c1, plan.cols, compiled, features_first=first) for s in self.j_syms]
        blocks = blocks if first else [b.transpose(1, 2) for b in blocks]
        return blocks, _valid(blocks[0].shape[2], max(0, min(c1, self.m) - c0), self.problem, 2)

    def _row_states(self, rows: int, compiled: bool) -> list:
        """Each consumer's state before a row block's first tile: its column state, else None (it starts from
        its first partial); a folding reduction's empty ``row_state`` for a compiled kernel (which takes the
        same arguments at every tile: merging it into the first partial cost a traced one-tile pass a third of
        its graph)."""
        dtype, device = self.problem.dtype, self.problem.device
        return [self.column_states[k] if self.by_column[k] else cons.row_state(self.batch, rows, dtype, device)
                if self.folds[k] and compiled else None for k, cons in enumerate(self.consumers)]

    def example_arguments(self, plan: TilePlan) -> tuple:
        """A compiled kernel's first tile, copied: what a background compile traces and runs once."""
        rows, rowmask = self._rows(plan, True, 0, min(plan.rows, self.n))
        cols, mask = self._columns(plan, True, 0, min(plan.cols, self.width))
        states = [state if fold else None for fold, state in zip(self.folds, self._row_states(plan.rows, True))]
        return rows, cols, [self.tensors[s].clone() for s in self.p_syms], states, mask, rowmask

    def run(self, plan: TilePlan, compiled: bool, *, kernel=None, start: int = 0, switch=None) -> int:
        """Row blocks from ``start`` on; returns the first row not done (``n`` unless ``switch`` took over)."""
        kernel = kernel or self.kernel(plan, compiled)
        column_blocks: dict[tuple[int, int], tuple] = {}
        params = [self.tensors[s] for s in self.p_syms]
        consumers, by_column, folds = self.consumers, self.by_column, self.folds
        for (r0, r1), column_ranges in tile_schedule(self.n, self.width, plan, start):
            threads.follow_load()
            rows, rowmask = self._rows(plan, compiled, r0, r1)
            states = self._row_states(rows[0].shape[1], compiled)
            for c0, c1 in column_ranges:
                if (c0, c1) not in column_blocks:
                    column_blocks[(c0, c1)] = self._columns(plan, compiled, c0, c1)
                cols, mask = column_blocks[(c0, c1)]
                partials = kernel(rows, cols, params, [st if f else None for st, f in zip(states, folds)], mask, rowmask)
                states = [p if f else cons.combine(st, p, slice(c0, c1) if column else self.offset + c0)
                          for cons, st, p, f, column in zip(consumers, states, partials, folds, by_column)]
            self._finish_rows(states, rows[0].shape[1], r1 - r0)
            if switch is not None and r1 < self.n and switch(r1) is not None:
                return r1
        return self.n

    def run_sparse(self, sparsity, plan: TilePlan, compiled: bool, fixed: bool) -> None:
        """A block-sparse pass (``plan.BlockSparsity``): packed tiles of (row piece, column piece) entries.

        Each tile is a batch of ``per_tile`` blocks, each with its own rows and
        columns, gathered from the variables (zero rows past the end for
        padding; the problem has no batch: ranges refuse one). Row states live
        in one (1, n + 1) buffer (row n takes the padding), gathered before
        each tile and written back after it; column sums are added at their
        columns (padding at column m). Reductions that place indices
        (``combine`` with a column offset) get one block per tile.
        """
        consumers, by_column, folds = self.consumers, self.by_column, self.folds
        if any(column and c.signature[0] != "sum" for c, column in zip(consumers, by_column)):
            raise ValueError("ranges: only sums reduce over the other axis in a block-sparse pass")
        packed = all(f or c.signature[0] == "sum" for c, f in zip(consumers, folds))
        schedule = sparsity.schedule(plan.rows * plan.cols, plan if fixed else None, packed)
        plan, entries = schedule.plan, schedule.per_tile
        dtype, device = self.problem.dtype, self.problem.device
        n, m = self.n, self.m
        i_tensors, j_tensors = self._whole(self.i_syms), [t.T.contiguous() for t in self._whole(self.j_syms)]
        params = [self.tensors[s] for s in self.p_syms]
        kernel = self.kernel(plan, compiled, entries=entries)
        row_steps = torch.arange(plan.rows, device=device)
        self.column_states = {k: c.initial_state(1, m + 1, dtype, device) for k, c in enumerate(consumers) if by_column[k]}
        states = [c.row_state(1, n + 1, dtype, device) if folds[k] else None for k, c in enumerate(consumers)]
        row_start, row_count, pieces, table = (t.to(device) for t in (schedule.row_start, schedule.row_count, schedule.piece,
                                                                       schedule.columns))
        for t, first in enumerate(schedule.first):
            threads.follow_load()
            row_valid = row_steps < row_count[t][:, None]
            at_rows = torch.where(row_valid, row_start[t][:, None] + row_steps, n).flatten()
            at_cols = torch.index_select(table, 0, pieces[t])
            mask, rowmask = (at_cols < m).to(dtype)[:, None, :, None], row_valid.to(dtype)[:, :, None, None]
            at_cols = at_cols.flatten()
            rows = [torch.index_select(x, 0, at_rows).view(entries, plan.rows, -1) for x in i_tensors]
            cols = [torch.index_select(y, 1, at_cols).view(-1, entries, plan.cols).permute(1, 0, 2) for y in j_tensors]
            before = [None if column or (first and not fold) else
                      tuple(torch.index_select(s[0], 0, at_rows).view(entries, plan.rows, *s.shape[2:]) for s in states[k])
                      for k, (fold, column) in enumerate(zip(folds, by_column))]
            partials = kernel(rows, cols, params, [b if f else None for b, f in zip(before, folds)], mask, rowmask)
            for k, cons in enumerate(consumers):
                if by_column[k]:
                    for total, part in zip(self.column_states[k], partials[k]):
                        part = part.expand(entries, plan.cols, *part.shape[2:]).to(total.dtype)
                        total[0].index_add_(0, at_cols, part.flatten(0, 1))
                    continue
                at = 0 if packed else int(schedule.firsts[int(pieces[t][0])])
                new = partials[k] if folds[k] else cons.combine(before[k], partials[k], at)
                if states[k] is None:
                    states[k] = tuple(p.new_empty(1, n + 1, *p.shape[2:]) for p in new)
                for total, part in zip(states[k], new):
                    total[0].index_copy_(0, at_rows, part.expand(entries, plan.rows, *part.shape[2:]).flatten(0, 1))
        for k, cons in enumerate(consumers):
            if not by_column[k]:
                self.outputs[k].append(tuple(o[:, :n] for o in cons.finalize(states[k], n + 1, 1)))

    def _whole(self, symbols) -> list:
        """Variables (n, D) with one zero row past the end: what padded rows and columns of a block read."""
        return [torch.cat([t[0], t.new_zeros(1, t.shape[2])]) for t in (self.tensors[s] for s in symbols)]

    def _finish_rows(self, states, padded: int, valid: int) -> None:
        if self.sharding is None:
            for k, cons in enumerate(self.consumers):
                if not self.by_column[k]:
                    self._store(k, cons.finalize(states[k], padded, self.batch), valid)
            return
        self.pending.append((states, padded, valid))
        self.pending_bytes += sum(_nbytes(st) for st, column in zip(states, self.by_column) if not column)
        if self.pending_bytes >= MERGE_BYTES:
            _merge_ranks(self.sharding, self.consumers, self.by_column, self.pending, self.batch, self.outputs)
            self.pending_bytes = 0

    def _store(self, k: int, outs: tuple, valid: int) -> None:
        """A row block's outputs copied into whole-pass buffers (allocated at the first block; a block of
        every row is kept as it is).

        Kept as one small tensor per block, they landed in the holes the tiles' freed
        buffers left on glibc's heap, one per row block, so the next tile's buffers
        no longer fitted there and the heap grew instead: the quantile's first
        counting pass at 20000^2 grew the process by ~1 GiB (3 MiB a row block)."""
        at = self.stored[k]
        self.stored[k] = at + valid
        if at == 0 and valid == self.n:
            self.outputs[k].append(tuple(o if o.shape[1] == valid else o[:, :valid].contiguous() for o in outs))
            return
        if not self.outputs[k]:
            self.outputs[k].append(tuple(o.new_empty(o.shape[0], self.n, *o.shape[2:]) for o in outs))
        for whole, o in zip(self.outputs[k][0], outs):
            whole[:, at : at + valid].copy_(o[:, :valid])

    def results(self) -> list[tuple]:
        if self.pending:
            _merge_ranks(self.sharding, self.consumers, self.by_column, self.pending, self.batch, self.outputs)
        for k, state in self.column_states.items():
            self.outputs[k].append(tuple(o[:, : self.m] for o in self.consumers[k].finalize(state, self.width, self.batch)))
        return [blocks[0] if len(blocks) == 1 else tuple(torch.cat(parts, 1) for parts in zip(*blocks))
                for blocks in self.outputs]
