"""Log-sum-exp and the softmax-weighted sum: max-shifted, merged online.

Both keep, per row, the running maximum ``top`` of F, the shifted sum
``total = sum_j exp(F_j - top)`` and (softmax) the shifted weighted sum
``acc = sum_j exp(F_j - top) V_j``; ``merge`` rescales two such states to a
common maximum. Attention uses the same merge.

Their outputs carry the shift and the shifted sum besides the result
(``lse = shift + log total``): the gradient weights exp(F - lse) are computed
as exp(F - shift) / total, which keeps float32 accuracy when |lse| is large
(F - shift is exact near the maximum, F - lse is not). The shift is not
differentiable (the weights do not depend on it); the total is.

Their derivative formulas hold the weights as a placeholder symbol
(``Softmax``), so that the sums they become (``SoftmaxSum``) are
differentiated as dense autograd differentiates a softmax: centred per pair,
d w = w (dF - sum_k w dF), with no cotangent on the total. Uncentred,
sum_j w F'^2 - (sum_j w F')^2 in two streamed sums lost ~1e-5 of a Hessian's
relative accuracy in float64 where F ~ 1e6 and F' barely changes with j.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from .. import diff, inductor, ir
from .base import Reduction, column_side, masked
from .sum import Sum


def finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, 0.0)


def merge(state, partial):
    """Two online-softmax states (top, total, *weighted sums) rescaled to their common maximum.

    Each state's sums were shifted by ``finite(maximum)`` (0 for a maximum of
    +inf, whose sums are then inf, as torch's log-sum-exp has it). A state of
    no column (maximum -inf) weighs 0, also beside a maximum below -88
    (exp(0 - top) would overflow: inf * 0).
    """
    if state is None:
        return partial
    (m0, *rest0), (m1, *rest1) = state, partial
    top = torch.maximum(m0, m1)
    ref = finite(top)
    a0 = torch.exp(torch.where(m0 == -math.inf, -math.inf, finite(m0) - ref))
    a1 = torch.exp(torch.where(m1 == -math.inf, -math.inf, finite(m1) - ref))
    return (top, *(s0 * a0 + s1 * a1 for s0, s1 in zip(rest0, rest1)))


def shifted(values, mask):
    """exp(F - rowmax) over a tile's columns, padded columns 0; and the row max (B, n, C)."""
    f = masked(values, mask, -math.inf)
    top = f.amax(2)
    return inductor.tile_exp(f - finite(top).unsqueeze(2)), top


def scalar_with_weights(reduction, expr: sympy.Expr, weights: sympy.Expr, info: dict) -> None:
    """The constructor of every softmax-type reduction: a scalar formula F and weights G of E features."""
    if ir.feature_dim(expr, info) != 1:
        raise ValueError(f"{reduction.name}: the formula must have feature size 1 (the weights may have several)")
    reduction.expr, reduction.weights = expr, weights
    reduction.dim = ir.feature_dim(weights, info)
    reduction.expressions = [expr, weights]
    reduction.signature = (reduction.name, reduction.dim)


def weighted_sum(p, v, mask):
    """sum_j p_ij v_ij over a tile's columns: p (B, n, m, 1), v a lowered value (one matmul when v is j-only)."""
    if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[1] == 1:
        return torch.matmul(p[..., 0], column_side(v).expand(p.shape[0], -1, -1))
    return (p * masked(v, mask, 0.0)).sum(2)


