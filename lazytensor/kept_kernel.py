"""A small kernel kept between products of the same points: ``K @ b`` for many ``b``, as BLAS on its matrix.

Why: KeOps's clients multiply one kernel by many right-hand sides (GPyTorch's CG and Lanczos on its
KeOps kernel: 23 of a training step's 25 passes are products of one kernel, with gradients off);
``lazytensor.keops``'s ``K @ v`` asks here first (lazytensor's own product streams: its routes and
tiers are the engine's). A streamed product evaluates the kernel again each time; while its N x M values fit
``MAX_PAIRS``, a product with the kept matrix is ATen's matrix product (2000 x 2000 points, 11
columns: 4.2-4.8 ms against 19 ms streamed). A product whose formula holds the same values as at the
product before (compared, not trusted: a tensor changed through ``.data`` keeps its version) forms
the matrix once (``reductions.values.Values``, one eager pass) and keeps it; other values forget it.
Only products that nothing differentiates take this route, on CPU (where it was measured); the others
stream as before.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from . import autograd, engine, ir, variables
from .reductions.values import Values

MAX_PAIRS = 1 << 22  # N x M of a kept matrix (16 MiB in float32)
MAX_KEPT = 2  # kept matrices, the last used first


@dataclass
class _Entry:
    values: list  # copies of the formula's tensors at its last product
    matrix: torch.Tensor | None = None  # (N, M), formed at the second product with the same values


_KEPT: OrderedDict = OrderedDict()  # formula structure -> _Entry


def product(K, b, options: dict) -> torch.Tensor | None:
    """``K @ b`` from K's kept matrix, or None: the product streams (and this one's values are remembered)."""
    if not _eligible(K, b, options):
        return None
    key = (K.expr, tuple((s, v.axis, v.tensor.shape, v.tensor.dtype, v.tensor.device, v.follows_dtype)
                         for s, v in K.variables.items()))
    tensors = [v.tensor for v in K.variables.values()]
    entry = _KEPT.pop(key, None)
    if entry is None or not all(torch.equal(kept, t) for kept, t in zip(entry.values, tensors)):
        entry = _Entry([t.detach().clone() for t in tensors])
    elif entry.matrix is None:
        entry.matrix = _matrix(K)
    _KEPT[key] = entry
    while len(_KEPT) > MAX_KEPT:
        _KEPT.popitem(last=False)
    if entry.matrix is None:
        return None
    return entry.matrix @ b


def _eligible(K, b, options: dict) -> bool:
    """A product this route may serve: a plain ``K @ b`` (no options, no batch, no NumPy), one mixed scalar
    formula of float32 / float64 tensors small enough to keep, and no gradient, tangent, transform or compiler's
    trace (fake tensors: their values cannot be compared) through it."""
    if options.get("ranges") is not None or set(options) - {"ranges"} or K.width != 1:
        return False
    if not isinstance(b, torch.Tensor) or is_fake(b) or b.dim() not in (1, 2) or b.dtype not in (torch.float32, torch.float64):
        return False
    if b.device.type != "cpu":  # measured on CPU only: an accelerator streams as before until measured there
        return False
    kept = [v for v in K.variables.values() if not v.follows_dtype]
    if not kept or any(v.numpy or v.tensor.dim() != (1 if v.axis == "p" else 2) or v.tensor.dtype != b.dtype
                       or v.tensor.device != b.device for v in kept):
        return False
    sizes = {v.axis: v.tensor.shape[0] for v in kept if v.axis != "p"}
    if set(sizes) != {"i", "j"} or sizes["j"] != b.shape[0] or not 0 < sizes["i"] * sizes["j"] <= MAX_PAIRS:
        return False
    if not {"i", "j"} <= {K.variables[s].axis for s in K.expr.free_symbols}:  # sympy folded it to one side
        return False
    return not autograd.differentiated([b, *(v.tensor for v in kept)])


def _matrix(K) -> torch.Tensor:
    """K's values on every pair, (N, M): one eager pass that keeps its tiles."""
    problem, _ = variables.problem(K.variables, "j")
    ((values,),) = engine.stream(problem, [Values(ir.numeric(K.expr))], backend="eager")
    return values[0]
