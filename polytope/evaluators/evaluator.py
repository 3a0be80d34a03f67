"""``NNCostEvaluator``: candidate losses for a model, through the cheapest exact path.

Both entry points turn candidates into groups first (``groups.py``):
``evaluate_batch`` takes the optimizer's structured ``CandidateBatch`` group by
group; ``evaluate`` compares flat ``(C, n)`` candidates with the model's
parameters once (``flat.py``) and groups them by the tensors and entries they
change. Each group then runs through the first path that accepts it
(``paths.py``), in this order:

=================  ==========================================================
``inplace``        ``use_inplace=True``: candidates written into the model one
                   at a time (restored afterwards)
``sparse_delta``   sequential MLP, full-space deltas (few entries, or whole
                   tensors of a structured batch)
``subspace_delta`` sequential MLP, ``HybridSubspace`` (or any block subspace)
``factored``       sequential MLP, ``FactoredSubspace``
``dense_bmm``      sequential MLP, flat candidates that rewrite whole tensors
                   (or ``candidate_autocast``)
``site_vmap``      any other model: vmap over the changed tensors only
``vmap``           any other model, every tensor changed (or ``reuse=False``)
``sequential``     the model (or a layer) cannot run under vmap
=================  ==========================================================

``group=`` (a ``torch.distributed`` process group) splits every call's
candidates across the group's ranks in contiguous ranges and all-gathers the
losses (``polytope/distributed.py``): each rank returns all of them.

``reuse=False`` turns off everything that shares work between candidates
(delta, dense-prefix and site-local paths): every candidate then runs the whole
forward under vmap. It exists as the baseline the benchmarks compare against.
"""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

import torch
from torch import nn

from .. import distributed
from ..candidates import CandidateBatch
from ..config import EvaluatorOptions
from ..param_layout import ParameterLayout
from .chunking import ChunkRunner, estimate_chunk, memory_budget
from .compiled import CompiledSite
from .contracts import vmap_forbidden
from .flat import flat_groups, whole_groups
from .functional import activation_numel, vmap_forward
from .groups import Group, batch_groups
from .losses import CandidateLoss
from .mlp import MLPPlan, PrefixCache, mlp_outputs
from .paths import STRATEGIES, Declined