class _OnlineSoftmax(Reduction):
    """Shared by both: the merge, and the gradient weights from the saved (total, shift)."""

    differentiable = (True, True, False)
    folds = True
    # Tiles of 1024 x 1024: a row's tile state is one column of values, so tall tiles fit the cache; fewer
    # tiles, less per-tile cost (the sinkhorn log-sum-exp, 4096^2, one thread: 39.2 ms at 256 x 1024, 33.0 ms).
    tile_hint = (1024, 1024)

    def combine(self, state, partial, at):
        return merge(state, partial)

    def _widths(self) -> tuple[int, ...]:
        """Channels of the state's (maximum, *sums)."""
        raise NotImplementedError

    def row_state(self, batch, rows, dtype, device):
        """Maximum -inf, sums 0: the state of no column."""
        top, *sums = self._widths()
        return (torch.full((batch, rows, top), -math.inf, dtype=dtype, device=device),
                *(torch.zeros(batch, rows, w, dtype=dtype, device=device) for w in sums))

    def _softmax(self, collector, outs) -> Softmax:
        """The weights exp(F - lse) = exp(F - shift) / total of the saved (total, shift), for ``collector``."""
        weight = Softmax(collector.fresh(), self.expr, collector.variable(outs[1], "i"),
                         collector.variable(outs[2], "i"), outs[1].shape[-1])
        collector.adopt({weight.symbol: weight})
        return weight


class LogSumExp(_OnlineSoftmax):
    """log sum_j exp F; outputs (lse, total, shift) with lse = shift + log total."""

    name = "logsumexp"

    def __init__(self, expr: sympy.Expr, info: dict):
        self.expr = expr
        self.dim = ir.feature_dim(expr, info)
        self.expressions = [expr]
        self.signature = ("lse", self.dim)

    def _widths(self):
        return self.dim, self.dim

    def partial(self, values, mask):
        p, top = shifted(values[0], mask)
        return top, p.sum(2)

    def finalize(self, state, rows, batch):
        top, total = state
        shift = finite(top)
        shape = (batch, rows, self.dim)
        return tuple(t.expand(shape).contiguous() for t in (torch.log(total) + shift, total, shift))

    def empty(self, batch, rows, dtype, device):
        shape = (batch, rows, self.dim)
        return torch.full(shape, -math.inf, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), \
            torch.zeros(shape, dtype=dtype, device=device)

    def vjp(self, collector, outs, grads):
        weight = self._softmax(collector, outs)
        if grads[0] is not None:
            collector.cotangent(self.expr, collector.variable(grads[0], "i") * weight.symbol)
        if grads[1] is not None:  # d total = total d lse
            collector.cotangent(self.expr, collector.variable(grads[1], "i") * weight.unnormalized)

    def jvp(self, collector, outs):
        weight = self._softmax(collector, outs)
        handle = collector.summed(weight.symbol * collector.tangent(self.expr), "j", self.dim)
        return lambda results: (results[handle], outs[1] * results[handle], torch.zeros_like(outs[2]))


class SoftmaxWeightedSum(_OnlineSoftmax):
    """sum_j softmax_j(F) V_j with an online softmax; outputs (out, total, shift)."""

    name = "softmax_weighted_sum"

    def __init__(self, expr: sympy.Expr, values: sympy.Expr, info: dict):
        scalar_with_weights(self, expr, values, info)

    def _widths(self):
        return 1, 1, self.dim

    def partial(self, values, mask):
        p, top = shifted(values[0], mask)
        return top, p.sum(2), weighted_sum(p, values[1], mask)

    def finalize(self, state, rows, batch):
        top, total, weighted = state
        out = torch.where(total == 0, 0.0, weighted / total).expand(batch, rows, self.dim).contiguous()  # NaN stays
        return out, total.expand(batch, rows, 1).contiguous(), finite(top).expand(batch, rows, 1).contiguous()

    def empty(self, batch, rows, dtype, device):
        zeros = lambda d: torch.zeros(batch, rows, d, dtype=dtype, device=device)  # noqa: E731
        return zeros(self.dim), zeros(1), zeros(1)

    def _centred(self, collector, outs):
        """V - out, one factor per pair."""
        return diff.grouped(self.weights - collector.variable(outs[0], "i"), self.dim)

    def vjp(self, collector, outs, grads):
        weight = self._softmax(collector, outs)
        if grads[0] is not None:
            g = collector.variable(grads[0], "i")
            collector.cotangent(self.expr, weight.symbol * ir.feature_sum(g * self._centred(collector, outs), self.dim))
            collector.cotangent(self.weights, weight.symbol * g)
        if grads[1] is not None:
            collector.cotangent(self.expr, collector.variable(grads[1], "i") * weight.unnormalized)

    def jvp(self, collector, outs):
        weight = self._softmax(collector, outs)
        df = collector.tangent(self.expr)
        tangent = df * self._centred(collector, outs) + collector.tangent(self.weights)
        h_out = collector.summed(weight.symbol * tangent, "j", self.dim)
        h_total = collector.summed(weight.unnormalized * df, "j", 1)
        return lambda results: (results[h_out], results[h_total], torch.zeros_like(outs[2]))


