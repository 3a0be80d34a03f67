"""LazyTensor: the user-facing formula object.

``Vi(x)`` / ``Vj(y)`` / ``Pm(p)`` wrap tensors as i-indexed, j-indexed and
parameter variables; arithmetic on them builds IR (nothing is computed);
a reduction over i or j runs the streamed engine and returns a tensor.
KeOps users can write ``LazyTensor(x[:, None, :])`` and
``LazyTensor(y[None, :, :])`` instead, with any number of leading batch
dimensions (they broadcast, and are flattened into the engine's one batch
dimension), and NumPy arrays in give NumPy arrays out.

The class only wraps: feature-vector operations are built by ``vectors``,
variables are read and checked by ``variables``, and every reduction is a
name of the ``reductions.named`` table run by ``run``.
"""
from __future__ import annotations

import functools
import math
import operator

import numpy as np
import sympy
import torch

from . import diff, ir, run, variables, vectors
from .opaque import opaque, tracing
from .reductions import named

_FEATURES = ("features", -1)


def is_feature_dim(dim, nbatch: int) -> bool:
    return dim in _FEATURES or (isinstance(dim, int) and not isinstance(dim, bool) and dim in (2, nbatch + 2))


def _operator(fn, reverse: bool = False, doc: str | None = None):
    """A method combining self with another operand entrywise by ``fn`` (``reverse``: fn(other, self))."""
    def method(self, other):
        return self._binary(other, fn, reverse)

    method.__doc__ = doc
    return method


def _elementwise(fn, doc: str | None = None):
    """A method applying the IR function ``fn`` to every entry."""
    def method(self):
        return self._unary(fn)

    method.__doc__ = doc
    return method


def _applied(fn, exprs: tuple, widths: tuple | None = None, options: tuple = ()) -> sympy.Expr:
    """``fn`` of the expressions, or with ``widths`` the feature-vector builder ``fn`` (``vectors``) of
    them with keyword ``options``. Memoised: a sympy operation costs 20-50 us, and a formula written
    in a loop repeats the same ones call after call (expressions compare structurally, by type too)."""
    try:
        hash(options)
    except TypeError:  # an unhashable option (a list index): computed uncached
        return _apply(fn, exprs, widths, options)
    return _applied_cached(fn, exprs, widths, options)


def _apply(fn, exprs: tuple, widths: tuple | None, options: tuple) -> sympy.Expr:
    if widths is None:
        return fn(*(ir.numeric(e) for e in exprs))
    return fn(*(vectors.Vec(ir.numeric(e), w) for e, w in zip(exprs, widths)), **dict(options))


_applied_cached = functools.lru_cache(maxsize=4096)(_apply)


