"""The comparison's tasks: batched objectives ((C, n) candidates -> (C,) losses) with a start point.

Analytic functions (Rosenbrock, rotated ill-conditioned quadratics) and small
networks on scikit-learn data sets or a random teacher. Each network task also
carries its ``nn.Module``, loss and data for methods that need a model, and its
batched objective equals the module's loss (tested).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


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


def teacher_task(seed: int, sizes: tuple[int, ...] = (8, 16, 1), name: str = "teacher-mlp") -> Task:
    """A tanh student fits a random teacher of its own shape on 512 Gaussian inputs (MSE): 8-16-1 has 161
    parameters, 24-76-1 (``teacher-2k``) 1,977."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    inputs = torch.randn(512, sizes[0], generator=gen, dtype=torch.float64)
    hidden = inputs
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        weight = torch.randn(fan_out, fan_in, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        bias = torch.randn(fan_out, generator=gen, dtype=torch.float64) * 0.1
        hidden = hidden @ weight.T + bias
        if i < len(sizes) - 2:
            hidden = torch.tanh(hidden)
    return mlp_task(name, list(sizes), inputs, hidden.squeeze(-1), "mse", seed)


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


TASK_BUILDERS: dict[str, Callable[[int], Task]] = {
    "rosenbrock": rosenbrock_task, "quadratic": quadratic_task, "teacher-mlp": teacher_task, "moons-mlp": moons_task,
    "digits-mlp": digits_task, "cancer-mlp": cancer_task, "diabetes-mlp": diabetes_task, "digits-cnn": cnn_task,
    "rosenbrock-50": lambda seed: rosenbrock_task(seed, dim=50),
    "quadratic-100": lambda seed: quadratic_task(seed, dim=100, condition=1e3),
    "teacher-2k": lambda seed: teacher_task(seed, (24, 76, 1), "teacher-2k"),
}
TASKS = tuple(TASK_BUILDERS)
