"""``pykeops.numpy`` on lazytensor: the same classes and functions; NumPy arrays in give NumPy arrays out."""
from ..genred import Genred, KernelSolve, generic_argkmin, generic_argmin, generic_logsumexp, generic_sum
from ..lazy import LazyTensor, Pm, Vi, Vj
from . import cluster

__all__ = ["LazyTensor", "Vi", "Vj", "Pm", "Genred", "KernelSolve", "generic_sum", "generic_logsumexp", "generic_argmin",
           "generic_argkmin", "cluster"]