class LazyTensor:
    """A symbolic (*batch, N, M, D) array; see the module docstring."""

    __array_priority__ = 1000  # make `tensor * lazy` dispatch to us
    __array_ufunc__ = None  # and `ndarray * lazy` too
    ranges = None  # KeOps's block-sparsity attribute: ``K.ranges = from_matrix(...)`` applies to K's reductions

    # Inside a caller's torch.compile, Dynamo would trace sympy and the tile engine (17 s at the first call, then
    # 2 ms a call at 40 x 50, with two dozen warnings); as opaque calls (graph breaks) 2.2 s, then 0.66 ms.
    # ``opaque`` is ``torch.compiler.disable`` that leaves Dynamo unimported until the caller imports it.
    def __new__(cls, x=None, axis=None, *args, **kwargs):
        """While a compiler traces, ``cls(x, axis)`` is recorded instead (``library.Deferred``, of flavour ``cls``);
        other arguments (KeOps's ``is_complex``) go to the eager constructor, which reads them."""
        if x is not None and not (args or kwargs) and tracing() and (recorded := _recorded("new", cls, x, axis)) is not None:
            return recorded
        return super().__new__(cls)

    @opaque
    def __init__(self, x, axis=None):
        if isinstance(x, LazyTensor):
            self.expr, self.variables, self.width, self.ranges = x.expr, x.variables, x.width, x.ranges
        else:
            self.expr, self.variables, self.width = variables.wrap(x, axis)

    # -- construction -------------------------------------------------------
    @classmethod
    @opaque
    def _build(cls, make, *parents: "LazyTensor", width: int | None = None) -> "LazyTensor":
        """The formula ``make(*expressions)`` of the parents, their variables merged (``variables.aligned``).

        ``make`` returns an expression, or a ``vectors.Vec`` that also gives the
        feature size. ``width`` is the feature size; by default the broadcast of
        the parents' and the expression's, so that ``x - x`` keeps x's size after
        sympy folds it to 0. Feature contractions pass 1.
        """
        kind = next((type(p) for p in parents if type(p) is not LazyTensor), cls)  # a flavour (lazytensor.keops) sticks
        out = kind.__new__(kind)
        exprs, out.variables = variables.aligned([(p.expr, p.variables) for p in parents])
        out.ranges = next((p.ranges for p in parents if p.ranges is not None), None)
        made = make(*exprs)
        if isinstance(made, vectors.Vec):
            made, width = made
        out.expr = made
        widths = {ir.feature_dim(made, variables.info(out.variables))}  # raises on feature sizes that do not broadcast
        if width is None:
            widths |= {p.width for p in parents}
        widths.discard(1)
        if len(widths) > 1:
            raise ValueError(f"feature sizes {sorted(widths)} do not broadcast in {made}")
        out.width = width if width is not None else (widths.pop() if widths else 1)
        return out

    @property
    def info(self) -> dict[sympy.Symbol, ir.VarInfo]:
        return variables.info(self.variables)

    @property
    def ndim_features(self) -> int:
        """Feature size of the formula (KeOps calls it ``ndim``)."""
        return self.width

    ndim = ndim_features

    # -- shape, as KeOps: (*batch, N, M) or (*batch, N, M, D) -------------------------
    @property
    def batch_shape(self) -> tuple:
        return variables.batch_shape(self.variables)

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

    @property
    def _numpy(self) -> bool:
        """Whether results are NumPy arrays: every array variable came from NumPy."""
        return variables.from_numpy(self.variables)

    def _unary(self, fn) -> "LazyTensor":
        return LazyTensor._build(lambda a: _applied(fn, (a,)), self)

    def _binary(self, other, fn, reverse: bool = False) -> "LazyTensor":
        other = as_lazy(other)
        a, b = (other, self) if reverse else (self, other)
        return LazyTensor._build(lambda x, y: _applied(fn, (x, y)), a, b)

    def _vector(self, builder, *others, **arguments) -> "LazyTensor":
        """The feature-vector operation ``builder`` (see ``vectors``) of self and ``others``."""
        operands = (self, *(as_lazy(o) for o in others))
        widths, options = tuple(o.width for o in operands), tuple(sorted(arguments.items()))
        return LazyTensor._build(lambda *exprs: _applied(builder, exprs, widths, options), *operands)

    # -- arithmetic and elementwise functions -------------------------------------
    __add__, __radd__ = _operator(operator.add), _operator(operator.add, reverse=True)
    __sub__, __rsub__ = _operator(operator.sub), _operator(operator.sub, reverse=True)
    __mul__, __rmul__ = _operator(operator.mul), _operator(operator.mul, reverse=True)
    __truediv__, __rtruediv__ = _operator(operator.truediv), _operator(operator.truediv, reverse=True)
    __rpow__ = _operator(operator.pow, reverse=True)
    # a formula, as torch's comparisons: 1 where it holds, else 0 (NaN compares false, so x >= x is not folded)
    __lt__, __le__ = (_operator(lambda a, b, kind=kind: _relation(kind, a, b)) for kind in (sympy.Lt, sympy.Le))
    __gt__, __ge__ = (_operator(lambda a, b, kind=kind: _relation(kind, a, b)) for kind in (sympy.Gt, sympy.Ge))
    __eq__ = _operator(lambda a, b: _relation(sympy.Eq, a, b))
    __ne__ = _operator(lambda a, b: _relation(sympy.Ne, a, b))
    __hash__ = object.__hash__
    atan2 = _operator(ir.Atan2, doc="The angle of the point (other, self), as ``torch.atan2(self, other)``.")

    def __pow__(self, o):
        if isinstance(o, float) and o.is_integer():
            o = int(o)
        if isinstance(o, float):
            o = sympy.nsimplify(o) if abs(o * 2 - round(o * 2)) < 1e-12 else o
        return self._binary(o, operator.pow)

    def power(self, other):
        """``self ** other`` (KeOps's method spelling)."""
        return self**other

    __neg__ = _elementwise(operator.neg)
    exp, sqrt, sin, cos, tanh = (_elementwise(f) for f in (sympy.exp, sympy.sqrt, sympy.sin, sympy.cos, sympy.tanh))
    asin, acos, atan, sign = (_elementwise(f) for f in (sympy.asin, sympy.acos, sympy.atan, sympy.sign))
    abs = __abs__ = _elementwise(sympy.Abs)
    sigmoid, relu, floor = _elementwise(ir.Sigmoid), _elementwise(ir.Relu), _elementwise(ir.Floor)
    log = _elementwise(lambda a: -sympy.oo if a == 0 else sympy.log(a), "log(x); log(0) = -inf, as torch.")
    rsqrt = _elementwise(lambda a: 1 / sympy.sqrt(a))
    square = _elementwise(lambda a: a**2)
    xlogx = _elementwise(ir.XLogX, "x log x, 0 at x = 0 (KeOps's XLogX).")
    sinxdivx = _elementwise(ir.sinxdivx, "sin(x) / x, 1 at x = 0 (KeOps's SinXDivX); derivatives of every order are finite at 0.")
    step = _elementwise(lambda a: ir.numeric(sympy.GreaterThan(a, 0)), "1 where x >= 0, else 0 (KeOps's Step: step(0) = 1).")

    def sinc(self):
        """sin(pi x) / (pi x), as ``torch.sinc`` and KeOps."""
        return (math.pi * self).sinxdivx()

    def round(self, decimals: int = 0):
        """x rounded to ``decimals`` places, halves away from zero (KeOps's Round, C's round; not torch's half-to-even)."""
        if isinstance(decimals, bool) or not isinstance(decimals, int):
            raise TypeError(f"round: decimals must be an int, got {decimals!r}")
        return self._unary(lambda a: ir.Round(a, sympy.Integer(decimals)))

    def mod(self, modulus, offset=0):
        """x - modulus * floor((x - offset) / modulus): in [offset, offset + modulus) (KeOps's Mod; NumPy's mod for offset 0)."""
        def make(x, n, d):
            x, n, d = ir.numeric(x), ir.numeric(n), ir.numeric(d)
            return x - n * ir.Floor((x - d) / n)

        return LazyTensor._build(make, self, as_lazy(modulus), as_lazy(offset))

    def clamp(self, low, high):
        """min(max(self, low), high); bounds are numbers, formulas or tensors read as the operators read them
        (torch.clamp with tensor bounds; pykeops wraps tensor bounds too)."""
        for name, bound in (("low", low), ("high", high)):
            if isinstance(bound, bool) or not isinstance(bound, (int, float, LazyTensor, torch.Tensor, np.ndarray)):
                raise TypeError(f"clamp: {name} must be a number, a LazyTensor or a tensor, got {type(bound).__name__}")
        if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
            raise ValueError(f"clamp expects low <= high, got low={low!r}, high={high!r}")
        lo, hi = as_lazy(low), as_lazy(high)
        return LazyTensor._build(lambda x, a, b: ir.Clamp(*map(ir.numeric, (x, a, b))), self, lo, hi)

    def ifelse(self, if_true, if_false):
        """``if_true`` where self >= 0, else ``if_false`` (KeOps's IfElse)."""
        return where(self >= 0, if_true, if_false)

    # -- feature contractions and vectors (built by ``vectors``) ----------------------
    def sqnorm2(self):
        return self._vector(vectors.sqnorm2)

    def norm2(self):
        return self.sqnorm2().sqrt()

    def norm(self, dim=-1):
        """The Euclidean norm over features (KeOps supports only the last axis)."""
        if not self._is_feature_dim(dim):
            raise ValueError(f"norm: only the feature axis (dim=-1) is supported, got dim={dim!r}")
        return self.norm2()

    def normalize(self):
        """x / |x|, and 0 for x = 0 (KeOps: Rsqrt(0) = 0)."""
        return self._vector(vectors.normalize)

    def sqdist(self, o):
        return self._vector(vectors.sqdist, o)

    def __or__(self, o):
        """``x | y``: the dot product over features (feature size 1)."""
        return self._vector(vectors.dot, o)

    def __ror__(self, o):
        return as_lazy(o) | self

    def dot(self, o):
        return self | o

    def weightedsqnorm(self, w):
        """sum_d w_d x_d^2 for w of 1 or D features; sum_de w_de x_d x_e for w of D*D features (KeOps's WeightedSqNorm)."""
        return self._vector(vectors.weightedsqnorm, w)

    def weightedsqdist(self, other, w):
        """(self - other).weightedsqnorm(w)."""
        return (self - other).weightedsqnorm(w)

    def difference_matrix(self, other):
        """out[j * D + i] = self[i] - other[j] for self of D and other of E features (D * E features)."""
        return self._vector(vectors.difference_matrix, other)

    def elem(self, i: int):
        """Feature i (feature size 1)."""
        return self._vector(vectors.elem, i=i)

    def extract(self, start: int, size: int):
        """Features start, ..., start + size - 1."""
        return self._vector(vectors.extract, start=start, size=size)

    def __getitem__(self, key):
        """``x[k]`` is ``elem(k)``, ``x[a:b]`` is ``extract(a, b - a)``, also after ``...`` or ``:`` (features only)."""
        return self._vector(vectors.index, key=key)

    def grad(self, other, gradin):
        """KeOps's ``Grad(f, x, e)``: ``sum_k e_k df_k/dx``, an exact formula of ``x``'s feature size.

        ``other`` is one variable, matched by identity (the LazyTensor the
        formula was written with); a formula that does not involve it gives 0.
        """
        x, e = as_lazy(other), as_lazy(gradin)
        if len(x.variables) != 1 or x.expr not in x.variables:
            raise ValueError(f"grad: other must be a variable (Vi, Vj or Pm of one tensor), got {x!r}")
        info = variables.info(variables.aligned([(p.expr, p.variables) for p in (self, x, e)])[1])
        return LazyTensor._build(lambda f, s, c: diff.vjp([(f, c)], [s], info)[s], self, x, e, width=x.width)

    def concat(self, other):
        """Features of self, then features of other."""
        return self._vector(vectors.concat, other)

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
        if not self.variables and self.width == 1:
            raise ValueError("one_hot needs a formula of variables, got a constant")
        return self._vector(vectors.one_hot, size=size)

    def matvecmult(self, v):
        """self (A*B features: an A x B matrix, row-major) times v (B features): A features."""
        return self._vector(vectors.matvecmult, v)

    def vecmatmult(self, m):
        """self (A features) times m (A*B features: an A x B matrix, row-major): B features."""
        return self._vector(vectors.vecmatmult, m)

    def tensorprod(self, other):
        """The outer product of the feature vectors, flattened row-major: out[i * E + j] = self[i] other[j]."""
        return self._vector(vectors.tensorprod, other)

    def keops_tensordot(self, other, dimfa, dimfb, contfa, contfb, *permute):
        """``torch.tensordot`` of the features seen as tensors of shapes ``dimfa`` and ``dimfb``.

        ``contfa`` / ``contfb`` are the contracted axes (paired in order, as
        ``tensordot(a, b, dims=(contfa, contfb))``); the result's axes (a's kept
        axes, then b's) are flattened row-major, after the optional KeOps
        ``permute``: kept axis k goes to position ``permute[k]``.
        """
        return self._vector(vectors.tensordot, other, dimfa=dimfa, dimfb=dimfb, contfa=contfa, contfb=contfb,
                            permute=permute[0] if permute else None)

    def keops_kron(self, other, dimfself, dimfother):
        """The Kronecker product of the features seen as tensors (``torch.kron``), flattened row-major."""
        return self._vector(vectors.kron, other, dimfx=dimfself, dimfy=dimfother)

    # -- reductions: names of the ``reductions.named`` table -------------------------
    def _is_feature_dim(self, dim) -> bool:
        return is_feature_dim(dim, self.nbatchdims)

    def _reduce(self, name: str, argument, dim, options: dict):
        """The named reduction over ``dim`` (or ``axis=``): a tensor, or a tuple for several public outputs."""
        axis = run.reduced_axis(dim if options.get("axis") is None else options["axis"], self.nbatchdims)
        if named.NAMES[name].argument in named.FORMULA_ARGUMENTS and argument is not None:
            argument = along(argument, axis)
        return run.run(self, [(name, argument)], axis, options)[0]

    def _over(self, name: str, dim, options: dict, features, argument=None):
        """``_reduce`` over j or i; over the feature axis (dim=-1) the formula ``features`` of self, as KeOps."""
        if not self._is_feature_dim(options.get("axis", dim)):
            return self._reduce(name, argument, dim, options)
        given = sorted(set(options) - {"axis", "keepdim"}) + ([] if argument is None else [named.NAMES[name].argument])
        if given:  # ``keepdim`` is ignored: features are always kept
            raise TypeError(f"a feature-axis reduction returns a formula and takes no reduction options, got {given}")
        return self._vector(features)

    def sum(self, dim=1, *, dtype_acc=None, **options):
        """Sum over j (dim=1 / "j"), over i (dim=0 / "i"), or over features (dim=-1: a formula).

        ``dtype_acc`` (e.g. ``torch.float64`` for a float32 formula): the dtype
        the sum is formed and accumulated in, and the result's dtype. KeOps's
        ``sum_scheme="kahan_scheme"`` accumulates float32 in float64 and
        returns the formula's dtype.
        """
        if options.get("sum_scheme") != "kahan_scheme" or dtype_acc is not None or self._is_feature_dim(options.get("axis", dim)):
            return self._over("sum", dim, options, vectors.feature_sum, dtype_acc)
        float32 = self.dtype in (torch.float32, np.float32)
        out = self._reduce("sum", torch.float64 if float32 else None, dim, options)
        return out.astype(self.dtype) if isinstance(out, np.ndarray) else out.to(self.dtype)

    def logsumexp(self, dim=1, weight=None, **options):
        """log sum exp over the axis; with ``weight`` (KeOps's LogSumExpWeight): log sum_j exp(F_ij) w_ij per feature of w."""
        return self._reduce("logsumexp", weight, dim, options)

    def max_sumshiftexp(self, dim=1, weight=None, **options):
        """KeOps's Max_SumShiftExp(Weight): m = max F and s = sum exp(F - m) w (w = 1 by default) as one (..., 1 + E) tensor."""
        return self._reduce("max_sumshiftexp", weight, dim, options)

    def softmax_weighted_sum(self, values, dim=1, **options):
        """sum_j softmax_j(F_ij) * values_j (values: LazyTensor or dense (M, E) tensor)."""
        return self._reduce("softmax_weighted_sum", values, dim, options)

    def min(self, dim=1, **options):
        """Minimum over j or i; over features (dim=-1) a formula, as KeOps."""
        return self._over("min", dim, options, lambda x: vectors.feature_min(x, 1))

    def argmin(self, dim=1, **options):
        return self._over("argmin", dim, options, lambda x: vectors.feature_argmin(x, 1))

    def min_argmin(self, dim=1, **options):
        return self._reduce("min_argmin", None, dim, options)

    def max(self, dim=1, **options):
        return self._over("max", dim, options, lambda x: vectors.feature_min(x, -1))

    def argmax(self, dim=1, **options):
        return self._over("argmax", dim, options, lambda x: vectors.feature_argmin(x, -1))

    def max_argmax(self, dim=1, **options):
        return self._reduce("max_argmax", None, dim, options)

    def kmin(self, k: int, dim=1, **options):
        """The k smallest values over the axis, ascending; (N, k) when the feature size is 1."""
        return self._reduce("kmin", k, dim, options)

    def argkmin(self, k: int, dim=1, **options):
        return self._reduce("argkmin", k, dim, options)

    def kmin_argkmin(self, k: int, dim=1, **options):
        """The k smallest values over the axis and their indices, ascending."""
        return self._reduce("kmin_argkmin", k, dim, options)

    def quantile(self, q, dim=1, **options):
        """Exact q-quantile over the axis with torch.quantile's linear interpolation."""
        return self._reduce("quantile", q, dim, options)

    # KeOps's spellings
    sum_reduction = sum
    logsumexp_reduction = logsumexp
    sumsoftmaxweight = sumsoftmaxweight_reduction = softmax_weighted_sum
    min_reduction, max_reduction = min, max
    argmin_reduction, argmax_reduction = argmin, argmax
    min_argmin_reduction, max_argmax_reduction = min_argmin, max_argmax
    Kmin, argKmin, Kmin_argKmin = kmin, argkmin, kmin_argkmin
    Kmin_reduction, argKmin_reduction, Kmin_argKmin_reduction = kmin, argkmin, kmin_argkmin

    # -- linear operator: K @ v, K.T, matvec / rmatvec --------------------------
    def matmul(self, b, **options):
        """K @ b for a scalar formula K_ij and a dense (M,), (M, C) or (*batch, M, C) tensor or array."""
        if not isinstance(b, (torch.Tensor, np.ndarray)):
            raise TypeError(f"matmul expects a dense tensor or array b, got {type(b).__name__}")
        if self.width != 1:
            raise ValueError(f"K @ b needs a formula of feature size 1, got {self.width}")
        if b.ndim == 0 or not (b.is_floating_point() if isinstance(b, torch.Tensor) else b.dtype.kind == "f"):
            raise TypeError(f"K @ b needs b floating-point of shape (M,), (M, C) or (*batch, M, C), got dtype "
                            f"{b.dtype} and shape {tuple(b.shape)}")
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
        out = type(self).__new__(type(self))
        out.expr, out.variables, out.width = self.expr, variables.transposed(self.variables), self.width
        out.ranges = None if self.ranges is None else (*self.ranges[3:6], *self.ranges[0:3])
        return out

    @property
    def T(self):
        return self.t()

    def solve(self, b, alpha: float = 1e-10, **options):
        """Solve (K + alpha I) a = b for a symmetric positive definite K_ij (KeOps's KernelSolve); see ``lazytensor.solve``."""
        from .solve import kernel_solve

        return kernel_solve(self, b, alpha, **options)

    def __repr__(self) -> str:
        axes = {s: v.axis for s, v in self.variables.items()}
        return f"LazyTensor({self.expr}, variables={axes})"

    def __bool__(self):
        raise TypeError("a LazyTensor has no truth value; reduce it first")


