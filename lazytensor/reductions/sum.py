"""Sum: sum_j F (per row) or sum_i F (per column), as matrix products where F allows it."""
from __future__ import annotations

import sympy
import torch

from .. import ir
from ..opaque import tracing
from .base import Reduction, column_side, masked, row_side

# A compiled tile sums products with at most this many bytes of weights per row as a reduction fused into the
# tile's loop; wider ones as a matrix product on the tile. Inductor hands BLAS the weights row-major, and MKL's
# product with 2-8 row-major columns ran at a sixth of its speed (one (256, 1024) @ (1024, 2) float32 tile: 301 us,
# 55 us column-major). 8192^2 RBF product, d = 8, one thread, AMD EPYC, fused / matrix product: float32 C = 1 0.079 /
# 0.085 s, C = 2 0.096 / 0.178, C = 8 0.125 / 0.176, C = 16 0.175 / 0.117; float64 C = 2 0.165 / 0.244, C = 4 and 8
# equal, C = 16 0.349 / 0.286.
FUSED_PRODUCT_BYTES = 32
COLUMN_MAJOR_MIN_ROWS = 4  # an eager tile of fewer rows multiplies its weights as they lie (``_column_major``)


def narrow(matrix: torch.Tensor, columns: int) -> bool:
    """Whether a compiled tile forms ``matrix @ W`` with ``columns`` weight columns as a fused reduction."""
    return tracing() and columns * matrix.element_size() <= FUSED_PRODUCT_BYTES


