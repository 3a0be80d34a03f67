"""Lowering: IR expressions -> the source of one per-tile PyTorch function.

The generated function receives row blocks of the i-variables (B, n, D),
column blocks of the j-variables stored features-first (B, D, m) so that the
tile's innermost (column) loads are contiguous, the parameters (B, D) (float
constants of the formula are parameters too, so a new value reuses the
kernel), the running row states of consumers that fold their merge into
the tile, and the column and row masks. Every node evaluates to a tensor that
broadcasts to (B, n, m, D): i-only nodes keep shape (B, n, 1, D), j-only
nodes (B, 1, m, D), so nothing is computed on the full tile unless it depends
on both indices. Feature contractions become matrix products where their
structure allows (x.y, |x - y|^2 by a centred norm expansion); the
elementwise rest is left for torch.compile to fuse. The consumers' ``partial``
methods are called at the end of the function, so a tile reduction fuses with
the formula that feeds it.

Common subexpressions are shared by memoising nodes: sympy expressions are
hashed structurally, so equal subtrees lower once.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

import sympy
import torch

from . import inductor, ir

# Squared distances with at least this many features use the norm expansion
# |a|^2 + |b|^2 + 2 a.b (one matrix product); below it the direct difference
# is both cheaper once fused and free of cancellation for near points.
# Compiled, N = M = 16384, float32, 2 threads (benchmarks/expansion_threshold.py):
# at D = 8 direct differences take 0.83x the expansion's time for the RBF
# product with 16 columns, 0.67x for logsumexp, 0.79x for its forward +
# backward; at D = 12 and 16 the two are within run-to-run noise.
EXPANSION_MIN_FEATURES = 9

_UNARY = {
    sympy.exp: "exp",  # inductor.tile_exp: torch.exp, except in compiled float32 CPU tiles
    sympy.log: "torch.log",
    sympy.sin: "torch.sin",
    sympy.cos: "torch.cos",
    sympy.tan: "torch.tan",
    sympy.tanh: "torch.tanh",
    sympy.Abs: "torch.abs",
    sympy.sign: "torch.sign",
    ir.Sigmoid: "torch.sigmoid",
    ir.Relu: "torch.relu",
    sympy.asin: "torch.asin",
    sympy.acos: "torch.acos",
    sympy.atan: "torch.atan",
    ir.Floor: "torch.floor",
    ir.XLogX: "torch.special.xlogy",  # xlogy(a, a) = a log a, 0 at 0
}
_RELATIONS = {
    sympy.StrictLessThan: "<",
    sympy.LessThan: "<=",
    sympy.StrictGreaterThan: ">",
    sympy.GreaterThan: ">=",
    sympy.Equality: "==",
    sympy.Unequality: "!=",
}
# Variables as views broadcasting to (B, n, m, D); column blocks arrive features-first (B, D, m).
_VIEWS = {"i": "I[{}].unsqueeze(2)", "j": "J[{}].transpose(1, 2).unsqueeze(1)", "p": "P[{}][:, None, None, :]"}
# The same at chosen pairs: j-variables read at ``columns`` (B, n, S) of each row, (B, n, S, D).
_PAIR_VIEWS = {**_VIEWS, "j": "at_columns(J[{}], columns)"}
_SPECIAL_CONSTANTS = {sympy.oo: "inf", -sympy.oo: "-inf", sympy.zoo: "inf", sympy.nan: "nan"}


class UnsupportedFormula(ValueError):
    """The formula uses a construct the lowering does not know."""


def exact_distances(exprs: Sequence[sympy.Expr]) -> set[sympy.Expr]:
    """Contractions under a fractional or negative power or a log: their cancellation would be amplified.

    The norm expansion of |x - y|^2 has an absolute error of a few ulps of
    |x|^2; under exp(-g d^2) that is harmless, under sqrt it turns a zero
    distance into sqrt(eps), under 1/d^2 or log d^2 it is unbounded. These
    keep the direct difference, also inside a sum (sqrt(d^2 + 1e-20)).
    """
    found = set()
    for e in exprs:
        for node in sympy.preorder_traversal(e):
            fractional = isinstance(node, sympy.Pow) and not node.exp.is_Integer
            if fractional or isinstance(node, ir.ZeroSafePow) or ir.unbounded_at_zero(node):
                found.update(f for term in sympy.Add.make_args(node.args[0]) for f in sympy.Mul.make_args(term)
                             if isinstance(f, ir.FSum))
    return found


class TileSource:
    """Builds the text of one tile function; ``emit`` returns a local name."""

    def __init__(self, info: dict[sympy.Symbol, ir.VarInfo], order: Sequence[sympy.Symbol], *,
                 expand: bool = True, exact: set = frozenset(), pairs: bool = False, eager: bool = False):
        self.info = info
        self.expand, self.exact = expand and not pairs, exact
        self.eager = eager and not pairs  # no compiler will fuse the tile: avoid (n, m, D) intermediates
        self.pairs = pairs  # j-variables gathered per row: contractions stay elementwise (no matmul)
        self.lines: list[str] = []
        self.names: dict[sympy.Expr, str] = {}
        self._fresh = (f"t{k}" for k in itertools.count())
        counters = {"i": 0, "j": 0, "p": 0}
        for sym in order:
            axis = info[sym].axis
            slot = counters[axis]
            counters[axis] += 1
            name = f"{axis}{slot}"
            self.lines.append(f"{name} = {(_PAIR_VIEWS if pairs else _VIEWS)[axis].format(slot)}")
            self.names[sym] = name

    def _assign(self, expr: sympy.Expr, code: str) -> str:
        name = next(self._fresh)
        self.lines.append(f"{name} = {code}")
        self.names[expr] = name
        return name

    def emit(self, expr: sympy.Expr) -> str:
        if expr in self.names:
            return self.names[expr]
        if ir.is_constant(expr):
            return self._constant(expr)
        return self._assign(expr, self._code(expr))

    @staticmethod
    def _constant(expr: sympy.Expr) -> str:
        if expr in (sympy.true, sympy.false):
            return repr(bool(expr))
        if expr in _SPECIAL_CONSTANTS:
            return _SPECIAL_CONSTANTS[expr]
        value = complex(expr.evalf())
        if value.imag != 0:  # sqrt(-1) and the like: nan, as torch's real functions give
            return "nan"
        real = value.real
        return repr(real) if math.isfinite(real) else ("nan" if math.isnan(real) else ("inf" if real > 0 else "-inf"))

    def _code(self, e: sympy.Expr) -> str:  # noqa: C901 - one dispatch table
        if isinstance(e, sympy.Add):
            return " + ".join(self.emit(a) for a in e.args)
        if isinstance(e, sympy.Mul):
            return " * ".join(self.emit(a) for a in e.args)
        if isinstance(e, sympy.Pow):
            return self._pow(*e.args)
        if isinstance(e, ir.ZeroSafePow):
            b = self.emit(e.args[0])
            return f"torch.where({b} == 0, 0.0, {self._pow(*e.args)})"
        if isinstance(e, ir.FSum):
            return self._fsum(e.args[0], int(e.args[1]), e)
        for func, torch_name in _UNARY.items():
            if isinstance(e, func):
                a = self.emit(e.args[0])
                return f"{torch_name}({a}, {a})" if func is ir.XLogX else f"{torch_name}({a})"
        if isinstance(e, (ir.VectorOp, ir.Round, ir.SinXDivXDiff, ir.Atan2, sympy.atan2)):
            return self._special(e)
        if isinstance(e, (ir.Step, sympy.Heaviside)):
            a = self.emit(e.args[0])
            half = self.emit(e.args[1]) if len(e.args) > 1 else "0.0"
            return f"torch.where({a} > 0, 1.0, torch.where({a} == 0, {half}, 0.0)).to({a}.dtype)"
        if isinstance(e, ir.IsNaN):
            a = self.emit(e.args[0])
            return f"torch.isnan({a}).to({a}.dtype)"
        if isinstance(e, sympy.DiracDelta):
            return f"torch.zeros_like({self.emit(e.args[0])})"
        if isinstance(e, ir.Clamp):
            a, lo, hi = (self._tensor(x) for x in e.args)
            return f"torch.minimum(torch.maximum({a}, {lo}), {hi})"
        if isinstance(e, ir.InRange):
            a, lo, hi = (self.emit(x) for x in e.args)
            return f"(({a} >= {lo}) & ({a} <= {hi})).to({a}.dtype)"
        if isinstance(e, (sympy.Max, sympy.Min)):
            fn = "torch.maximum" if isinstance(e, sympy.Max) else "torch.minimum"
            code = self._tensor(e.args[0])
            for a in e.args[1:]:
                code = f"{fn}({code}, {self._tensor(a)})"
            return code
        if isinstance(e, ir.Select):
            cond, a, b = e.args
            return f"torch.where({self.emit(cond)}, {self._tensor(a)}, {self._tensor(b)})"
        if isinstance(e, sympy.Piecewise):  # sympy's own rewrites may still make one
            *cases, (last, last_cond) = e.args
            if last_cond != sympy.true:
                raise UnsupportedFormula(f"piecewise without a default branch: {e}")
            code = self._tensor(last)
            for value, cond in reversed(cases):
                code = f"torch.where({self.emit(cond)}, {self._tensor(value)}, {code})"
            return code
        for rel, op in _RELATIONS.items():
            if isinstance(e, rel):
                return f"({self.emit(e.lhs)} {op} {self.emit(e.rhs)})"
        if isinstance(e, sympy.And):
            return " & ".join(f"({self.emit(a)})" for a in e.args)
        if isinstance(e, sympy.Or):
            return " | ".join(f"({self.emit(a)})" for a in e.args)
        if isinstance(e, sympy.Not):
            return f"~({self.emit(e.args[0])})"
        raise UnsupportedFormula(f"cannot lower {type(e).__name__}: {e}")

    def _tensor(self, e: sympy.Expr) -> str:
        """A node as a tensor of the problem's dtype even when it is a constant (where/maximum)."""
        name = self.emit(e)
        return name if not ir.is_constant(e) else f"torch.full((), {name}, dtype=mask.dtype, device=mask.device)"

    def _pow(self, base: sympy.Expr, exp: sympy.Expr) -> str:
        b = self.emit(base)
        if exp.is_Number:
            special = {
                2: f"torch.square({b})",
                -1: f"torch.reciprocal({b})",
                sympy.Rational(1, 2): f"torch.sqrt({b})",
                sympy.Rational(-1, 2): f"torch.rsqrt({b})",
                -2: f"torch.reciprocal(torch.square({b}))",
                sympy.Rational(3, 2): f"({b} * torch.sqrt({b}))",
                sympy.Rational(-3, 2): f"(torch.rsqrt({b}) / {b})",
            }
            if exp in special:
                return special[exp]
            if exp.is_Integer:
                return f"({b} ** {int(exp)})"
            return f"torch.pow({b}, {float(exp)})"
        return f"torch.pow({self._tensor(base)}, {self.emit(exp)})"

    # -- rounding, sinc, atan2 and the feature-vector nodes ------------------------
    def _special(self, e: sympy.Expr) -> str:  # noqa: C901 - one dispatch table
        if isinstance(e, (ir.Atan2, sympy.atan2)):
            return f"torch.atan2({self._tensor(e.args[0])}, {self._tensor(e.args[1])})"
        if isinstance(e, ir.SinXDivXDiff):  # the Taylor series near 0, the closed form elsewhere
            a = self.emit(e.args[0])
            near = f"{a}.abs() < {ir.SERIES_RADIUS!r}"
            return f"torch.where({near}, {self._tensor(e.series(e.args[0]))}, {self._tensor(e.expansion(e.args[0]))})"
        if isinstance(e, ir.Round):  # torch.round takes halves to even; KeOps (C's round) away from zero
            scale = 10.0 ** int(e.args[1])
            v = self._assign(sympy.Dummy(), f"{self._tensor(e.args[0])} * {scale!r}")
            t = self._assign(sympy.Dummy(), f"torch.trunc({v})")
            return f"torch.where(({v} - {t}).abs() == 0.5, {t} + torch.sign({v}), torch.round({v})) / {scale!r}"
        a = self._tensor(e.args[0])
        if isinstance(e, ir.FeatureMin):
            return f"{a}.amin(-1, keepdim=True)"
        if isinstance(e, ir.FeatureArgMin):
            return f"torch.argmin({a}, dim=-1, keepdim=True).to({a}.dtype)"
        if isinstance(e, ir.OneHot):
            size = int(e.args[1])
            return f"(torch.floor({a} + 0.5) == torch.arange({size}, dtype={a}.dtype, device={a}.device)).to({a}.dtype)"
        index = [int(m) for m in e.args[1]]
        if ir.feature_dim(e.args[0], self.info) == 1:  # a size-1 value is read at every position
            a = f"{a}.expand(*{a}.shape[:-1], {len(index)})"
            if isinstance(e, ir.Gather):
                return a
        if isinstance(e, ir.Gather):
            return _gather_code(a, index)
        return _scatter_code(a, index, int(e.args[2]))

    # -- feature contractions -------------------------------------------------
    def _fsum(self, arg: sympy.Expr, width: int, node: sympy.Expr) -> str:
        """The sum over ``width`` features of ``arg`` (a size-1 ``arg`` counts ``width`` times)."""
        if ir.axes_of(arg, self.info) == {"i", "j"}:
            if isinstance(arg, sympy.Add):  # linearity: contract each term on its own
                return " + ".join(self.emit(ir.FSum(t, width)) for t in arg.args)
            if isinstance(arg, sympy.Mul) and not self.pairs:
                left, mixed, right = ir.split_product(arg, self.info)
                if mixed == 1:
                    return self._dot(left, right, width)
            if isinstance(arg, sympy.Pow) and arg.exp == 2 and isinstance(arg.base, sympy.Add):
                sides = self._split_sum(arg.base)
                if sides is not None and width >= EXPANSION_MIN_FEATURES and self.expand and node not in self.exact:
                    return self._sqdist(*sides, width)
                if sides is not None and self.eager and width < EXPANSION_MIN_FEATURES:
                    return self._sqdist_by_feature(*sides, width)
        value = self.emit(arg)
        if ir.feature_dim(arg, self.info) == 1:
            return value if width == 1 else f"({width} * {value})"
        return f"{value}.sum(-1, keepdim=True)"

    def _split_sum(self, base: sympy.Add):
        left, right = [], []
        for term in base.args:
            axes = ir.axes_of(term, self.info)
            if axes == {"i", "j"}:
                return None
            (right if axes == {"j"} else left).append(term)
        return sympy.Add(*left), sympy.Add(*right)

    def _rows(self, expr: sympy.Expr, width: int) -> str:
        """An i-side node as (B, n, D) and a j-side node as (B, m, D) (constants: the i side)."""
        name = self.emit(expr)
        if ir.is_constant(expr):
            name = f"torch.full((1, 1, 1, 1), {name}, dtype=mask.dtype, device=mask.device)"
        code = f"{name}[:, 0]" if "j" in ir.axes_of(expr, self.info) else f"{name}[:, :, 0]"
        if ir.feature_dim(expr, self.info) == 1 and width > 1:
            code = f"{code}.expand(-1, -1, {width})"
        return code

    def _dot(self, left: sympy.Expr, right: sympy.Expr, width: int) -> str:
        a, b = self._rows(left, width), self._rows(right, width)
        return f"torch.matmul({a}, {b}.transpose(-1, -2)).unsqueeze(-1)"

    def _sqdist_by_feature(self, left: sympy.Expr, right: sympy.Expr, width: int) -> str:
        """|l + r|^2 as a sum of (n, m) squares, one per feature (``squares_by_feature``): the direct
        difference (exact near 0) without the (n, m, D) broadcast that an eager tile would write and read
        three times (a standalone microbenchmark, 1000 x 1000, D = 3, one thread: 24.7 ms broadcast,
        5.5 ms by feature, cdist 4.3 ms)."""
        negated = right.could_extract_minus_sign()  # x - y: subtract y, not add a negated copy of its block
        a = self._assign(sympy.Dummy(), self._rows(left, width))
        b = self._assign(sympy.Dummy(), self._rows(-right if negated else right, width))
        return f"squares_by_feature({a}, {b}, {negated})"

    def _sqdist(self, left: sympy.Expr, right: sympy.Expr, width: int) -> str:
        """|l + r|^2 = |a|^2 + |b|^2 + 2 a.b with a = l + c, b = r - c, c the mean of r's real columns.

        Centring on the column block keeps the expansion's cancellation error
        relative to the points' spread, not to their distance from the origin.
        """
        right_rows = self._assign(sympy.Dummy(), self._rows(right, width))
        centre = self._assign(sympy.Dummy(), f"({right_rows} * mask[:, 0]).sum(1, keepdim=True) / mask.sum()")  # real columns
        a = self._assign(sympy.Dummy(), f"{self._rows(left, width)} + {centre}")
        b = self._assign(sympy.Dummy(), f"{right_rows} - {centre}")
        cross = f"torch.matmul({a}, {b}.transpose(-1, -2))"
        sq_a = f"torch.square({a}).sum(-1, keepdim=True)"
        sq_b = f"torch.square({b}).sum(-1).unsqueeze(1)"
        return f"({sq_a} + {sq_b} + 2.0 * {cross}).clamp_min(0.0).unsqueeze(-1)"


