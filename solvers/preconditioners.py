"""Preconditioners for ``(A + shift I) x = b``: callables returning ``~ (A + shift I)^{-1} R``.

:func:`pivoted_cholesky` builds a low-rank factor ``F`` (``F F^T ~ K``) from
kernel columns chosen by randomly pivoted Cholesky: each block of pivots is
drawn in proportion to what the factor still misses on the diagonal, so the
columns go where the kernel has mass (uniformly random columns waste rank on
redundant points). It stops early once the missed trace is below the shift:
the preconditioned system is then already well conditioned.

:class:`LowRankPreconditioner` turns ``F`` into a Nystrom preconditioner in
the spirit of Frangella, Tropp and Udell (2023): ``P = F F^T + nu I`` with
``nu = shift + lam_r``, ``lam_r`` the smallest eigenvalue the factor resolves.
The preconditioned spectrum then lies in ``[shift / nu, 1]``: the resolved
directions map to about 1 and the ones the factor misses keep their own scale.
The plain Woodbury inverse of ``F F^T + shift I`` divides the missed directions
by ``shift`` instead: with a tiny shift (alpha = 1e-6) that amplifies roundoff
and turns a well-conditioned system into an ill-conditioned one (the float32
breakdown this replaces).
:class:`Jacobi` divides by the shifted diagonal; :class:`Cholesky` solves a
small system exactly from its explicitly formed matrix.
"""
from __future__ import annotations

import copy

import torch

from .sources import symmetric_gram

__all__ = ["LowRankPreconditioner", "Jacobi", "Cholesky", "Falkon", "pivoted_cholesky", "nystrom"]

UPCAST_BYTES = 8 * 2**20  # a low-rank factor's float64 row block
# Float64 row blocks are kept (not upcast at every application) while they fit this budget: each upcast read and
# wrote the whole factor (ridge n = 8192, rank 704, 2 targets: 0.14 s of a 2.7 s fit).
KEPT_UPCAST_BYTES = 256 * 2**20
JITTER_TRIES, JITTER_MAX = 12, 0.1  # a Cholesky jitter grows 100x a try, up to a tenth of the largest diagonal entry
PIVOT_BLOCK = 64  # pivots drawn per round: one batched column evaluation each (16-64 measured equal)


