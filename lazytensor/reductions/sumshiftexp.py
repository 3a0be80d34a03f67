"""KeOps's Max_SumShiftExp(Weight): the raw state of every softmax-type reduction, as a result.

m_i = max_j F_ij and s_i = sum_j exp(F_ij - m_i) G_ij (G = 1 without a
weight); log-sum-exp is m + log s and a softmax-weighted sum s_G / s_1.
Blocks merge by rescaling to the larger maximum (``softmax.merge``). The
outputs are (m, s, argmax): unlike KeOps, whose gradient assumes the pair is
flattened into m + log s, both are differentiated exactly: m through its
first maximizing pair, s as a sum whose shift m also moves.
"""
from __future__ import annotations

import math

import sympy
import torch

from .. import inductor, ir
from .base import Reduction, channels_at_selection, masked, select_channels
from .softmax import finite, merge, scalar_with_weights, weighted_sum


class MaxSumShiftExp(Reduction):
    """(max_j F, sum_j exp(F - max) G, first argmax) per row; F scalar, G of E features."""

    name = "max_sumshiftexp"
    differentiable = (True, True, False)

    def __init__(self, expr: sympy.Expr, weights: sympy.Expr, info: dict):
        scalar_with_weights(self, expr, weights, info)

    def partial(self, values, mask):
        f = masked(values[0], mask, -math.inf)
        top, where = f.max(2)  # the first maximum of the tile's row
        p = inductor.tile_exp(f - finite(top).unsqueeze(2))
        return top, weighted_sum(p, values[1], mask), where

    def combine(self, state, partial, at):
        top, total, where = partial
        where = where + at
        if state is None:
            return top, total, where
        take = top > state[0]  # strict: the earlier block keeps ties
        merged_top, merged_total = merge(state[:2], (top, total))
        return merged_top, merged_total, torch.where(take, where, state[2])

    def finalize(self, state, rows, batch):
        top, total, where = state
        return (top.expand(batch, rows, 1).contiguous(), total.expand(batch, rows, self.dim).contiguous(),
                where.expand(batch, rows, 1).contiguous())

    def empty(self, batch, rows, dtype, device):
        return (torch.full((batch, rows, 1), -math.inf, dtype=dtype, device=device),
                torch.zeros(batch, rows, self.dim, dtype=dtype, device=device),
                torch.zeros(batch, rows, 1, dtype=torch.int64, device=device))

    def _unnormalized(self, collector, outs):
        return sympy.exp(self.expr - collector.variable(outs[0], "i"))

    def vjp(self, collector, outs, grads):
        at_max = torch.zeros_like(outs[0]) if grads[0] is None else grads[0]
        if grads[1] is not None:  # ds = sum_j exp(F - m) (dF G + dG) - s dm
            unnormalized, g = self._unnormalized(collector, outs), collector.variable(grads[1], "i")
            collector.cotangent(self.expr, unnormalized * ir.feature_sum(g * self.weights, self.dim))
            collector.cotangent(self.weights, unnormalized * g)
            at_max = at_max - (grads[1] * outs[1]).sum(-1, keepdim=True)
        select_channels(collector, self.expr, outs[2].unsqueeze(2), at_max.unsqueeze(2))

    def jvp(self, collector, outs):
        unnormalized = self._unnormalized(collector, outs)
        tangent = collector.tangent(self.expr) * self.weights + collector.tangent(self.weights)
        handle = collector.summed(unnormalized * tangent, "j", self.dim)
        pick = channels_at_selection(collector, self.expr, outs[2].unsqueeze(2))

        def finish(results):
            dm = pick(results).squeeze(2)
            return dm, results[handle] - outs[1] * dm, None

        return finish
