"""Where every parameter sits in the flat ``parameters_to_vector`` order.

Evaluators and subspaces both translate between flat coordinates and named
parameter tensors; this is the one place that knows the offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    """One parameter tensor's place in the flat vector."""

    position: int  # rank in ``model.parameters()`` order
    name: str
    shape: torch.Size
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ParameterLayout:
    """Offsets of ``model.named_parameters()`` in ``parameters_to_vector`` order."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        slots, start = [], 0
        for position, (name, param) in enumerate(model.named_parameters()):
            slots.append(ParamSlot(position, name, param.shape, start, start + param.numel()))
            start += param.numel()
        if not slots:
            raise ValueError("model has no parameters to evaluate candidates for")
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.n = start
        self.by_name = {slot.name: slot for slot in slots}
        self._starts = torch.tensor([slot.start for slot in slots])

    def slot_ids(self, flat_index: torch.Tensor) -> torch.Tensor:
        """Slot position of each flat coordinate."""
        return torch.searchsorted(self._starts, flat_index.cpu(), right=True) - 1

    def split(self, flat_index: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Group flat coordinates by parameter: slot -> (positions in ``flat_index``, local offsets)."""
        if flat_index.dim() != 1:
            raise ValueError(f"flat_index must be 1-D, got shape {tuple(flat_index.shape)}")
        if not flat_index.numel():
            return {}
        low, high = int(flat_index.min()), int(flat_index.max())
        if low < 0 or high >= self.n:
            raise ValueError(f"flat_index must lie in [0, {self.n}); got range [{low}, {high}]")
        first, last = self.slot_ids(torch.tensor([low, high])).tolist()
        if first == last:  # all in one parameter (blocks within tensors): no per-coordinate search
            positions = torch.arange(flat_index.numel(), device=flat_index.device)
            return {first: (positions, flat_index - self.slots[first].start)}
        ids = self.slot_ids(flat_index)
        out = {}
        for slot_id in torch.unique(ids).tolist():
            positions = torch.nonzero(ids == slot_id).flatten().to(flat_index.device)
            out[slot_id] = (positions, flat_index[positions] - self.slots[slot_id].start)
        return out

    def views(self, flat: torch.Tensor, names=None) -> dict[str, torch.Tensor]:
        """Named views of a flat vector ``(n,)`` or a candidate matrix ``(C, n)``."""
        lead = flat.shape[:-1]
        slots = self.slots if names is None else [self.by_name[name] for name in names]
        return {slot.name: flat[..., slot.start : slot.stop].reshape(*lead, *slot.shape) for slot in slots}

    def positions(self, model: nn.Module, params) -> torch.Tensor | None:
        """Flat coordinates of ``params`` (any of the model's parameters, in any order) in this layout,
        in the order they list them; None when they are all of ``model.parameters()`` in its order."""
        params, own = list(params), list(model.parameters())
        if len(params) == len(own) and all(p is q for p, q in zip(params, own)):
            return None
        where = {id(p): slot for p, slot in zip(own, self.slots)}
        missing = [i for i, p in enumerate(params) if id(p) not in where]
        if missing:
            raise ValueError(f"params[{missing[0]}] (shape {tuple(params[missing[0]].shape)}) is not a parameter of "
                             f"the model; build the optimizer on model.parameters() (or some of them)")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("params lists a parameter twice")
        return torch.cat([torch.arange(where[id(p)].start, where[id(p)].stop) for p in params])

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """The model's current parameters as one detached flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

