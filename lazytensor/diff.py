"""Exact derivatives as IR: reverse-mode (``vjp``) and forward-mode (``jvp``) formulas.

Both chain sympy's exact local partials of each node (``local_partial``), with
the vector nodes (``VectorOp``) handing cotangents and tangents through their
own ``pullback`` / ``pushforward``. The results are ordinary formulas over the
same symbols, so a derivative of any order is one more formula for the engine.
``grouped`` keeps a centred difference one factor of the formulas it enters.
"""
from __future__ import annotations

import functools

import sympy

from .ir import LOGICAL, FSum, Gather, Select, VarInfo, VectorOp, ZeroSafePow, feature_dim, feature_sum, index_tuple


@functools.lru_cache(maxsize=8192)
def local_partial(node: sympy.Expr, k: int) -> sympy.Expr:
    """d node / d arg_k, by sympy on placeholder symbols (fractional powers: 0 at a zero base). Kept: a
    training loop differentiates the same nodes every step, and sympy's answer takes ~1 ms a node."""
    if isinstance(node, sympy.Pow) and k == 0:
        base, exponent = node.args
        if exponent.is_Number and 0 < exponent < 1:
            return exponent * ZeroSafePow(base, exponent - 1)
    holders = [sympy.Dummy(f"a{n}", real=True) for n in range(len(node.args))]
    generic = node.func(*holders)
    return sympy.diff(generic, holders[k]).xreplace(dict(zip(holders, node.args)))


def grouped(expr: sympy.Expr, width: int) -> sympy.Expr:
    """``expr`` (of ``width`` features, or 1 to broadcast) as one factor: the gather of all its features.

    A streamed sum distributes products over sums to form matrix products
    (``ir.sum_terms``); a centred difference ``a_ij - mean_i`` summed term by
    term is two large sums that cancel, while summed as one factor per pair
    it keeps its digits (softmax derivatives, ``reductions.softmax``).
    """
    return Gather(expr, index_tuple(range(width)))


def _pieces(node: sympy.Piecewise):
    """Each branch of a Piecewise with the 0/1 indicator of being the branch taken."""
    earlier = []
    for value, cond in node.args:
        taken = [(sympy.Integer(0), c) for c in earlier] + [(sympy.Integer(1), cond), (sympy.Integer(0), True)]
        yield value, sympy.Piecewise(*taken)
        earlier.append(cond)


def _differentiable_args(node: sympy.Expr):
    """(argument, its local partial) pairs; Piecewise conditions are locally constant."""
    if isinstance(node, Select):  # the condition is locally constant
        cond, a, b = node.args
        return [(a, Select(cond, sympy.Integer(1), sympy.Integer(0))), (b, Select(cond, sympy.Integer(0), sympy.Integer(1)))]
    if isinstance(node, sympy.Piecewise):
        return list(_pieces(node))
    if isinstance(node, LOGICAL):
        return []
    return [(arg, local_partial(node, k)) for k, arg in enumerate(node.args)]


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
    cotangent to every feature of its argument (D times to a size-1 argument).
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
            arg, width = node.args
            visit(arg, cot * width if feature_dim(arg, info) == 1 else cot)
            return
        if isinstance(node, VectorOp):
            for k, arg in enumerate(node.args):
                if isinstance(arg, sympy.Expr) and arg.free_symbols & targets:
                    arg_cot = node.pullback(k, cot, info)
                    if arg_cot is not None:
                        visit(arg, arg_cot)
            return
        node_dim = feature_dim(node, info)
        for arg, partial in _differentiable_args(node):
            if not (arg.free_symbols & targets):
                continue
            arg_cot = cot * partial
            if node_dim > 1 and feature_dim(arg, info) == 1:
                arg_cot = feature_sum(arg_cot, node_dim)
            visit(arg, arg_cot)

    for out, cot in outputs:
        visit(out, cot)
    result = {}
    for s, g in grads.items():
        width = feature_dim(g, info)
        if info[s].dim == 1 and width > 1:
            g = feature_sum(g, width)  # a scalar variable broadcast over features
        result[s] = g
    return result


def jvp(expr: sympy.Expr, tangents: dict[sympy.Symbol, sympy.Symbol], info: dict[sympy.Symbol, VarInfo]) -> sympy.Expr:
    """Forward-mode directional derivative of ``expr`` as IR.

    ``tangents`` maps variables to the symbols of their tangents (same axis
    and feature size); variables without a tangent are constants.
    """
    memo: dict[sympy.Expr, sympy.Expr] = {}

    def visit(node: sympy.Expr) -> sympy.Expr:
        if node in memo:
            return memo[node]
        if not (node.free_symbols & tangents.keys()):
            out = sympy.Integer(0)
        elif isinstance(node, sympy.Symbol):
            out = tangents[node]
        elif isinstance(node, FSum):
            out = FSum(visit(node.args[0]), node.args[1])
        elif isinstance(node, VectorOp):
            out = node.pushforward([visit(a) if isinstance(a, sympy.Expr) else None for a in node.args], info)
        else:
            out = sympy.Add(*(partial * visit(arg) for arg, partial in _differentiable_args(node)))
        memo[node] = out
        return out

    return visit(expr)
