"""Changes to one linear layer, expressed as corrections to its output.

A candidate that moves a few weights of ``y = x @ W.T + b`` changes ``y`` by
``x @ dW.T + db``. These terms compute that correction from the layer input
without ever forming ``W + dW``:

* ``SparseTerm``: dW has k nonzero entries (rows, cols): gather + scatter, k x M work;
* ``DenseTerm``: dW is the whole weight, in order: one batched matmul, no
  index bookkeeping (per-tensor blocks with a dense frame);
* ``FactoredTerm``: dW = A @ B: ``(x @ B.T) @ A.T``, r (in + out) x M work;
* ``BiasTerm``: db on a few units.

``LinearChange`` sums them; ``Replacement`` instead swaps in whole candidate
weights (dense candidates, where a correction would cost as much).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _rowwise(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h (M, in) or (C, M, in) times weight.T for weight (C, out, in) -> (C, M, out)."""
    return torch.matmul(h, weight.transpose(-1, -2))


@dataclass(eq=False)
class SparseTerm:
    """dW with entries ``values[:, j]`` at (rows[j], cols[j])."""

    rows: torch.Tensor  # (k,)
    cols: torch.Tensor  # (k,)
    values: torch.Tensor  # (C, k)

    def units(self) -> torch.Tensor | None:
        return torch.unique(self.rows)

    def contribution(self, h: torch.Tensor, units: torch.Tensor, width: int) -> torch.Tensor:
        """(C, M, len(units)) correction on output ``units`` (sorted, covering ``rows``)."""
        pos = torch.searchsorted(units, self.rows)
        count, k = self.values.shape
        if 4 * k >= units.numel() * width:  # dense enough: one small batched matmul
            dw = self.values.new_zeros(count, units.numel(), width)
            dw[:, pos, self.cols] = self.values
            return _rowwise(h, dw)
        g = h[..., self.cols] * self.values.unsqueeze(-2)  # (C, M, k)
        out = g.new_zeros(count, g.shape[-2], units.numel())
        return out.index_add_(-1, pos, g)


@dataclass(eq=False)
class DenseTerm:
    """dW given whole as (C, out, in)."""

    values: torch.Tensor

    def units(self) -> torch.Tensor | None:
        return None  # every output unit

    def contribution(self, h: torch.Tensor, units: torch.Tensor, width: int) -> torch.Tensor:
        return _rowwise(h, self.values)


@dataclass(eq=False)
class FactoredTerm:
    """dW = A @ B with A (C, out, r) per candidate and B (r, in) shared."""

    a: torch.Tensor
    b: torch.Tensor

    def units(self) -> torch.Tensor | None:
        return None  # every output unit

    def contribution(self, h: torch.Tensor, units: torch.Tensor, width: int) -> torch.Tensor:
        projected = h @ self.b.T  # (M, r) or (C, M, r)
        a = self.a if units.numel() == self.a.shape[1] else self.a[:, units]
        return _rowwise(projected, a)


@dataclass(eq=False)
class BiasTerm:
    """db with entries ``values[:, j]`` on units ``rows[j]``."""

    rows: torch.Tensor
    values: torch.Tensor  # (C, k)

    def units(self) -> torch.Tensor | None:
        return torch.unique(self.rows)

    def contribution(self, h: torch.Tensor, units: torch.Tensor, width: int) -> torch.Tensor:
        out = self.values.new_zeros(self.values.shape[0], 1, units.numel())
        out[:, 0, :].index_add_(-1, torch.searchsorted(units, self.rows), self.values)
        return out


