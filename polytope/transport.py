"""Entropic transport from blocks (rows) to polytope vertices (columns).

Each block p must send its mass a_p = 1 / P to vertices; C[p, v] is what that
costs. Three solvers, from cheapest to most coupled:

- ``softmax``: only the row constraint, so each row is softmax(-C / eps) on its
  own. It is the one-sided limit of unbalanced Sinkhorn (column penalty -> 0).
- ``argmin``: the eps -> 0 limit of ``softmax``: all mass on the best vertex.
- ``sinkhorn``: log-domain Sinkhorn with a KL penalty ``relaxation`` on the
  column marginal (None = balanced), warm-started from the last potentials.

Entries with cost +inf (padding for blocks with fewer vertices) get no mass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SOLVERS = ("softmax", "argmin", "sinkhorn")


@dataclass
class TransportResult:
    plan: torch.Tensor  # (P, V) coupling, rows sum to 1 / P
    potentials: tuple[torch.Tensor, torch.Tensor] | None = None
    info: dict = field(default_factory=dict)


def normalize_costs(cost: torch.Tensor) -> torch.Tensor:
    """Costs relative to each row's mean, in units of the mean absolute deviation.

    One global scale keeps blocks comparable (a flat block moves less) while
    making the temperature dimensionless.
    """
    finite = torch.isfinite(cost)
    masked = torch.where(finite, cost, 0.0)
    row_mean = masked.sum(1, keepdim=True) / finite.sum(1, keepdim=True)
    centred = torch.where(finite, cost - row_mean, torch.inf)
    scale = torch.where(finite, centred.abs(), 0.0).sum() / finite.sum()
    return centred / scale.clamp_min(torch.finfo(cost.dtype).tiny)


def softmax_plan(cost: torch.Tensor, epsilon: float) -> TransportResult:
    rows = cost.shape[0]
    return TransportResult(torch.softmax(-cost / epsilon, dim=1) / rows)


def argmin_plan(cost: torch.Tensor) -> TransportResult:
    best = cost == cost.min(dim=1, keepdim=True).values
    plan = best.to(cost.dtype)
    return TransportResult(plan / plan.sum(1, keepdim=True) / cost.shape[0])


def sinkhorn_plan(
    cost: torch.Tensor,
    epsilon: float,
    relaxation: float | None = 1.0,
    warm_start: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_iter: int = 200,
    tol: float = 1e-9,
) -> TransportResult:
    """Log-domain (unbalanced) Sinkhorn; ``info`` says whether it converged."""
    rows, cols = cost.shape
    log_a = torch.full((rows,), -math.log(rows), dtype=cost.dtype)  # exact masses: unequal totals would drift
    valid = torch.isfinite(cost)
    log_b = torch.where(valid.any(0), 0.0, -torch.inf).to(cost.dtype)
    log_b = log_b - torch.logsumexp(log_b, 0)  # uniform over usable vertices
    damping = 1.0 if relaxation is None else relaxation / (relaxation + epsilon)
    f = torch.zeros(rows, dtype=cost.dtype)
    g = torch.zeros(cols, dtype=cost.dtype)
    if warm_start is not None and warm_start[0].shape == f.shape and warm_start[1].shape == g.shape:
        f, g = warm_start[0].to(cost.dtype).clone(), warm_start[1].to(cost.dtype).clone()
    error = float("inf")
    iterations = 0
    for iterations in range(1, max_iter + 1):  # noqa: B007 (reported after the loop)
        f = -epsilon * torch.logsumexp(log_b + (g - cost) / epsilon, dim=1)
        g_new = -damping * epsilon * torch.logsumexp(log_a[:, None] + (f[:, None] - cost) / epsilon, dim=0)
        g_new = torch.where(torch.isfinite(g_new), g_new, 0.0)
        error = float((g_new - g).abs().max()) / epsilon
        g = g_new
        if error < tol:
            break
    log_plan = log_a[:, None] + log_b + (f[:, None] + g - cost) / epsilon
    plan = torch.exp(log_plan)
    plan = plan / plan.sum(1, keepdim=True) / rows  # exact row marginals after the last column update
    info = {"iterations": iterations, "potential_change": error, "converged": error < tol}
    return TransportResult(plan, (f, g), info)


class Transport:
    """The configured solver, with Sinkhorn's potentials kept as the next step's warm start."""

    def __init__(self, solver: str, relaxation: float | None = 1.0, max_iter: int = 200):
        self.solver, self.relaxation, self.max_iter = solver, relaxation, max_iter
        self.potentials: tuple[torch.Tensor, torch.Tensor] | None = None

    def state_dict(self) -> dict:
        return {"potentials": None if self.potentials is None else [t.clone() for t in self.potentials]}

    def load_state_dict(self, state: dict) -> None:
        self.potentials = None if state["potentials"] is None else tuple(t.clone() for t in state["potentials"])

    def plan(self, costs: torch.Tensor, epsilon: float) -> TransportResult:
        """Plan for raw costs (normalized here); Sinkhorn's ``info`` warns when it did not converge."""
        normalized = normalize_costs(costs)
        if self.solver == "softmax":
            return softmax_plan(normalized, epsilon)
        if self.solver == "argmin":
            return argmin_plan(normalized)
        result = sinkhorn_plan(normalized, epsilon, self.relaxation, self.potentials, self.max_iter)
        self.potentials = result.potentials
        if not result.info["converged"]:
            result.info["sinkhorn_warning"] = "Sinkhorn did not converge; the plan's column marginals are approximate"
        return result


def barycentric_directions(plan: torch.Tensor, vertices: torch.Tensor) -> torch.Tensor:
    """Row-normalised plan times vertices: (P, V) x (P, V, d) -> (P, d) points in the unit polytope."""
    weights = plan / plan.sum(1, keepdim=True)
    return torch.einsum("pv,pvd->pd", weights, vertices)
