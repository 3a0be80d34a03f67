"""The automatic settings: what a user who passes nothing but a budget and a seed gets.

Measured on the harness tasks (docs/polytope.md, "Defaults"): one block over
all parameters probed along a low-dimensional frame, the quadratic radius
model inside a trust region, the last step as the first frame axis, momentum
0.5, an adaptive temperature (``controllers.AdaptiveTemperature``), and one
probe scale per parameter tensor of a block (``tensor_scales``, steered toward
equal curvature by ``probes.Probes.follow_curvature``). What depends on the
problem is sized here:

- the frame dimension: 8 axes (16 probes and one or two incumbents per step),
  fewer when the budget could not pay for ``MIN_STEPS`` steps of that frame,
  never more than a block's size;
- the first probe radius: ``RADIUS`` (0.05, in parameter units, measured best
  on every task above, whose parameters' spreads run from 0.07 to 1.4), kept
  within [``SPREAD_BOUNDS``] times the parameters' typical initial spread, so a
  model with much smaller or larger weights starts at its own scale (the
  radius model then follows the step lengths).
"""
from __future__ import annotations

import math

import torch

FRAME_DIM = 8
MIN_STEPS = 50
RADIUS = 0.05
SPREAD_BOUNDS = (0.01, 1.0)
INCUMBENTS_PER_STEP = 2  # f(x), and f(previous x) when the objective changed


def frame_dims(block_sizes: list[int], vertex_count, max_evaluations: float | None) -> list[int]:
    """Frame dimension per block: ``FRAME_DIM`` (capped by the block size), lowered until the budget pays
    for ``MIN_STEPS`` steps."""
    dim = FRAME_DIM
    while max_evaluations is not None and dim > 1:
        per_step = sum(vertex_count(min(size, dim)) for size in block_sizes) + INCUMBENTS_PER_STEP
        if max_evaluations / per_step >= MIN_STEPS:
            break
        dim -= 1
    return [min(size, dim) for size in block_sizes]


def _std(param: torch.Tensor) -> float:
    """A tensor's standard deviation; 0 for a single value."""
    return float(param.detach().double().std()) if param.numel() > 1 else 0.0


def tensor_spread(param: torch.Tensor) -> float:
    """A tensor's initial spread: its standard deviation, else its mean magnitude, else 1 (all zeros)."""
    return _std(param) or (float(param.detach().double().abs().mean()) or 1.0)


def spread_vector(params: list[torch.Tensor]) -> torch.Tensor:
    """Per coordinate, its tensor's initial standard deviation (where ``tensor_scales`` start); NaN for a constant
    tensor (zeros, ones) or a single value, which has no spread of its own to start from."""
    return torch.cat([torch.full((p.numel(),), _std(p) or math.nan, dtype=torch.float64) for p in params])


def initial_radius(params: list[torch.Tensor]) -> float:
    """``RADIUS``, clamped to ``SPREAD_BOUNDS`` times the RMS over coordinates of each tensor's initial spread."""
    total = sum(p.numel() for p in params)
    spread = (sum(tensor_spread(p) ** 2 * p.numel() for p in params) / total) ** 0.5
    low, high = SPREAD_BOUNDS
    return min(max(RADIUS, low * spread), high * spread)
