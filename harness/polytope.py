"""Equal-budget comparison of derivative-free optimizers (and Adam as the gradient reference).

    python -m harness polytope --task teacher-mlp --seeds 0 1 2 3 4 --budget 20000 --output results/teacher.json

Every method sees the same batched objective through a meter that charges each
candidate it scores and stops it at the budget; progress is the best loss of its
recommended point (``baselines``). Tasks are in ``tasks``. Each method picks its
setting from its grid (``baselines.GRIDS``) on a separate seed; this module runs, tunes,
summarizes, plots and merges.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
from typing import Any, Callable

import torch

from . import cli
from .baselines import GRIDS, OPTIONAL_PACKAGES, RUNNERS, BudgetExhausted, Meter
from .method import BenchmarkError, kept_on_interrupt, progress, summarize, write_json
from .tasks import TASK_BUILDERS, TASKS

OPTIMIZERS = ("polytope-defaults", "polytope", "random-search", "spsa", "sep-cma", "polystep", "adam", "ngopt", "snes", "cem")
LABELS = {"polytope-defaults": "polytope (defaults)", "polytope": "polytope (tuned)", "ngopt": "NGOpt", "snes": "SNES",
          "cem": "CEM", "sep-cma": "sep-CMA-ES"}
PACKAGES = {**OPTIONAL_PACKAGES, "polytope-defaults": "polytope", "polytope": "polytope"}


def run_one(task_name: str, method: str, seed: int, config: dict, budget: int, wall: float | None) -> dict[str, Any]:
    """One charged run; its record holds the best-so-far curve and the final value."""
    task = TASK_BUILDERS[task_name](seed)
    importlib.import_module(PACKAGES.get(method, "torch"))  # before the timer starts: no run pays an import
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
            started: Callable[[str], None] = lambda label: None, settings: dict[str, dict] | None = None) -> dict[str, Any]:
    """Tune and run each method (a method in ``settings`` runs that setting untuned); ``out`` is filled as runs finish
    (Ctrl-C keeps them), ``started`` hears of each run."""
    out = {} if out is None else out
    settings = settings or {}
    for method in methods:
        grid = GRIDS[method]
        tuning = []
        if method in settings:
            chosen = settings[method]
        elif tune_seed is not None and len(grid) > 1:
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
                               seconds=summarize([r["seconds"] for r in runs]),
                               seconds_per_1000=summarize([1000 * r["seconds"] / max(r["evaluations"], 1) for r in runs]))
        log(f"{task_name:12s} {method:14s} median {out[method]['summary']['median']:.4g}  config {chosen}")
    return out


def plot(record: dict[str, Any], path: str) -> None:
    """Best-so-far vs evaluations and vs seconds: median over seeds, min to max shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = {name: record["tasks"][name] for name in TASKS if name in record["tasks"]}
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.2 * len(tasks)), squeeze=False)
    for row, (task_name, methods) in enumerate(tasks.items()):
        for col, axis_name in enumerate(("evaluations", "seconds")):
            ax = axes[row, col]
            for method in (m for m in OPTIMIZERS if m in methods):  # one colour per method in every panel
                data = methods[method]
                curves = [r["curve"] for r in data["runs"] if r["curve"]["best"]]
                if not curves:
                    continue
                end = max(c[axis_name][-1] for c in curves) or 1.0
                grid = np.linspace(0.0, end, 200)
                values = np.array([np.interp(grid, c[axis_name], c["best"]) for c in curves])
                colour = f"C{OPTIMIZERS.index(method)}"
                ax.plot(grid, np.median(values, axis=0), label=LABELS.get(method, method), color=colour)
                ax.fill_between(grid, values.min(axis=0), values.max(axis=0), alpha=0.2, color=colour)
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
    unknown = [method for method, _ in args.setting or [] if method not in args.optimizers]
    if unknown:
        raise cli.UsageError("--setting", f"{', '.join(unknown)} is not among --optimizers")
    if len(set(args.seeds)) != len(args.seeds):
        raise cli.UsageError("--seeds", f"each seed once, got {' '.join(map(str, args.seeds))}")
    if not args.no_tune and args.tune_seed in args.seeds:
        raise cli.UsageError("--tune-seed", f"{args.tune_seed} is also in --seeds; tuning must use a seed kept apart")


