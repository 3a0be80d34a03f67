"""Equal-budget comparison of derivative-free optimizers (and Adam as the gradient reference).

    python -m harness polytope --task teacher-mlp --seeds 0 1 2 3 4 --budget 20000 --output results/teacher.json

Every method sees the same batched objective through a meter that charges each
candidate it scores (incumbents, screens, rejected steps included) and stops
it at the budget. Progress is judged by scoring each method's recommended point
(incumbent, mean, best so far) outside the budget and outside the timer.
Each method picks its setting from the same-sized grid on a separate seed.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import cli
from .method import BenchmarkError, kept_on_interrupt, progress, summarize, write_json

TASKS = ("rosenbrock", "quadratic", "teacher-mlp", "moons-mlp", "digits-mlp",
         "cancer-mlp", "diabetes-mlp", "digits-cnn", "rosenbrock-50", "quadratic-100")
OPTIMIZERS = ("polytope-defaults", "polytope", "random-search", "spsa", "sep-cma", "polystep", "adam")
LABELS = {"polytope-defaults": "polytope (defaults)", "polytope": "polytope (tuned)"}


# ----------------------------------------------------------------------------- tasks
@dataclass
class Task:
    """A batched objective: (C, n) candidates -> (C,) losses, with a start point and a model view."""

    name: str
    x0: torch.Tensor
    objective: Callable[[torch.Tensor], torch.Tensor]
    model: nn.Module | None = None  # for methods that need an nn.Module (polystep)
    loss_fn: Callable | None = None
    data: tuple[torch.Tensor, torch.Tensor] | None = None


def rosenbrock_task(seed: int, dim: int = 10) -> Task:
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(dim, generator=gen, dtype=torch.float64)

    def objective(x: torch.Tensor) -> torch.Tensor:
        return (100.0 * (x[:, 1:] - x[:, :-1] ** 2) ** 2 + (1.0 - x[:, :-1]) ** 2).sum(1)

    return Task("rosenbrock", x0, objective)


def quadratic_task(seed: int, dim: int = 20, condition: float = 100.0) -> Task:
    """0.5 (x - x*)^T A (x - x*), eigenvalues log-spaced over ``condition``, random eigenbasis."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    eig = torch.logspace(0, math.log10(condition), dim, dtype=torch.float64)
    a = q @ torch.diag(eig) @ q.T
    target = torch.randn(dim, generator=gen, dtype=torch.float64)
    x0 = target + torch.randn(dim, generator=gen, dtype=torch.float64)

    def objective(x: torch.Tensor) -> torch.Tensor:
        d = x - target
        return 0.5 * ((d @ a) * d).sum(1)

    return Task("quadratic", x0, objective)


def batched_mlp_loss(sizes: list[int], inputs: torch.Tensor, targets: torch.Tensor, loss: str) -> Callable:
    """Losses of C flat parameter vectors of an nn.Sequential tanh MLP, all at once (bmm)."""

    def objective(params: torch.Tensor) -> torch.Tensor:
        count, offset, h = params.shape[0], 0, inputs.unsqueeze(0)
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            weight = params[:, offset:offset + fan_in * fan_out].reshape(count, fan_out, fan_in)
            offset += fan_in * fan_out
            bias = params[:, offset:offset + fan_out]
            offset += fan_out
            h = torch.baddbmm(bias.unsqueeze(1), h.expand(count, -1, -1), weight.transpose(1, 2))
            if i < len(sizes) - 2:
                h = torch.tanh(h)
        if loss == "mse":
            return ((h.squeeze(-1) - targets) ** 2).mean(1)
        logp = torch.log_softmax(h, dim=-1)
        return -logp.gather(2, targets.expand(count, -1).unsqueeze(-1)).squeeze(-1).mean(1)

    return objective


