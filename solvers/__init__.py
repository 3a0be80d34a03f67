"""Kernel sources, block Krylov methods and kernel-learning estimators that never store the kernel.

See docs/solvers.md. A kernel is a lazytensor formula of two points: ``RBF``,
``Laplacian``, ``Matern``, any ``k(x, y) -> LazyTensor`` or a formula string;
every kernel product runs through the lazytensor engine.

The estimators and their exceptions stand on scikit-learn (~1.6 s to import), so they load
on first access (PEP 562): ``import solvers`` and ``LazyTensor.solve``'s
``solvers.formula_solve`` leave scikit-learn unimported.
"""
from .auto import AUTO_DIRECT_MAX_N, AUTO_SPECTRAL_DIRECT_MAX_N, AUTO_STORED_MAX_BYTES
from .kernels import RBF, FormulaKernel, Kernel, Laplacian, Matern, as_kernel
from .krylov import KrylovInfo, cg, golub_kahan_svds, lanczos_eigsh
from .operators import Centred, Normal, Shifted
from .preconditioners import Cholesky, Falkon, Jacobi, LowRankPreconditioner, nystrom, pivoted_cholesky
from .sources import FunctionOperator, ShardedKernel, StoredKernel, StreamedKernel

__all__ = [
    "AUTO_DIRECT_MAX_N", "AUTO_SPECTRAL_DIRECT_MAX_N", "AUTO_STORED_MAX_BYTES", "ConvergenceWarning", "NotFittedError",
    "Kernel", "RBF", "Laplacian", "Matern", "FormulaKernel", "as_kernel",
    "StreamedKernel", "ShardedKernel", "StoredKernel", "FunctionOperator", "Shifted", "Centred", "Normal",
    "KrylovInfo", "cg", "lanczos_eigsh", "golub_kahan_svds",
    "Cholesky", "Falkon", "Jacobi", "LowRankPreconditioner", "nystrom", "pivoted_cholesky",
    "KernelRidge", "LandmarkRidge", "KernelPCA", "KernelLDA", "KernelSVD",
]

# name -> the submodule that defines it, imported on first access
_LAZY = {
    "ConvergenceWarning": "base", "NotFittedError": "base",
    "KernelRidge": "ridge", "LandmarkRidge": "ridge",
    "KernelPCA": "spectral", "KernelLDA": "spectral", "KernelSVD": "spectral",
}
# the submodules an eager `import solvers` used to leave as attributes, imported on first access too
_LAZY_SUBMODULES = ("base", "implicit", "ridge", "spectral")


def __getattr__(name: str):
    from importlib import import_module

    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    if name in _LAZY_SUBMODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    public = {name for name in globals() if not name.startswith("_") or name.startswith("__")} - {"__getattr__", "__dir__"}
    return sorted(public | set(_LAZY) | set(_LAZY_SUBMODULES))
