"""The description of one reduction problem: its variables' IR info and tensors, in kernel order.

Everything downstream (tile plans, kernel keys, the tile loop) reads the
problem, never the user's formula object.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import sympy
import torch
from torch._subclasses.fake_tensor import is_fake

from . import ir


def kernel_order(info: dict, symbols) -> list:
    """``symbols`` in tile-kernel argument order: by axis (i, j, p), then by position."""
    return sorted(symbols, key=lambda s: (ir.AXES.index(info[s].axis), ir.creation_index(s)))


@dataclass
class Problem:
    """Variables of one reduction: IR info and their tensors.

    i/j tensors are (B, N, D) / (B, M, D) with B equal to the batch size or 1;
    parameters are (B, D) (B may be 1). ``order`` fixes the argument order of
    tile kernels. ``traced``: its tensors are a compiler's stand-ins (fake), not values.
    """

    info: dict[sympy.Symbol, ir.VarInfo]
    tensors: dict[sympy.Symbol, torch.Tensor]
    order: list[sympy.Symbol] = field(default_factory=list)
    total: int | None = None  # the reduced axis's size over every rank when it is sharded (``sharded_over``)

    def __post_init__(self):
        if not self.order:
            self.order = kernel_order(self.info, self.tensors)
        # read many times a pass, so computed once (plain attributes: a cached_property's first read on each new
        # problem takes a lock, ~0.8 us more than an attribute set here)
        self._by_axis = {axis: [] for axis in ir.AXES}
        for s in self.order:
            self._by_axis[self.info[s].axis].append(s)
        self._sizes = {axis: self.tensors[syms[0]].shape[1] for axis, syms in self._by_axis.items() if syms and axis != "p"}
        first = next(iter(self.tensors.values()), None)
        self.batch = max((t.shape[0] for t in self.tensors.values()), default=1)
        self.dtype = None if first is None else first.dtype
        self.device = None if first is None else first.device
        self.traced = any(type(t) is not torch.Tensor and is_fake(t) for t in self.tensors.values())

    def axis_symbols(self, axis: str) -> list[sympy.Symbol]:
        return list(self._by_axis[axis])

    def size(self, axis: str) -> int:
        size = self._sizes.get(axis)
        if size is None:
            raise ValueError(f"the formula has no {axis}-indexed variable")
        return size

    @property
    def reduced_size(self) -> int:
        """How many entries the j axis reduces over (all ranks' when sharded)."""
        return self.size("j") if self.total is None else self.total

    def sharded_over(self, total: int) -> "Problem":
        """This problem as one rank's shard of a reduced axis of ``total`` entries over every rank."""
        return dataclasses.replace(self, total=total)

    def extended(self, extra: dict[sympy.Symbol, tuple[torch.Tensor, str]]) -> "Problem":
        """The problem plus new variables (placed after the existing ones)."""
        info, tensors = dict(self.info), dict(self.tensors)
        for sym, (tensor, axis) in extra.items():
            info[sym] = ir.VarInfo(axis, tensor.shape[-1])
            tensors[sym] = tensor
        return Problem(info, tensors, self.order + list(extra), self.total)

    def canonical(self, exprs: list[sympy.Expr]) -> tuple:
        """A structural key for ``exprs``: symbols renamed by axis and position (sympy compares and hashes
        expressions structurally, so the renamed expressions are the key; printing them cost ~1 ms a call)."""
        return _canonical(tuple(exprs), tuple((s, self.info[s]) for s in self.order))


@functools.lru_cache(maxsize=1024)
def _canonical(exprs: tuple, order: tuple) -> tuple:
    rename = {s: ir.make_symbol(f"{info.axis}{k}_{info.dim}") for k, (s, info) in enumerate(order)}
    return tuple(e.xreplace(rename) for e in exprs)

