"""LazyTensor: the user-facing formula object.

``Vi(x)`` / ``Vj(y)`` / ``Pm(p)`` wrap tensors as i-indexed, j-indexed and
parameter variables; arithmetic on them builds IR (nothing is computed);
a reduction over i or j runs the streamed engine and returns a tensor.
KeOps users can write ``LazyTensor(x[:, None, :])`` and
``LazyTensor(y[None, :, :])`` instead.
"""
from __future__ import annotations

from typing import Union

import sympy
import torch

from . import autograd, engine, ir, reductions

Number = Union[int, float]


class LazyTensor:
    """A symbolic (B,) N x M x D array; see the module docstring."""

    __array_priority__ = 1000  # make `tensor * lazy` dispatch to us

    def __init__(self, x, axis: str | None = None):
        if isinstance(x, LazyTensor):
            self.expr, self.variables, self.width = x.expr, x.variables, x.width
            return
        if isinstance(x, (int, float)):
            self.expr, self.variables = sympy.Float(x) if isinstance(x, float) else sympy.Integer(x), {}
            self.width = 1
            return
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"LazyTensor expects a torch.Tensor, a number or a LazyTensor, got {type(x).__name__}")
        if axis is None:
            x, axis = _keops_layout(x)
        sym = ir.new_variable_symbol()
        tensor, batched = _normalize(x, axis)
        self.expr = sym
        self.variables = {sym: _Variable(axis, tensor, batched)}
        self.width = tensor.shape[-1]

    # -- construction -------------------------------------------------------
    @classmethod
    def _build(cls, expr: sympy.Expr, *parents: "LazyTensor", width: int | None = None) -> "LazyTensor":
        """A formula over the parents' variables.

        ``width`` is its feature size; by default the broadcast of the parents'
        and the expression's, so that ``x - x`` keeps x's size after sympy
        folds it to 0. Feature contractions pass 1.
        """
        out = cls.__new__(cls)
        out.variables = {}
        for p in parents:
            out.variables.update(p.variables)
        out.expr = expr
        widths = {ir.feature_dim(expr, out.info)}  # raises on feature sizes that do not broadcast
        if width is None:
            widths |= {p.width for p in parents}
        widths.discard(1)
        if len(widths) > 1:
            raise ValueError(f"feature sizes {sorted(widths)} do not broadcast in {expr}")
        out.width = width if width is not None else (widths.pop() if widths else 1)
        return out

    @property
    def info(self) -> dict[sympy.Symbol, ir.VarInfo]:
        return {s: ir.VarInfo(v.axis, v.tensor.shape[-1]) for s, v in self.variables.items()}

    @property
    def ndim_features(self) -> int:
        """Feature size of the formula (KeOps calls it ``ndim``)."""
        return self.width

    ndim = ndim_features

    def _unary(self, fn) -> "LazyTensor":
        return LazyTensor._build(fn(ir.numeric(self.expr)), self)

    def _contract(self, fn, *others) -> "LazyTensor":
        """``fn`` of the operands summed over their (broadcast) features."""
        operands = (self, *(as_lazy(o) for o in others))
        widths = {o.width for o in operands} - {1}
        if len(widths) > 1:
            raise ValueError(f"feature sizes {sorted(widths)} do not broadcast in a feature contraction")
        summed = ir.feature_sum(fn(*(ir.numeric(o.expr) for o in operands)), max(widths, default=1))
        return LazyTensor._build(summed, *operands, width=1)

    def _binary(self, other, fn, reverse: bool = False) -> "LazyTensor":
        other = as_lazy(other)
        a, b = (other, self) if reverse else (self, other)
        return LazyTensor._build(fn(ir.numeric(a.expr), ir.numeric(b.expr)), a, b)

    # -- arithmetic ---------------------------------------------------------
    def __add__(self, o):
        return self._binary(o, lambda a, b: a + b)

    def __radd__(self, o):
        return self._binary(o, lambda a, b: a + b, reverse=True)

    def __sub__(self, o):
        return self._binary(o, lambda a, b: a - b)

    def __rsub__(self, o):
        return self._binary(o, lambda a, b: a - b, reverse=True)

    def __mul__(self, o):
        return self._binary(o, lambda a, b: a * b)

    def __rmul__(self, o):
        return self._binary(o, lambda a, b: a * b, reverse=True)

    def __truediv__(self, o):
        return self._binary(o, lambda a, b: a / b)

    def __rtruediv__(self, o):
        return self._binary(o, lambda a, b: a / b, reverse=True)

    def __pow__(self, o):
        if isinstance(o, float) and o.is_integer():
            o = int(o)
        if isinstance(o, float):
            o = sympy.nsimplify(o) if abs(o * 2 - round(o * 2)) < 1e-12 else o
        return self._binary(o, lambda a, b: a**b)

    def __rpow__(self, o):
        return self._binary(o, lambda a, b: a**b, reverse=True)

    def __neg__(self):
        return self._unary(lambda a: -a)

    def __abs__(self):
        return self.abs()

    def __or__(self, o):
        """``x | y``: the dot product over features (feature size 1)."""
        return self._contract(lambda a, b: a * b, o)

    def __lt__(self, o):
        return self._binary(o, sympy.StrictLessThan)

    def __le__(self, o):
        return self._binary(o, sympy.LessThan)

    def __gt__(self, o):
        return self._binary(o, sympy.StrictGreaterThan)

    def __ge__(self, o):
        return self._binary(o, sympy.GreaterThan)

    def __eq__(self, o):  # a formula, as torch's ==: 1 where equal, else 0 (NaN != NaN, so never folded)
        return self._binary(o, lambda a, b: _relation(sympy.Eq, a, b))

    def __ne__(self, o):
        return self._binary(o, lambda a, b: _relation(sympy.Ne, a, b))

    __hash__ = object.__hash__

    def exp(self):
        return self._unary(sympy.exp)

    def log(self):
        return self._unary(lambda a: -sympy.oo if a == 0 else sympy.log(a))  # log(0) = -inf, as torch

    def sqrt(self):
        return self._unary(sympy.sqrt)

    def rsqrt(self):
        return self._unary(lambda a: 1 / sympy.sqrt(a))

    def abs(self):
        return self._unary(sympy.Abs)

    def sin(self):
        return self._unary(sympy.sin)

    def cos(self):
        return self._unary(sympy.cos)

    def tanh(self):
        return self._unary(sympy.tanh)

    def sigmoid(self):
        return self._unary(ir.Sigmoid)

    def relu(self):
        return self._unary(ir.Relu)

    def square(self):
        return self._unary(lambda a: a**2)

    def sign(self):
        return self._unary(sympy.sign)

    def clamp(self, low, high):
        """min(max(self, low), high); bounds are numbers or formulas (as torch.clamp with tensor bounds)."""
        for name, bound in (("low", low), ("high", high)):
            if isinstance(bound, bool) or not isinstance(bound, (int, float, LazyTensor)):
                raise TypeError(f"clamp: {name} must be a number or a LazyTensor, got {type(bound).__name__}")
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
            raise ValueError(f"clamp expects low <= high, got low={low!r}, high={high!r}")
        lo, hi = as_lazy(low), as_lazy(high)
        return LazyTensor._build(ir.Clamp(ir.numeric(self.expr), ir.numeric(lo.expr), ir.numeric(hi.expr)), self, lo, hi)

    # -- feature contractions ----------------------------------------------
    def sqnorm2(self):
        return self._contract(lambda a: a**2)

    def norm2(self):
        return self.sqnorm2().sqrt()

    def sqdist(self, o):
        return self._contract(lambda a, b: (a - b) ** 2, o)

    def dot(self, o):
        return self | o

    def weightedsqnorm(self, w):
        return self._contract(lambda a, b: b * a**2, w)

    # -- reductions -----------------------------------------------------------
    def sum(self, dim=1, *, backend: str = "auto", chunk_size=None, dtype_acc=None):
        """Sum over j (dim=1 / "j"), over i (dim=0 / "i"), or over features (dim=-1).

        ``dtype_acc`` (e.g. ``torch.float64`` for a float32 formula): the dtype
        the sum is formed and accumulated in, and the result's dtype.
        """
        if dim in (-1, 2, "features"):
            return self._contract(lambda a: a)

        def make(e, p):
            return reductions.Sum(e, p.info, self.width, dtype_acc=reductions.accumulation_dtype(dtype_acc, p.dtype))

        return self._reduce(make, dim, backend, chunk_size)[0]

    sum_reduction = sum

    def logsumexp(self, dim=1, *, backend: str = "auto", chunk_size=None):
        return self._widen(self._reduce(lambda e, p: reductions.LogSumExp(e, p.info), dim, backend, chunk_size)[0])

    logsumexp_reduction = logsumexp

    def softmax_weighted_sum(self, values, dim=1, *, backend: str = "auto", chunk_size=None):
        """sum_j softmax_j(F_ij) * values_j (values: LazyTensor or dense (M, E) tensor)."""
        axis = _axis(dim)
        if isinstance(values, torch.Tensor):
            values = LazyTensor(values, axis)
        values = as_lazy(values)
        make = lambda e, p: reductions.SoftmaxWeightedSum(e, ir.numeric(values.expr), p.info)  # noqa: E731
        return self._reduce(make, dim, backend, chunk_size, values=values)[0]

    sumsoftmaxweight = softmax_weighted_sum

    def min_argmin(self, dim=1, *, backend: str = "auto", chunk_size=None):
        value, index = self._reduce(lambda e, p: reductions.ArgMin(e, p.info), dim, backend, chunk_size)
        return self._widen(value), self._widen(index)

    def min(self, dim=1, **kw):
        return self.min_argmin(dim, **kw)[0]

    def argmin(self, dim=1, **kw):
        return self.min_argmin(dim, **kw)[1]

    def max_argmax(self, dim=1, *, backend: str = "auto", chunk_size=None):
        value, index = self._reduce(lambda e, p: reductions.ArgMin(e, p.info, -1), dim, backend, chunk_size)
        return self._widen(value), self._widen(index)

    def max(self, dim=1, **kw):
        return self.max_argmax(dim, **kw)[0]

    def argmax(self, dim=1, **kw):
        return self.max_argmax(dim, **kw)[1]

    def kmin_argkmin(self, k: int, dim=1, *, backend: str = "auto", chunk_size=None):
        """The k smallest values over the axis and their indices, ascending; (N, k) when C == 1."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")

        def make(e, problem):
            if k > problem.size("j"):
                raise ValueError(f"k={k} is larger than the {problem.size('j')} entries reduced over")
            return reductions.KMin(e, problem.info, k)

        outs = self._reduce(make, dim, backend, chunk_size)
        return tuple(o.squeeze(-1) if o.shape[-1] == 1 else o for o in (self._widen(t) for t in outs))

    def kmin(self, k: int, dim=1, **kw):
        return self.kmin_argkmin(k, dim, **kw)[0]

    def argkmin(self, k: int, dim=1, **kw):
        return self.kmin_argkmin(k, dim, **kw)[1]

    Kmin, argKmin, Kmin_argKmin = kmin, argkmin, kmin_argkmin

    def quantile(self, q, dim=1, *, backend: str = "auto", chunk_size=None):
        """Exact q-quantile over the axis with torch.quantile's linear interpolation."""
        make = lambda e, p: reductions.Quantile(e, p.info, q, p.size("j"), p.dtype, p.device)  # noqa: E731
        out = self._reduce(make, dim, backend, chunk_size)[0]  # (B?, N, Q, C)
        if not isinstance(q, torch.Tensor) or q.dim() == 0:
            return self._widen(out[..., 0, :])
        return out.squeeze(-1) if out.shape[-1] == 1 else out

    def matmul(self, b: torch.Tensor, **kw):
        """K @ b for a scalar formula K_ij and a dense (M, C) (or (B, M, C)) tensor."""
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"matmul expects a dense torch.Tensor b, got {type(b).__name__}")
        return (self * LazyTensor(b, "j")).sum(1, **kw)

    __matmul__ = matmul

    # -- running ------------------------------------------------------------
    @property
    def _batched(self) -> bool:
        return any(v.batched for v in self.variables.values())

    def problem(self, axis: str) -> engine.Problem:
        """The engine problem reducing over ``axis`` (variables validated)."""
        _check_variables(self.variables)
        info = self.info
        if not any(v.axis == axis for v in info.values()):
            raise ValueError(f"cannot reduce over {axis!r}: the formula has no {axis}-indexed variable")
        other = "i" if axis == "j" else "j"
        if not any(v.axis == other for v in info.values()):
            raise ValueError(f"the formula has no {other}-indexed variable to index the result")
        problem = engine.Problem(info, {s: v.tensor for s, v in self.variables.items()})
        return problem.swapped() if axis == "i" else problem

    def _reduce(self, make, dim, backend, chunk_size, *, values: "LazyTensor | None" = None) -> tuple:
        """Run the reduction ``make(expr, problem)`` over ``dim``; its outputs without the batch dim if unbatched."""
        axis = _axis(dim)
        engine.check_backend(backend)
        engine.check_chunk_size(chunk_size)
        source = self if values is None else LazyTensor._build(self.expr, self, values, width=self.width)
        problem = source.problem(axis)
        ((outs),) = autograd.reduce(problem, [make(ir.numeric(self.expr), problem)], backend, chunk_size)
        return tuple(_unbatch(o, source._batched) for o in outs)

    def _widen(self, out: torch.Tensor) -> torch.Tensor:
        """Give a result the formula's feature size where sympy folded it to a scalar."""
        if self.width == 1 or out.shape[-1] == self.width:
            return out
        return out.expand(*out.shape[:-1], self.width).contiguous()

    def __repr__(self) -> str:
        axes = {s: v.axis for s, v in self.variables.items()}
        return f"LazyTensor({self.expr}, variables={axes})"

    def __bool__(self):
        raise TypeError("a LazyTensor has no truth value; reduce it first")


