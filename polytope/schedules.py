"""Schedules: multipliers ``step -> float`` of the probe scale or the temperature, and ``ProbeRadius``,
the view that lets any ``torch.optim.lr_scheduler`` schedule the probe radius."""
from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Callable

import torch

Schedule = Callable[[int], float]


def constant_schedule(step: int) -> float:
    return 1.0


def cosine_schedule(total_steps: int, floor: float = 0.0) -> Schedule:
    """Multiplier decaying from 1 to ``floor`` over ``total_steps`` along a half cosine."""
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")

    def schedule(step: int) -> float:
        progress = min(step / total_steps, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def exponential_schedule(rate: float) -> Schedule:
    """Multiplier ``rate ** step``: a geometric decay (rate < 1) or growth."""
    if not rate > 0.0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    return lambda step: rate**step


def check_schedule(name: str, schedule: Schedule | None) -> Schedule:
    if schedule is None:
        return constant_schedule
    if not callable(schedule):
        raise TypeError(f"{name} must be a callable step -> multiplier or None, got {type(schedule).__name__}")
    return schedule


class _RadiusAlias(MutableMapping):
    """A parameter group seen with ``lr`` meaning the probe ``radius`` (and ``initial_lr`` its start)."""

    ALIASES = {"lr": "radius", "initial_lr": "initial_radius"}

    def __init__(self, group: dict):
        self.group = group

    def _key(self, key):
        return self.ALIASES.get(key, key)

    def __getitem__(self, key):
        return self.group[self._key(key)]

    def __setitem__(self, key, value) -> None:
        self.group[self._key(key)] = value

    def __delitem__(self, key) -> None:
        del self.group[self._key(key)]

    def __iter__(self):
        inverse = {v: k for k, v in self.ALIASES.items()}
        return (inverse.get(key, key) for key in self.group)

    def __len__(self) -> int:
        return len(self.group)


class ProbeRadius(torch.optim.Optimizer):
    """A view of a PolytopeOptimizer whose groups' ``lr`` is the probe radius: hand it to any
    ``torch.optim.lr_scheduler`` to schedule the radius (``StepLR(ProbeRadius(opt), 10, 0.5)``).

    The view never steps itself; schedulers only read and write its ``param_groups``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):  # no super().__init__(): it would rebuild the groups
        if not all("radius" in group for group in getattr(optimizer, "param_groups", [{}])):
            raise TypeError(f"ProbeRadius needs a PolytopeOptimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.defaults, self.state = {}, {}
        self.param_groups = [_RadiusAlias(group) for group in optimizer.param_groups]

    def step(self, closure=None):  # what a scheduler's step-order check wraps; forwards to the optimizer
        return self.optimizer.step(closure)

    @property
    def _opt_called(self) -> bool:  # the scheduler's "optimizer.step() came first" check looks at the real optimizer
        return getattr(self.optimizer, "_step_count", 0) > 0

    @_opt_called.setter
    def _opt_called(self, value) -> None:
        pass
