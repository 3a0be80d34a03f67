"""What every estimator shares: scikit-learn citizenship, the hyper-parameter table, input checks, sources, warnings.

With scikit-learn installed the estimators are real scikit-learn estimators
(``BaseEstimator`` and the regressor / classifier / transformer mixins: tags,
``clone``, ``Pipeline``, ``GridSearchCV``), and ``NotFittedError`` /
``ConvergenceWarning`` subclass scikit-learn's. Without it they keep the same
conventions on their own. Inputs may be torch tensors or anything NumPy can
read: NumPy in gives NumPy out, torch in gives torch out (with gradients).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import numbers
import sys
import warnings

import numpy as np
import torch

from lazytensor import distributed

# source="auto"'s rule and thresholds live in the light .auto (no scikit-learn): LazyTensor.solve takes them from there
from .auto import AUTO_DIRECT_MAX_N, AUTO_SPECTRAL_DIRECT_MAX_N, AUTO_STORED_MAX_BYTES, auto_rank, auto_source
from .auto import AUTO_RANK_MAX as AUTO_RANK_MAX  # re-exported (auto_rank's cap)
from .implicit import requires_grad
from .kernels import as_kernel
from .sources import ShardedKernel, StoredKernel, StreamedKernel

try:
    from sklearn import base as _sklearn
    from sklearn.exceptions import ConvergenceWarning as _SkConvergenceWarning
    from sklearn.exceptions import DataConversionWarning
    from sklearn.exceptions import NotFittedError as _SkNotFittedError
except ImportError:  # scikit-learn is optional
    _sklearn = None
    DataConversionWarning = UserWarning

__all__ = ["Estimator", "NotFittedError", "ConvergenceWarning", "SOURCES", "AUTO_DIRECT_MAX_N", "AUTO_SPECTRAL_DIRECT_MAX_N",
           "AUTO_STORED_MAX_BYTES", "auto_source", "auto_rank"]

SOURCES = ("auto", "streamed", "stored", "direct", "sharded")
TILE_DTYPES = (None, torch.float32, torch.float64)


class NotFittedError(*((_SkNotFittedError,) if _sklearn else (ValueError, AttributeError))):
    """``predict`` / ``transform`` before ``fit`` (scikit-learn's ``NotFittedError`` when installed)."""


class ConvergenceWarning(*((_SkConvergenceWarning,) if _sklearn else (UserWarning,))):
    """An iterative solve stopped before meeting its tolerance (see ``info_``)."""


if _sklearn is not None:
    _Base, RegressorMixin = _sklearn.BaseEstimator, _sklearn.RegressorMixin
    ClassifierMixin, TransformerMixin = _sklearn.ClassifierMixin, _sklearn.TransformerMixin
else:
    import inspect

    class _Base:
        """scikit-learn's parameter conventions without scikit-learn."""

        @classmethod
        def _get_param_names(cls) -> list[str]:
            sig = inspect.signature(cls.__init__)
            return sorted(p.name for p in sig.parameters.values() if p.name != "self" and p.kind != p.VAR_KEYWORD)

        def get_params(self, deep: bool = True) -> dict:
            return {name: getattr(self, name) for name in self._get_param_names()}

        def set_params(self, **params):
            valid = self._get_param_names()
            for name, value in params.items():
                if name not in valid:
                    raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}; valid: {valid}")
                setattr(self, name, value)
            return self

        def __repr__(self):
            return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.get_params().items())})"

    class RegressorMixin:
        pass

    class ClassifierMixin:
        pass

    class TransformerMixin:
        def fit_transform(self, X, y=None, **fit_params):
            return self.fit(X, y, **fit_params).transform(X)


