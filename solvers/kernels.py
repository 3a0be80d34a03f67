"""Kernel functions evaluated one tile at a time.

A kernel is anything that turns a block of rows ``x (n, d)`` and a block of
columns ``y (m, d)`` into the ``(n, m)`` tile ``k(x_i, y_j)`` with differentiable
torch operations. That is the whole contract the sources and the implicit
gradients rely on, so a plain callable ``f(x, y) -> (n, m)`` -- for instance a
tile function produced by ``lazytensor`` -- is a kernel too (see :func:`as_kernel`).

The radial kernels below also offer ``tile_into``: the same tile written into
a reused buffer with in-place operations, which is what the streamed products
use when no gradient is needed (allocating a fresh tile per block dominated
naive chunked products).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

__all__ = ["Kernel", "RBF", "Laplacian", "Matern", "CallableKernel", "as_kernel", "squared_distances"]


def squared_distances(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None,
                      x_sq: torch.Tensor | None = None, y_sq: torch.Tensor | None = None) -> torch.Tensor:
    """|x_i - y_j|^2 by the norm expansion (one GEMM), clamped at 0 against cancellation.

    With ``out`` the result is written in place (no autograd); the squared norms
    may be passed in when the caller reuses them across tiles.
    """
    x_sq = x.square().sum(-1) if x_sq is None else x_sq
    y_sq = y.square().sum(-1) if y_sq is None else y_sq
    if out is None:
        d2 = torch.addmm(y_sq.unsqueeze(0), x, y.T, alpha=-2.0) + x_sq.unsqueeze(1)
        return d2.clamp_min(0.0)
    torch.addmm(y_sq.unsqueeze(0), x, y.T, alpha=-2.0, out=out)
    return out.add_(x_sq.unsqueeze(1)).clamp_min_(0.0)


def _as_parameter(value, name: str) -> torch.Tensor:
    """Kernel hyper-parameters are tensors so that they can require grad."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{name} must be a floating scalar tensor, got shape {tuple(value.shape)} "
                             f"and dtype {value.dtype}")
        tensor = value.reshape(())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        tensor = torch.tensor(float(value), dtype=torch.float64)
    else:
        raise TypeError(f"{name} must be a positive number or a scalar tensor, got {type(value).__name__}")
    if not bool(torch.isfinite(tensor.detach())) or float(tensor.detach()) <= 0:
        raise ValueError(f"{name} must be finite and positive, got {float(tensor.detach())}")
    return tensor


