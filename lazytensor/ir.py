"""The formula IR: sympy expressions over whole-variable symbols.

A symbol stands for a whole feature vector (an i-row, a j-row or a parameter
vector); elementwise operations broadcast over features exactly like torch
(a feature size of 1 broadcasts). Feature contractions are the opaque
function ``FSum`` (sum over the feature axis), so a squared distance stays one
node, ``FSum((x - y)**2)``, instead of D unrolled terms. sympy gives us
canonical forms, structural sharing and exact local derivatives; ``vjp`` below
chains them into reverse-mode formulas that are themselves IR.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy

AXES = ("i", "j", "p")


@dataclass(frozen=True)
class VarInfo:
    """What the IR knows about a variable: its axis and feature size."""

    axis: str  # "i", "j" or "p"
    dim: int


def make_symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, real=True)


_created = itertools.count()


def new_variable_symbol() -> sympy.Symbol:
    """A fresh variable symbol; creation order gives kernels a stable argument order."""
    return make_symbol(f"v{next(_created)}")


def creation_index(sym: sympy.Symbol) -> int:
    return int(sym.name[1:]) if sym.name[1:].isdigit() else -1


class FSum(sympy.Function):
    """Sum over the feature axis: (..., D) -> (..., 1)."""

    nargs = 1

    @classmethod
    def eval(cls, arg):
        if arg.is_zero:
            return sympy.Integer(0)
        return None


def feature_sum(arg: sympy.Expr, width: int) -> sympy.Expr:
    """FSum of ``arg`` whose feature size was ``width`` before sympy simplified it.

    ``sqdist(x, x)`` or ``x - x + 1`` fold to constants that no longer carry
    their feature size; their sum over features is the constant times ``width``.
    """
    return arg * width if not arg.free_symbols else FSum(arg)


class Sigmoid(sympy.Function):
    nargs = 1

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)


class Step(sympy.Function):
    """Indicator of a positive argument (the derivative of relu)."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Relu(sympy.Function):
    nargs = 1

    def fdiff(self, argindex=1):
        return Step(self.args[0])


class InRange(sympy.Function):
    """Indicator of lo <= a <= hi (the derivative of clamp)."""

    nargs = 3

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Clamp(sympy.Function):
    nargs = 3

    def fdiff(self, argindex=1):
        if argindex != 1:
            raise ValueError("clamp bounds must be constants")
        a, lo, hi = self.args
        return InRange(a, lo, hi)


def feature_dim(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]) -> int:
    """Feature size of an expression, with torch broadcasting rules."""
    if isinstance(expr, sympy.Symbol):
        return info[expr].dim
    if isinstance(expr, FSum) or not expr.free_symbols:
        return 1
    dims = {feature_dim(a, info) for a in expr.args if isinstance(a, sympy.Basic) and a.free_symbols}
    dims.discard(1)
    if len(dims) > 1:
        raise ValueError(f"feature sizes {sorted(dims)} do not broadcast in {expr}")
    return dims.pop() if dims else 1


def axes_of(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]) -> frozenset[str]:
    """The indexed axes ('i', 'j') an expression depends on."""
    return frozenset(info[s].axis for s in expr.free_symbols if info[s].axis != "p")


def _local_partial(node: sympy.Expr, k: int) -> sympy.Expr:
    """d node / d arg_k, by sympy on placeholder symbols."""
    holders = [sympy.Dummy(f"a{n}", real=True) for n in range(len(node.args))]
    generic = node.func(*holders)
    return sympy.diff(generic, holders[k]).xreplace(dict(zip(holders, node.args)))


def _pieces(node: sympy.Piecewise):
    """Each branch of a Piecewise with the 0/1 indicator of being the branch taken."""
    earlier = []
    for value, cond in node.args:
        taken = [(sympy.Integer(0), c) for c in earlier] + [(sympy.Integer(1), cond), (sympy.Integer(0), True)]
        yield value, sympy.Piecewise(*taken)
        earlier.append(cond)


def vjp(
    outputs: list[tuple[sympy.Expr, sympy.Expr]],
    wrt: list[sympy.Symbol],
    info: dict[sympy.Symbol, VarInfo],
) -> dict[sympy.Symbol, sympy.Expr]:
    """Reverse-mode vector-Jacobian products as IR.

    ``outputs`` pairs each output expression with its cotangent expression
    (same feature size, or 1 to broadcast). Returns, for each symbol in
    ``wrt``, the expression of sum_k <cot_k, d out_k / d symbol> with the
    symbol's feature size. Elementwise nodes use sympy's exact local
    derivatives; where an argument broadcasts (feature size 1 under a size-D
    node) its cotangent is summed over features, and ``FSum`` hands its scalar
    cotangent to every feature of its argument.
    """
    targets = set(wrt)
    grads: dict[sympy.Symbol, sympy.Expr] = {s: sympy.Integer(0) for s in wrt}

    def visit(node: sympy.Expr, cot: sympy.Expr) -> None:
        if cot == 0 or not (node.free_symbols & targets):
            return
        if isinstance(node, sympy.Symbol):
            grads[node] = grads[node] + cot
            return
        if isinstance(node, FSum):
            visit(node.args[0], cot)
            return
        node_dim = feature_dim(node, info)
        if isinstance(node, sympy.Piecewise):  # conditions are locally constant
            branches = list(_pieces(node))
        else:
            branches = [(arg, k) for k, arg in enumerate(node.args)]
        for arg, how in branches:
            if not (arg.free_symbols & targets):
                continue
            arg_cot = cot * (how if isinstance(node, sympy.Piecewise) else _local_partial(node, how))
            if node_dim > 1 and feature_dim(arg, info) == 1:
                arg_cot = feature_sum(arg_cot, node_dim)
            visit(arg, arg_cot)

    for out, cot in outputs:
        visit(out, cot)
    result = {}
    for s, g in grads.items():
        if info[s].dim == 1 and feature_dim(g, info) > 1:
            g = FSum(g)  # a scalar variable broadcast over features
        result[s] = g
    return result


def split_product(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]):
    """Split a product into (i-or-constant factors, mixed factors, j-only factors)."""
    factors = expr.args if isinstance(expr, sympy.Mul) else (expr,)
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


def sum_terms(expr: sympy.Expr, info: dict[sympy.Symbol, VarInfo]):
    """Write sum_j expr as a list of (A_i, S_ij, W_j): sum_j expr = sum A * (S @ W).

    The top-level product is distributed over sums so that, e.g., the gradient
    term c_ij * (x_i - y_j) becomes x_i * rowsum(c) - c @ y: matrix products
    instead of an N x M x D broadcast. Terms whose mixed part has feature size
    above 1 cannot use a matrix product; the caller sums those directly.
    """
    expanded = sympy.expand(expr, deep=False, power_base=False, power_exp=False, log=False, multinomial=False)
    terms = expanded.args if isinstance(expanded, sympy.Add) else (expanded,)
    return [split_product(t, info) for t in terms]
