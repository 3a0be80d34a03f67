"""Block-sparse reductions: clusters, their ranges, and KeOps's ``ranges`` argument.

A reduction with ``ranges=`` visits only the (row cluster, column range)
blocks it lists, so on clustered data the tiles of far-apart clusters are
never computed. The recipe, as in KeOps (same names, same ``ranges`` format):

1. label the points (``grid_cluster``, or any clustering) and sort them so that
   each cluster is contiguous (``sort_clusters``);
2. ``cluster_ranges_centroids`` gives each cluster's [start, end) rows and centroid;
3. decide which cluster pairs interact, e.g. ``keep = centroid distance < cutoff``;
4. ``from_matrix(ranges_x, ranges_y, keep)`` is the ``ranges`` 6-tuple
   (row clusters, slices into the stacked column ranges, the column ranges,
   and the same for reductions over i).

The result is exact for the pairs kept; pairs in dropped blocks count as
absent (a truncated kernel), which is the caller's approximation to choose.
"""
from __future__ import annotations

import torch

__all__ = ["grid_cluster", "sort_clusters", "cluster_ranges", "cluster_centroids", "cluster_ranges_centroids", "from_matrix",
           "keops_ranges", "swap_axes"]


def grid_cluster(x: torch.Tensor, size) -> torch.Tensor:
    """Labels in [0, C) of the cubic cells of side ``size`` (a number or one per feature) holding the points (N, D)."""
    with torch.no_grad():
        cells = torch.floor((x - x.min(0, keepdim=True).values) / torch.as_tensor(size, dtype=x.dtype, device=x.device))
        _, labels = torch.unique(cells.long(), dim=0, return_inverse=True)
    return labels


def sort_clusters(x, labels: torch.Tensor):
    """Points (a tensor, or a tuple/list of tensors, one row per point) and labels, reordered so each cluster is contiguous."""
    labels, order = torch.sort(labels.reshape(-1), stable=True)
    if isinstance(x, (tuple, list)):
        return type(x)(t[order] for t in x), labels
    return x[order], labels


def cluster_ranges(labels: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """(C, 2) [start, end) rows of each cluster of sorted ``labels`` (``counts``: points per label, if known)."""
    counts = torch.bincount(labels) if counts is None else counts
    ends = counts.to(torch.int64).cumsum(0)
    return torch.stack([ends - counts.to(torch.int64), ends], 1)


def cluster_centroids(x: torch.Tensor, labels: torch.Tensor, counts=None, weights=None, weights_c=None) -> torch.Tensor:
    """(C, D) (weighted) mean of each cluster's points."""
    w = torch.ones(len(labels), dtype=x.dtype, device=x.device) if weights is None else weights.reshape(-1).to(x.dtype)
    total = torch.bincount(labels, weights=w) if weights_c is None else weights_c.reshape(-1).to(x.dtype)
    sums = torch.zeros(len(total), x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, labels, x * w[:, None])
    return sums / total[:, None]


def cluster_ranges_centroids(x: torch.Tensor, labels: torch.Tensor, weights=None, min_weight: float = 1e-9):
    """(ranges (C, 2), centroids (C, D), total weights (C,)) of the clusters of sorted points (weights >= ``min_weight``)."""
    counts = torch.bincount(labels)
    if weights is None:
        return cluster_ranges(labels, counts), cluster_centroids(x, labels), counts.to(x.dtype)
    weights = weights.reshape(-1).clamp_min(min_weight)
    totals = torch.bincount(labels, weights=weights)
    return cluster_ranges(labels, counts), cluster_centroids(x, labels, weights=weights, weights_c=totals), totals


def from_matrix(ranges_i: torch.Tensor, ranges_j: torch.Tensor, keep: torch.Tensor) -> tuple:
    """KeOps's ``ranges`` from cluster ranges and a boolean (C_i, C_j) matrix of the cluster pairs that interact.

    Returns (ranges_i, slices_i, redranges_j, ranges_j, slices_j, redranges_i):
    i-cluster k reduces over ``redranges_j[slices_i[k-1]:slices_i[k]]`` (reductions
    over j), j-cluster l over ``redranges_i[slices_j[l-1]:slices_j[l]]`` (over i).
    """
    keep = torch.as_tensor(keep, dtype=torch.bool)
    if keep.shape != (len(ranges_i), len(ranges_j)):
        raise ValueError(f"keep must be ({len(ranges_i)}, {len(ranges_j)}) for the cluster ranges given, got {tuple(keep.shape)}")
    cols = keep.nonzero(as_tuple=True)[1]  # row-major: grouped by i-cluster
    rows = keep.T.nonzero(as_tuple=True)[1]  # grouped by j-cluster
    slices_i = keep.sum(1).cumsum(0).to(torch.int64)
    slices_j = keep.sum(0).cumsum(0).to(torch.int64)
    return ranges_i, slices_i, ranges_j[cols], ranges_j, slices_j, ranges_i[rows]


def keops_ranges(ranges):
    """KeOps's ``ranges`` 6-tuple with its slices as flat ends, however KeOps code spelled them.

    Slices come as (C,) ends (``from_matrix``), as (C, 1) columns, or as (C, 2)
    [start, end) pairs into the stacked reduction ranges, which must then be
    consecutive. Anything else passes through for ``plan.check_ranges`` to
    reject with its message.
    """
    if not isinstance(ranges, (tuple, list)) or len(ranges) != 6:
        return ranges
    out = list(ranges)
    for k in (1, 4):
        if out[k] is None:  # the other axis's half may be left out
            continue
        slices = torch.as_tensor(out[k])
        if slices.dim() == 2 and slices.shape[1] == 1:
            slices = slices[:, 0]
        elif slices.dim() == 2 and slices.shape[1] == 2:
            starts, ends = slices[:, 0], slices[:, 1]
            if len(ends) and (int(starts[0]) != 0 or not torch.equal(starts[1:], ends[:-1])):
                raise ValueError("ranges: slices given as (C, 2) [start, end) pairs must be consecutive, starting at 0; "
                                 f"got {slices.tolist()}")
            slices = ends
        out[k] = slices
    return tuple(out)


def swap_axes(ranges):
    """The same block-sparsity for the transposed reduction (i and j exchanged); None stays None."""
    return None if ranges is None else (*ranges[3:6], *ranges[0:3])
