"""What every estimator shares: scikit-learn parameter handling, input checks, sources, warnings."""
from __future__ import annotations

import inspect
import warnings

import torch

from .kernels import as_kernel
from .sources import StoredKernel, StreamedKernel

__all__ = ["Estimator", "NotFittedError", "ConvergenceWarning", "SOURCES", "AUTO_DIRECT_MAX_N"]

SOURCES = ("auto", "streamed", "stored", "direct")

# source="auto" picks the direct factorization up to this many training points:
# measured with `python -m harness ml --case ridge` (docs/solvers.md), the direct
# solve stays faster than the preconditioned streamed fit below it, and its
# n x n matrix (<= 128 MiB in float64) is still affordable.
AUTO_DIRECT_MAX_N = 4096


class NotFittedError(ValueError, AttributeError):
    """``predict`` / ``transform`` before ``fit``."""


class ConvergenceWarning(UserWarning):
    """An iterative solve stopped before meeting its tolerance (see ``info_``)."""


class Estimator:
    """Hyper-parameters live in ``__init__`` arguments; learned state in ``attr_`` names."""

    @classmethod
    def _param_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p.name for p in sig.parameters.values() if p.name != "self" and p.kind != p.VAR_KEYWORD]

    def get_params(self, deep: bool = True) -> dict:
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params):
        valid = self._param_names()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"invalid parameter {name!r} for {type(self).__name__}; valid: {valid}")
            setattr(self, name, value)
        return self

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    # -- checks shared by the estimators ----------------------------------
    def _check_common(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number or None, got {value!r}")
        self._kernel = as_kernel(self.kernel)

    def _rtol(self, dtype: torch.dtype) -> float:
        """Default tolerance: tight in float64, what single precision can reach in float32."""
        return self.rtol if self.rtol is not None else (1e-8 if dtype == torch.float64 else 1e-4)

    def _resolve_source(self, n: int) -> str:
        if self.source == "auto":
            return "direct" if n <= AUTO_DIRECT_MAX_N else "streamed"
        return self.source

    def _source(self, kind: str, X: torch.Tensor, Y: torch.Tensor | None = None):
        """The kernel matrix K(X, Y) as a streamed or a stored source."""
        if kind == "streamed":
            return StreamedKernel(self._kernel, X.detach(), None if Y is None else Y.detach(),
                                  chunk_size=self.chunk_size, tile_dtype=getattr(self, "tile_dtype", None))
        with torch.no_grad():
            return StoredKernel(self._kernel.tile(X.detach(), X.detach() if Y is None else Y.detach()))

    def _check_fitted(self, attr: str) -> None:
        if not hasattr(self, attr):
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet: call fit first")

    def _report(self, info, what: str) -> None:
        if not info.converged:
            warnings.warn(f"{type(self).__name__}: {what} did not converge ({info.reason}; "
                          f"{info.iterations} iterations, max residual {float(info.residuals.max()):.3g}); "
                          f"see info_", ConvergenceWarning, stacklevel=3)


def check_points(X, name: str = "X", n_features: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A finite floating (n, d) tensor, or a ValueError/TypeError saying what is wrong."""
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(X).__name__}")
    if not X.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {X.dtype}")
    if X.ndim != 2 or X.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D (n_samples, n_features) tensor, got shape {tuple(X.shape)}")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(f"{name} has {X.shape[1]} features but the estimator was fitted with {n_features}")
    if dtype is not None and X.dtype != dtype:
        raise TypeError(f"{name} has dtype {X.dtype} but the estimator was fitted with {dtype}")
    if not bool(torch.isfinite(X.detach()).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return X


def check_targets(Y, n: int, dtype: torch.dtype, name: str = "Y") -> torch.Tensor:
    """Targets with ``n`` rows, 1-D or 2-D, finite, in the dtype of the inputs."""
    if not isinstance(Y, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(Y).__name__}")
    if Y.ndim not in (1, 2) or Y.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) or ({n}, n_targets) to match X, got {tuple(Y.shape)}")
    if not Y.is_floating_point():
        Y = Y.to(dtype)
    if Y.dtype != dtype:
        raise TypeError(f"{name} has dtype {Y.dtype} but X has {dtype}")
    if not bool(torch.isfinite(Y.detach()).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return Y


def check_positive(value, name: str) -> None:
    number = float(value.detach()) if isinstance(value, torch.Tensor) else value
    if not isinstance(number, (int, float)) or isinstance(number, bool) or not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")


def check_count(value, name: str, upper: int, why: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise ValueError(f"{name} must be an int in [1, {upper}] ({why}), got {value!r}")
    return value
