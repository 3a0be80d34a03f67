"""The normal product: ``K^T (K W)`` for ``F_ij = K_ij W_j`` in one pass, each kernel tile evaluated once.

Landmark ridge's normal equations multiply by ``K_nm^T K_nm`` every
iteration. Two sums (``K @ W`` over j, then ``K.T @ U`` over i) evaluate
every kernel entry twice; here a row block's tile spans every column, so
``U_b = K_b W`` is complete inside the tile and ``K_b^T U_b`` is folded
into the column state at once: half the kernel work, same state size
(M x C). Columns are never split across tiles: the tile hint asks for all
of them, and a plan that splits them (a ``chunk_size`` narrower than M)
is refused rather than summed wrong.
"""
from __future__ import annotations

import sympy
import torch

from .. import autograd, distributed, ir, precision, variables
from ..lazy_tensor import LazyTensor
from ..plan import MAX_TILE_ROWS, PAIRS_PER_TILE, bucket, check_chunk_size
from .base import Reduction, column_side, masked
from .sum import accumulation_dtype, tile_product

__all__ = ["NormalProduct", "normal_product"]


class NormalProduct(Reduction):
    """``out_j = sum_i K_ij sum_k K_ik W_k`` for a formula ``K_ij * W_j`` (K scalar, W j-only, C channels)."""

    name = "normal_product"
    differentiable = (False,)  # the solvers differentiate through residuals, never through iterations
    reduced_axis = "i"  # the state spans every column
    # Distances as direct differences, not the norm expansion: at D = 8 the expansion's (rows x D) @ (D x cols)
    # product ran as a separate matrix product per tile (45% of a pass); the fused differences ran 1.1-1.4x faster
    # (n = 50000, m = 4096, float32) and are exact for close points, where the expansion cancels.
    compares_values = True

    def __init__(self, expr: sympy.Expr, info: dict, columns: int, dtype_acc: torch.dtype | None = None):
        left, mixed, right = ir.split_product(expr, info)
        if left != 1 or mixed == 1 or right == 1 or ir.feature_dim(mixed, info) != 1:
            raise ValueError("normal_product needs a formula K_ij * W_j: a scalar kernel of i and j times "
                             f"j-only weights, got {expr}")
        self.dtype_acc = dtype_acc
        self.dim = ir.feature_dim(right, info)
        self.expressions = [mixed, right]
        self.signature = ("normal_product", self.dim, dtype_acc)
        self.tile_hint = (min(MAX_TILE_ROWS, max(16, 2 * PAIRS_PER_TILE // bucket(columns))), bucket(columns))  # all columns

    def _acc(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype_acc is None else t.to(self.dtype_acc)

    tile_masks = "mask, rowmask"  # both axes are summed over inside the tile

    def partial(self, values, mask, rowmask):
        """``K_b^T (K_b W)`` of the tile (padded rows and columns zeroed: a formula may be inf there).

        In the tile function, so a compiled tile fuses the cast to ``dtype_acc`` into the kernel's
        evaluation and runs both products in its graph: 1.4-1.7x faster passes than casting and
        multiplying each tile eagerly (a one-off timing script, not the harness: n = 50000, m = 4096, d = 8,
        float32 tiles summed in float64, one weight column, 1-2 threads; about equal with two columns).
        """
        kernel, weights = values
        kernel = self._acc(masked(masked(kernel, rowmask, 0.0), mask, 0.0)[..., 0])
        weights = self._acc(column_side(masked(weights, mask, 0.0)))
        # (U^T K_b)^T, not K_b^T U: Inductor handed MKL the narrow U row-major (AMD EPYC, n = 50000,
        # m = 1024, float64, one thread: C = 1 / 2 / 16 passes 0.144 / 0.338 / 0.416 s -> 0.123 / 0.147 / 0.285 s)
        return ((tile_product(kernel, weights).mT @ kernel).mT,)

    def combine(self, state, partial, at):
        width = state[0].shape[1]
        if at.start != 0 or at.stop != width:
            raise ValueError(f"normal_product needs each tile to span all {width} columns; "
                             f"give chunk_size=(rows, {width}) or None")
        state[0].add_(partial[0][:, :width])  # padded columns dropped
        return state

    def initial_state(self, batch, columns, dtype, device):
        return (torch.zeros(batch, columns, self.dim, dtype=self.dtype_acc or dtype, device=device),)

    def finalize(self, state, rows, batch):
        return state

    def empty(self, batch, rows, dtype, device):
        return (torch.zeros(batch, rows, self.dim, dtype=self.dtype_acc or dtype, device=device),)


def normal_product(F: LazyTensor, *, dtype_acc=None, chunk_size=None, backend: str = "auto") -> torch.Tensor:
    """``K^T (K W)`` (M x C) for ``F = K_ij * W_j`` in one pass over K's tiles (no gradient).

    ``dtype_acc`` as for sums (products and the state in that dtype);
    ``chunk_size`` rows, or (rows, M). Batch dimensions and shardings are not supported (a
    sharded caller runs it on its own rows under ``distributed.local()`` and sums the results).
    """
    if not isinstance(F, LazyTensor):
        raise TypeError(f"normal_product: F must be a LazyTensor formula, got {type(F).__name__}")
    if distributed.active() is not None:
        raise ValueError("normal_product does not run sharded: call it under lazytensor.distributed.local() "
                         "on this rank's rows and all-reduce the (M, C) results")
    problem, batch = variables.problem(dict(F.variables), "j")
    if batch:
        raise ValueError("normal_product does not support batch dimensions")
    m = problem.size("j")
    given = check_chunk_size(chunk_size)
    reduction = NormalProduct(ir.numeric(F.expr), problem.info, m, accumulation_dtype(dtype_acc, problem.dtype))
    with torch.no_grad():
        (out,) = autograd.reduce(problem, [reduction], backend, None if given is None else (given[0], max(m, 1)))[0]
    return precision.narrowed(out[0], next(iter(F.variables.values())).tensor.dtype)
