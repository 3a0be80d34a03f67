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
closure and a registered evaluator both become, and charged by one ``Scorer``
(``scoring``). The keywords are validated once, into a frozen ``PolytopeConfig``
(``config``); each component saves its own state. The defaults are the measured
best configuration; what they size from the problem is in ``defaults``.
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable, Sequence

import torch

from . import validation as check
from .candidates import Subspace
from .config import EvaluatorOptions, PolytopeConfig
from .controllers import AdaptiveTemperature, FixedTemperature, ProbeScale
from .defaults import frame_dims, initial_radius, spread_vector
from .geometry import vertex_count
from .moves import BlockModels, Momentum, fit_models, move_lengths
from .objective import ClosureObjective, EvaluatorObjective, Objective
from .probes import ProbeRecord, Probes, make_blocks, tensor_segments
from .scoring import Scorer
from .transport import Transport, barycentric_directions

MAX_MODEL_STEP = 4.0  # without a trust region, model steps stop at this many mean probe radii
DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolytopeConfig) if f.init}  # as written, before normalising


def _config(config: PolytopeConfig | None, keywords: dict[str, Any]) -> PolytopeConfig:
    """The keywords as a PolytopeConfig, or ``config`` when given (then every keyword must keep its default)."""
    if config is None:
        return PolytopeConfig(**keywords)
    if not isinstance(config, PolytopeConfig):
        raise TypeError(f"config must be a PolytopeConfig or None, got {type(config).__name__}")
    given = [k for k, v in keywords.items() if not (type(v) is type(DEFAULTS[k]) and v == DEFAULTS[k])]
    if given:
        raise TypeError(f"pass the settings either in config= or as keywords, not both (got config and {sorted(given)})")
    return config