def caller_level() -> int:
    """``stacklevel`` for a warning raised here that points at the first line outside ``solvers``: the user's."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("solvers."):
        frame, level = frame.f_back, level + 1
    return level


# ------------------------------------------------------------------ inputs
def _floating(t: torch.Tensor, name: str) -> torch.Tensor:
    """Floating dtypes the solvers compute in: integers and booleans -> float64, half precisions -> float32."""
    if t.is_complex():
        raise ValueError(f"Complex data not supported: {name} has dtype {t.dtype}")
    if not t.is_floating_point():
        return t.to(torch.float64)
    if torch.finfo(t.dtype).bits < 32:
        return t.to(torch.float32)
    return t


def as_tensor(X, name: str) -> tuple[torch.Tensor, bool]:
    """``(tensor, came_from_numpy)`` for a tensor or anything NumPy reads (lists, arrays, frames)."""
    if isinstance(X, torch.Tensor):
        return _floating(X, name), False
    if X is None:
        raise ValueError(f"{name} is None; expected an array-like or a torch.Tensor")
    if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
        raise TypeError(f"{name} is a sparse matrix; sparse input is not supported, pass a dense array ({name}.toarray())")
    array = np.asarray(X)
    if array.dtype.kind == "c":
        raise ValueError(f"Complex data not supported: {name} has dtype {array.dtype}")
    if array.dtype.kind not in "biuf":
        array = array.astype(np.float64)  # object arrays of numbers; anything else raises numpy's TypeError
    return _floating(torch.from_numpy(np.array(array, copy=True)), name), True


def check_points(X, name: str = "X", *, estimator=None, n_features: int | None = None,
                 dtype: torch.dtype | None = None, allow_empty: bool = False) -> tuple[torch.Tensor, bool]:
    """A finite floating (n, d) tensor and whether it came from NumPy, or an error naming ``name``.

    With ``n_features`` / ``dtype`` (a fitted estimator's), the feature count
    must match and the data is cast to ``dtype``. ``allow_empty``: n = 0 is
    fine (one rank's shard of a sharded fit).
    """
    X, numpy_in = as_tensor(X, name)
    if X.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (n_samples, n_features) array, got shape {tuple(X.shape)}"
                         + (f"; Reshape your data with {name}.reshape(-1, 1) (one feature) or {name}.reshape(1, -1) "
                            f"(one sample)" if X.ndim == 1 else ""))
    if (X.shape[0] == 0 and not allow_empty) or X.shape[1] == 0:
        which = "sample" if X.shape[0] == 0 else "feature"
        raise ValueError(f"Found {name} with 0 {which}(s) (shape={tuple(X.shape)}) while a minimum of 1 is required.")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(f"{name} has {X.shape[1]} features, but {type(estimator).__name__} is expecting {n_features} "
                         f"features as input")
    if dtype is not None:
        X = X.to(dtype)
    _check_finite(X, name)
    return X, numpy_in


def feature_names(X) -> np.ndarray | None:
    """A DataFrame's column names when they are all strings (scikit-learn's rule for ``feature_names_in_``), else None."""
    columns = getattr(X, "columns", None)
    if columns is None or isinstance(X, torch.Tensor):
        return None
    names = np.asarray(list(columns), dtype=object)
    return names if len(names) and all(isinstance(name, str) for name in names) else None


def _names_mismatch(fitted: list, names: list) -> str:
    """scikit-learn's wording, so that code matching its error matches ours: which names are new, which are
    missing (five of each at most), or else that the order changed."""
    def listed(title, items):
        return f"{title}:\n" + "".join(f"- {name}\n" for name in items[:5]) + ("- ...\n" if len(items) > 5 else "")

    unseen, missing = sorted(set(names) - set(fitted)), sorted(set(fitted) - set(names))
    detail = (listed("Feature names unseen at fit time", unseen) if unseen else "") + (
        listed("Feature names seen at fit time, yet now missing", missing) if missing else "")
    return ("The feature names should match those that were passed during fit.\n"
            + (detail or "Feature names must be in the same order as they were in fit.\n"))


def _check_finite(t: torch.Tensor, name: str) -> None:
    values = t.detach()
    if bool(torch.isnan(values).any()):
        raise ValueError(f"Input {name} contains NaN")
    if bool(torch.isinf(values).any()):
        raise ValueError(f"Input {name} contains infinity")


def check_targets(Y, n: int, dtype: torch.dtype, estimator, name: str = "y") -> torch.Tensor:
    """Targets with ``n`` rows, 1-D or 2-D, finite, cast to the inputs' dtype."""
    if Y is None:
        raise ValueError(f"{type(estimator).__name__} requires y to be passed, but the target y is None")
    Y, _ = as_tensor(Y, name)
    if Y.ndim not in (1, 2) or Y.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) or ({n}, n_targets) to match X, got {tuple(Y.shape)}")
    if Y.ndim == 2 and Y.shape[1] == 0:
        raise ValueError(f"Found {name} with 0 target(s) (shape={tuple(Y.shape)}) while a minimum of 1 is required.")
    Y = Y.to(dtype)
    _check_finite(Y, name)
    return Y


