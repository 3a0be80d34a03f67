"""Controllers around the core step: trust region, screening, probe scale, temperature.

Each one is a small object with a validated configuration and (where it
keeps any) a state that ``state_dict`` can carry, so the optimizer stays a
readable sequence of "probe, solve, move, control".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class TrustRegion:
    """Accept or reject a move by comparing incumbents on the same objective.

    The ratio rho = actual decrease / model-predicted decrease decides: below
    ``eta`` the move is undone, below ``low`` the allowed step shrinks, above
    ``high`` it grows. Both incumbents are scored on the *current* batch, so a
    minibatch change cannot pass for progress or for failure.
    """

    eta: float = 0.0
    low: float = 0.25
    high: float = 0.75
    shrink: float = 0.5
    grow: float = 2.0
    initial: float = 2.0  # allowed step, in units of the mean probe radius
    minimum: float = 1e-3
    maximum: float = 64.0

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"trust_region needs low <= high, got {self.low} and {self.high}")
        if not 0.0 < self.shrink < 1.0 < self.grow:
            raise ValueError(f"trust_region needs 0 < shrink < 1 < grow, got {self.shrink} and {self.grow}")
        if not 0.0 < self.minimum <= self.initial <= self.maximum:
            raise ValueError("trust_region needs 0 < minimum <= initial <= maximum")

    @classmethod
    def from_option(cls, option: "bool | dict | TrustRegion | None") -> "TrustRegion | None":
        if option is None or option is False:
            return None
        if option is True:
            return cls()
        if isinstance(option, cls):
            return option
        if isinstance(option, dict):
            unknown = set(option) - set(asdict(cls()))
            if unknown:
                raise ValueError(f"trust_region got unknown keys {sorted(unknown)}")
            return cls(**option)
        raise TypeError(f"trust_region must be a bool, a dict of settings or a TrustRegion, got {type(option).__name__}")

    def ratio(self, actual_decrease: float, predicted_decrease: float) -> float:
        if predicted_decrease > 0.0:
            return actual_decrease / predicted_decrease
        return math.inf if actual_decrease > 0.0 else -math.inf

    def update(self, radius: float, rho: float, hit_boundary: bool) -> tuple[bool, float]:
        """(accepted, new allowed step) for a move with ratio ``rho``."""
        if rho < self.low:
            radius *= self.shrink
        elif rho > self.high and hit_boundary:
            radius *= self.grow
        return rho >= self.eta, min(max(radius, self.minimum), self.maximum)


@dataclass
class MultifidelityScreen:
    """Screen every probe on a subsample, then score a random share fully.

    Vertex v is kept with probability p_v (larger for promising screens, mean
    ``screen_keep_ratio``), and its loss is estimated as
    S_v + keep_v / p_v * (F_v - S_v): unbiased for the full-batch loss F_v
    whether or not v was kept, so dropping a vertex never biases the plan.
    """

    screen_fidelity: int
    num_probe: int
    screen_keep_ratio: float
    min_keep_probability: float = 0.05

    def __post_init__(self) -> None:
        for name in ("screen_fidelity", "num_probe"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"multifidelity_screen[{name!r}] must be a positive int, got {value!r}")
        if self.screen_fidelity >= self.num_probe:
            raise ValueError("multifidelity_screen needs screen_fidelity < num_probe (a cheaper screen)")
        if not 0.0 < self.screen_keep_ratio < 1.0:
            raise ValueError(f"multifidelity_screen[{'screen_keep_ratio'!r}] must be in (0, 1), got {self.screen_keep_ratio!r}")
        if not self.cost_ratio < 1.0:
            raise ValueError(
                "multifidelity_screen must save evaluations: screen_fidelity / num_probe + screen_keep_ratio "
                f"= {self.cost_ratio:.3f} is not < 1"
            )
        if not 0.0 < self.min_keep_probability <= self.screen_keep_ratio:
            raise ValueError("multifidelity_screen needs 0 < min_keep_probability <= screen_keep_ratio")

    @classmethod
    def from_option(cls, option: "dict | MultifidelityScreen | None") -> "MultifidelityScreen | None":
        if option is None or isinstance(option, cls):
            return option
        if not isinstance(option, dict):
            raise TypeError(f"multifidelity_screen must be a dict (or MultifidelityScreen) or None, got {type(option).__name__}")
        missing = {"screen_fidelity", "num_probe", "screen_keep_ratio"} - set(option)
        if missing:
            raise ValueError(f"multifidelity_screen is missing {sorted(missing)}")
        unknown = set(option) - {"screen_fidelity", "num_probe", "screen_keep_ratio", "min_keep_probability"}
        if unknown:
            raise ValueError(f"multifidelity_screen got unknown keys {sorted(unknown)}")
        return cls(**option)

    @property
    def cost_ratio(self) -> float:
        return self.screen_fidelity / self.num_probe + self.screen_keep_ratio

    def keep_probabilities(self, screen: torch.Tensor) -> torch.Tensor:
        """Inclusion probabilities with mean keep_ratio, favouring low screened losses."""
        ranks = screen.argsort().argsort().to(torch.float64)
        weight = 1.0 - ranks / max(screen.numel() - 1, 1)  # best 1, worst 0
        budget = self.screen_keep_ratio * screen.numel()
        probs = torch.full_like(weight, self.min_keep_probability)
        spare = budget - probs.sum()
        for _ in range(screen.numel()):  # water-filling: clip at 1 and redistribute
            room = (1.0 - probs).clamp_min(0.0)
            share = weight * (room > 0)
            if spare <= 1e-12 or share.sum() <= 0:
                break
            add = torch.minimum(room, spare * share / share.sum())
            probs = probs + add
            spare = budget - probs.sum()
        return probs

    @staticmethod
    def combine(screen: torch.Tensor, full: torch.Tensor, kept: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Control-variate estimate of every full loss (``full`` only read where kept)."""
        correction = torch.where(kept, (full - screen) / probs, torch.zeros_like(screen))
        return screen + correction


