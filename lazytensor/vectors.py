"""Feature-vector IR builders: LazyTensor's operations on the feature axis as index plans.

Each builder takes its operands as ``Vec(expr, width)`` (a numeric IR
expression and its feature size) and returns the result's ``Vec``; the
LazyTensor method wraps it with the operands' variables. Everything is
written with two index maps over flattened, row-major features: ``Gather``
(out[m] = x[index[m]]) and ``Scatter`` (out[k] = sum of x[m] with
index[m] == k), so lowering and differentiation know only those two.
Feature contractions (dot, squared norms and distances) end in a feature
sum and have width 1.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import sympy

from . import ir


class Vec(NamedTuple):
    """An operand: a numeric IR expression and its feature size."""

    expr: sympy.Expr
    width: int


def _gather(x: Vec, indices) -> sympy.Expr:
    return ir.Gather(x.expr, ir.index_tuple(indices))


def _scatter(expr: sympy.Expr, indices, size: int) -> Vec:
    return Vec(ir.Scatter(expr, ir.index_tuple(indices), sympy.Integer(size)), size)


# -- feature contractions (width 1) ------------------------------------------------
def _contract(fn, *operands: Vec) -> Vec:
    """``fn`` of the operands, summed over their (broadcast) features."""
    widths = {o.width for o in operands} - {1}
    if len(widths) > 1:
        raise ValueError(f"feature sizes {sorted(widths)} do not broadcast in a feature contraction")
    return Vec(ir.feature_sum(fn(*(o.expr for o in operands)), max(widths, default=1)), 1)


def feature_sum(x: Vec) -> Vec:
    return _contract(lambda a: a, x)


def sqnorm2(x: Vec) -> Vec:
    return _contract(lambda a: a**2, x)


def dot(x: Vec, y: Vec) -> Vec:
    return _contract(lambda a, b: a * b, x, y)


def sqdist(x: Vec, y: Vec) -> Vec:
    return _contract(lambda a, b: (a - b) ** 2, x, y)


def weightedsqnorm(x: Vec, w: Vec) -> Vec:
    """sum_d w_d x_d^2 for w of 1 or D features; sum_de w_de x_d x_e for w of D*D features."""
    d = x.width
    if w.width == d * d and d > 1:
        rows, cols = _gather(x, (m // d for m in range(d * d))), _gather(x, (m % d for m in range(d * d)))
        return Vec(ir.feature_sum(w.expr * rows * cols, d * d), 1)
    if w.width not in (1, d):
        raise ValueError(f"weightedsqnorm: weights must have 1, D or D*D features (D = {d}), got {w.width}")
    return _contract(lambda a, b: b * a**2, x, w)


def normalize(x: Vec) -> Vec:
    """x / |x|, and 0 for x = 0 (KeOps: Rsqrt(0) = 0)."""
    inverse = ir.ZeroSafePow(ir.feature_sum(x.expr**2, x.width), sympy.Rational(-1, 2))
    return Vec(x.expr * inverse, x.width)


def feature_min(x: Vec, sign: int) -> Vec:
    """The smallest feature (the largest for sign -1)."""
    return Vec(ir.FeatureMin(x.expr * sign) * sign, 1)


def feature_argmin(x: Vec, sign: int) -> Vec:
    return Vec(ir.FeatureArgMin(x.expr * sign), 1)


# -- indexing, concatenation, one-hot ------------------------------------------------
def elem(x: Vec, i: int) -> Vec:
    """Feature i."""
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < x.width:
        raise ValueError(f"elem: index must be an int in [0, {x.width}), got {i!r}")
    return Vec(_gather(x, [i]), 1)


def extract(x: Vec, start: int, size: int) -> Vec:
    """Features start, ..., start + size - 1."""
    for name, v in (("start", start), ("size", size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"extract: {name} must be an int, got {v!r}")
    if not (0 <= start < x.width and size >= 1 and start + size <= x.width):
        raise ValueError(f"extract: [start, start + size) = [{start}, {start + size}) is not inside [0, {x.width})")
    return Vec(_gather(x, range(start, start + size)), size)


def index(x: Vec, key) -> Vec:
    """``x[k]`` is ``elem(k)``, ``x[a:b]`` is ``extract(a, b - a)``, also after ``...`` or ``:`` (features only)."""
    if isinstance(key, tuple):
        rest = [k for k in key[:-1] if k is not Ellipsis]
        if not key or any(k != slice(None) for k in rest):
            raise ValueError(f"a LazyTensor is indexed over its feature axis only, got {key!r}")
        key = key[-1]
    if isinstance(key, slice):
        start, stop, step = key.indices(x.width)
        if step != 1 or stop <= start:
            raise ValueError(f"feature slices need step 1 and a non-empty range, got {key!r}")
        return extract(x, start, stop - start)
    if isinstance(key, int) and not isinstance(key, bool):
        return elem(x, key + x.width if key < 0 else key)
    raise ValueError(f"a LazyTensor is indexed by an int or a slice of features, got {key!r}")


def concat(x: Vec, y: Vec) -> Vec:
    """Features of x, then features of y."""
    d, e = x.width, y.width
    first = _scatter(x.expr, range(d), d + e)
    second = _scatter(y.expr, range(d, d + e), d + e)
    return Vec(first.expr + second.expr, d + e)


def one_hot(x: Vec, size: int) -> Vec:
    """``size`` features: 1 at position round(x) (KeOps: floor(x + 0.5)), 0 elsewhere."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"one_hot: size must be a positive int, got {size!r}")
    if x.width != 1:
        raise ValueError(f"one_hot needs a formula of feature size 1, got {x.width}")
    return Vec(ir.OneHot(x.expr, sympy.Integer(size)), size)


