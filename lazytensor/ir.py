"""The formula IR: sympy expressions over whole-variable symbols.

A symbol stands for a whole feature vector (an i-row, a j-row or a parameter
vector); elementwise operations broadcast over features exactly like torch
(a feature size of 1 broadcasts). Feature contractions are the opaque
function ``FSum(arg, width)``: the sum over the ``width`` features of ``arg``
broadcast to that width, so a squared distance stays one node,
``FSum((x - y)**2, D)``, instead of D unrolled terms, and a size-1 term inside
a contraction counts D times, as in torch. sympy gives us canonical forms,
structural sharing and exact local derivatives (chained into reverse- and
forward-mode formulas by ``diff``). Besides the node vocabulary (its
elementwise nodes live in ``elementwise``) this module holds the queries the
lowering asks of an expression (feature size, axes, product structure for
matrix-product sums, constants to lift).
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import sympy

# sympy imports these on its first sum or product (inside Add/Mul.flatten): ~40 ms, mostly
# sympy.combinatorics, that a process's first reduction would otherwise pay; imported with us instead.
import sympy.calculus.accumulationbounds  # noqa: F401
import sympy.matrices.expressions  # noqa: F401
import sympy.tensor.tensor  # noqa: F401

from .elementwise import (  # noqa: F401 - the IR's vocabulary: the lowering and diff name them as ir.<node>
    SERIES_RADIUS,
    Atan2,
    Clamp,
    Floor,
    InRange,
    IsNaN,
    Relu,
    Round,
    Select,
    Sigmoid,
    SinXDivXDiff,
    Step,
    XLogX,
    ZeroSafePow,
    indicator,
    sinxdivx,
)

AXES = ("i", "j", "p")
FLIPPED = {"i": "j", "j": "i", "p": "p"}  # each axis with i and j exchanged (reducing over i, transposing)


class VarInfo(NamedTuple):
    """What the IR knows about a variable: its axis and feature size (a tuple: built and hashed on every
    formula operation: 0.25 us to build and hash against a frozen dataclass's 0.49 us)."""

    axis: str  # "i", "j" or "p"
    dim: int


def make_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, real=True)


_created = itertools.count()
_FRESH = 1 << 40  # fresh symbols sort after every formula position


@functools.lru_cache(maxsize=None)
def position_symbol(position: int) -> sympy.Symbol:
    """The symbol of a formula's ``position``-th variable.

    Formulas name their variables by position, not by identity: the same
    formula written again on new tensors is the same sympy expression, so
    sympy's caches, the engine's analyses and the kernel cache hit on every
    call after the first (a small problem's per-call cost was mostly sympy
    redoing that work for fresh symbols). Operands are aligned on their merged
    variables (``variables.aligned``) before they combine.
    """
    return make_symbol(f"x{position}")


def new_variable_symbol() -> sympy.Symbol:
    """A fresh symbol for a variable the engine adds to a problem (a cotangent, a selected rank)."""
    return make_symbol(f"v{next(_created)}")


def derived_symbol(index: int) -> sympy.Symbol:
    """The ``index``-th variable a derivative pass adds (a cotangent, a saved output, a softmax placeholder).

    Numbered per pass, after every such symbol the pass already holds
    (``autograd._Collector``), not from a global count: the same backward
    builds the same formulas each call, so sympy's caches, the derivative
    caches and the engine's hit, as they do for formula positions.
    """
    return make_symbol(f"d{index}")


def creation_index(sym: sympy.Symbol) -> int:
    """Kernel argument order: formula positions first, then fresh symbols in creation order, then derived ones."""
    digits = sym.name[1:]
    if not digits.isdigit():
        return -1
    return int(digits) + {"v": _FRESH, "d": 2 * _FRESH}.get(sym.name[0], 0)


def derived_index(sym: sympy.Symbol) -> int:
    """``derived_symbol``'s index of ``sym``; -1 for any other symbol."""
    return int(sym.name[1:]) if sym.name[0] == "d" and sym.name[1:].isdigit() else -1


