"""Evaluation paths: one strategy object per path, tried in order.

Each path says whether it can score a group (``accepts(group, evaluator)``:
the evaluator knows the model, its plan and the options) and scores it
(``run(group, evaluator, inputs, targets)`` -> (count,) losses). The evaluator
runs the first path that accepts; a path that finds out only while running
that it cannot (the model does not run under vmap) raises ``Declined`` and the
next accepting path runs instead. ``STRATEGIES`` is the selection order, the
order of the path table in docs/performance.md.
"""
from __future__ import annotations

import warnings

import torch

from ..subspaces import BlockSubspace, FactoredSubspace
from .chunking import is_out_of_memory
from .functional import as_args, buffers_restored, call_with
from .groups import Group, candidate_values, writes
from .inplace import inplace_losses
from .mlp import group_changes, mlp_outputs, replacement_changes, subspace_changes


class Declined(Exception):
    """Raised by a path that cannot score the group after all; the next path runs."""


class Path:
    name: str

    def accepts(self, group: Group, evaluator) -> bool:
        raise NotImplementedError

    def run(self, group: Group, evaluator, inputs, targets) -> torch.Tensor:
        raise NotImplementedError


class InPlace(Path):
    """One candidate at a time, written into the model's own tensors (restored afterwards)."""

    name = "inplace"

    def accepts(self, group, evaluator):
        return evaluator.use_inplace

    def forward(self, evaluator):
        return evaluator.forward_site

    def run(self, group, evaluator, inputs, targets):
        forward = self.forward(evaluator)

        def forward_loss():
            with evaluator.autocast():
                outputs = forward(*as_args(inputs))
            return evaluator.loss.single(outputs, targets)

        count = group.count if group.slots else 1  # candidates equal to the base: one forward
        with buffers_restored(evaluator.model):
            changes = writes(group, evaluator.layout)
            losses = inplace_losses(evaluator.model, evaluator.layout, group.base, changes, count, forward_loss)
        return losses.expand(group.count)


class MLPPath(Path):
    """Sequential MLPs: cached base activations, then per-stage changes of each chunk of candidates."""

    def changes(self, group: Group, evaluator, a: int, b: int) -> dict:
        raise NotImplementedError

    def site(self, evaluator):
        return mlp_outputs

    def run(self, group, evaluator, inputs, targets):
        plan = evaluator.plan
        prefix = evaluator.prefix.get(plan, group.base, inputs)
        rows = prefix.entering[0].shape[0]
        chunk = evaluator.chunk_for(group.count, group.width, rows * plan.activation_widths(0), group.base)
        site = self.site(evaluator)

        def run(a, b):
            with evaluator.autocast():
                outputs = site(plan, prefix, self.changes(group, evaluator, a, b), b - a)
            return evaluator.loss(outputs, targets, b - a)

        return evaluator.chunks.run(group.count, chunk, run)


class SparseDelta(MLPPath):
    """Full-space deltas: output corrections from the moved entries only."""

    name = "sparse_delta"

    def accepts(self, group, evaluator):
        return evaluator.delta_allowed and group.is_delta and group.subspace is None

    def changes(self, group, evaluator, a, b):
        return group_changes(evaluator.plan, group.split, group.delta[a:b])


class SubspaceDelta(MLPPath):
    """Block subspaces: entry blocks as sparse corrections, low-rank blocks as factored ones."""

    name = "subspace_delta"

    def accepts(self, group, evaluator):
        blocks = isinstance(group.subspace, BlockSubspace) and not isinstance(group.subspace, FactoredSubspace)
        return evaluator.delta_allowed and group.is_delta and blocks

    def changes(self, group, evaluator, a, b):
        return subspace_changes(evaluator.plan, group.subspace, group.split, group.delta[a:b])


class Factored(SubspaceDelta):
    """``FactoredSubspace``: ``(x @ B.T) @ A.T`` without building candidate weights."""

    name = "factored"

    def accepts(self, group, evaluator):
        return evaluator.delta_allowed and group.is_delta and isinstance(group.subspace, FactoredSubspace)


class DenseBmm(MLPPath):
    """Candidates' own weights for the changed layers, one batched matmul each."""

    name = "dense_bmm"

    def accepts(self, group, evaluator):
        return evaluator.plan is not None and evaluator.reuse

    def site(self, evaluator):
        return evaluator.dense_site

    def changes(self, group, evaluator, a, b):
        return replacement_changes(evaluator.plan, candidate_values(group, evaluator.layout, a, b))


class SiteVmap(Path):
    """``functional_call`` under vmap with only the changed tensors batched: what does not depend on them runs once."""

    name = "site_vmap"

    def accepts(self, group, evaluator):
        return evaluator.reuse and evaluator.vmap_ok and len(group.slots) < len(evaluator.layout.slots)

    def varying(self, group: Group, evaluator) -> tuple[int, ...]:
        return group.slots

    def named(self, group, evaluator, slots, a, b) -> dict:
        """Candidates ``a:b`` as {parameter name: (b - a, *shape)}; tensors the group keeps are expanded."""
        layout = evaluator.layout
        given = candidate_values(group, layout, a, b)
        out = {}
        for s in slots:
            slot = layout.slots[s]
            kept = group.base[slot.start : slot.stop].reshape(slot.shape)
            out[slot.name] = given[s] if s in given else kept.expand(b - a, *slot.shape)
        return out

    def run(self, group, evaluator, inputs, targets):
        layout, slots = evaluator.layout, self.varying(group, evaluator)
        names = {layout.slots[s].name for s in slots}
        fixed = {n: v for n, v in layout.views(group.base).items() if n not in names}
        if not slots:  # every candidate equals the base: one forward
            with evaluator.autocast(), buffers_restored(evaluator.model):
                loss = evaluator.loss.single(call_with(evaluator.model, fixed, inputs), targets)
            return loss.expand(group.count)
        width = sum(layout.slots[s].numel for s in slots)
        chunk = evaluator.chunk_for(group.count, width, evaluator.activation_numel(inputs), group.base)

        def run(a, b):
            with evaluator.autocast():
                outputs = evaluator.vmap_site(evaluator.model, fixed, self.named(group, evaluator, slots, a, b), inputs)
            return evaluator.loss(outputs, targets, b - a)

        try:
            return evaluator.chunks.run(group.count, chunk, run)
        except Exception as exc:  # noqa: BLE001 - vmap incompatibility: the sequential path takes over
            if is_out_of_memory(exc):
                raise
            evaluator.vmap_ok = False
            first = str(exc).splitlines()[0] if str(exc) else ""
            warnings.warn(
                f"model does not run under torch.vmap ({type(exc).__name__}: {first}); "
                "evaluating candidates one at a time (call reset_vmap() after changing the model)",
                stacklevel=2,
            )
            raise Declined from exc


class Vmap(SiteVmap):
    """Every tensor batched: one whole forward per chunk (also ``reuse=False``)."""

    name = "vmap"

    def accepts(self, group, evaluator):
        return evaluator.vmap_ok

    def varying(self, group, evaluator):
        return tuple(range(len(evaluator.layout.slots)))


class Sequential(InPlace):
    """The fallback: one eager forward per candidate, in the model's own tensors; buffers (BatchNorm statistics) restored."""

    name = "sequential"

    def accepts(self, group, evaluator):
        return True

    def forward(self, evaluator):
        return evaluator.model


STRATEGIES: tuple[Path, ...] = (
    InPlace(), SparseDelta(), SubspaceDelta(), Factored(), DenseBmm(), SiteVmap(), Vmap(), Sequential()
)
PATHS = tuple(path.name for path in STRATEGIES)
