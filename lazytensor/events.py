"""Event streaming: one pass over a formula's tiles feeding several reductions.

``stream(F, ["sum", "max"])`` evaluates every tile of ``F`` once and
publishes it to a sum and a max consumer, instead of paying for the formula
twice. Each result is differentiable as if it had been computed alone: the
pass is one ``autograd.reduce`` call over a list of reduction objects.

Reductions are named like the LazyTensor methods: ``"sum"``,
``"logsumexp"``, ``"min"``, ``"max"``, ``"argmin"``, ``"argmax"``,
``"min_argmin"``, ``"max_argmax"``, ``("kmin", k)``, ``("argkmin", k)``,
``("kmin_argkmin", k)`` and ``("softmax_weighted_sum", values)``.
"""
from __future__ import annotations

import torch

from . import autograd, distributed, engine, ir, reductions
from .formula import LazyTensor, _axis, as_lazy
from .plan import check_chunk_size

# name -> (factory(expr, info, argument), which outputs the caller gets)
_NAMES = {
    "sum": (lambda e, info, _: reductions.Sum(e, info), (0,)),
    "logsumexp": (lambda e, info, _: reductions.LogSumExp(e, info), (0,)),
    "min": (lambda e, info, _: reductions.ArgMin(e, info), (0,)),
    "argmin": (lambda e, info, _: reductions.ArgMin(e, info), (1,)),
    "min_argmin": (lambda e, info, _: reductions.ArgMin(e, info), (0, 1)),
    "max": (lambda e, info, _: reductions.ArgMax(e, info), (0,)),
    "argmax": (lambda e, info, _: reductions.ArgMax(e, info), (1,)),
    "max_argmax": (lambda e, info, _: reductions.ArgMax(e, info), (0, 1)),
    "kmin": (lambda e, info, k: reductions.KMin(e, info, k), (0,)),
    "argkmin": (lambda e, info, k: reductions.KMin(e, info, k), (1,)),
    "kmin_argkmin": (lambda e, info, k: reductions.KMin(e, info, k), (0, 1)),
    "softmax_weighted_sum": (lambda e, info, v: reductions.SoftmaxWeightedSum(e, ir.numeric(v.expr), info), (0,)),
}
_WITH_ARGUMENT = ("kmin", "argkmin", "kmin_argkmin", "softmax_weighted_sum")


def _parse(spec, axis: str):
    """A reduction spec -> (name, argument: k, a values LazyTensor or None)."""
    name, arg = (spec, None) if isinstance(spec, str) else (tuple(spec) + (None,))[:2]
    if name not in _NAMES:
        raise ValueError(f"stream: unknown reduction {spec!r}; known: {sorted(_NAMES)}")
    if (name in _WITH_ARGUMENT) != (arg is not None):
        need = "(name, argument)" if name in _WITH_ARGUMENT else "a plain name"
        raise ValueError(f"stream: reduction {name!r} must be given as {need}, got {spec!r}")
    if name == "softmax_weighted_sum":
        arg = LazyTensor(arg, axis) if isinstance(arg, torch.Tensor) else as_lazy(arg)
    elif arg is not None and (isinstance(arg, bool) or not isinstance(arg, int) or arg < 1):
        raise ValueError(f"stream: k must be a positive integer, got {arg!r}")
    return name, arg


def stream(source: LazyTensor, reductions, dim=1, *, backend: str = "auto", chunk_size=None, group=None) -> tuple:
    """Reduce ``source`` over ``dim`` by every named reduction in one pass over its tiles.

    Returns one entry per reduction, shaped as the LazyTensor method of that
    name returns it (``min_argmin`` / ``kmin_argkmin`` give a pair). ``group``
    shards the reduced axis as in ``lazytensor.distributed``.
    """
    if not isinstance(source, LazyTensor):
        raise TypeError(f"stream: source must be a LazyTensor formula, got {type(source).__name__}")
    if isinstance(reductions, (str, tuple)) or not reductions:
        raise ValueError("stream: reductions must be a non-empty list, e.g. ['sum', 'max']")
    axis = _axis(dim)
    engine.check_backend(backend)
    check_chunk_size(chunk_size)
    parsed = [_parse(spec, axis) for spec in reductions]
    values = [arg for name, arg in parsed if name == "softmax_weighted_sum"]
    combined = LazyTensor._build(source.expr, source, *values, width=source.width)
    problem, batch = combined.problem(axis)
    sharding = distributed.active(group)
    total = problem.size("j") if sharding is None else sum(sharding.sizes(problem.size("j"), problem.device))
    expr = ir.numeric(source.expr)
    for name, arg in parsed:
        if name in _WITH_ARGUMENT[:3] and arg > total:
            raise ValueError(f"stream: {name} k={arg} is larger than the {total} entries reduced over")
    objects = [_NAMES[name][0](expr, problem.info, arg) for name, arg in parsed]
    results = []
    for (name, _), outs in zip(parsed, autograd.reduce(problem, objects, backend, chunk_size, sharding=sharding)):
        if name != "softmax_weighted_sum":
            outs = tuple(source._widen(o) for o in outs)
        if name in _WITH_ARGUMENT[:3]:
            outs = tuple(o.squeeze(-1) if o.shape[-1] == 1 else o for o in outs)
        picked = tuple(outs[i].reshape(*batch, *outs[i].shape[1:]) for i in _NAMES[name][1])
        results.append(picked[0] if len(picked) == 1 else picked)
    return tuple(results)