class ProbeScale:
    """The probe-radius multiplier ``s`` that the radius model and adaptive probes steer.

    With the quadratic model it follows the step length (``s *= clip(|move| /
    (s r), 1/2, 2)^(1/2)``, so probes stay at the scale the model moves on);
    adaptive probes lean toward the radius whose best vertex did best; a worse
    incumbent without a trust region halves it.
    """

    minimum, maximum = 1e-6, 1e6

    def __init__(self, value: float = 1.0):
        self.value = value

    def follow_moves(self, ratio: float) -> None:
        self.value *= min(max(ratio, 0.5), 2.0) ** 0.5

    def prefer_radius(self, best: float, geometric_mean: float) -> None:
        self.value *= (best / geometric_mean) ** 0.5

    def halve(self) -> None:
        self.value *= 0.5

    def clamp(self) -> None:
        self.value = min(max(self.value, self.minimum), self.maximum)

    def state_dict(self) -> dict:
        return {"scale": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["scale"]


class AdaptiveTemperature:
    """The transport temperature, steered by how well the last move was predicted.

    Costs reach the solver in units of the probes' mean absolute deviation (the
    observed loss spread), so the temperature is dimensionless. A soft plan
    (high temperature) averages every vertex into a gradient-like direction
    that mixes frame axes, where the block model's per-axis curvature misses the
    cross-axis terms; a sharp plan (low temperature) picks the best vertices,
    whose axis models are exact. So: when the trust region finds a move
    predicted well (rho > ``good_rho``) and inside its bound, the temperature
    grows by ``grow``; otherwise it shrinks by ``shrink``; always within
    [``minimum``, ``maximum``]. Without a trust region it stays put.
    """

    start, minimum, maximum = 2.0, 0.5, 8.0
    grow, shrink, good_rho = 1.1, 0.8, 0.5

    def __init__(self, value: float | None = None):
        self.value = self.start if value is None else value

    def update(self, rho: float, clipped: bool) -> None:
        good = rho > self.good_rho and not clipped
        self.value = min(max(self.value * (self.grow if good else self.shrink), self.minimum), self.maximum)

    def state_dict(self) -> dict:
        return {"temperature": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["temperature"]


class FixedTemperature:
    """A temperature the user set: it never moves and has no state to save."""

    def __init__(self, value: float):
        self.value = value

    def update(self, rho: float, clipped: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"temperature": None}

    def load_state_dict(self, state: dict) -> None:
        pass
