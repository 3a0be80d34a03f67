"""Derivative-free neural-network optimizer: polytope probes, optimal transport, barycentric moves."""
from .candidates import CandidateBatch, CandidateGroup
from .optimizer import PolytopeOptimizer
from .train import History, train

__all__ = ["PolytopeOptimizer", "train", "History", "CandidateBatch", "CandidateGroup"]

# Candidate evaluators and subspaces live in their own modules; export them when present.
try:
    from .evaluators import NNCostEvaluator  # noqa: F401

    __all__.append("NNCostEvaluator")
except ImportError:
    pass
try:
    from .subspaces import FactoredSubspace, HybridSubspace  # noqa: F401

    __all__ += ["HybridSubspace", "FactoredSubspace"]
except ImportError:
    pass
