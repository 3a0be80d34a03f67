"""Kernel sources, block Krylov methods and kernel-learning estimators that never store the kernel.

See docs/solvers.md. A kernel is a lazytensor formula of two points: ``RBF``,
``Laplacian``, ``Matern``, any ``k(x, y) -> LazyTensor`` or a formula string;
every kernel product runs through the lazytensor engine.
"""
from .base import AUTO_DIRECT_MAX_N, AUTO_SPECTRAL_DIRECT_MAX_N, AUTO_STORED_MAX_BYTES, ConvergenceWarning, NotFittedError
from .kernels import RBF, FormulaKernel, Kernel, Laplacian, Matern, as_kernel
from .krylov import KrylovInfo, cg, golub_kahan_svds, lanczos_eigsh
from .operators import Centred, Normal, Shifted
from .preconditioners import Cholesky, Falkon, Jacobi, LowRankPreconditioner, nystrom, pivoted_cholesky
from .ridge import KernelRidge, LandmarkRidge
from .sources import FunctionOperator, ShardedKernel, StoredKernel, StreamedKernel
from .spectral import KernelLDA, KernelPCA, KernelSVD

__all__ = [
    "AUTO_DIRECT_MAX_N", "AUTO_SPECTRAL_DIRECT_MAX_N", "AUTO_STORED_MAX_BYTES", "ConvergenceWarning", "NotFittedError",
    "Kernel", "RBF", "Laplacian", "Matern", "FormulaKernel", "as_kernel",
    "StreamedKernel", "ShardedKernel", "StoredKernel", "FunctionOperator", "Shifted", "Centred", "Normal",
    "KrylovInfo", "cg", "lanczos_eigsh", "golub_kahan_svds",
    "Cholesky", "Falkon", "Jacobi", "LowRankPreconditioner", "nystrom", "pivoted_cholesky",
    "KernelRidge", "LandmarkRidge", "KernelPCA", "KernelLDA", "KernelSVD",
]
