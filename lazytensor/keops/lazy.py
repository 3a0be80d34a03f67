"""KeOps's LazyTensor semantics over lazytensor's formulas: a subclass that only translates.

Differences from ``lazytensor.LazyTensor`` (which counts reduction dims without
batch dimensions and reduces over j by default):

- ``axis`` / ``dim`` count batch dimensions, as KeOps: with B batch dims,
  B reduces over i, B + 1 over j, -1 (or B + 2) over features;
- KeOps's defaults: ``sum`` / ``min`` / ``max`` / ``argmin`` / ``argmax`` reduce
  the features (a formula); the other reductions need an axis;
- a reduced axis without any variable counts as size 1 (KeOps's one-point case);
- KeOps's tuning options are accepted and ignored (``backend="CPU"``,
  ``device_id``, ``enable_chunks``, ``use_fast_math``, ...); ``dtype_acc`` /
  ``use_double_acc`` and ``sum_scheme`` are honoured by sums (the result rounded
  back to the formula's dtype, as KeOps returns it); options that would
  change a result we cannot honour raise ``ValueError``.

Operations build the same IR and run on the same engine: nothing is re-implemented.
"""
from __future__ import annotations

import copy
import inspect

import numpy as np
import torch

from .. import ir, kept_kernel, variables
from ..lazy_tensor import LazyTensor as CoreLazyTensor

# KeOps's map-reduce schemes: how KeOps schedules its loop, not what it computes. Ours picks its own.
KEOPS_BACKENDS = ("auto", "CPU", "GPU", "GPU_1D", "GPU_2D", "GPU_1D_device", "GPU_1D_host", "GPU_2D_device", "GPU_2D_host")
IGNORED = ("device_id", "enable_chunks", "use_fast_math", "optional_flags", "is_complex")
PASSED = ("ranges", "out", "chunk_size", "sum_scheme")
SUM_REDUCTIONS = ("sum", "matmul")


def options(kwargs: dict, reduction: str, dtype) -> dict:
    """KeOps's keyword options as lazytensor's: tuning ones dropped, accuracy ones honoured or refused."""
    out = {}
    for name, value in kwargs.items():
        if name == "backend":
            if value in ("compiled", "eager"):
                out["backend"] = value
            elif value not in KEOPS_BACKENDS:
                raise ValueError(f"backend must be one of KeOps's {list(KEOPS_BACKENDS)} (or 'compiled' / 'eager'), "
                                 f"got {value!r}")
        elif name in IGNORED:
            continue
        elif name in PASSED:
            if value is not None:
                out[name] = value
        elif name == "call":  # taken by LazyTensor._run / solve, before the options are read
            continue
        elif name in ("dtype_acc", "use_double_acc"):
            acc = (torch.float64 if value else None) if name == "use_double_acc" else (None if value in (None, "auto") else value)
            if acc is None:
                continue
            if reduction in SUM_REDUCTIONS:
                out["dtype_acc"] = acc
            elif not _same_dtype(acc, dtype):
                raise ValueError(f"{name}={value!r} is honoured by sums only; {reduction} accumulates in the formula's dtype "
                                 f"({dtype}), which would change the result KeOps gives")
        else:
            raise TypeError(f"{reduction}: unexpected option {name!r}")
    return out


def _rounded_back(result, opts: dict, dtype):
    """A sum accumulated in ``dtype_acc`` in the formula's dtype, as KeOps returns it (the core API keeps dtype_acc)."""
    if "dtype_acc" not in opts:
        return result
    return result.astype(dtype) if isinstance(result, np.ndarray) else result.to(dtype)


def _same_dtype(acc, dtype) -> bool:
    name = acc if isinstance(acc, str) else str(acc).replace("torch.", "")
    return dtype is not None and name == str(dtype).replace("torch.", "")


