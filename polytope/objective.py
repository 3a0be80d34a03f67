"""What a step scores candidates with: one ``Objective`` protocol, two adapters.

A user closure sees dense ``(C, n)`` candidates; a registered evaluator sees the
structured ``CandidateBatch``. Both become an ``Objective`` (a callable
``(batch, subset) -> (C,) losses``), so the optimizer has one scoring path; the
adapters own what differs: materializing, and slicing the training data for a
screen on a subset of samples.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch

from .candidates import CandidateBatch, CandidateGroup, cut


@runtime_checkable
class Objective(Protocol):
    def __call__(self, batch: CandidateBatch, subset: torch.Tensor | None = None) -> torch.Tensor:
        """(C,) losses of the batch's candidates, in group order; ``subset``: sample indices of a cheaper screen."""
        ...


class ClosureObjective:
    """``closure(candidates (C, n))`` (and ``closure(candidates, subset=...)`` for screens) as an Objective."""

    def __init__(self, closure: Callable[..., Any]):
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        self.closure = closure

    def __call__(self, batch: CandidateBatch, subset: torch.Tensor | None = None) -> torch.Tensor:
        if subset is None:
            return self.closure(batch.materialize())
        return self.closure(batch.materialize(), subset=subset)


class EvaluatorObjective:
    """``evaluator.evaluate_batch(batch, inputs, targets)`` on a fixed batch of data as an Objective."""

    def __init__(self, evaluator, inputs, targets, params=None):
        """``params``: the optimizer's tensors, whose order its candidates follow (see ``placed``)."""
        if not callable(getattr(evaluator, "evaluate_batch", None)):
            raise TypeError("evaluator must have an evaluate_batch(batch, inputs, targets) method")
        self.evaluator, self.inputs, self.targets = evaluator, inputs, targets
        layout, model = getattr(evaluator, "layout", None), getattr(evaluator, "model", None)
        self.index = None if params is None or layout is None else layout.positions(model, params)

    def __call__(self, batch: CandidateBatch, subset: torch.Tensor | None = None) -> torch.Tensor:
        inputs, targets = self.inputs, self.targets
        if subset is not None:
            inputs, targets = inputs[subset], targets[subset]
        return self.evaluator.evaluate_batch(self.placed(batch), inputs, targets)

    def placed(self, batch: CandidateBatch) -> CandidateBatch:
        """The batch in the model's coordinates: an optimizer on some of the model's parameters (the trainable
        ones) or with its groups in another order numbers them its own way; the other parameters keep their values."""
        if self.index is None:
            return batch
        if batch.subspace is not None:
            raise ValueError("a subspace spans the model's parameters: build the optimizer on model.parameters(), "
                             "in that order, to use one")
        base = self.evaluator.layout.flatten(self.evaluator.model).to(batch.base.dtype)
        index = self.index.to(base.device)
        base[index] = batch.base
        return CandidateBatch(base, [CandidateGroup(index[g.index], g.delta, g.info) for g in batch.groups])


def chunks(groups: list[CandidateGroup], size: int | None) -> Iterator[list[CandidateGroup]]:
    """The groups' candidates in order, cut into lists of at most ``size`` candidates (None: one list)."""
    if size is None:
        yield groups
        return
    total = sum(group.count for group in groups)
    for start in range(0, total, size):
        yield cut(groups, start, start + size)
