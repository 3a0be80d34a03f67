"""Derivative-free neural-network optimizer: polytope probes, optimal transport, barycentric moves."""
from .candidates import CandidateBatch, CandidateGroup
from .evaluators import NNCostEvaluator
from .optimizer import PolytopeOptimizer
from .schedules import ProbeRadius, cosine_schedule, exponential_schedule
from .subspaces import FactoredSubspace, HybridSubspace
from .train import History, train

__all__ = [
    "PolytopeOptimizer", "train", "History", "CandidateBatch", "CandidateGroup",
    "NNCostEvaluator", "HybridSubspace", "FactoredSubspace", "ProbeRadius", "cosine_schedule", "exponential_schedule",
]
