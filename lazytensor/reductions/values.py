"""The values of a formula on every pair, kept: a consumer for problems small enough to hold them.

Not a reduction: nothing differentiates it. ``kept_kernel`` forms a small kernel's matrix with it, to
multiply by many right-hand sides; each tile's values are the row block's next columns.
"""
from __future__ import annotations

import sympy
import torch

from .base import Consumer, masked


class Values(Consumer):
    """(B, N, M) values of a formula of feature size 1 that depends on both i and j."""

    def __init__(self, expr: sympy.Expr):
        self.expressions = [expr]
        self.dim = 1
        self.signature = ("values",)

    def partial(self, values, mask):
        return (masked(values[0], mask, 0.0)[..., 0],)

    def combine(self, state, partial, at):
        """The row block's column tiles so far (joined once, in ``finalize``: not copied at every tile)."""
        return [partial[0]] if state is None else [*state, partial[0]]

    def finalize(self, state, rows, batch):
        return (torch.cat(state, 2),)

    def empty(self, batch, rows, dtype, device):
        return (torch.zeros(batch, rows, 0, dtype=dtype, device=device),)
