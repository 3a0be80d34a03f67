"""A formula's variables: their axis and tensor, and the engine problem they make.

A LazyTensor holds ``{symbol: Variable}``. This module reads the axis of a
tensor (``lazy(t, axis)`` or KeOps's singleton layout), normalizes its shape,
checks that a formula's variables agree (dtype, device, lengths, NumPy or
torch), and flattens their batch dimensions into the engine's one batch
dimension when a reduction runs.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math

import numpy as np
import sympy
import torch

from . import ir, precision
from .kept import Kept
from .problem import Problem, kernel_order


class Variable:
    """A variable's axis and tensor: (*batch, N, D) for i/j, (*batch, D) for parameters.

    ``follows_dtype`` marks parameters made from Python numbers: they take the
    dtype and device of the other variables when the formula runs; ``numpy``
    marks arrays that came from NumPy (their results go back as NumPy).
    """

    __slots__ = ("axis", "tensor", "follows_dtype", "numpy")

    def __init__(self, axis: str, tensor: torch.Tensor, follows_dtype: bool = False, numpy: bool = False):
        self.axis, self.tensor, self.follows_dtype, self.numpy = axis, tensor, follows_dtype, numpy

    @property
    def batch_shape(self) -> torch.Size:
        return self.tensor.shape[:-1] if self.axis == "p" else self.tensor.shape[:-2]

    def with_axis(self, axis: str) -> "Variable":
        return Variable(axis, self.tensor, self.follows_dtype, self.numpy)

    def __deepcopy__(self, memo):
        """As pickle copies it: torch refuses to deep-copy a tensor computed from a leaf (``Pm(g)`` holds a reshaped
        view of ``g``), so such a tensor becomes a leaf copy that requires grad as it did."""
        t, new = self.tensor, copy.copy(self)
        new.tensor = copy.deepcopy(t, memo) if t.is_leaf else t.detach().clone().requires_grad_(t.requires_grad)
        return new


class Placeholder(Variable):
    """KeOps's symbolic variable (``Vi(index, dim)``): a feature size and no data until a reduction is called with
    its tensor as argument ``index`` (``lazytensor.keops``). It follows the other variables' dtype meanwhile."""

    __slots__ = ("index",)

    def __init__(self, axis: str, index: int, dim: int):
        super().__init__(axis, torch.zeros(dim if axis == "p" else (1, dim)), follows_dtype=True)
        self.index = index

    def with_axis(self, axis: str) -> "Placeholder":
        return Placeholder(axis, self.index, self.tensor.shape[-1])


def wrap(x, axis) -> tuple[sympy.Expr, dict, int]:
    """What ``LazyTensor(x, axis)`` holds: its expression, its variables and its feature size.

    ``x`` is a number (a constant), a list of numbers (KeOps: a parameter that
    follows the formula's dtype), a tensor or a NumPy array; ``axis`` None
    reads KeOps's singleton layout.
    """
    if isinstance(x, np.generic) and not isinstance(x, np.ndarray):
        x = x.item()
    if isinstance(x, bool) or (isinstance(x, (int, float)) and axis is not None):
        raise TypeError(f"LazyTensor expects a tensor, an array, a number or a LazyTensor, got {x!r}")
    if isinstance(x, (int, float)):
        return _number(type(x), x), {}, 1
    follows_dtype = isinstance(x, list)
    if follows_dtype:
        x, axis = torch.tensor([float(v) for v in x]), "p"
    from_numpy = isinstance(x, np.ndarray)
    if from_numpy:
        x = tensor_of_array(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"LazyTensor expects a torch.Tensor, a NumPy array, a number or a LazyTensor, got {type(x).__name__}")
    x, axis = keops_layout(x) if axis is None else (x, axis_name(axis))
    tensor = normalized(x, axis)
    symbol = ir.position_symbol(0)
    return symbol, {symbol: Variable(axis, tensor, follows_dtype, from_numpy)}, tensor.shape[-1]


def tensor_of_array(x: np.ndarray) -> torch.Tensor:
    """The array as a tensor sharing its memory, or a copy where torch cannot view it (negative strides: ``x[::-1]``)."""
    return torch.from_numpy(x if all(stride >= 0 for stride in x.strides) else np.ascontiguousarray(x))


@functools.lru_cache(maxsize=1024)
def _number(kind: type, x) -> sympy.Number:
    """A Python number as a sympy constant (cached: ``sympy.Float`` costs ~30 us, and a formula
    written in a loop makes the same constants call after call; ``kind`` keeps 1 and 1.0 apart)."""
    return sympy.Float(x) if kind is float else sympy.Integer(x)


