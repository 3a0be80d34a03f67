"""Validated, frozen settings: ``EvaluatorOptions`` (how candidates are scored, shared by the optimizer, ``train()`` and
``NNCostEvaluator``) and ``PolytopeConfig`` (every ``PolytopeOptimizer`` keyword, checked once).

Each value is checked here and nowhere else, so an option has one rule wherever it is passed; the
error names the option. What a setting means is documented in docs/polytope.md and docs/performance.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import validation as check
from .candidates import Subspace
from .controllers import MultifidelityScreen, TrustRegion
from .geometry import POLYTOPES
from .moves import RADIUS_MODELS
from .probes import ROTATIONS
from .schedules import check_schedule
from .transport import SOLVERS

AUTOCAST = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def autocast_dtype(value: Any) -> torch.dtype | None:
    """``candidate_autocast``: None, torch.bfloat16, torch.float16 or one of their names in ``AUTOCAST``."""
    if value is None:
        return None
    if isinstance(value, str) and value in AUTOCAST:
        return AUTOCAST[value]
    if value in (torch.bfloat16, torch.float16):
        return value
    if not isinstance(value, (str, torch.dtype)):
        raise TypeError(f"candidate_autocast must be None, a torch.dtype or a name, got {type(value).__name__} {value!r}")
    raise ValueError(f"candidate_autocast must be None, torch.bfloat16, torch.float16 or one of {sorted(AUTOCAST)}, "
                     f"got {value!r}")


@dataclass(frozen=True)
class EvaluatorOptions:
    """How an ``NNCostEvaluator`` scores candidates; ``candidate_autocast`` is stored as its dtype."""

    chunk_size: int | None = None
    memory_budget: int | None = None
    use_inplace: bool = False
    reuse: bool = True
    compile_evaluator: bool = False
    compile_forward: bool | None = None
    candidate_autocast: torch.dtype | None = None
    sparse_fraction: float = 0.125

    def __post_init__(self) -> None:
        check.integer("chunk_size", self.chunk_size, optional=True)
        check.integer("memory_budget", self.memory_budget, optional=True)
        for name in ("use_inplace", "reuse", "compile_evaluator"):
            check.flag(name, getattr(self, name))
        check.flag("compile_forward", self.compile_forward, optional=True)
        object.__setattr__(self, "candidate_autocast", autocast_dtype(self.candidate_autocast))
        object.__setattr__(self, "sparse_fraction", check.real("sparse_fraction", self.sparse_fraction, low=0.0, high=1.0))


@dataclass(frozen=True)
class PolytopeConfig:
    """Every ``PolytopeOptimizer`` keyword (same names and defaults), validated and normalised.

    ``radii`` becomes a tuple (None: sized from the parameters), ``trust_region`` and
    ``multifidelity_screen`` their controllers' settings (or None), the schedules callables.
    ``compile=True`` is the switch for everything compiled in a step: it turns on
    ``compile_evaluator`` and (unless given) ``compile_forward`` of the evaluator ``train()``
    builds; the probe geometry and transport are a few small ops per step and stay eager, and a
    user closure is the user's to compile. ``evaluator`` holds the resulting ``EvaluatorOptions``.
    """

    polytope: str = "orthoplex"
    radii: float | Sequence[float] | None = None
    blocks: str | int | Sequence[int] = "all"
    block_dim: int | None = None
    subspace: Subspace | None = None
    chunk_size: int | None = None
    use_inplace: bool = False
    compile: bool = False
    compile_evaluator: bool = False
    compile_forward: bool | None = None
    candidate_autocast: Any = None
    solver: str = "softmax"
    temperature: float | None = None
    sinkhorn_relaxation: float | None = 1.0
    sinkhorn_max_iter: int = 200
    lr: float = 1.0
    momentum: float = 0.5
    step_schedule: Callable[[int], float] | None = None
    temperature_schedule: Callable[[int], float] | None = None
    rotation: str = "last_step"
    radius_model: str | None = "quadratic"
    trust_region: bool | dict | TrustRegion | None = True
    adaptive_probes: bool = False
    amortize_steps: int | None = None
    multifidelity_screen: dict | MultifidelityScreen | None = None
    tensor_scales: bool = True
    seed: int | None = None
    max_evaluations: float | None = None
    evaluator: EvaluatorOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # a normalised value, stored while the frozen instance checks itself
            object.__setattr__(self, name, value)

        if self.radii is not None:
            put("radii", check.positives("radii", self.radii))
        put("lr", check.positive("lr", self.lr))
        put("momentum", check.real("momentum", self.momentum, low=0.0, low_open=False, high=1.0, high_open=True))
        check.choice("polytope", self.polytope, POLYTOPES)
        check.choice("rotation", self.rotation, ROTATIONS)
        check.choice("radius_model", self.radius_model, RADIUS_MODELS)
        check.choice("solver", self.solver, SOLVERS)
        if self.temperature is not None:
            put("temperature", check.positive("temperature", self.temperature))
        if self.sinkhorn_relaxation is not None:
            put("sinkhorn_relaxation", check.positive("sinkhorn_relaxation", self.sinkhorn_relaxation))
        for name in ("sinkhorn_max_iter", "chunk_size", "amortize_steps", "block_dim"):
            check.integer(name, getattr(self, name), optional=name != "sinkhorn_max_iter")
        for name in ("adaptive_probes", "compile", "compile_evaluator", "tensor_scales"):
            check.flag(name, getattr(self, name))
        if self.max_evaluations is not None:
            put("max_evaluations", check.positive("max_evaluations", self.max_evaluations))
        self._check_subspace()
        put("multifidelity_screen", MultifidelityScreen.from_option(self.multifidelity_screen))
        if self.multifidelity_screen is not None and self.radius_model == "quadratic":
            raise ValueError("multifidelity_screen cannot run with radius_model='quadratic' (the default): "
                             "the curvature fit needs exact full-batch differences; pass radius_model=None with a screen")
        put("trust_region", TrustRegion.from_option(self.trust_region))
        put("step_schedule", check_schedule("step_schedule", self.step_schedule))
        put("temperature_schedule", check_schedule("temperature_schedule", self.temperature_schedule))
        put("seed", check.seed(self.seed))
        compile_forward = True if self.compile and self.compile_forward is None else self.compile_forward
        put("evaluator", EvaluatorOptions(use_inplace=self.use_inplace, compile_evaluator=self.compile_evaluator or self.compile,
                                          compile_forward=compile_forward, candidate_autocast=self.candidate_autocast))
        put("candidate_autocast", self.evaluator.candidate_autocast)

    def _check_subspace(self) -> None:
        subspace = self.subspace
        if subspace is not None and not (isinstance(getattr(subspace, "dim", None), int)
                                         and callable(getattr(subspace, "to_flat", None))):
            raise TypeError("subspace must have an int `dim` and a `to_flat(z)` method")
