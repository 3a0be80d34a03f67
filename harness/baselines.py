"""The methods of the comparison and the meter they all score through.

Every method sees the same batched objective through a ``Meter`` that charges
each candidate it scores (incumbents, screens, rejected steps included) and
stops it at the budget. Progress is judged by scoring each method's recommended
point (incumbent, mean, best so far) outside the budget and outside the timer.
Methods from optional packages (``pip install tp[compare]``) are listed in
``OPTIONAL_PACKAGES``; the command skips those whose package is missing.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import torch
from torch import nn

from .method import BenchmarkError
from .tasks import Task


class BudgetExhausted(Exception):
    """Raised by the meter when the next charge would exceed the evaluation or time budget."""


class Meter:
    """The batched objective as every method sees it: charged, timed, and watched."""

    def __init__(self, task: Task, budget: int, wall: float | None = None, checkpoints: int = 200):
        self.task, self.budget, self.wall = task, budget, wall
        self.evaluations = 0
        self.best = math.inf
        self.curve: list[tuple[int, float, float]] = []
        self._spacing = max(budget // checkpoints, 1)
        self._next = 0
        self._start = time.perf_counter()
        self._paused = 0.0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def charge(self, count: int) -> None:
        if self.evaluations + count > self.budget or (self.wall is not None and self.seconds > self.wall):
            raise BudgetExhausted
        self.evaluations += count

    def __call__(self, candidates: torch.Tensor) -> torch.Tensor:
        self.charge(candidates.shape[0])
        with torch.no_grad():
            return self.task.objective(candidates.to(self.task.x0.dtype))

    def observe(self, point: Callable[[], torch.Tensor], force: bool = False) -> None:
        """Score the recommended point (uncharged, untimed) at checkpoints."""
        if not force and self.evaluations < self._next:
            return
        paused = time.perf_counter()
        with torch.no_grad():
            value = float(self.task.objective(point().detach().to(self.task.x0.dtype)[None])[0])
        if math.isfinite(value):
            self.best = min(self.best, value)
        self.curve.append((self.evaluations, self.seconds, self.best))
        self._next = self.evaluations + self._spacing
        self._paused += time.perf_counter() - paused


def run_polytope(task: Task, meter: Meter, seed: int, config: dict) -> None:
    from polytope import PolytopeOptimizer

    params = list(task.model.parameters()) if task.model is not None else [nn.Parameter(task.x0.clone())]
    optimizer = PolytopeOptimizer(params, seed=seed, max_evaluations=meter.budget, **config)
    while optimizer.step(meter, objective_token=task.name) is not None or not optimizer.last_info.get("exhausted"):
        meter.observe(lambda: optimizer.incumbent)  # a fixed objective: the same token every step
    meter.observe(lambda: optimizer.incumbent, force=True)


def run_random_search(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """Local random search: Gaussian samples around the best point, move when one is better."""
    gen = torch.Generator().manual_seed(seed)
    best_x = task.x0.clone()
    best_f = float(meter(best_x[None])[0])
    while True:
        samples = best_x + config["sigma"] * torch.randn(config["popsize"], best_x.numel(), generator=gen, dtype=best_x.dtype)
        losses = meter(samples)
        i = int(losses.argmin())
        if float(losses[i]) < best_f:
            best_x, best_f = samples[i].clone(), float(losses[i])
        meter.observe(lambda: best_x)  # noqa: B023 - observe() calls it at once


def run_spsa(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """Two-point SPSA with Gaussian directions (the MeZO estimator) and a fixed learning rate."""
    gen = torch.Generator().manual_seed(seed)
    x = task.x0.clone()
    eps, lr = config["eps"], config["lr"]
    while True:
        z = torch.randn(x.numel(), generator=gen, dtype=x.dtype)
        plus, minus = meter(torch.stack([x + eps * z, x - eps * z]))
        if not (torch.isfinite(plus) and torch.isfinite(minus)):
            raise BenchmarkError("SPSA diverged")
        x = x - lr * float(plus - minus) / (2 * eps) * z
        meter.observe(lambda: x)  # noqa: B023 - observe() calls it at once


def run_sep_cma(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """sep-CMA-ES: the cma package with a diagonal covariance."""
    import cma
    import numpy as np

    options = {"CMA_diagonal": True, "seed": seed + 1, "verbose": -9, "maxfevals": meter.budget, "tolfun": 0, "tolx": 0,
               "tolfunhist": 0, "tolstagnation": 10**9}
    es = cma.CMAEvolutionStrategy(task.x0.numpy(), config["sigma0"], options)

    def recommended():  # of the current strategy (restarts replace es)
        return mean_or_best(task, torch.tensor(es.result.xfavorite), torch.tensor(es.result.xbest), es.result.fbest)

    while True:
        if es.stop():
            es = cma.CMAEvolutionStrategy(es.result.xfavorite, config["sigma0"], options)  # restart from the mean
        points = es.ask()
        losses = meter(torch.as_tensor(np.asarray(points), dtype=task.x0.dtype))
        es.tell(points, losses.tolist())
        meter.observe(recommended)


def run_adam(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """Gradient reference: one charged evaluation per gradient step (its backward is not charged)."""
    x = task.x0.clone().requires_grad_(True)
    adam = torch.optim.Adam([x], lr=config["lr"])
    while True:
        meter.charge(1)
        adam.zero_grad()
        task.objective(x[None])[0].backward()
        adam.step()
        meter.observe(lambda: x)


def run_polystep(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """The published polystep package's ask/tell optimizer (orthoplex around one particle)."""
    from polystep import PolyStepES

    es = PolyStepES(task.x0.numel(), epsilon=config["epsilon"], step_radius=config["step_radius"], x0=task.x0,
                    seed=seed, dtype=task.x0.dtype)
    while True:
        es.tell(meter(es.ask()))

        meter.observe(lambda: mean_or_best(task, es.mean, es.best_solution, es.best_fitness))