@dataclass(frozen=True)
class Softmax:
    """Softmax weights w = exp(F - shift) / total (total = sum_j exp(F - shift)) held as ``symbol`` in formulas.

    ``total`` and ``shift`` are the symbols of the saved i-variables. A formula
    in ``symbol`` is summed with the weights' value put in (``SoftmaxSum``)
    and differentiated through F only, centred per pair: w depends on F, and
    on the total only as its normalisation.
    """

    symbol: sympy.Symbol
    expr: sympy.Expr
    total: sympy.Symbol
    shift: sympy.Symbol
    dim: int

    @property
    def unnormalized(self) -> sympy.Expr:
        """exp(F - shift) with F evaluated whole, as the forward summed it: the weights then sum to 1 to rounding.

        Flattened into one sum with the shift, F ~ 1e6 rounds otherwise (by
        ~1e-10), and sum_j w - 1 is amplified by F'^2 in a second derivative.
        """
        return sympy.exp(diff.grouped(self.expr, self.dim) - self.shift)

    @property
    def value(self) -> sympy.Expr:
        return self.unnormalized / self.total

    def tangent(self, d_expr: sympy.Expr, d_total: sympy.Expr | None) -> sympy.Expr:
        """dw = w (dF - d total / total): d total / total = sum_j w dF is the mean of dF the difference removes."""
        mean = 0 if d_total is None else d_total / self.total
        return self.symbol * diff.grouped(d_expr - mean, self.dim)

    def on_expr(self, cot: sympy.Expr, centre: sympy.Expr) -> sympy.Expr:
        """A cotangent ``cot`` on w as one on F: w (cot - centre), ``centre`` = sum_j w cot (the total's share)."""
        return self.symbol * diff.grouped(cot - centre, self.dim)


class SoftmaxSum(Sum):
    """A sum of a formula in softmax weights (``Softmax`` placeholders): the derivatives of softmax reductions.

    The forward is ``Sum`` of the formula with the weights' values. Reverse
    mode hands the collector the cotangent on the formula in the placeholders
    (with ``centre``, the sum over j of w times the cotangent on w, when it is
    known: G . out for a formula linear in one scalar weight, summed over j),
    forward mode asks for the tangent of the formula in them.
    """

    def __init__(self, expr: sympy.Expr, softmaxes: dict, info: dict, dim: int, reduced_axis: str):
        self.in_weights, self.softmaxes = expr, softmaxes
        super().__init__(expr.xreplace({w: s.value for w, s in softmaxes.items()}), info, dim, reduced_axis)

    def vjp(self, collector, outs, grads):
        collector.adopt(self.softmaxes)
        g = collector.variable(grads[0], "i" if self.reduced_axis == "j" else "j")
        cot = ir.feature_sum(g, self.dim) if ir.feature_dim(self.expr, collector.info) < self.dim else g
        centre = None
        weight, *others = self.softmaxes
        if self.reduced_axis == "j" and not others and self.softmaxes[weight].dim == 1 \
                and self.in_weights.xreplace({weight: 0}) == 0:  # linear in w: sum_j w d(G . out)/dw = G . out
            centre = ir.feature_sum(g * collector.variable(outs[0], "i"), self.dim)
        collector.cotangent(self.in_weights, cot, centre)

    def jvp(self, collector, outs):
        collector.adopt(self.softmaxes)
        handle = collector.summed(collector.tangent(self.in_weights), self.reduced_axis, self.dim)
        return lambda results: (results[handle],)
