"""Block Krylov methods that only ever ask their operator for products.

Every product is one pass over the source with all active columns at once,
so a streamed kernel regenerates its tiles once per iteration no matter how
many right-hand sides or block vectors there are.

* :func:`cg` -- conjugate gradients for many right-hand sides (per-column
  coefficients, shared passes), stopping per column on the true residual.
* :func:`lanczos_eigsh` -- block Lanczos with full reorthogonalization and
  thick restarts (Rayleigh-Ritz on the explicit projection).
* :func:`golub_kahan_svds` -- block Golub-Kahan-Lanczos bidiagonalization for
  leading singular triplets of rectangular sources.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch

from .sources import as_source

# A CG cycle on a cheaper operator (``exact=`` given) checks the exact residual at its iterations 32, 64, 128, ...:
# once the recurrence residual is below a DRIFT-th of it, the cheap operator has reached its precision floor and
# the rest of the solve runs on ``exact``. Without the check an ill-conditioned fit ran its whole cheap cycle past
# that floor (ridge, n = 4096, alpha = 1e-6: 5506 float32 iterations, then stalled at maxiter; exact: 5228).
DRIFT_CHECK_FROM, DRIFT = 32, 2.0

__all__ = ["KrylovInfo", "cg", "lanczos_eigsh", "golub_kahan_svds"]


@dataclass
class KrylovInfo:
    """Diagnostics: ``matvecs`` counts operator applications (passes), each over all active columns.

    ``product_seconds``: wall time spent in those products (CG); estimators that know how
    many kernel entries a pass evaluates set ``pairs_per_second`` from it (NaN otherwise).
    ``norm``: what ``residuals`` measure and CG stopped on (``"euclidean"`` or ``"preconditioned"``).
    """

    iterations: int = 0
    matvecs: int = 0
    product_seconds: float = 0.0
    pairs_per_second: float = float("nan")
    residuals: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    converged: bool = False
    reason: str = ""
    column_converged: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))
    norm: str = "euclidean"

    def __repr__(self):
        worst = float(self.residuals.max()) if self.residuals.numel() else float("nan")
        return (f"KrylovInfo(converged={self.converged}, reason={self.reason!r}, iterations={self.iterations}, "
                f"matvecs={self.matvecs}, max_residual={worst:.3g})")


def _check_tolerances(rtol: float, atol: float, maxiter) -> None:
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a non-negative number, got {type(value).__name__} {value!r}")
    if not (rtol >= 0 and atol >= 0) or rtol != rtol or atol != atol:
        raise ValueError(f"rtol and atol must be non-negative numbers, got rtol={rtol!r}, atol={atol!r}")
    if maxiter is not None and (not isinstance(maxiter, int) or maxiter < 1):
        raise ValueError(f"maxiter must be a positive int or None, got {maxiter!r}")


def _generator(random_state: int, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(int(random_state))
    return gen


def fix_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Flip columns so that each one's largest-magnitude entry is positive."""
    if vectors.numel() == 0:
        return torch.ones(vectors.shape[-1], dtype=vectors.dtype, device=vectors.device)
    idx = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors.gather(0, idx.unsqueeze(0)).squeeze(0))
    return torch.where(signs == 0, torch.ones_like(signs), signs)


# --------------------------------------------------------------------------- CG
def cg(A, B: torch.Tensor, *, M=None, x0: torch.Tensor | None = None, rtol: float = 1e-6, atol: float = 0.0,
       maxiter: int | None = None, exact=None, norm: str = "euclidean"):
    """Solve ``A X = B`` for symmetric positive definite ``A`` and every column of ``B``.

    A column stops when its true residual satisfies ``||b - A x|| <= max(rtol ||b||, atol)``:
    the recurrence residual decides when to check, then the residual is recomputed
    with one more product and CG restarts from there for columns that are not done
    (and reports ``stagnation`` when a restart no longer helps). ``M`` is an optional
    preconditioner: a callable returning an approximation of ``A^{-1} R``.
    ``exact`` is the operator the true residual is computed with (default ``A``):
    with a cheaper, less accurate ``A`` (float32 tiles) each restart is a step of
    iterative refinement, so the answer meets ``rtol`` in ``exact``'s precision;
    if a cycle on ``A`` stalls, breaks down or drifts (its recurrence residual below
    half the exact one at a checkpoint, ``DRIFT_CHECK_FROM``), the remaining cycles use ``exact``.
    ``norm="preconditioned"`` measures residuals (and ``b``) as ``sqrt(r^T M r)``: with
    ``M ~ A^{-1}`` that is the error's energy norm ``||x - x*||_A``, the quantity CG
    minimizes (and the Euclidean residual of the system in the variables ``M`` factors
    into, where Falkon stops). Returns ``(X, info)`` with ``info.residuals`` the final
    true residual norms.
    """
    A = as_source(A)
    exact = A if exact is None else as_source(exact)
    _check_tolerances(rtol, atol, maxiter)
    B, vector = _right_hand_sides(A, B)
    if M is not None and not callable(M):
        raise TypeError(f"M must be a callable R -> approximately A^-1 R, got {type(M).__name__}")
    if norm not in ("euclidean", "preconditioned") or (norm == "preconditioned" and M is None):
        raise ValueError(f"norm must be 'euclidean' or 'preconditioned' (which needs M), got {norm!r}"
                         + (" without M" if norm == "preconditioned" else ""))
    run = _CG(A, exact, B, M, maxiter or min(10 * A.shape[0], 10_000), rtol, atol, norm)
    run.start(_initial_guess(x0, B, vector, A.dtype))
    while True:
        active = (~run.stopped & (run.true_norm > run.target)).nonzero().squeeze(1)
        if active.numel() == 0 or run.info.iterations >= run.maxiter:
            break
        run.cycle(active)
        run.refresh(active)
    return (run.X.squeeze(1) if vector else run.X), run.finish()