class LazyTensor(CoreLazyTensor):
    """pykeops's ``LazyTensor``: KeOps's axes and defaults on lazytensor's engine (see the module docstring)."""

    def __init__(self, x=None, axis=None, is_complex=False):
        if is_complex:
            raise TypeError("complex KeOps LazyTensors are not supported")
        if isinstance(x, tuple):  # KeOps's symbolic variable: (index, dim, category 0 / 1 / 2 for i / j / parameter)
            if len(x) != 3:
                raise ValueError(f"a symbolic variable is an (index, dim, category) tuple, got {x!r}")
            index, dim, category = x
            self.expr, self.width, self.ranges = ir.position_symbol(0), _count(dim, "dim", 1), None
            self.variables = {self.expr: variables.Placeholder(variables.axis_name(category), _count(index, "index", 0),
                                                               self.width)}
            return
        super().__init__(x, axis)

    # -- KeOps's shape bookkeeping
    @property
    def _shape(self) -> tuple:
        """(*batch, N, M, D), every axis present (KeOps's internal shape; GeomLoss tests for it)."""
        return self.batch_shape + (self._size("i"), self._size("j"), self.width)

    def _keops_axis(self, axis, dim, default):
        return keops_axis(self.nbatchdims, axis, dim, default)

    @classmethod
    def _reduced_axis(cls, name: str, nbatch: int, args: tuple, kwargs: dict) -> str | None:
        """``library.reduced_axis`` for KeOps's reductions: their axes count batch dimensions, some reduce the features."""
        from .. import library  # loaded: only a compiler's trace asks

        if name in ("matmul", "__matmul__", "solve"):
            return "j"
        has_axis, default = _axis_default(name)
        if not has_axis:
            return library.reduced_axis(name, nbatch, args, kwargs)
        named = library.bound(getattr(cls, name), args, kwargs)
        where = keops_axis(nbatch, named.get("axis"), named.get("dim"), default)
        return None if where == -1 else where

    def _anchored(self, axis: str) -> "LazyTensor":
        """Self with a variable on ``axis``: KeOps counts an axis without variables as one point."""
        if any(v.axis == axis for v in self.variables.values()):
            return self
        anchor = next((v.tensor for v in self.variables.values() if not v.follows_dtype), None)
        ones = torch.ones(1, 1, dtype=torch.float32 if anchor is None else anchor.dtype,
                          device=None if anchor is None else anchor.device)
        numpy = self._numpy
        return self * LazyTensor(ones.numpy() if numpy else ones, axis)

    def _run(self, name, axis, dim, default, kwargs, *args, **named):
        where = self._keops_axis(axis, dim, default)
        if where != -1 and _waits(kwargs, self, *args, *named.values()):
            names = list(named)

            def later(formula, *operands, **call_options):  # the operands bound: self, args, then named's values
                given, weights = operands[:len(args)], dict(zip(names, operands[len(args):]))
                # the axis as written (KeOps fixes it then): the call's tensors may bring batch dimensions
                return formula._run(name, where, None, default, {**kwargs, **call_options}, *given, **weights)

            return Waiting(later, self, *args, *named.values())
        kwargs.pop("call", None)
        core_method = getattr(CoreLazyTensor, name)
        if where == -1:
            if kwargs.get("keepdim"):
                kwargs = {k: v for k, v in kwargs.items() if k != "keepdim"}
            options(kwargs, name, self.dtype)
            return core_method(self, *args, dim=-1)
        opts = options(kwargs, name, self.dtype)
        return _rounded_back(core_method(self._anchored(where), *args, dim=where, **named, **opts), opts, self.dtype)

    # -- reductions, KeOps's signatures and defaults
    def sum(self, axis=-1, dim=None, **kwargs):
        return self._run("sum", axis, dim, -1, kwargs)

    def sum_reduction(self, axis=None, dim=None, **kwargs):
        return self._run("sum", axis, dim, None, kwargs)

    def logsumexp(self, axis=None, dim=None, weight=None, **kwargs):
        if "other" in kwargs:  # pykeops hands its reduction's other= through: the weight
            if weight is not None:
                raise TypeError("logsumexp: give the weight once, as weight= or other=")
            weight = kwargs.pop("other")
        return self._run("logsumexp", axis, dim, None, kwargs, weight=weight)

    def logsumexp_reduction(self, **kwargs):
        return self.logsumexp(**kwargs)

    def sumsoftmaxweight(self, weight, axis=None, dim=None, **kwargs):
        return self._run("softmax_weighted_sum", axis, dim, None, kwargs, weight)

    sumsoftmaxweight_reduction = sumsoftmaxweight

    def min(self, axis=-1, dim=None, **kwargs):
        return self._run("min", axis, dim, -1, kwargs)

    def min_reduction(self, axis=None, dim=None, **kwargs):
        return self._run("min", axis, dim, None, kwargs)

    def argmin(self, axis=-1, dim=None, **kwargs):
        return self._run("argmin", axis, dim, -1, kwargs)

    def argmin_reduction(self, axis=None, dim=None, **kwargs):
        return self._run("argmin", axis, dim, None, kwargs)

    def min_argmin(self, axis=None, dim=None, **kwargs):
        return self._run("min_argmin", axis, dim, None, kwargs)

    min_argmin_reduction = min_argmin

    def max(self, axis=-1, dim=None, **kwargs):
        return self._run("max", axis, dim, -1, kwargs)

    def max_reduction(self, axis=None, dim=None, **kwargs):
        return self._run("max", axis, dim, None, kwargs)

    def argmax(self, axis=-1, dim=None, **kwargs):
        return self._run("argmax", axis, dim, -1, kwargs)

    def argmax_reduction(self, axis=None, dim=None, **kwargs):
        return self._run("argmax", axis, dim, None, kwargs)

    def max_argmax(self, axis=None, dim=None, **kwargs):
        return self._run("max_argmax", axis, dim, None, kwargs)

    max_argmax_reduction = max_argmax

    def Kmin(self, K, axis=None, dim=None, **kwargs):
        return self._run("kmin", axis, dim, None, kwargs, K)

    def argKmin(self, K, axis=None, dim=None, **kwargs):
        return self._run("argkmin", axis, dim, None, kwargs, K)

    def Kmin_argKmin(self, K, axis=None, dim=None, **kwargs):
        return self._run("kmin_argkmin", axis, dim, None, kwargs, K)

    Kmin_reduction, argKmin_reduction, Kmin_argKmin_reduction = Kmin, argKmin, Kmin_argKmin
    kmin, argkmin, kmin_argkmin = Kmin, argKmin, Kmin_argKmin

    def max_sumshiftexp(self, axis=None, dim=None, weight=None, **kwargs):
        return self._run("max_sumshiftexp", axis, dim, None, kwargs, weight=weight)

    # -- linear operator
    def matmul(self, v, **kwargs):
        """K @ v: the sum over j of K_ij v_j, v dense (M, E) or (*batch, M, E). KeOps's clients multiply one kernel
        by many right-hand sides (GPyTorch's CG and Lanczos): a small one keeps its matrix (``kept_kernel``)."""
        opts = options(kwargs, "matmul", self.dtype)
        K = self._anchored("j")
        kept = kept_kernel.product(K, v, {"ranges": K.ranges, **opts})
        return _rounded_back(CoreLazyTensor.matmul(K, v, **opts) if kept is None else kept, opts, self.dtype)

    __matmul__ = matmul

    def solve(self, other, var=None, call=True, eps=None, **kwargs):
        """(K + alpha I) a = other by conjugate gradients (KeOps's ``solve``); ``other`` dense or Vi(b).

        It stops by KeOps's rule, the residual's root mean square entry below
        ``eps`` (default 1e-6), where ``eps`` is given or the formula is not
        float64; float64 keeps lazytensor's tighter relative default. ``rtol`` /
        ``atol`` (lazytensor's) replace either.
        """
        if var is not None:
            raise ValueError("solve(var=...) (a formula linear in var) is not supported: write K and call K.solve(Vi(b))")
        if _waits({"call": call}, self, other):
            return Waiting(lambda K, b, **later: LazyTensor.solve(K, b, eps=eps, **{**kwargs, **later}), self, other)
        alpha = kwargs.pop("alpha", 1e-10)
        solve_options = {k: kwargs.pop(k) for k in ("rtol", "atol", "maxiter") if k in kwargs}
        keops_rule = eps is not None or self.dtype != torch.float64
        if keops_rule and "rtol" not in solve_options and "atol" not in solve_options:  # per column: ||r_c||^2 < n eps^2
            solve_options.update(rtol=0.0, atol=(1e-6 if eps is None else float(eps)) * self._size("i") ** 0.5)
        return CoreLazyTensor.solve(self, other, alpha, **solve_options, **options(kwargs, "solve", self.dtype))


