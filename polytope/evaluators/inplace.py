"""In-place parameter swaps: one candidate at a time in the model's own tensors.

For candidates too large to batch: no (C, n) tensor and no functional copies,
only the touched entries are written before each forward. The parameters are
snapshotted first and copied back afterwards, so they end bit-identical.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..param_layout import ParameterLayout


@contextmanager
def parameters_swapped(model: nn.Module, flat: torch.Tensor | None = None):
    """Run the block with the model's parameters set to ``flat`` (if given); restore them exactly on exit.

    Inside, callers may also overwrite parameter entries freely.
    """
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            if flat is not None:
                write_flat(params, flat)
        yield params
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def write_flat(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    start = 0
    for p in params:
        p.copy_(flat[start : start + p.numel()].view_as(p))
        start += p.numel()


def inplace_losses(
    model: nn.Module,
    layout: ParameterLayout,
    base: torch.Tensor,
    writes: list[tuple[int, torch.Tensor | None, torch.Tensor]],
    count: int,
    forward_loss,
) -> torch.Tensor:
    """Losses of ``count`` candidates equal to ``base`` except for ``writes``.

    Each write is (slot, local offsets or None for the whole tensor, values
    (C, k)): candidate c has ``values[c]`` at those entries of that parameter.
    """
    with parameters_swapped(model) as params, torch.no_grad():
        if not torch.equal(layout.flatten(model), base):
            write_flat(params, base)
        setters = [(_setter(params[slot], local), values) for slot, local, values in writes]
        losses = []
        for c in range(count):
            for setter, values in setters:
                setter(values[c])
            losses.append(forward_loss().reshape(()))
    return torch.stack(losses) if losses else base.new_empty(0)


def _setter(param: torch.Tensor, local: torch.Tensor | None):
    """A function writing one candidate's values into ``param`` (whole, or at flat offsets ``local``), whatever its strides."""
    if local is None:
        def write(values):
            param.copy_(values.reshape(param.shape))
    else:
        target, where = (param.view(-1), local) if param.is_contiguous() else (param, torch.unravel_index(local, param.shape))

        def write(values):
            target[where] = values
    return write
