"""Fast, exact candidate evaluation for neural networks (see docs/performance.md)."""
from .contracts import ELEMENTWISE, LINEAR, SEQUENTIAL, VMAP, contracts_of
from .evaluator import NNCostEvaluator
from .inplace import parameters_swapped
from .paths import PATHS

__all__ = [
    "NNCostEvaluator",
    "PATHS",
    "parameters_swapped",
    "contracts_of",
    "LINEAR",
    "ELEMENTWISE",
    "VMAP",
    "SEQUENTIAL",
]
