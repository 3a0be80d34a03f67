"""Search subspaces: linear maps from a few coordinates z to parameter changes.

A subspace is a list of blocks, each owning a contiguous range of z and one
parameter tensor. Two block kinds cover everything here:

* ``EntryBlock``: each coordinate moves one entry of the parameter;
* ``FactoredBlock``: the coordinates fill (part of) a small matrix A and the
  parameter, viewed as ``(out, in)``, moves by ``A @ B`` with a fixed basis B
  (``(r, in)``) and optionally a fixed left basis L: ``L @ A @ B``.

The block structure is what lets evaluators turn a candidate into a few
activation corrections instead of a full weight matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .param_layout import ParameterLayout, ParamSlot


@dataclass(frozen=True, eq=False)
class EntryBlock:
    """Coordinates ``offset .. offset + dim`` move the parameter entries ``entries``."""

    slot: ParamSlot
    offset: int
    entries: torch.Tensor  # (dim,) local flat offsets into the parameter

    @property
    def dim(self) -> int:
        return self.entries.numel()

    def displacement(self, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """(C, numel) change of the parameter for coordinates ``positions`` set to ``values``."""
        out = values.new_zeros(values.shape[0], self.slot.numel)
        out[:, self.entries[positions]] = values
        return out


@dataclass(frozen=True, eq=False)
class FactoredBlock:
    """Coordinates fill entries ``coords`` of A; the parameter moves by ``[left @] A @ right``."""

    slot: ParamSlot
    offset: int
    coords: torch.Tensor  # (dim,) flat offsets into A
    right: torch.Tensor  # (r, in) fixed input basis B
    left: torch.Tensor | None = None  # (out, r_out) fixed output basis, or None: A is (out, r)

    @property
    def dim(self) -> int:
        return self.coords.numel()

    @property
    def core_shape(self) -> tuple[int, int]:
        rows = self.slot.shape[0] if self.left is None else self.left.shape[1]
        return rows, self.right.shape[0]

    def factors(self, positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) with A ``(C, out, r)`` and B ``(r, in)`` such that the weight change is A @ B."""
        rows, rank = self.core_shape
        core = values.new_zeros(values.shape[0], rows * rank)
        core[:, self.coords[positions]] = values
        core = core.view(-1, rows, rank)
        a = core if self.left is None else self.left.to(values.dtype) @ core
        return a, self.right.to(values.dtype)

    def displacement(self, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        a, b = self.factors(positions, values)
        return (a @ b).reshape(values.shape[0], self.slot.numel)


class BlockSubspace:
    """A subspace made of blocks; ``to_flat`` is linear in z."""

    def __init__(self, layout: ParameterLayout, blocks: list):
        self.layout = layout
        self.blocks = tuple(b for b in blocks if b.dim > 0)
        self.dim = sum(b.dim for b in self.blocks)
        if self.dim == 0:
            raise ValueError("subspace has no coordinates")
        self._offsets = torch.tensor([b.offset for b in self.blocks])

    @property
    def block_sizes(self) -> list[int]:
        """Coordinates per block (one block per parameter tensor): the optimizer's per-tensor blocks."""
        return [b.dim for b in self.blocks]

    def split(self, index: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Group subspace coordinates by block: block id -> (positions in ``index``, coordinates within the block)."""
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.dim):
            raise ValueError(f"subspace index must lie in [0, {self.dim}); got [{int(index.min())}, {int(index.max())}]")
        ids = torch.searchsorted(self._offsets, index.cpu(), right=True) - 1
        out = {}
        for block_id in torch.unique(ids).tolist():
            positions = torch.nonzero(ids == block_id).flatten().to(index.device)
            out[block_id] = (positions, index[positions] - self.blocks[block_id].offset)
        return out

    def to_flat(self, z: torch.Tensor) -> torch.Tensor:
        """(C, dim) coordinates -> (C, n) flat displacements."""
        if z.dim() != 2 or z.shape[1] != self.dim:
            raise ValueError(f"z must have shape (C, {self.dim}), got {tuple(z.shape)}")
        out = z.new_zeros(z.shape[0], self.layout.n)
        for block in self.blocks:
            positions = torch.arange(block.dim, device=z.device)
            values = z[:, block.offset : block.offset + block.dim]
            out[:, block.slot.start : block.slot.stop] += block.displacement(positions, values)
        return out

    def __repr__(self) -> str:
        kinds = {}
        for b in self.blocks:
            kinds[type(b).__name__] = kinds.get(type(b).__name__, 0) + b.dim
        return f"{type(self).__name__}(dim={self.dim}, {kinds})"


def _orthonormal_rows(rows: int, cols: int, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) matrix with orthonormal rows: QR of a Gaussian."""
    q, _ = torch.linalg.qr(torch.randn(cols, rows, generator=generator, dtype=torch.float64))
    return q.T.to(dtype=like.dtype, device=like.device).contiguous()


def _check_rank(rank, max_subspace_dim) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if max_subspace_dim is not None and (isinstance(max_subspace_dim, bool) or not isinstance(max_subspace_dim, int)
                                         or max_subspace_dim < 1):
        raise ValueError(f"max_subspace_dim must be a positive integer or None, got {max_subspace_dim!r}")


def _cap(specs: list[tuple], max_dim: int | None, generator: torch.Generator) -> list[tuple]:
    """Keep a seeded uniform subset of ``max_dim`` coordinates over all (kind, slot, coords, ...) specs."""
    total = sum(spec[2].numel() for spec in specs)
    if max_dim is None or total <= max_dim:
        return specs
    keep = torch.zeros(total, dtype=torch.bool)
    keep[torch.randperm(total, generator=generator)[:max_dim]] = True
    out, start = [], 0
    for spec in specs:
        d = spec[2].numel()
        out.append((spec[0], spec[1], spec[2][keep[start : start + d]], *spec[3:]))
        start += d
    return out


def _build(specs: list[tuple], device: torch.device) -> list:
    blocks, offset = [], 0
    for kind, slot, coords, *bases in specs:
        coords = coords.to(device)
        block = EntryBlock(slot, offset, coords) if kind == "entries" else FactoredBlock(slot, offset, coords, *bases)
        blocks.append(block)
        offset += block.dim
    return blocks


class HybridSubspace(BlockSubspace):
    """Two-sided low rank for large matrices, every entry for small tensors.

    A matrix W (out, in) moves by ``L @ Z @ R.T`` with fixed random orthonormal
    L (out, r) and R (in, r) and r x r coordinates Z; tensors smaller than a
    rank-r factorisation (biases, thin layers) keep one coordinate per entry.
    The dimension grows with depth and rank; ``max_subspace_dim`` bounds it by
    keeping a seeded uniform subset of coordinates.
    """

    @classmethod
    def from_layout(cls, model: nn.Module, rank: int = 4, max_subspace_dim: int | None = None, seed: int = 0) -> "HybridSubspace":
        _check_rank(rank, max_subspace_dim)
        layout = ParameterLayout(model)
        generator = torch.Generator().manual_seed(seed)
        specs = []
        for slot, param in zip(layout.slots, model.parameters()):
            if param.dim() >= 2:
                out, inner = param.shape[0], param.numel() // param.shape[0]
                r_out, r_in = min(rank, out), min(rank, inner)
                if param.numel() > rank * (out + inner):
                    left = _orthonormal_rows(r_out, out, generator, param).T.contiguous()
                    right = _orthonormal_rows(r_in, inner, generator, param)
                    specs.append(("factored", slot, torch.arange(r_out * r_in), right, left))
                    continue
            specs.append(("entries", slot, torch.arange(slot.numel)))
        return cls(layout, _build(_cap(specs, max_subspace_dim, generator), next(model.parameters()).device))


class FactoredSubspace(BlockSubspace):
    """dW = A @ B per matrix with a fixed input basis B (r, in); A (out, r) is searched.

    Sequential linear layers then evaluate ``x @ W.T + (x @ B.T) @ A.T`` without
    building candidate weights. The search is confined to the input directions
    spanned by B; other tensors (biases) keep one coordinate per entry when
    ``include_other`` is true.
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 4,
        *,
        bases: dict[str, torch.Tensor] | None = None,
        include_other: bool = True,
        max_subspace_dim: int | None = None,
        seed: int = 0,
    ):
        _check_rank(rank, max_subspace_dim)
        layout = ParameterLayout(model)
        bases = dict(bases or {})
        unknown = set(bases) - set(layout.by_name)
        if unknown:
            raise ValueError(f"bases names unknown parameters {sorted(unknown)}")
        generator = torch.Generator().manual_seed(seed)
        specs = []
        for slot, param in zip(layout.slots, model.parameters()):
            if param.dim() >= 2:
                out, inner = param.shape[0], param.numel() // param.shape[0]
                basis = bases.pop(slot.name, None)
                if basis is None:
                    basis = _orthonormal_rows(min(rank, inner), inner, generator, param)
                elif basis.dim() != 2 or basis.shape[1] != inner:
                    raise ValueError(f"bases[{slot.name!r}] must have shape (r, {inner}), got {tuple(basis.shape)}")
                specs.append(("factored", slot, torch.arange(out * basis.shape[0]), basis.to(param)))
            elif include_other:
                specs.append(("entries", slot, torch.arange(slot.numel)))
        if bases:
            raise ValueError(f"bases given for parameters that are not matrices: {sorted(bases)}")
        super().__init__(layout, _build(_cap(specs, max_subspace_dim, generator), next(model.parameters()).device))