def _axis_default(name: str) -> tuple:
    """(whether KeOps's reduction ``name`` takes an axis, its default: -1 the features; logsumexp_reduction passes
    it on). The signatures are read when a compiler first traces one (1.3 ms: not at import). Dynamo calls this
    rather than tracing it (``_dynamo_marked_constant``): traced, the first call's side effects (the dict filled,
    inspect's own caches) made Dynamo's restart of the same trace take another path, and the compile failed
    (``SpeculationLogDivergence``) where a KeOps formula was first reduced inside a compiled function."""
    if not _AXIS_DEFAULTS:
        _AXIS_DEFAULTS.update({name: inspect.signature(value).parameters["axis"].default
                               for name, value in vars(LazyTensor).items()
                               if inspect.isfunction(value) and "axis" in inspect.signature(value).parameters})
        _AXIS_DEFAULTS["logsumexp_reduction"] = None
    return name in _AXIS_DEFAULTS, _AXIS_DEFAULTS.get(name)


_AXIS_DEFAULTS: dict = {}
_axis_default._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets (without importing Dynamo)


def keops_axis(nb: int, axis, dim, default):
    """KeOps's axis (batch dims counted) as lazytensor's: 'i', 'j' or -1 (features)."""
    axis = dim if dim is not None else axis
    if axis is None:
        axis = default
    if axis in ("i", "j"):
        return axis
    if axis is None:
        raise ValueError(f"this reduction needs axis (or dim): {nb} to reduce over i, {nb + 1} over j")
    if axis in (-1, nb + 2):
        return -1
    if isinstance(axis, bool) or axis not in (nb, nb + 1):
        raise ValueError(f"axis (or dim) must be {nb} (over i), {nb + 1} (over j) or -1 (features) with {nb} batch "
                         f"dimension(s), got {axis!r}")
    return "i" if axis == nb else "j"