# -- products of feature vectors -------------------------------------------------------
def difference_matrix(x: Vec, y: Vec) -> Vec:
    """out[j * D + i] = x[i] - y[j] for x of D and y of E features."""
    d, e = x.width, y.width
    return Vec(_gather(x, (k % d for k in range(d * e))) - _gather(y, (k // d for k in range(d * e))), d * e)


def matvecmult(m: Vec, v: Vec) -> Vec:
    """m (A*B features: an A x B matrix, row-major) times v (B features): A features."""
    a, b = _factor(m.width, v.width, "matvecmult")
    product = m.expr * _gather(v, (k % b for k in range(a * b)))
    return _scatter(product, (k // b for k in range(a * b)), a)


def vecmatmult(v: Vec, m: Vec) -> Vec:
    """v (A features) times m (A*B features: an A x B matrix, row-major): B features."""
    a, b = v.width, _factor(m.width, v.width, "vecmatmult")[0]
    product = _gather(v, (k // b for k in range(a * b))) * m.expr
    return _scatter(product, (k % b for k in range(a * b)), b)


def tensorprod(x: Vec, y: Vec) -> Vec:
    """The outer product, flattened row-major: out[i * E + j] = x[i] y[j]."""
    d, e = x.width, y.width
    return Vec(_gather(x, (k // e for k in range(d * e))) * _gather(y, (k % e for k in range(d * e))), d * e)


def tensordot(x: Vec, y: Vec, dimfa, dimfb, contfa, contfb, permute=None) -> Vec:
    """``torch.tensordot`` of the features seen as tensors of shapes ``dimfa`` and ``dimfb`` (see LazyTensor.keops_tensordot)."""
    ia, ib, out_index, size = _tensordot_plan(dimfa, dimfb, contfa, contfb, permute, x.width, y.width)
    return _scatter(_gather(x, ia) * _gather(y, ib), out_index, size)


def kron(x: Vec, y: Vec, dimfx, dimfy) -> Vec:
    """The Kronecker product of the features seen as tensors (``torch.kron``), flattened row-major."""
    if len(dimfx) != len(dimfy):
        raise ValueError(f"keops_kron: dimfself and dimfother need the same number of axes, got {dimfx} and {dimfy}")
    n = len(dimfx)
    return tensordot(x, y, dimfx, dimfy, (), (), [2 * k for k in range(n)] + [2 * k + 1 for k in range(n)])


def _factor(total: int, part: int, name: str) -> tuple[int, int]:
    if part < 1 or total % part:
        raise ValueError(f"{name}: a matrix of {total} features and a vector of {part} features do not match")
    return total // part, part


def _tensordot_plan(dimfa, dimfb, contfa, contfb, permute, width_a: int, width_b: int):
    """Index maps of a tensordot on flattened features: (a index, b index, output index) per term, and the output size."""
    dimfa, dimfb, contfa, contfb = (_ints(v) for v in (dimfa, dimfb, contfa, contfb))
    if math.prod(dimfa) != width_a or math.prod(dimfb) != width_b:
        raise ValueError(f"keops_tensordot: shapes {dimfa} and {dimfb} do not match feature sizes {width_a} and {width_b}")
    if len(contfa) != len(contfb) or [dimfa[c] for c in contfa] != [dimfb[c] for c in contfb]:
        raise ValueError(f"keops_tensordot: contracted axes {contfa} of {dimfa} and {contfb} of {dimfb} do not match")
    keep_a = [k for k in range(len(dimfa)) if k not in contfa]
    keep_b = [k for k in range(len(dimfb)) if k not in contfb]
    kept = [dimfa[k] for k in keep_a] + [dimfb[k] for k in keep_b]
    order = list(range(len(kept))) if permute is None else _ints(permute)
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


def _ints(values) -> list[int]:
    return [int(values)] if isinstance(values, int) else [int(v) for v in values]


def _ravel(index, shape) -> int:
    flat = 0
    for i, d in zip(index, shape):
        flat = flat * d + i
    return flat