class NNCostEvaluator:
    """Losses of candidate parameter vectors of ``model`` under ``loss_fn(model(inputs), targets)``.

    Never changes the model's parameters (the in-place path restores them
    exactly). ``last_path`` names the path that ran last; ``path_counts``
    counts candidates per path (this rank's, under ``group=``). Call
    ``reset_vmap()`` after replacing layers, parameters or buffers. The
    keywords are checked by ``EvaluatorOptions`` (the one rule the optimizer
    and ``train()`` use too) and kept in ``options``.
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
        group=None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.options = o = EvaluatorOptions(chunk_size, memory_budget, use_inplace, reuse, compile_evaluator, compile_forward,
                                            candidate_autocast, sparse_fraction)
        self.model = model
        self.loss = CandidateLoss(loss_fn)
        self.chunk_size, self.memory_budget, self.use_inplace, self.reuse = o.chunk_size, o.memory_budget, o.use_inplace, o.reuse
        self.compile_evaluator, self.compile_forward = o.compile_evaluator, o.compile_forward
        self.autocast_dtype, self.sparse_fraction = o.candidate_autocast, o.sparse_fraction
        self.shards = distributed.ranks(group)
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
        self.dense_site = CompiledSite(mlp_outputs, "dense batched", self.compile_evaluator)
        self.vmap_site = CompiledSite(vmap_forward, "vmap", self.compile_evaluator)
        param = next(self.model.parameters())
        compile_forward = param.device.type == "cuda" if self.compile_forward is None else self.compile_forward
        self.forward_site = CompiledSite(self.model, "in-place forward", compile_forward)

    @property
    def delta_allowed(self) -> bool:
        """Delta paths need the base activations at full precision and reuse enabled."""
        return self.plan is not None and self.reuse and self.autocast_dtype is None

    def autocast(self):
        """The candidate forwards' precision context (a no-op without ``candidate_autocast``)."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=self.autocast_dtype)

    def chunk_for(self, count: int, params_per_candidate: int, activations_per_candidate: int, base: torch.Tensor) -> int:
        """Candidates per chunk; dtype and device come from ``base`` (cheaper than walking the model's parameters)."""
        if self.chunk_size is not None:
            return min(self.chunk_size, max(count, 1))
        itemsize = torch.finfo(base.dtype).bits // 8
        budget = self.memory_budget or memory_budget(base.device)
        return estimate_chunk(count, (params_per_candidate + activations_per_candidate) * itemsize, budget)

    def activation_numel(self, inputs) -> int:
        """Activation storage per candidate of a generic model, measured once per input shape."""
        key = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else tuple(getattr(t, "shape", None) for t in inputs)
        if key not in self._activations:
            self._activations[key] = 2 * activation_numel(self.model, inputs)
        return self._activations[key]

    # ----------------------------------------------------------------- public
    def evaluate(self, candidates, inputs, targets) -> torch.Tensor:
        """(C,) losses of flat candidates ``(C, n)`` in ``parameters_to_vector`` order.

        They are compared with the model's current parameters once, and those
        that change few entries run on the same delta paths as structured
        candidates.
        """
        if isinstance(candidates, CandidateBatch):
            return self.evaluate_batch(candidates, inputs, targets)
        self._check_vector(candidates, "candidates", batched=True)
        self._check_inputs(inputs)

        def score(start: int, stop: int) -> torch.Tensor:
            base, groups = self.analyse(candidates[start:stop])
            return self._run(groups, stop - start, base, inputs, targets)

        with torch.no_grad():
            return self._scored(candidates.shape[0], score)

    def analyse(self, candidates: torch.Tensor) -> tuple[torch.Tensor, list[Group]]:
        """(model parameters, groups): how ``evaluate`` splits flat candidates, without scoring them."""
        self._check_vector(candidates, "candidates", batched=True)
        with torch.no_grad():
            base = self.layout.flatten(self.model)
            if self.use_inplace:  # written one at a time anyway: writing every tensor costs what comparing would
                return base, whole_groups(candidates, base, self.layout)
            coordinates, fraction = self.delta_allowed, self.sparse_fraction  # per-entry changes serve the delta paths only
            return base, flat_groups(candidates, base, self.layout, coordinates=coordinates, sparse_fraction=fraction)

    def evaluate_batch(self, batch: CandidateBatch, inputs, targets) -> torch.Tensor:
        """(C,) losses of structured candidates, in group order, without building (C, n) on the fast paths."""
        if not isinstance(batch, CandidateBatch):
            raise TypeError(f"batch must be a CandidateBatch, got {type(batch).__name__}")
        self._check_vector(batch.base, "batch.base", batched=False)
        self._check_inputs(inputs)
        if batch.subspace is not None and getattr(batch.subspace, "layout", self.layout).n != self.layout.n:
            raise ValueError("batch.subspace was built for a model with a different number of parameters")

        def score(start: int, stop: int) -> torch.Tensor:
            return self._run(batch_groups(batch.rows(start, stop), self.layout), stop - start, batch.base, inputs, targets)

        with torch.no_grad():
            return self._scored(batch.count, score)

    # ---------------------------------------------------------------- running
    def _scored(self, count: int, score) -> torch.Tensor:
        """``score(start, stop)`` on all candidates, or on this rank's range and gathered (``group=``)."""
        if self.shards is None:
            return score(0, count)
        dtype = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)  # an empty range's too
        return distributed.scored(self.shards, count, lambda start, stop: score(start, stop).to(dtype))

    def _run(self, groups: list[Group], count: int, base: torch.Tensor, inputs, targets) -> torch.Tensor:
        """Every group through its path; losses back in the caller's order."""
        out = None
        for group in groups:
            losses = self._dispatch(group, inputs, targets)
            if out is None:
                out = losses.new_empty(count)
            out[group.rows] = losses
        return base.new_empty(0, dtype=torch.promote_types(base.dtype, torch.float32)) if out is None else out

    def _dispatch(self, group: Group, inputs, targets) -> torch.Tensor:
        for path in STRATEGIES:
            if path.accepts(group, self):
                try:
                    losses = path.run(group, self, inputs, targets)
                except Declined:
                    continue
                self.last_path = path.name
                self.path_counts[path.name] += group.count
                return losses
        raise AssertionError("the sequential path accepts every group")

    # ----------------------------------------------------------------- checks
    def _check_vector(self, tensor, argument: str, batched: bool) -> None:
        param = next(self.model.parameters())
        shape = f"(C, {self.layout.n})" if batched else f"({self.layout.n},)"
        expected = f"{argument} must be a {shape} tensor of {param.dtype} on {param.device} (the model's parameters)"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{expected}, got {type(tensor).__name__}")
        if tensor.dim() != (2 if batched else 1) or tensor.shape[-1] != self.layout.n:
            raise ValueError(f"{expected}, got shape {tuple(tensor.shape)}")
        if tensor.dtype != param.dtype or tensor.device != param.device:
            raise TypeError(f"{expected}, got {tensor.dtype} on {tensor.device}")

    def _check_inputs(self, inputs) -> None:
        if self.plan is None:
            return
        first = next(s for s in self.plan.stages if hasattr(s, "in_features"))
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 1 or inputs.shape[-1] != first.in_features:
            got = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(f"inputs must be a tensor whose last dimension is {first.in_features}, got {got}")
