"""Kernels are lazytensor formulas of two points.

A kernel is a formula factory: called with an i-indexed ``LazyTensor`` ``x``
and a j-indexed ``y`` it returns the formula ``k(x_i, y_j)`` (a LazyTensor of
feature size 1); called with torch tensors ``X`` (n, d) and ``Y`` (m, d,
default ``X``) it returns the dense n x m matrix, as scikit-learn's pairwise
kernels do (:func:`matrix`: identity products of the same formula, so the
dense matrix is the streamed products' twin, differentiable). Every product,
diagonal, column and gradient the sources need is a lazytensor reduction of
that formula, so the kernels below are a few lines each and any user formula
is a kernel too:

    KernelRidge(lambda x, y: (1 + x.sqdist(y)).rsqrt(), alpha=0.1)
    KernelRidge("exp(-0.5 * sqdist(x, y))", alpha=0.1)

Gradients flow to every tensor a formula closes over (``lt.Pm(g)``), with no
list of parameters to keep: lazytensor's reductions differentiate whatever
the formula holds.
"""
from __future__ import annotations

import copy
import inspect
import math
import numbers
from typing import Callable

import torch

import lazytensor as lt

__all__ = ["Kernel", "RBF", "Laplacian", "Matern", "FormulaKernel", "as_kernel", "formula", "matrix"]

# Dense blocks of a kernel (tensor calls, columns, stored and direct matrices) are
# identity products over this many columns at a time, batched: exact, and it costs
# n * m * COLUMN_BLOCK multiply-adds next to the n * m kernel entries.
COLUMN_BLOCK = 32


