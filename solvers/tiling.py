"""Row-block plans and streamed gradients of kernel contractions.

Everything that touches a kernel matrix walks it in row blocks whose tile fits a
memory budget. Gradients follow the same walk: for a scalar that is a sum of
per-block contributions ``c_b(K[b, :])``, :func:`tile_vjp` rebuilds each tile
with autograd enabled, differentiates its contribution, and accumulates the
gradients of the row points, the column points and the kernel parameters.
Only one tile lives at a time, so no ``n x m`` tensor is ever saved.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .kernels import Kernel

__all__ = ["TILE_BUDGET_BYTES", "rows_per_block", "row_blocks", "tile_vjp", "kernel_matmul"]

# Tiles of 4-16 MiB were fastest on this machine (DESIGN.md section 5); 8 MiB sits in the middle.
TILE_BUDGET_BYTES = 8 << 20


def rows_per_block(n_cols: int, itemsize: int, chunk_size: int | None = None) -> int:
    """Rows per tile: ``chunk_size`` if given, else as many as fit the budget."""
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        return chunk_size
    return max(1, TILE_BUDGET_BYTES // max(1, n_cols * itemsize))


def row_blocks(n_rows: int, block: int) -> Iterator[slice]:
    for start in range(0, n_rows, block):
        yield slice(start, min(start + block, n_rows))


def tile_vjp(kernel: Kernel, rows: torch.Tensor, cols: torch.Tensor,
             contribution: Callable[[torch.Tensor, slice], torch.Tensor], *,
             need_rows: bool, need_cols: bool, chunk_size: int | None = None):
    """Gradients of ``sum_b contribution(K(rows[b], cols), b)``.

    Returns ``(d_rows, d_cols, d_params)``; ``d_params`` follows
    ``kernel.parameters()`` with ``None`` where a parameter needs no gradient.
    """
    params = kernel.parameters()
    want = [p.requires_grad for p in params]
    d_rows = torch.zeros_like(rows) if need_rows else None
    d_cols = torch.zeros_like(cols) if need_cols else None
    d_params = [torch.zeros_like(p) if w else None for p, w in zip(params, want)]
    if not (need_rows or need_cols or any(want)):
        return d_rows, d_cols, d_params
    cols_leaf = cols.detach().requires_grad_(need_cols)
    block = rows_per_block(cols.shape[0], cols.element_size(), chunk_size)
    with torch.enable_grad():
        for sl in row_blocks(rows.shape[0], block):
            rows_leaf = rows[sl].detach().requires_grad_(need_rows)
            inputs = ([rows_leaf] if need_rows else []) + ([cols_leaf] if need_cols else []) \
                + [p for p, w in zip(params, want) if w]
            value = contribution(kernel.tile(rows_leaf, cols_leaf), sl)
            grads = list(torch.autograd.grad(value, inputs, allow_unused=True))
            if need_rows:
                _accumulate(d_rows[sl], grads.pop(0))
            if need_cols:
                _accumulate(d_cols, grads.pop(0))
            for i, w in enumerate(want):
                if w:
                    _accumulate(d_params[i], grads.pop(0))
    return d_rows, d_cols, d_params


def _accumulate(total: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None:
        total.add_(grad.to(total.dtype).reshape(total.shape))


class _KernelProduct(torch.autograd.Function):
    """``K(rows, cols) @ V`` streamed forward and backward."""

    @staticmethod
    def forward(ctx, source, rows, cols, values, *params):
        ctx.source = source
        ctx.save_for_backward(rows, cols, values)
        return source.matmul_nograd(values)

    @staticmethod
    def backward(ctx, grad_out):
        rows, cols, values = ctx.saved_tensors
        source = ctx.source
        need_rows, need_cols, need_values = ctx.needs_input_grad[1:4]
        d_values = source.rmatmul_nograd(grad_out) if need_values else None
        grad_out, values = grad_out.detach(), values.detach()

        def contribution(tile, sl):
            return (grad_out[sl] * (tile @ values.to(tile.dtype))).sum()

        d_rows, d_cols, d_params = tile_vjp(source.kernel, rows, cols, contribution, need_rows=need_rows,
                                            need_cols=need_cols, chunk_size=source.chunk_size)
        return (None, d_rows, d_cols, d_values, *d_params)


def kernel_matmul(source, values: torch.Tensor) -> torch.Tensor:
    """Differentiable streamed product of a :class:`~solvers.sources.StreamedKernel` with ``values``."""
    return _KernelProduct.apply(source, source.X, source.Y, values, *source.kernel.parameters())