def tile_product(matrix: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``matrix @ weights`` in a tile: narrow weights as a broadcast product summed (Inductor fuses the sum into
    the tile's loop), others as a matrix product."""
    if narrow(matrix, weights.shape[-1]):
        return (matrix.unsqueeze(-1) * weights.unsqueeze(-3)).sum(-2)
    return torch.matmul(matrix, weights)


def _column_major(weights: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``weights`` column-major for ``matrix @ weights``: BLAS is several times faster on a (rows, cols) @
    (cols, few) product that way, but the copy costs more than it saves below ``COLUMN_MAJOR_MIN_ROWS``
    rows (one row, 16384 x 4 float32 weights: 28 us as they lie, 72 us copied first)."""
    return weights.mT.contiguous().mT if matrix.shape[-2] >= COLUMN_MAJOR_MIN_ROWS else weights


def _is_one(a) -> bool:
    return not isinstance(a, torch.Tensor) and a == 1


class Sum(Reduction):
    """sum over the reduced axis of F, written as sum of A * (S @ W) terms when F allows it.

    Terms whose mixed part S is the same expression share one matrix product:
    their W columns are stacked (a column of ones for a bare sum), so e.g. the
    gradient terms x_i rowsum(c) - c @ y read the tile c once, not twice.

    ``reduced_axis = "i"`` sums over rows for every column: a backward pass
    needs sums over j (gradients of i-variables) and over i (gradients of
    j-variables) of formulas sharing the kernel values, and one pass with both
    kinds evaluates each tile once. Its state is the whole (B, M, D) result,
    written per column block; padded rows are masked by the row mask.
    ``dim`` widens a feature-size-1 formula (a gradient broadcast to a vector).

    ``dtype_acc`` (KeOps's name) is the dtype sums are formed and accumulated
    in: each tile's values and weights are cast to it before their matrix
    product, partials and the state stay in it, and so does the result. So a
    formula evaluated in float32 (fast elementwise work) can be summed to
    float64 accuracy; gradients flow back in the formula's dtype.
    """

    name = "sum"
    differentiable = (True,)

    def merge_ranks(self, state, sharding):
        """Row sums of every rank's columns: one all-reduce (``lazytensor.distributed``)."""
        return tuple(sharding.all_reduce(t) for t in state)

    def __init__(self, expr: sympy.Expr, info: dict, dim: int | None = None, reduced_axis: str = "j",
                 dtype_acc: torch.dtype | None = None):
        self.expr, self.reduced_axis, self.dtype_acc = expr, reduced_axis, dtype_acc
        self.dim = dim or ir.feature_dim(expr, info)
        frame = info if reduced_axis == "j" else {s: ir.VarInfo(ir.FLIPPED[v.axis], v.dim) for s, v in info.items()}
        self.terms = []  # (kind, index of the shared S or None) per term
        self.expressions = []
        shared: dict[sympy.Expr, int] = {}
        for a, s, w in ir.sum_terms(expr, frame):
            if s != 1 and ir.feature_dim(s, frame) > 1:  # a vector-valued mixed part: sum the tile
                self.terms.append(("tile", None))
                self.expressions.append(a * s * w)
            else:
                group = shared.setdefault(s, len(shared)) if s != 1 else None
                self.terms.append((("s" if s != 1 else "") + ("w" if w != 1 else ""), group))
                self.expressions.extend([a, s, w])
        self.signature = ("sum", reduced_axis, self.dim, tuple(self.terms), dtype_acc)

    # -- the tile's sides: over j the rows are kept and columns summed; over i the reverse
    @property
    def _summed_dim(self) -> int:
        return 2 if self.reduced_axis == "j" else 1

    def _kept(self, t):
        return row_side(t) if self.reduced_axis == "j" else column_side(t)

    def _summed_side(self, w):
        return w[:, 0] if self.reduced_axis == "j" else w[:, :, 0]

    def _matrix(self, s):
        return s[..., 0] if self.reduced_axis == "j" else s[..., 0].transpose(1, 2)

    def _acc(self, t):
        """A tile-side value in the accumulation dtype (constants pass through)."""
        return t.to(self.dtype_acc) if self.dtype_acc is not None and isinstance(t, torch.Tensor) else t

    def _products(self, terms, mask) -> dict[int, list]:
        """Each shared S times its stacked W columns, split back per term."""
        stacks: dict[int, tuple] = {}  # group -> (S as a matrix, W column blocks)
        for (kind, group), parts in terms:
            if group is None:  # "tile" terms and terms without a mixed part
                continue
            _, s, w = parts
            if group not in stacks:
                stacks[group] = (self._acc(self._matrix(masked(s, mask, 0.0))), [])
            w = self._acc(self._summed_side(masked(w, mask, 0.0))) if "w" in kind else None  # padding may be inf
            stacks[group][1].append(w)
        products = {}
        for group, (matrix, columns) in stacks.items():
            columns = [matrix.new_ones(1, matrix.shape[-1], 1) if c is None else c for c in columns]
            if narrow(matrix, sum(c.shape[-1] for c in columns)):
                products[group] = [tile_product(matrix, c) for c in columns]
                continue
            if len(columns) == 1:  # nothing to stack or split (a copy and a split per tile saved)
                products[group] = [torch.matmul(matrix, _column_major(columns[0], matrix))]
                continue
            batch = max([matrix.shape[0]] + [c.shape[0] for c in columns])
            stacked = _column_major(torch.cat([c.expand(batch, *c.shape[1:]) for c in columns], -1), matrix)
            products[group] = list(torch.matmul(matrix, stacked).split([c.shape[-1] for c in columns], -1))
        return products

    def partial(self, values, mask):
        values = list(values)
        terms, at = [], 0
        for kind, group in self.terms:
            width = 1 if kind == "tile" else 3
            terms.append(((kind, group), values[at : at + width]))
            at += width
        products = self._products(terms, mask)
        total = None
        for (kind, group), parts in terms:
            if kind == "tile":
                term = self._acc(masked(parts[0], mask, 0.0)).sum(self._summed_dim)
            else:
                a, _, w = parts
                if group is not None:
                    r = products[group].pop(0)
                elif "w" in kind:
                    r = self._acc(masked(w, mask, 0.0)).sum(self._summed_dim)
                else:
                    r = self._acc(mask.sum(self._summed_dim) * w)
                term = r if _is_one(a) else self._acc(self._kept(a)) * r  # an eager tile's product with 1 saved
            total = term if total is None else total + term
        return (total,)

    def combine(self, state, partial, at):
        if self.reduced_axis == "j":
            return partial if state is None else (state[0] + partial[0],)
        columns = state[0][:, at]  # ``at``: the column block's slice of a state spanning every column
        columns += partial[0][:, : columns.shape[1]].expand_as(columns)  # (B, 1, D) when F is i-only
        return state

    def initial_state(self, batch: int, columns: int, dtype: torch.dtype, device) -> tuple:
        return (torch.zeros(batch, columns, self.dim, dtype=self.dtype_acc or dtype, device=device),)

    def finalize(self, state, rows, batch):
        if self.reduced_axis == "i":
            return state
        return (state[0].expand(batch, rows, self.dim).contiguous(),)

    def empty(self, batch, rows, dtype, device):
        return (torch.zeros(batch, rows, self.dim, dtype=self.dtype_acc or dtype, device=device),)

    # -- derivatives
    def _cotangent(self, collector, grad):
        g = collector.variable(grad, "i" if self.reduced_axis == "j" else "j")
        width = ir.feature_dim(self.expr, collector.info)
        return ir.feature_sum(g, self.dim) if width < self.dim else g  # a widened formula: its channels sum

    def vjp(self, collector, outs, grads):
        grad = grads[0].to(collector.problem.dtype)  # an accumulated result's cotangent, in the formula's dtype
        collector.cotangent(self.expr, self._cotangent(collector, grad))

    def jvp(self, collector, outs):
        handle = collector.summed(collector.tangent(self.expr), self.reduced_axis, self.dim)
        return lambda results: (self._acc(results[handle]),)


def accumulation_dtype(dtype_acc, dtype: torch.dtype) -> torch.dtype | None:
    """``dtype_acc`` checked against the formula's ``dtype``: None when it changes nothing.

    Accepts a floating torch dtype or its name (``"float64"``, as KeOps), at
    least as precise as the formula's dtype.
    """
    if dtype_acc is None or dtype_acc == "auto":
        return None
    acc = getattr(torch, dtype_acc, None) if isinstance(dtype_acc, str) else dtype_acc
    if not isinstance(acc, torch.dtype) or not acc.is_floating_point:
        raise ValueError(f"dtype_acc must be None, 'auto' or a floating dtype (torch.float64, 'float64', ...), "
                         f"got {dtype_acc!r}")
    if torch.finfo(acc).eps > torch.finfo(dtype).eps:
        raise ValueError(f"dtype_acc={acc} is less precise than the formula's {dtype}; accumulate in {dtype} or wider")
    return None if acc == dtype else acc
