"""``NNCostEvaluator``: candidate losses for a model, through the cheapest exact path.

Path selection, per group of candidates that change the same parameters:

=================  ==========================================================
``inplace``        ``use_inplace=True``: candidates written into the model one
                   at a time (restored afterwards)
``sparse_delta``   sequential MLP, full space, few changed coordinates
``subspace_delta`` sequential MLP, ``HybridSubspace`` (or any block subspace)
``factored``       sequential MLP, ``FactoredSubspace``
``dense_bmm``      sequential MLP, dense candidates (or ``candidate_autocast``)
``site_vmap``      any other model: vmap over the changed parameters only
``vmap``           any other model, every parameter changed
``sequential``     the model (or a layer) cannot run under vmap
=================  ==========================================================

``reuse=False`` turns off everything that shares work between candidates
(delta, dense-prefix and site-local paths): every candidate then runs the whole
forward under vmap. It exists as the baseline the benchmarks compare against.
"""
from __future__ import annotations

import warnings
from collections import Counter
from contextlib import nullcontext

import torch
from torch import nn
from torch.func import functional_call

from ..candidates import CandidateBatch, CandidateGroup
from ..param_layout import ParameterLayout
from ..subspaces import BlockSubspace, FactoredSubspace
from .chunking import ChunkRunner, estimate_chunk, is_out_of_memory, memory_budget
from .compiled import CompiledSite
from .contracts import vmap_forbidden
from .functional import activation_numel, as_args, buffers_restored, sequential_losses, vmap_forward
from .inplace import inplace_losses
from .losses import CandidateLoss
from .mlp import MLPPlan, PrefixCache, group_changes, mlp_outputs, replacement_changes, subspace_changes

PATHS = ("inplace", "sparse_delta", "subspace_delta", "factored", "dense_bmm", "site_vmap", "vmap", "sequential")
_AUTOCAST = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _autocast_dtype(value) -> torch.dtype | None:
    if value is None or value is False:
        return None
    if isinstance(value, str):
        if value not in _AUTOCAST:
            raise ValueError(f"candidate_autocast must be None, torch.bfloat16, torch.float16 or one of {sorted(_AUTOCAST)}, got {value!r}")
        return _AUTOCAST[value]
    if value in (torch.bfloat16, torch.float16):
        return value
    raise ValueError(f"candidate_autocast must be None, torch.bfloat16 or torch.float16, got {value!r}")


