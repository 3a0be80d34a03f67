"""Log-sum-exp with weights (KeOps's LogSumExpWeight): log sum_j exp(F_ij) G_ij, one value per feature of G.

F is scalar and G has E features. The state is the softmax family's
(running max, sum_j exp(F - max) G), merged online; the outputs are
(lse, total, shift) with lse = shift + log total per feature, so the
gradient weights exp(F - lse) are exp(F - shift) / total, accurate in
float32 when |lse| is large (as for LogSumExp).
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import ir
from .softmax import _OnlineSoftmax, finite, scalar_with_weights, shifted, weighted_sum


class LogSumExpWeight(_OnlineSoftmax):
    """log sum_j exp(F) G per feature of G; outputs (lse, total, shift)."""

    name = "logsumexp_weight"

    def __init__(self, expr: sympy.Expr, weights: sympy.Expr, info: dict):
        scalar_with_weights(self, expr, weights, info)

    def _widths(self):
        return 1, self.dim

    def partial(self, values, mask):
        p, top = shifted(values[0], mask)
        return top, weighted_sum(p, values[1], mask)

    def finalize(self, state, rows, batch):
        top, total = state
        total = total.expand(batch, rows, self.dim).contiguous()
        shift = finite(top).expand(batch, rows, 1).contiguous()
        return torch.log(total) + shift, total, shift

    def empty(self, batch, rows, dtype, device):
        zeros = lambda d: torch.zeros(batch, rows, d, dtype=dtype, device=device)  # noqa: E731
        return torch.full((batch, rows, self.dim), -math.inf, dtype=dtype, device=device), zeros(self.dim), zeros(1)

    def vjp(self, collector, outs, grads):
        softmax = self._softmax(collector, outs)  # its total weighs exp(F - shift) by G: values, not centred
        weight, unnormalized = softmax.value, softmax.unnormalized  # exp(F - lse) per feature, exp(F - shift)
        per_feature = 0  # the cotangent of each feature of exp(F - shift) G
        if grads[0] is not None:
            per_feature = per_feature + collector.variable(grads[0], "i") * weight
        if grads[1] is not None:  # d total = sum_j exp(F - shift) (dF G + dG)
            per_feature = per_feature + collector.variable(grads[1], "i") * unnormalized
        collector.cotangent(self.expr, ir.feature_sum(per_feature * self.weights, self.dim))
        collector.cotangent(self.weights, per_feature)

    def jvp(self, collector, outs):
        unnormalized = self._softmax(collector, outs).unnormalized
        tangent = collector.tangent(self.expr) * self.weights + collector.tangent(self.weights)
        handle = collector.summed(unnormalized * tangent, "j", self.dim)
        return lambda results: (results[handle] / outs[1], results[handle], torch.zeros_like(outs[2]))
