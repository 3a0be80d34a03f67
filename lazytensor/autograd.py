"""Reductions as autograd functions whose backward passes are streamed too.

The backward of ``out_i = reduce_j F(x_i, y_j, p)`` is derived symbolically:
each reduction turns the output cotangent into a cotangent on the tile
values F_ij (for a sum simply G_i; for log-sum-exp G_i exp(F_ij - L_i); ...),
``ir.vjp`` turns that into formulas for every input, and the formulas run as
streamed sums through the same engine: i-variables and parameters in one
pass over j, j-variables in one pass over i. Min/max/k-min values depend on
the selected pairs only, so their backward evaluates the same formulas on
those pairs and scatters the result. No N x M tensor is saved or built.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from . import engine, ir, reductions


@dataclass(frozen=True)
class Reduction:
    """What to reduce and how: the IR, the reduction kind and its options."""

    kind: str  # "sum" | "lse" | "softmax" | "argmin" | "kmin"
    expr: sympy.Expr
    values: sympy.Expr | None = None  # softmax: the weighted values
    k: int = 1  # kmin
    sign: int = 1  # argmin: -1 for max
    backend: str = "auto"
    chunk_size: object = None

    def consumer(self, info):
        if self.kind == "sum":
            return reductions.Sum(self.expr, info)
        if self.kind == "lse":
            return reductions.LogSumExp(self.expr, info)
        if self.kind == "softmax":
            return reductions.SoftmaxWeightedSum(self.expr, self.values, info)
        if self.kind == "argmin":
            return reductions.ArgMin(self.expr, info, self.sign)
        if self.kind == "kmin":
            return reductions.KMin(self.expr, info, self.k)
        raise ValueError(f"unknown reduction {self.kind!r}")


def run(reduction: Reduction, problem: engine.Problem) -> tuple[torch.Tensor, ...]:
    """Forward outputs (B, N, ...) of a reduction over the problem's j axis."""
    consumer = reduction.consumer(problem.info)
    (outs,) = engine.stream(problem, [consumer], backend=reduction.backend, chunk_size=reduction.chunk_size)
    return outs


class StreamedReduction(torch.autograd.Function):
    """autograd glue: forward = ``run``, backward = streamed VJP formulas."""

    @staticmethod
    def forward(ctx, reduction: Reduction, problem: engine.Problem, *tensors):
        problem = engine.Problem(problem.info, dict(zip(problem.order, tensors)), problem.order)
        outs = run(reduction, problem)
        ctx.reduction, ctx.problem = reduction, problem
        ctx.save_for_backward(*tensors, *outs)
        if reduction.kind in ("argmin", "kmin"):
            ctx.mark_non_differentiable(outs[1])
        return outs[0] if reduction.kind in ("sum", "lse") else outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        reduction, problem = ctx.reduction, ctx.problem
        saved = ctx.saved_tensors
        tensors = dict(zip(problem.order, saved[: len(problem.order)]))
        outs = saved[len(problem.order) :]
        problem = engine.Problem(problem.info, tensors, problem.order)
        wanted = [s for s, need in zip(problem.order, ctx.needs_input_grad[2:]) if need]
        if not wanted or grads[0] is None:
            return (None, None, *[None] * len(problem.order))
        if reduction.kind in ("argmin", "kmin"):
            result = _selected_pairs_vjp(reduction, problem, wanted, grads[0], outs[1])
        else:
            result = _streamed_vjp(reduction, problem, wanted, grads[0], outs)
        return (None, None, *[result.get(s) for s in problem.order])


def _extend(problem: engine.Problem, extra: dict[sympy.Symbol, tuple[torch.Tensor, str]]) -> engine.Problem:
    info = dict(problem.info)
    tensors = dict(problem.tensors)
    for sym, (tensor, axis) in extra.items():
        info[sym] = ir.VarInfo(axis, tensor.shape[-1])
        tensors[sym] = tensor
    return engine.Problem(info, tensors, problem.order + list(extra))


def _cotangent_pairs(reduction: Reduction, problem: engine.Problem, grad, outs):
    """Cotangents on the tile values, plus the new i-variables they use."""
    g = ir.new_variable_symbol()
    extra = {g: (grad.contiguous(), "i")}
    f = reduction.expr
    if reduction.kind == "sum":
        return [(f, g)], extra
    lse = ir.new_variable_symbol()
    extra[lse] = (outs[0] if reduction.kind == "lse" else outs[1], "i")
    weight = sympy.exp(f - lse)
    if reduction.kind == "lse":
        return [(f, g * weight)], extra
    out = ir.new_variable_symbol()
    extra[out] = (outs[0], "i")
    v = reduction.values
    return [(f, weight * (ir.FSum(g * v) - ir.FSum(g * out))), (v, weight * g)], extra