class FSum(sympy.Function):
    """Sum over the feature axis of ``arg`` broadcast to ``width`` features: (..., D) -> (..., 1)."""

    nargs = 2

    def _eval_is_extended_real(self):  # a sum of real features (variables are real symbols): sympy compares it
        return True

    @classmethod
    def eval(cls, arg, width):
        if arg == 0:  # structural: ``is_zero`` would run sympy's assumption system on every contraction
            return sympy.Integer(0)
        if is_constant(arg):  # a constant: sympy folded x - x + 1, or a bare number
            return arg * width
        return None


def feature_sum(arg: sympy.Expr, width: int) -> sympy.Expr:
    """The contraction of ``arg`` over ``width`` features (its width before sympy folded it)."""
    return FSum(arg, sympy.Integer(width))


# -- feature-vector operations: nodes that move or combine features --------------------------
class VectorOp(sympy.Function):
    """A node that is not elementwise over features (indexing, scatter, one-hot, feature min).

    It knows its feature size (``width``) and its derivatives as IR: the
    cotangent of each argument from the node's cotangent (``pullback``, None
    where none flows) and the node's tangent from its arguments' tangents
    (``pushforward``). ``vjp``, ``jvp`` and ``feature_dim`` use only these, so
    matrix-vector products, tensor products, concatenation or tensordot built
    from the few nodes below get derivatives of any order for free.
    """

    def _eval_is_extended_real(self):  # moves or combines real features: real, so sympy compares it and takes abs
        return True

    def width(self, info) -> int:
        raise NotImplementedError

    def pullback(self, k: int, cot: sympy.Expr, info):
        raise NotImplementedError

    def pushforward(self, tangents: list, info) -> sympy.Expr:
        raise NotImplementedError


def is_constant(expr: sympy.Expr) -> bool:
    """A scalar constant: no variables and no feature-vector node (those may be non-uniform vectors)."""
    return not expr.free_symbols and not expr.atoms(VectorOp)


def index_tuple(values) -> sympy.Tuple:
    return sympy.Tuple(*(sympy.Integer(int(v)) for v in values))


def _broadcast_cot(cot: sympy.Expr, arg: sympy.Expr, uses: int, info) -> sympy.Expr:
    """A size-1 argument read at ``uses`` positions gets the sum of their cotangents."""
    return feature_sum(cot, uses) if feature_dim(arg, info) == 1 and uses > 1 else cot


class Gather(VectorOp):
    """Features ``index`` of ``arg``: out[m] = arg[index[m]] (elem, extract, tensor products)."""

    nargs = 2

    @classmethod
    def eval(cls, arg, index):
        if is_constant(arg):
            return arg  # a scalar constant is the same at every position
        if isinstance(arg, Gather):
            inner = arg.args[1]  # one position is a size-1 value that broadcasts: any index reads it
            return Gather(arg.args[0], sympy.Tuple(*(inner[0 if len(inner) == 1 else int(m)] for m in index)))
        return None

    def width(self, info) -> int:
        return len(self.args[1])

    def pullback(self, k, cot, info):
        arg, index = self.args
        if feature_dim(arg, info) == 1:  # every position reads the one value
            return _broadcast_cot(cot, arg, len(index), info)
        return Scatter(cot, index, sympy.Integer(feature_dim(arg, info)))

    def pushforward(self, tangents, info):
        return Gather(tangents[0], self.args[1])


class Scatter(VectorOp):
    """The adjoint of Gather: out[k] = sum of arg[m] over m with index[m] == k, ``size`` features."""

    nargs = 3

    @classmethod
    def eval(cls, arg, index, size):
        if arg.is_zero:
            return sympy.Integer(0)
        if tuple(int(m) for m in index) == tuple(range(int(size))):
            return arg
        return None

    def width(self, info) -> int:
        return int(self.args[2])

    def pullback(self, k, cot, info):
        arg, index, _ = self.args
        return _broadcast_cot(Gather(cot, index), arg, len(index), info)

    def pushforward(self, tangents, info):
        return Scatter(tangents[0], *self.args[1:])


