"""``formula(text, **variables)``: the formula language from a string.

The text is a Python expression, parsed by ``ast`` and evaluated over
LazyTensors: names are the variables the caller passes (LazyTensors, tensors,
arrays or numbers) and the functions below, operators are the LazyTensor
operators, and a call ``f(x, ...)`` is the LazyTensor method ``x.f(...)``.
So the string language is exactly the LazyTensor language, including
``x[0]`` / ``x[1:3]`` and integer or tuple arguments (``one_hot(x, 4)``,
``keops_tensordot(a, b, (2, 3), (3,), (1,), (0,))``). KeOps's operation names
(``Exp``, ``SqDist``, ``Elem``, ``IfElse``, ...) are accepted too.

Anything else is a ``ValueError`` that names it and says where: a syntax
error (with its position, never a raw ``TokenError``), an unknown function
or variable, or a construct the language does not have (``a if c else b``,
``x and y``, ``lambda``, attribute access, several statements).
"""
from __future__ import annotations

import ast
import math
import re

from .lazy_tensor import LazyTensor, _recorded, as_lazy, where
from .opaque import tracing

# Functions whose first argument is the formula: f(x, *args) is x.f(*args).
METHODS = (
    "exp log sqrt rsqrt abs sin cos tanh asin acos atan atan2 sigmoid relu step square sign floor round mod clamp ifelse "
    "xlogx sinxdivx sinc power sqnorm2 norm2 normalize sqdist dot weightedsqnorm weightedsqdist difference_matrix "
    "elem extract one_hot matvecmult vecmatmult tensorprod keops_tensordot keops_kron grad"
).split()
# Feature-axis reductions written as functions: sum(x) is x.sum(-1), a formula.
FEATURE_REDUCTIONS = ("sum", "min", "max", "argmin", "argmax")
# KeOps's formula names (Genred strings) -> ours.
KEOPS_NAMES = {
    "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Abs": "abs", "Sin": "sin", "Cos": "cos", "Asin": "asin",
    "Acos": "acos", "Atan": "atan", "Atan2": "atan2", "ReLU": "relu", "Step": "step", "Square": "square", "Sign": "sign",
    "Floor": "floor", "Round": "round", "Mod": "mod", "Clamp": "clamp", "ClampInt": "clamp", "IfElse": "ifelse",
    "XLogX": "xlogx", "SinXDivX": "sinxdivx", "Pow": "power", "Powf": "power", "SqNorm2": "sqnorm2", "Norm2": "norm2",
    "Normalize": "normalize", "SqDist": "sqdist", "Scalprod": "dot", "WeightedSqNorm": "weightedsqnorm",
    "WeightedSqDist": "weightedsqdist", "Elem": "elem", "Extract": "extract", "OneHot": "one_hot",
    "MatVecMult": "matvecmult", "VecMatMult": "vecmatmult", "TensorProd": "tensorprod", "TensorDot": "keops_tensordot",
    "Kron": "keops_kron", "Sum": "sum", "Min": "min", "Max": "max", "ArgMin": "argmin", "ArgMax": "argmax",
    "Concat": "concat", "Inv": "inv", "Minus": "minus", "Grad": "grad",
}
CONSTANTS = {"pi": math.pi, "inf": math.inf}
_OPERATORS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a ** b, ast.BitOr: lambda a, b: as_lazy(a) | b,
}
_COMPARISONS = {
    ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: as_lazy(a) == b, ast.NotEq: lambda a, b: as_lazy(a) != b,
}
_HINTS = {
    ast.IfExp: "use where(condition, a, b) or ifelse(x, a, b)", ast.BoolOp: "use products or where() of comparisons",
    ast.BitXor: "use ** for powers", ast.Attribute: "call methods as functions: exp(x), not x.exp()",
}


def _method(name: str, *fixed):
    """f(x, *args) -> x.name(*fixed, *args)."""
    return lambda x, *args: getattr(as_lazy(x), name)(*fixed, *args)


def _functions() -> dict:
    table = {name: _method(name) for name in METHODS}
    table.update({name: _method(name, -1) for name in FEATURE_REDUCTIONS})
    table.update({
        "where": where,
        "concat": lambda *xs: LazyTensor.concatenate(tuple(as_lazy(x) for x in xs)),
        "inv": lambda x: 1 / as_lazy(x),
        "minus": lambda x: -as_lazy(x),
        "IntCst": lambda n: _integer(n, "IntCst"),  # KeOps's integer constants
        "IntInv": lambda n: 1 / _integer(n, "IntInv"),
    })
    table.update({keops: table[ours] for keops, ours in KEOPS_NAMES.items()})
    return table


