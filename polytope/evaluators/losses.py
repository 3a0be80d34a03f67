"""Per-candidate losses from stacked outputs.

``loss_fn(outputs, targets)`` is written for one model; candidates stack a
leading dimension. vmap applies it per candidate in one call; a loss that
cannot run under vmap is applied candidate by candidate instead (once found
out, remembered). Low-precision outputs are promoted to float32 first so the
reduction accumulates in float32.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_map

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _promote(outputs):
    if isinstance(outputs, torch.Tensor):  # the common case, without a tree walk
        return outputs.float() if outputs.dtype in LOW_PRECISION else outputs
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION else t, outputs)


class CandidateLoss:
    """Apply a single-model loss to ``(C, ...)`` stacked outputs, returning ``(C,)``."""

    def __init__(self, loss_fn):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.vmap_ok = True

    def _scalar(self, outputs, targets) -> torch.Tensor:
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor per model, "
                             f"got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        return loss.reshape(())

    def single(self, outputs, targets) -> torch.Tensor:
        """The scalar loss of one model's outputs (float32 or wider)."""
        return self._scalar(_promote(outputs), targets)

    def __call__(self, outputs, targets, count: int) -> torch.Tensor:
        outputs = _promote(outputs)
        if self.vmap_ok:
            try:
                return torch.vmap(self._scalar, in_dims=(0, None))(outputs, targets)
            except Exception:  # noqa: BLE001 - any vmap incompatibility: fall back below
                losses = self._loop(outputs, targets, count)  # a loss wrong either way raises its own error here
                self.vmap_ok = False  # only now known to be vmap's limit, not the loss's
                warnings.warn("loss_fn does not run under torch.vmap; computing candidate losses one at a time", stacklevel=3)
                return losses
        return self._loop(outputs, targets, count)

    def _loop(self, outputs, targets, count: int) -> torch.Tensor:
        return torch.stack([self._scalar(tree_map(lambda t, c=c: t[c], outputs), targets) for c in range(count)])