def generation_size(dim: int) -> int:
    """CMA-ES's default population, 4 + floor(3 ln n): the generation NGOpt is asked for and CEM samples."""
    return 4 + int(3 * math.log(dim))


def run_ngopt(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """nevergrad's NGOpt (it picks its algorithm from dimension, budget and workers), asked one generation at a time."""
    import nevergrad as ng
    import numpy as np

    parametrization = ng.p.Array(init=task.x0.numpy()).set_mutation(sigma=config["sigma"])
    parametrization.random_state = np.random.RandomState(seed)
    optimizer = ng.optimizers.NGOpt(parametrization=parametrization, budget=meter.budget,
                                    num_workers=generation_size(task.x0.numel()))
    chosen = optimizer
    while hasattr(chosen, "optim"):  # NGOpt wraps the algorithm it picked (CMA here, at every size in the suite)
        chosen = chosen.optim
    # Ask its own generation: nevergrad's CMA breaks (TPA's mean-shift samples) when asks run a generation ahead of tells.
    workers = getattr(chosen, "_popsize", optimizer.num_workers)

    def recommended():
        return torch.as_tensor(optimizer.provide_recommendation().value)

    while True:
        asked = [optimizer.ask() for _ in range(workers)]
        losses = meter(torch.as_tensor(np.stack([candidate.value for candidate in asked])))
        for candidate, loss in zip(asked, losses.tolist()):
            optimizer.tell(candidate, loss if math.isfinite(loss) else math.inf)
        meter.observe(recommended)


def run_evotorch(task: Task, meter: Meter, seed: int, config: dict) -> None:
    """EvoTorch's SNES or CEM on a vectorized problem whose fitness is the meter (every sampled solution charged)."""
    from evotorch import Problem
    from evotorch.algorithms import CEM, SNES

    config = dict(config)
    algorithm = {"snes": SNES, "cem": CEM}[config.pop("algorithm")]
    if algorithm is CEM:
        config.setdefault("popsize", 2 * generation_size(task.x0.numel()))
        config.setdefault("parenthood_ratio", 0.5)
    logging.getLogger("evotorch").setLevel(logging.WARNING)  # not one INFO line per Problem
    torch.manual_seed(seed)  # EvoTorch samples from torch's global generator
    problem = Problem("min", meter, solution_length=task.x0.numel(), dtype=task.x0.dtype, vectorized=True,
                      initial_bounds=(-1.0, 1.0))
    searcher = algorithm(problem, center_init=task.x0, **config)

    def recommended():
        best = searcher.status.get("best")
        return mean_or_best(task, searcher.status["center"], None if best is None else best.values,
                            math.inf if best is None else float(best.evals[0]))

    while True:
        searcher.step()
        meter.observe(recommended)


def mean_or_best(task: Task, mean: torch.Tensor, best: torch.Tensor | None, best_value: float) -> torch.Tensor:
    """A distribution method's recommendation: its mean, or the best sample so far where that scored lower."""
    mean = torch.as_tensor(mean, dtype=task.x0.dtype)
    if best is not None and best_value < float(task.objective(mean[None])[0]):
        return torch.as_tensor(best, dtype=task.x0.dtype)
    return mean


RUNNERS: dict[str, Callable[[Task, Meter, int, dict], None]] = {
    "polytope-defaults": run_polytope, "polytope": run_polytope, "random-search": run_random_search, "spsa": run_spsa,
    "sep-cma": run_sep_cma, "polystep": run_polystep, "adam": run_adam, "ngopt": run_ngopt, "snes": run_evotorch,
    "cem": run_evotorch}
OPTIONAL_PACKAGES = {"sep-cma": "cma", "polystep": "polystep", "ngopt": "nevergrad", "snes": "evotorch", "cem": "evotorch"}

# Six settings per method, chosen on a separate seed. Radii and step sizes are in
# parameter units; MLP tasks start from PyTorch's default initialisation.
GRIDS: dict[str, list[dict[str, Any]]] = {
    "polytope-defaults": [{}],  # nothing but the seed and the budget: what a user who keeps the defaults gets
    "polytope": [
        {"radii": r, "radius_model": "quadratic", "trust_region": True, "rotation": "last_step", "momentum": m,
         "blocks": blocks, "block_dim": d}
        for r, m, blocks, d in ((0.05, 0.8, 16, 2), (0.02, 0.8, 16, 2), (0.2, 0.8, 16, 2),
                                (0.05, 0.5, "all", 8), (0.05, 0.8, "all", 4), (0.05, 0.5, "tensor", 4))
    ],
    "random-search": [{"sigma": s, "popsize": 16} for s in (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)],
    "spsa": [{"lr": lr, "eps": 1e-3} for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)],
    "sep-cma": [{"sigma0": s} for s in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)],
    "polystep": [{"step_radius": r, "epsilon": e} for r in (0.003, 0.03, 0.3) for e in (0.1, 1.0)],
    "adam": [{"lr": lr} for lr in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)],
    # NGOpt (CMA inside, which adapts its step) gets three settings a decade apart: its asks cost 1-3 ms each.
    "ngopt": [{"sigma": s} for s in (0.03, 0.3, 3.0)],
    "snes": [{"algorithm": "snes", "stdev_init": s} for s in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)],
    "cem": [{"algorithm": "cem", "stdev_init": s} for s in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)],
}