class _PiecewiseConstant(VectorOp):
    """An op whose value is locally constant in its arguments: derivative 0 (no pullback, zero tangent)."""

    def pullback(self, k, cot, info):
        return None

    def pushforward(self, tangents, info):
        return sympy.Integer(0)


class OneHot(_PiecewiseConstant):
    """``size`` features, 1 at position round(arg) (KeOps: floor(arg + 0.5)), else 0; derivative 0."""

    nargs = 2

    def width(self, info) -> int:
        return int(self.args[1])


class FeatureArgMin(_PiecewiseConstant):
    """The first position of the smallest feature of ``arg`` (as a number); derivative 0."""

    nargs = 1

    def width(self, info) -> int:
        return 1


class FeatureMin(VectorOp):
    """The smallest feature of ``arg``; its derivatives flow to the first smallest feature."""

    nargs = 1

    def width(self, info) -> int:
        return 1

    def _selector(self, info) -> sympy.Expr:
        arg = self.args[0]
        size = feature_dim(arg, info)
        return sympy.Integer(1) if size == 1 else OneHot(FeatureArgMin(arg), sympy.Integer(size))

    def pullback(self, k, cot, info):
        return cot * self._selector(info)

    def pushforward(self, tangents, info):
        size = feature_dim(self.args[0], info)
        picked = tangents[0] * self._selector(info)
        return picked if size == 1 else feature_sum(picked, size)


LOGICAL = (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction, sympy.logic.boolalg.BooleanAtom)


def numeric(expr: sympy.Expr) -> sympy.Expr:
    """A comparison or logical formula as a number: 1 where it holds, else 0."""
    if isinstance(expr, LOGICAL):
        if expr == sympy.true:
            return sympy.Integer(1)
        if expr == sympy.false:
            return sympy.Integer(0)
        return indicator(expr)
    return expr


def condition(expr: sympy.Expr):
    """A formula used as a condition: itself if boolean, else ``expr != 0``."""
    if isinstance(expr, LOGICAL):
        return expr
    if isinstance(expr, Select) and expr.args[1:] == (1, 0):
        return expr.args[0]  # an indicator: back to its condition
    return sympy.Ne(expr, 0)


def feature_dim(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]) -> int:
    """Feature size of an expression, with torch broadcasting rules. Cached: formulas repeat."""
    return _feature_dim(expr, tuple(info.items()))


@functools.lru_cache(maxsize=4096)
def _feature_dim(expr: sympy.Expr, info: tuple) -> int:
    return _width(expr, dict(info))


def _width(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]) -> int:
    if isinstance(expr, sympy.Symbol):
        return info[expr].dim
    if isinstance(expr, VectorOp):
        return expr.width(info)
    if isinstance(expr, FSum) or is_constant(expr):
        return 1
    # a constant feature vector (concat of numbers: a Scatter of a constant) counts as much as a variable
    dims = {_width(a, info) for a in expr.args if isinstance(a, sympy.Basic) and not is_constant(a)}
    dims.discard(1)
    if len(dims) > 1:
        raise ValueError(f"feature sizes {sorted(dims)} do not broadcast in {expr}")
    return dims.pop() if dims else 1


def axes_of(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]) -> frozenset[str]:
    """The indexed axes ('i', 'j') an expression depends on."""
    return frozenset(info[s].axis for s in expr.free_symbols if info[s].axis != "p")


def split_product(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]):
    """Split a product into (i-or-constant factors, mixed factors, j-only factors)."""
    return _split(expr.args if isinstance(expr, sympy.Mul) else (expr,), info)


def _split(factors, info):
    left, mixed, right = [], [], []
    for f in factors:
        axes = axes_of(f, info)
        if axes == {"i", "j"}:
            mixed.append(f)
        elif axes == {"j"}:
            right.append(f)
        else:
            left.append(f)
    return sympy.Mul(*left), sympy.Mul(*mixed), sympy.Mul(*right)


MAX_DISTRIBUTED_TERMS = 64


