"""``formula(text, **variables)``: the formula language from a string.

The text is parsed by sympy with only our names in scope: the variables the
caller passes (LazyTensors or numbers) and the functions below. Anything else
(an unknown function or name) is an error that names it.
"""
from __future__ import annotations

import sympy
from sympy.core.function import AppliedUndef
from sympy.parsing.sympy_parser import parse_expr, standard_transformations

from . import ir
from .formula import LazyTensor, as_lazy

FUNCTIONS = {
    "exp": sympy.exp,
    "log": sympy.log,
    "sqrt": sympy.sqrt,
    "rsqrt": lambda a: 1 / sympy.sqrt(a),
    "abs": sympy.Abs,
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tanh": sympy.tanh,
    "sigmoid": ir.Sigmoid,
    "relu": ir.Relu,
    "square": lambda a: a**2,
    "sign": sympy.sign,
    "clamp": lambda a, lo, hi: ir.Clamp(a, sympy.Float(lo), sympy.Float(hi)),
    "where": lambda c, a, b: sympy.Piecewise((a, c), (b, True)),
}

# Summed over features; sqrt applied after for norm2.
CONTRACTIONS = {
    "sqnorm2": lambda a: a**2,
    "norm2": lambda a: a**2,
    "sqdist": lambda a, b: (a - b) ** 2,
    "dot": lambda a, b: a * b,
    "sum": lambda a: a,
}


def _contraction(name, info):
    """The function ``name`` over sympy arguments whose feature sizes ``info`` gives."""

    def apply(*args):
        width = max(ir.feature_dim(a, info) for a in args)
        summed = ir.feature_sum(CONTRACTIONS[name](*args).doit(), width)
        return sympy.sqrt(summed) if name == "norm2" else summed

    return apply


def formula(text: str, **variables) -> LazyTensor:
    """Build a LazyTensor from ``text``, e.g. ``formula("exp(-g*sqdist(x,y))*b", x=Vi(x), ...)``."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("formula text must be a non-empty string")
    lazies = {}
    for name, value in variables.items():
        if name in FUNCTIONS or name in CONTRACTIONS:
            raise ValueError(f"variable name {name!r} shadows the function of that name")
        try:
            lazies[name] = as_lazy(value)
        except TypeError as exc:
            raise TypeError(f"formula variable {name!r}: {exc}") from None
    info = {s: i for lt in lazies.values() for s, i in lt.info.items()}
    functions = {**FUNCTIONS, **{name: _contraction(name, info) for name in CONTRACTIONS}}
    scope = {**functions, **{name: lt.expr for name, lt in lazies.items()}}
    try:  # unevaluated first, so that x - x still shows x's feature size
        raw = parse_expr(text, local_dict=scope, global_dict={"__builtins__": {}, **_sympy_atoms()},
                         transformations=standard_transformations, evaluate=False)
        expr = raw.doit()
    except (SyntaxError, TypeError) as exc:
        raise ValueError(f"cannot parse formula {text!r}: {exc}") from None
    undefined = sorted({f.func.__name__ for f in expr.atoms(AppliedUndef)})
    if undefined:
        raise ValueError(f"unknown function(s) {undefined} in formula {text!r}; known: {sorted({**FUNCTIONS, **CONTRACTIONS})}")
    known = set().union(*(lt.variables for lt in lazies.values())) if lazies else set()
    unknown = sorted(s.name for s in expr.free_symbols if s not in known)
    if unknown:
        raise ValueError(f"unknown name(s) {unknown} in formula {text!r}; pass them as keyword variables")
    return LazyTensor._build(expr, *lazies.values(), width=ir.feature_dim(raw, info))


def _sympy_atoms():
    return {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
            "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow, "Lt": sympy.Lt, "Le": sympy.Le, "Gt": sympy.Gt,
            "Ge": sympy.Ge, "Eq": sympy.Eq, "Ne": sympy.Ne,
            "Function": sympy.Function}
