"""Sources: the (implicit) matrices that the Krylov methods multiply by.

A source answers ``A @ V``, ``A.T @ U``, ``diag()``, ``columns(idx)``,
``gram(V) = A^T (A V)`` and ``row_gram(idx) = A[idx]^T A[idx]``, plus ``shape``,
``dtype`` and ``device``.
:class:`StreamedKernel` never stores its matrix: every product is one
lazytensor reduction of the kernel formula (``K @ V`` a sum over j,
``K.T @ U`` a sum over i), streamed tile by tile with all columns of ``V`` at
once, and differentiable through lazytensor's streamed backward.
:class:`StoredKernel` wraps an explicit matrix and uses direct ATen products.
"""
from __future__ import annotations

import copy

import torch

import lazytensor as lt
from lazytensor import distributed
from lazytensor.plan import check_chunk_size
from lazytensor.reductions.normal import normal_product

from .kernels import as_kernel, check_pair, check_tensor, formula, matrix

__all__ = ["Source", "StreamedKernel", "ShardedKernel", "StoredKernel", "FunctionOperator", "as_source"]

ROW_BLOCK_BYTES = 8 * 2**20  # a row_gram's block of rows (block_rows x m in the source's dtype) stays within this
# A Gram matrix's column blocks (``symmetric_gram``): at most this many, each at least GRAM_MIN_WIDTH wide.
# One thread, float64 (a /tmp script): 16384 x 512 rows 166 -> 138 ms, 4096 x 704 89 -> 72 ms, 1024 x 2048
# 157 -> 117 ms against one full product; 8 blocks were no faster, 16 slower (narrow products run slower).
GRAM_BLOCKS = 4
GRAM_MIN_WIDTH = 64


