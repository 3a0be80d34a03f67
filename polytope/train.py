"""train(): minibatches, evaluator registration, progress and history around PolytopeOptimizer."""
from __future__ import annotations

import inspect
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .optimizer import PolytopeOptimizer


@dataclass
class History:
    """Per-step records: loss on the step's batch after the move, cumulative evaluations, seconds."""

    loss: list[float] = field(default_factory=list)
    evaluations: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    info: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, list]:
        return {"loss": self.loss, "evaluations": self.evaluations, "seconds": self.seconds}

    def __len__(self) -> int:
        return len(self.loss)


def _batches(data, batch_size: int | None, generator: torch.Generator) -> Iterable[tuple[Any, Any]]:
    """An endless stream of (inputs, targets) batches."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        inputs, targets = data
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"data inputs and targets disagree on the sample count: {inputs.shape[0]} vs {targets.shape[0]}")
        if batch_size is None or batch_size >= inputs.shape[0]:
            return itertools.repeat((inputs, targets))
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")

        def shuffled():
            while True:
                order = torch.randperm(inputs.shape[0], generator=generator)
                for start in range(0, inputs.shape[0] - batch_size + 1, batch_size):
                    rows = order[start:start + batch_size]
                    yield inputs[rows], targets[rows]

        return shuffled()
    if iter(data) is data:  # a one-shot iterator: use it once
        return data
    if isinstance(data, Iterable):
        return itertools.chain.from_iterable(itertools.repeat(data))
    raise TypeError(f"data must be an (inputs, targets) pair of tensors or an iterable of batches, got {type(data).__name__}")


def _make_evaluator(model: nn.Module, loss_fn: Callable, optimizer: PolytopeOptimizer):
    """NNCostEvaluator when the evaluator module exists, else None (closure fallback)."""
    try:
        from .evaluators import NNCostEvaluator
    except ImportError:
        return None
    accepted = inspect.signature(NNCostEvaluator).parameters
    options = {k: v for k, v in optimizer.evaluator_options.items() if k in accepted}
    evaluator = NNCostEvaluator(model, loss_fn, **options)
    return evaluator if callable(getattr(evaluator, "evaluate_batch", None)) else None


def flat_closure(model: nn.Module, loss_fn: Callable, inputs, targets) -> Callable[..., torch.Tensor]:
    """closure(candidates (C, n), subset=None) -> (C,) losses, one functional forward per candidate."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def closure(candidates: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
        x, y = (inputs, targets) if subset is None else (inputs[subset], targets[subset])
        losses = []
        for row in candidates:
            params = {n: t.view(s) for n, t, s in zip(names, row.split(sizes), shapes)}
            losses.append(loss_fn(torch.func.functional_call(model, params, (x,)), y).detach())
        return torch.stack(losses)

    return closure


def train(
    model: nn.Module,
    loss_fn: Callable,
    data,
    optimizer: PolytopeOptimizer | None = None,
    steps: int | None = None,
    max_evaluations: float | None = None,
    seed: int | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    use_evaluator: bool = True,
    callback: Callable[[int, PolytopeOptimizer, History], None] | None = None,
    **optimizer_options,
) -> History:
    """Optimize ``model`` on ``data`` without gradients; stops at ``steps`` or ``max_evaluations``.

    ``data`` is an (inputs, targets) pair (full batch, or shuffled minibatches
    of ``batch_size``) or an iterable of batches. Every batch gets a new
    objective token, so the trust region and probe reuse stay honest.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if steps is None and max_evaluations is None:
        raise ValueError("train needs steps or max_evaluations (or both)")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if max_evaluations is not None and not max_evaluations > 0:
        raise ValueError(f"max_evaluations must be positive, got {max_evaluations!r}")
    if optimizer is None:
        optimizer = PolytopeOptimizer(model.parameters(), seed=seed, **optimizer_options)
    elif optimizer_options:
        raise TypeError(f"optimizer options {sorted(optimizer_options)} given together with an optimizer")
    generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    evaluator = _make_evaluator(model, loss_fn, optimizer) if use_evaluator else None
    batches = _batches(data, batch_size, generator)
    stationary = isinstance(batches, itertools.repeat)
    history = History()
    start = time.perf_counter()
    total = steps if steps is not None else max_evaluations
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("polytope", total=total, status="")
        for step, (inputs, targets) in enumerate(batches):
            if (steps is not None and step >= steps) or (max_evaluations is not None and optimizer.evaluations >= max_evaluations):
                break
            token = 0 if stationary else step
            if evaluator is not None:
                optimizer.register_evaluator(evaluator, inputs, targets)
                optimizer.step(objective_token=token)
            else:
                optimizer.step(flat_closure(model, loss_fn, inputs, targets), objective_token=token)
            with torch.no_grad():
                loss = float(loss_fn(model(inputs), targets))  # monitoring only: not charged
            history.loss.append(loss)
            history.evaluations.append(optimizer.evaluations)
            history.seconds.append(time.perf_counter() - start)
            history.info.append(dict(optimizer.last_info))
            bar.update(task, completed=step + 1 if steps is not None else min(optimizer.evaluations, total),
                       status=f"loss {loss:.4g} | evals {optimizer.evaluations:.0f}")
            if callback is not None:
                callback(step, optimizer, history)
    if evaluator is not None:
        optimizer.unregister_evaluator()
    return history