def mlp_task(name: str, sizes: list[int], inputs, targets, loss: str, seed: int) -> Task:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers).to(torch.float64)
    x0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    if loss == "mse":
        loss_fn = lambda out, y: nn.functional.mse_loss(out.squeeze(-1), y)  # noqa: E731
    else:
        loss_fn = nn.CrossEntropyLoss()
    return Task(name, x0, batched_mlp_loss(sizes, inputs, targets, loss), model, loss_fn, (inputs, targets))


def teacher_task(seed: int) -> Task:
    """Student 8-16-1 tanh fits a random teacher of the same shape on 512 Gaussian inputs."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    inputs = torch.randn(512, 8, generator=gen, dtype=torch.float64)
    teacher = [torch.randn(16, 8, generator=gen, dtype=torch.float64) / math.sqrt(8),
               torch.randn(16, generator=gen, dtype=torch.float64) * 0.1,
               torch.randn(1, 16, generator=gen, dtype=torch.float64) / math.sqrt(16),
               torch.randn(1, generator=gen, dtype=torch.float64) * 0.1]
    hidden = torch.tanh(inputs @ teacher[0].T + teacher[1])
    outputs = (hidden @ teacher[2].T + teacher[3]).squeeze(-1)
    return mlp_task("teacher-mlp", [8, 16, 1], inputs, outputs, "mse", seed)


def moons_task(seed: int) -> Task:
    from sklearn.datasets import make_moons

    x, y = make_moons(n_samples=512, noise=0.2, random_state=10_000 + seed)
    inputs = torch.tensor(x, dtype=torch.float64)
    inputs = (inputs - inputs.mean(0)) / inputs.std(0)
    return mlp_task("moons-mlp", [2, 16, 16, 2], inputs, torch.tensor(y, dtype=torch.long), "ce", seed)


def digits_task(seed: int) -> Task:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    inputs = torch.tensor(x, dtype=torch.float64)
    inputs = (inputs - inputs.mean(0)) / inputs.std(0).clamp_min(1e-6)
    return mlp_task("digits-mlp", [64, 16, 10], inputs, torch.tensor(y, dtype=torch.long), "ce", seed)


def standardized(x) -> torch.Tensor:
    inputs = torch.tensor(x, dtype=torch.float64)
    return (inputs - inputs.mean(0)) / inputs.std(0).clamp_min(1e-6)


def cancer_task(seed: int) -> Task:
    """30-16-2 tanh MLP on sklearn's breast_cancer (569 samples, standardized), cross-entropy, 530 parameters."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    return mlp_task("cancer-mlp", [30, 16, 2], standardized(x), torch.tensor(y, dtype=torch.long), "ce", seed)


def diabetes_task(seed: int) -> Task:
    """10-32-1 tanh MLP on sklearn's diabetes (442 samples, inputs and target standardized), MSE, 385 parameters."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    return mlp_task("diabetes-mlp", [10, 32, 1], standardized(x), standardized(y[:, None])[:, 0], "mse", seed)


class SmallCNN(nn.Module):
    """Conv 3x3 stride 2 (1 -> 4 channels) - tanh - linear 36 -> 10, on 8x8 images: 410 parameters."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2)
        self.fc = nn.Linear(36, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(images)).flatten(1))