def _contiguous(index: list[int]) -> bool:
    return index == list(range(index[0], index[0] + len(index)))


def _groups(index: list[int], size: int):
    """(blocks, repeats) when ``index`` is each of ``size`` positions repeated in place or tiled."""
    reps = len(index) // size if size and len(index) % size == 0 else 0
    if reps and index == [m // reps for m in range(len(index))]:
        return "repeat", reps
    if reps and index == [m % size for m in range(len(index))]:
        return "tile", reps
    return None, 0


def _gather_code(a: str, index: list[int]) -> str:
    """out[..., m] = a[..., index[m]]: a slice, a repeat, a tiling, or an index_select."""
    if _contiguous(index):
        return f"{a}[..., {index[0]}:{index[0] + len(index)}]"
    kind, reps = _groups(index, max(index) + 1)
    if kind == "repeat":
        return f"{a}[..., :{max(index) + 1}].repeat_interleave({reps}, dim=-1)"
    if kind == "tile":
        return f"{a}[..., :{max(index) + 1}].repeat(1, 1, 1, {reps})"
    return f"torch.index_select({a}, -1, torch.tensor({index}, device={a}.device))"


def _scatter_code(a: str, index: list[int], size: int) -> str:
    """out[..., k] = sum of a[..., m] with index[m] == k: a zero pad, a group sum, or an index_add."""
    if _contiguous(index) and len(set(index)) == len(index):
        return f"torch.nn.functional.pad({a}, ({index[0]}, {size - index[0] - len(index)}))"
    kind, reps = _groups(index, size)
    if kind == "repeat":
        return f"{a}.unflatten(-1, ({size}, {reps})).sum(-1)"
    if kind == "tile":
        return f"{a}.unflatten(-1, ({reps}, {size})).sum(-2)"
    return f"{a}.new_zeros(*{a}.shape[:-1], {size}).index_add(-1, torch.tensor({index}, device={a}.device), {a})"


def squares_by_feature(a: torch.Tensor, b: torch.Tensor, subtract: bool = False) -> torch.Tensor:
    """sum_k (a[:, i, k] + b[:, j, k])^2 (``subtract``: a - b) as (B, n, m, 1), for rows a (B, n, D) and columns
    b (B, m, D).

    Eager tiles only: each feature's difference is squared and accumulated in
    place, so the sum costs D tile buffers and 2D passes where separate
    square and add ops cost 3D - 1 of each (a standalone script, one
    128 x 1024 tile, D = 8, 2 threads: 0.49 -> 0.24 ms). Subtracting saves
    negating the column block first, a pass as long as a one-row tile's own."""
    total = None
    for a_k, b_k in zip(a.unbind(-1), b.unbind(-1)):  # views by method calls: indexing costs ~3 us a view
        d = a_k.unsqueeze(2) - b_k.unsqueeze(1) if subtract else a_k.unsqueeze(2) + b_k.unsqueeze(1)
        total = d.mul_(d) if total is None else total.addcmul_(d, d)
    if total is None:  # D = 0: an empty sum
        return a.new_zeros(a.shape[0], a.shape[1], b.shape[1], 1)
    return total.unsqueeze(-1)


def at_columns(block: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """A column block (B, D, m) read at ``columns`` (B', n, S) of each row: (B', n, S, D)."""
    batch, n, picks = columns.shape
    width = block.shape[1]
    rows = block.unsqueeze(1).expand(batch, n, width, block.shape[2])
    return torch.gather(rows, 3, columns.unsqueeze(2).expand(batch, n, width, picks)).transpose(2, 3)


def _pairs_function(name: str, exprs, info, order) -> list[str]:
    """Lines of ``name(columns)``: ``exprs`` at the pairs (i, columns[i, s]) of the tile, (B, n, S, C) each.

    A consumer that selects a few entries per row recomputes them from the
    points instead of reading them from the tile, so the tile is never stored.
    """
    src = TileSource(info, order, pairs=True)
    values = [src.emit(e) for e in exprs]
    return [f"def {name}(columns):", *(f"    {line}" for line in src.lines), f"    return [{', '.join(values)}]"]


def may_expand(exprs) -> bool:
    """Whether ``exprs`` contract a squared difference over at least EXPANSION_MIN_FEATURES features:
    only then does the lowering consider the norm expansion, and a pass check its inputs are finite."""
    return any(_widest_contraction(e) >= EXPANSION_MIN_FEATURES for e in exprs)


@functools.lru_cache(maxsize=1024)
def _widest_contraction(expr: sympy.Expr) -> int:
    return max((int(node.args[1]) for node in expr.atoms(ir.FSum)), default=0)


def folds(consumer) -> bool:
    """Whether the tile function merges ``consumer``'s partial into its running row state ``S[k]``."""
    return consumer.folds and consumer.reduced_axis == "j"


def tile_function_source(consumers, exprs, info, order, *, expand: bool = True, eager: bool = False) -> str:
    """Text of ``tile(I, J, P, S, mask, rowmask)`` returning every consumer's partial (or state, if it ``folds``).

    ``exprs[k]`` are the expressions consumer k needs (its ``expressions``
    with float constants lifted to parameters); ``S[k]`` is the running row
    state of a consumer that ``folds`` (None for the others). A consumer that
    ``reads_pairs`` also gets a function evaluating them at chosen pairs; one
    that ``compares_values`` gets its contractions as direct differences.
    """
    exact = exact_distances([e for es in exprs for e in es]) | {
        node for k, c in enumerate(consumers) if c.compares_values
        for e in exprs[k] for node in sympy.preorder_traversal(e) if isinstance(node, ir.FSum)}
    src = TileSource(info, order, expand=expand, exact=exact, eager=eager)
    outputs = []
    for k, consumer in enumerate(consumers):
        values = [src.emit(e) for e in exprs[k]]
        which = consumer.tile_masks
        if consumer.reads_pairs:
            src.lines.extend(_pairs_function(f"at{k}", exprs[k], info, order))
            which += f", at{k}"
        partial = f"C{k}.partial([{', '.join(values)}], {which})"
        src.lines.append(f"c{k} = C{k}.combine(S[{k}], {partial}, 0)" if folds(consumer) else f"c{k} = {partial}")
        outputs.append(f"c{k}")
    body = "\n".join("    " + line for line in src.lines)
    return f"def tile(I, J, P, S, mask, rowmask):\n{body}\n    return ({', '.join(outputs)},)\n"


def build_tile_function(consumers, exprs, info, order, label: str, *, expand: bool = True, eager: bool = False):
    """The tile function; ``eager``: lowered for eager execution (no compiler fuses it)."""
    return tile_function(tile_function_source(consumers, exprs, info, order, expand=expand, eager=eager), consumers, label)


def tile_function(source: str, consumers, label: str):
    """The function ``source`` defines, with the names it calls (another process rebuilds a kernel from these)."""
    namespace = {"torch": torch, "exp": inductor.tile_exp, "inf": math.inf, "nan": math.nan, "at_columns": at_columns,
                 "squares_by_feature": squares_by_feature,
                 **{f"C{k}": c for k, c in enumerate(consumers)}}
    exec(compile(source, f"<lazytensor:{label}>", "exec"), namespace)
    fn = namespace["tile"]
    fn.source = source
    return fn
