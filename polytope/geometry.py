"""Polytope frames, their rotations, and the radius models they support.

A frame is a (V, d) matrix of unit vertices that is centred (sum_v v = 0) and
tight (V^T V = (V / d) I). Those two identities are what make the simple
finite-difference estimators below exact (curvature) or first-order exact
(gradient): any frame with them works, and only two are offered.
"""
from __future__ import annotations

import torch

POLYTOPES = ("orthoplex", "simplex")


def frame(kind: str, dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The (V, dim) vertex matrix of a unit polytope centred at the origin."""
    if kind not in POLYTOPES:
        raise ValueError(f"polytope must be one of {POLYTOPES}, got {kind!r}")
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"frame dimension must be a positive int, got {dim!r}")
    if kind == "orthoplex":  # +-e_i: central differences along every axis
        eye = torch.eye(dim, dtype=torch.float64)
        return torch.cat([eye, -eye]).to(dtype)
    # Simplex: the d + 1 standard basis vectors of R^(d+1), centred, written in an
    # orthonormal basis of the hyperplane orthogonal to ones, scaled to unit norm.
    centred = torch.eye(dim + 1, dtype=torch.float64) - 1.0 / (dim + 1)
    basis, _ = torch.linalg.qr(centred[:, :dim])
    vertices = centred @ basis
    return (vertices / vertices.norm(dim=1, keepdim=True)).to(dtype)


def vertex_count(kind: str, dim: int) -> int:
    return 2 * dim if kind == "orthoplex" else dim + 1


def random_basis(
    size: int, dim: int, generator: torch.Generator, dtype: torch.dtype = torch.float64, bias: torch.Tensor | None = None,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """A (size, dim) matrix with orthonormal columns, Haar-distributed.

    With ``bias`` (a (size,) vector, e.g. the last displacement) the first column
    is that direction and the rest are random in its orthogonal complement, so
    the polytope probes along the previous move as well as around it. With
    ``support`` (a (size, dim) 0/1 mask) column j is drawn on its support only
    (before the bias and the orthonormalisation). The
    Gaussian is drawn in float32 (CPU float64 sampling is ~6x slower, and a
    basis is drawn per block every step); the QR runs in float64.
    """
    if dim > size:
        raise ValueError(f"frame dimension {dim} exceeds block size {size}")
    gauss = torch.randn(size, dim, generator=generator, dtype=torch.float32).double()
    if support is not None:
        gauss *= support
    if bias is not None and float(bias.norm()) > 0.0:
        gauss[:, 0] = bias.to(torch.float64)
    q, r = torch.linalg.qr(gauss)
    signs = torch.sign(torch.diagonal(r))  # makes Q Haar-uniform (and keeps the bias column's sign)
    signs[signs == 0] = 1.0
    return q.mul_(signs).to(dtype)


def procrustes(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The orthogonal (d, d) Q minimising ||old @ Q - new||_F.

    Frame coordinates z in the old basis correspond to ``Q.T @ z`` in the new
    one: statistics kept per frame axis survive a rotation instead of being reset.
    """
    u, _, vh = torch.linalg.svd(old.T.to(torch.float64) @ new.to(torch.float64))
    return (u @ vh).to(new.dtype)


def gradient_estimate(losses: torch.Tensor, vertices: torch.Tensor, step: float,
                      reference: torch.Tensor | float | None = None) -> torch.Tensor:
    """g = d / (V h) * sum_v (L_v - L_ref) v for probes at incumbent + h * v.

    ``losses`` is (..., V); returns (..., d). Exact for quadratics on the
    orthoplex; O(h) biased on the simplex (its third moment does not vanish).
    Since sum_v v = 0 the reference only matters numerically (default: mean).
    """
    count, dim = vertices.shape
    if reference is None:
        reference = losses.mean(dim=-1, keepdim=True)
    elif isinstance(reference, torch.Tensor):
        reference = reference.unsqueeze(-1)
    return (losses - reference) @ vertices.to(losses.dtype) * (dim / (count * step))


def curvature_estimate(losses: torch.Tensor, incumbent_loss: torch.Tensor | float, step: float) -> torch.Tensor:
    """tr(H) / d = 2 (mean_v L_v - f(x)) / h^2, exact for quadratics on any tight centred frame."""
    return 2.0 * (losses.mean(dim=-1) - incumbent_loss) / step**2