def _integer(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{name} takes an integer, got {n!r}")
    return n


FUNCTIONS = _functions()


class FormulaError(ValueError):
    """A formula string that cannot be evaluated; the message says what and where."""


def _fail(text: str, node_or_offset, message: str):
    offset = node_or_offset if isinstance(node_or_offset, int) else getattr(node_or_offset, "col_offset", 0)
    pointer = f"\n    {text}\n    {' ' * offset}^"
    raise FormulaError(f"formula {text!r}, position {offset}: {message}{pointer}") from None


class _Evaluator:
    """Evaluates the parsed expression over LazyTensors; every node kind not listed is an error naming it."""

    def __init__(self, text: str, variables: dict):
        self.text, self.variables = text, variables

    def eval(self, node):
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:
            hint = next((f" ({h})" for kind, h in _HINTS.items() if isinstance(node, kind)), "")
            _fail(self.text, node, f"{type(node).__name__} is not part of the formula language{hint}")
        try:
            return method(node)
        except FormulaError:
            raise
        except (ValueError, TypeError, IndexError, ZeroDivisionError) as exc:
            _fail(self.text, node, str(exc))

    def visit_Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            _fail(self.text, node, f"only numbers are constants, got {node.value!r}")
        return node.value

    def visit_Name(self, node):
        if node.id in self.variables:
            return self.variables[node.id]
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if node.id in FUNCTIONS:
            _fail(self.text, node, f"{node.id!r} is a function: call it, {node.id}(...)")
        _fail(self.text, node, f"unknown variable {node.id!r}; pass it as a keyword: formula(text, {node.id}=...)")

    def visit_BinOp(self, node):
        op = _OPERATORS.get(type(node.op))
        if op is None:
            hint = f" ({_HINTS[type(node.op)]})" if type(node.op) in _HINTS else ""
            _fail(self.text, node, f"operator {type(node.op).__name__} is not part of the formula language{hint}")
        return op(self.eval(node.left), self.eval(node.right))

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.USub):
            return -self.eval(node.operand)
        if isinstance(node.op, ast.UAdd):
            return self.eval(node.operand)
        _fail(self.text, node, f"operator {type(node.op).__name__} is not part of the formula language")

    def visit_Compare(self, node):
        if len(node.ops) != 1:
            _fail(self.text, node, "chained comparisons are not supported; combine two comparisons with *")
        return _COMPARISONS[type(node.ops[0])](self.eval(node.left), self.eval(node.comparators[0]))

    def visit_Call(self, node):
        if not isinstance(node.func, ast.Name):
            _fail(self.text, node, "only named functions can be called, e.g. exp(x)")
        if node.keywords:
            _fail(self.text, node.keywords[0].value, "functions take positional arguments only")
        name = node.func.id
        if name not in FUNCTIONS:
            _fail(self.text, node.func, f"unknown function {name!r}; known: {sorted(set(FUNCTIONS) - set(KEOPS_NAMES))}")
        args = [self.eval(a) for a in node.args]
        try:
            return FUNCTIONS[name](*args)
        except TypeError as exc:  # an arity error names a Python closure; name the formula's function instead
            _fail(self.text, node, re.sub(r"^[\w.<>]*\(\)", f"{name}()", str(exc)))

    def visit_Tuple(self, node):
        values = [self.eval(e) for e in node.elts]
        if not all(isinstance(v, int) for v in values):
            _fail(self.text, node, "tuples hold integers only (shapes, axes)")
        return tuple(values)

    visit_List = visit_Tuple

    def visit_Subscript(self, node):
        """``x[1]``, ``x[0:2]``, and ``x[..., 1]`` as the method takes them (``...`` is a constant only here)."""
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        keys = [... if isinstance(p, ast.Constant) and p.value is ... else self.eval(p) for p in parts]
        return as_lazy(self.eval(node.value))[tuple(keys) if isinstance(node.slice, ast.Tuple) else keys[0]]

    def visit_Slice(self, node):
        parts = [None if p is None else self.eval(p) for p in (node.lower, node.upper, node.step)]
        return slice(*parts)


def formula(text: str, **variables) -> LazyTensor:
    """Build a LazyTensor from ``text``, e.g. ``formula("exp(-g*sqdist(x,y))*b", x=Vi(x), ...)``."""
    if tracing() and (recorded := _recorded("formula", text, **variables)) is not None:
        return recorded
    if not isinstance(text, str) or not text.strip():
        raise ValueError("formula text must be a non-empty string")
    text = text.strip()
    lazies = {}
    for name, value in variables.items():
        if name in FUNCTIONS or name in CONSTANTS:
            raise ValueError(f"variable name {name!r} shadows the function or constant of that name")
        try:
            lazies[name] = as_lazy(value)
        except TypeError as exc:
            raise TypeError(f"formula variable {name!r}: {exc}") from None
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        offset = (exc.offset or 1) - 1 if exc.lineno in (None, 1) else len(text)
        _fail(text, min(offset, len(text)), f"syntax error: {exc.msg}")
    return as_lazy(_Evaluator(text, lazies).eval(tree.body))
