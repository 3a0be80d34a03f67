"""Sequential MLPs: shared prefix activations and per-candidate corrections.

A candidate that only changes layer s leaves every activation before s equal
to the incumbent's, so those come from one cached base forward. From layer s
on, candidates are carried in one of two states:

* ``Sparse``: only a few units differ from the base activation (a sparse
  change of layer s touches only the rows it moves, and elementwise
  activations keep it that way); the next layer then costs units x out,
  not in x out;
* dense ``(C, M, width)``, where unchanged layers run as one linear op over
  all candidates at once.

The cache is keyed on the base parameters and the input tensor, so reuse ends
by itself when the batch (or its fidelity) or the incumbent changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..param_layout import ParameterLayout
from ..subspaces import EntryBlock
from .contracts import ELEMENTWISE, LINEAR, contracts_of
from .deltas import FactoredTerm, LinearChange, Replacement, entry_terms, sign_pairs


@dataclass(frozen=True)
class LinearStage:
    module: nn.Module
    weight: str  # parameter names in the layout
    bias: str | None
    out_features: int
    in_features: int


@dataclass(frozen=True)
class ElementwiseStage:
    module: nn.Module


@dataclass
class Sparse:
    """Candidate activation = base activation with ``units`` replaced by ``values`` (C, M, u)."""

    units: torch.Tensor
    values: torch.Tensor


class MLPPlan:
    """The stages of an ``nn.Sequential`` of linear and elementwise layers."""

    def __init__(self, stages: list, layout: ParameterLayout):
        self.stages = stages
        self.layout = layout
        # slot position -> (stage index, is_weight)
        self.owner: dict[int, tuple[int, bool]] = {}
        for i, stage in enumerate(stages):
            if isinstance(stage, LinearStage):
                self.owner[layout.by_name[stage.weight].position] = (i, True)
                if stage.bias is not None:
                    self.owner[layout.by_name[stage.bias].position] = (i, False)

    @classmethod
    def from_model(cls, model: nn.Module, layout: ParameterLayout) -> "MLPPlan | None":
        """The plan, or None when the model is not a sequential MLP the delta paths support."""
        if not isinstance(model, nn.Sequential):
            return None
        names = {id(p): n for n, p in model.named_parameters()}
        stages, owned = [], 0
        for child in model:
            contracts = contracts_of(child)
            params = dict(child.named_parameters())
            if LINEAR in contracts:
                weight = getattr(child, "weight", None)
                bias = getattr(child, "bias", None)
                if weight is None or weight.dim() != 2 or set(params) - {"weight", "bias"}:
                    raise ValueError(
                        f"{type(child).__name__} declares the 'linear' contract but does not own exactly "
                        "a 2-D 'weight' and an optional 'bias'"
                    )
                stages.append(LinearStage(child, names[id(weight)], None if bias is None else names[id(bias)], *weight.shape))
                owned += 1 + (bias is not None)
            elif ELEMENTWISE in contracts and not params:
                stages.append(ElementwiseStage(child))
            else:
                return None
        if owned != len(layout.slots) or not any(isinstance(s, LinearStage) for s in stages):
            return None  # shared parameters between layers, or nothing to evaluate
        return cls(stages, layout)

    def weights(self, base: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Per stage, the (weight, bias) views of the flat base vector."""
        views = self.layout.views(base)
        return [
            (views[s.weight], None if s.bias is None else views[s.bias]) if isinstance(s, LinearStage) else None
            for s in self.stages
        ]

    def activation_widths(self, first: int) -> int:
        """Sum of the widths a candidate carries from stage ``first`` on (for memory estimates)."""
        return sum(s.out_features for s in self.stages[first:] if isinstance(s, LinearStage)) * 2


class PrefixCache:
    """Base activations entering and leaving every stage, for one (base, inputs) pair."""

    def __init__(self):
        self._key = None
        self._inputs = None  # held so its memory cannot be reused under the same key
        self.base = None
        self.weights = None
        self.entering: list[torch.Tensor] = []
        self.leaving: list[torch.Tensor] = []
        self.lead: torch.Size = torch.Size()
        self.builds = 0

    @staticmethod
    def _inputs_key(inputs: torch.Tensor):
        return (inputs.data_ptr(), tuple(inputs.shape), inputs.stride(), inputs.dtype, inputs.device, inputs._version)

    def get(self, plan: MLPPlan, base: torch.Tensor, inputs: torch.Tensor) -> "PrefixCache":
        key = self._inputs_key(inputs)
        if key == self._key and self.base is not None and torch.equal(self.base, base):
            return self
        self._key, self._inputs, self.base = key, inputs, base.clone()
        self.weights = plan.weights(self.base)
        self.lead = inputs.shape[:-1]
        h = inputs.reshape(-1, inputs.shape[-1])
        self.entering, self.leaving = [], []
        for stage, wb in zip(plan.stages, self.weights):
            self.entering.append(h)
            h = F.linear(h, *wb) if isinstance(stage, LinearStage) else stage.module(h)
            self.leaving.append(h)
        self.builds += 1
        return self

    def clear(self) -> None:
        self.__init__()


