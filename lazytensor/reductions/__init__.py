"""Reductions: each one a class that owns its tile consumer, its outputs and its derivatives.

A new reduction is one module here; ``autograd.reduce`` runs any list of
them in one pass (forward, backward, forward-mode and under vmap) without
knowing which they are. ``named`` is the table of the user-facing names
(``"sum"``, ``"kmin"``, ...): which class, argument, outputs and shaping each
one means for ``LazyTensor``'s methods and ``lazytensor.stream``.
"""
from .base import Consumer, Reduction
from .lse_weight import LogSumExpWeight
from .quantile import Quantile
from .selection import ArgMax, ArgMin, KMin
from .softmax import LogSumExp, SoftmaxWeightedSum, merge
from .sum import Sum, accumulation_dtype
from .sumshiftexp import MaxSumShiftExp

__all__ = ["Consumer", "Reduction", "Sum", "LogSumExp", "LogSumExpWeight", "MaxSumShiftExp", "SoftmaxWeightedSum", "ArgMin",
           "ArgMax", "KMin", "Quantile", "merge", "accumulation_dtype"]
