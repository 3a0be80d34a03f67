"""Sources: the (implicit) matrices that the Krylov methods multiply by.

A source answers ``A @ V``, ``A.T @ U``, ``diag()``, ``columns(idx)`` and
``gram(V) = A^T (A V)``, plus ``shape``, ``dtype`` and ``device``.
:class:`StreamedKernel` never stores its matrix: it regenerates row-block tiles
from the kernel and the points on every product, feeding all columns of ``V``
from one pass over the tiles into one reused buffer. :class:`StoredKernel`
wraps an explicit matrix and uses direct ATen products.
"""
from __future__ import annotations

import torch

from .kernels import as_kernel
from .tiling import kernel_matmul, row_blocks, rows_per_block

__all__ = ["Source", "StreamedKernel", "StoredKernel", "FunctionOperator", "as_source"]


def _check_points(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != 2 or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating (n, d) tensor, got shape {tuple(t.shape)} and dtype {t.dtype}")
    return t


class Source:
    """Common operator surface; subclasses implement the no-grad products."""

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

    def matmul(self, V: torch.Tensor) -> torch.Tensor:
        return self.matmul_nograd(V)

    def rmatmul(self, U: torch.Tensor) -> torch.Tensor:
        """``A.T @ U`` for a 2-D ``U``."""
        U2, vector = self._operand(U, self.shape[0], "U")
        out = self.rmatmul_nograd(U2)
        return out.squeeze(1) if vector else out

    @property
    def T(self) -> "Source":
        return _Transposed(self)

    def matmul_nograd(self, V: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rmatmul_nograd(self, U: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gram(self, V: torch.Tensor) -> torch.Tensor:
        """``A^T (A V)``."""
        return self.rmatmul_nograd(self.matmul_nograd(V))


class _Transposed(Source):
    def __init__(self, base: Source):
        self.base = base
        self.shape = (base.shape[1], base.shape[0])
        self.dtype, self.device = base.dtype, base.device

    def matmul_nograd(self, V):
        return self.base.rmatmul_nograd(V)

    def rmatmul_nograd(self, U):
        return self.base.matmul_nograd(U)

    @property
    def T(self):
        return self.base


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

    def matmul_nograd(self, V):
        return self.matrix @ V

    def rmatmul_nograd(self, U):
        return self.matrix.T @ U

    def diag(self) -> torch.Tensor:
        return self.matrix.diagonal()

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        return self.matrix[:, idx]


class StreamedKernel(Source):
    """The kernel matrix ``K[i, j] = kernel(X[i], Y[j])`` generated tile by tile.

    ``chunk_size`` is the number of rows per tile (default: an 8 MiB budget).
    ``tile_dtype=torch.float32`` evaluates tiles in single precision and
    accumulates the products in the dtype of ``X`` (faster exp, but about 1e-7
    relative error in each entry: use it where the solve tolerance allows).
    Products are differentiable with respect to ``X``, ``Y``, ``V`` and the
    kernel parameters (the backward pass streams too).
    """

    def __init__(self, kernel, X: torch.Tensor, Y: torch.Tensor | None = None, chunk_size: int | None = None,
                 tile_dtype: torch.dtype | None = None):
        self.kernel = as_kernel(kernel)
        self.X = _check_points(X, "X")
        self.Y = self.X if Y is None else _check_points(Y, "Y")
        self.symmetric = Y is None
        if self.Y.shape[1] != self.X.shape[1] or self.Y.dtype != self.X.dtype or self.Y.device != self.X.device:
            raise ValueError(f"Y must match X in features, dtype and device: X {tuple(self.X.shape)} {self.X.dtype}, "
                             f"Y {tuple(self.Y.shape)} {self.Y.dtype}")
        if tile_dtype not in (None, self.X.dtype, torch.float32):
            raise ValueError(f"tile_dtype must be None or torch.float32, got {tile_dtype}")
        self.tile_dtype = tile_dtype or self.X.dtype
        self.shape = (self.X.shape[0], self.Y.shape[0])
        self.dtype, self.device = self.X.dtype, self.X.device
        self.chunk_size = rows_per_block(self.shape[1], torch.finfo(self.tile_dtype).bits // 8, chunk_size)
        self._buffers: dict[str, torch.Tensor] = {}
        self._tile_points = None

    # -- tile generation -------------------------------------------------
    def _points(self):
        """Points in the tile dtype and the kernel's per-column state, built once."""
        if self._tile_points is None:
            with torch.no_grad():
                X = self.X.detach().to(self.tile_dtype)
                Y = X if self.symmetric else self.Y.detach().to(self.tile_dtype)
                self._tile_points = (X, Y, self.kernel.prepare(Y))
        return self._tile_points

    def _buffer(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.dtype != dtype:
            buf = torch.empty(rows, self.shape[1], dtype=dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:rows]

    def tiles(self):
        """Yield ``(row_slice, tile)``; the tile lives in a reused buffer, in the source dtype."""
        X, Y, state = self._points()
        with torch.no_grad():
            for sl in row_blocks(self.shape[0], self.chunk_size):
                rows = sl.stop - sl.start
                tile = self.kernel.tile_into(X[sl], Y, self._buffer("tile", rows, self.tile_dtype), state)
                if self.tile_dtype != self.dtype:
                    tile = self._buffer("wide", rows, self.dtype).copy_(tile)
                yield sl, tile

    # -- products --------------------------------------------------------
    def matmul(self, V):
        needs_grad = torch.is_grad_enabled() and (
            V.requires_grad or self.X.requires_grad or self.Y.requires_grad
            or any(p.requires_grad for p in self.kernel.parameters()))
        return kernel_matmul(self, V) if needs_grad else self.matmul_nograd(V)

    def matmul_nograd(self, V):
        V = V.detach()
        out = torch.empty(self.shape[0], V.shape[1], dtype=self.dtype, device=self.device)
        for sl, tile in self.tiles():
            torch.mm(tile, V, out=out[sl])
        return out

    def rmatmul_nograd(self, U):
        U = U.detach()
        out = torch.zeros(self.shape[1], U.shape[1], dtype=self.dtype, device=self.device)
        for sl, tile in self.tiles():
            out.addmm_(tile.T, U[sl])
        return out

    def gram(self, V):
        """``K^T (K V)`` in one pass: each tile feeds both products."""
        V = V.detach()
        out = torch.zeros(self.shape[1], V.shape[1], dtype=self.dtype, device=self.device)
        for _, tile in self.tiles():
            out.addmm_(tile.T, tile @ V)
        return out

    def diag(self) -> torch.Tensor:
        if not self.symmetric:
            raise ValueError("diag() needs a square kernel source (Y=None)")
        with torch.no_grad():
            return self.kernel.diag(self.X.detach()).to(self.dtype)

    def columns(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[:, idx]`` (n x len(idx)), computed exactly in the source dtype."""
        with torch.no_grad():
            cols = self.Y.detach()[idx]
            out = torch.empty(self.shape[0], cols.shape[0], dtype=self.dtype, device=self.device)
            state = self.kernel.prepare(cols)
            for sl in row_blocks(self.shape[0], rows_per_block(cols.shape[0], self.X.element_size())):
                self.kernel.tile_into(self.X.detach()[sl], cols, out[sl], state)
            return out

    def dense(self) -> torch.Tensor:
        """The full matrix (for references and small problems only)."""
        return self.kernel.tile(self.X, self.Y)


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

    def matmul_nograd(self, V):
        return self._matvec(V)

    def rmatmul_nograd(self, U):
        return self._rmatvec(U)