def aligned(operands: list[tuple[sympy.Expr, dict]]) -> tuple[list[sympy.Expr], dict]:
    """Several formulas' ``(expression, variables)`` on their merged variables.

    Symbols name positions (``ir.position_symbol``), so two formulas' ``x0``
    are different variables unless they hold the same ``Variable``. The first
    operand keeps its symbols; every other variable takes the next free
    position, in order of appearance, and the expressions are renamed to
    match. Returns the renamed expressions and the merged variables.
    """
    (first, merged), *rest = operands
    if not rest:  # one formula: its own variables (never mutated, so shared)
        return [first], merged
    merged = dict(merged)
    symbol_of = {id(v): s for s, v in merged.items()}
    used = {ir.creation_index(s) for s in merged}
    free = (k for k in itertools.count() if k not in used)
    exprs = [first]
    for expr, variables in rest:
        rename = {}
        for s, v in variables.items():
            if id(v) not in symbol_of:
                symbol_of[id(v)] = ir.position_symbol(next(free))
                merged[symbol_of[id(v)]] = v
            if symbol_of[id(v)] != s:
                rename[s] = symbol_of[id(v)]
        exprs.append(_renamed(expr, tuple(rename.items())) if rename else expr)
    return exprs, merged


@functools.lru_cache(maxsize=4096)
def _renamed(expr: sympy.Expr, rename: tuple) -> sympy.Expr:
    """``expr`` with its symbols renamed at once (a formula's operands align the same way on every call)."""
    return expr.xreplace(dict(rename))


def transposed(variables: dict) -> dict:
    """The variables with i and j exchanged (new ``Variable`` objects: x_i and its transpose x_j differ)."""
    return {s: v if v.axis == "p" else v.with_axis(ir.FLIPPED[v.axis])
            for s, v in variables.items()}