class LowRankPreconditioner:
    """``R -> P^{-1} R = (R - F (nu I + F^T F)^{-1} F^T R) / nu`` (see the module docstring).

    ``F`` is kept in its dtype (a float32 factor halves its memory) and every
    product with it runs in float64, on row blocks upcast in turn
    (``UPCAST_BYTES``): the Woodbury subtraction then cancels only to float64
    roundoff, so ``nu`` need only exceed ``sqrt(eps64) * lam_max``. In float32
    the floor ``sqrt(eps32) * lam_max`` lay above the shift and capped what any
    rank could do (ridge, n = 32768, RBF, alpha 0.5: 18 iterations, 13 with
    float64 products; n = 10^5: 29 at rank 2048 and at 4096). One r x r Gram
    matrix, its extreme eigenvalues and a Cholesky factor, all float64.
    With a ``sharding`` (a sharded fit: residuals whole on every rank) ``F`` is
    this rank's ``rows`` of the factor (``pivoted_cholesky`` of a sharded source):
    the Gram and ``F^T R`` are all-reduced and ``F core`` all-gathered.
    """

    def __init__(self, F: torch.Tensor, shift: float, *, sharding=None, rows: slice | None = None):
        self.sharding, self.rows = sharding, slice(None) if sharding is None else rows
        if sharding is not None and F.shape[0] != rows.stop - rows.start:
            raise ValueError(f"F must hold this rank's {rows.stop - rows.start} rows, got {F.shape[0]}")
        # every rank's row count, gathered once: each application's gather then needs no collective for it
        self.sizes = None if sharding is None else sharding.sizes(F.shape[0], F.device)
        self.F = F
        self._kept = None
        if F.shape[0] * F.shape[1] * 8 <= KEPT_UPCAST_BYTES:
            self._kept = list(self._blocks())
        self.gram = self._summed(symmetric_gram((block for _, block in self._blocks()), F.shape[1], torch.float64, F.device))
        lam = torch.linalg.eigvalsh(self.gram) if F.shape[1] else self.gram.new_zeros(1)
        self.floor = float(lam[-1]) * torch.finfo(torch.float64).eps ** 0.5
        self.lam_r = float(lam[0].clamp_min(0))
        self._shifted(shift)

    def _blocks(self):
        """``(start, F[start:start + step] in float64)``: the factor's row blocks, one upcast at a time (or kept)."""
        if self._kept is not None:
            yield from self._kept
            return
        step = max(1, UPCAST_BYTES // (8 * max(1, self.F.shape[1])))
        for start in range(0, self.F.shape[0], step):
            yield start, self.F[start:start + step].double()

    def _summed(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.sharding is None else self.sharding.all_reduce(t)

    def _shifted(self, shift: float) -> None:
        if not shift > 0:
            raise ValueError(f"shift must be positive for a low-rank preconditioner, got {shift!r}")
        self.shift = float(shift)
        self.nu = max(self.shift + self.lam_r, self.floor)
        eye = torch.eye(self.gram.shape[0], dtype=torch.float64, device=self.gram.device)
        self.chol = torch.linalg.cholesky(self.gram + self.nu * eye)

    def with_shift(self, shift: float) -> "LowRankPreconditioner":
        """The preconditioner of ``F F^T + shift I`` sharing this one's factor (one factor serves every shift)."""
        other = copy.copy(self)
        other._shifted(shift)
        return other

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        Rd = R.double()[self.rows]
        RtF = Rd.new_zeros(R.shape[1], self.F.shape[1])  # R^T F, not F^T R: MKL's F^T R with 2 columns was 5x slower
        for start, block in self._blocks():
            RtF.addmm_(Rd[start:start + block.shape[0]].T, block)
        core = torch.cholesky_solve(self._summed(RtF.T), self.chol).T.contiguous().T  # column-major: 1.4x faster
        out = Rd.clone()
        for start, block in self._blocks():
            out[start:start + block.shape[0]].sub_(block @ core)
        out = out.div_(self.nu)
        return (out if self.sharding is None else self.sharding.gather_rows(out, self.sizes)[0]).to(R.dtype)

    @property
    def rank(self) -> int:
        return self.F.shape[1]


class Jacobi:
    """``R -> R / (diag + shift)``."""

    def __init__(self, diag: torch.Tensor, shift: float = 0.0):
        scale = diag + shift
        if not bool((scale > 0).all()):
            raise ValueError("Jacobi preconditioner needs a positive shifted diagonal")
        self.inverse = (1.0 / scale).unsqueeze(1)

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return R * self.inverse


def _factor(A: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """The float64 Cholesky factor of symmetric ``A``, with a jitter from ``size * eps * max|diag|`` grown
    100x until it factors (kernel matrices of close points are indefinite to roundoff); a matrix that needs
    more than ``JITTER_MAX`` of its diagonal is not a roundoff case: a ``ValueError``."""
    scale = float(A.diagonal().abs().max()) if A.numel() else 0.0
    jitter = A.shape[0] * torch.finfo(A.dtype).eps * scale
    for _ in range(JITTER_TRIES):
        if jitter > JITTER_MAX * scale:
            break
        S = A.to(torch.float64, copy=True)
        S = S.add_(S.T.clone()).mul_(0.5)  # m x m temporaries one at a time
        S.diagonal().add_(jitter)
        factor, info = torch.linalg.cholesky_ex(S, upper=upper)
        if int(info) == 0 and bool(torch.isfinite(factor.diagonal()).all()):
            return factor
        jitter *= 100
    raise ValueError(f"the {A.shape[0]} x {A.shape[0]} matrix to factor is not positive semi-definite (or not finite): "
                     f"no jitter up to a tenth of its largest diagonal entry ({scale:.1e}) factors it")


class Cholesky:
    """``R -> A^{-1} R`` from the Cholesky factor of a small explicit SPD matrix ``A`` (float64).

    Roundoff may make ``A`` numerically indefinite: the smallest jitter that factors
    (``_factor``); CG around it still checks the true residual.
    """

    def __init__(self, A: torch.Tensor):
        self.chol = _factor(A)

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_solve(R.double(), self.chol).to(R.dtype)


class Falkon:
    """``R -> P^{-1} R`` for landmark ridge's ``K_nm^T K_nm + shift K_mm`` from ``K_mm`` alone.

    For landmarks drawn uniformly from the n points ``K_nm^T K_nm ~ (n / m) K_mm^2``
    (Rudi, Carratino and Rosasco's Falkon, 2017), so ``P = (n / m) K_mm^2 + shift K_mm
    = T^T A^T A T`` with ``K_mm = T^T T`` and ``A^T A = (n / m) T T^T + shift I``: two
    m x m Cholesky factors (float64, O(m^3) once) and four triangular solves per
    application, where forming the true normal matrix costs n m^2.
    """

    def __init__(self, Kmm: torch.Tensor, n: int, shift: float):
        m = Kmm.shape[0]
        self.T = _factor(Kmm, upper=True)  # jitter in K_mm's dtype (the tiles'), as Cholesky's
        TT = (self.T @ self.T.T).mul_(n / m)  # m x m temporaries one at a time: peak memory ~3 m^2 doubles
        TT.diagonal().add_(shift)
        self.A = torch.linalg.cholesky(TT, upper=True)

    def __call__(self, R: torch.Tensor) -> torch.Tensor:
        Z = R.double()
        for factor in (self.T, self.A):  # (T^T)^{-1} then (A^T)^{-1}
            Z = torch.linalg.solve_triangular(factor.T, Z, upper=False)
        for factor in (self.A, self.T):  # A^{-1} then T^{-1}
            Z = torch.linalg.solve_triangular(factor, Z, upper=True)
        return Z.to(R.dtype)


def _check_rank(rank) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    return rank


def pivoted_cholesky(source, rank: int, *, tolerance: float = 0.0, random_state: int = 0,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F`` (n x r', r' <= rank) with ``F F^T ~ K`` by block randomly pivoted Cholesky.

    ``source`` offers ``diag()`` and ``columns(idx)``. Rounds of ``PIVOT_BLOCK``
    pivots are drawn with probability proportional to the residual diagonal;
    directions of a round's residual block below roundoff are dropped. Stops
    at ``rank`` columns or when the residual trace is at most ``tolerance``.
    ``dtype``: the factor's (default the source's; float32 halves its memory).
    A sharded source (``own_picks``: a ``ShardedKernel``) gives each rank its own
    rows of ``F``: the residual diagonal is gathered, so every rank draws the same
    pivots, and the pivots' rows are summed over the ranks; the n r^2 updates and
    the factor's memory split over them (``LowRankPreconditioner(..., sharding=)``).
    """
    _check_rank(rank)
    n = source.shape[0]
    sharding = source.sharding if hasattr(source, "own_picks") else None
    if sharding is None:
        diag, columns, picks_of = source.diag, source.columns, (lambda idx: (torch.arange(len(idx), device=idx.device), idx))
        everyone, summed = (lambda t: t), (lambda t: t)
    else:
        diag, columns, picks_of = source.own_diag, source.own_columns, source.own_picks
        everyone, summed = source.gather, sharding.all_reduce
    residual = diag().clone().clamp_min_(0)  # this process's rows
    F = residual.new_zeros(residual.shape[0], min(rank, n), dtype=dtype)  # filled left to right; returned as F[:, :found]
    found = 0
    gen = torch.Generator().manual_seed(int(random_state))
    eps = torch.finfo(residual.dtype).eps
    while found < F.shape[1]:
        whole = everyone(residual)
        total = float(whole.sum())
        if not total > tolerance or not total > 0:
            break
        picks = min(PIVOT_BLOCK, F.shape[1] - found, int((whole > 0).sum()))
        idx = torch.multinomial(whole.cpu().double(), picks, replacement=False, generator=gen).sort().values
        idx = idx.to(residual.device)
        mine, rows = picks_of(idx)  # the pivots that are this process's rows: positions in idx, local rows
        pivots = summed(_placed(F[rows, :found], mine, picks))  # F[idx, :found]
        block = columns(idx) - (F[:, :found] @ pivots.T).to(residual.dtype)
        square = summed(_placed(block[rows], mine, picks))  # block[idx]
        values, vectors = torch.linalg.eigh((square + square.T) / 2)
        keep = values > values.max() * picks * eps * 10
        if not keep.any():
            break
        new = block @ (vectors[:, keep] / values[keep].sqrt())
        F[:, found:found + new.shape[1]] = new
        found += new.shape[1]
        residual = (residual - new.square().sum(1)).clamp_min_(0)
        residual[rows] = 0
    return F if found == F.shape[1] else F[:, :found].clone()


def _placed(rows: torch.Tensor, at: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` at positions ``at`` of ``count`` zero rows: one process's share of a block summed over ranks."""
    out = rows.new_zeros(count, *rows.shape[1:])
    out[at] = rows
    return out


def nystrom(source, rank: int, shift: float, random_state: int = 0, dtype: torch.dtype | None = None) -> LowRankPreconditioner:
    """Nystrom preconditioner for ``source + shift I`` from a rank-``rank`` pivoted Cholesky factor (of ``dtype``);
    a sharded source's ranks keep their own rows of it."""
    F = pivoted_cholesky(source, rank, tolerance=shift, random_state=random_state, dtype=dtype)
    if hasattr(source, "own_picks"):
        return LowRankPreconditioner(F, shift, sharding=source.sharding, rows=source.rows)
    return LowRankPreconditioner(F, shift)
