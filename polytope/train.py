"""train(): minibatches, evaluator registration, budget, progress and history around PolytopeOptimizer;
``flat_closure`` (the closure train() uses without an evaluator) and the stall warning."""
from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from . import distributed
from . import validation as check
from .evaluators import NNCostEvaluator
from .evaluators.functional import buffers_restored, call_with
from .optimizer import PolytopeOptimizer
from .param_layout import ParameterLayout

DATA_FORMS = "an (inputs, targets) pair of torch tensors or an iterable (list, DataLoader) of such pairs"
STALL_STEPS = 30  # consecutive evaluated steps without an accepted move before train() warns


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


def _check_batch(batch, where: str) -> tuple[torch.Tensor, Any]:
    """An (inputs, targets) pair with a tensor of inputs and a matching sample count, or a TypeError saying what is expected."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {type(batch).__name__} of length {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise TypeError(f"{where} must be {DATA_FORMS}; got {got}")
    inputs, targets = batch
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            hint = " (convert NumPy arrays with torch.as_tensor)" if type(value).__module__ == "numpy" else ""
            raise TypeError(f"{where}: {name} must be a torch.Tensor{hint}, got {type(value).__name__}; "
                            f"train expects {DATA_FORMS}")
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"{where}: inputs and targets disagree on the sample count: "
                         f"{tuple(inputs.shape)} vs {tuple(targets.shape)}")
    if inputs.shape[0] == 0:
        raise ValueError(f"{where} is empty (0 samples)")
    return inputs, targets


def _is_pair(data) -> bool:
    """A sequence of array-likes (not of batches) is meant as the (inputs, targets) form, whatever its length."""
    return isinstance(data, (tuple, list)) and len(data) > 0 and not any(isinstance(item, (tuple, list)) for item in data)


def _batches(data, batch_size: int | None, generator: torch.Generator) -> tuple[Iterator[tuple[Any, Any]], bool]:
    """An endless stream of checked (inputs, targets) batches, and whether they are all the same batch."""
    if _is_pair(data):
        inputs, targets = _check_batch(data, "data")
        if batch_size is None or batch_size >= inputs.shape[0]:
            return itertools.repeat((inputs, targets)), True

        def shuffled():
            while True:
                order = torch.randperm(inputs.shape[0], generator=generator)
                for start in range(0, inputs.shape[0] - batch_size + 1, batch_size):
                    rows = order[start:start + batch_size]
                    yield inputs[rows], targets[rows]

        return shuffled(), False
    if isinstance(data, (str, bytes, dict, torch.Tensor)) or not isinstance(data, Iterable):
        raise TypeError(f"data must be {DATA_FORMS}; got {type(data).__name__}")
    if batch_size is not None:
        raise ValueError("batch_size applies to an (inputs, targets) pair; an iterable of batches brings its own batches")

    def passes():
        one_shot = iter(data) is data
        while True:
            count = 0
            for batch in data:
                count += 1
                yield _check_batch(batch, f"data batch {count - 1}")
            if count == 0:
                raise ValueError("data is empty: it yielded no batch" + (" (a used-up iterator?)" if one_shot else ""))
            if one_shot:
                return

    return passes(), False


def _check_dtype(model: nn.Module, inputs: torch.Tensor) -> None:
    param = next(model.parameters())
    if inputs.is_floating_point() and inputs.dtype != param.dtype:
        raise TypeError(f"data inputs are {inputs.dtype} but the model's parameters are {param.dtype}; "
                        f"convert one of them (e.g. inputs.to({param.dtype}) or model.to({inputs.dtype}))")


def flat_closure(model: nn.Module, loss_fn: Callable, inputs, targets, shards=None, params=None) -> Callable[..., torch.Tensor]:
    """closure(candidates (C, n), subset=None) -> (C,) losses, one functional forward per candidate
    (this rank's range of them, all-gathered, with ``shards`` from ``distributed.ranks``).

    ``params``: the tensors the candidates' coordinates belong to, in that order (an optimizer's
    parameters: some of the model's, e.g. its trainable ones, or in other groups' order); the
    model's other parameters keep their values. Default: all of ``model.parameters()``.
    """
    layout = ParameterLayout(model)
    index = None if params is None else layout.positions(model, params)

    def closure(candidates: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
        x, y = (inputs, targets) if subset is None else (inputs[subset], targets[subset])
        if index is not None:  # the optimizer's coordinates, placed among the model's
            whole = layout.flatten(model).to(candidates.dtype).repeat(candidates.shape[0], 1)
            whole[:, index.to(candidates.device)] = candidates
            candidates = whole

        def score(start: int, stop: int) -> torch.Tensor:
            losses = []
            with buffers_restored(model):  # as the evaluator: a candidate's forward leaves BatchNorm statistics alone
                for row in candidates[start:stop]:
                    losses.append(loss_fn(call_with(model, layout.views(row), x), y).detach().reshape(-1))
            return torch.cat(losses) if losses else candidates.new_empty(0)

        return distributed.scored(shards, candidates.shape[0], score)

    return closure


class StallMonitor:
    """Counts evaluated steps since the last accepted move (trust region) or new best loss (stationary objective)."""

    def __init__(self, stationary: bool, patience: int = STALL_STEPS):
        self.stationary, self.patience = stationary, patience
        self.best, self.since, self.warned = float("inf"), 0, False

    def update(self, info: dict[str, Any], loss: float) -> str | None:
        if not info.get("evaluated", False):
            return None
        if "accepted" in info:
            progress = bool(info["accepted"])
        elif self.stationary:
            progress = loss < self.best
        else:
            return None  # minibatch losses without a trust region: no honest signal
        self.best = min(self.best, loss)
        self.since = 0 if progress else self.since + 1
        if self.since < self.patience or self.warned:
            return None
        self.warned = True
        return (f"no step was accepted in the last {self.since} steps (probe scale {info.get('scale', float('nan')):.3g}, "
                f"trust radius {info.get('trust_radius', float('nan')):.3g}): the probes may be too small for the "
                "loss's noise or the loss may be flat there; try larger radii, a larger batch_size, or check the objective")


def _check_arguments(model, loss_fn, steps, max_evaluations, seed, batch_size, progress, use_evaluator, callback) -> tuple:
    """train()'s own arguments, each error naming its argument, as (steps, max_evaluations, seed, batch_size)
    (the optimizer's options are checked by PolytopeConfig)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, targets) -> loss, got {type(loss_fn).__name__}")
    if steps is None and max_evaluations is None:
        raise ValueError("train needs steps or max_evaluations (or both)")
    steps = check.integer("steps", steps, optional=True)
    if max_evaluations is not None:
        max_evaluations = check.positive("max_evaluations", max_evaluations)
    seed, batch_size = check.seed(seed), check.integer("batch_size", batch_size, optional=True)
    check.flag("progress", progress)
    check.flag("use_evaluator", use_evaluator)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable (step, optimizer, history) or None, got {type(callback).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError("model has no parameters to train")
    return steps, max_evaluations, seed, batch_size


def _optimizer_for(model: nn.Module, optimizer, options: dict, seed, max_evaluations) -> PolytopeOptimizer:
    """The given optimizer (built on some of this model's parameters, with no options beside it), else a new one
    with ``options`` on the trainable parameters: ``requires_grad=False`` freezes a tensor, as for torch.optim
    (a model with none trainable, as derivative-free users often leave it, trains them all)."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
        return PolytopeOptimizer(params, seed=seed, max_evaluations=max_evaluations, **options)
    if options:
        raise TypeError(f"optimizer options {sorted(options)} given together with an optimizer")
    if not isinstance(optimizer, PolytopeOptimizer):
        raise TypeError(f"optimizer must be a PolytopeOptimizer or None, got {type(optimizer).__name__}")
    ParameterLayout(model).positions(model, optimizer._params)  # an error naming the tensor that is not the model's
    return optimizer


@dataclass
class _Run:
    """One train() call's loop: a step per batch until the step count, the budget or the data ends."""

    model: nn.Module
    loss_fn: Callable
    optimizer: PolytopeOptimizer
    evaluator: NNCostEvaluator | None
    shards: Any
    stationary: bool
    steps: int | None
    max_evaluations: float | None
    callback: Callable | None
    history: History = field(default_factory=History)
    objective: object = field(default_factory=object)  # this call's objectives: another train() on the optimizer reuses nothing

    def loop(self, batches: Iterator, bar, task) -> None:
        optimizer, history = self.optimizer, self.history
        monitor, spent_before, start = StallMonitor(self.stationary), optimizer.evaluations, time.perf_counter()
        for step in itertools.count():
            left = None if self.max_evaluations is None else self.max_evaluations - (optimizer.evaluations - spent_before)
            if (self.steps is not None and step >= self.steps) or (left is not None and left <= 0):
                break
            batch = next(batches, None)
            if batch is None:
                break  # a one-shot iterator ran out
            if step == 0:
                _check_dtype(self.model, batch[0])
            if not self.step(batch, (self.objective, 0 if self.stationary else step), left):
                break  # the budget left cannot pay for one probe pair
            with torch.no_grad():
                loss = float(self.loss_fn(self.model(batch[0]), batch[1]))  # monitoring only: not charged
            spent = optimizer.evaluations - spent_before
            history.loss.append(loss)
            history.evaluations.append(spent)
            history.seconds.append(time.perf_counter() - start)
            history.info.append(dict(optimizer.last_info))
            stalled = monitor.update(optimizer.last_info, loss)
            if stalled:
                warnings.warn(stalled, RuntimeWarning, stacklevel=3)
            bar.update(task, completed=step + 1 if self.steps is not None else min(spent, self.max_evaluations),
                       status=f"loss {loss:.4g} | evals {spent:.0f}")
            if self.callback is not None:
                self.callback(step, optimizer, history)

    def step(self, batch, token: int, left: float | None) -> bool:
        """One optimizer step on ``batch``; False when the budget could not pay for it."""
        inputs, targets = batch
        if self.evaluator is not None:
            self.optimizer.register_evaluator(self.evaluator, inputs, targets)
            self.optimizer.step(objective_token=token, max_evaluations=left)
        else:
            closure = flat_closure(self.model, self.loss_fn, inputs, targets, self.shards, self.optimizer._params)
            self.optimizer.step(closure, objective_token=token, max_evaluations=left)
        return not self.optimizer.last_info.get("exhausted")


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
    group=None,
    **optimizer_options,
) -> History:
    """Optimize ``model`` on ``data`` without gradients; stops at ``steps`` or ``max_evaluations``.

    ``data`` is an (inputs, targets) pair (full batch, or shuffled minibatches
    of ``batch_size``) or an iterable of batches. Every batch gets a new
    objective token, so the trust region and probe reuse stay honest.
    ``max_evaluations`` is a hard cap: the last step shrinks to what is left.
    The evaluator (built with the optimizer's ``evaluator_options``) is
    unregistered however train() ends (an exception or KeyboardInterrupt
    included), so the optimizer stays usable with a closure.

    ``group`` (a ``torch.distributed`` process group): every rank runs train()
    with the same arguments, seed and data; each step's candidates are scored
    in contiguous ranges across the ranks and their losses all-gathered, so
    every rank takes the single-process trajectory (``polytope/distributed.py``).
    """
    steps, max_evaluations, seed, batch_size = _check_arguments(model, loss_fn, steps, max_evaluations, seed, batch_size,
                                                                progress, use_evaluator, callback)
    shards = distributed.ranks(group)
    shuffle_seed = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed  # None follows torch.manual_seed
    batches, stationary = _batches(data, batch_size, torch.Generator().manual_seed(shuffle_seed))
    optimizer = _optimizer_for(model, optimizer, optimizer_options, seed, max_evaluations)
    options = dataclasses.asdict(optimizer.evaluator_options)
    evaluator = NNCostEvaluator(model, loss_fn, group=group, **options) if use_evaluator else None
    run = _Run(model, loss_fn, optimizer, evaluator, shards, stationary, steps, max_evaluations, callback)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    try:
        with Progress(*columns, disable=not progress, transient=False) as bar:
            run.loop(batches, bar, bar.add_task("polytope", total=steps if steps is not None else max_evaluations, status=""))
    finally:
        if evaluator is not None:
            optimizer.unregister_evaluator()
    return run.history
