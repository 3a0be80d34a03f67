"""The one form candidates take inside the evaluator: groups.

Both entry points end here. ``evaluate_batch`` turns each ``CandidateGroup`` of
a ``CandidateBatch`` into a ``Group`` as it is; ``evaluate`` analyses flat
``(C, n)`` candidates against the model's parameters (``flat.py``) and
produces the same kind of groups. Paths only ever see groups, so a flat
candidate that changes a few entries runs exactly the code a structured one
does.

A group holds candidates that change the same parameter tensors, in one of two
forms:

* delta form: candidate = base + ``delta`` on the coordinates ``index`` (flat
  parameter indices, or subspace coordinates mapped through ``subspace``);
* value form: candidate = base with the tensors ``slots`` replaced by
  ``values`` (flat candidates that rewrite whole tensors: no subtraction, and
  the candidates' own numbers reach the forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..candidates import CandidateBatch
from ..param_layout import ParameterLayout
from ..subspaces import BlockSubspace


@dataclass(eq=False)
class Group:
    base: torch.Tensor  # (n,) parameters the candidates start from
    count: int
    slots: tuple[int, ...]  # parameter tensors (layout positions) the candidates change
    rows: slice | torch.Tensor  # where the group's losses go in the caller's order
    index: torch.Tensor | None = None  # delta form: (k,) coordinates
    delta: torch.Tensor | None = None  # delta form: (count, k)
    subspace: object = None  # delta form: maps coordinates to parameters when set
    split: dict | None = None  # delta form: ``index`` grouped by parameter (no subspace) or by block (block subspace)
    values: dict[int, torch.Tensor] | None = None  # value form: slot -> (count, numel) new values

    @property
    def is_delta(self) -> bool:
        return self.values is None

    @property
    def width(self) -> int:
        """Numbers per candidate this group carries (for memory estimates)."""
        if self.values is not None:
            return sum(v.shape[1] for v in self.values.values())
        return self.index.numel()


def delta_group(layout: ParameterLayout, base: torch.Tensor, index: torch.Tensor, delta: torch.Tensor, rows, subspace=None):
    """A delta-form group; validates ``index`` and finds the tensors it touches once."""
    if subspace is None:
        split = layout.split(index)
        slots = tuple(sorted(split))
    elif isinstance(subspace, BlockSubspace):
        split = subspace.split(index)
        slots = tuple(sorted({subspace.blocks[b].slot.position for b in split}))
    else:  # any other subspace: a coordinate may move every tensor
        split, slots = None, tuple(range(len(layout.slots)))
    return Group(base, delta.shape[0], slots, rows, index, delta, subspace, split)


def batch_groups(batch: CandidateBatch, layout: ParameterLayout) -> list[Group]:
    """The groups of a structured batch, in order."""
    base, groups, start = batch.base, [], 0
    for g in batch.groups:
        if g.count:
            rows = slice(start, start + g.count)
            groups.append(delta_group(layout, base, g.index.to(base.device), g.delta.to(base.dtype), rows, batch.subspace))
        start += g.count
    return groups


def candidate_values(group: Group, layout: ParameterLayout, a: int, b: int) -> dict[int, torch.Tensor]:
    """Candidates ``a:b`` of the group as {slot: (b - a, *shape)} new values of the tensors they change."""
    if group.values is not None:
        return {s: v[a:b].reshape(b - a, *layout.slots[s].shape) for s, v in group.values.items()}
    base, rows, subspace = group.base, group.delta[a:b], group.subspace
    if subspace is not None and not isinstance(subspace, BlockSubspace):
        z = rows.new_zeros(b - a, subspace.dim)
        z[:, group.index] = rows
        flat = subspace.to_flat(z).to(base.dtype)
    out = {}
    for s in group.slots:
        slot = layout.slots[s]
        own = base[slot.start : slot.stop]
        if subspace is None:
            positions, local = group.split[s]
            value = own.repeat(b - a, 1)
            value[:, local] = own[local] + rows[:, positions]
        elif isinstance(subspace, BlockSubspace):
            parts = [(subspace.blocks[k], p, c) for k, (p, c) in group.split.items() if subspace.blocks[k].slot.position == s]
            value = own + sum(block.displacement(coords, rows[:, positions]) for block, positions, coords in parts)
        else:
            value = own + flat[:, slot.start : slot.stop]
        out[s] = value.reshape(b - a, *slot.shape)
    return out


def writes(group: Group, layout: ParameterLayout) -> list[tuple[int, torch.Tensor | None, torch.Tensor]]:
    """What the in-place path writes per candidate: (slot, local offsets or None for all, (count, k) values)."""
    if group.values is not None:
        return [(s, None, v) for s, v in group.values.items()]
    if group.subspace is None:
        base, delta, split = group.base, group.delta, group.split
        return [(s, local, base[layout.slots[s].start + local] + delta[:, positions]) for s, (positions, local) in split.items()]
    values = candidate_values(group, layout, 0, group.count)
    return [(s, None, v.reshape(group.count, -1)) for s, v in values.items()]