def _check_gamma(value):
    """A finite positive number, or a positive scalar tensor (which may require grad)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"gamma must be a floating scalar tensor, got shape {tuple(value.shape)} and dtype {value.dtype}")
        number = float(value.detach())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"gamma must be a positive number or a scalar tensor, got {type(value).__name__}")
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"gamma must be finite and positive, got {number}")
    return value


def _dtype(x: lt.LazyTensor) -> torch.dtype:
    return next(iter(x.variables.values())).tensor.dtype


def _scalar(value, like: lt.LazyTensor):
    """A Python number stays a constant (a new value reuses the compiled kernel); a tensor becomes a parameter."""
    if isinstance(value, torch.Tensor):
        return lt.Pm(value.reshape(1).to(_dtype(like)))
    return float(value)


class Kernel:
    """A formula factory: ``kernel(x, y) -> LazyTensor`` for an i-variable ``x`` and a j-variable ``y``;
    ``kernel(X, Y=None) -> (n, m) tensor`` for torch tensors (scikit-learn's pairwise convention).

    Subclasses implement :meth:`expression` (the formula); the call dispatches on the argument types.
    """

    def expression(self, x: lt.LazyTensor, y: lt.LazyTensor) -> lt.LazyTensor:
        raise NotImplementedError

    def __call__(self, x, y=None):
        if isinstance(x, lt.LazyTensor) and isinstance(y, lt.LazyTensor):
            return self.expression(x, y)
        if isinstance(x, torch.Tensor) and (y is None or isinstance(y, torch.Tensor)):
            return matrix(self, x, y)
        raise TypeError(f"{self!r} takes two LazyTensors x_i, y_j (returns the formula k(x_i, y_j)) or torch tensors "
                        f"X (n, d) and Y (m, d), Y defaulting to X (returns the n x m kernel matrix); got "
                        f"{type(x).__name__} and {type(y).__name__}")

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def get_params(self, deep: bool = True) -> dict:
        """The constructor's arguments, scikit-learn's way: a grid search may then tune ``kernel__gamma``."""
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = [name for name, p in inspect.signature(type(self).__init__).parameters.items()
                 if name != "self" and p.kind in kinds]
        return {name: getattr(self, name) for name in names}

    def set_params(self, **params):
        """New constructor arguments, checked as the constructor checks them."""
        current = self.get_params()
        unknown = sorted(set(params) - set(current))
        if unknown:
            raise ValueError(f"invalid parameter {unknown[0]!r} for {type(self).__name__}; valid: {sorted(current)}")
        self.__init__(**{**current, **params})
        return self

    def __sklearn_clone__(self):
        """scikit-learn's ``clone``: the same arguments, tensors shared rather than deep-copied (a tensor
        carries the caller's gradient, and one computed from a parameter cannot be deep-copied)."""
        return type(self)(**{k: v if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in self.get_params().items()})


class _Radial(Kernel):
    """k(x, y) = profile(|x - y|, gamma); lazytensor keeps the exact difference under a square root,
    so K(x, x) is exactly 1 and distances far from the origin keep their float32 accuracy."""

    def __init__(self, gamma=1.0):
        self.gamma = _check_gamma(gamma)

    def profile(self, d2: lt.LazyTensor, gamma) -> lt.LazyTensor:
        raise NotImplementedError

    def expression(self, x, y):
        return self.profile(x.sqdist(y), _scalar(self.gamma, x))


class RBF(_Radial):
    """Gaussian kernel exp(-gamma |x - y|^2) (scikit-learn's ``rbf_kernel``)."""

    def profile(self, d2, gamma):
        return (-gamma * d2).exp()


class Laplacian(_Radial):
    """exp(-gamma |x - y|_2) (Euclidean; scikit-learn's ``laplacian_kernel`` uses L1)."""

    def profile(self, d2, gamma):
        return (-gamma * d2.sqrt()).exp()


class Matern(_Radial):
    """Matern kernel with smoothness ``nu`` in {0.5, 1.5, 2.5} and length scale 1 / gamma.

    Equals scikit-learn's ``Matern(length_scale=1 / gamma, nu=nu)``.
    """

    NUS = (0.5, 1.5, 2.5)

    def __init__(self, nu: float = 1.5, gamma=1.0):
        if nu not in self.NUS:
            raise ValueError(f"nu must be one of {self.NUS}, got {nu!r}")
        super().__init__(gamma)
        self.nu = nu

    def profile(self, d2, gamma):
        r = math.sqrt(2 * self.nu) * gamma * d2.sqrt()
        poly = {0.5: 1.0, 1.5: 1 + r, 2.5: 1 + r + r.square() / 3}[self.nu]
        return poly * (-r).exp()

    def __repr__(self):
        return f"Matern(nu={self.nu}, gamma={self.gamma!r})"


class FormulaKernel(Kernel):
    """A user kernel: a callable ``k(x, y) -> LazyTensor`` or a formula string in ``x`` and ``y``."""

    def __init__(self, fn: Callable | str):
        if not (callable(fn) or isinstance(fn, str)):
            raise TypeError(f"kernel must be a Kernel, a callable k(x, y) -> LazyTensor or a formula string, "
                            f"got {type(fn).__name__}")
        self.fn = fn

    def expression(self, x, y):
        if isinstance(self.fn, str):
            return lt.formula(self.fn, x=x, y=y)
        return self.fn(x, y)

    def __repr__(self):
        return f"FormulaKernel({self.fn!r})"


def as_kernel(kernel) -> Kernel:
    """A :class:`Kernel` from a kernel, a callable or a formula string."""
    return kernel if isinstance(kernel, Kernel) else FormulaKernel(kernel)


def formula(kernel: Kernel, x: lt.LazyTensor, y: lt.LazyTensor, dtype: torch.dtype) -> lt.LazyTensor:
    """``kernel(x, y)``, checked: a scalar formula whose tensors all have the data's ``dtype``."""
    try:
        out = kernel(x, y)
    except (TypeError, AttributeError, ValueError) as exc:
        raise TypeError(f"kernel {kernel!r} failed on lazytensor arguments ({type(exc).__name__}: {exc}); a kernel "
                        f"maps two LazyTensors x_i, y_j to a LazyTensor formula, e.g. "
                        f"lambda x, y: (-0.5 * x.sqdist(y)).exp()") from exc
    if not isinstance(out, lt.LazyTensor):
        raise TypeError(f"kernel {kernel!r} must return a LazyTensor formula of x and y, got {type(out).__name__}")
    if out.width != 1:
        raise ValueError(f"kernel {kernel!r} must return a scalar formula (feature size 1), got feature size {out.width}")
    for v in out.variables.values():
        if not getattr(v, "follows_dtype", False) and v.tensor.dtype != dtype:
            raise TypeError(f"kernel {kernel!r} uses a {v.tensor.dtype} tensor but the kernel is evaluated in {dtype}; "
                            f"give the tensors it closes over the data's dtype")
    return out


def check_tensor(t, name: str) -> torch.Tensor:
    """``t`` if it is a floating (n, d) torch tensor, else an error naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 2 or not t.is_floating_point() or t.shape[1] == 0:
        raise ValueError(f"{name} must be a floating (n, d) tensor with d >= 1, got shape {tuple(t.shape)} and "
                         f"dtype {t.dtype}")
    return t


def check_pair(X, Y=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, Y)`` (``Y`` defaulting to ``X``): floating (n, d) and (m, d) tensors of one dtype and device."""
    X = check_tensor(X, "X")
    Y = X if Y is None else check_tensor(Y, "Y")
    if Y.shape[1] != X.shape[1] or Y.dtype != X.dtype or Y.device != X.device:
        raise ValueError(f"Y must match X in features, dtype and device: X {tuple(X.shape)} {X.dtype}, "
                         f"Y {tuple(Y.shape)} {Y.dtype}")
    return X, Y


def matrix(kernel: Kernel, X: torch.Tensor, Y: torch.Tensor | None = None, *, tile_dtype: torch.dtype | None = None,
           chunk_size=None, dtype_acc: torch.dtype | None = None) -> torch.Tensor:
    """The dense block ``K(X, Y)`` (differentiable), as lazytensor identity products over column blocks.

    Columns are grouped ``COLUMN_BLOCK`` at a time into a batch, so one
    lazytensor sum returns every block: ``sum_j K[i, j] E[j, c]`` with ``E``
    the identity is exact. The formula is evaluated in ``tile_dtype`` (default
    ``X``'s) and summed in ``dtype_acc``.
    """
    X, Y = check_pair(X, Y)
    tile_dtype = tile_dtype or X.dtype
    (n, d), m = X.shape, Y.shape[0]
    if n == 0 or m == 0:
        return X.new_zeros(n, m, dtype=dtype_acc or tile_dtype)
    width = min(m, COLUMN_BLOCK)
    batches = math.ceil(m / width)
    padded = torch.cat([Y, Y[:1].expand(batches * width - m, d)]) if batches * width > m else Y
    eye = torch.eye(width, dtype=tile_dtype, device=X.device)
    K = formula(kernel, lt.Vi(X.to(tile_dtype)), lt.Vj(padded.reshape(batches, width, d).to(tile_dtype)), tile_dtype)
    out = (K * lt.Vj(eye)).sum(1, chunk_size=chunk_size, dtype_acc=dtype_acc)  # (batches, n, width)
    return out.permute(1, 0, 2).reshape(n, batches * width)[:, :m]