@dataclass(eq=False)
class SignPairs:
    """Candidates whose deltas are +- copies of fewer representatives (orthoplex vertices come in pairs)."""

    representatives: torch.Tensor  # (R,) candidate rows computed
    inverse: torch.Tensor  # (C,) representative of each candidate
    signs: torch.Tensor  # (C,) +1 or -1 relative to the representative's row
    halves: bool = False  # rows are [representatives; -representatives]: views and one concatenation, no gathers

    def select(self, delta: torch.Tensor) -> torch.Tensor:
        """The representatives' rows of ``delta``."""
        return delta[: self.representatives.numel()] if self.halves else delta[self.representatives]

    def expand(self, correction: torch.Tensor) -> torch.Tensor:
        """(R, M, u) corrections of the representatives -> (C, M, u): exact, since negation is."""
        if self.halves:
            return torch.cat([correction, -correction])
        return correction[self.inverse] * self.signs.to(correction.dtype)[:, None, None]


def sign_pairs(delta: torch.Tensor) -> SignPairs | None:
    """Find rows of ``delta`` (C, k) equal to +- another row; None when that saves under a quarter."""
    count = delta.shape[0]
    if count < 2 or delta.shape[1] == 0:
        return None
    sums = delta.sum(1)  # rows that are +- each other have +- the same sum (same numbers, same order): cheap screens
    half = count // 2
    # the orthoplex's order: +v rows, then -v rows
    if 2 * half == count and torch.equal(sums[half:], -sums[:half]) and torch.equal(delta[half:], -delta[:half]):
        rows = torch.arange(count, device=delta.device)
        return SignPairs(rows[:half], rows % half, torch.where(rows < half, 1, -1), halves=True)
    if 4 * torch.unique(sums.abs()).numel() > 3 * count:
        return None
    lead = (delta != 0).to(torch.int8).argmax(1)
    signs = torch.where(delta.gather(1, lead[:, None])[:, 0] < 0, -1, 1)
    canonical, inverse = torch.unique(delta * signs[:, None].to(delta.dtype), dim=0, return_inverse=True)
    if 4 * canonical.shape[0] > 3 * count:
        return None
    rows = torch.arange(count, device=delta.device)
    representatives = torch.full((canonical.shape[0],), count, device=delta.device).scatter_reduce(0, inverse, rows, "amin")
    return SignPairs(representatives, inverse, signs * signs[representatives][inverse])  # sign relative to the representative


@dataclass(eq=False)
class LinearChange:
    """Additive change of one linear layer: the sum of its terms.

    With ``pairs``, the terms hold only the representatives' values and the
    correction is expanded to every candidate (valid where the layer input is
    shared, i.e. at the first changed layer).
    """

    terms: list = field(default_factory=list)
    pairs: SignPairs | None = None

    def units(self, out_features: int, device) -> torch.Tensor:
        """Sorted output units the change touches (all of them if any term is dense)."""
        parts = [t.units() for t in self.terms]
        if any(p is None for p in parts):
            return torch.arange(out_features, device=device)
        return torch.unique(torch.cat(parts))

    def correction(self, h: torch.Tensor, units: torch.Tensor, width: int) -> torch.Tensor:
        total = None
        for term in self.terms:
            part = term.contribution(h, units, width)
            total = part if total is None else total + part
        if self.pairs is None:
            return total
        if h.dim() != 2:
            raise RuntimeError("sign-paired corrections need the shared base input")
        return self.pairs.expand(total)


@dataclass(eq=False)
class Replacement:
    """Candidate weights replacing the layer's own; ``None`` keeps the base tensor."""

    weight: torch.Tensor | None  # (C, out, in)
    bias: torch.Tensor | None  # (C, out)

    def output(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = weight if self.weight is None else self.weight
        y = torch.matmul(h, w.transpose(-1, -2))
        b = bias if self.bias is None else self.bias.unsqueeze(-2)
        return y if b is None else y + b


def entry_terms(local: torch.Tensor, values: torch.Tensor, is_weight: bool, out_features: int, in_features: int) -> list:
    """Terms for parameter entries at local flat offsets ``local`` moved by ``values`` (C, k)."""
    if is_weight:
        if local.numel() == out_features * in_features and torch.equal(local, torch.arange(local.numel(), device=local.device)):
            return [DenseTerm(values.reshape(-1, out_features, in_features))]
        return [SparseTerm(torch.div(local, in_features, rounding_mode="floor"), local % in_features, values)]
    return [BiasTerm(local, values)]
