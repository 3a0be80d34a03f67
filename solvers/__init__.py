"""Kernel sources, block Krylov methods and kernel-learning estimators that never store the kernel.

See docs/solvers.md. A kernel is any ``f(x_rows (n, d), y_cols (m, d)) -> (n, m)``
tile function made of differentiable torch operations (``RBF``, ``Laplacian``,
``Matern`` or a plain callable such as a lazytensor tile function).
"""
from .base import AUTO_DIRECT_MAX_N, ConvergenceWarning, NotFittedError
from .kernels import RBF, CallableKernel, Kernel, Laplacian, Matern, as_kernel
from .krylov import KrylovInfo, cg, golub_kahan_svds, lanczos_eigsh
from .preconditioners import Cholesky, Jacobi, LowRankShift, nystrom
from .ridge import KernelRidge, LandmarkRidge
from .sources import FunctionOperator, StoredKernel, StreamedKernel
from .spectral import KernelLDA, KernelPCA, KernelSVD

__all__ = [
    "AUTO_DIRECT_MAX_N", "ConvergenceWarning", "NotFittedError",
    "Kernel", "RBF", "Laplacian", "Matern", "CallableKernel", "as_kernel",
    "StreamedKernel", "StoredKernel", "FunctionOperator",
    "KrylovInfo", "cg", "lanczos_eigsh", "golub_kahan_svds",
    "Cholesky", "Jacobi", "LowRankShift", "nystrom",
    "KernelRidge", "LandmarkRidge", "KernelPCA", "KernelLDA", "KernelSVD",
]
