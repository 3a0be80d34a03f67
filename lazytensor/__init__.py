"""lazytensor: symbolic formulas over i/j-indexed variables, streamed as tile kernels.

    from lazytensor import Vi, Vj, Pm
    K = (-Pm(g) * Vi(x).sqdist(Vj(y))).exp()      # symbolic N x M kernel
    out = K @ b                                     # streamed: never N x M in memory
"""
import os as _os

from . import cluster, distributed
from .events import stream
from .lazy_tensor import LazyTensor, Pm, Vi, Vj, lazy, where
from .ops import attention, distance_quantile, distance_sum, kernel_regression, knn_regression, rbf_matmul
from .parse import formula

if _os.environ.get("TP_KEOPS", "").strip().lower() not in ("", "0", "false", "no", "off"):
    from . import keops as _keops

    _keops.install_from_environment()

__all__ = [
    "LazyTensor", "Vi", "Vj", "Pm", "lazy", "where", "formula", "stream", "cluster", "distributed",
    "distance_sum", "rbf_matmul", "distance_quantile", "kernel_regression", "knn_regression", "attention",
]