class Waiting:
    """A reduction to run when called: KeOps's ``call=False``, and every reduction of a formula with symbolic
    variables (``Vi(index, dim)``), whose tensors the call takes in index order. Without placeholders it reads
    the formula's tensors as they are at the call (KeOps's in-place loop idiom); keyword options given to the
    call join the reduction's."""

    def __init__(self, reduce, *operands):
        self.reduce, self.operands = reduce, operands
        self.indices = sorted({v.index for o in operands if _symbolic(o) for v in o.variables.values()
                               if isinstance(v, variables.Placeholder)})
        if self.indices != list(range(len(self.indices))):
            raise ValueError(f"symbolic variables must be numbered 0, 1, ... without gaps, got indices {self.indices}")

    def __repr__(self):
        return f"Waiting(a reduction of {self.operands[0]!r}; call it with {len(self.indices)} tensor(s))"

    def __call__(self, *tensors, **options):
        if len(tensors) != len(self.indices):
            raise TypeError(f"this reduction takes {len(self.indices)} tensor(s), one per symbolic variable in index order, "
                            f"got {len(tensors)}")
        return self.reduce(*(_bound(o, tensors) for o in self.operands), **options)


def _waits(kwargs: dict, *operands) -> bool:
    """Whether a reduction returns a ``Waiting``: ``call=False``, or an operand with symbolic variables."""
    call = kwargs.pop("call", True)
    if not isinstance(call, bool):
        raise TypeError(f"call must be True or False, got {call!r}")
    return not call or any(_symbolic(o) for o in operands)


def _symbolic(operand) -> bool:
    return isinstance(operand, CoreLazyTensor) and any(isinstance(v, variables.Placeholder) for v in operand.variables.values())


def _bound(operand, tensors: tuple):
    """``operand`` with each symbolic variable replaced by its tensor (checked against its feature size)."""
    if not _symbolic(operand):
        return operand
    out, bound = copy.copy(operand), {}
    for s, v in operand.variables.items():
        if isinstance(v, variables.Placeholder):
            _, wrapped, width = variables.wrap(tensors[v.index], v.axis)
            if width != v.tensor.shape[-1]:
                raise ValueError(f"argument {v.index} has {width} features; its symbolic variable has {v.tensor.shape[-1]}")
            v = next(iter(wrapped.values()))
        bound[s] = v
    out.variables = bound
    return out


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"a symbolic variable's {name} must be an int >= {least}, got {value!r}")
    return int(value)


def Vi(x, dim=None):
    """An i-indexed variable: (N, D) or (*batch, N, D); ``Vi(index, dim)``: a symbolic one (see ``Waiting``)."""
    return _variable(x, dim, "i")


def Vj(x, dim=None):
    """A j-indexed variable: (M, D) or (*batch, M, D)."""
    return _variable(x, dim, "j")


def Pm(x, dim=None):
    """A parameter: a number, (D,) or (*batch, D); a Python number is a constant."""
    if isinstance(x, (int, float)) and not isinstance(x, bool) and dim is None:
        return LazyTensor(x)
    return _variable(x, dim, "p")


def _variable(x, dim, axis) -> LazyTensor:
    if dim is not None or isinstance(x, int) and not isinstance(x, bool):
        if dim is None:
            raise TypeError(f"V{axis}(index, dim): a symbolic variable needs its feature size dim")
        return LazyTensor((x, dim, axis))
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        raise TypeError(f"expected a torch.Tensor or a NumPy array, got {type(x).__name__}")
    return LazyTensor(x, axis)
