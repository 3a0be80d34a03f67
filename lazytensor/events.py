"""Event streaming: one pass over a formula's tiles feeding several reductions.

``stream(F, ["sum", "max"])`` evaluates every tile of ``F`` once and
publishes it to a sum and a max consumer, instead of paying for the formula
twice. Each result is differentiable as if it had been computed alone: the
pass is one ``autograd.reduce`` call over a list of reduction objects
(``run.run``, the path every LazyTensor reduction takes).

Reductions are the names of the LazyTensor methods, from the
``reductions.named`` table: ``"sum"``, ``"logsumexp"``, ``"min"``, ``"max"``,
``"argmin"``, ``"argmax"``, ``"min_argmin"``, ``"max_argmax"``,
``"max_sumshiftexp"``, ``("kmin", k)``, ``("argkmin", k)``,
``("kmin_argkmin", k)``, ``("softmax_weighted_sum", values)`` and
``("quantile", q)`` (its own passes: a quantile is found by replay);
optional arguments come the same way: ``("sum", torch.float64)`` (the
accumulation dtype), ``("logsumexp", weight)``, ``("max_sumshiftexp", weight)``.
"""
from __future__ import annotations

from . import run
from .lazy_tensor import LazyTensor, along
from .reductions import named


def _request(spec, axis: str) -> tuple:
    """A reduction spec -> (name, argument), formula arguments indexed like the reduced ``axis``."""
    name, argument = (spec, None) if isinstance(spec, str) else (tuple(spec) + (None,))[:2]
    if not isinstance(name, str):
        raise ValueError(f"stream: a reduction is a name or a (name, argument) pair, got {spec!r}")
    entry = named.check(name, argument)
    if entry.argument in named.FORMULA_ARGUMENTS and argument is not None:
        argument = along(argument, axis)
    return name, argument


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
    axis = run.reduced_axis(dim)
    requests = [_request(spec, axis) for spec in reductions]
    return tuple(run.run(source, requests, axis, {"backend": backend, "chunk_size": chunk_size, "group": group}))