def cnn_task(seed: int) -> Task:
    """SmallCNN on sklearn's digits (1,797 8x8 images, standardized pixels), cross-entropy."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    images = standardized(x).reshape(-1, 1, 8, 8)
    targets = torch.tensor(y, dtype=torch.long)
    torch.manual_seed(seed)
    model = SmallCNN().to(torch.float64)
    x0 = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    patches = nn.functional.unfold(images, 3, stride=2).transpose(0, 1).reshape(9, -1)  # the convolution as one product

    def objective(params: torch.Tensor) -> torch.Tensor:
        count = params.shape[0]
        conv_w, conv_b = params[:, :36].reshape(count, 4, 9), params[:, 36:40]
        fc_w, fc_b = params[:, 40:400].reshape(count, 10, 36), params[:, 400:410]
        conv = (conv_w.reshape(count * 4, 9) @ patches).reshape(count, 4, -1, 9) + conv_b[:, :, None, None]
        hidden = torch.tanh(conv).transpose(1, 2).flatten(2)  # (C, N, channel x position), the module's order
        logits = torch.baddbmm(fc_b.unsqueeze(1), hidden, fc_w.transpose(1, 2))
        logp = torch.log_softmax(logits, dim=-1)
        return -logp.gather(2, targets.expand(count, -1).unsqueeze(-1)).squeeze(-1).mean(1)

    return Task("digits-cnn", x0, objective, model, nn.CrossEntropyLoss(), (images, targets))


TASK_BUILDERS = {"rosenbrock": rosenbrock_task, "quadratic": quadratic_task, "teacher-mlp": teacher_task,
                 "moons-mlp": moons_task, "digits-mlp": digits_task, "cancer-mlp": cancer_task,
                 "diabetes-mlp": diabetes_task, "digits-cnn": cnn_task,
                 "rosenbrock-50": lambda seed: rosenbrock_task(seed, dim=50),
                 "quadratic-100": lambda seed: quadratic_task(seed, dim=100, condition=1e3)}


# ----------------------------------------------------------------------------- the meter
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


# ----------------------------------------------------------------------------- methods
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
        mean = torch.tensor(es.result.xfavorite, dtype=task.x0.dtype)
        best = torch.tensor(es.result.xbest, dtype=task.x0.dtype)
        return best if es.result.fbest < float(task.objective(mean[None])[0]) else mean

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

        def recommended():
            mean = es.mean
            if es.best_solution is not None and es.best_fitness < float(task.objective(mean[None])[0]):
                return es.best_solution
            return mean

        meter.observe(recommended)


RUNNERS = {"polytope-defaults": run_polytope, "polytope": run_polytope, "random-search": run_random_search, "spsa": run_spsa,
           "sep-cma": run_sep_cma,
           "polystep": run_polystep, "adam": run_adam}
OPTIONAL_PACKAGES = {"sep-cma": "cma", "polystep": "polystep"}

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
}


def run_one(task_name: str, method: str, seed: int, config: dict, budget: int, wall: float | None) -> dict[str, Any]:
    """One charged run; its record holds the best-so-far curve and the final value."""
    task = TASK_BUILDERS[task_name](seed)
    meter = Meter(task, budget, wall)
    meter.observe(lambda: task.x0, force=True)
    error = None
    try:
        RUNNERS[method](task, meter, seed, config)
    except BudgetExhausted:
        pass
    except (BenchmarkError, ValueError, RuntimeError, FloatingPointError) as exc:  # a diverged setting
        error = f"{type(exc).__name__}: {exc}"
    final = meter.best
    if meter.curve and meter.curve[-1][0] != meter.evaluations:
        meter.curve.append((meter.evaluations, meter.seconds, final))
    return {"seed": seed, "config": config, "final": final, "evaluations": meter.evaluations, "seconds": meter.seconds,
            "error": error, "curve": {"evaluations": [c[0] for c in meter.curve], "seconds": [c[1] for c in meter.curve],
                                      "best": [c[2] for c in meter.curve]}}


def compare(task_name: str, methods: list[str], seeds: list[int], budget: int, wall: float | None, tune_seed: int | None,
            log: Callable[[str], None], out: dict[str, Any] | None = None,
            started: Callable[[str], None] = lambda label: None) -> dict[str, Any]:
    """Tune and run each method; ``out`` is filled as runs finish (Ctrl-C keeps them), ``started`` hears of each run."""
    out = {} if out is None else out
    for method in methods:
        grid = GRIDS[method]
        tuning = []
        if tune_seed is not None and len(grid) > 1:
            for k, cfg in enumerate(grid):
                started(f"{task_name} {method}: tuning {k + 1}/{len(grid)}")
                tuning.append(run_one(task_name, method, tune_seed, cfg, budget, wall))
            for rec in tuning:
                rec.pop("curve")
            chosen = min(tuning, key=lambda r: r["final"] if math.isfinite(r["final"]) else math.inf)["config"]
        else:
            chosen = grid[0]
        runs: list[dict[str, Any]] = []
        out[method] = {"chosen": chosen, "tuning": tuning, "runs": runs}
        try:
            for seed in seeds:
                started(f"{task_name} {method}: seed {seed}")
                runs.append(run_one(task_name, method, seed, chosen, budget, wall))
        finally:
            out[method].update(summary=summarize([r["final"] for r in runs]),
                               seconds=summarize([r["seconds"] for r in runs]))
        log(f"{task_name:12s} {method:14s} median {out[method]['summary']['median']:.4g}  config {chosen}")
    return out


def plot(record: dict[str, Any], path: str) -> None:
    """Best-so-far vs evaluations and vs seconds: median over seeds with the IQR shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = record["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.2 * len(tasks)), squeeze=False)
    for row, (task_name, methods) in enumerate(tasks.items()):
        for col, axis_name in enumerate(("evaluations", "seconds")):
            ax = axes[row, col]
            for method, data in methods.items():
                curves = [r["curve"] for r in data["runs"] if r["curve"]["best"]]
                if not curves:
                    continue
                end = max(c[axis_name][-1] for c in curves) or 1.0
                grid = np.linspace(0.0, end, 200)
                values = np.array([np.interp(grid, c[axis_name], c["best"]) for c in curves])
                q1, med, q3 = np.percentile(values, [25, 50, 75], axis=0)
                ax.plot(grid, med, label=method)
                ax.fill_between(grid, q1, q3, alpha=0.2)
            ax.set_yscale("log")
            ax.set_xlabel(axis_name)
            ax.set_title(f"{task_name}: best loss vs {axis_name}")
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def _check(args: argparse.Namespace) -> None:
    """Flags that do not go together, named before any run starts."""
    if args.plot is not None and args.output is None:
        raise cli.UsageError("--plot", "needs --output (the plot is drawn beside the JSON record)")
    if args.merge:
        given = [flag for flag, value in (("--task", args.task), ("--budget", args.budget)) if value]
        if given:
            raise cli.UsageError("--merge", f"combines saved records and runs nothing; drop {' and '.join(given)}")
        return
    if not args.task:
        raise cli.UsageError("--task", "required (one or more of " + ", ".join(TASKS) + "), or --merge FILES")
    if args.budget is None:
        raise cli.UsageError("--budget", "required: candidate evaluations per run (an integer >= 1)")
    if len(set(args.seeds)) != len(args.seeds):
        raise cli.UsageError("--seeds", f"each seed once, got {' '.join(map(str, args.seeds))}")
    if not args.no_tune and args.tune_seed in args.seeds:
        raise cli.UsageError("--tune-seed", f"{args.tune_seed} is also in --seeds; tuning must use a seed kept apart")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    _check(args)
    torch.set_num_threads(args.threads)
    console = Console()
    if args.merge:
        return merge(args, console)
    methods = []
    for method in args.optimizers:
        package = OPTIONAL_PACKAGES.get(method)
        if package is not None:
            try:
                __import__(package)
            except ImportError:
                console.print(f"[yellow]skipping {method}: the optional package {package!r} is not installed "
                              "(pip install tp[compare])")
                continue
        methods.append(method)
    if not methods:
        raise cli.UsageError("--optimizers", "none of these can run here (their optional packages are missing)")
    tune_seed = None if args.no_tune else args.tune_seed
    record: dict[str, Any] = {"command": "polytope", "budget": args.budget, "wall": args.wall, "seeds": args.seeds,
                              "tune_seed": tune_seed, "threads": args.threads,
                              "grids": {m: GRIDS[m] for m in methods}, "tasks": {}}
    per_method = {m: len(args.seeds) + (len(GRIDS[m]) if tune_seed is not None and len(GRIDS[m]) > 1 else 0) for m in methods}
    with kept_on_interrupt(record, args.output, lambda: report(record, args, console)), progress() as bar:
        task = bar.add_task("", total=len(args.task) * sum(per_method.values()))
        runs_started = itertools.count()

        def started(label: str) -> None:  # the runs started before this one have finished
            bar.update(task, description=label, completed=next(runs_started))

        for task_name in args.task:
            compare(task_name, methods, args.seeds, args.budget, args.wall, tune_seed, console.print,
                    out=record["tasks"].setdefault(task_name, {}), started=started)
    report(record, args, console)
    return 0


def merge(args: argparse.Namespace, console) -> int:
    """Combine records of separate runs (e.g. one per task and method, run in parallel) into one."""
    record: dict[str, Any] = {}
    for path, part in args.merge:
        if part.get("command") != "polytope" or not all(isinstance(part.get(k), dict) for k in ("tasks", "grids")):
            raise cli.UsageError("--merge", f"{path!r} is not a record written by python -m harness polytope")
        if not record:
            record = {k: v for k, v in part.items() if k not in ("environment", "checksums", "created_unix")}
            record["tasks"], record["grids"], record["budget"] = {}, {}, {}
        record["grids"].update(part["grids"])
        for task_name, methods in part["tasks"].items():
            record["tasks"].setdefault(task_name, {}).update(methods)
            record["budget"][task_name] = part["budget"]
    report(record, args, console)
    return 0


def report(record: dict[str, Any], args: argparse.Namespace, console) -> None:
    """Rich table, JSON and PNG of a finished comparison."""
    from rich.table import Table

    table = Table(title=f"best loss at the evaluation budget {record['budget']}: median and IQR over seeds {record['seeds']}")
    for column in ("task", "method", "median", "IQR", "median seconds", "setting"):
        table.add_column(column)
    for task_name, methods_out in record["tasks"].items():
        for method, data in methods_out.items():
            s = data["summary"]
            table.add_row(task_name, LABELS.get(method, method), f"{s['median']:.3g}", f"{s['iqr']:.2g}",
                          f"{data['seconds']['median']:.2f}", str(data["chosen"]))
    console.print(table)
    write_json(args.output, record)
    if args.output is not None:
        plot(record, args.plot or str(args.output).rsplit(".", 1)[0] + ".png")


def register(subparsers) -> None:
    parser = subparsers.add_parser("polytope", help="equal-budget comparison of derivative-free optimizers",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", nargs="+", choices=TASKS, default=[])
    parser.add_argument("--seeds", nargs="+", type=cli.nonneg_int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--budget", type=cli.positive_int, default=None, help="candidate evaluations per run")
    parser.add_argument("--wall", type=cli.positive_float, default=None,
                        help="seconds per run (a second budget, whichever ends first)")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--tune-seed", type=cli.nonneg_int, default=100,
                        help="seed of the tuning runs (kept apart from --seeds)")
    parser.add_argument("--no-tune", action="store_true", help="use each grid's first setting")
    parser.add_argument("--threads", type=cli.positive_int, default=1)
    parser.add_argument("--output", type=cli.output_path, default=None, help="JSON record; a PNG plot is written beside it")
    parser.add_argument("--plot", type=cli.output_path, default=None, help="PNG path (default: the output path with .png)")
    parser.add_argument("--merge", nargs="+", type=cli.json_record, default=None, metavar="FILE",
                        help="combine these JSON records instead of running")
    parser.set_defaults(func=run)


def main_args_run(argv: list[str]) -> int:
    """``python -m harness`` with ``argv`` (the tests' entry point for this command)."""
    from .__main__ import main

    return main(argv)