def _dense(state, base_activation: torch.Tensor, count: int) -> torch.Tensor:
    """Materialize a candidate state as (C, M, width)."""
    if isinstance(state, torch.Tensor):
        return state if state.dim() == 3 else state.expand(count, *state.shape)
    full = base_activation.expand(count, *base_activation.shape).clone()
    full[..., state.units] = state.values
    return full


def _linear_stage(state, stage: LinearStage, wb, prefix_in, prefix_out, change, count: int):
    """One linear layer for all candidates, given the incoming state."""
    weight, bias = wb
    if isinstance(change, Replacement):
        h = state if isinstance(state, torch.Tensor) else _dense(state, prefix_in, count)
        return change.output(h, weight, bias)
    if change is None:
        if isinstance(state, Sparse):  # y = y_base + (h_U - h_base_U) @ W[:, U].T
            diff = state.values - prefix_in[..., state.units]
            return prefix_out + diff @ weight[:, state.units].T
        return F.linear(state, weight, bias)
    if isinstance(state, Sparse):
        state = _dense(state, prefix_in, count)
    shared = state.dim() == 2
    units = change.units(stage.out_features, weight.device)
    if shared and 2 * units.numel() <= stage.out_features:  # shared input, few units touched: stay sparse
        return Sparse(units, prefix_out[..., units] + change.correction(state, units, stage.in_features))
    y = prefix_out if shared else F.linear(state, weight, bias)
    correction = change.correction(state, units, stage.in_features)
    if units.numel() == stage.out_features:  # every unit (units is sorted and unique): a plain broadcast add
        return y + correction
    y = y.expand(count, *y.shape).clone() if shared else y
    y[..., units] += correction
    return y


def mlp_outputs(plan: MLPPlan, prefix: PrefixCache, changes: dict, count: int) -> torch.Tensor:
    """(C, *lead, out) outputs of ``count`` candidates differing from the base by ``changes``.

    ``changes`` maps stage index -> ``LinearChange`` or ``Replacement``; an
    empty dict means every candidate equals the base.
    """
    first = min(changes, default=len(plan.stages))
    state = prefix.leaving[-1] if first == len(plan.stages) else prefix.entering[first]
    for i in range(first, len(plan.stages)):
        stage = plan.stages[i]
        if isinstance(stage, LinearStage):
            state = _linear_stage(state, stage, prefix.weights[i], prefix.entering[i], prefix.leaving[i], changes.get(i), count)
        elif isinstance(state, Sparse):
            state = Sparse(state.units, stage.module(state.values))
        else:
            state = stage.module(state)
    out = _dense(state, prefix.leaving[-1], count)
    return out.reshape(count, *prefix.lead, out.shape[-1])


def _columns(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values[:, positions]`` for sorted unique ``positions``: a view when they are consecutive (the usual case)."""
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 == positions.numel():
        return values[:, first : last + 1]
    return values.index_select(1, positions)


def _paired(delta: torch.Tensor, build) -> dict:
    """``build(values)`` -> changes; values reduced to sign-pair representatives when one layer changes."""
    pairs = sign_pairs(delta)
    if pairs is not None:
        changes = build(pairs.select(delta))
        if len(changes) == 1:
            next(iter(changes.values())).pairs = pairs
            return changes
    return build(delta)


def group_changes(plan: MLPPlan, split: dict, delta: torch.Tensor) -> dict:
    """Full-space group (``delta`` (C, k) on coordinates grouped by ``ParameterLayout.split``) -> per-stage ``LinearChange``."""

    def build(values):
        changes: dict[int, LinearChange] = {}
        for slot_id, (positions, local) in split.items():
            stage_id, is_weight = plan.owner[slot_id]
            stage = plan.stages[stage_id]
            columns = _columns(values, positions)
            terms = entry_terms(local, columns, is_weight, stage.out_features, stage.in_features)
            changes.setdefault(stage_id, LinearChange()).terms.extend(terms)
        return changes

    return _paired(delta, build)


def subspace_changes(plan: MLPPlan, subspace, split: dict, delta: torch.Tensor) -> dict:
    """Block-subspace group (coordinates grouped by ``subspace.split``) -> per-stage ``LinearChange``."""

    def build(values):
        changes: dict[int, LinearChange] = {}
        for block_id, (positions, coords) in split.items():
            block = subspace.blocks[block_id]
            stage_id, is_weight = plan.owner[block.slot.position]
            if isinstance(block, EntryBlock):
                local = block.entries.to(coords.device)[coords]
                stage = plan.stages[stage_id]
                terms = entry_terms(local, _columns(values, positions), is_weight, stage.out_features, stage.in_features)
            else:
                terms = [FactoredTerm(*block.factors(coords, _columns(values, positions)))]
            changes.setdefault(stage_id, LinearChange()).terms.extend(terms)
        return changes

    return _paired(delta, build)


def replacement_changes(plan: MLPPlan, values: dict) -> dict:
    """Dense candidates given as {slot: (C, *shape) new values} -> per-stage ``Replacement``."""
    changes: dict[int, Replacement] = {}
    for slot_id, value in values.items():
        stage_id, is_weight = plan.owner[slot_id]
        old = changes.get(stage_id, Replacement(None, None))
        changes[stage_id] = Replacement(value, old.bias) if is_weight else Replacement(old.weight, value)
    return changes