def _settings(pairs: list[list[str]]) -> dict[str, dict]:
    """``--setting METHOD JSON`` pairs -> {method: setting}."""
    out = {}
    for method, text in pairs:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise cli.UsageError("--setting", f"{method}: {text!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise cli.UsageError("--setting", f"{method}: expected a JSON object of options, got {text!r}")
        out[method] = value
    return out


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
    settings = _settings(args.setting or [])
    record: dict[str, Any] = {"command": "polytope", "budget": args.budget, "wall": args.wall, "seeds": args.seeds,
                              "tune_seed": tune_seed, "threads": args.threads,
                              "grids": {m: GRIDS[m] for m in methods}, "tasks": {}}
    tuned = {m for m in methods if tune_seed is not None and len(GRIDS[m]) > 1 and m not in settings}
    per_method = {m: len(args.seeds) + len(GRIDS[m]) * (m in tuned) for m in methods}
    with kept_on_interrupt(record, args.output, lambda: report(record, args, console)), progress() as bar:
        task = bar.add_task("", total=len(args.task) * sum(per_method.values()))
        runs_started = itertools.count()

        def started(label: str) -> None:  # the runs started before this one have finished
            bar.update(task, description=label, completed=next(runs_started))

        for task_name in args.task:
            compare(task_name, methods, args.seeds, args.budget, args.wall, tune_seed, console.print,
                    out=record["tasks"].setdefault(task_name, {}), started=started, settings=settings)
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

    table = Table(title=f"best loss at the evaluation budget {record['budget']}: median (min-max) over seeds {record['seeds']}")
    for column in ("task", "method", "median", "min-max", "median seconds", "s / 1000 evaluations", "setting"):
        table.add_column(column)
    for task_name, methods_out in record["tasks"].items():
        for method, data in methods_out.items():
            s = data["summary"]
            per_1000 = data.get("seconds_per_1000", {}).get("median", math.nan)
            table.add_row(task_name, LABELS.get(method, method), f"{s['median']:.3g}", f"{s['min']:.3g}-{s['max']:.3g}",
                          f"{data['seconds']['median']:.2f}", f"{per_1000:.3f}", str(data["chosen"]))
    console.print(table)
    if args.markdown:
        console.print(markdown(record), markup=False, highlight=False, soft_wrap=True)
    write_json(args.output, record)
    if args.output is not None:
        plot(record, args.plot or str(args.output).rsplit(".", 1)[0] + ".png")


def markdown(record: dict[str, Any], reference: str = "polytope-defaults") -> str:
    """The docs' tables: median (min-max) of the best loss, then seconds per 1000 evaluations, one row per task;
    last, on how many tasks ``reference`` has the lower median than each other method, and its worst relative loss."""
    tasks = {name: record["tasks"][name] for name in TASKS if name in record["tasks"]}
    seen = {m for methods in tasks.values() for m in methods}
    methods = [reference] * (reference in seen) + [m for m in OPTIMIZERS if m in seen and m != reference]
    budgets = record["budget"] if isinstance(record["budget"], dict) else dict.fromkeys(tasks, record["budget"])
    head = "| task (parameters, budget) | " + " | ".join(LABELS.get(m, m) for m in methods) + " |"
    rule = "| --- " * (len(methods) + 1) + "|"
    loss, speed = [head, rule], [head, rule]
    for task_name, data in tasks.items():
        best = min(data[m]["summary"]["median"] for m in data)
        size = TASK_BUILDERS[task_name](0).x0.numel()
        cells, times = [], []
        for m in methods:
            s = data.get(m, {}).get("summary")
            cell = "" if s is None else f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})"
            cells.append(f"**{cell}**" if s is not None and s["median"] == best else cell)
            times.append(f"{data[m]['seconds_per_1000']['median']:.3g}" if m in data else "")
        label = f"{task_name} ({size:,}, {budgets[task_name]:,})"
        loss.append(f"| {label} | " + " | ".join(cells) + " |")
        speed.append(f"| {label} | " + " | ".join(times) + " |")
    verdicts = []
    for m in methods:
        if m == reference:
            continue
        pairs = [(d[reference]["summary"]["median"], d[m]["summary"]["median"])
                 for d in tasks.values() if reference in d and m in d]
        wins = sum(ours < theirs for ours, theirs in pairs)
        worst = max(((ours - theirs) / theirs for ours, theirs in pairs if ours > theirs and theirs > 0), default=0.0)
        verdicts.append(f"- against {LABELS.get(m, m)}: lower median on {wins} of {len(pairs)} tasks"
                        + (f", worst loss {100 * worst:.0f}% above its median" if worst else ""))
    return "\n".join(["Best loss: median (min-max) over seeds", "", *loss, "", "Seconds per 1000 evaluations (median over seeds)",
                      "", *speed, "", *verdicts])


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
    parser.add_argument("--setting", nargs=2, action="append", type=str, metavar=("METHOD", "JSON"), default=None,
                        help="run METHOD with this setting (a JSON object, e.g. what an earlier run's tuning chose) "
                             "instead of tuning it; repeatable")
    parser.add_argument("--threads", type=cli.positive_int, default=1)
    parser.add_argument("--output", type=cli.output_path, default=None, help="JSON record; a PNG plot is written beside it")
    parser.add_argument("--plot", type=cli.output_path, default=None, help="PNG path (default: the output path with .png)")
    parser.add_argument("--merge", nargs="+", type=cli.json_record, default=None, metavar="FILE",
                        help="combine these JSON records instead of running")
    parser.add_argument("--markdown", action="store_true", help="also print the docs' Markdown tables")
    parser.set_defaults(func=run)