def _relation(kind, a: sympy.Expr, b: sympy.Expr):
    """``kind(a, b)``, kept symbolic where a variable is involved (x == x is not true for NaN).

    A formula compared with itself is a NaN test, since sympy folds ``Ne(x, x)``
    to false wherever it meets it."""
    if a == b and a.free_symbols:
        return ir.IsNaN(a) if kind is sympy.Ne else 1 - ir.IsNaN(a) if kind in (sympy.Eq, sympy.Ge, sympy.Le) \
            else sympy.Integer(0)
    return kind(a, b, evaluate=not (a.free_symbols or b.free_symbols))


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
    from . import library  # a formula recorded while a compiler traced, met by eager code after a graph break

    if isinstance(x, library.Deferred):
        return x.materialized()
    raise TypeError(f"cannot combine a LazyTensor with {type(x).__name__}")


def along(values, axis: str) -> LazyTensor:
    """A weight or values argument of a reduction: a LazyTensor, or a dense tensor indexed like the reduced ``axis``."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return LazyTensor(values, axis)
    return as_lazy(values)


def lazy(t, axis) -> LazyTensor:
    """Wrap ``t`` as an "i"- or "j"-indexed variable ((N, D) or (*batch, N, D)) or a parameter ("p": (D,) or (*batch, D))."""
    if not isinstance(t, (torch.Tensor, np.ndarray)):
        raise TypeError(f"lazy expects a torch.Tensor or a NumPy array, got {type(t).__name__}")
    return LazyTensor(t, variables.axis_name(axis))


def _recorded(name: str, *args, **kwargs):
    """The call as a ``library.Deferred`` formula while a compiler traces (``lazytensor.library``), else None."""
    from . import library

    return library.Deferred.call(name, *args, **kwargs) if library.recording() else None


def Vi(t) -> LazyTensor:
    return lazy(t, "i")


def Vj(t) -> LazyTensor:
    return lazy(t, "j")


def Pm(t) -> LazyTensor:
    """A parameter (scalar, (D,) or batched (*batch, D) tensor); a Python number follows the formula's dtype."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return LazyTensor([t])
    return lazy(t, "p")


def where(cond: LazyTensor, a, b) -> LazyTensor:
    """Elementwise choice: ``a`` where ``cond`` holds, else ``b``."""
    if tracing() and (recorded := _recorded("where", cond, a, b)) is not None:
        return recorded
    cond, a, b = as_lazy(cond), as_lazy(a), as_lazy(b)
    return LazyTensor._build(lambda c, x, y: ir.Select(ir.condition(c), ir.numeric(x), ir.numeric(y)), cond, a, b)
