"""LazyTensor: the user-facing formula object.

``Vi(x)`` / ``Vj(y)`` / ``Pm(p)`` wrap tensors as i-indexed, j-indexed and
parameter variables; arithmetic on them builds IR (nothing is computed);
a reduction over i or j runs the streamed engine and returns a tensor.
KeOps users can write ``LazyTensor(x[:, None, :])`` and
``LazyTensor(y[None, :, :])`` instead, with any number of leading batch
dimensions (they broadcast, and are flattened into the engine's one batch
dimension), and NumPy arrays in give NumPy arrays out.
"""
from __future__ import annotations

import itertools
import math
from typing import Union

import numpy as np
import sympy
import torch

from . import autograd, cluster, distributed, engine, ir, reductions
from .plan import check_chunk_size, check_ranges
from .problem import Problem

Number = Union[int, float]
# Options every reduction takes (``axis`` is KeOps's and NumPy's name for ``dim``; ``sum_scheme`` is KeOps's).
REDUCTION_OPTIONS = ("backend", "chunk_size", "ranges", "out", "axis", "group", "sum_scheme")
# KeOps's summation orders: ours sums each tile, then the tiles ("block_sum"); "kahan_scheme" asks for more
# accuracy than float32 accumulation, which sums give by accumulating in float64.
SUM_SCHEMES = ("auto", "direct_sum", "block_sum", "kahan_scheme")
_FEATURES = ("features", -1)