def _right_hand_sides(A, B) -> tuple[torch.Tensor, bool]:
    """``B`` as a finite 2-D block in ``A``'s dtype, and whether it was one vector."""
    if not isinstance(B, torch.Tensor):
        raise TypeError(f"B must be a torch.Tensor, got {type(B).__name__}")
    n = A.shape[0]
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be a square operator, got shape {tuple(A.shape)}")
    if B.ndim not in (1, 2) or B.shape[0] != n:
        raise ValueError(f"B must have {n} rows for a square ({n}, {n}) operator, got B {tuple(B.shape)}")
    vector = B.ndim == 1
    B = (B.unsqueeze(1) if vector else B).detach().to(A.dtype)
    if not torch.isfinite(B).all():
        raise ValueError("B contains NaN or infinite values")
    return B, vector


def _initial_guess(x0, B: torch.Tensor, vector: bool, dtype) -> torch.Tensor | None:
    """``x0`` as a 2-D block shaped like ``B`` (None: start from zero)."""
    if x0 is None:
        return None
    shape = B.squeeze(1).shape if vector else B.shape
    if not isinstance(x0, torch.Tensor) or x0.shape != shape:
        got = tuple(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__
        raise ValueError(f"x0 must be a tensor shaped like B {tuple(shape)}, got {got}")
    return (x0.unsqueeze(1) if vector else x0).detach().to(dtype).clone()


class _CG:
    """One block CG run: the iterate, the true residuals and which columns stopped, updated by named steps."""

    def __init__(self, A, exact, B, M, maxiter: int, rtol: float, atol: float, norm: str):
        self.A, self.exact, self.B, self.M, self.maxiter, self.norm = A, exact, B, M, maxiter, norm
        self.target = torch.clamp(rtol * self.measure(B), min=atol)
        self.guard = max(A.shape[0], 10) * torch.finfo(A.dtype).eps  # cosines below this are roundoff: no curvature
        self.info = KrylovInfo(norm=norm)
        self.stopped = torch.zeros(B.shape[1], dtype=torch.bool, device=B.device)  # converged or broken down
        self.broken = torch.zeros_like(self.stopped)
        self.drifted = False  # a cheap cycle's recurrence left the exact residual behind
        self.reason = "maxiter"

    def product(self, op, V):
        start = time.perf_counter()
        out = _finite(op.matmul_nograd(V), "A")
        self.info.product_seconds += time.perf_counter() - start
        return out

    def precondition(self, R):
        if self.M is None:
            return R
        Z = self.M(R)
        if not isinstance(Z, torch.Tensor) or Z.shape != R.shape:
            got = tuple(Z.shape) if isinstance(Z, torch.Tensor) else type(Z).__name__
            raise ValueError(f"M must map a residual block of shape {tuple(R.shape)} to the same shape, got {got}")
        return Z.to(R.dtype)

    def measure(self, R, Z=None) -> torch.Tensor:
        """Column norms of residuals ``R`` in the stopping norm (``Z``: ``M R`` when known)."""
        if self.norm == "euclidean":
            return R.norm(dim=0)
        Z = self.precondition(R) if Z is None else Z
        return (R * Z).sum(0).clamp_min(0).sqrt()

    def start(self, X0) -> None:
        """The iterate and its true residual: ``B`` itself from zero, one product from ``x0``."""
        self.X = torch.zeros_like(self.B) if X0 is None else X0
        self.R = self.B - self.product(self.exact, self.X) if X0 is not None else self.B.clone()
        self.info.matvecs += X0 is not None
        self.true_norm = self.measure(self.R)

    def stop(self, columns) -> None:
        """Columns whose curvature or preconditioned residual vanished: not positive definite there."""
        self.broken[columns] = True
        self.stopped[columns] = True

    def cycle(self, active) -> None:
        """A fresh CG cycle on the ``active`` columns from their true residual, until each one's
        recurrence residual meets its target (or breaks down, or ``maxiter``)."""
        info, guard = self.info, self.guard
        Ra = self.R[:, active]
        Z = self.precondition(Ra)
        P = Z.clone()
        rz = (Ra * Z).sum(0)
        live = torch.arange(active.numel(), device=self.B.device)
        steps = 0
        while live.numel() and info.iterations < self.maxiter:
            steps += 1
            cols = active[live]
            AP = self.product(self.A, P[:, live])
            info.matvecs += 1
            info.iterations += 1
            Pl = P[:, live]
            curvature = (Pl * AP).sum(0)
            bad = ~(curvature > guard * Pl.norm(dim=0) * AP.norm(dim=0))
            if bad.any():  # p^T A p lost in roundoff or negative: A is not positive definite here
                self.stop(cols[bad])
            step = torch.where(bad, torch.zeros_like(curvature), rz[live] / torch.where(bad, 1.0, curvature))
            self.X[:, cols] += Pl * step
            Ra[:, live] -= AP * step
            Zl = self.precondition(Ra[:, live])
            recurrence = self.measure(Ra[:, live], Zl)
            if self._drifted(steps, cols, recurrence):
                break
            going = ~bad & (recurrence > self.target[cols])
            live, Zl = live[going], Zl[:, going]
            if live.numel() == 0:
                break
            rz_new = (Ra[:, live] * Zl).sum(0)
            dead = ~(rz_new > guard * Ra[:, live].norm(dim=0) * Zl.norm(dim=0))  # preconditioner not SPD
            if dead.any():
                self.stop(active[live[dead]])
            P[:, live] = Zl + P[:, live] * (rz_new / rz[live])
            rz[live] = rz_new
            live = live[~dead]

    def _drifted(self, steps: int, cols, recurrence) -> bool:
        """At a cheap cycle's checkpoints (``DRIFT_CHECK_FROM`` steps, then each doubling): whether the exact
        residual of ``cols`` exceeds ``DRIFT`` times the recurrence's (one exact product)."""
        if self.A is self.exact or steps < DRIFT_CHECK_FROM or steps & (steps - 1):
            return False
        true = self.measure(self.B[:, cols] - self.product(self.exact, self.X[:, cols]))
        self.info.matvecs += 1
        self.drifted = bool((true > DRIFT * recurrence).any())
        return self.drifted

    def refresh(self, active) -> None:
        """Recompute the true residual of the columns just iterated; a cycle that did not halve it met a
        precision floor: the cheap operator's (go exact) or the problem's (those columns stop, stagnation)."""
        previous = self.true_norm[active].clone()
        self.R[:, active] = self.B[:, active] - self.product(self.exact, self.X[:, active])
        self.info.matvecs += 1
        self.true_norm[active] = self.measure(self.R[:, active])
        stalled = (self.true_norm[active] > self.target[active]) & (self.true_norm[active] >= 0.5 * previous)
        if self.A is not self.exact and (stalled.any() or self.broken.any() or self.drifted):
            self.A = self.exact
            self.stopped[:], self.broken[:] = False, False
        elif self.info.iterations < self.maxiter and stalled.any():
            self.stopped[active[stalled]] = True
            self.reason = "stagnation"

    def finish(self) -> KrylovInfo:
        """The info: final true residuals, which columns converged, and why the run ended."""
        info, done = self.info, self.true_norm <= self.target
        info.residuals, info.column_converged, info.converged = self.true_norm, done, bool(done.all())
        if info.converged:
            info.reason = "converged"
        elif self.broken.any():
            info.reason = "breakdown: the operator or preconditioner is not positive definite"
        else:
            info.reason = self.reason
        return info


# ------------------------------------------------------------ block bases
def _extend(W: torch.Tensor, basis: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Orthonormal block spanning ``W`` outside ``span(basis)``.

    Projected out of the basis and normalized twice: a column that was nearly
    dependent is divided by a tiny ``R_jj``, which magnifies its roundoff inside
    the basis (up to 3e-2 seen near an invariant subspace), and the second pass
    on unit columns removes it. Columns that vanish to roundoff are replaced by
    random directions so the block keeps its width (an invariant subspace was found).
    """
    n, width = W.shape
    eps = torch.finfo(W.dtype).eps
    scale = W.norm(dim=0).clamp_min(torch.finfo(W.dtype).tiny)
    for _ in range(3):
        Q, R = torch.linalg.qr(_project_out(W, basis))
        Q, R_again = torch.linalg.qr(_project_out(Q, basis))
        weak = (R.diagonal().abs() <= 10 * n * eps * scale) | (R_again.diagonal().abs() <= 0.5)
        if not weak.any():
            return Q
        W = torch.where(weak, torch.randn(n, width, generator=gen, dtype=W.dtype, device=W.device), Q)
        scale = W.norm(dim=0)
    return Q


def _project_out(W: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return W - basis @ (basis.T @ W) if basis.shape[1] else W


def _restart(Q: torch.Tensor, AQ: torch.Tensor, Y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The basis ``Q Y`` and its image ``A Q Y``, re-orthonormalized: ``Q Y = Q' R`` with ``R`` ~ I,
    so the rounding each restart adds does not pile up over hundreds of restarts."""
    Q, R = torch.linalg.qr(Q @ Y)
    return Q, torch.linalg.solve_triangular(R, AQ @ Y, upper=True, left=False)


def _default_basis(p: int, limit: int, max_basis: int | None) -> int:
    """Basis columns kept before a restart: six blocks unless told otherwise."""
    cap = 6 * p if max_basis is None else max_basis
    if cap < 2 * p and cap < limit:
        raise ValueError(f"max_basis must be at least twice the block width {p}, got {max_basis}")
    return min(limit, cap)


def _settle(info: KrylovInfo, residuals: torch.Tensor, tol, *, full: bool, maxiter: int) -> bool:
    """Record the Ritz residuals; True when the iteration should stop (converged, exact or out of steps)."""
    info.residuals = residuals
    info.column_converged = (residuals <= tol) | full
    if bool(info.column_converged.all()):
        info.converged, info.reason = True, "converged"
    return info.converged or info.iterations >= maxiter


def _finite(product: torch.Tensor, name: str) -> torch.Tensor:
    if not bool(torch.isfinite(product).all()):
        raise ValueError(f"the operator {name} returned NaN or infinite values; check the matrix or kernel for "
                         f"non-finite entries")
    return product


def _check_rank(k, limit: int, name: str = "k") -> int:
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 1 <= k <= limit:
        raise ValueError(f"{name} must be an int in [1, {limit}], got {k!r}")
    return int(k)


# ---------------------------------------------------------------- Lanczos
def lanczos_eigsh(A, k: int, *, search_width: int = 10, rtol: float = 1e-8, maxiter: int | None = None,
                  max_basis: int | None = None, random_state: int = 0, which: str = "LA"):
    """Leading ``k`` eigenpairs of a symmetric operator by block Lanczos.

    The block has ``k + search_width`` columns (a streamed pass costs about the
    same for one column or twelve, so width buys fewer passes). Every new block
    is fully reorthogonalized; when the basis reaches ``max_basis`` columns it
    is restarted from the leading Ritz vectors. A pair is accepted when
    ``||A u - theta u|| <= rtol * max|theta|``. ``which`` is ``"LA"`` (largest
    algebraic) or ``"LM"`` (largest magnitude). Returns
    ``(eigenvalues (k,), eigenvectors (n, k), info)``, eigenvalues in decreasing
    order of the chosen criterion and signs fixed.
    """
    A = as_source(A)
    n = A.shape[0]
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be square, got shape {A.shape}")
    k = _check_rank(k, n)
    _check_tolerances(rtol, 0.0, maxiter)
    if which not in ("LA", "LM"):
        raise ValueError(f"which must be 'LA' or 'LM', got {which!r}")
    if not isinstance(search_width, int) or search_width < 0:
        raise ValueError(f"search_width must be a non-negative int, got {search_width!r}")
    p = min(k + search_width, n)
    basis_cap = _default_basis(p, n, max_basis)
    maxiter = maxiter or 1000
    gen = _generator(random_state, "cpu")
    dtype, device = A.dtype, A.device

    def start(width, basis):
        return _extend(torch.randn(n, width, generator=gen, dtype=dtype).to(device), basis, gen)

    info = KrylovInfo(reason="maxiter")
    Q = torch.empty(n, 0, dtype=dtype, device=device)
    AQ = torch.empty_like(Q)
    block = start(p, Q)
    while True:
        A_block = _finite(A.matmul_nograd(block), "A")
        info.matvecs += 1
        info.iterations += 1
        Q, AQ = torch.cat([Q, block], 1), torch.cat([AQ, A_block], 1)
        H = Q.T @ AQ
        theta, Y = torch.linalg.eigh((H + H.T) / 2)
        order = torch.argsort(theta if which == "LA" else theta.abs(), descending=True)
        theta, Y = theta[order], Y[:, order]
        vectors = Q @ Y[:, :k]
        residuals = (AQ @ Y[:, :k] - vectors * theta[:k]).norm(dim=0)
        tol = rtol * theta.abs().max().clamp_min(torch.finfo(dtype).tiny)
        if _settle(info, residuals, tol, full=Q.shape[1] >= n, maxiter=maxiter):
            break
        W = A_block - Q @ (Q.T @ A_block)
        if Q.shape[1] + p > basis_cap:  # thick restart from the leading Ritz vectors
            Q, AQ = _restart(Q, AQ, Y[:, :basis_cap // 2])
        width = min(p, n - Q.shape[1])
        block = _extend(W[:, :width], Q, gen)
    return theta[:k], vectors * fix_signs(vectors), info


# ---------------------------------------------------------- Golub-Kahan
def golub_kahan_svds(A, k: int, *, search_width: int = 10, rtol: float = 1e-8, maxiter: int | None = None,
                     max_basis: int | None = None, random_state: int = 0):
    """Leading ``k`` singular triplets of a rectangular source by block Golub-Kahan-Lanczos.

    Right blocks ``V_j`` and left blocks ``U_j = orth(A V_j)`` are both fully
    reorthogonalized; ``U^T A V`` is the projected matrix and its SVD gives the
    Ritz triplets. A triplet is accepted when
    ``sqrt(||A v - s u||^2 + ||A^T u - s v||^2) <= rtol * s_max``.
    Returns ``(singular_values (k,), left (m, k), right (n, k), info)`` with the
    largest-magnitude entry of each left vector positive.
    """
    A = as_source(A)
    m, n = A.shape
    k = _check_rank(k, min(m, n))
    _check_tolerances(rtol, 0.0, maxiter)
    if not isinstance(search_width, int) or search_width < 0:
        raise ValueError(f"search_width must be a non-negative int, got {search_width!r}")
    p = min(k + search_width, m, n)
    basis_cap = _default_basis(p, n, max_basis)
    maxiter = maxiter or 1000
    gen = _generator(random_state, "cpu")
    dtype, device = A.dtype, A.device

    info = KrylovInfo(reason="maxiter")
    V = torch.empty(n, 0, dtype=dtype, device=device)
    U = torch.empty(m, 0, dtype=dtype, device=device)
    AV, AtU = torch.empty_like(U), torch.empty_like(V)
    V_block = _extend(torch.randn(n, p, generator=gen, dtype=dtype).to(device), V, gen)
    while True:
        AV_block = _finite(A.matmul_nograd(V_block), "A")
        U_block = _extend(AV_block[:, :min(p, m - U.shape[1])], U, gen)  # empty once U spans R^m
        AtU_block = _finite(A.rmatmul_nograd(U_block), "A.T")
        info.matvecs += 2
        info.iterations += 1
        V, AV = torch.cat([V, V_block], 1), torch.cat([AV, AV_block], 1)
        U, AtU = torch.cat([U, U_block], 1), torch.cat([AtU, AtU_block], 1)
        Y, s, Zt = torch.linalg.svd(U.T @ AV, full_matrices=False)
        Z = Zt.T
        left, right = U @ Y[:, :k], V @ Z[:, :k]
        residuals = torch.sqrt((AV @ Z[:, :k] - left * s[:k]).square().sum(0)
                               + (AtU @ Y[:, :k] - right * s[:k]).square().sum(0))
        tol = rtol * s[0].clamp_min(torch.finfo(dtype).tiny)
        if _settle(info, residuals, tol, full=V.shape[1] >= n, maxiter=maxiter):
            break
        # Only the newest A^T U block reaches outside span(V); once U is full, use the Ritz images.
        grow = AtU_block if AtU_block.shape[1] == p else AtU @ Y[:, :p]
        W = grow - V @ (V.T @ grow)
        if V.shape[1] + p > basis_cap:  # thick restart: A V' = U' diag(s') holds exactly
            keep = min(basis_cap // 2, Y.shape[1])
            V, AV = _restart(V, AV, Z[:, :keep])
            U, AtU = _restart(U, AtU, Y[:, :keep])
        width = min(p, n - V.shape[1])
        V_block = _extend(W[:, :width], V, gen)
    signs = fix_signs(left)
    return s[:k], left * signs, right * signs, info