def symmetric_gram(blocks, size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``sum B^T B`` over the row blocks ``blocks`` (each (rows, size)): only the upper triangle of column blocks
    is multiplied (a quarter fewer multiply-adds with 4 of them) and mirrored once at the end, in place and
    block by block (no second size x size buffer: 128 MiB at size 4096), so the result is exactly symmetric.
    No gradient flows through it (it builds preconditioners)."""
    parts = max(1, min(GRAM_BLOCKS, size // GRAM_MIN_WIDTH))
    edges = [size * k // parts for k in range(parts + 1)]
    spans = list(zip(edges, edges[1:]))
    out = torch.zeros(size, size, dtype=dtype, device=device)
    with torch.no_grad():
        for block in blocks:
            block = block.to(dtype)
            for lo, hi in spans:
                out[lo:hi, lo:].addmm_(block[:, lo:hi].mT, block[:, lo:])
        for k, (lo, hi) in enumerate(spans):
            diagonal = out[lo:hi, lo:hi]
            diagonal.copy_(diagonal.triu() + diagonal.triu(1).mT)  # MKL's B^T B is symmetric bit for bit; other BLAS need not be
            for below, above in spans[k + 1:]:
                out[below:above, lo:hi] = out[lo:hi, below:above].mT
        return out


class Source:
    """Common operator surface; subclasses implement ``matmul`` and ``rmatmul`` on 2-D operands."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def _operand(self, V, n_rows: int, name: str):
        if not isinstance(V, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(V).__name__}")
        if V.ndim not in (1, 2) or V.shape[0] != n_rows:
            raise ValueError(f"{name} must have {n_rows} rows (shape ({n_rows},) or ({n_rows}, c)), "
                             f"got {tuple(V.shape)}")
        if V.dtype != self.dtype:
            raise TypeError(f"{name} has dtype {V.dtype} but the source is {self.dtype}")
        return V.unsqueeze(1) if V.ndim == 1 else V, V.ndim == 1

    def __matmul__(self, V: torch.Tensor) -> torch.Tensor:
        V2, vector = self._operand(V, self.shape[1], "V")
        out = self.matmul(V2)
        return out.squeeze(1) if vector else out

    @property
    def T(self) -> "Source":
        return _Transposed(self)

    def matmul(self, V: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rmatmul(self, U: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul_nograd(self, V: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.matmul(V.detach())

    def rmatmul_nograd(self, U: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.rmatmul(U.detach())

    def gram(self, V: torch.Tensor) -> torch.Tensor:
        """``A^T (A V)`` (no gradient)."""
        return self.rmatmul_nograd(self.matmul_nograd(V))

    def squared_row_norms(self) -> torch.Tensor:
        """``sum_j A[i, j]^2`` (no gradient)."""
        raise NotImplementedError

    def row_gram(self, idx: torch.Tensor) -> torch.Tensor:
        """``A[idx]^T A[idx]`` (m x m, no gradient): the normal matrix of the rows ``idx`` alone."""
        raise NotImplementedError


class _Transposed(Source):
    def __init__(self, base: Source):
        self.base = base
        self.shape = (base.shape[1], base.shape[0])
        self.dtype, self.device = base.dtype, base.device

    def matmul(self, V):
        return self.base.rmatmul(V)

    def rmatmul(self, U):
        return self.base.matmul(U)

    @property
    def T(self):
        return self.base

    def diag(self) -> torch.Tensor:
        return self.base.diag()


class StoredKernel(Source):
    """An explicit matrix behind the source interface (direct ATen products)."""

    def __init__(self, matrix: torch.Tensor):
        if not isinstance(matrix, torch.Tensor):
            raise TypeError(f"matrix must be a torch.Tensor, got {type(matrix).__name__}")
        if matrix.ndim != 2 or not matrix.is_floating_point():
            raise ValueError(f"matrix must be a floating 2-D tensor, got shape {tuple(matrix.shape)}, {matrix.dtype}")
        self.matrix = matrix
        self.shape = tuple(matrix.shape)
        self.dtype, self.device = matrix.dtype, matrix.device

    def matmul(self, V):
        return self.matrix @ V

    def rmatmul(self, U):
        return self.matrix.T @ U

    def diag(self) -> torch.Tensor:
        return self.matrix.diagonal()

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        return self.matrix[:, idx]

    def squared_row_norms(self) -> torch.Tensor:
        return self.matrix.square().sum(1)

    def row_gram(self, idx: torch.Tensor) -> torch.Tensor:
        return symmetric_gram([self.matrix[idx]], self.shape[1], self.dtype, self.device)


class StreamedKernel(Source):
    """The kernel matrix ``K[i, j] = kernel(X[i], Y[j])``, never stored: each product is a lazytensor sum.

    ``kernel`` is a formula factory (``RBF``, ``Laplacian``, ``Matern``), any
    callable ``k(x, y) -> LazyTensor`` or a formula string in ``x`` and ``y``.
    ``chunk_size`` is lazytensor's tile size (rows, or (rows, cols); default:
    from its memory budget). ``tile_dtype=torch.float32`` evaluates the
    formula in single precision and accumulates every sum in the dtype of
    ``X`` (lazytensor's ``dtype_acc``): faster elementwise work, about 1e-7
    relative error per entry. ``sum_dtype=torch.float32`` sums in the tile
    dtype too (results still in ``X``'s): a pass all in single precision,
    2x faster than a float64 pass (RBF, 8192^2, d = 8, one thread: 0.081 s
    against 0.158 s) and no more accurate than float32 sums are. Products are differentiable with respect to
    ``X``, ``Y``, ``V`` and every tensor the kernel formula closes over; the
    backward pass is lazytensor's, streamed too.
    """

    def __init__(self, kernel, X: torch.Tensor, Y: torch.Tensor | None = None, chunk_size=None,
                 tile_dtype: torch.dtype | None = None, sum_dtype: torch.dtype | None = None):
        self.kernel = as_kernel(kernel)
        self.X, self.Y = check_pair(X, Y)
        self.symmetric = Y is None or Y is X
        if tile_dtype not in (None, self.X.dtype, torch.float32):
            raise ValueError(f"tile_dtype must be None or torch.float32, got {tile_dtype}")
        check_chunk_size(chunk_size)
        self.chunk_size = chunk_size
        self.tile_dtype = tile_dtype or self.X.dtype
        if sum_dtype not in (None, self.X.dtype, self.tile_dtype):
            raise ValueError(f"sum_dtype must be None, X's dtype or the tile dtype ({self.tile_dtype}), got {sum_dtype}")
        self.sum_dtype = sum_dtype or self.X.dtype
        self.dtype_acc = None if self.tile_dtype == self.sum_dtype else self.sum_dtype
        self.shape = (self.X.shape[0], self.Y.shape[0])
        self.dtype, self.device = self.X.dtype, self.X.device
        self.K = self.formula(self.X, self.Y)  # built once (a bad kernel fails here, with its name); products reuse it

    def with_tile_dtype(self, tile_dtype: torch.dtype, sum_dtype: torch.dtype | None = None) -> "StreamedKernel":
        """The same kernel evaluated in ``tile_dtype`` and summed in ``sum_dtype`` (default: the dtype of ``X``)."""
        return StreamedKernel(self.kernel, self.X, None if self.symmetric else self.Y, self.chunk_size, tile_dtype, sum_dtype)

    def formula(self, X: torch.Tensor, Y: torch.Tensor) -> lt.LazyTensor:
        """The kernel formula on rows ``X`` (i) and columns ``Y`` (j), in the tile dtype."""
        return formula(self.kernel, lt.Vi(X.to(self.tile_dtype)), lt.Vj(Y.to(self.tile_dtype)), self.tile_dtype)

    def _sum(self, terms: lt.LazyTensor, dim: int) -> torch.Tensor:
        return terms.sum(dim, chunk_size=self.chunk_size, dtype_acc=self.dtype_acc).to(self.dtype)

    def matmul(self, V):
        """``K @ V`` (2-D ``V``): a sum over j, differentiable."""
        return self._sum(self.K * lt.Vj(V.to(self.tile_dtype)), 1)

    def rmatmul(self, U):
        """``K.T @ U`` (2-D ``U``): a sum over i, differentiable."""
        return self._sum(self.K * lt.Vi(U.to(self.tile_dtype)), 0)

    def gram(self, V):
        """``K.T @ (K @ V)`` in one pass: each row block's tile evaluated once for both products (no gradient)."""
        with torch.no_grad():
            rows = None if self.chunk_size is None else check_chunk_size(self.chunk_size)[0]
            return normal_product(self.K * lt.Vj(V.detach().to(self.tile_dtype)), dtype_acc=self.dtype_acc,
                                  chunk_size=rows).to(self.dtype)

    def diag(self) -> torch.Tensor:
        """k(x_i, x_i): the formula on one variable twice (sympy folds radial kernels to exactly 1)."""
        if not self.symmetric:
            raise ValueError("diag() needs a square kernel source (Y=None)")
        with torch.no_grad():
            x = lt.Vi(self.X.detach().to(self.tile_dtype))
            one = lt.Vj(torch.ones(1, 1, dtype=self.tile_dtype, device=self.device))
            values = (formula(self.kernel, x, x, self.tile_dtype) * one).sum(1, dtype_acc=self.dtype_acc)
        return values.squeeze(1).to(self.dtype)

    def squared_row_norms(self) -> torch.Tensor:
        with torch.no_grad():
            return self._sum(self.K.square(), 1).squeeze(1)

    def block(self, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        """The dense block ``K(X, Y)`` (differentiable; :func:`solvers.kernels.matrix`)."""
        return matrix(self.kernel, X, Y, tile_dtype=self.tile_dtype, chunk_size=self.chunk_size, dtype_acc=self.dtype_acc)

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[:, idx]`` (n x len(idx)), no gradient."""
        with torch.no_grad():
            return self.block(self.X.detach(), self.Y.detach()[idx])

    def row_gram(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[idx]^T K[idx]``: blocks of rows formed by lazytensor (``ROW_BLOCK_BYTES`` each) and multiplied
        densely in the source's dtype, n_idx m^2 work that a BLAS product does far faster than streamed passes."""
        m = self.shape[1]
        step = max(1, ROW_BLOCK_BYTES // max(1, m * self.X.element_size()))
        with torch.no_grad():
            blocks = (self.block(self.X.detach()[idx[start:start + step]], self.Y.detach()) for start in range(0, len(idx), step))
            return symmetric_gram(blocks, m, self.dtype, self.device)

    def dense(self) -> torch.Tensor:
        """The full matrix (for stored and direct fits, and references: n x m memory), differentiable."""
        return self.block(self.X, self.Y)


class ShardedKernel(Source):
    """``K(X, Y)`` with the rows ``X`` sharded over the ranks of a ``torch.distributed`` group.

    Each rank passes its own rows ``X_local``; ``Y=None`` means every rank's
    points (gathered once: the square kernel of the whole data set), otherwise
    ``Y`` is replicated. Vectors indexed by rows are whole on every rank. A
    product evaluates this rank's rows only (a lazytensor sum, as in
    :class:`StreamedKernel`) and meets the other ranks in one collective:
    ``K @ V`` all-gathers the row blocks, ``K.T @ U`` and ``gram`` all-reduce an
    (m, c) sum. Every rank then holds the same result, so Krylov methods run
    the same arithmetic on every rank. No gradients (products are ``no_grad``).
    The group: ``sharding`` (a :class:`lazytensor.distributed.Sharding`), else
    the active ``lazytensor.distributed.sharded`` context, else the world.
    """

    def __init__(self, kernel, X_local: torch.Tensor, Y: torch.Tensor | None = None, *, sharding=None, chunk_size=None,
                 tile_dtype: torch.dtype | None = None):
        X_local = check_tensor(X_local, "X_local").detach()
        self.sharding = sharding or distributed.active() or distributed.Sharding()
        self.sizes = self.sharding.sizes(X_local.shape[0], X_local.device)  # every rank's rows: gathers need no more
        start = sum(self.sizes[:self.sharding.rank])
        self.rows = slice(start, start + X_local.shape[0])
        self.symmetric = Y is None  # then the columns are every rank's points, gathered once
        self.Y = self.gather(X_local) if Y is None else check_tensor(Y, "Y").detach()
        self.local = StreamedKernel(kernel, X_local, self.Y, chunk_size, tile_dtype)
        self.tile_dtype = self.local.tile_dtype
        self.shape = (sum(self.sizes), self.Y.shape[0])
        self.dtype, self.device = X_local.dtype, X_local.device

    def with_tile_dtype(self, tile_dtype: torch.dtype, sum_dtype: torch.dtype | None = None) -> "ShardedKernel":
        """The same sharded kernel evaluated in ``tile_dtype`` and summed in ``sum_dtype`` (nothing gathered again)."""
        other = copy.copy(self)
        other.local = self.local.with_tile_dtype(tile_dtype, sum_dtype)
        other.tile_dtype = other.local.tile_dtype
        return other

    @staticmethod
    def _own(local) -> torch.Tensor:
        """``local()``, this rank's product, computed unsharded."""
        with torch.no_grad(), distributed.local():
            return local()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` (one per row of its ``X_local``) in rank order: one collective."""
        return self.sharding.gather_rows(rows, self.sizes)[0]

    def _rows(self, local) -> torch.Tensor:
        """Every rank's rows of ``local()`` in rank order."""
        return self.gather(self._own(local))

    def _summed(self, local) -> torch.Tensor:
        """The sum over ranks of ``local()`` (this rank's rows' contribution)."""
        return self.sharding.all_reduce(self._own(local))

    def matmul(self, V):
        return self._rows(lambda: self.local.matmul(V))

    def rmatmul(self, U):
        return self._summed(lambda: self.local.rmatmul(U[self.rows]))

    def gram(self, V):
        """``K^T (K V)``: this rank's rows of ``K V`` stay local; one all-reduce of the (m, c) sum."""
        return self._summed(lambda: self.local.gram(V))

    def own_diag(self) -> torch.Tensor:
        """This rank's rows of ``diag()`` (no collective)."""
        if not self.symmetric:
            raise ValueError("diag() needs a square kernel source (Y=None)")
        return self._own(StreamedKernel(self.local.kernel, self.local.X, tile_dtype=self.local.tile_dtype).diag)

    def diag(self) -> torch.Tensor:
        return self.gather(self.own_diag())

    def squared_row_norms(self) -> torch.Tensor:
        return self._rows(self.local.squared_row_norms)

    def own_columns(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``columns(idx)`` (no collective)."""
        return self._own(lambda: self.local.columns(idx))

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gather(self.own_columns(idx))

    def own_picks(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the global row indices ``idx`` are this rank's: their positions in ``idx`` and local row numbers."""
        local = idx - self.rows.start
        at = ((local >= 0) & (local < self.rows.stop - self.rows.start)).nonzero().squeeze(1)
        return at, local[at]

    def row_gram(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` over every rank's rows: each rank multiplies its own picks, one all-reduce of the m x m sum."""
        return self._summed(lambda: self.local.row_gram(self.own_picks(idx)[1]))


def as_source(A) -> Source:
    """A source from a source or an explicit matrix."""
    if isinstance(A, Source):
        return A
    if isinstance(A, torch.Tensor):
        return StoredKernel(A)
    raise TypeError(f"A must be a solvers source (StreamedKernel, StoredKernel) or a tensor, got {type(A).__name__}")


class FunctionOperator(Source):
    """A linear operator given by functions (composed operators: shifts, centring, normal equations)."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device, matvec, rmatvec=None):
        self.shape = tuple(shape)
        self.dtype, self.device = dtype, torch.device(device)
        self._matvec = matvec
        self._rmatvec = matvec if rmatvec is None else rmatvec

    def matmul(self, V):
        return self._matvec(V)

    def rmatmul(self, U):
        return self._rmatvec(U)
