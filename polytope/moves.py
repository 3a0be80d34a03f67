"""The move rule: from a block's transport direction to its displacement.

A block's barycentric point ``b_p`` (inside the unit polytope) sets the
direction ``u = b_p / |b_p|``. Without a radius model the move is
``lr * r * b_p`` (``r`` the block's mean probe radius); with the quadratic model
it is ``lr`` times the minimiser of the block model along ``u``. Every move is
cut at ``cap`` (trust radius x mean probe radius) and enters heavy-ball momentum,
kept per block in frame coordinates and carried over basis rotations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .geometry import curvature_estimate, gradient_estimate

RADIUS_MODELS = (None, "quadratic")


@dataclass
class BlockModels:
    """Per-block gradient and per-axis curvature (frame coordinates) at ``point``, on objective ``token``."""

    point: torch.Tensor
    token: Any
    f_x: float
    bases: list[torch.Tensor]
    grads: list[torch.Tensor]
    curvs: list[torch.Tensor | None]

    def predicted_change(self, displacement: torch.Tensor, blocks: list[torch.Tensor]) -> float:
        """The models' prediction for a (scaled-coordinate) displacement from ``point``.

        Directions outside a block's frame get the block's mean curvature and no slope.
        """
        total = 0.0
        for p, index in enumerate(blocks):
            delta = displacement[index]
            z = self.bases[p].T @ delta
            outside = float((delta - self.bases[p] @ z).square().sum())
            total += float(self.grads[p] @ z) + 0.5 * float(self.curvs[p] @ z**2) + 0.5 * float(self.curvs[p].mean()) * outside
        return total

    def state(self) -> tuple:
        clone = lambda ts: [t.clone() for t in ts]  # noqa: E731
        return (self.point.clone(), self.token, self.f_x, clone(self.bases), clone(self.grads), clone(self.curvs))

    @classmethod
    def from_state(cls, state) -> "BlockModels | None":
        if state is None:
            return None
        point, token, f_x, bases, grads, curvs = state
        return cls(point.clone(), token, f_x, [t.clone() for t in bases], [t.clone() for t in grads], [t.clone() for t in curvs])


def fit_models(losses: torch.Tensor, radii: torch.Tensor, f_x: float | None, polytope: str, frames, dims: list[int],
               active: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per-block gradient and curvature along each frame axis, averaged over radii (zero on unprobed axes).

    ``losses`` is (P, Vmax, K), ``radii`` (P, K). The curvature's mean over axes
    is the tr(H)/d estimate; the orthoplex resolves it per axis,
    ``(L_+i + L_-i - 2 f) / h^2``, which keeps model steps along steep axes short.
    """
    grads, curvs = [], []
    for p, (d, a) in enumerate(zip(dims, active)):
        grad, curv = torch.zeros(d, dtype=torch.float64), None if f_x is None else torch.zeros(d, dtype=torch.float64)
        if a:
            vertices = frames(a)
            block = losses[p, : vertices.shape[0], :].T  # (K, V)
            steps = radii[p].tolist()
            grad[:a] = torch.stack([gradient_estimate(block[k], vertices, r) for k, r in enumerate(steps)]).mean(0)
            if f_x is not None and polytope == "orthoplex":
                pairs = block[:, :a] + block[:, a:] - 2.0 * f_x
                curv[:a] = (pairs / radii[p][:, None] ** 2).mean(0)
            elif f_x is not None:
                curv[:a] = torch.stack([curvature_estimate(block[k], f_x, r) for k, r in enumerate(steps)]).mean()
        grads.append(grad)
        curvs.append(curv)
    return grads, curvs


def move_lengths(directions: torch.Tensor, dims: list[int], grads, curvs, quadratic: bool, lrs: list[float],
                 mean_radii: list[float], caps: list[float]) -> tuple[list[torch.Tensor], bool]:
    """Frame-coordinate moves per block, and whether any was cut by its cap."""
    moves, clipped = [], False
    for p, d in enumerate(dims):
        b = directions[p, :d]
        norm = float(b.norm())
        if norm == 0.0:
            moves.append(torch.zeros_like(b))
            continue
        u = b / norm
        if quadratic:
            slope, curv = float(grads[p] @ u), float(curvs[p] @ u**2)
            length = 0.0 if slope >= 0.0 else (-slope / curv if curv > 0.0 else math.inf)
        else:
            length = mean_radii[p] * norm
        length = lrs[p] * length
        if length > caps[p]:
            length, clipped = caps[p], True
        moves.append(length * u)
    return moves, clipped


class Momentum:
    """Heavy-ball velocity per block, in frame coordinates."""

    def __init__(self, dims: list[int]):
        self.velocity = [torch.zeros(d, dtype=torch.float64) for d in dims]

    def carry(self, maps: list[torch.Tensor] | None) -> None:
        """Follow a basis rotation: ``z -> Q.T @ z`` (orthogonal Procrustes), not a reset."""
        if maps is not None:
            self.velocity = [q.T @ v for q, v in zip(maps, self.velocity)]

    def push(self, moves: list[torch.Tensor | None], momenta: list[float]) -> list[torch.Tensor]:
        """v <- m v + move for blocks that moved (``None``: untouched), returns the velocities."""
        for p, move in enumerate(moves):
            if move is not None:
                self.velocity[p] = momenta[p] * self.velocity[p] + move
        return self.velocity

    def reset(self) -> None:
        self.velocity = [torch.zeros_like(v) for v in self.velocity]

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": [v.clone() for v in self.velocity]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = [v.clone() for v in state["velocity"]]