def unbounded_at_zero(node: sympy.Expr) -> bool:
    """A node that may be arbitrarily large for finite arguments: a negative (or symbolic) power or a log.

    Near a zero argument such a node amplifies any rounding error of that
    argument without bound, so expansions that trade exactness for speed (the
    norm expansion, distributing differences) cannot be trusted under it.
    """
    if isinstance(node, sympy.Pow):
        return not (node.exp.is_Number and node.exp > 0)
    if isinstance(node, ZeroSafePow):
        return not (node.args[1].is_Number and node.args[1] > 0)
    return isinstance(node, sympy.log)


def _singular(factor: sympy.Expr, info) -> bool:
    """A factor depending on both axes that may be unbounded where x_i ~ y_j (a 1/|x_i - y_j| in a gradient)."""
    if axes_of(factor, info) != {"i", "j"}:
        return False
    return any(unbounded_at_zero(n) and axes_of(n, info) == {"i", "j"} for n in sympy.preorder_traversal(factor))


def _products(expr: sympy.Expr, info) -> list[list[sympy.Expr]]:
    """``expr`` as factor lists whose products sum to it: products distributed over sums.

    Our own distribution (sympy's ``expand`` spends milliseconds per call in
    ``as_numer_denom``); a product that would exceed MAX_DISTRIBUTED_TERMS
    terms keeps its sums as factors, and so does a product with a singular
    mixed factor c: c (x_i - y_j) distributed is x_i c - c y_j, two terms that
    cancel catastrophically where c is huge (c ~ 1/|x_i - y_j| on the diagonal
    of K(X, X)), while the direct difference is exactly 0 there.
    """
    if isinstance(expr, sympy.Add):
        return [p for a in expr.args for p in _products(a, info)]
    if isinstance(expr, sympy.Mul):
        keep_mixed = any(_singular(f, info) for f in expr.args)
        out = [[]]
        for f in expr.args:
            parts = _products(f, info) if isinstance(f, sympy.Add) else [[f]]
            if len(out) * len(parts) > MAX_DISTRIBUTED_TERMS or (keep_mixed and axes_of(f, info) == {"i", "j"}):
                parts = [[f]]
            out = [a + b for a in out for b in parts]
        return out
    return [[expr]]


def sum_terms(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]):
    """Write sum_j expr as a list of (A_i, S_ij, W_j): sum_j expr = sum A * (S @ W).

    Products are distributed over sums so that, e.g., the gradient term
    c_ij * (x_i - y_j) becomes x_i * rowsum(c) - c @ y: matrix products
    instead of an N x M x D broadcast, where c is bounded (see ``_products``).
    Terms whose mixed part has feature size above 1 cannot use a matrix
    product; the caller sums those directly. Cached: formulas repeat.
    """
    return _sum_terms(expr, tuple(info.items()))


@functools.lru_cache(maxsize=1024)
def _sum_terms(expr: sympy.Expr, info: tuple) -> list:
    info = dict(info)
    return [_split(factors, info) for factors in _products(expr, info)]


def lift_constants(exprs: list[sympy.Expr]) -> tuple[list[sympy.Expr], list[tuple[sympy.Symbol, float]]]:
    """Replace float constants by parameter symbols, so a new value never needs a new kernel.

    Integers and rationals stay in the formula: they choose the lowering
    (``x**2`` is a square, ``x**(1/2)`` a sqrt). Returns the new expressions and
    (symbol, value) pairs in a deterministic order. Cached: formulas repeat.
    """
    return _lift_constants(tuple(exprs))


@functools.lru_cache(maxsize=1024)
def _lift_constants(exprs: tuple) -> tuple[list[sympy.Expr], list[tuple[sympy.Symbol, float]]]:
    found: dict[sympy.Float, sympy.Symbol] = {}
    for e in exprs:
        for node in sympy.preorder_traversal(e):
            if isinstance(node, sympy.Float) and node not in found:
                found[node] = make_symbol(f"c{len(found)}")
    if not found:
        return list(exprs), []
    return [e.xreplace(found) for e in exprs], [(s, float(f)) for f, s in found.items()]