def _relation(kind, a: sympy.Expr, b: sympy.Expr):
    """``kind(a, b)``, kept symbolic where a variable is involved (x == x is not true for NaN)."""
    return kind(a, b, evaluate=not (a.free_symbols or b.free_symbols))


class _Variable:
    """A variable's axis, normalized tensor, and whether it came with a batch dim.

    ``follows_dtype`` marks parameters made from Python numbers: they take the
    dtype and device of the other variables when the formula runs.
    """

    __slots__ = ("axis", "tensor", "batched", "follows_dtype")

    def __init__(self, axis: str, tensor: torch.Tensor, batched: bool, follows_dtype: bool = False):
        self.axis, self.tensor, self.batched, self.follows_dtype = axis, tensor, batched, follows_dtype


def _keops_layout(x: torch.Tensor):
    """Read the axis from KeOps-style singleton dims: (N,1,D) -> i, (1,M,D) -> j."""
    if x.dim() in (3, 4):
        if x.shape[-2] == 1 and x.shape[-3] != 1:
            return x.squeeze(-2), "i"
        if x.shape[-3] == 1:
            return x.squeeze(-3), "j"
        raise ValueError(
            f"cannot tell the axis of a tensor of shape {tuple(x.shape)}: use x[:, None, :] for i, y[None, :, :] for j, or Vi/Vj"
        )
    if x.dim() <= 1:
        return x, "p"
    raise ValueError(f"cannot tell the axis of a {x.dim()}-D tensor: use Vi(x), Vj(y) or Pm(p)")


