"""Structured candidates: what the optimizer hands to evaluators.

A polytope step scores P x V x K candidates, and every candidate differs from
the incumbent in one block only. Handing evaluators that structure (base +
block coordinates + per-candidate displacement) instead of a dense (C, n)
tensor lets them reuse activations and never build full candidate vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Subspace(Protocol):
    """Maps search coordinates z (dim ``dim``) to flat parameter displacements."""

    dim: int

    def to_flat(self, z: torch.Tensor) -> torch.Tensor:
        """(C, dim) coordinates -> (C, n) displacements in parameters_to_vector order."""
        ...


@dataclass
class CandidateGroup:
    """Candidates that all change the same block of coordinates.

    ``index`` holds the (k,) coordinates of the block (flat parameter indices,
    or subspace coordinates when the batch has a subspace); ``delta`` holds the
    (C_g, k) displacement of each candidate on that block.
    """

    index: torch.Tensor
    delta: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)  # e.g. block id, radii, vertex ids

    def __post_init__(self) -> None:
        if self.index.dim() != 1 or self.delta.dim() != 2 or self.delta.shape[1] != self.index.numel():
            raise ValueError(
                f"CandidateGroup expects index (k,) and delta (C, k); got {tuple(self.index.shape)} and {tuple(self.delta.shape)}"
            )

    @property
    def count(self) -> int:
        return self.delta.shape[0]


@dataclass
class CandidateBatch:
    """Candidates in order: groups concatenated. candidate = base (+ subspace map of) delta on its block."""

    base: torch.Tensor  # (n,) flat incumbent parameters
    groups: list[CandidateGroup]
    subspace: Subspace | None = None  # when set, group indices are subspace coordinates

    @property
    def count(self) -> int:
        return sum(g.count for g in self.groups)

    def rows(self, start: int, stop: int) -> CandidateBatch:
        """Candidates ``start:stop`` (in group order) as a batch around the same base."""
        return CandidateBatch(self.base, cut(self.groups, start, stop), self.subspace)

    def group_displacements(self, group: CandidateGroup) -> torch.Tensor:
        """(C_g, n) flat displacements of one group."""
        if self.subspace is None:
            out = self.base.new_zeros(group.count, self.base.numel())
            out[:, group.index] = group.delta.to(self.base.dtype)
            return out
        z = group.delta.new_zeros(group.count, self.subspace.dim)
        z[:, group.index] = group.delta
        return self.subspace.to_flat(z).to(self.base.dtype)

    def materialize(self) -> torch.Tensor:
        """The dense (C, n) candidate matrix, for closures and reference checks."""
        if not self.groups:
            return self.base.new_zeros(0, self.base.numel())
        return self.base + torch.cat([self.group_displacements(g) for g in self.groups])


def cut(groups: list[CandidateGroup], start: int, stop: int) -> list[CandidateGroup]:
    """Candidates ``start:stop`` of the groups concatenated, as groups (those cut keep their info; empty ones are dropped)."""
    out, offset = [], 0
    for group in groups:
        a, b = max(start - offset, 0), min(stop - offset, group.count)
        if a == 0 and b == group.count and b > 0:
            out.append(group)
        elif a < b:
            out.append(CandidateGroup(group.index, group.delta[a:b], dict(group.info, rows=(a, b))))
        offset += group.count
    return out
