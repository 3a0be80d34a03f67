"""Derivative-free neural-network optimizer: polytope probes, optimal transport, barycentric moves."""
from .candidates import CandidateBatch, CandidateGroup
from .config import EvaluatorOptions, PolytopeConfig
from .evaluators import NNCostEvaluator
from .optimizer import PolytopeOptimizer
from .param_layout import ParameterLayout
from .schedules import ProbeRadius, cosine_schedule, exponential_schedule
from .subspaces import FactoredSubspace, HybridSubspace
from .train import History, flat_closure, train

__all__ = [
    "PolytopeOptimizer", "PolytopeConfig", "EvaluatorOptions", "train", "History", "flat_closure",
    "CandidateBatch", "CandidateGroup", "ParameterLayout", "NNCostEvaluator", "HybridSubspace", "FactoredSubspace",
    "ProbeRadius", "cosine_schedule", "exponential_schedule",
]
