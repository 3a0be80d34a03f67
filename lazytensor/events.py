"""Event streaming: one pass over a formula's tiles feeding several reductions.

``stream(F, ["sum", "max"])`` evaluates every tile of ``F`` once and
publishes it to a sum and a max consumer, instead of paying for the formula
twice. Each result is differentiable as if it had been computed alone; the
backward of each reduction is the streamed VJP of ``autograd``.

Reductions are named like the LazyTensor methods: ``"sum"``,
``"logsumexp"``, ``"min"``, ``"max"``, ``"argmin"``, ``"argmax"``,
``"min_argmin"``, ``"max_argmax"``, ``("kmin", k)``, ``("argkmin", k)``,
``("kmin_argkmin", k)`` and ``("softmax_weighted_sum", values)``.
"""
from __future__ import annotations

import torch

from . import autograd, engine
from .formula import LazyTensor, _axis, _unbatch, as_lazy

# name -> (reduction kind, sign, which outputs the caller gets)
_NAMES = {
    "sum": ("sum", 1, (0,)),
    "logsumexp": ("lse", 1, (0,)),
    "min": ("argmin", 1, (0,)),
    "argmin": ("argmin", 1, (1,)),
    "min_argmin": ("argmin", 1, (0, 1)),
    "max": ("argmin", -1, (0,)),
    "argmax": ("argmin", -1, (1,)),
    "max_argmax": ("argmin", -1, (0, 1)),
    "kmin": ("kmin", 1, (0,)),
    "argkmin": ("kmin", 1, (1,)),
    "kmin_argkmin": ("kmin", 1, (0, 1)),
    "softmax_weighted_sum": ("softmax", 1, (0,)),
}
_WITH_ARGUMENT = ("kmin", "argkmin", "kmin_argkmin", "softmax_weighted_sum")


def _parse(spec, source: LazyTensor, axis: str):
    """A reduction spec -> (name, kind, sign, picked outputs, k, values LazyTensor or None)."""
    name, arg = (spec, None) if isinstance(spec, str) else (tuple(spec) + (None,))[:2]
    if name not in _NAMES:
        raise ValueError(f"stream: unknown reduction {spec!r}; known: {sorted(_NAMES)}")
    if (name in _WITH_ARGUMENT) != (arg is not None):
        need = "(name, argument)" if name in _WITH_ARGUMENT else "a plain name"
        raise ValueError(f"stream: reduction {name!r} must be given as {need}, got {spec!r}")
    kind, sign, picked = _NAMES[name]
    k, values = 1, None
    if kind == "kmin":
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 1:
            raise ValueError(f"stream: k must be a positive integer, got {arg!r}")
        k = arg
    if kind == "softmax":
        values = LazyTensor(arg, axis) if isinstance(arg, torch.Tensor) else as_lazy(arg)
    return name, kind, sign, picked, k, values


class _Events(torch.autograd.Function):
    """All reductions from one forward pass; each backward is that reduction's streamed VJP."""

    @staticmethod
    def forward(ctx, reductions, problem, *tensors):
        problem = engine.Problem(problem.info, dict(zip(problem.order, tensors)), problem.order)
        consumers = [r.consumer(problem.info) for r in reductions]
        outs = engine.stream(problem, consumers, backend=reductions[0].backend, chunk_size=reductions[0].chunk_size)
        ctx.reductions, ctx.problem, ctx.sizes = reductions, problem, [len(o) for o in outs]
        flat = [t for o in outs for t in o]
        ctx.save_for_backward(*tensors, *flat)
        ctx.mark_non_differentiable(*[o[1] for r, o in zip(reductions, outs) if r.kind in ("argmin", "kmin")])
        return tuple(flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        problem = ctx.problem
        saved = ctx.saved_tensors
        count = len(problem.order)
        problem = engine.Problem(problem.info, dict(zip(problem.order, saved[:count])), problem.order)
        wanted = [s for s, need in zip(problem.order, ctx.needs_input_grad[2:]) if need]
        total: dict = {}
        start = 0
        for reduction, size in zip(ctx.reductions, ctx.sizes):
            outs, grad = saved[count + start : count + start + size], grads[start]
            start += size
            if grad is None or not wanted:
                continue
            if reduction.kind in ("argmin", "kmin"):
                part = autograd._selected_pairs_vjp(reduction, problem, wanted, grad, outs[1])
            else:
                part = autograd._streamed_vjp(reduction, problem, wanted, grad, outs)
            for s, g in part.items():
                total[s] = g if s not in total else total[s] + g
        return (None, None, *[total.get(s) for s in problem.order])


def stream(source: LazyTensor, reductions, dim=1, *, backend: str = "auto", chunk_size=None) -> tuple:
    """Reduce ``source`` over ``dim`` by every named reduction in one pass over its tiles.

    Returns one entry per reduction, shaped as the LazyTensor method of that
    name returns it (``min_argmin`` / ``kmin_argkmin`` give a pair).
    """
    if not isinstance(source, LazyTensor):
        raise TypeError(f"stream: source must be a LazyTensor formula, got {type(source).__name__}")
    if isinstance(reductions, (str, tuple)) or not reductions:
        raise ValueError("stream: reductions must be a non-empty list, e.g. ['sum', 'max']")
    axis = _axis(dim)
    parsed = [_parse(spec, source, axis) for spec in reductions]
    combined = LazyTensor._build(source.expr, source, *[p[5] for p in parsed if p[5] is not None], width=source.width)
    problem = combined.problem(axis)
    for name, kind, _, _, k, _ in parsed:
        if kind == "kmin" and k > problem.size("j"):
            raise ValueError(f"stream: {name} k={k} is larger than the {problem.size('j')} entries reduced over")
    specs = [
        autograd.Reduction(kind, source.expr, values.expr if values is not None else None, k, sign, backend, chunk_size)
        for _, kind, sign, _, k, values in parsed
    ]
    flat = _Events.apply(specs, problem, *[problem.tensors[s] for s in problem.order])
    results, start = [], 0
    for (name, kind, _, picked, _, _), spec in zip(parsed, specs):
        size = 2 if kind in ("softmax", "argmin", "kmin") else 1
        outs = flat[start : start + size]
        start += size
        if kind == "kmin":
            outs = tuple(o.squeeze(-1) if o.shape[-1] == 1 else o for o in outs)
        picked_outs = tuple(_unbatch(outs[i], combined._batched) for i in picked)
        results.append(picked_outs[0] if len(picked_outs) == 1 else picked_outs)
    return tuple(results)