class Kernel:
    """Base class: ``tile(x, y)``, ``diag(x)``, ``parameters()`` and an optional fast ``tile_into``."""

    def tile(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.tile(x, y)

    def diag(self, x: torch.Tensor, block: int = 256) -> torch.Tensor:
        """k(x_i, x_i); the generic fallback takes diagonals of small square tiles."""
        parts = [self.tile(x[i:i + block], x[i:i + block]).diagonal() for i in range(0, x.shape[0], block)]
        return torch.cat(parts) if parts else x.new_zeros(0)

    def parameters(self) -> list[torch.Tensor]:
        """Tensors the kernel depends on; gradients flow to those that require grad."""
        return []

    def prepare(self, y: torch.Tensor):
        """Per-source state reused by every tile against the columns ``y`` (e.g. norms)."""
        return None

    def tile_into(self, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, state=None) -> torch.Tensor:
        """The tile written into ``out`` (no autograd). Default: evaluate and copy."""
        return out.copy_(self.tile(x, y))


class _Radial(Kernel):
    """k(x, y) = profile(|x - y|^2): one GEMM per tile, then an elementwise profile."""

    def __init__(self, gamma):
        self.gamma = _as_parameter(gamma, "gamma")

    def parameters(self) -> list[torch.Tensor]:
        return [self.gamma]

    def _gamma_for(self, ref: torch.Tensor):
        return self.gamma.to(ref.dtype) if self.gamma.requires_grad else float(self.gamma.detach())

    def profile(self, d2: torch.Tensor, gamma) -> torch.Tensor:
        raise NotImplementedError

    def profile_(self, d2: torch.Tensor, gamma: float) -> torch.Tensor:
        """In-place profile for the no-grad fast path (default: out of place, copied)."""
        return d2.copy_(self.profile(d2, gamma))

    def tile(self, x, y):
        return self.profile(squared_distances(x, y), self._gamma_for(x))

    def diag(self, x):
        return self.profile(x.new_zeros(x.shape[0]), self._gamma_for(x))

    def prepare(self, y):
        return y.square().sum(-1)

    def tile_into(self, x, y, out, state=None):
        d2 = squared_distances(x, y, out=out, y_sq=state)
        return self.profile_(d2, float(self.gamma.detach()))

    def __repr__(self):
        return f"{type(self).__name__}(gamma={float(self.gamma):g})"


class RBF(_Radial):
    """Gaussian kernel exp(-gamma |x - y|^2)."""

    def profile(self, d2, gamma):
        return torch.exp(d2 * -gamma)

    def profile_(self, d2, gamma):
        return d2.mul_(-gamma).exp_()


def _safe_distance(d2: torch.Tensor) -> torch.Tensor:
    """sqrt with a finite gradient at 0 (the clamp passes no gradient there)."""
    return d2.clamp_min(torch.finfo(d2.dtype).tiny).sqrt()


class Laplacian(_Radial):
    """exp(-gamma |x - y|_2) (Euclidean; scikit-learn's ``laplacian_kernel`` uses L1)."""

    def profile(self, d2, gamma):
        return torch.exp(_safe_distance(d2) * -gamma)

    def profile_(self, d2, gamma):
        return d2.sqrt_().mul_(-gamma).exp_()


class Matern(_Radial):
    """Matern kernel with smoothness ``nu`` in {0.5, 1.5, 2.5} and length scale 1 / gamma.

    Equals scikit-learn's ``Matern(length_scale=1 / gamma, nu=nu)``.
    """

    _NUS = (0.5, 1.5, 2.5)

    def __init__(self, nu: float = 1.5, gamma=1.0):
        if nu not in self._NUS:
            raise ValueError(f"nu must be one of {self._NUS}, got {nu!r}")
        super().__init__(gamma)
        self.nu = float(nu)

    def profile(self, d2, gamma):
        r = _safe_distance(d2) * (gamma * math.sqrt(2 * self.nu))
        if self.nu == 0.5:
            poly = torch.ones_like(r)
        elif self.nu == 1.5:
            poly = 1 + r
        else:
            poly = 1 + r + r.square() / 3
        return poly * torch.exp(-r)

    def __repr__(self):
        return f"Matern(nu={self.nu}, gamma={float(self.gamma):g})"


class CallableKernel(Kernel):
    """Wraps ``fn(x_rows, y_cols) -> (n, m)``; list the tensors it closes over in ``params``.

    This is the entry point for tile functions generated elsewhere (lazytensor
    formulas): any differentiable tile function works, and gradients with
    respect to ``params`` are computed when they require grad.
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 params: Sequence[torch.Tensor] = ()):
        if not callable(fn):
            raise TypeError(f"kernel must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.params = list(params)

    def tile(self, x, y):
        out = self.fn(x, y)
        if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0], y.shape[0]):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"kernel callable must return an ({x.shape[0]}, {y.shape[0]}) tensor, got {got}")
        return out

    def parameters(self):
        return self.params

    def __repr__(self):
        return f"CallableKernel({getattr(self.fn, '__name__', self.fn)!r})"


def as_kernel(kernel) -> Kernel:
    """A :class:`Kernel` from a kernel object or a plain tile callable."""
    if isinstance(kernel, Kernel):
        return kernel
    if callable(kernel):
        return CallableKernel(kernel)
    raise TypeError(f"kernel must be a solvers.Kernel or a callable f(x, y) -> (n, m) tile, "
                    f"got {type(kernel).__name__}")