def _reduce_grad(grad: torch.Tensor, like: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum a gradient over broadcast dimensions back to the input's shape."""
    if axis == "p":
        return grad.sum(dim=tuple(range(grad.dim() - 1))).reshape(like.shape)
    if like.shape[0] == 1 and grad.shape[0] != 1:
        grad = grad.sum(0, keepdim=True)
    return grad


def _streamed_vjp(reduction, problem, wanted, grad, outs):
    pairs, extra = _cotangent_pairs(reduction, problem, grad, outs)
    full = _extend(problem, extra)
    formulas = ir.vjp(pairs, wanted, full.info)
    # One pass for every input: i-variables and parameters sum over j (rows), j-variables over i
    # (ColumnSum), so each tile of the formula and its derivatives is evaluated once.
    consumers = [
        (reductions.ColumnSum if problem.info[s].axis == "j" else reductions.Sum)(formulas[s], full.info, problem.info[s].dim)
        for s in wanted
    ]
    outs_ = engine.stream(full, consumers, backend=reduction.backend, chunk_size=reduction.chunk_size)
    return {s: _reduce_grad(g, problem.tensors[s], problem.info[s].axis) for s, (g,) in zip(wanted, outs_)}


def _selected_pairs_vjp(reduction, problem, wanted, grad, index):
    """Backward of min/max/k-min values: the formula's VJP on the selected pairs.

    Each selection (row i, rank r, channel c) becomes one row of a pair
    problem in which every variable is i-indexed (j-variables gathered at the
    selected index) and the cotangent is G[i, r, c] on channel c only.
    """
    batch, n = index.shape[0], index.shape[1]
    dim = ir.feature_dim(reduction.expr, problem.info)
    index = index.reshape(batch, n, -1, dim)  # (B, N, k, C)
    grad = grad.reshape(batch, n, -1, dim)
    k = index.shape[2]
    sel = k * dim
    flat_index = index.reshape(batch, n * sel)
    channel = torch.arange(dim, device=grad.device).repeat(k)  # channel of each selection
    cot = torch.zeros(batch, n, sel, dim, dtype=grad.dtype, device=grad.device)
    cot.scatter_(3, channel.view(1, 1, sel, 1).expand(batch, n, sel, 1), grad.reshape(batch, n, sel, 1))
    info, tensors = {}, {}
    for s in problem.order:
        axis, t = problem.info[s].axis, problem.tensors[s]
        if axis == "i":
            t = t.unsqueeze(2).expand(-1, -1, sel, -1).reshape(t.shape[0], n * sel, -1)
        elif axis == "j":
            t = torch.gather(t.expand(batch, -1, -1), 1, flat_index.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
        info[s] = ir.VarInfo("i" if axis != "p" else "p", problem.info[s].dim)
        tensors[s] = t
    g = ir.new_variable_symbol()
    dummy = ir.new_variable_symbol()  # one column: the "reduction" is the identity
    info[g], tensors[g] = ir.VarInfo("i", dim), cot.reshape(batch, n * sel, dim)
    info[dummy], tensors[dummy] = ir.VarInfo("j", 1), grad.new_zeros(1, 1, 1)
    pairs = engine.Problem(info, tensors, problem.order + [g, dummy])
    formulas = ir.vjp([(reduction.expr, g)], wanted, info)
    consumers = [reductions.Sum(formulas[s], info, info[s].dim) for s in wanted]
    outs = engine.stream(pairs, consumers, backend="eager", chunk_size=None)
    result = {}
    for s, (contrib,) in zip(wanted, outs):
        axis, like = problem.info[s].axis, problem.tensors[s]
        if axis == "i":
            contrib = contrib.reshape(batch, n, sel, -1).sum(2)
        elif axis == "j":
            target = contrib.new_zeros(batch, like.shape[1], contrib.shape[-1])
            contrib = target.scatter_add_(1, flat_index.unsqueeze(-1).expand_as(contrib), contrib)
        result[s] = _reduce_grad(contrib, like, axis)
    return result
