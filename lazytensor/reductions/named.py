"""The named reductions: one table from a reduction's name to its class, argument, public outputs and shaping.

``LazyTensor.sum`` / ``.kmin`` / ``.quantile`` / ... and ``lazytensor.stream``
look their names up here, so a reduction is spelled, checked and shaped in
one place. An entry says

- ``build(expr, problem, argument, width)``: the reduction object for an
  engine problem (``width`` is the formula's feature size);
- ``argument``: what it takes besides the formula - ``"k"`` (a positive
  count), ``"values"`` (a formula, required), ``"weight"`` (a formula,
  optional), ``"q"`` (quantile levels), ``"dtype_acc"`` (optional) or None;
  formula arguments reach ``build`` as IR expressions;
- ``outputs``: which of the class's outputs the caller gets, in order;
- ``shape(outputs, width, argument)``: their final shape, e.g. widened to the
  formula's feature size where sympy folded it to a scalar;
- ``block_sparse``: whether ``ranges=`` is supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch

from .lse_weight import LogSumExpWeight
from .quantile import Quantile
from .selection import ArgMax, ArgMin, KMin
from .softmax import LogSumExp, SoftmaxWeightedSum
from .sum import Sum, accumulation_dtype
from .sumshiftexp import MaxSumShiftExp

FORMULA_ARGUMENTS = ("values", "weight")  # arguments that are formulas (a dense tensor is indexed like the reduced axis)
REQUIRED_ARGUMENTS = ("k", "values", "q")


def widen(out: torch.Tensor, width: int) -> torch.Tensor:
    """A result with the formula's feature size where sympy folded the formula to a scalar."""
    if width == 1 or out.shape[-1] == width:
        return out
    return out.expand(*out.shape[:-1], width).contiguous()


def _as_is(outs, width, argument):
    return outs


def _widened(outs, width, argument):
    return tuple(widen(o, width) for o in outs)


def _selected(outs, width, argument):
    """k values or indices per row: (..., rows, k) for a scalar formula, (..., rows, k, D) otherwise."""
    return tuple(o.squeeze(-1) if o.shape[-1] == 1 else o for o in _widened(outs, width, argument))


def _logsumexp_shape(outs, width, weight):
    return outs if weight is not None else _widened(outs, width, weight)


def _joined(outs, width, argument):
    """Max_SumShiftExp as KeOps returns it: the max and the shifted sum as one (..., 1 + E) tensor."""
    return (torch.cat(outs, -1),)


def _quantile_shape(outs, width, q):
    """(..., rows, D) for one level; (..., rows, Q) or (..., rows, Q, D) for a tensor of levels."""
    if not isinstance(q, torch.Tensor) or q.dim() == 0:
        return (widen(outs[0][..., 0, :], width),)
    return (outs[0].squeeze(-1) if outs[0].shape[-1] == 1 else outs[0],)


def _sum(expr, problem, dtype_acc, width):
    return Sum(expr, problem.info, width, dtype_acc=accumulation_dtype(dtype_acc, problem.dtype))


def _logsumexp(expr, problem, weight, width):
    return LogSumExp(expr, problem.info) if weight is None else LogSumExpWeight(expr, weight, problem.info)


def _sumshiftexp(expr, problem, weight, width):
    return MaxSumShiftExp(expr, sympy.Integer(1) if weight is None else weight, problem.info)


def _softmax(expr, problem, values, width):
    return SoftmaxWeightedSum(expr, values, problem.info)


def _min(expr, problem, argument, width):
    return ArgMin(expr, problem.info)


def _max(expr, problem, argument, width):
    return ArgMax(expr, problem.info)


def _kmin(expr, problem, k, width):
    if k > problem.reduced_size:
        raise ValueError(f"k={k} is larger than the {problem.reduced_size} entries reduced over")
    return KMin(expr, problem.info, k)


def _quantile(expr, problem, q, width):
    return Quantile(expr, problem.info, q, problem.reduced_size, problem.dtype, problem.device)


@dataclass(frozen=True)
class Named:
    """One named reduction (see the module docstring)."""

    build: Callable
    argument: str | None = None
    outputs: tuple = (0,)
    shape: Callable = _as_is
    block_sparse: bool = True


NAMES = {
    "sum": Named(_sum, "dtype_acc"),
    "logsumexp": Named(_logsumexp, "weight", shape=_logsumexp_shape),
    "max_sumshiftexp": Named(_sumshiftexp, "weight", (0, 1), _joined),
    "softmax_weighted_sum": Named(_softmax, "values"),
    "min": Named(_min, shape=_widened),
    "argmin": Named(_min, outputs=(1,), shape=_widened),
    "min_argmin": Named(_min, outputs=(0, 1), shape=_widened),
    "max": Named(_max, shape=_widened),
    "argmax": Named(_max, outputs=(1,), shape=_widened),
    "max_argmax": Named(_max, outputs=(0, 1), shape=_widened),
    "kmin": Named(_kmin, "k", shape=_selected),
    "argkmin": Named(_kmin, "k", (1,), _selected),
    "kmin_argkmin": Named(_kmin, "k", (0, 1), _selected),
    "quantile": Named(_quantile, "q", shape=_quantile_shape, block_sparse=False),
}


def check(name: str, argument) -> Named:
    """The entry of ``name``, after checking that ``argument`` is what it takes."""
    if name not in NAMES:
        raise ValueError(f"unknown reduction {name!r}; known: {sorted(NAMES)}")
    entry = NAMES[name]
    if entry.argument is None and argument is not None:
        raise ValueError(f"reduction {name!r} takes no argument: give it as a plain name, got {argument!r}")
    if entry.argument in REQUIRED_ARGUMENTS and argument is None:
        raise ValueError(f"reduction {name!r} needs its {entry.argument}: give it as ({name!r}, {entry.argument})")
    if entry.argument == "k" and (isinstance(argument, bool) or not isinstance(argument, int) or argument < 1):
        raise ValueError(f"k must be a positive integer, got {argument!r}")
    return entry