def _flat(params) -> torch.Tensor:
    """The parameters as one new flat vector, in order (whatever their strides)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def _write(x: torch.Tensor, params) -> None:
    """Copy ``x`` into the parameters' own storage: a parameter never aliases the optimizer's state."""
    start = 0
    for p in params:
        p.copy_(x[start : start + p.numel()].view_as(p))
        start += p.numel()


class PolytopeOptimizer(torch.optim.Optimizer):
    """Derivative-free optimizer: see the module docstring and docs/polytope.md.

    Every keyword is a field of ``PolytopeConfig`` (its docstring says how each is
    read; ``compile=True`` turns on the evaluator's compiled paths); pass
    ``config=PolytopeConfig(...)`` to give them all at once instead.
    """

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
        candidate_autocast: torch.dtype | str | None = None,
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
        tensor_scales: bool = True,
        seed: int | None = None,
        max_evaluations: float | None = None,
        *,
        config: PolytopeConfig | None = None,
    ):
        self.config = c = _config(config, {k: v for k, v in locals().items() if k in DEFAULTS})  # the keywords, by name
        radii = c.radii or (None,)
        super().__init__(params, {"lr": c.lr, "radius": radii[0], "momentum": c.momentum})
        for group in self.param_groups:
            if group["radius"] is None:  # automatic: from this group's initial spread
                group["radius"] = initial_radius(group["params"])
            self._check_group(group)
        if c.subspace is not None and len(self.param_groups) > 1:
            raise ValueError("a subspace searches one space: use a single parameter group with subspace=")
        self._params = [p for group in self.param_groups for p in group["params"]]
        self.radius_ratios = torch.tensor([1.0 if r is None else r / radii[0] for r in radii], dtype=torch.float64)
        seed = int(torch.randint(0, 2**62, (1,)).item()) if c.seed is None else c.seed  # None follows torch.manual_seed
        self._generator = torch.Generator().manual_seed(seed)
        self._x = _flat(self._params)
        self.probes, self._block_group = self._make_probes()
        self.momentum_state, self.scale = Momentum(self.dims), ProbeScale()
        self.temperature = AdaptiveTemperature() if c.temperature is None else FixedTemperature(c.temperature)
        self.transport = Transport(c.solver, c.sinkhorn_relaxation, c.sinkhorn_max_iter)
        self.scorer = Scorer(c.chunk_size, c.subspace, c.multifidelity_screen, self._generator)
        self._trust_radius = c.trust_region.initial if c.trust_region else MAX_MODEL_STEP
        self._model: BlockModels | None = None
        self._pending = torch.zeros(sum(d.numel() for d in self.blocks), dtype=torch.float64)  # moved since the model's point
        self._record: ProbeRecord | None = None
        self._objective: Objective | None = None
        self._step_count = 0
        self.last_info: dict[str, Any] = {}

    def _make_probes(self) -> tuple[Probes, list[int]]:
        """The blocks (never across parameter groups), their frame dimensions, and each block's parameter group."""
        c = self.config
        if c.subspace is not None:
            tensors = [[(c.subspace.dim, 1)]]
            subspace_blocks = list(getattr(c.subspace, "block_sizes", None) or [])
        else:
            tensors = [[(p.numel(), p.dim()) for p in group["params"]] for group in self.param_groups]
            subspace_blocks = None
        blocks = make_blocks(c.blocks, tensors, subspace_blocks)
        if c.block_dim is None:
            dims = frame_dims([index.numel() for index in blocks], partial(vertex_count, c.polytope), c.max_evaluations)
        else:
            dims = [min(index.numel(), c.block_dim) for index in blocks]
        group_of = [g for g, tensors_g in enumerate(tensors) for _ in range(sum(n for n, _ in tensors_g))]
        segments = tensor_segments(blocks, [n for tensors_g in tensors for n, _ in tensors_g]) if c.tensor_scales else None
        spread = spread_vector(self._params) if c.tensor_scales and c.subspace is None else None
        return Probes(blocks, dims, c.polytope, self._generator, segments, spread), [group_of[int(index[0])] for index in blocks]

    @staticmethod
    def _check_group(group: dict) -> None:
        """Group settings may change between steps (schedulers, users): checked before every step."""
        for p in group["params"]:
            if not p.is_floating_point():  # a step adds real moves to every parameter
                raise TypeError(f"params must be floating-point tensors, got one of dtype {p.dtype} and shape "
                                f"{tuple(p.shape)}")
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

    @property
    def evaluations(self) -> float:
        """Evaluations charged so far (full-fidelity equivalents): what a budget counts."""
        return self.scorer.evaluations

    @property
    def candidates_scored(self) -> int:
        return self.scorer.candidates_scored

    @property
    def evaluator_options(self) -> EvaluatorOptions:
        """How ``train()`` builds the ``NNCostEvaluator`` for this optimizer."""
        return self.config.evaluator

    def _per_block(self, key: str) -> list[float]:
        return [float(self.param_groups[g][key]) for g in self._block_group]

    # ---------------------------------------------------------------- objective
    def register_evaluator(self, evaluator, inputs, targets) -> None:
        """Score candidates with ``evaluator.evaluate_batch(batch, inputs, targets)`` until replaced; the
        evaluator's model may hold more parameters than the optimizer (those keep their values)."""
        self._objective = EvaluatorObjective(evaluator, inputs, targets, self._params)

    def unregister_evaluator(self) -> None:
        self._objective = None

    def resync_from_model(self) -> None:
        """Adopt the parameters as they are now (after external changes); forget stale comparisons."""
        self._x = _flat(self._params)
        self._model = None
        self._record = None
        self._pending.zero_()

    def _objective_for(self, closure) -> Objective:
        if self._objective is not None:
            return self._objective
        if closure is None:
            raise ValueError("step needs a closure(candidates) or a registered evaluator")
        return ClosureObjective(closure)

    # ------------------------------------------------------------- budgeting
    def _room(self, max_evaluations: float | None) -> float:
        room = math.inf if max_evaluations is None else check.real("max_evaluations", max_evaluations, low=0.0, low_open=False)
        if self.config.max_evaluations is not None:
            room = min(room, self.config.max_evaluations - self.evaluations)
        return room

    def _incumbent_cost(self, token) -> int:
        trust = self.config.trust_region
        if self.config.radius_model != "quadratic" and trust is None:
            return 0
        stale = trust is not None and self._model is not None and bool(self._pending.any()) \
            and (token is None or token != self._model.token)
        return 1 + int(stale)

    def _active(self, room: float) -> list[int] | None:
        """Frame dimension probed per block (see ``Probes.affordable``); None: not one probe pair fits."""
        screen = self.config.multifidelity_screen
        unit = len(self.radius_ratios) * (1.0 if screen is None else screen.cost_ratio)
        return self.probes.affordable(room, unit)

    # ------------------------------------------------------------ the step
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
        if self.config.amortize_steps is not None and t % self.config.amortize_steps != 0:
            self._coast()
            self._step_count += 1
            return None
        objective = self._objective_for(closure)
        incumbent_cost = self._incumbent_cost(objective_token)
        active = self._active(room - incumbent_cost)
        if incumbent_cost > room or active is None:
            self.last_info = {"step": t, "evaluated": False, "exhausted": True, "evaluations": self.evaluations}
            return None
        f_x = self._incumbents(objective, objective_token, incumbent_cost)
        radii, losses, active = self._probes(objective, objective_token, active, room - incumbent_cost)
        costs = losses.mean(dim=2)
        self._move(f_x, objective_token, radii, losses, costs, active)
        self._step_count += 1
        probed = torch.tensor([a > 0 for a in active])
        return f_x if f_x is not None else float(costs[probed].min())

    def _incumbents(self, objective: Objective, token, cost: int) -> float | None:
        """Start the step's record; score the incumbent(s) when they are paid for and steer temperature and scale."""
        clipped_before = self.last_info.get("clipped", False)
        self.last_info = {"step": self._step_count, "evaluated": True, "clipped": clipped_before}
        f_x = self._check_incumbents(objective, token) if cost else None
        if "rho" in self.last_info:
            self.temperature.update(self.last_info["rho"], clipped_before)
        if self.config.trust_region is None and self._model is not None and f_x is not None and token is not None \
                and token == self._model.token and f_x > self._model.f_x:
            self.scale.halve()  # without a trust region, a worse incumbent at least stops the radius growing
        return f_x

    def _check_incumbents(self, objective: Objective, token) -> float:
        """Score x (and, with the trust region, the previous incumbent on this objective); undo a bad move."""
        f_x = self.scorer.point(objective, self._x)
        model, trust = self._model, self.config.trust_region
        if trust is None or model is None or not bool(self._pending.any()):
            return f_x
        f_old = model.f_x
        if token is None or token != model.token:
            f_old = self.scorer.point(objective, model.point)  # same batch for both: a fair comparison
        predicted = model.predicted_change(self._pending, self.blocks)
        rho = trust.ratio(f_old - f_x, -predicted)
        accepted, self._trust_radius = trust.update(self._trust_radius, rho, self.last_info.get("clipped", False))
        self.last_info.update(rho=rho, accepted=accepted, trust_radius=self._trust_radius)
        if accepted:
            return f_x
        self._x = model.point.clone()
        self._pending.zero_()
        self.momentum_state.reset()
        with torch.no_grad():
            _write(self._x, self._params)
        return f_old

    def _probes(self, objective: Objective, token, active: list[int], room: float) -> tuple[torch.Tensor, torch.Tensor, list]:
        """(radii (P, K), losses (P, Vmax, K), active): the last sweep's when it may be reused, else a new sweep."""
        record = self._record
        reuse = (self.config.adaptive_probes and not self.probes.scaled and record is not None and token is not None
                 and record.token == token and torch.equal(record.point, self._x))
        self.last_info["reused_probes"] = reuse
        if reuse:
            self.probes.bases = list(record.bases)
            return record.radii, record.losses, record.active
        momenta = self._per_block("momentum")
        self.momentum_state.carry(self.probes.rotate(self.config.rotation, carry=any(m > 0.0 for m in momenta)))
        base = torch.tensor(self._per_block("radius"), dtype=torch.float64)
        radii = base[:, None] * self.radius_ratios * (self.scale.value * self.config.step_schedule(self._step_count))
        groups = self.probes.groups(radii, self._x.dtype, active)
        flat = self.scorer.probes(objective, groups, self._x, room, self.last_info)
        losses = self.probes.unpack(flat, radii.shape[1], active)
        self._record = ProbeRecord(self._x.clone(), token, list(self.probes.bases), radii, losses, list(active))
        return radii, losses, active

    def _plan(self, costs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(P, Vmax) plan; blocks outside ``rows`` (not probed) get none."""
        epsilon = self.temperature.value * self.config.temperature_schedule(self._step_count)
        self.last_info["temperature"] = epsilon
        result = self.transport.plan(costs[rows], epsilon)
        self.last_info["transport"] = result.info
        if "sinkhorn_warning" in result.info:
            self.last_info["sinkhorn_warning"] = result.info["sinkhorn_warning"]
        plan = torch.zeros_like(costs)
        plan[rows] = result.plan
        return plan

    def _move(self, f_x: float | None, token, radii: torch.Tensor, losses: torch.Tensor, costs: torch.Tensor,
              active: list[int]) -> None:
        """Transport plan -> directions -> model moves -> momentum -> the displacement, applied; then the radius control."""
        probed = torch.tensor([a > 0 for a in active])
        directions = barycentric_directions(self._plan(costs, probed), self.probes.vertices(active))
        c = self.config
        grads, curvs = fit_models(losses, radii, f_x, c.polytope, self.probes.frame, self.dims, active)
        mean_radii = radii.mean(dim=1).tolist()
        caps = [self._trust_radius * r for r in mean_radii]
        moves, clipped = move_lengths(directions, self.dims, grads, curvs, c.radius_model == "quadratic",
                                      self._per_block("lr"), mean_radii, caps)
        self._model_point(f_x, token, grads, curvs)
        velocity = self.momentum_state.push([m if a else None for m, a in zip(moves, active)], self._per_block("momentum"))
        step = torch.zeros_like(self._pending)
        for p, index in enumerate(self.blocks):
            if active[p]:
                step[index] = self.probes.bases[p] @ velocity[p]
                self.probes.last_move[p] = step[index]  # indexing with a tensor copies
        self._apply(step)
        self._adapt_radius(moves, losses, mean_radii, active)
        if curvs and curvs[0] is not None:  # tensor scales follow the probed curvature (no-op without segments)
            for p, a in enumerate(active):
                if a:
                    self.probes.follow_curvature(p, curvs[p][:a])
        self.last_info.update(clipped=clipped, incumbent_loss=f_x, scale=self.scale.value, evaluations=self.evaluations,
                              step_norm=float(step.norm()), probed_blocks=int(probed.sum()))

    def _apply(self, scaled_step: torch.Tensor) -> None:
        """Move by ``D * scaled_step`` (``D`` the probes' tensor scales, if any), through the subspace if there is one."""
        subspace, metric = self.config.subspace, self.probes.metric_vector(scaled_step.numel())
        step = scaled_step if metric is None else metric * scaled_step
        step = step if subspace is None else subspace.to_flat(step[None].to(self._x.dtype))[0]
        self._x = self._x + step.to(self._x.dtype)
        self._pending += scaled_step
        with torch.no_grad():
            _write(self._x, self._params)

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

    def _model_point(self, f_x, token, grads, curvs) -> None:
        """Remember the model at x so the next step can judge the move from here."""
        if f_x is None:
            self._model = None
            return
        self._model = BlockModels(self._x.clone(), token, f_x, list(self.probes.bases), grads, curvs)
        self._pending.zero_()

    def _adapt_radius(self, moves, losses: torch.Tensor, mean_radii: list[float], active: list[int]) -> None:
        probed = [p for p, a in enumerate(active) if a]
        if self.config.radius_model == "quadratic":
            ratios = torch.tensor([float(moves[p].norm()) / mean_radii[p] for p in probed])
            self.scale.follow_moves(float(ratios.mean()))
        if self.config.adaptive_probes and len(self.radius_ratios) > 1:
            best = int(losses[probed].amin(dim=1).mean(dim=0).argmin())  # radius whose best vertex is best on average
            geometric = float(self.radius_ratios.log().mean().exp())
            self.scale.prefer_radius(float(self.radius_ratios[best]), geometric)
        self.scale.clamp()

    # ------------------------------------------------------------ state
    def _components(self) -> tuple:
        """The parts that save their own state (each under its own keys of one flat dict)."""
        return self.probes, self.momentum_state, self.scale, self.temperature, self.transport, self.scorer

    def _layout(self) -> dict[str, Any]:
        return {"blocks": [int(b.numel()) for b in self.blocks], "dims": list(self.dims), "polytope": self.config.polytope}

    def __getstate__(self) -> dict[str, Any]:
        """All of it, not torch.optim's defaults, state and groups alone: a copy (``copy.deepcopy``, pickle,
        ``torch.save`` of the optimizer) steps on as the original would."""
        return dict(self.__dict__)

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing: the polytope's blocks, bases and incumbent are built from the groups then."""
        if "_params" not in self.__dict__:
            return super().add_param_group(param_group)
        raise NotImplementedError("PolytopeOptimizer fixes its parameters at construction (its blocks and incumbent are "
                                  "built from them): build a new optimizer with every group instead of add_param_group")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: incumbent, bases, momentum, controllers, RNG, group settings."""
        state = {
            "layout": self._layout(),
            "x": self._x.clone(),
            "pending": self._pending.clone(),
            "trust_radius": self._trust_radius,
            "model": None if self._model is None else self._model.state(),
            "record": None if self._record is None else self._record.state_dict(),
            "step_count": self._step_count,
            "generator": self._generator.get_state(),
            "last_info": dict(self.last_info),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }
        for part in self._components():
            state.update(part.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` of an optimizer with the same layout (nothing changes unless all of it loads)."""
        s = state_dict
        if not isinstance(s, dict):
            raise TypeError(f"state_dict must be a dict from PolytopeOptimizer.state_dict(), got {type(s).__name__}")
        missing = [key for key in self.state_dict() if key not in s]
        if missing:
            raise KeyError(f"state_dict is missing {missing}; it must come from PolytopeOptimizer.state_dict()")
        if s["layout"] != self._layout():
            raise ValueError(f"state_dict was saved with layout {s['layout']}, this optimizer has {self._layout()}")
        if len(s["groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(s['groups'])} parameter groups, this optimizer {len(self.param_groups)}")
        for part in self._components():
            part.load_state_dict(s)
        self._x, self._pending, self._trust_radius = s["x"].clone(), s["pending"].clone(), s["trust_radius"]
        self._model = BlockModels.from_state(s["model"])
        self._record = ProbeRecord.from_state(s["record"])
        self._step_count = s["step_count"]
        self._generator.set_state(s["generator"])
        self.last_info = dict(s["last_info"])
        for group, saved in zip(self.param_groups, s["groups"]):
            group.update(saved)
        with torch.no_grad():
            _write(self._x, self._params)
