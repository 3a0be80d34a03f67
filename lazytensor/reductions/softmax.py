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
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import inductor, ir
from .base import Reduction, column_side, masked


def finite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, 0.0)


def merge(state, partial):
    """Two online-softmax states (top, total, *weighted sums) rescaled to their common maximum.

    A state whose maximum is not finite (-inf: nothing yet) weighs 0, also
    beside a maximum below -88 (exp(0 - top) would overflow: inf * 0).
    """
    if state is None:
        return partial
    (m0, *rest0), (m1, *rest1) = state, partial
    top = torch.maximum(m0, m1)
    ref = finite(top)
    a0 = torch.exp(torch.where(torch.isfinite(m0), m0 - ref, -math.inf))
    a1 = torch.exp(torch.where(torch.isfinite(m1), m1 - ref, -math.inf))
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

    def _weight(self, collector, outs):
        """exp(F - lse) as exp(F - shift) / total, and exp(F - shift)."""
        total, shift = collector.variable(outs[1], "i"), collector.variable(outs[2], "i")
        unnormalized = sympy.exp(self.expr - shift)
        return unnormalized / total, unnormalized


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
        weight, unnormalized = self._weight(collector, outs)
        cot = 0
        if grads[0] is not None:
            cot = cot + collector.variable(grads[0], "i") * weight
        if grads[1] is not None:  # d total = total d lse
            cot = cot + collector.variable(grads[1], "i") * unnormalized
        collector.cotangent(self.expr, cot)

    def jvp(self, collector, outs):
        weight, _ = self._weight(collector, outs)
        handle = collector.summed(weight * collector.tangent(self.expr), "j", self.dim)
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
        out = torch.where(total > 0, weighted / total, 0.0).expand(batch, rows, self.dim).contiguous()
        return out, total.expand(batch, rows, 1).contiguous(), finite(top).expand(batch, rows, 1).contiguous()

    def empty(self, batch, rows, dtype, device):
        zeros = lambda d: torch.zeros(batch, rows, d, dtype=dtype, device=device)  # noqa: E731
        return zeros(self.dim), zeros(1), zeros(1)

    def vjp(self, collector, outs, grads):
        weight, unnormalized = self._weight(collector, outs)
        cot_f = 0
        if grads[0] is not None:
            g, out = collector.variable(grads[0], "i"), collector.variable(outs[0], "i")
            cot_f = weight * (ir.feature_sum(g * self.weights, self.dim) - ir.feature_sum(g * out, self.dim))
            collector.cotangent(self.weights, weight * g)
        if grads[1] is not None:
            cot_f = cot_f + collector.variable(grads[1], "i") * unnormalized
        collector.cotangent(self.expr, cot_f)

    def jvp(self, collector, outs):
        weight, unnormalized = self._weight(collector, outs)
        out = collector.variable(outs[0], "i")
        df = collector.tangent(self.expr)
        h_out = collector.summed(weight * (df * (self.weights - out) + collector.tangent(self.weights)), "j", self.dim)
        h_total = collector.summed(unnormalized * df, "j", 1)
        return lambda results: (results[h_out], results[h_total], torch.zeros_like(outs[2]))