class LazyTensor:
    """A symbolic (*batch, N, M, D) array; see the module docstring."""

    __array_priority__ = 1000  # make `tensor * lazy` dispatch to us
    __array_ufunc__ = None  # and `ndarray * lazy` too
    ranges = None  # KeOps's block-sparsity attribute: ``K.ranges = from_matrix(...)`` applies to K's reductions

    def __init__(self, x, axis=None):
        if isinstance(x, LazyTensor):
            self.expr, self.variables, self.width, self.ranges = x.expr, x.variables, x.width, x.ranges
            return
        if isinstance(x, np.generic) and not isinstance(x, np.ndarray):
            x = x.item()
        if isinstance(x, bool) or (isinstance(x, (int, float)) and axis is not None):
            raise TypeError(f"LazyTensor expects a tensor, an array, a number or a LazyTensor, got {x!r}")
        if isinstance(x, (int, float)):
            self.expr, self.variables = sympy.Float(x) if isinstance(x, float) else sympy.Integer(x), {}
            self.width = 1
            return
        if isinstance(x, list):  # KeOps: a list of numbers is a parameter vector that follows the formula's dtype
            out = Pm(torch.tensor([float(v) for v in x]))
            next(iter(out.variables.values())).follows_dtype = True
            self.expr, self.variables, self.width = out.expr, out.variables, out.width
            return
        from_numpy = isinstance(x, np.ndarray)
        if from_numpy:
            x = torch.from_numpy(x)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"LazyTensor expects a torch.Tensor, a NumPy array, a number or a LazyTensor, got {type(x).__name__}")
        x, axis = _keops_layout(x) if axis is None else (x, _axis_name(axis))
        sym = ir.new_variable_symbol()
        tensor = _normalize(x, axis)
        self.expr = sym
        self.variables = {sym: _Variable(axis, tensor, numpy=from_numpy)}
        self.width = tensor.shape[-1]

    # -- construction -------------------------------------------------------
    @classmethod
    def _build(cls, expr: sympy.Expr, *parents: "LazyTensor", width: int | None = None) -> "LazyTensor":
        """A formula over the parents' variables.

        ``width`` is its feature size; by default the broadcast of the parents'
        and the expression's, so that ``x - x`` keeps x's size after sympy
        folds it to 0. Feature contractions pass 1.
        """
        kind = next((type(p) for p in parents if type(p) is not LazyTensor), cls)  # a flavour (lazytensor.keops) sticks
        out = kind.__new__(kind)
        out.variables = {}
        for p in parents:
            out.variables.update(p.variables)
        out.ranges = next((p.ranges for p in parents if p.ranges is not None), None)
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

    # -- shape, as KeOps: (*batch, N, M) or (*batch, N, M, D) -------------------------
    @property
    def batch_shape(self) -> tuple:
        try:
            return tuple(torch.broadcast_shapes(*(v.batch_shape for v in self.variables.values())))
        except RuntimeError:
            raise ValueError(f"batch shapes {[tuple(v.batch_shape) for v in self.variables.values()]} do not broadcast") from None

    @property
    def nbatchdims(self) -> int:
        return len(self.batch_shape)

    def _size(self, axis: str) -> int:
        return next((v.tensor.shape[-2] for v in self.variables.values() if v.axis == axis), 1)

    @property
    def shape(self) -> tuple:
        """``(*batch, N, M)`` for a scalar formula, ``(*batch, N, M, D)`` otherwise (a missing axis counts 1)."""
        core = (self._size("i"), self._size("j")) + ((self.width,) if self.width != 1 else ())
        return self.batch_shape + core

    def dim(self) -> int:
        """Number of dimensions of the symbolic array, with the feature axis (KeOps's ``dim()``)."""
        return self.nbatchdims + 3

    @property
    def dtype(self):
        """The variables' dtype (a NumPy dtype for a formula of NumPy arrays), None for a constant."""
        tensors = [v for v in self.variables.values() if not v.follows_dtype]
        if not tensors:
            return None
        dtype = tensors[0].tensor.dtype
        return torch.empty((), dtype=dtype).numpy().dtype if all(v.numpy for v in tensors) else dtype

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

    def _vector(self, expr: sympy.Expr, *others: "LazyTensor", width: int) -> "LazyTensor":
        """A feature-vector operation (indexing, products) of ``width`` features."""
        return LazyTensor._build(expr, self, *others, width=width)

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

    def power(self, other):
        """``self ** other`` (KeOps's method spelling)."""
        return self**other

    def __neg__(self):
        return self._unary(lambda a: -a)

    def __abs__(self):
        return self.abs()

    def __or__(self, o):
        """``x | y``: the dot product over features (feature size 1)."""
        return self._contract(lambda a, b: a * b, o)

    def __ror__(self, o):
        return as_lazy(o) | self

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

    # -- elementwise functions ----------------------------------------------
    def exp(self):
        return self._unary(sympy.exp)

    def log(self):
        return self._unary(lambda a: -sympy.oo if a == 0 else sympy.log(a))  # log(0) = -inf, as torch

    def xlogx(self):
        """x log x, 0 at x = 0 (KeOps's XLogX)."""
        return self._unary(ir.XLogX)

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

    def asin(self):
        return self._unary(sympy.asin)

    def acos(self):
        return self._unary(sympy.acos)

    def atan(self):
        return self._unary(sympy.atan)

    def atan2(self, other):
        """atan2(self, other): the angle of the point (other, self), as ``torch.atan2(self, other)``."""
        return self._binary(other, sympy.atan2)

    def sinxdivx(self):
        """sin(x) / x, 1 at x = 0 (KeOps's SinXDivX); derivatives of every order are finite at 0."""
        return self._unary(ir.sinxdivx)

    def sinc(self):
        """sin(pi x) / (pi x), as ``torch.sinc`` and KeOps."""
        return (math.pi * self).sinxdivx()

    def sigmoid(self):
        return self._unary(ir.Sigmoid)

    def relu(self):
        return self._unary(ir.Relu)

    def step(self):
        """1 where x >= 0, else 0 (KeOps's Step: step(0) = 1)."""
        return self._unary(lambda a: ir.numeric(sympy.GreaterThan(a, 0)))

    def square(self):
        return self._unary(lambda a: a**2)

    def sign(self):
        return self._unary(sympy.sign)

    def floor(self):
        return self._unary(ir.Floor)

    def round(self, decimals: int = 0):
        """x rounded to ``decimals`` places, halves away from zero (KeOps's Round, C's round; not torch's half-to-even)."""
        if isinstance(decimals, bool) or not isinstance(decimals, int):
            raise TypeError(f"round: decimals must be an int, got {decimals!r}")
        return self._unary(lambda a: ir.Round(a, sympy.Integer(decimals)))

    def mod(self, modulus, offset=0):
        """x - modulus * floor((x - offset) / modulus): in [offset, offset + modulus) (KeOps's Mod; NumPy's mod for offset 0)."""
        n, d = as_lazy(modulus), as_lazy(offset)
        x, ne, de = ir.numeric(self.expr), ir.numeric(n.expr), ir.numeric(d.expr)
        return LazyTensor._build(x - ne * ir.Floor((x - de) / ne), self, n, d)

    def clamp(self, low, high):
        """min(max(self, low), high); bounds are numbers or formulas (as torch.clamp with tensor bounds)."""
        for name, bound in (("low", low), ("high", high)):
            if isinstance(bound, bool) or not isinstance(bound, (int, float, LazyTensor)):
                raise TypeError(f"clamp: {name} must be a number or a LazyTensor, got {type(bound).__name__}")
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
            raise ValueError(f"clamp expects low <= high, got low={low!r}, high={high!r}")
        lo, hi = as_lazy(low), as_lazy(high)
        return LazyTensor._build(ir.Clamp(ir.numeric(self.expr), ir.numeric(lo.expr), ir.numeric(hi.expr)), self, lo, hi)

    def ifelse(self, if_true, if_false):
        """``if_true`` where self >= 0, else ``if_false`` (KeOps's IfElse)."""
        return where(self >= 0, if_true, if_false)

    # -- feature contractions and vectors ------------------------------------
    def sqnorm2(self):
        return self._contract(lambda a: a**2)

    def norm2(self):
        return self.sqnorm2().sqrt()

    def norm(self, dim=-1):
        """The Euclidean norm over features (KeOps supports only the last axis)."""
        if not self._is_feature_dim(dim):
            raise ValueError(f"norm: only the feature axis (dim=-1) is supported, got dim={dim!r}")
        return self.norm2()

    def normalize(self):
        """x / |x|, and 0 for x = 0 (KeOps: Rsqrt(0) = 0)."""
        inverse = ir.ZeroSafePow(ir.feature_sum(ir.numeric(self.expr) ** 2, self.width), sympy.Rational(-1, 2))
        return LazyTensor._build(ir.numeric(self.expr) * inverse, self)

    def sqdist(self, o):
        return self._contract(lambda a, b: (a - b) ** 2, o)

    def dot(self, o):
        return self | o

    def weightedsqnorm(self, w):
        """sum_d w_d x_d^2 for w of 1 or D features; sum_de w_de x_d x_e for w of D*D features (KeOps's WeightedSqNorm)."""
        w = as_lazy(w)
        d = self.width
        if w.width == d * d and d > 1:
            rows = ir.Gather(ir.numeric(self.expr), ir.index_tuple(m // d for m in range(d * d)))
            cols = ir.Gather(ir.numeric(self.expr), ir.index_tuple(m % d for m in range(d * d)))
            return LazyTensor._build(ir.feature_sum(ir.numeric(w.expr) * rows * cols, d * d), self, w, width=1)
        if w.width not in (1, d):
            raise ValueError(f"weightedsqnorm: weights must have 1, D or D*D features (D = {d}), got {w.width}")
        return self._contract(lambda a, b: b * a**2, w)

    def weightedsqdist(self, other, w):
        """(self - other).weightedsqnorm(w)."""
        return (self - other).weightedsqnorm(w)

    def difference_matrix(self, other):
        """out[j * D + i] = self[i] - other[j] for self of D and other of E features (D * E features)."""
        other = as_lazy(other)
        d, e = self.width, other.width
        a = ir.Gather(ir.numeric(self.expr), ir.index_tuple(k % d for k in range(d * e)))
        b = ir.Gather(ir.numeric(other.expr), ir.index_tuple(k // d for k in range(d * e)))
        return self._vector(a - b, other, width=d * e)

    # -- indexing, concatenation, one-hot -------------------------------------
    def elem(self, i: int):
        """Feature i (feature size 1)."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.width:
            raise ValueError(f"elem: index must be an int in [0, {self.width}), got {i!r}")
        return self._vector(ir.Gather(ir.numeric(self.expr), ir.index_tuple([i])), width=1)

    def extract(self, start: int, size: int):
        """Features start, ..., start + size - 1."""
        for name, v in (("start", start), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"extract: {name} must be an int, got {v!r}")
        if not (0 <= start < self.width and size >= 1 and start + size <= self.width):
            raise ValueError(f"extract: [start, start + size) = [{start}, {start + size}) is not inside [0, {self.width})")
        return self._vector(ir.Gather(ir.numeric(self.expr), ir.index_tuple(range(start, start + size))), width=size)

    def __getitem__(self, key):
        """``x[k]`` is ``elem(k)``, ``x[a:b]`` is ``extract(a, b - a)``, also after ``...`` or ``:`` (features only)."""
        if isinstance(key, tuple):
            rest = [k for k in key[:-1] if k is not Ellipsis]
            if not key or any(k != slice(None) for k in rest):
                raise ValueError(f"a LazyTensor is indexed over its feature axis only, got {key!r}")
            key = key[-1]
        if isinstance(key, slice):
            start, stop, step = key.indices(self.width)
            if step != 1 or stop <= start:
                raise ValueError(f"feature slices need step 1 and a non-empty range, got {key!r}")
            return self.extract(start, stop - start)
        if isinstance(key, int) and not isinstance(key, bool):
            return self.elem(key + self.width if key < 0 else key)
        raise ValueError(f"a LazyTensor is indexed by an int or a slice of features, got {key!r}")

    def concat(self, other):
        """Features of self, then features of other."""
        other = as_lazy(other)
        d, e = self.width, other.width
        first = ir.Scatter(ir.numeric(self.expr), ir.index_tuple(range(d)), sympy.Integer(d + e))
        second = ir.Scatter(ir.numeric(other.expr), ir.index_tuple(range(d, d + e)), sympy.Integer(d + e))
        return self._vector(first + second, other, width=d + e)

    @staticmethod
    def concatenate(lazies, axis=-1):
        """Concatenation of a tuple of LazyTensors over the feature axis."""
        if not isinstance(lazies, (tuple, list)) or not lazies:
            raise ValueError("concatenate expects a non-empty tuple of LazyTensors")
        first = as_lazy(lazies[0])
        if not first._is_feature_dim(axis):
            raise ValueError(f"LazyTensors concatenate over the feature axis only (axis=-1), got axis={axis!r}")
        out = first
        for other in lazies[1:]:
            out = out.concat(other)
        return out

    @staticmethod
    def cat(lazies, dim=-1):
        """torch-style name of ``concatenate``."""
        return LazyTensor.concatenate(lazies, dim)

    def one_hot(self, size: int):
        """A vector of ``size`` features: 1 at position round(x) (KeOps: floor(x + 0.5)), 0 elsewhere; derivative 0."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"one_hot: size must be a positive int, got {size!r}")
        if self.width != 1:
            raise ValueError(f"one_hot needs a formula of feature size 1, got {self.width}")
        if not self.variables:
            raise ValueError("one_hot needs a formula of variables, got a constant")
        return self._vector(ir.OneHot(ir.numeric(self.expr), sympy.Integer(size)), width=size)

    # -- products of feature vectors ----------------------------------------
    def matvecmult(self, v):
        """self (A*B features: an A x B matrix, row-major) times v (B features): A features."""
        v = as_lazy(v)
        a, b = _factor(self.width, v.width, "matvecmult")
        tiled = ir.Gather(ir.numeric(v.expr), ir.index_tuple(m % b for m in range(a * b)))
        product = ir.numeric(self.expr) * tiled
        return self._vector(ir.Scatter(product, ir.index_tuple(m // b for m in range(a * b)), sympy.Integer(a)), v, width=a)

    def vecmatmult(self, m):
        """self (A features) times m (A*B features: an A x B matrix, row-major): B features."""
        m = as_lazy(m)
        a, b = self.width, _factor(m.width, self.width, "vecmatmult")[0]
        repeated = ir.Gather(ir.numeric(self.expr), ir.index_tuple(k // b for k in range(a * b)))
        product = repeated * ir.numeric(m.expr)
        return self._vector(ir.Scatter(product, ir.index_tuple(k % b for k in range(a * b)), sympy.Integer(b)), m, width=b)

    def tensorprod(self, other):
        """The outer product of the feature vectors, flattened row-major: out[i * E + j] = self[i] other[j]."""
        other = as_lazy(other)
        d, e = self.width, other.width
        a = ir.Gather(ir.numeric(self.expr), ir.index_tuple(k // e for k in range(d * e)))
        b = ir.Gather(ir.numeric(other.expr), ir.index_tuple(k % e for k in range(d * e)))
        return self._vector(a * b, other, width=d * e)

    def keops_tensordot(self, other, dimfa, dimfb, contfa, contfb, *permute):
        """``torch.tensordot`` of the features seen as tensors of shapes ``dimfa`` and ``dimfb``.

        ``contfa`` / ``contfb`` are the contracted axes (paired in order, as
        ``tensordot(a, b, dims=(contfa, contfb))``); the result's axes (a's kept
        axes, then b's) are flattened row-major, after the optional KeOps
        ``permute``: kept axis k goes to position ``permute[k]``.
        """
        other = as_lazy(other)
        plan = _tensordot_plan(dimfa, dimfb, contfa, contfb, permute[0] if permute else None, self.width, other.width)
        ia, ib, out_index, size = plan
        product = ir.Gather(ir.numeric(self.expr), ir.index_tuple(ia)) * ir.Gather(ir.numeric(other.expr), ir.index_tuple(ib))
        return self._vector(ir.Scatter(product, ir.index_tuple(out_index), sympy.Integer(size)), other, width=size)

    def keops_kron(self, other, dimfself, dimfother):
        """The Kronecker product of the features seen as tensors (``torch.kron``), flattened row-major."""
        if len(dimfself) != len(dimfother):
            raise ValueError(f"keops_kron: dimfself and dimfother need the same number of axes, got {dimfself} and {dimfother}")
        n = len(dimfself)
        permute = [2 * k for k in range(n)] + [2 * k + 1 for k in range(n)]
        return self.keops_tensordot(other, dimfself, dimfother, (), (), permute)

    # -- feature-axis reductions ---------------------------------------------
    def _is_feature_dim(self, dim) -> bool:
        return dim in _FEATURES or (isinstance(dim, int) and not isinstance(dim, bool) and dim in (2, self.nbatchdims + 2))

    def _feature_min(self, sign: int):
        x = ir.numeric(self.expr) * sign
        return LazyTensor._build(ir.FeatureMin(x) * sign, self, width=1)

    def _feature_argmin(self, sign: int):
        return LazyTensor._build(ir.FeatureArgMin(ir.numeric(self.expr) * sign), self, width=1)

    # -- reductions -----------------------------------------------------------
    def sum(self, dim=1, *, dtype_acc=None, **options):
        """Sum over j (dim=1 / "j"), over i (dim=0 / "i"), or over features (dim=-1: a formula).

        ``dtype_acc`` (e.g. ``torch.float64`` for a float32 formula): the dtype
        the sum is formed and accumulated in, and the result's dtype.
        """
        if self._is_feature_dim(options.get("axis", dim)):
            _feature_options(options if dtype_acc is None else {**options, "dtype_acc": dtype_acc})
            return self._contract(lambda a: a)

        compensated = options.get("sum_scheme") == "kahan_scheme" and dtype_acc is None

        def make(e, p):
            acc = torch.float64 if compensated and p.dtype == torch.float32 else dtype_acc
            return reductions.Sum(e, p.info, self.width, dtype_acc=reductions.accumulation_dtype(acc, p.dtype))

        out = self._reduce(make, dim, options)[0]
        if compensated:  # the result in the formula's dtype, as KeOps returns it
            out = out.astype(self.dtype) if isinstance(out, np.ndarray) else out.to(self.dtype)
        return out

    sum_reduction = sum

    def logsumexp(self, dim=1, weight=None, **options):
        """log sum exp over the axis; with ``weight`` (KeOps's LogSumExpWeight): log sum_j exp(F_ij) w_ij per feature of w."""
        if weight is None:
            return self._reduce(lambda e, p: reductions.LogSumExp(e, p.info), dim, options, public=self._first_widened)[0]
        weight = self._along(weight, dim)
        make = lambda e, p: reductions.LogSumExpWeight(e, ir.numeric(weight.expr), p.info)  # noqa: E731
        return self._reduce(make, dim, options, values=weight)[0]

    logsumexp_reduction = logsumexp

    def max_sumshiftexp(self, dim=1, weight=None, **options):
        """KeOps's Max_SumShiftExp(Weight): m = max F and s = sum exp(F - m) w (w = 1 by default) as one (..., 1 + E) tensor."""
        weight = None if weight is None else self._along(weight, dim)
        expr = sympy.Integer(1) if weight is None else ir.numeric(weight.expr)
        make = lambda e, p: reductions.MaxSumShiftExp(e, expr, p.info)  # noqa: E731
        return self._reduce(make, dim, options, values=weight, public=lambda outs: (torch.cat(outs[:2], -1),))[0]

    def softmax_weighted_sum(self, values, dim=1, **options):
        """sum_j softmax_j(F_ij) * values_j (values: LazyTensor or dense (M, E) tensor)."""
        values = self._along(values, dim)
        make = lambda e, p: reductions.SoftmaxWeightedSum(e, ir.numeric(values.expr), p.info)  # noqa: E731
        return self._reduce(make, dim, options, values=values)[0]

    sumsoftmaxweight = sumsoftmaxweight_reduction = softmax_weighted_sum

    def min_argmin(self, dim=1, **options):
        return self._reduce(lambda e, p: reductions.ArgMin(e, p.info), dim, options, public=self._widened)

    def min(self, dim=1, **options):
        """Minimum over j or i; over features (dim=-1) a formula, as KeOps."""
        if self._is_feature_dim(options.get("axis", dim)):
            _feature_options(options)
            return self._feature_min(1)
        return self._reduce(lambda e, p: reductions.ArgMin(e, p.info), dim, options, public=self._first_widened)[0]

    def argmin(self, dim=1, **options):
        if self._is_feature_dim(options.get("axis", dim)):
            _feature_options(options)
            return self._feature_argmin(1)
        return self._reduce(lambda e, p: reductions.ArgMin(e, p.info), dim, options, public=self._second_widened)[0]

    def max_argmax(self, dim=1, **options):
        return self._reduce(lambda e, p: reductions.ArgMax(e, p.info), dim, options, public=self._widened)

    def max(self, dim=1, **options):
        if self._is_feature_dim(options.get("axis", dim)):
            _feature_options(options)
            return self._feature_min(-1)
        return self._reduce(lambda e, p: reductions.ArgMax(e, p.info), dim, options, public=self._first_widened)[0]

    def argmax(self, dim=1, **options):
        if self._is_feature_dim(options.get("axis", dim)):
            _feature_options(options)
            return self._feature_argmin(-1)
        return self._reduce(lambda e, p: reductions.ArgMax(e, p.info), dim, options, public=self._second_widened)[0]

    min_reduction, max_reduction = min, max
    argmin_reduction, argmax_reduction = argmin, argmax
    min_argmin_reduction, max_argmax_reduction = min_argmin, max_argmax

    def kmin_argkmin(self, k: int, dim=1, **options):
        """The k smallest values over the axis and their indices, ascending; (N, k) when C == 1."""
        return self._kmin(k, dim, options, lambda outs: outs)

    def kmin(self, k: int, dim=1, **options):
        return self._kmin(k, dim, options, lambda outs: outs[:1])[0]

    def argkmin(self, k: int, dim=1, **options):
        return self._kmin(k, dim, options, lambda outs: outs[1:])[0]

    Kmin, argKmin, Kmin_argKmin = kmin, argkmin, kmin_argkmin
    Kmin_reduction, argKmin_reduction, Kmin_argKmin_reduction = kmin, argkmin, kmin_argkmin

    def _kmin(self, k, dim, options, pick):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")

        def make(e, problem):
            if k > problem.reduced_size:
                raise ValueError(f"k={k} is larger than the {problem.reduced_size} entries reduced over")
            return reductions.KMin(e, problem.info, k)

        squeezed = lambda outs: tuple(o.squeeze(-1) if o.shape[-1] == 1 else o for o in self._widened(outs))  # noqa: E731
        return self._reduce(make, dim, options, public=lambda outs: pick(squeezed(outs)))

    def quantile(self, q, dim=1, **options):
        """Exact q-quantile over the axis with torch.quantile's linear interpolation."""
        if options.get("ranges", self.ranges) is not None:
            raise ValueError("quantile does not support ranges (block-sparse reductions)")
        make = lambda e, p: reductions.Quantile(e, p.info, q, p.reduced_size, p.dtype, p.device)  # noqa: E731

        def public(outs):  # (..., rows, Q, C)
            if not isinstance(q, torch.Tensor) or q.dim() == 0:
                return (self._widen(outs[0][..., 0, :]),)
            return (outs[0].squeeze(-1) if outs[0].shape[-1] == 1 else outs[0],)

        return self._reduce(make, dim, options, public=public)[0]

    def _widened(self, outs: tuple) -> tuple:
        return tuple(self._widen(o) for o in outs)

    def _first_widened(self, outs: tuple) -> tuple:
        return (self._widen(outs[0]),)

    def _second_widened(self, outs: tuple) -> tuple:
        return (self._widen(outs[1]),)

    # -- linear operator: K @ v, K.T, matvec / rmatvec --------------------------
    def matmul(self, b, **options):
        """K @ b for a scalar formula K_ij and a dense (M,), (M, C) or (*batch, M, C) tensor or array."""
        if not isinstance(b, (torch.Tensor, np.ndarray)):
            raise TypeError(f"matmul expects a dense tensor or array b, got {type(b).__name__}")
        if self.width != 1:
            raise ValueError(f"K @ b needs a formula of feature size 1, got {self.width}")
        vector = b.ndim == 1
        if vector and options.get("out") is not None:
            options = {**options, "out": options["out"][..., None]}
        options = {"ranges": self.ranges, **options}
        out = (self * LazyTensor(b[:, None] if vector else b, "j")).sum("j", **options)
        return out[..., 0] if vector else out

    __matmul__ = matmul

    def matvec(self, v):
        """K @ v (scipy.sparse.linalg.LinearOperator's name)."""
        return self @ v

    def rmatvec(self, v):
        """K.T @ v."""
        return self.T @ v

    def t(self):
        """The transpose: i-variables become j-variables and back (a (B, M, N, D) array)."""
        renamed, variables = {}, {}
        for s, v in self.variables.items():
            if v.axis == "p":
                variables[s] = v
                continue
            new = ir.new_variable_symbol()
            renamed[s] = new
            variables[new] = _Variable({"i": "j", "j": "i"}[v.axis], v.tensor, v.follows_dtype, v.numpy)
        out = type(self).__new__(type(self))
        out.expr, out.variables, out.width = self.expr.xreplace(renamed), variables, self.width
        out.ranges = None if self.ranges is None else (*self.ranges[3:6], *self.ranges[0:3])
        return out

    @property
    def T(self):
        return self.t()

    def solve(self, b, alpha: float = 1e-10, **options):
        """Solve (K + alpha I) a = b for a symmetric positive definite K_ij (KeOps's KernelSolve); see ``lazytensor.solve``."""
        from .solve import kernel_solve

        return kernel_solve(self, b, alpha, **options)

    # -- running ------------------------------------------------------------
    def problem(self, axis: str) -> tuple[Problem, tuple]:
        """The engine problem reducing over ``axis`` (variables validated, batch dims flattened) and the batch shape."""
        _check_variables(self.variables)
        info = self.info
        other = "i" if axis == "j" else "j"
        if not any(v.axis == axis for v in info.values()):
            size = "M (the number of j indices)" if axis == "j" else "N (the number of i indices)"
            raise ValueError(f"cannot reduce over {axis!r}: the formula has no {axis}-indexed variable, so the reduced size "
                             f"{size} is unknown; multiply by a {axis}-variable of that length (e.g. a column of ones)")
        batch = self.batch_shape
        flat = math.prod(batch)
        tensors, info = {}, dict(info)
        for s, v in self.variables.items():
            tensors[s] = _flatten_batch(v, batch, flat)
        if not any(v.axis == other for v in info.values()):  # an i-only (j-only) formula: the kept axis has size 1
            anchor = next(iter(tensors.values()))
            missing = ir.new_variable_symbol()
            info[missing] = ir.VarInfo(other, 1)
            tensors[missing] = anchor.new_zeros(1, 1, 1)
        problem = Problem(info, tensors)
        return (problem.swapped() if axis == "i" else problem), batch

    def _along(self, values, dim) -> "LazyTensor":
        """A weight or values argument: a LazyTensor, or a dense tensor indexed like the reduced axis."""
        if isinstance(values, (torch.Tensor, np.ndarray)):
            return LazyTensor(values, _axis(dim))
        return as_lazy(values)

    def _reduce(self, make, dim, options: dict, *, values: "LazyTensor | None" = None, public=lambda outs: outs[:1]) -> tuple:
        """Run the reduction ``make(expr, problem)`` over ``dim``: its ``public`` outputs, shaped (*batch, rows, ...).

        Under a sharding (``group=`` or ``lazytensor.distributed.sharded``) the
        reduced axis's variables are this rank's shard; ``problem.reduced_size``
        is the total.
        """
        unknown = sorted(set(options) - set(REDUCTION_OPTIONS))
        if unknown:
            hint = " (dtype_acc is an option of sum and K @ b)" if "dtype_acc" in unknown else ""
            raise TypeError(f"unexpected reduction option(s) {unknown}{hint}; known: {list(REDUCTION_OPTIONS)}")
        if options.get("sum_scheme", "auto") not in SUM_SCHEMES:
            raise ValueError(f"sum_scheme must be one of {list(SUM_SCHEMES)}, got {options['sum_scheme']!r}")
        if options.get("axis") is not None:
            dim = options["axis"]
        axis = _axis(dim, self.nbatchdims)
        backend = engine.check_backend(options.get("backend", "auto"))
        chunk_size = options.get("chunk_size")
        check_chunk_size(chunk_size)
        source = self if values is None else LazyTensor._build(self.expr, self, values, width=self.width)
        problem, batch = source.problem(axis)
        ranges = check_ranges(cluster.keops_ranges(options.get("ranges", self.ranges)), problem, axis)
        if ranges is not None and batch:
            raise ValueError("ranges (block-sparse reductions) are not supported with batch dimensions")
        sharding = distributed.active(options.get("group"))
        if sharding is not None:
            if ranges is not None:
                raise ValueError("ranges (block-sparse reductions) are not supported with a sharded (group=) reduction")
            problem = problem.sharded_over(sum(sharding.sizes(problem.size("j"), problem.device)))
        reduction = make(ir.numeric(self.expr), problem)
        ((outs),) = autograd.reduce(problem, [reduction], backend, chunk_size, ranges=ranges, sharding=sharding)
        outs = public(tuple(o.reshape(*batch, *o.shape[1:]) for o in outs))
        return _deliver(outs, options.get("out"), source._numpy)

    @property
    def _numpy(self) -> bool:
        """Whether results are NumPy arrays: every array variable came from NumPy."""
        arrays = [v for v in self.variables.values() if not v.follows_dtype]
        return bool(arrays) and all(v.numpy for v in arrays)

    def _widen(self, out):
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
    """A variable's axis and tensor: (*batch, N, D) for i/j, (*batch, D) for parameters.

    ``follows_dtype`` marks parameters made from Python numbers: they take the
    dtype and device of the other variables when the formula runs; ``numpy``
    marks arrays that came from NumPy (their results go back as NumPy).
    """

    __slots__ = ("axis", "tensor", "follows_dtype", "numpy")

    def __init__(self, axis: str, tensor: torch.Tensor, follows_dtype: bool = False, numpy: bool = False):
        self.axis, self.tensor, self.follows_dtype, self.numpy = axis, tensor, follows_dtype, numpy

    @property
    def batch_shape(self) -> torch.Size:
        return self.tensor.shape[:-1] if self.axis == "p" else self.tensor.shape[:-2]


def _keops_layout(x: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The axis from KeOps-style singleton dims: (..., N, 1, D) -> i, (..., 1, M, D) -> j, (..., 1, 1, D) -> p."""
    if x.dim() >= 3:
        if x.shape[-3] == 1 and x.shape[-2] == 1:
            return x.squeeze(-2).squeeze(-2), "p"
        if x.shape[-2] == 1:
            return x.squeeze(-2), "i"
        if x.shape[-3] == 1:
            return x.squeeze(-3), "j"
        raise ValueError(
            f"cannot tell the axis of a tensor of shape {tuple(x.shape)}: use x[:, None, :] for i, y[None, :, :] for j, "
            "p[None, None, :] for a parameter, or Vi/Vj/Pm"
        )
    if x.dim() <= 1:
        return x, "p"
    raise ValueError(f"cannot tell the axis of a 2-D tensor of shape {tuple(x.shape)}: use Vi(x), Vj(y), Pm(p) or axis=0/1/2")


def _axis_name(axis) -> str:
    """'i' / 'j' / 'p', also as KeOps's 0 / 1 / 2."""
    names = {0: "i", 1: "j", 2: "p", "i": "i", "j": "j", "p": "p"}
    if isinstance(axis, bool) or axis not in names:
        raise ValueError(f"axis must be 'i', 'j' or 'p' (or KeOps's 0, 1, 2), got {axis!r}")
    return names[axis]


def _normalize(x: torch.Tensor, axis: str) -> torch.Tensor:
    """i/j variables become (*batch, N, D); parameters (*batch, D)."""
    if not x.is_floating_point():
        raise TypeError(f"variables must be floating-point tensors, got dtype {x.dtype}")
    if axis == "p":
        return x.reshape(1) if x.dim() == 0 else x
    if x.dim() == 0:
        raise ValueError(f"an {axis}-variable must be (N,), (N, D) or (*batch, N, D), got a 0-D tensor")
    return x.reshape(-1, 1) if x.dim() == 1 else x


def _flatten_batch(v: _Variable, batch: tuple, flat: int) -> torch.Tensor:
    """A variable as the engine sees it: (B, N, D) / (B, D) with B the flattened batch, or 1 where it does not vary."""
    t = v.tensor
    core = t.shape[-1:] if v.axis == "p" else t.shape[-2:]
    if all(s == 1 for s in v.batch_shape):
        return t.reshape(1, *core)
    if tuple(v.batch_shape) != tuple(batch):
        t = t.expand(*batch, *core)
    return t.reshape(flat, *core)


def _check_variables(variables: dict) -> None:
    anchor = next((v.tensor for v in variables.values() if not v.follows_dtype), None)
    if anchor is not None:
        for v in variables.values():
            if v.follows_dtype:
                v.tensor = v.tensor.to(dtype=anchor.dtype, device=anchor.device)
    tensors = [(s, v) for s, v in variables.items()]
    if not tensors:
        raise ValueError("the formula has no variables")
    ref = tensors[0][1].tensor
    for _, v in tensors[1:]:
        if v.tensor.dtype != ref.dtype:
            raise TypeError(f"variable dtypes differ: {ref.dtype} and {v.tensor.dtype}; convert them to one dtype")
        if v.tensor.device != ref.device:
            raise ValueError(f"variable devices differ: {ref.device} and {v.tensor.device}")
    kinds = {v.numpy for v in variables.values() if not v.follows_dtype}
    if len(kinds) > 1:
        raise TypeError("a formula mixes NumPy arrays and torch tensors; use one of them (torch.from_numpy converts)")
    sizes: dict[str, set] = {"i": set(), "j": set()}
    for v in variables.values():
        if v.axis in sizes:
            sizes[v.axis].add(v.tensor.shape[-2])
    for axis, found in sizes.items():
        if len(found) > 1:
            raise ValueError(f"{axis}-variables have different lengths {sorted(found)}")


def _axis(dim, nbatchdims: int = 0) -> str:
    """The reduced axis: 1 / 'j' / -2 reduce over j, 0 / 'i' / -3 over i (batch dims are not counted)."""
    if dim in (1, "j", -2):
        return "j"
    if dim in (0, "i", -3):
        return "i"
    hint = (f"; batch dimensions are not counted (KeOps's dim={nbatchdims} / {nbatchdims + 1} is 0 / 1 here)"
            if nbatchdims and dim in (nbatchdims, nbatchdims + 1) else "")
    raise ValueError(f"dim must be 0/'i' or 1/'j' for a reduction, got {dim!r}{hint}")


def _feature_options(options: dict) -> None:
    """A feature-axis min/max/sum is a formula: only ``keepdim`` (ignored: features are always kept) may come with it."""
    unknown = sorted(set(options) - {"axis", "keepdim"})
    if unknown:
        raise TypeError(f"a feature-axis reduction returns a formula and takes no reduction options, got {unknown}")


def _deliver(outs: tuple, out, as_numpy: bool) -> tuple:
    """Results as NumPy arrays when the inputs were, written into ``out`` when given."""
    if as_numpy:
        outs = tuple(o.detach().cpu().numpy() for o in outs)
    if out is None:
        return outs
    targets = out if isinstance(out, (tuple, list)) else (out,)
    if len(targets) != len(outs):
        raise ValueError(f"out: expected {len(outs)} output(s), got {len(targets)}")
    for target, result in zip(targets, outs):
        if not isinstance(target, (torch.Tensor, np.ndarray)) or tuple(target.shape) != tuple(result.shape):
            raise ValueError(f"out must be a {'NumPy array' if as_numpy else 'tensor'} of shape {tuple(result.shape)}, got "
                             f"{type(target).__name__} {tuple(getattr(target, 'shape', ()))}")
        if isinstance(result, torch.Tensor):
            if result.requires_grad and torch.is_grad_enabled():
                raise ValueError("out= does not support automatic differentiation (as torch's out= arguments); "
                                 "drop out= or run under torch.no_grad()")
            target.copy_(result)
        else:
            np.copyto(target, result)
    return tuple(targets)


def _factor(total: int, part: int, name: str) -> tuple[int, int]:
    if part < 1 or total % part:
        raise ValueError(f"{name}: a matrix of {total} features and a vector of {part} features do not match")
    return total // part, part


def _tensordot_plan(dimfa, dimfb, contfa, contfb, permute, width_a: int, width_b: int):
    """Index maps of a tensordot on flattened features: (a index, b index, output index) per term, and the output size."""
    dimfa, dimfb = [int(d) for d in _ints(dimfa)], [int(d) for d in _ints(dimfb)]
    contfa, contfb = [int(c) for c in _ints(contfa)], [int(c) for c in _ints(contfb)]
    if math.prod(dimfa) != width_a or math.prod(dimfb) != width_b:
        raise ValueError(f"keops_tensordot: shapes {dimfa} and {dimfb} do not match feature sizes {width_a} and {width_b}")
    if len(contfa) != len(contfb) or [dimfa[c] for c in contfa] != [dimfb[c] for c in contfb]:
        raise ValueError(f"keops_tensordot: contracted axes {contfa} of {dimfa} and {contfb} of {dimfb} do not match")
    keep_a = [k for k in range(len(dimfa)) if k not in contfa]
    keep_b = [k for k in range(len(dimfb)) if k not in contfb]
    kept = [dimfa[k] for k in keep_a] + [dimfb[k] for k in keep_b]
    order = list(range(len(kept))) if permute is None else [int(p) for p in _ints(permute)]
    if sorted(order) != list(range(len(kept))):
        raise ValueError(f"keops_tensordot: permute must be a permutation of {len(kept)} axes, got {order}")
    out_axes = sorted(range(len(kept)), key=lambda k: order[k])  # kept axis k goes to position order[k]
    out_shape = [kept[k] for k in out_axes]
    ia, ib, io = [], [], []
    for kept_index in itertools.product(*(range(d) for d in kept)):
        for summed in itertools.product(*(range(dimfa[c]) for c in contfa)):
            a, b = [0] * len(dimfa), [0] * len(dimfb)
            for k, v in zip(keep_a, kept_index[: len(keep_a)]):
                a[k] = v
            for k, v in zip(keep_b, kept_index[len(keep_a):]):
                b[k] = v
            for ca, cb, v in zip(contfa, contfb, summed):
                a[ca], b[cb] = v, v
            ia.append(_ravel(a, dimfa))
            ib.append(_ravel(b, dimfb))
            io.append(_ravel([kept_index[k] for k in out_axes], out_shape))
    return ia, ib, io, math.prod(kept)


def _ints(values) -> list:
    return [values] if isinstance(values, int) else list(values)


def _ravel(index, shape) -> int:
    flat = 0
    for i, d in zip(index, shape):
        flat = flat * d + i
    return flat


def as_lazy(x) -> LazyTensor:
    if isinstance(x, LazyTensor):
        return x
    if isinstance(x, (int, float, np.generic)) and not isinstance(x, bool):
        return LazyTensor(x)
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return LazyTensor(x, "p") if x.ndim <= 1 else LazyTensor(x)
    if isinstance(x, sympy.Basic) and not x.free_symbols:
        out = LazyTensor(0)
        out.expr = x
        return out
    raise TypeError(f"cannot combine a LazyTensor with {type(x).__name__}")


def lazy(t, axis) -> LazyTensor:
    """Wrap ``t`` as an "i"- or "j"-indexed variable ((N, D) or (*batch, N, D)) or a parameter ("p": (D,) or (*batch, D))."""
    if not isinstance(t, (torch.Tensor, np.ndarray)):
        raise TypeError(f"lazy expects a torch.Tensor or a NumPy array, got {type(t).__name__}")
    return LazyTensor(t, _axis_name(axis))


def Vi(t) -> LazyTensor:
    return lazy(t, "i")


def Vj(t) -> LazyTensor:
    return lazy(t, "j")


def Pm(t) -> LazyTensor:
    """A parameter (scalar, (D,) or batched (*batch, D) tensor); a Python number follows the formula's dtype."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
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