class NNCostEvaluator:
    """Losses of candidate parameter vectors of ``model`` under ``loss_fn(model(inputs), targets)``.

    Never changes the model's parameters (the in-place path restores them
    exactly). ``last_path`` names the path that ran last; ``path_counts``
    counts candidates per path. Call ``reset_vmap()`` after replacing layers,
    parameters or buffers.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn,
        *,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        use_inplace: bool = False,
        reuse: bool = True,
        compile_evaluator: bool = False,
        compile_forward: bool | None = None,
        candidate_autocast=None,
        sparse_fraction: float = 0.125,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("chunk_size", chunk_size), ("memory_budget", memory_budget)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < sparse_fraction <= 1:
            raise ValueError(f"sparse_fraction must be in (0, 1], got {sparse_fraction!r}")
        if compile_forward not in (None, True, False):
            raise ValueError(f"compile_forward must be None, True or False, got {compile_forward!r}")
        self.model = model
        self.loss = CandidateLoss(loss_fn)
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self.use_inplace = bool(use_inplace)
        self.reuse = bool(reuse)
        self.compile_evaluator = bool(compile_evaluator)
        self.compile_forward = compile_forward
        self.autocast_dtype = _autocast_dtype(candidate_autocast)
        self.sparse_fraction = sparse_fraction
        self.last_path: str | None = None
        self.path_counts: Counter = Counter()
        self.reset_vmap()

    # ------------------------------------------------------------------ state
    def reset_vmap(self) -> None:
        """Forget everything derived from the model: layout, plan, caches, compiled and vmap state."""
        self.layout = ParameterLayout(self.model)
        self.plan = MLPPlan.from_model(self.model, self.layout)
        self.prefix = PrefixCache()
        self.vmap_ok = not vmap_forbidden(self.model)
        self.chunks = ChunkRunner()
        self._activations: dict = {}
        self._dense_site = CompiledSite(mlp_outputs, "dense batched", self.compile_evaluator)
        self._vmap_site = CompiledSite(vmap_forward, "vmap", self.compile_evaluator)
        device = next(self.model.parameters()).device
        compile_forward = device.type == "cuda" if self.compile_forward is None else self.compile_forward
        self._forward_site = CompiledSite(self.model, "in-place forward", compile_forward)

    @property
    def delta_allowed(self) -> bool:
        """Delta paths need the base activations at full precision and reuse enabled."""
        return self.plan is not None and self.reuse and self.autocast_dtype is None

    def _record(self, path: str, count: int) -> None:
        self.last_path = path
        self.path_counts[path] += count

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.layout_device.type, dtype=self.autocast_dtype)

    @property
    def layout_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _check(self, tensor: torch.Tensor, argument: str) -> None:
        param = next(self.model.parameters())
        if tensor.dtype != param.dtype or tensor.device != param.device:
            raise TypeError(
                f"{argument} must match the model's parameters ({param.dtype} on {param.device}), got {tensor.dtype} on {tensor.device}"
            )

    def _check_inputs(self, inputs) -> None:
        if self.plan is None:
            return
        first = next(s for s in self.plan.stages if hasattr(s, "in_features"))
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 1 or inputs.shape[-1] != first.in_features:
            got = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(f"inputs must be a tensor whose last dimension is {first.in_features}, got {got}")

    def _chunk(self, count: int, params_per_candidate: int, activations_per_candidate: int, base: torch.Tensor) -> int:
        """Candidates per chunk; dtype and device come from ``base`` (cheaper than walking the model's parameters)."""
        if self.chunk_size is not None:
            return min(self.chunk_size, max(count, 1))
        itemsize = torch.finfo(base.dtype).bits // 8
        budget = self.memory_budget or memory_budget(base.device)
        return estimate_chunk(count, (params_per_candidate + activations_per_candidate) * itemsize, budget)

    # ----------------------------------------------------------------- public
    def evaluate(self, candidates, inputs, targets) -> torch.Tensor:
        """(C,) losses of flat candidates ``(C, n)`` in ``parameters_to_vector`` order."""
        if isinstance(candidates, CandidateBatch):
            return self.evaluate_batch(candidates, inputs, targets)
        self.layout.check_vector(candidates, "candidates", batched=True)
        self._check(candidates, "candidates")
        self._check_inputs(inputs)
        with torch.no_grad():
            base = self.layout.flatten(self.model)
            count = candidates.shape[0]
            if self.use_inplace:
                writes = [(slot.position, None, candidates[:, slot.start : slot.stop]) for slot in self.layout.slots]
                return self._inplace(base, writes, count, inputs, targets)
            diff = candidates - base
            changed = torch.stack([(diff[:, s.start : s.stop] != 0).any(1) for s in self.layout.slots], 1)
            patterns, which = torch.unique(changed, dim=0, return_inverse=True)
            losses = [None] * len(patterns)
            for p, pattern in enumerate(patterns):
                rows = torch.nonzero(which == p).flatten()
                slots = torch.nonzero(pattern).flatten().tolist()
                losses[p] = (rows, self._flat_pattern(candidates[rows], diff[rows], slots, base, inputs, targets))
            out = losses[0][1].new_empty(count)
            for rows, values in losses:
                out[rows] = values
            return out

    def evaluate_batch(self, batch: CandidateBatch, inputs, targets) -> torch.Tensor:
        """(C,) losses of structured candidates, in group order, without building (C, n) on the fast paths."""
        if not isinstance(batch, CandidateBatch):
            raise TypeError(f"batch must be a CandidateBatch, got {type(batch).__name__}")
        self.layout.check_vector(batch.base, "batch.base", batched=False)
        self._check(batch.base, "batch.base")
        self._check_inputs(inputs)
        if batch.subspace is not None and getattr(batch.subspace, "layout", self.layout).n != self.layout.n:
            raise ValueError("batch.subspace was built for a model with a different number of parameters")
        with torch.no_grad():
            parts = [self._group(batch, group, inputs, targets) for group in batch.groups if group.count]
        return torch.cat(parts) if parts else batch.base.new_empty(0)

    # ------------------------------------------------------------ flat input
    def _flat_pattern(self, candidates, diff, slots, base, inputs, targets) -> torch.Tensor:
        """Candidates that all change the parameters ``slots``."""
        count = candidates.shape[0]
        if self.delta_allowed and slots:
            touched = (diff != 0).any(0)
            cols = torch.nonzero(touched).flatten()
            if cols.numel() <= self.sparse_fraction * sum(self.layout.slots[s].numel for s in slots):
                delta = diff[:, cols]
                return self._mlp(
                    "sparse_delta", count, cols.numel(), lambda a, b: group_changes(self.plan, self.layout, cols, delta[a:b]), base, inputs, targets
                )

        def values(a, b):
            return {s: candidates[a:b, self.layout.slots[s].start : self.layout.slots[s].stop].reshape(b - a, *self.layout.slots[s].shape) for s in slots}

        return self._replaced(slots, values, count, base, inputs, targets)

    # ------------------------------------------------------ structured input
    def _group(self, batch: CandidateBatch, group: CandidateGroup, inputs, targets) -> torch.Tensor:
        base, subspace, count = batch.base, batch.subspace, group.count
        index, delta = group.index.to(base.device), group.delta.to(base.dtype)
        if self.use_inplace:
            return self._inplace(base, self._group_writes(batch, index, delta), count, inputs, targets)
        if self.delta_allowed and subspace is None:
            changes = lambda a, b: group_changes(self.plan, self.layout, index, delta[a:b])  # noqa: E731
            return self._mlp("sparse_delta", count, index.numel(), changes, base, inputs, targets)
        if self.delta_allowed and isinstance(subspace, BlockSubspace):
            path = "factored" if isinstance(subspace, FactoredSubspace) else "subspace_delta"
            changes = lambda a, b: subspace_changes(self.plan, subspace, index, delta[a:b])  # noqa: E731
            return self._mlp(path, count, index.numel(), changes, base, inputs, targets)
        slots, values = self._group_values(batch, index, delta)
        return self._replaced(slots, values, count, base, inputs, targets)

    def _group_values(self, batch: CandidateBatch, index: torch.Tensor, delta: torch.Tensor):
        """Touched parameters and a chunk -> {slot: candidate values} function."""
        base, subspace = batch.base, batch.subspace
        if subspace is None:
            split = self.layout.split(index)
        elif isinstance(subspace, BlockSubspace):
            split = {}
            for block_id, (positions, coords) in subspace.split(index).items():
                split.setdefault(subspace.blocks[block_id].slot.position, []).append((subspace.blocks[block_id], positions, coords))
        else:
            split = {slot.position: None for slot in self.layout.slots}
        slots = sorted(split)

        def values(a, b):
            rows = delta[a:b]
            flat = batch.group_displacements(CandidateGroup(index, rows)) if subspace is not None and not isinstance(subspace, BlockSubspace) else None
            out = {}
            for s in slots:
                slot = self.layout.slots[s]
                own = base[slot.start : slot.stop]
                if flat is not None:
                    value = own + flat[:, slot.start : slot.stop]
                elif subspace is None:
                    positions, local = split[s]
                    value = own.repeat(b - a, 1)
                    value[:, local] = own[local] + rows[:, positions]
                else:
                    value = own + sum(block.displacement(p, rows[:, pos]) for block, pos, p in split[s])
                out[s] = value.reshape(b - a, *slot.shape)
            return out

        return slots, values

    def _group_writes(self, batch: CandidateBatch, index: torch.Tensor, delta: torch.Tensor) -> list:
        base, count = batch.base, delta.shape[0]
        if batch.subspace is None:
            return [
                (s, local, base[self.layout.slots[s].start + local] + delta[:, positions])
                for s, (positions, local) in self.layout.split(index).items()
            ]
        slots, values = self._group_values(batch, index, delta)
        full = values(0, count)
        return [(s, None, full[s].reshape(count, -1)) for s in slots]

    # ------------------------------------------------------------------ paths
    def _mlp(self, path: str, count: int, width: int, changes_for, base, inputs, targets) -> torch.Tensor:
        """Sequential-MLP paths: ``changes_for(a, b)`` gives the per-stage changes of a chunk."""
        prefix = self.prefix.get(self.plan, base, inputs)
        m = prefix.entering[0].shape[0]
        chunk = self._chunk(count, width, m * self.plan.activation_widths(0), base)
        site = self._dense_site if path == "dense_bmm" else mlp_outputs

        def run(a, b):
            with self._autocast():
                outputs = site(self.plan, prefix, changes_for(a, b), b - a)
            return self.loss(outputs, targets, b - a)

        losses = self.chunks.run(count, chunk, run)
        self._record(path, count)
        return losses

    def _replaced(self, slots, values, count, base, inputs, targets) -> torch.Tensor:
        """Candidates given as new values of the parameters ``slots``: dense MLP or functional paths."""
        if self.plan is not None and self.reuse:  # no slots: the incumbent, a dense pass with no change
            width = sum(self.layout.slots[s].numel for s in slots)
            return self._mlp("dense_bmm", count, width, lambda a, b: replacement_changes(self.plan, values(a, b)), base, inputs, targets)
        if not self.reuse:
            slots = [slot.position for slot in self.layout.slots]
            values = self._all_values(values, base, slots)
        return self._functional(slots, values, count, base, inputs, targets)

    def _all_values(self, values, base, slots):
        def full(a, b):
            given = values(a, b)
            return {s: given[s] if s in given else base[self.layout.slots[s].start : self.layout.slots[s].stop].reshape(self.layout.slots[s].shape).expand(b - a, *self.layout.slots[s].shape) for s in slots}

        return full

    def _functional(self, slots, values, count, base, inputs, targets) -> torch.Tensor:
        names = {s: self.layout.slots[s].name for s in slots}
        fixed = {n: v for n, v in self.layout.views(base).items() if n not in names.values()}
        if not slots:  # every candidate equals the base
            with self._autocast(), buffers_restored(self.model):
                loss = self.loss.single(functional_call(self.model, fixed, as_args(inputs)), targets)
            self._record("site_vmap", count)
            return loss.expand(count)
        path = "vmap" if len(slots) == len(self.layout.slots) else "site_vmap"
        width = sum(self.layout.slots[s].numel for s in slots)

        def named(a, b):
            return {names[s]: v for s, v in values(a, b).items()}

        if self.vmap_ok:
            chunk = self._chunk(count, width, self._activation_numel(inputs), base)

            def run(a, b):
                with self._autocast():
                    outputs = self._vmap_site(self.model, fixed, named(a, b), inputs)
                return self.loss(outputs, targets, b - a)

            try:
                losses = self.chunks.run(count, chunk, run)
                self._record(path, count)
                return losses
            except Exception as exc:  # noqa: BLE001 - vmap incompatibility: sequential below
                if is_out_of_memory(exc):
                    raise
                self.vmap_ok = False
                warnings.warn(
                    f"model does not run under torch.vmap ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                    "evaluating candidates one at a time (call reset_vmap() after changing the model)",
                    stacklevel=3,
                )

        def single(outputs):
            return self.loss.single(outputs, targets)

        with buffers_restored(self.model), self._autocast():
            losses = torch.cat([sequential_losses(self.model, fixed, named(a, min(a + 64, count)), inputs, single) for a in range(0, count, 64)])
        self._record("sequential", count)
        return losses

    def _inplace(self, base, writes, count, inputs, targets) -> torch.Tensor:
        def forward_loss():
            with self._autocast():
                outputs = self._forward_site(*as_args(inputs))
            return self.loss.single(outputs, targets)

        with buffers_restored(self.model):
            losses = inplace_losses(self.model, self.layout, base, writes, count, forward_loss)
        self._record("inplace", count)
        return losses

    def _activation_numel(self, inputs) -> int:
        key = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else tuple(getattr(t, "shape", None) for t in inputs)
        if key not in self._activations:
            self._activations[key] = 2 * activation_numel(self.model, inputs)
        return self._activations[key]
