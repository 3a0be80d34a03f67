"""``source="auto"``: the route rule and its thresholds, shared by the estimators and ``LazyTensor.solve``.

Plain numbers and two small functions, nothing imported: :mod:`solvers.base` re-exports
them for the estimators, and :mod:`solvers.formula_solve` takes them from here, so a
``K.solve(...)`` leaves scikit-learn (what ``base`` stands on, ~1.6 s to import) unimported.
"""
from __future__ import annotations

__all__ = ["AUTO_DIRECT_MAX_N", "AUTO_SPECTRAL_DIRECT_MAX_N", "AUTO_STORED_MAX_BYTES", "AUTO_RANK_MAX", "auto_source",
           "auto_rank"]

# source="auto" takes the route measured fastest for the size (`python -m harness ml --variants
# stored,direct`, docs/solvers.md): the direct factorization up to an estimator's
# ``_auto_direct_max_n`` training points, then the iterative fit on the stored matrix while it takes
# at most AUTO_STORED_MAX_BYTES, streamed above. Ridge (since its CG iterates on float64 tiles, session 34): direct
# 1.2-1.3x faster at n = 1024 and 1280; the stored fit 1.1x faster at 1536 and 1.6x at 2048 (it was equal there before).
# A dense eigh / SVD costs more: the stored Lanczos was as fast
# at n = 256 and 2-4.7x faster from 512 on (PCA, SVD); LDA's direct solve (K H K, one Cholesky) won to 512.
# A stored matrix's products are ATen matrix products, where each streamed pass evaluates the kernel again.
AUTO_DIRECT_MAX_N = 1280
AUTO_SPECTRAL_DIRECT_MAX_N = 256
AUTO_STORED_MAX_BYTES = 128 << 20
AUTO_RANK_MAX = 2048  # the default preconditioner rank's cap (a float32 factor: 8 KiB per training point)


def auto_source(n: int, m: int | None = None, itemsize: int = 8, *, direct_max_n: int, stored_max_bytes: int) -> str:
    """``source="auto"``'s route for an ``n x m`` kernel (``m`` default ``n``) of ``itemsize``-byte entries: the
    direct factorization up to ``direct_max_n`` points, the stored matrix while it takes at most
    ``stored_max_bytes``, streamed above. The estimators' rule (``Estimator._resolve_source``) and
    ``LazyTensor.solve``'s (:mod:`solvers.formula_solve`, with its own thresholds)."""
    if n <= direct_max_n:
        return "direct"
    return "stored" if n * (n if m is None else m) * itemsize <= stored_max_bytes else "streamed"


def auto_rank(n: int) -> int:
    """The default Nystrom preconditioner rank: ``8 sqrt(n)``, a multiple of 64, at most ``AUTO_RANK_MAX`` (and
    ``n``): there the preconditioner's O(n r^2) set-up and the passes it saves balance (docs/solvers.md)."""
    return min(n, AUTO_RANK_MAX, max(64, 64 * round(8 * n**0.5 / 64)))
