"""PolytopeOptimizer: derivative-free steps from polytope probes and optimal transport.

One evaluated step, stage by stage (each stage is its own module):
  1. incumbents: score f(x) when a model or the trust region needs it; with the
     trust region, also the previous incumbent on the *same* objective, and undo
     the last move if it did not pay off (``controllers``);
  2. probes: around x, block p gets the candidates x + r_pk R_p v (vertices v of
     a unit frame, radii r_pk, basis R_p), every other block unchanged (``probes``);
  3. transport: the cost matrix C[p, v] (mean over radii) goes through softmax,
     argmin or Sinkhorn; each block's barycentric point b_p sets its direction
     (``transport``);
  4. move: length lr * r * b_p, or the quadratic model's minimiser along b_p;
     heavy-ball momentum in frame coordinates, carried over rotations (``moves``);
  5. control: probe-radius and trust-radius updates (``controllers``).

``lr``, ``radius`` (the first probe radius) and ``momentum`` live in
``param_groups``, so ``torch.optim.lr_scheduler`` and per-group settings work.
Every candidate is scored through one ``Objective`` (``objective``), which a
closure and a registered evaluator both become. The defaults are the measured
best configuration; what they size from the problem is in ``defaults``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from . import validation as check
from .candidates import CandidateBatch, CandidateGroup, Subspace
from .controllers import AdaptiveTemperature, MultifidelityScreen, ProbeScale, TrustRegion
from .defaults import frame_dims, initial_radius
from .geometry import POLYTOPES, vertex_count
from .moves import RADIUS_MODELS, BlockModels, Momentum, fit_models, move_lengths
from .objective import ClosureObjective, EvaluatorObjective, Objective, chunks
from .probes import ROTATIONS, Probes, make_blocks
from .schedules import check_schedule
from .transport import SOLVERS, Transport, barycentric_directions

MAX_MODEL_STEP = 4.0  # without a trust region, model steps stop at this many mean probe radii
HALF_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class ProbeRecord:
    """What one probe sweep saw; reusable while point, objective and configuration stay put."""

    point: torch.Tensor
    token: Any
    bases: list[torch.Tensor]
    radii: torch.Tensor  # (P, K) absolute radii
    losses: torch.Tensor  # (P, Vmax, K), +inf padding
    active: list[int]


@dataclass(frozen=True)
class EvaluatorOptions:
    """How ``train()`` builds the ``NNCostEvaluator`` for this optimizer (validated here, used there)."""

    use_inplace: bool = False
    compile_evaluator: bool = False
    compile_forward: bool | None = None
    candidate_autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        check.flag("use_inplace", self.use_inplace)
        check.flag("compile_evaluator", self.compile_evaluator)
        check.flag("compile_forward", self.compile_forward, optional=True)
        if self.candidate_autocast is not None and not isinstance(self.candidate_autocast, torch.dtype):
            raise TypeError(f"candidate_autocast must be a torch.dtype or None, got {type(self.candidate_autocast).__name__}")
        if self.candidate_autocast is not None and self.candidate_autocast not in HALF_PRECISION:
            raise ValueError(f"candidate_autocast must be None, torch.bfloat16 or torch.float16, got {self.candidate_autocast}")


class PolytopeOptimizer(torch.optim.Optimizer):
    """Derivative-free optimizer: see the module docstring and docs/polytope.md."""

    def __init__(
        self,
        params,
        polytope: str = "orthoplex",
        radii: float | Sequence[float] | None = None,
        blocks: str | int | Sequence[int] = "all",
        block_dim: int | None = None,
        subspace: Subspace | None = None,
        chunk_size: int | None = None,
        use_inplace: bool = False,
        compile: bool = False,
        compile_evaluator: bool = False,
        compile_forward: bool | None = None,
        candidate_autocast: torch.dtype | None = None,
        solver: str = "softmax",
        temperature: float | None = None,
        sinkhorn_relaxation: float | None = 1.0,
        sinkhorn_max_iter: int = 200,
        lr: float = 1.0,
        momentum: float = 0.5,
        step_schedule: Callable[[int], float] | None = None,
        temperature_schedule: Callable[[int], float] | None = None,
        rotation: str = "last_step",
        radius_model: str | None = "quadratic",
        trust_region: bool | dict = True,
        adaptive_probes: bool = False,
        amortize_steps: int | None = None,
        multifidelity_screen: dict | None = None,
        seed: int | None = None,
        max_evaluations: float | None = None,
    ):
        radii = (None,) if radii is None else check.positives("radii", radii)
        defaults = {"lr": check.positive("lr", lr), "radius": radii[0],
                    "momentum": check.real("momentum", momentum, low=0.0, low_open=False, high=1.0, high_open=True)}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["radius"] is None:  # automatic: from this group's initial spread
                group["radius"] = initial_radius(group["params"])
            self._check_group(group)
        self._params = [p for group in self.param_groups for p in group["params"]]
        self.polytope = check.choice("polytope", polytope, POLYTOPES)
        self.rotation = check.choice("rotation", rotation, ROTATIONS)
        self.radius_model = check.choice("radius_model", radius_model, RADIUS_MODELS)
        self.radius_ratios = torch.tensor([1.0 if r is None else r / radii[0] for r in radii], dtype=torch.float64)
        self.temperature = None if temperature is None else check.positive("temperature", temperature)
        self.adaptive_temperature = AdaptiveTemperature() if temperature is None else None
        self.transport = Transport(check.choice("solver", solver, SOLVERS),
                                   None if sinkhorn_relaxation is None
                                   else check.positive("sinkhorn_relaxation", sinkhorn_relaxation),
                                   check.integer("sinkhorn_max_iter", sinkhorn_max_iter))
        self.chunk_size = check.integer("chunk_size", chunk_size, optional=True)
        self.amortize_steps = check.integer("amortize_steps", amortize_steps, optional=True)
        block_dim = check.integer("block_dim", block_dim, optional=True)
        self.adaptive_probes = check.flag("adaptive_probes", adaptive_probes)
        self.compile = check.flag("compile", compile)  # geometry/solver kernels are tiny on CPU; kept for the contract
        self.evaluator_options = EvaluatorOptions(use_inplace, compile_evaluator, compile_forward, candidate_autocast)
        self.max_evaluations = None if max_evaluations is None else check.positive("max_evaluations", max_evaluations)
        is_subspace = isinstance(getattr(subspace, "dim", None), int) and callable(getattr(subspace, "to_flat", None))
        if subspace is not None and not is_subspace:
            raise TypeError("subspace must have an int `dim` and a `to_flat(z)` method")
        if subspace is not None and len(self.param_groups) > 1:
            raise ValueError("a subspace searches one space: use a single parameter group with subspace=")
        self.subspace = subspace
        self.screen = MultifidelityScreen.from_option(multifidelity_screen)
        if self.screen is not None and radius_model == "quadratic":
            raise ValueError("multifidelity_screen cannot run with radius_model='quadratic' (the default): "
                             "the curvature fit needs exact full-batch differences; pass radius_model=None with a screen")
        self.trust = TrustRegion.from_option(trust_region)
        self.step_schedule = check_schedule("step_schedule", step_schedule)
        self.temperature_schedule = check_schedule("temperature_schedule", temperature_schedule)
        seed = check.seed(seed)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # follows torch.manual_seed
        self._generator = torch.Generator().manual_seed(seed)

        self._x = parameters_to_vector(self._params).detach().clone()
        if subspace is not None:
            tensors = [[(subspace.dim, 1)]]
            subspace_blocks = list(getattr(subspace, "block_sizes", None) or [])
        else:
            tensors = [[(p.numel(), p.dim()) for p in group["params"]] for group in self.param_groups]
            subspace_blocks = None
        blocks = make_blocks(blocks, tensors, subspace_blocks)
        if block_dim is None:
            dims = frame_dims([index.numel() for index in blocks], partial(vertex_count, self.polytope), self.max_evaluations)
        else:
            dims = [min(index.numel(), block_dim) for index in blocks]
        self.probes = Probes(blocks, dims, self.polytope, self._generator)
        group_of = [g for g, tensors_g in enumerate(tensors) for _ in range(sum(n for n, _ in tensors_g))]
        self._block_group = [group_of[int(index[0])] for index in blocks]
        self.momentum_state = Momentum(dims)
        self.scale = ProbeScale()
        self._trust_radius = self.trust.initial if self.trust else MAX_MODEL_STEP
        self._model: BlockModels | None = None
        self._pending = torch.zeros(sum(d.numel() for d in blocks), dtype=torch.float64)  # displacement since the model's point
        self._record: ProbeRecord | None = None
        self._objective: Objective | None = None
        self._step_count = 0
        self.evaluations = 0.0  # full-fidelity equivalents: what a budget charges
        self.candidates_scored = 0
        self.last_info: dict[str, Any] = {}

    @staticmethod
    def _check_group(group: dict) -> None:
        """Group settings may change between steps (schedulers, users): checked before every step."""
        check.real("lr", group["lr"], low=0.0, low_open=False)
        check.positive("radius", group["radius"])
        check.real("momentum", group["momentum"], low=0.0, low_open=False, high=1.0, high_open=True)

    # ------------------------------------------------------------------ views
    @property
    def blocks(self) -> list[torch.Tensor]:
        return self.probes.blocks

    @property
    def dims(self) -> list[int]:
        return self.probes.dims

    @property
    def incumbent(self) -> torch.Tensor:
        return self._x.clone()

    def _per_block(self, key: str) -> list[float]:
        return [float(self.param_groups[g][key]) for g in self._block_group]

    # ---------------------------------------------------------------- objective
    def register_evaluator(self, evaluator, inputs, targets) -> None:
        """Score candidates with ``evaluator.evaluate_batch(batch, inputs, targets)`` until replaced."""
        self._objective = EvaluatorObjective(evaluator, inputs, targets)

    def unregister_evaluator(self) -> None:
        self._objective = None

    def resync_from_model(self) -> None:
        """Adopt the parameters as they are now (after external changes); forget stale comparisons."""
        self._x = parameters_to_vector(self._params).detach().clone()
        self._model = None
        self._record = None
        self._pending.zero_()

    def _objective_for(self, closure) -> Objective:
        if self._objective is not None:
            return self._objective
        if closure is None:
            raise ValueError("step needs a closure(candidates) or a registered evaluator")
        return ClosureObjective(closure)

    # --------------------------------------------------------------- scoring
    def _score(self, objective: Objective, groups: list[CandidateGroup], subset: torch.Tensor | None = None,
               base: torch.Tensor | None = None) -> torch.Tensor:
        """Losses of all groups' candidates around ``base`` (default: x) in order, one CandidateBatch per chunk, charged."""
        fidelity = 1.0 if subset is None else self.screen.screen_fidelity / self.screen.num_probe
        base = self._x if base is None else base
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

    def _score_point(self, point: torch.Tensor, objective: Objective) -> float:
        # A zero change on one coordinate (not an empty block): the plainest case for any evaluator.
        first = torch.zeros(1, dtype=torch.long)
        group = CandidateGroup(first, point.new_zeros(1, 1), {"incumbent": True})
        loss = float(self._score(objective, [group], base=point)[0])
        if not math.isfinite(loss):
            raise ValueError(f"the objective is not finite at the incumbent ({loss})")
        return loss

    def _probe(self, radii: torch.Tensor, objective: Objective, active: list[int], room: float) -> torch.Tensor:
        """(P, Vmax, K) probe losses, +inf where a block has fewer (or no) probed vertices."""
        groups = self.probes.groups(radii, self._x.dtype, active)
        flat = self._score(objective, groups) if self.screen is None else self._screened(groups, objective, room)
        bad = ~torch.isfinite(flat)
        if bad.all():
            raise ValueError("the objective is not finite at any probe; reduce radii")
        flat = torch.where(bad, flat[~bad].max(), flat)  # a diverging probe is as bad as the worst seen
        self.last_info["nonfinite_probes"] = int(bad.sum())
        return self.probes.unpack(flat, radii.shape[1], active)

    def _screened(self, groups: list[CandidateGroup], objective: Objective, room: float) -> torch.Tensor:
        screen = self.screen
        subset = torch.randperm(screen.num_probe, generator=self._generator)[: screen.screen_fidelity]
        cheap = self._score(objective, groups, subset)
        probs = screen.keep_probabilities(cheap)
        kept = torch.rand(cheap.shape, generator=self._generator, dtype=torch.float64) < probs
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
            full[kept] = self._score(objective, kept_groups)
        self.last_info["screen_kept"] = int(kept.sum())
        return screen.combine(cheap, full, kept, probs)

    # ------------------------------------------------------------- budgeting
    def _room(self, max_evaluations: float | None) -> float:
        room = math.inf if max_evaluations is None else check.real("max_evaluations", max_evaluations, low=0.0, low_open=False)
        if self.max_evaluations is not None:
            room = min(room, self.max_evaluations - self.evaluations)
        return room

    def _incumbent_cost(self, token) -> int:
        if self.radius_model != "quadratic" and self.trust is None:
            return 0
        stale = self.trust is not None and self._model is not None and bool(self._pending.any()) \
            and (token is None or token != self._model.token)
        return 1 + int(stale)

    def _active(self, room: float, radius_count: int) -> list[int] | None:
        """Frame dimension probed per block: all of them, or (last step) what ``room`` pays for; None: nothing fits."""
        unit = radius_count * (1.0 if self.screen is None else self.screen.cost_ratio)
        dims = list(self.dims)
        if unit * self.probes.candidate_count(dims, 1) <= room:
            return dims
        active, spent = [0] * len(dims), 0.0
        order = torch.randperm(len(dims), generator=self._generator).tolist()
        for p in order:
            cost = unit * self.probes.vertex_count(p)
            if spent + cost <= room:
                active[p], spent = dims[p], spent + cost
        if not any(active):  # not even one whole block: the leading axes of one
            p = order[0]
            fits = [d for d in range(1, dims[p] + 1) if unit * self.probes.vertex_count(p, d) <= room]
            if not fits:
                return None
            active[p] = fits[-1]
        return active

    # ------------------------------------------------------------ the step
    def _plan(self, costs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(P, Vmax) plan; blocks outside ``rows`` (not probed) get none."""
        base = self.temperature if self.adaptive_temperature is None else self.adaptive_temperature.value
        epsilon = base * self.temperature_schedule(self._step_count)
        self.last_info["temperature"] = epsilon
        result = self.transport.plan(costs[rows], epsilon)
        self.last_info["transport"] = result.info
        if "sinkhorn_warning" in result.info:
            self.last_info["sinkhorn_warning"] = result.info["sinkhorn_warning"]
        plan = torch.zeros_like(costs)
        plan[rows] = result.plan
        return plan

    def _apply(self, scaled_step: torch.Tensor) -> None:
        step = scaled_step if self.subspace is None else self.subspace.to_flat(scaled_step[None].to(self._x.dtype))[0]
        self._x = self._x + step.to(self._x.dtype)
        self._pending += scaled_step
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)

    def _coast(self) -> None:
        """A momentum-only step between sampled ones: no evaluations."""
        step = torch.zeros_like(self._pending)
        momenta = self._per_block("momentum")
        velocity = self.momentum_state.velocity
        for p, index in enumerate(self.blocks):
            if momenta[p] > 0.0:
                velocity[p] = momenta[p] * velocity[p]
            step[index] = self.probes.bases[p] @ velocity[p]
        self._apply(step)
        self.last_info = {"step": self._step_count, "evaluated": False, "evaluations": self.evaluations}

    def _check_incumbents(self, objective: Objective, token) -> float:
        """Score x (and, with the trust region, the previous incumbent on this objective); undo a bad move."""
        f_x = self._score_point(self._x, objective)
        model = self._model
        if self.trust is None or model is None or not bool(self._pending.any()):
            return f_x
        f_old = model.f_x
        if token is None or token != model.token:
            f_old = self._score_point(model.point, objective)  # same batch for both: a fair comparison
        predicted = model.predicted_change(self._pending, self.blocks)
        rho = self.trust.ratio(f_old - f_x, -predicted)
        accepted, self._trust_radius = self.trust.update(self._trust_radius, rho, self.last_info.get("clipped", False))
        self.last_info.update(rho=rho, accepted=accepted, trust_radius=self._trust_radius)
        if accepted:
            return f_x
        self._x = model.point.clone()
        self._pending.zero_()
        self.momentum_state.reset()
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)
        return f_old

    @torch.no_grad()
    def step(self, closure: Callable[..., torch.Tensor] | None = None, objective_token: Any = None,
             max_evaluations: float | None = None) -> float | None:
        """One optimizer step; returns f(incumbent) when it was scored, else the best probe's mean cost.

        ``objective_token`` names the objective (e.g. the minibatch); pass a new
        one whenever it changes so stale losses are never compared or reused.
        ``max_evaluations`` caps what this step may spend: the probes shrink to
        fit (a random subset of blocks, or fewer axes of one), and a step that
        cannot afford one probe pair scores nothing and returns None.
        """
        for group in self.param_groups:
            self._check_group(group)
        room = self._room(max_evaluations)
        t = self._step_count
        if self.amortize_steps is not None and t % self.amortize_steps != 0:
            self._coast()
            self._step_count += 1
            return None
        objective = self._objective_for(closure)
        incumbent_cost = self._incumbent_cost(objective_token)
        active = self._active(room - incumbent_cost, len(self.radius_ratios))
        if incumbent_cost > room or active is None:
            self.last_info = {"step": t, "evaluated": False, "exhausted": True, "evaluations": self.evaluations}
            return None
        clipped_before = self.last_info.get("clipped", False)
        self.last_info = {"step": t, "evaluated": True, "clipped": clipped_before}
        f_x = self._check_incumbents(objective, objective_token) if incumbent_cost else None
        if self.adaptive_temperature is not None and "rho" in self.last_info:
            self.adaptive_temperature.update(self.last_info["rho"], clipped_before)
        if self.trust is None and self._model is not None and f_x is not None and objective_token is not None \
                and objective_token == self._model.token and f_x > self._model.f_x:
            self.scale.halve()  # without a trust region, a worse incumbent at least stops the radius growing
        record = self._record
        reuse = (self.adaptive_probes and record is not None and objective_token is not None
                 and record.token == objective_token and torch.equal(record.point, self._x))
        if reuse:
            self.probes.bases = list(record.bases)
            radii, losses, active = record.radii, record.losses, record.active
        else:
            momenta = self._per_block("momentum")
            self.momentum_state.carry(self.probes.rotate(self.rotation, carry=any(m > 0.0 for m in momenta)))
            base = torch.tensor(self._per_block("radius"), dtype=torch.float64)
            radii = base[:, None] * self.radius_ratios * (self.scale.value * self.step_schedule(t))
            losses = self._probe(radii, objective, active, room - incumbent_cost)
            self._record = ProbeRecord(self._x.clone(), objective_token, list(self.probes.bases), radii, losses, list(active))
        self.last_info["reused_probes"] = reuse
        probed = torch.tensor([a > 0 for a in active])
        costs = losses.mean(dim=2)
        plan = self._plan(costs, probed)
        directions = barycentric_directions(plan, self.probes.vertices(active))
        grads, curvs = fit_models(losses, radii, f_x, self.polytope, self.probes.frame, self.dims, active)
        mean_radii = radii.mean(dim=1).tolist()
        caps = [self._trust_radius * r for r in mean_radii]
        moves, clipped = move_lengths(directions, self.dims, grads, curvs, self.radius_model == "quadratic",
                                      self._per_block("lr"), mean_radii, caps)
        self._model_point(f_x, objective_token, grads, curvs)
        velocity = self.momentum_state.push([m if a else None for m, a in zip(moves, active)], self._per_block("momentum"))
        step = torch.zeros_like(self._pending)
        for p, index in enumerate(self.blocks):
            if active[p]:
                step[index] = self.probes.bases[p] @ velocity[p]
                self.probes.last_move[p] = step[index]  # indexing with a tensor copies
        self._apply(step)
        self._adapt_radius(moves, losses, mean_radii, active)
        self.last_info.update(clipped=clipped, incumbent_loss=f_x, scale=self.scale.value, evaluations=self.evaluations,
                              step_norm=float(step.norm()), probed_blocks=int(probed.sum()))
        self._step_count += 1
        return f_x if f_x is not None else float(costs[probed].min())

    def _model_point(self, f_x, token, grads, curvs) -> None:
        """Remember the model at x so the next step can judge the move from here."""
        if f_x is None:
            self._model = None
            return
        self._model = BlockModels(self._x.clone(), token, f_x, list(self.probes.bases), grads, curvs)
        self._pending.zero_()

    def _adapt_radius(self, moves, losses: torch.Tensor, mean_radii: list[float], active: list[int]) -> None:
        probed = [p for p, a in enumerate(active) if a]
        if self.radius_model == "quadratic":
            ratios = torch.tensor([float(moves[p].norm()) / mean_radii[p] for p in probed])
            self.scale.follow_moves(float(ratios.mean()))
        if self.adaptive_probes and len(self.radius_ratios) > 1:
            best = int(losses[probed].amin(dim=1).mean(dim=0).argmin())  # radius whose best vertex is best on average
            geometric = float(self.radius_ratios.log().mean().exp())
            self.scale.prefer_radius(float(self.radius_ratios[best]), geometric)
        self.scale.clamp()

    # ------------------------------------------------------------ state
    STATE_KEYS = ("layout", "x", "bases", "velocity", "last_move", "scale", "trust_radius", "potentials", "model", "pending",
                  "record", "step_count", "evaluations", "candidates_scored", "generator", "last_info", "groups", "temperature")

    def _layout(self) -> dict[str, Any]:
        return {"blocks": [int(b.numel()) for b in self.blocks], "dims": list(self.dims), "polytope": self.polytope}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: incumbent, bases, momentum, controllers, RNG, group settings."""
        clone = lambda ts: [t.clone() for t in ts]  # noqa: E731
        record = None
        if self._record is not None:
            r = self._record
            record = {"point": r.point.clone(), "token": r.token, "bases": clone(r.bases), "radii": r.radii.clone(),
                      "losses": r.losses.clone(), "active": list(r.active)}
        potentials = self.transport.potentials
        return {
            "layout": self._layout(),
            "x": self._x.clone(),
            "bases": clone(self.probes.bases),
            "velocity": clone(self.momentum_state.velocity),
            "last_move": clone(self.probes.last_move),
            "scale": self.scale.value,
            "trust_radius": self._trust_radius,
            "potentials": None if potentials is None else clone(potentials),
            "model": None if self._model is None else self._model.state(),
            "pending": self._pending.clone(),
            "record": record,
            "step_count": self._step_count,
            "evaluations": self.evaluations,
            "candidates_scored": self.candidates_scored,
            "generator": self._generator.get_state(),
            "last_info": dict(self.last_info),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "temperature": None if self.adaptive_temperature is None else self.adaptive_temperature.value,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from PolytopeOptimizer.state_dict(), got {type(state_dict).__name__}")
        missing = [key for key in self.STATE_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"state_dict is missing {missing}; it must come from PolytopeOptimizer.state_dict()")
        s = state_dict
        if s["layout"] != self._layout():
            raise ValueError(f"state_dict was saved with layout {s['layout']}, this optimizer has {self._layout()}")
        if len(s["groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(s['groups'])} parameter groups, this optimizer {len(self.param_groups)}")
        self._x = s["x"].clone()
        self.probes.bases = [b.clone() for b in s["bases"]]
        self.momentum_state.velocity = [v.clone() for v in s["velocity"]]
        self.probes.last_move = [m.clone() for m in s["last_move"]]
        self.scale.value, self._trust_radius = s["scale"], s["trust_radius"]
        if self.adaptive_temperature is not None:
            self.adaptive_temperature.value = s["temperature"]
        self.transport.potentials = None if s["potentials"] is None else tuple(t.clone() for t in s["potentials"])
        self._model = BlockModels.from_state(s["model"])
        self._pending = s["pending"].clone()
        r = s["record"]
        self._record = None if r is None else ProbeRecord(r["point"].clone(), r["token"], [b.clone() for b in r["bases"]],
                                                          r["radii"].clone(), r["losses"].clone(), list(r["active"]))
        self._step_count, self.evaluations, self.candidates_scored = s["step_count"], s["evaluations"], s["candidates_scored"]
        self._generator.set_state(s["generator"])
        self.last_info = dict(s["last_info"])
        for group, saved in zip(self.param_groups, s["groups"]):
            group.update(saved)
        with torch.no_grad():
            vector_to_parameters(self._x, self._params)
