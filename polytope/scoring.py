"""``Scorer``: a step's candidates through its ``Objective``, chunk by chunk, each one charged to the budget.

The one place that counts evaluations (full-fidelity equivalents: a screened
candidate costs ``screen_fidelity / num_probe``) and candidates scored, and
that runs the multifidelity screen (``controllers.MultifidelityScreen``).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .candidates import CandidateBatch, CandidateGroup, Subspace
from .controllers import MultifidelityScreen
from .objective import Objective, chunks


class Scorer:
    """Scores candidate groups around a base point; its counters are what a budget charges."""

    def __init__(self, chunk_size: int | None, subspace: Subspace | None, screen: MultifidelityScreen | None,
                 generator: torch.Generator):
        self.chunk_size, self.subspace, self.screen, self.generator = chunk_size, subspace, screen, generator
        self.evaluations = 0.0
        self.candidates_scored = 0

    def state_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations, "candidates_scored": self.candidates_scored}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluations, self.candidates_scored = state["evaluations"], state["candidates_scored"]

    def __call__(self, objective: Objective, groups: list[CandidateGroup], base: torch.Tensor,
                 subset: torch.Tensor | None = None) -> torch.Tensor:
        """Losses of all groups' candidates around ``base`` in order, one CandidateBatch per chunk, charged."""
        fidelity = 1.0 if subset is None else self.screen.screen_fidelity / self.screen.num_probe
        pieces = []
        for part in chunks(groups, self.chunk_size):
            batch = CandidateBatch(base, part, self.subspace)
            losses = torch.as_tensor(objective(batch, subset)).detach().reshape(-1).to(torch.float64)
            if losses.numel() != batch.count:
                raise ValueError(f"the objective returned {losses.numel()} losses for {batch.count} candidates")
            self.evaluations += fidelity * batch.count
            self.candidates_scored += batch.count
            pieces.append(losses)
        return torch.cat(pieces)

    def point(self, objective: Objective, point: torch.Tensor) -> float:
        """f(point), which must be finite."""
        # A zero change on one coordinate (not an empty block): the plainest case for any evaluator.
        first = torch.zeros(1, dtype=torch.long)
        group = CandidateGroup(first, point.new_zeros(1, 1), {"incumbent": True})
        loss = float(self(objective, [group], point)[0])
        if not math.isfinite(loss):
            raise ValueError(f"the objective is not finite at the incumbent ({loss})")
        return loss

    def probes(self, objective: Objective, groups: list[CandidateGroup], base: torch.Tensor, room: float,
               info: dict[str, Any]) -> torch.Tensor:
        """Flat probe losses (screened when configured), a diverging probe set to the worst finite one."""
        flat = self(objective, groups, base) if self.screen is None else self.screened(objective, groups, base, room, info)
        bad = ~torch.isfinite(flat)
        if bad.all():
            raise ValueError("the objective is not finite at any probe; reduce radii")
        info["nonfinite_probes"] = int(bad.sum())
        return torch.where(bad, flat[~bad].max(), flat)

    def screened(self, objective: Objective, groups: list[CandidateGroup], base: torch.Tensor, room: float,
                 info: dict[str, Any]) -> torch.Tensor:
        """Every probe on a sample subset, a random share of them fully: unbiased estimates of the full losses."""
        screen = self.screen
        subset = torch.randperm(screen.num_probe, generator=self.generator)[: screen.screen_fidelity]
        cheap = self(objective, groups, base, subset)
        probs = screen.keep_probabilities(cheap)
        kept = torch.rand(cheap.shape, generator=self.generator, dtype=torch.float64) < probs
        spare = room - screen.screen_fidelity / screen.num_probe * cheap.numel()
        if int(kept.sum()) > spare:  # the last step: keep only what the budget still pays for
            kept[torch.nonzero(kept).flatten()[max(math.floor(spare + 1e-9), 0):]] = False
        kept_groups, offset = [], 0
        for group in groups:
            rows = kept[offset:offset + group.count]
            if rows.any():
                kept_groups.append(CandidateGroup(group.index, group.delta[rows], group.info))
            offset += group.count
        full = torch.zeros_like(cheap)
        if kept.any():
            full[kept] = self(objective, kept_groups, base)
        info["screen_kept"] = int(kept.sum())
        return screen.combine(cheap, full, kept, probs)