def keops_layout(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The axis from KeOps-style singleton dims: (..., N, 1, D) -> i, (..., 1, M, D) -> j, (..., 1, 1, D) -> p."""
    if x.dim() >= 3:
        if x.shape[-3] == 1 and x.shape[-2] == 1:
            return x.squeeze(-2).squeeze(-2), "p"
        if x.shape[-2] == 1:
            return x.squeeze(-2), "i"
        if x.shape[-3] == 1:
            return x.squeeze(-3), "j"
        raise ValueError(
            f"cannot tell the axis of a tensor of shape {tuple(x.shape)}: use x[:, None, :] for i, y[None, :, :] for j, "
            "p[None, None, :] for a parameter, or Vi/Vj/Pm"
        )
    if x.dim() <= 1:
        return x, "p"
    raise ValueError(f"cannot tell the axis of a 2-D tensor of shape {tuple(x.shape)}: use Vi(x), Vj(y), Pm(p) or axis=0/1/2")


def axis_name(axis) -> str:
    """'i' / 'j' / 'p', also as KeOps's 0 / 1 / 2."""
    names = {0: "i", 1: "j", 2: "p", "i": "i", "j": "j", "p": "p"}
    if isinstance(axis, bool) or axis not in names:
        raise ValueError(f"axis must be 'i', 'j' or 'p' (or KeOps's 0, 1, 2), got {axis!r}")
    return names[axis]


def normalized(x: torch.Tensor, axis: str) -> torch.Tensor:
    """i/j variables become (*batch, N, D); parameters (*batch, D)."""
    if not x.is_floating_point():
        raise TypeError(f"variables must be floating-point tensors, got dtype {x.dtype}")
    if axis == "p":
        return x.reshape(1) if x.dim() == 0 else x
    if x.dim() == 0:
        raise ValueError(f"an {axis}-variable must be (N,), (N, D) or (*batch, N, D), got a 0-D tensor")
    return x.reshape(-1, 1) if x.dim() == 1 else x


def info(variables: dict) -> dict[object, ir.VarInfo]:
    return {s: ir.VarInfo(v.axis, v.tensor.shape[-1]) for s, v in variables.items()}


def batch_shape(variables: dict) -> tuple:
    shapes = {tuple(v.batch_shape) for v in variables.values()}
    if len(shapes) == 1:  # the common case, without torch.broadcast_shapes (~50 us)
        return shapes.pop()
    try:
        return tuple(torch.broadcast_shapes(*(v.batch_shape for v in variables.values())))
    except RuntimeError:
        raise ValueError(f"batch shapes {[tuple(v.batch_shape) for v in variables.values()]} do not broadcast") from None


def from_numpy(variables: dict) -> bool:
    """Whether results are NumPy arrays: every array variable came from NumPy."""
    arrays = [v for v in variables.values() if not v.follows_dtype]
    return bool(arrays) and all(v.numpy for v in arrays)


_LAYOUTS = Kept()  # problem layouts by variables' structure (``problem``)


def problem(variables: dict, axis: str) -> tuple[Problem, tuple]:
    """The engine problem reducing over ``axis`` (variables validated, batch dims flattened) and the batch shape.

    What depends on the variables' structure alone (checks, info, order, batch)
    is kept per structure: a call repeated in a loop only flattens its tensors.
    Number-made parameters are converted to the formula's dtype (``check``) every call; half-precision
    tensors are widened to float32 (``precision``)."""
    if any(v.follows_dtype for v in variables.values()):
        layout = _layout(variables, axis)
    else:
        key = (axis, tuple((s, v.axis, v.tensor.shape, v.tensor.dtype, v.tensor.device, v.numpy) for s, v in variables.items()))
        layout = _LAYOUTS.get(key, lambda: _layout(variables, axis))
    info, order, batch, missing = layout
    flat = math.prod(batch)
    tensors = {s: precision.widened(_flatten_batch(v, batch, flat)) for s, v in variables.items()}
    if missing is not None:  # an i-only (j-only) formula: the kept axis has size 1
        tensors[missing] = next(iter(tensors.values())).new_zeros(1, 1, 1)
    return Problem(info, tensors, order), batch


def _layout(variables: dict, axis: str) -> tuple:
    """(info, order, batch shape, the missing axis's symbol or None) of a problem over ``variables``, after ``check``."""
    require_data(variables)  # (placeholders follow the dtype, so a problem with them is never served from _LAYOUTS)
    check(variables)
    known = info(variables)
    other = "i" if axis == "j" else "j"
    if not any(v.axis == axis for v in known.values()):
        size = "M (the number of j indices)" if axis == "j" else "N (the number of i indices)"
        raise ValueError(f"cannot reduce over {axis!r}: the formula has no {axis}-indexed variable, so the reduced size "
                         f"{size} is unknown; multiply by a {axis}-variable of that length (e.g. a column of ones)")
    batch = batch_shape(variables)
    missing = None
    if not any(v.axis == other for v in known.values()):
        missing = ir.position_symbol(1 + max(ir.creation_index(s) for s in known))
        known[missing] = ir.VarInfo(other, 1)
    if axis == "i":
        known = {s: ir.VarInfo(ir.FLIPPED[v.axis], v.dim) for s, v in known.items()}
    return known, kernel_order(known, known), batch, missing


def require_data(variables: dict) -> None:
    """Placeholders have no data: a reduction of their formula must be called with it (``lazytensor.keops``)."""
    waiting = sorted(v.index for v in variables.values() if isinstance(v, Placeholder))
    if waiting:
        raise ValueError(f"the formula has placeholder variables (indices {waiting}) without data: call the reduction's "
                         "result with their tensors (a KeOps reduction of such a formula returns a function)")


def _flatten_batch(v: Variable, batch: tuple, flat: int) -> torch.Tensor:
    """A variable as the engine sees it: (B, N, D) / (B, D) with B the flattened batch, or 1 where it does not vary."""
    t = v.tensor
    core = t.shape[-1:] if v.axis == "p" else t.shape[-2:]
    if all(s == 1 for s in v.batch_shape):
        return t.reshape(1, *core)
    if tuple(v.batch_shape) != tuple(batch):
        t = t.expand(*batch, *core)
    return t.reshape(flat, *core)


class DtypeMismatch(TypeError, ValueError):
    """Variables of different dtypes: a ``TypeError`` as torch raises, and the ``ValueError`` pykeops raises."""


def check(variables: dict) -> None:
    """Number-made parameters take the formula's dtype and device; the others must agree on them and on lengths."""
    anchor = next((v.tensor for v in variables.values() if not v.follows_dtype), None)
    if anchor is not None:
        for v in variables.values():
            if v.follows_dtype:
                v.tensor = v.tensor.to(dtype=anchor.dtype, device=anchor.device)
    if not variables:
        raise ValueError("the formula has no variables")
    ref, *rest = (v.tensor for v in variables.values())
    for t in rest:
        if t.dtype != ref.dtype:
            raise DtypeMismatch(f"variable dtypes differ: {ref.dtype} and {t.dtype}; convert them to one dtype")
        if t.device != ref.device:
            raise ValueError(f"variable devices differ: {ref.device} and {t.device}")
    if ref.device.type == "meta":
        raise ValueError("variables are on the meta device, which holds no values: a reduction needs real tensors")
    if len({v.numpy for v in variables.values() if not v.follows_dtype}) > 1:
        raise TypeError("a formula mixes NumPy arrays and torch tensors; use one of them (torch.from_numpy converts)")
    for axis in ("i", "j"):
        found = {v.tensor.shape[-2] for v in variables.values() if v.axis == axis}
        if len(found) > 1:
            raise ValueError(f"{axis}-variables have different lengths {sorted(found)}")