def _normalize(x: torch.Tensor, axis: str):
    """i/j variables become (B, N, D); parameters become (D,)."""
    if axis not in ir.AXES:
        raise ValueError(f"axis must be 'i', 'j' or 'p', got {axis!r}")
    if not x.is_floating_point():
        raise TypeError(f"variables must be floating-point tensors, got dtype {x.dtype}")
    if axis == "p":
        if x.dim() > 1:
            raise ValueError(f"a parameter must be a scalar or a 1-D tensor, got shape {tuple(x.shape)}")
        return x.reshape(1, -1), False
    if x.dim() == 1:
        return x.reshape(1, -1, 1), False
    if x.dim() == 2:
        return x.unsqueeze(0), False
    if x.dim() == 3:
        return x, True
    raise ValueError(f"an {axis}-variable must be (N,), (N, D) or (B, N, D), got shape {tuple(x.shape)}")


def _check_variables(variables: dict) -> None:
    anchor = next((v.tensor for v in variables.values() if not v.follows_dtype), None)
    if anchor is not None:
        for v in variables.values():
            if v.follows_dtype:
                v.tensor = v.tensor.to(dtype=anchor.dtype, device=anchor.device)
    tensors = [(s, v.tensor) for s, v in variables.items()]
    if not tensors:
        raise ValueError("the formula has no variables")
    ref = tensors[0][1]
    for _, t in tensors[1:]:
        if t.dtype != ref.dtype:
            raise TypeError(f"variable dtypes differ: {ref.dtype} and {t.dtype}; convert them to one dtype")
        if t.device != ref.device:
            raise ValueError(f"variable devices differ: {ref.device} and {t.device}")
    batches = {v.tensor.shape[0] for v in variables.values() if v.axis != "p"} - {1}
    if len(batches) > 1:
        raise ValueError(f"batch sizes {sorted(batches)} do not broadcast")
    sizes: dict[str, set] = {"i": set(), "j": set()}
    for v in variables.values():
        if v.axis in sizes:
            sizes[v.axis].add(v.tensor.shape[1])
    for axis, found in sizes.items():
        if len(found) > 1:
            raise ValueError(f"{axis}-variables have different lengths {sorted(found)}")


