"""Running named reductions over a formula: the one path from a LazyTensor to ``autograd.reduce``.

``LazyTensor``'s reduction methods (one request) and ``lazytensor.stream``
(several) end here. The options are checked, the engine problem is built
from the formula's variables and its formula arguments', each reduction
object comes from the ``reductions.named`` table, and one
``autograd.reduce`` call runs them all; the outputs are reshaped to the batch
shape, shaped as the table says and delivered (NumPy arrays when the inputs
were, written into ``out=`` when given).

Under a sharding (``group=`` or ``lazytensor.distributed.sharded``) the
reduced axis's variables are this rank's shard; ``problem.reduced_size`` is
the total.
"""
from __future__ import annotations

import numpy as np
import torch

from . import autograd, cluster, distributed, engine, ir, precision, variables
from .kept import Kept
from .opaque import opaque
from .plan import check_chunk_size, check_ranges
from .reductions import named

# Options every reduction takes (``axis`` is KeOps's and NumPy's name for ``dim``; ``sum_scheme`` is KeOps's).
REDUCTION_OPTIONS = ("backend", "chunk_size", "ranges", "out", "axis", "group", "sum_scheme")
# KeOps's summation orders: ours sums each tile, then the tiles ("block_sum"); "kahan_scheme" asks for more
# accuracy than float32 accumulation, which sums give by accumulating in float64.
SUM_SCHEMES = ("auto", "direct_sum", "block_sum", "kahan_scheme")
_OBJECTS = Kept()  # reduction objects of calls that repeat (``_built``)


def reduced_axis(dim, nbatchdims: int = 0) -> str:
    """The reduced axis: 1 / 'j' / -2 reduce over j, 0 / 'i' / -3 over i (batch dims are not counted)."""
    if isinstance(dim, (bool, float)):  # True == 1 and 1.0 == 1, but neither names an axis
        raise ValueError(f"dim must be 0/'i' or 1/'j' for a reduction, got {dim!r}")
    if dim in (1, "j", -2):
        return "j"
    if dim in (0, "i", -3):
        return "i"
    hint = (f"; batch dimensions are not counted (KeOps's dim={nbatchdims} / {nbatchdims + 1} is 0 / 1 here)"
            if nbatchdims and dim in (nbatchdims, nbatchdims + 1) else "")
    raise ValueError(f"dim must be 0/'i' or 1/'j' for a reduction, got {dim!r}{hint}")


def check_options(options: dict) -> None:
    unknown = sorted(set(options) - set(REDUCTION_OPTIONS))
    if unknown:
        hint = " (dtype_acc is an option of sum and K @ b)" if "dtype_acc" in unknown else ""
        raise TypeError(f"unexpected reduction option(s) {unknown}{hint}; known: {list(REDUCTION_OPTIONS)}")
    if options.get("sum_scheme", "auto") not in SUM_SCHEMES:
        raise ValueError(f"sum_scheme must be one of {list(SUM_SCHEMES)}, got {options['sum_scheme']!r}")