def check_sample_weight(weight, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample weights for ``score`` (scikit-learn's ``sample_weight``): ``n`` finite, non-negative numbers,
    not all 0; None weighs every sample 1."""
    if weight is None:
        return torch.ones(n, dtype=dtype)
    weight = torch.as_tensor(np.asarray(weight) if not isinstance(weight, torch.Tensor) else weight.detach().cpu())
    if weight.ndim != 1 or weight.shape[0] != n or weight.is_complex() or weight.dtype == torch.bool:
        raise ValueError(f"sample_weight must be a 1-D array of {n} real numbers, got shape {tuple(weight.shape)}"
                         f" and dtype {weight.dtype}")
    weight = weight.to(dtype)
    if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()) or not bool((weight > 0).any()):
        raise ValueError("sample_weight must be finite and non-negative, with at least one positive weight")
    return weight


def check_labels(y, n: int, name: str = "y"):
    """Class labels (any type NumPy or torch holds): ``(classes, codes)`` with codes a long tensor."""
    if y is None:
        raise ValueError("this estimator requires y to be passed, but the target y is None")
    if getattr(y, "ndim", 1) == 2 and y.shape[1] == 1:
        warnings.warn("A column-vector y was passed when a 1d array was expected; using y.ravel()",
                      DataConversionWarning, stacklevel=caller_level())
        y = y.reshape(-1)
    if isinstance(y, torch.Tensor):
        if y.ndim != 1 or y.shape[0] != n:
            raise ValueError(f"{name} must be a 1-D array of {n} class labels, got shape {tuple(y.shape)}")
        if y.is_floating_point() and not bool((y == y.round()).all()):
            raise ValueError(f"Unknown label type: continuous; {name} must hold class labels")
        classes, codes = torch.unique(y, return_inverse=True)
        return classes, codes
    array = np.asarray(y)
    if array.ndim != 1 or array.shape[0] != n:
        raise ValueError(f"{name} must be a 1-D array of {n} class labels, got shape {array.shape}")
    if array.dtype.kind == "c":
        raise ValueError("Complex data not supported")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array) & (array == np.round(array))):
        raise ValueError(f"Unknown label type: continuous; {name} must hold class labels")
    if array.dtype.kind == "O" and not all(isinstance(v, (str, numbers.Integral)) for v in array):
        raise ValueError(f"Unknown label type: {name} holds objects that are neither strings nor integers")
    classes, codes = np.unique(array, return_inverse=True)
    return classes, torch.from_numpy(codes.reshape(-1)).long()


def as_output(t: torch.Tensor, numpy_out: bool):
    """NumPy in, NumPy out; torch in, torch out. A gradient NumPy cannot carry is dropped with a warning."""
    if numpy_out and t.requires_grad:
        warnings.warn("X is a NumPy array, so this result is NumPy and drops its gradient (targets or kernel "
                      "parameters require grad); pass X as a torch.Tensor to keep it", stacklevel=caller_level())
    return t.detach().cpu().numpy() if numpy_out else t


def check_positive(value, name: str) -> float:
    number = float(value.detach()) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if not isinstance(number, numbers.Real) or isinstance(number, bool) or not 0 < number < float("inf"):
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(number)


def check_count(value, name: str, upper: int, why: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 1 <= value <= upper:
        raise ValueError(f"{name} must be an int in [1, {upper}] ({why}), got {value!r}")
    return int(value)


# --------------------------------------------------------------- estimators
def agree_on_ranks(sharding, check):
    """``check()`` on every rank of a sharded fit; if it raises on any rank it raises on all of them
    (the failing rank with its own error, the others naming it), so no rank waits in a collective."""
    try:
        result, error = check(), None
    except (ValueError, TypeError) as exc:
        result, error = None, exc
    failed = [r for r, flag in enumerate(sharding.gather(torch.tensor([error is not None]))) if bool(flag)]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"sharded fit: the input on rank(s) {failed} was rejected (see the error raised there)")
    return result


# ------------------------------------------------------- hyper-parameters
def one_of(*choices):
    """A parameter check: the value is one of ``choices``."""
    def check(value, name):
        if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return check


def number(*, minimum: float = 0.0, strict: bool = False, none: bool = False):
    """A parameter check: a real number above ``minimum`` (``strict``: not equal; finite), or None if ``none``."""
    def check(value, name):
        if value is None and none:
            return
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value
        if not ok or (value <= minimum if strict else value < minimum) or (strict and value == float("inf")):
            kind = "a finite positive number" if strict else "a non-negative number"
            raise ValueError(f"{name} must be {kind}{' or None' if none else ''}, got {value!r}")
    return check


def integer(*, minimum: int = 0, none: bool = False, auto: bool = False):
    """A parameter check: an int of at least ``minimum``, or None if ``none``, or ``"auto"`` if ``auto``."""
    def check(value, name):
        if (value is None and none) or (value == "auto" and auto and isinstance(value, str)):
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
            alternatives = (" or None" if none else "") + (" or 'auto'" if auto else "")
            raise ValueError(f"{name} must be {kind}{alternatives}, got {value!r}")
    return check


# What every estimator's table holds where it has the parameter; ``kernel`` (``as_kernel``), ``alpha``
# (per target), ``chunk_size`` (lazytensor's rule, at the first source) and the data-bound counts
# (``n_components <= n``) are checked where their meaning is known.
COMMON_PARAMETERS = {
    "source": one_of(*SOURCES), "rtol": number(none=True), "atol": number(none=True),
    "maxiter": integer(minimum=1, none=True), "tile_dtype": one_of(*TILE_DTYPES), "random_state": integer(),
    "rank": integer(minimum=1, auto=True), "search_width": integer(), "regularization": check_positive,
    "n_components": integer(minimum=1, none=True), "n_landmarks": integer(minimum=1, none=True),
}


DATA_METHODS = ("fit", "predict", "transform", "fit_transform", "score")


def _without_autocast(method):
    """``method`` with torch's autocast off: a fit's precision is its data's dtype and ``tile_dtype``. Under a
    caller's bfloat16 autocast its products and Krylov updates ran in bfloat16 and stalled at a 4e-3 error."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        devices = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not devices:
            return method(self, *args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.autocast(device, enabled=False))
            return method(self, *args, **kwargs)

    return run


class Estimator(_Base):
    """Hyper-parameters live in ``__init__`` arguments; learned state in ``attr_`` names.

    ``_parameters`` is the class's table name -> check (scikit-learn's parameter
    constraints): ``fit`` checks every hyper-parameter the estimator has against
    it before touching the data, so a bad setting fails at once, naming itself.
    """

    _parameters: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in DATA_METHODS:
            if name in cls.__dict__:
                setattr(cls, name, _without_autocast(cls.__dict__[name]))

    def __sklearn_clone__(self):
        """scikit-learn's ``clone``, with tensor hyper-parameters shared rather than deep-copied: a tensor
        carries the caller's gradient, and one computed from a parameter cannot be deep-copied."""
        tensors = {k: v for k, v in self.get_params(deep=False).items() if isinstance(v, torch.Tensor)}
        stripped = copy.copy(self).set_params(**dict.fromkeys(tensors))
        return super(Estimator, stripped).__sklearn_clone__().set_params(**tensors)

    def _check_common(self) -> None:
        table = {**COMMON_PARAMETERS, **self._parameters}
        for name in self._get_param_names():
            if name in table:
                table[name](getattr(self, name), name)
        self._kernel = as_kernel(self.kernel)

    def _rank(self, n: int) -> int:
        """The Nystrom preconditioner's rank: ``rank``, or by default ``8 sqrt(n)`` (a multiple of 64, at most
        ``AUTO_RANK_MAX``): there the preconditioner's O(n r^2) set-up and the passes it saves balance
        (measured in docs/solvers.md)."""
        if self.rank == "auto":
            return auto_rank(n)
        return min(n, int(self.rank))

    def _rtol(self, dtype: torch.dtype) -> float:
        """Default tolerance: tight in float64, what single precision can reach in float32."""
        return self.rtol if self.rtol is not None else (1e-8 if dtype == torch.float64 else 1e-4)

    _auto_direct_max_n = AUTO_DIRECT_MAX_N

    def _resolve_source(self, n: int, m: int | None = None, itemsize: int = 8) -> str:
        """``source``, or for ``"auto"`` the fastest measured route for an ``n x m`` kernel (``m``
        default ``n``) of ``itemsize``-byte entries: direct, stored within AUTO_STORED_MAX_BYTES, streamed."""
        if self.source != "auto":
            return self.source
        return auto_source(n, m, itemsize, direct_max_n=self._auto_direct_max_n, stored_max_bytes=AUTO_STORED_MAX_BYTES)

    def _tile_dtype(self, dtype: torch.dtype, preconditioner: bool) -> torch.dtype:
        """The dtype ``fast`` tiles are evaluated in: ``tile_dtype``, or by default float32 for float64
        data where they only build a preconditioner (``preconditioner``), else the data's."""
        if self.tile_dtype is not None:
            return self.tile_dtype if torch.finfo(self.tile_dtype).bits < torch.finfo(dtype).bits else dtype
        return torch.float32 if preconditioner and dtype == torch.float64 else dtype

    def make_sources(self, kind: str, X: torch.Tensor, Y: torch.Tensor | None = None, *, fast: str | None = None):
        """``(exact, fast)``: the kernel matrix ``K(X, Y)`` as a source of one ``kind``, and in cheaper tiles.

        ``kind``: ``"streamed"`` (each product a lazytensor sum, differentiable in
        ``X``, ``Y`` and the kernel's tensors), ``"sharded"`` (``X`` this rank's
        rows; no gradient) or ``"stored"`` / ``"direct"`` (the matrix; no gradient). ``exact``
        evaluates tiles in the data's dtype (results, true residuals). ``fast``:
        ``None`` the same source; ``"asked"`` tiles in ``tile_dtype`` if given;
        ``"preconditioner"`` by default float32 tiles for float64 data too (what
        builds a CG fit's preconditioner). Sums always run in the data's dtype.
        """
        if kind == "sharded":
            exact = ShardedKernel(self._kernel, X, Y, sharding=self._sharding, chunk_size=self.chunk_size)
        else:
            exact = StreamedKernel(self._kernel, X, Y, chunk_size=self.chunk_size)
            if kind in ("stored", "direct"):
                with torch.no_grad():
                    exact = StoredKernel(exact.dense())
        tile_dtype = X.dtype if fast is None else self._tile_dtype(X.dtype, preconditioner=fast == "preconditioner")
        if isinstance(exact, StoredKernel) or tile_dtype == X.dtype:
            return exact, exact
        try:
            return exact, exact.with_tile_dtype(tile_dtype)
        except TypeError:  # a formula closing over tensors of the data's dtype has no float32 version
            if self.tile_dtype is not None:
                raise
            return exact, exact

    def _fit_points(self, X) -> torch.Tensor:
        """Training points, checked; records ``n_features_in_`` and whether outputs are NumPy."""
        X, self._numpy, names = *check_points(X, "X"), feature_names(X)
        self.n_features_in_ = X.shape[1]
        self._remember_feature_names(names)
        return X

    def _remember_feature_names(self, names: np.ndarray | None) -> None:
        if names is None:
            self.__dict__.pop("feature_names_in_", None)
        else:
            self.feature_names_in_ = names

    def _check_feature_names(self, X) -> None:
        """Query columns in the fit's names and order, as scikit-learn: a DataFrame's columns reordered would
        otherwise give other predictions silently."""
        fitted, names = getattr(self, "feature_names_in_", None), feature_names(X)
        if fitted is not None and names is not None:
            if len(fitted) != len(names) or bool((fitted != names).any()):
                raise ValueError(_names_mismatch(list(fitted), list(names)))
        elif fitted is not None or names is not None:
            warnings.warn(f"X does not have valid feature names, but {type(self).__name__} was fitted with feature names"
                          if names is None else
                          f"X has feature names, but {type(self).__name__} was fitted without feature names",
                          UserWarning, stacklevel=caller_level())

    def _fit_rows(self, X, derive=lambda X: (), *tensors) -> tuple:
        """``(X, *derive(X))``: checked training points and what ``derive`` checks against them (targets, labels).

        With ``source="sharded"`` these are this rank's rows (possibly none);
        every rank checks its own, they agree on features, the widths of the
        derived 2-D tensors and the dtype, and a rejected input raises on every
        rank. Sharded fits have no gradients: inputs (or ``tensors``, or tensors
        the kernel closes over) that require grad are rejected.
        """
        if self.source != "sharded":
            X = self._fit_points(X)
            return (X, *derive(X))
        self._sharding = distributed.active() or distributed.Sharding()
        X_in = X

        def check():
            X_, self._numpy = check_points(X, "X", allow_empty=True)
            derived = derive(X_)
            if requires_grad(X_, *derived, *tensors, self.make_sources("streamed", X_[:1])[0].K):
                raise ValueError("source='sharded' fits are not differentiable: pass tensors that do not require grad")
            return (X_, *derived)

        rows = agree_on_ranks(self._sharding, check)
        X = rows[0]
        widths = [t.shape[1] for t in rows[1:] if isinstance(t, torch.Tensor) and t.ndim == 2]
        layouts = self._sharding.gather(torch.tensor([X.shape[0], X.shape[1], *widths, torch.finfo(X.dtype).bits]))
        if any(not torch.equal(layout[1:], layouts[0][1:]) for layout in layouts):
            raise ValueError("sharded fit: every rank needs the same number of features and targets and the same dtype; "
                             f"got (features, [targets,] float bits) {[tuple(t[1:].tolist()) for t in layouts]} by rank")
        if sum(int(layout[0]) for layout in layouts) == 0:
            raise ValueError("sharded fit: no rank holds a training point")
        self.n_features_in_ = X.shape[1]
        self._remember_feature_names(feature_names(X_in))
        return rows

    def _agreed(self, check):
        """``check()``; in a sharded fit on every rank at once (one rank's error raises on all: no rank waits)."""
        return agree_on_ranks(self._sharding, check) if self.source == "sharded" else check()

    def _times(self, X, centres: torch.Tensor, coef: torch.Tensor, rows: slice | None = None):
        """``(K(X, centres) @ coef, numpy_out)`` for query points ``X`` (checked against the fit).

        ``rows``: the fit was sharded and ``centres`` / ``coef`` are whole; each
        rank multiplies its own rows of them and one all-reduce adds the shares,
        so every rank gets the full result.
        """
        if rows is None:
            X, numpy_out = self._query_points(X, centres)
            return self.make_sources("streamed", X, centres)[0] @ coef, numpy_out
        X, numpy_out = agree_on_ranks(self._sharding, lambda: self._query_points(X, centres))
        with torch.no_grad(), distributed.local():
            mine = self.make_sources("streamed", X, centres[rows])[0] @ coef[rows]
        return self._sharding.all_reduce(mine), numpy_out

    def _query_points(self, X, fitted: torch.Tensor) -> tuple[torch.Tensor, bool]:
        self._check_feature_names(X)
        return check_points(X, "X", estimator=self, n_features=self.n_features_in_, dtype=fitted.dtype)

    def _publish(self, **attrs) -> None:
        """Learned attributes in the type of the training data (NumPy or torch); torch copies kept privately."""
        for name, value in attrs.items():
            setattr(self, f"_{name}", value)
            setattr(self, f"{name}_", as_output(value, self._numpy) if isinstance(value, torch.Tensor) else value)

    def _check_fitted(self, attr: str) -> None:
        if not hasattr(self, f"_{attr}"):
            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with appropriate "
                                 f"arguments before using this estimator.")

    def _report(self, info, what: str) -> None:
        if not info.converged:
            warnings.warn(f"{type(self).__name__}: {what} did not converge ({info.reason}; "
                          f"{info.iterations} iterations, max residual {float(info.residuals.max()):.3g}); "
                          f"see info_", ConvergenceWarning, stacklevel=caller_level())

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.non_deterministic = False
        if tags.transformer_tags is not None:
            tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        return tags

    def _more_tags(self):  # scikit-learn < 1.6
        return {"preserves_dtype": [np.float64, np.float32]}