def _axis(dim) -> str:
    if dim in (1, "j"):
        return "j"
    if dim in (0, "i"):
        return "i"
    raise ValueError(f"dim must be 0/'i' or 1/'j' for a reduction, got {dim!r}")


def _unbatch(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.squeeze(0)


def as_lazy(x) -> LazyTensor:
    if isinstance(x, LazyTensor):
        return x
    if isinstance(x, (int, float)):
        return LazyTensor(x)
    if isinstance(x, torch.Tensor):
        if x.dim() <= 1:
            return LazyTensor(x, "p")
        return LazyTensor(x)
    if isinstance(x, sympy.Basic) and not x.free_symbols:
        out = LazyTensor(0)
        out.expr = x
        return out
    raise TypeError(f"cannot combine a LazyTensor with {type(x).__name__}")


def lazy(t: torch.Tensor, axis: str) -> LazyTensor:
    """Wrap ``t`` as an "i"- or "j"-indexed variable ((N, D) or (B, N, D)) or a parameter ("p")."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lazy expects a torch.Tensor, got {type(t).__name__}")
    return LazyTensor(t, axis)


def Vi(t: torch.Tensor) -> LazyTensor:
    return lazy(t, "i")


def Vj(t: torch.Tensor) -> LazyTensor:
    return lazy(t, "j")


def Pm(t) -> LazyTensor:
    """A parameter (scalar or (D,) tensor); a Python number follows the formula's dtype."""
    if isinstance(t, (int, float)):
        out = lazy(torch.tensor([float(t)]), "p")
        for v in out.variables.values():
            v.follows_dtype = True
        return out
    return lazy(t, "p")


def where(cond: LazyTensor, a, b) -> LazyTensor:
    """Elementwise choice: ``a`` where ``cond`` holds, else ``b``."""
    cond, a, b = as_lazy(cond), as_lazy(a), as_lazy(b)
    chosen = sympy.Piecewise((ir.numeric(a.expr), ir.condition(cond.expr)), (ir.numeric(b.expr), True))
    return LazyTensor._build(chosen, cond, a, b)