@opaque  # opaque to a caller's torch.compile (see LazyTensor.__init__ and lazytensor.opaque)
def run(source, requests: list, axis: str, options: dict) -> list:
    """Each ``(name, argument)`` of ``requests`` reduced over ``axis`` in one pass over ``source``'s tiles.

    Formula arguments are LazyTensors already indexed like the reduced axis.
    Returns one entry per request: a tensor, or a tuple for names with
    several public outputs (``min_argmin``, ``kmin_argkmin``, ...).
    """
    check_options(options)
    backend = engine.check_backend(options.get("backend", "auto"))
    chunk_size = options.get("chunk_size")
    check_chunk_size(chunk_size)
    entries = [named.check(name, argument) for name, argument in requests]
    is_formula = [e.argument in named.FORMULA_ARGUMENTS and a is not None for e, (_, a) in zip(entries, requests)]
    formulas = [a for formula, (_, a) in zip(is_formula, requests) if formula]
    (expr, *formula_exprs), merged = variables.aligned([(f.expr, f.variables) for f in [source, *formulas]])
    problem, batch = variables.problem(merged, axis)
    ranges = _ranges(options.get("ranges", source.ranges), problem, axis, batch, requests, entries)
    sharding = distributed.active(options.get("group"))
    if sharding is not None:
        if ranges is not None:
            raise ValueError("ranges (block-sparse reductions) are not supported with a sharded (group=) reduction")
        problem = problem.sharded_over(sum(sharding.sizes(problem.size("j"), problem.device)))
    formula_exprs = iter(formula_exprs)
    expr = ir.numeric(expr)
    arguments = [ir.numeric(next(formula_exprs)) if formula else precision.widened(a)
                 for formula, (_, a) in zip(is_formula, requests)]
    objects = [_built(e, expr, problem, a, source.width) for e, a in zip(entries, arguments)]
    results = autograd.reduce(problem, objects, backend, chunk_size, ranges=ranges, sharding=sharding)
    as_numpy = variables.from_numpy(merged)
    dtype = next(iter(merged.values())).tensor.dtype  # the variables' one dtype (``variables.check``)
    delivered = []
    for entry, (_, argument), outs in zip(entries, requests, results):
        outs = tuple(precision.narrowed(o.reshape(*batch, *o.shape[1:]), dtype) for o in outs)
        outs = _deliver(entry.shape(tuple(outs[k] for k in entry.outputs), source.width, argument), options.get("out"), as_numpy)
        delivered.append(outs[0] if len(outs) == 1 else outs)
    return delivered


def _built(entry, expr, problem, argument, width: int):
    """``entry``'s reduction object, kept by all it is built from: a call repeated in a loop gets the same
    object, and with it the engine's kept per-pass set-up (``engine._setup``, keyed by its consumers).
    Tensor and other unhashable arguments (quantile levels) are built every call."""
    def build():
        return entry.build(expr, problem, argument, width)

    if isinstance(argument, torch.Tensor):
        return build()
    key = (entry, expr, tuple(problem.info.items()), problem.dtype, problem.device, problem.reduced_size, argument, width)
    try:
        hash(key)
    except TypeError:
        return build()
    return _OBJECTS.get(key, build)


def _ranges(ranges, problem, axis: str, batch: tuple, requests: list, entries: list):
    """KeOps's ``ranges`` checked against the problem and the reductions that must honour them."""
    ranges = check_ranges(cluster.keops_ranges(ranges), problem, axis)
    if ranges is None:
        return None
    if batch:
        raise ValueError("ranges (block-sparse reductions) are not supported with batch dimensions")
    for (name, _), entry in zip(requests, entries):
        if not entry.block_sparse:
            raise ValueError(f"{name} does not support ranges (block-sparse reductions)")
    return ranges


def _deliver(outs: tuple, out, as_numpy: bool) -> tuple:
    """Results as NumPy arrays when the inputs were, written into ``out`` when given."""
    if as_numpy:
        outs = tuple(o.detach().cpu().numpy() for o in outs)
    if out is None:
        return outs
    targets = out if isinstance(out, (tuple, list)) else (out,)
    if len(targets) != len(outs):
        raise ValueError(f"out: expected {len(outs)} output(s), got {len(targets)}")
    for target, result in zip(targets, outs):
        if not isinstance(target, (torch.Tensor, np.ndarray)) or tuple(target.shape) != tuple(result.shape):
            raise ValueError(f"out must be a {'NumPy array' if as_numpy else 'tensor'} of shape {tuple(result.shape)}, got "
                             f"{type(target).__name__} {tuple(getattr(target, 'shape', ()))}")
        if isinstance(result, torch.Tensor):
            if result.requires_grad and torch.is_grad_enabled():
                raise ValueError("out= does not support automatic differentiation (as torch's out= arguments); "
                                 "drop out= or run under torch.no_grad()")
            if not torch.can_cast(result.dtype, target.dtype):  # torch's out= rule: float results never land in ints
                raise TypeError(f"out: result type {result.dtype} can't be cast to the desired output type {target.dtype}")
            target.copy_(result)
        else:
            np.copyto(target, result)
    return tuple(targets)
