"""PolytopeOptimizer: derivative-free steps from polytope probes and optimal transport.

One evaluated step:
  1. incumbents: score f(x) when a model or the trust region needs it; with the
     trust region, also the previous incumbent on the *same* objective, and undo
     the last move if it did not pay off;
  2. probes: around x, block p gets the candidates x + s r_k R_p v (vertices v of
     a unit frame, radii r_k, basis R_p), every other block unchanged;
  3. transport: the cost matrix C[p, v] (mean over radii) goes through softmax,
     argmin or Sinkhorn; each block's barycentric point b_p sets its direction;
  4. move: length lr * s * mean(r) * b_p, or the quadratic model's minimiser
     along b_p; heavy-ball momentum kept in frame coordinates and carried over
     basis rotations by orthogonal Procrustes;
  5. control: probe-radius and trust-radius updates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .candidates import CandidateBatch, CandidateGroup, Subspace
from .controllers import MultifidelityScreen, TrustRegion, check_schedule
from .geometry import POLYTOPES, curvature_estimate, frame, gradient_estimate, procrustes, random_basis
from .transport import SOLVERS, argmin_plan, barycentric_directions, normalize_costs, sinkhorn_plan, softmax_plan

ROTATIONS = ("random", "last_step", "none")
RADIUS_MODELS = (None, "quadratic")
MAX_MODEL_STEP = 4.0  # without a trust region, model steps stop at this many mean probe radii


@dataclass
class ProbeRecord:
    """What one probe sweep saw; reusable while point, objective and configuration stay put."""

    point: torch.Tensor
    token: Any
    bases: list[torch.Tensor]
    radii: torch.Tensor  # absolute radii s * r_k
    losses: torch.Tensor  # (P, Vmax, K), +inf padding


def _positive_floats(name: str, values) -> tuple[float, ...]:
    if isinstance(values, (int, float)):
        values = (values,)
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number or a sequence of them, got {values!r}") from None
    if not out or not all(math.isfinite(v) and v > 0 for v in out):
        raise ValueError(f"{name} must be positive finite numbers, got {values!r}")
    return out


class PolytopeOptimizer(torch.optim.Optimizer):
    """Derivative-free optimizer: see the module docstring and docs/polytope.md."""

    def __init__(
        self,
        params,
        polytope: str = "orthoplex",
        radii: float | Sequence[float] = (0.05,),
        blocks: str | int | Sequence[int] = "tensor",
        block_dim: int | None = None,
        subspace: Subspace | None = None,
        chunk_size: int | None = None,
        use_inplace: bool = False,
        compile: bool = False,
        compile_evaluator: bool = False,
        compile_forward: bool | None = None,
        candidate_autocast: torch.dtype | None = None,
        solver: str = "softmax",
        temperature: float = 0.5,
        sinkhorn_relaxation: float | None = 1.0,
        sinkhorn_max_iter: int = 200,
        lr: float = 1.0,
        momentum: float = 0.0,
        step_schedule: Callable[[int], float] | None = None,
        temperature_schedule: Callable[[int], float] | None = None,
        rotation: str = "random",
        radius_model: str | None = None,
        trust_region: bool | dict = False,
        adaptive_probes: bool = False,
        amortize_steps: int | None = None,
        multifidelity_screen: dict | None = None,
        seed: int | None = None,
    ):
        super().__init__(params, defaults={})
        self._params = [p for group in self.param_groups for p in group["params"]]
        if polytope not in POLYTOPES:
            raise ValueError(f"polytope must be one of {POLYTOPES}, got {polytope!r}")
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {ROTATIONS}, got {rotation!r}")
        if radius_model not in RADIUS_MODELS:
            raise ValueError(f"radius_model must be one of {RADIUS_MODELS}, got {radius_model!r}")
        self.radii = torch.tensor(_positive_floats("radii", radii), dtype=torch.float64)
        self.temperature = _positive_floats("temperature", temperature)[0]
        self.lr = _positive_floats("lr", lr)[0]
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if sinkhorn_relaxation is not None:
            _positive_floats("sinkhorn_relaxation", sinkhorn_relaxation)
        if not isinstance(sinkhorn_max_iter, int) or sinkhorn_max_iter < 1:
            raise ValueError(f"sinkhorn_max_iter must be a positive int, got {sinkhorn_max_iter!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        if amortize_steps is not None and (not isinstance(amortize_steps, int) or amortize_steps < 1):
            raise ValueError(f"amortize_steps must be a positive int or None, got {amortize_steps!r}")
        if block_dim is not None and (not isinstance(block_dim, int) or block_dim < 1):
            raise ValueError(f"block_dim must be a positive int or None, got {block_dim!r}")
        for name, flag in (("use_inplace", use_inplace), ("compile", compile), ("compile_evaluator", compile_evaluator),
                           ("adaptive_probes", adaptive_probes)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if compile_forward is not None and not isinstance(compile_forward, bool):
            raise TypeError(f"compile_forward must be a bool or None, got {type(compile_forward).__name__}")
        if candidate_autocast is not None and not isinstance(candidate_autocast, torch.dtype):
            raise TypeError(f"candidate_autocast must be a torch.dtype or None, got {type(candidate_autocast).__name__}")
        if subspace is not None and not (isinstance(getattr(subspace, "dim", None), int) and callable(getattr(subspace, "to_flat", None))):
            raise TypeError("subspace must have an int `dim` and a `to_flat(z)` method")
        self.screen = MultifidelityScreen.from_option(multifidelity_screen)
        if self.screen is not None and radius_model == "quadratic":
            raise ValueError("multifidelity_screen cannot run with radius_model='quadratic': the curvature fit needs exact full-batch differences")
        self.trust = TrustRegion.from_option(trust_region)
        self.polytope, self.solver, self.rotation, self.radius_model = polytope, solver, rotation, radius_model
        self.sinkhorn_relaxation, self.sinkhorn_max_iter = sinkhorn_relaxation, sinkhorn_max_iter
        self.momentum, self.chunk_size, self.amortize_steps = momentum, chunk_size, amortize_steps
        self.adaptive_probes = adaptive_probes
        self.step_schedule = check_schedule("step_schedule", step_schedule)
        self.temperature_schedule = check_schedule("temperature_schedule", temperature_schedule)
        self.subspace = subspace
        self.evaluator_options = {"use_inplace": use_inplace, "compile_evaluator": compile_evaluator,
                                  "compile_forward": compile_forward, "candidate_autocast": candidate_autocast}
        self.compile = compile  # geometry/solver kernels are tiny on CPU; kept for the CUDA path and the contract

        self._x = parameters_to_vector(self._params).detach().clone()
        space = subspace.dim if subspace is not None else self._x.numel()
        self.blocks = self._make_blocks(blocks, space)
        self.dims = [idx.numel() if block_dim is None else min(idx.numel(), block_dim) for idx in self.blocks]
        self._frames = {d: frame(polytope, d) for d in set(self.dims)}
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
        self._generator = torch.Generator().manual_seed(int(seed))
        self._bases = [random_basis(idx.numel(), d, self._generator) for idx, d in zip(self.blocks, self.dims)]
        self._velocity = [torch.zeros(d, dtype=torch.float64) for d in self.dims]
        self._last_move = [torch.zeros(idx.numel(), dtype=torch.float64) for idx in self.blocks]
        self._scale = 1.0  # probe-radius multiplier (radius model / adaptive probes)
        self._trust_radius = self.trust.initial if self.trust else MAX_MODEL_STEP
        self._potentials = None  # Sinkhorn warm start
        self._model = None  # (x, token, f(x), bases, per-block frame gradients, per-axis curvatures)
        self._pending = torch.zeros(space, dtype=torch.float64)  # displacement since the model's point
        self._record: ProbeRecord | None = None
        self._evaluator = None
        self._step_count = 0
        self.evaluations = 0.0  # full-fidelity equivalents: what a budget charges
        self.candidates_scored = 0
        self.last_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ setup
    def _make_blocks(self, spec, space: int) -> list[torch.Tensor]:
        sizes: list[int]
        if spec == "all":
            sizes = [space]
        elif spec in ("tensor", "layer"):
            if self.subspace is not None:
                sizes = list(getattr(self.subspace, "block_sizes", None) or [])
                if not sizes:
                    raise ValueError(f"blocks={spec!r} needs a subspace with `block_sizes`; use 'all', an int or explicit sizes")
            else:
                sizes = []
                for p in self._params:
                    if spec == "layer" and p.dim() < 2 and sizes:
                        sizes[-1] += p.numel()  # biases and norms join the layer before them
                    else:
                        sizes.append(p.numel())
        elif isinstance(spec, int) and not isinstance(spec, bool):
            if spec < 1:
                raise ValueError(f"blocks as an int is a particle size and must be positive, got {spec}")
            sizes = [min(spec, space - start) for start in range(0, space, spec)]
        elif isinstance(spec, (list, tuple)) and all(isinstance(s, int) and s > 0 for s in spec):
            sizes = list(spec)
        else:
            raise ValueError(f"blocks must be 'tensor', 'layer', 'all', a positive int or a list of positive sizes, got {spec!r}")
        if sum(sizes) != space:
            raise ValueError(f"blocks sizes sum to {sum(sizes)} but the search space has {space} coordinates")
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        return [torch.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    def register_evaluator(self, evaluator, inputs, targets) -> None:
        """Score candidates with ``evaluator.evaluate_batch(batch, inputs, targets)`` until replaced."""
        if not callable(getattr(evaluator, "evaluate_batch", None)):
            raise TypeError("evaluator must have an evaluate_batch(batch, inputs, targets) method")
        self._evaluator = (evaluator, inputs, targets)

    def unregister_evaluator(self) -> None:
        self._evaluator = None

    def resync_from_model(self) -> None:
        """Adopt the parameters as they are now (after external changes); forget stale comparisons."""
        self._x = parameters_to_vector(self._params).detach().clone()
        self._model = None
        self._record = None
        self._pending.zero_()

    @property
    def incumbent(self) -> torch.Tensor:
        return self._x.clone()

    # ------------------------------------------------------------- evaluation
    def _score(self, batch: CandidateBatch, closure, subset: torch.Tensor | None) -> torch.Tensor:
        if self._evaluator is not None:
            evaluator, inputs, targets = self._evaluator
            if subset is not None:
                inputs, targets = inputs[subset], targets[subset]
            losses = evaluator.evaluate_batch(batch, inputs, targets)
        elif closure is None:
            raise ValueError("step needs a closure(candidates) or a registered evaluator")
        elif subset is None:
            losses = closure(batch.materialize())
        else:
            losses = closure(batch.materialize(), subset=subset)
        losses = torch.as_tensor(losses).detach().reshape(-1).to(torch.float64)
        if losses.numel() != batch.count:
            raise ValueError(f"the objective returned {losses.numel()} losses for {batch.count} candidates")
        fidelity = 1.0 if subset is None else self.screen.screen_fidelity / self.screen.num_probe
        self.evaluations += fidelity * batch.count
        self.candidates_scored += batch.count
        return losses

    def _score_point(self, point: torch.Tensor, closure) -> float:
        # A zero change on one coordinate (not an empty block): the plainest case for any evaluator.
        first = torch.zeros(1, dtype=torch.long)
        batch = CandidateBatch(point, [CandidateGroup(first, point.new_zeros(1, 1), {"incumbent": True})])
        loss = float(self._score(batch, closure, None)[0])
        if not math.isfinite(loss):
            raise ValueError(f"the objective is not finite at the incumbent ({loss})")
        return loss

    def _score_groups(self, groups: list[CandidateGroup], closure, subset=None) -> torch.Tensor:
        """Losses of all groups' candidates in order, one CandidateBatch per chunk."""
        chunk = self.chunk_size or sum(g.count for g in groups)
        pieces, current, room = [], [], chunk
        for group in groups:
            start = 0
            while start < group.count:
                take = min(room, group.count - start)
                rows = slice(start, start + take)
                info = dict(group.info, rows=(start, start + take))
                current.append(CandidateGroup(group.index, group.delta[rows], info))
                start, room = start + take, room - take
                if room == 0:
                    pieces.append(self._score(CandidateBatch(self._x, current, self.subspace), closure, subset))
                    current, room = [], chunk
        if current:
            pieces.append(self._score(CandidateBatch(self._x, current, self.subspace), closure, subset))
        return torch.cat(pieces)

    def _probe_groups(self, radii: torch.Tensor) -> list[CandidateGroup]:
        """Per block and radius, the (V, m) displacements r * frame @ basis.T, built in the model's dtype.

        Big blocks make this memory-bound (fresh pages cost as much as the
        arithmetic), so temporaries are avoided: the orthoplex frame is
        [I; -I], so its displacements are the basis columns, cast and scaled in
        place, and their negatives; other frames scale the (m, d) basis before
        the product.
        """
        groups, dtype = [], self._x.dtype
        for p, (index, basis) in enumerate(zip(self.blocks, self._bases)):
            d = self.dims[p]
            for k, radius in enumerate(radii.tolist()):
                if self.polytope == "orthoplex":
                    delta = basis.new_empty(2 * d, index.numel(), dtype=dtype)
                    delta[:d] = basis.T
                    delta[:d] *= radius
                    torch.neg(delta[:d], out=delta[d:])
                else:
                    delta = self._frames[d].to(dtype) @ (radius * basis.T).to(dtype)
                groups.append(CandidateGroup(index, delta, {"block": p, "radius_index": k, "radius": radius}))
        return groups

    def _probe(self, radii: torch.Tensor, closure) -> torch.Tensor:
        """(P, Vmax, K) probe losses, +inf where a block has fewer vertices."""
        groups = self._probe_groups(radii)
        if self.screen is None:
            flat = self._score_groups(groups, closure)
        else:
            flat = self._screened(groups, closure)
        bad = ~torch.isfinite(flat)
        if bad.all():
            raise ValueError("the objective is not finite at any probe; reduce radii")
        flat = torch.where(bad, flat[~bad].max(), flat)  # a diverging probe is as bad as the worst seen
        counts = [self._frames[d].shape[0] for d in self.dims]
        out = torch.full((len(self.blocks), max(counts), len(radii)), torch.inf, dtype=torch.float64)
        offset = 0
        for p, count in enumerate(counts):
            size = count * len(radii)
            out[p, :count, :] = flat[offset:offset + size].reshape(len(radii), count).T
            offset += size
        self.last_info["nonfinite_probes"] = int(bad.sum())
        return out

    def _screened(self, groups: list[CandidateGroup], closure) -> torch.Tensor:
        screen = self.screen
        subset = torch.randperm(screen.num_probe, generator=self._generator)[: screen.screen_fidelity]
        cheap = self._score_groups(groups, closure, subset)
        probs = screen.keep_probabilities(cheap)
        kept = torch.rand(cheap.shape, generator=self._generator, dtype=torch.float64) < probs
        kept_groups, offset = [], 0
        for group in groups:
            rows = kept[offset:offset + group.count]
            if rows.any():
                kept_groups.append(CandidateGroup(group.index, group.delta[rows], group.info))
            offset += group.count
        full = torch.zeros_like(cheap)
        if kept.any():
            full[kept] = self._score_groups(kept_groups, closure)
        self.last_info["screen_kept"] = int(kept.sum())
        return screen.combine(cheap, full, kept, probs)

    # ------------------------------------------------------------ the step
    def _rotate(self) -> None:
        """New random bases. Bases are replaced, never changed in place, so records and models share them."""
        if self.rotation == "none":
            return
        for p, (index, d) in enumerate(zip(self.blocks, self.dims)):
            bias = self._last_move[p] if self.rotation == "last_step" else None
            new = random_basis(index.numel(), d, self._generator, bias=bias)
            if self.momentum > 0.0:  # otherwise the next move overwrites the velocity unread
                self._velocity[p] = procrustes(self._bases[p], new).T @ self._velocity[p]
            self._bases[p] = new

    def _plan(self, costs: torch.Tensor) -> torch.Tensor:
        epsilon = self.temperature * self.temperature_schedule(self._step_count)
        normalized = normalize_costs(costs)
        if self.solver == "softmax":
            result = softmax_plan(normalized, epsilon)
        elif self.solver == "argmin":
            result = argmin_plan(normalized)
        else:
            result = sinkhorn_plan(normalized, epsilon, self.sinkhorn_relaxation, self._potentials, self.sinkhorn_max_iter)
            self._potentials = result.potentials
            if not result.info["converged"]:
                self.last_info["sinkhorn_warning"] = "Sinkhorn did not converge; the plan's column marginals are approximate"
        self.last_info["transport"] = result.info
        return result.plan

    def _fit_model(self, losses: torch.Tensor, radii: torch.Tensor, f_x: float | None):
        """Per-block gradient and curvature along each frame axis, averaged over radii.

        The curvature's mean over axes is the tr(H)/d estimate. The orthoplex
        also resolves it per axis (the diagonal of the projected Hessian:
        (L_+i + L_-i - 2 f) / h^2), which keeps model steps along steep axes short.
        """
        grads, curvs = [], []
        for p, d in enumerate(self.dims):
            vertices = self._frames[d]
            block = losses[p, : vertices.shape[0], :].T  # (K, V)
            steps = radii.tolist()
            grads.append(torch.stack([gradient_estimate(block[k], vertices, r) for k, r in enumerate(steps)]).mean(0))
            if f_x is None:
                curvs.append(None)
            elif self.polytope == "orthoplex":
                pairs = block[:, :d] + block[:, d:] - 2.0 * f_x
                curvs.append((pairs / radii[:, None] ** 2).mean(0))
            else:
                trace = torch.stack([curvature_estimate(block[k], f_x, r) for k, r in enumerate(steps)]).mean()
                curvs.append(trace.expand(d).clone())
        return grads, curvs

    def _moves(self, directions: torch.Tensor, grads, curvs, mean_radius: float) -> tuple[list[torch.Tensor], bool]:
        """Frame-coordinate moves per block, and whether any was cut by the allowed step."""
        cap = self._trust_radius * mean_radius
        moves, clipped = [], False
        for p, d in enumerate(self.dims):
            b = directions[p, :d]
            norm = float(b.norm())
            if norm == 0.0:
                moves.append(torch.zeros_like(b))
                continue
            if self.radius_model == "quadratic":
                u = b / norm
                slope, curv = float(grads[p] @ u), float(curvs[p] @ u**2)
                if slope >= 0.0:
                    length = 0.0
                elif curv > 0.0:
                    length = -slope / curv
                else:
                    length = math.inf
            else:
                u, length = b / norm, mean_radius * norm
            length = self.lr * length
            if length > cap:
                length, clipped = cap, True
            moves.append(length * u)
        return moves, clipped

    def _predicted_change(self, displacement: torch.Tensor) -> float | None:
        """The stored block models' prediction for a coordinate-space displacement."""
        if self._model is None:
            return None
        _, _, _, bases, grads, curvs = self._model
        total = 0.0
        for p, index in enumerate(self.blocks):
            delta = displacement[index]
            z = bases[p].T @ delta
            outside = float((delta - bases[p] @ z).square().sum())
            total += float(grads[p] @ z) + 0.5 * float(curvs[p] @ z**2) + 0.5 * float(curvs[p].mean()) * outside
        return total

    def _apply(self, coordinate_step: torch.Tensor) -> None:
        step = coordinate_step if self.subspace is None else self.subspace.to_flat(coordinate_step[None].to(self._x.dtype))[0]
        self._x = self._x + step.to(self._x.dtype)
        self._pending += coordinate_step
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)

    def _coast(self) -> None:
        """A momentum-only step between sampled ones: no evaluations."""
        step = torch.zeros_like(self._pending)
        for p, index in enumerate(self.blocks):
            if self.momentum > 0.0:
                self._velocity[p] = self.momentum * self._velocity[p]
            step[index] = self._bases[p] @ self._velocity[p]
        self._apply(step)
        self.last_info = {"step": self._step_count, "evaluated": False, "evaluations": self.evaluations}

    def _check_incumbents(self, closure, token) -> float:
        """Score x (and, with the trust region, the previous incumbent on this objective); undo a bad move."""
        f_x = self._score_point(self._x, closure)
        if self.trust is None or self._model is None or not bool(self._pending.any()):
            return f_x
        point, model_token, f_old = self._model[:3]
        if token is None or token != model_token:
            f_old = self._score_point(point, closure)  # same batch for both: a fair comparison
        predicted = self._predicted_change(self._pending)
        rho = self.trust.ratio(f_old - f_x, -predicted)
        accepted, self._trust_radius = self.trust.update(self._trust_radius, rho, self.last_info.get("clipped", False))
        self.last_info.update(rho=rho, accepted=accepted, trust_radius=self._trust_radius)
        if accepted:
            return f_x
        self._x = point.clone()
        self._pending.zero_()
        self._velocity = [torch.zeros_like(v) for v in self._velocity]
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)
        return f_old

    @torch.no_grad()
    def step(self, closure: Callable[..., torch.Tensor] | None = None, objective_token: Any = None) -> float | None:
        """One optimizer step; returns f(incumbent) when it was scored, else the best probe's mean cost.

        ``objective_token`` names the objective (e.g. the minibatch); pass a new
        one whenever it changes so stale losses are never compared or reused.
        """
        t = self._step_count
        if self.amortize_steps is not None and t % self.amortize_steps != 0:
            self._coast()
            self._step_count += 1
            return None
        clipped_before = self.last_info.get("clipped", False)
        self.last_info = {"step": t, "evaluated": True, "clipped": clipped_before}
        needs_incumbent = self.radius_model == "quadratic" or self.trust is not None
        f_x = self._check_incumbents(closure, objective_token) if needs_incumbent else None
        if self.trust is None and self._model is not None and f_x is not None and objective_token is not None \
                and objective_token == self._model[1] and f_x > self._model[2]:
            self._scale *= 0.5  # without a trust region, a worse incumbent at least stops the radius growing
        record = self._record
        reuse = (self.adaptive_probes and record is not None and objective_token is not None
                 and record.token == objective_token and torch.equal(record.point, self._x))
        if reuse:
            self._bases = list(record.bases)
            radii, losses = record.radii, record.losses
        else:
            self._rotate()
            radii = self.radii * self._scale * self.step_schedule(t)
            losses = self._probe(radii, closure)
            self._record = ProbeRecord(self._x.clone(), objective_token, list(self._bases), radii, losses)
        self.last_info["reused_probes"] = reuse
        costs = losses.mean(dim=2)
        plan = self._plan(costs)
        vertices = torch.zeros(len(self.blocks), costs.shape[1], max(self.dims), dtype=torch.float64)
        for p, d in enumerate(self.dims):
            vertices[p, : self._frames[d].shape[0], :d] = self._frames[d]
        directions = barycentric_directions(plan, vertices)
        grads, curvs = self._fit_model(losses, radii, f_x)
        mean_radius = float(radii.mean())
        moves, clipped = self._moves(directions, grads, curvs, mean_radius)
        self._model_point(f_x, objective_token, grads, curvs)
        step = torch.zeros_like(self._pending)
        for p, index in enumerate(self.blocks):
            self._velocity[p] = self.momentum * self._velocity[p] + moves[p]
            step[index] = self._bases[p] @ self._velocity[p]
            self._last_move[p] = step[index]  # indexing with a tensor copies
        self._apply(step)
        self._adapt_radius(moves, losses, mean_radius)
        self.last_info.update(clipped=clipped, incumbent_loss=f_x, scale=self._scale, evaluations=self.evaluations,
                              step_norm=float(step.norm()))
        self._step_count += 1
        return f_x if f_x is not None else float(costs.min())

    def _model_point(self, f_x, token, grads, curvs) -> None:
        """Remember the model at x so the next step can judge the move from here."""
        if f_x is None:
            self._model = None
            return
        self._model = (self._x.clone(), token, f_x, list(self._bases), grads, curvs)
        self._pending.zero_()

    def _adapt_radius(self, moves, losses: torch.Tensor, mean_radius: float) -> None:
        if self.radius_model == "quadratic":
            lengths = torch.tensor([float(m.norm()) for m in moves])
            ratio = float(lengths.mean()) / mean_radius
            self._scale *= min(max(ratio, 0.5), 2.0) ** 0.5
        if self.adaptive_probes and len(self.radii) > 1:
            best = int(losses.amin(dim=1).mean(dim=0).argmin())  # radius whose best vertex is best on average
            geometric = float(self.radii.log().mean().exp())
            self._scale *= (float(self.radii[best]) / geometric) ** 0.5
        self._scale = min(max(self._scale, 1e-6), 1e6)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: incumbent, bases, momentum, controllers, RNG."""
        clone = lambda ts: [t.clone() for t in ts]  # noqa: E731
        model = None
        if self._model is not None:
            point, token, f_x, bases, grads, curvs = self._model
            model = (point.clone(), token, f_x, clone(bases), clone(grads), clone(curvs))
        record = None
        if self._record is not None:
            r = self._record
            record = {"point": r.point.clone(), "token": r.token, "bases": clone(r.bases), "radii": r.radii.clone(), "losses": r.losses.clone()}
        return {
            "layout": {"blocks": [int(b.numel()) for b in self.blocks], "dims": list(self.dims), "polytope": self.polytope},
            "x": self._x.clone(),
            "bases": clone(self._bases),
            "velocity": clone(self._velocity),
            "last_move": clone(self._last_move),
            "scale": self._scale,
            "trust_radius": self._trust_radius,
            "potentials": None if self._potentials is None else clone(self._potentials),
            "model": model,
            "pending": self._pending.clone(),
            "record": record,
            "step_count": self._step_count,
            "evaluations": self.evaluations,
            "candidates_scored": self.candidates_scored,
            "generator": self._generator.get_state(),
            "last_info": dict(self.last_info),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        layout = {"blocks": [int(b.numel()) for b in self.blocks], "dims": list(self.dims), "polytope": self.polytope}
        if state_dict.get("layout") != layout:
            raise ValueError(f"state_dict was saved with layout {state_dict.get('layout')}, this optimizer has {layout}")
        s = state_dict
        self._x = s["x"].clone()
        self._bases = [b.clone() for b in s["bases"]]
        self._velocity = [v.clone() for v in s["velocity"]]
        self._last_move = [m.clone() for m in s["last_move"]]
        self._scale, self._trust_radius = s["scale"], s["trust_radius"]
        self._potentials = None if s["potentials"] is None else tuple(t.clone() for t in s["potentials"])
        m = s["model"]
        self._model = None if m is None else (m[0].clone(), m[1], m[2], *([t.clone() for t in ts] for ts in m[3:]))
        self._pending = s["pending"].clone()
        r = s["record"]
        self._record = None if r is None else ProbeRecord(r["point"].clone(), r["token"], [b.clone() for b in r["bases"]], r["radii"].clone(), r["losses"].clone())
        self._step_count, self.evaluations, self.candidates_scored = s["step_count"], s["evaluations"], s["candidates_scored"]
        self._generator.set_state(s["generator"])
        self.last_info = dict(s["last_info"])
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)
