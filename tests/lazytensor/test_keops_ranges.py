"""Block-sparse reductions with KeOps's ``ranges`` argument and its cluster helpers.

The twin of a block-sparse reduction is the dense reduction of the kernel masked to the kept
(cluster, cluster) blocks (pairs outside them are absent). ``ranges`` and the helpers follow
pykeops.torch.cluster (from_matrix's 6-tuple; grid_cluster, sort_clusters,
cluster_ranges_centroids); test_block_sparse_reduction is ported at the end.
"""
import math

import pytest
import torch

import lazytensor as lt
from lazytensor import cluster

from .dense import TOLERANCE


def clustered(n, centres, spread, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    points = torch.cat([c + spread * torch.randn(n, len(c), generator=gen, dtype=dtype) for c in centres])
    return points[torch.randperm(len(points), generator=gen)]


def setup(dtype=torch.float64, cutoff=3.0):
    """Sorted clustered points, the ranges keeping cluster pairs closer than ``cutoff``, and the dense pair mask."""
    centres = [torch.tensor(c, dtype=dtype) for c in ([0.0, 0.0], [2.0, 0.0], [0.0, 2.5], [6.0, 6.0])]
    x, y = clustered(9, centres, 0.3, dtype), clustered(7, centres[1:], 0.3, dtype, seed=1)
    x, lx = cluster.sort_clusters(x, cluster.grid_cluster(x, 1.5))
    y, ly = cluster.sort_clusters(y, cluster.grid_cluster(y, 1.5))
    rx, cx, _ = cluster.cluster_ranges_centroids(x, lx)
    ry, cy, _ = cluster.cluster_ranges_centroids(y, ly)
    keep = torch.cdist(cx, cy) < cutoff
    mask = torch.zeros(len(x), len(y), dtype=torch.bool)
    for a, (r0, r1) in enumerate(rx.tolist()):
        for b, (c0, c1) in enumerate(ry.tolist()):
            mask[r0:r1, c0:c1] = bool(keep[a, b])
    assert 0 < mask.sum() < mask.numel()
    return x.requires_grad_(), y.requires_grad_(), cluster.from_matrix(rx, ry, keep), mask


def dense_masked(f, mask, kind, dim, values=None):
    if kind == "sum":
        return torch.where(mask[..., None], f, 0.0).sum(dim)
    if kind == "logsumexp":
        return torch.logsumexp(torch.where(mask[..., None], f, -math.inf), dim)
    if kind == "min":
        return torch.where(mask[..., None], f, math.inf).min(dim).values
    if kind == "softmax":
        w = torch.softmax(torch.where(mask, f[..., 0], -math.inf), dim)
        return w @ values if dim == 1 else w.T @ values
    raise ValueError(kind)


@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("kind", ["sum", "logsumexp", "min", "softmax"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_sparse_reduction_matches_masked_dense(kind, dim, dtype):
    x, y, ranges, mask = setup(dtype)
    b = torch.randn(len(y) if dim == 1 else len(x), 2, dtype=dtype, requires_grad=True)
    F = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
    f = -torch.cdist(x, y)[..., None] ** 2 / 2
    if kind == "softmax":
        out = F.softmax_weighted_sum(b, dim, ranges=ranges, chunk_size=(4, 3))
        ref = dense_masked(f, mask, kind, dim, b)
        keep = ref.isfinite().all(-1)  # a row without a kept pair has no softmax (0 / 0 in the twin)
        out, ref = out[keep], ref[keep]
        inputs = [x, y, b]
    else:
        out = getattr(F, kind)(dim, ranges=ranges, chunk_size=(4, 3))
        ref = dense_masked(f, mask, kind, dim)
        inputs = [x, y]
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, **tol)
    finite = ref.isfinite()
    weight = torch.randn_like(ref)
    gl = torch.autograd.grad((torch.where(finite, out, 0.0) * weight).sum(), inputs, allow_unused=True)
    gd = torch.autograd.grad((torch.where(finite, ref, 0.0) * weight).sum(), inputs, allow_unused=True)
    for a, g in zip(gl, gd):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(g), g if g is not None else torch.zeros_like(a),
                                   **tol)


def test_rows_in_no_kept_block_reduce_over_nothing():
    x, y, ranges, mask = setup(cutoff=1.0)
    F = -lt.Vi(x).sqdist(lt.Vj(y))
    lonely = ~mask.any(1)
    assert lonely.any()
    assert (F.sum(1, ranges=ranges)[lonely] == 0).all()
    assert (F.logsumexp(1, ranges=ranges)[lonely] == -math.inf).all()
    assert (F.min(1, ranges=ranges)[lonely] == math.inf).all()


def test_second_order_and_transpose_with_ranges():
    x, y, ranges, mask = setup()
    K = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
    Kd = torch.where(mask, torch.exp(-torch.cdist(x, y) ** 2), 0.0)
    K.ranges = ranges  # KeOps's attribute form
    w = torch.randn(len(x), 3, dtype=torch.float64)
    torch.testing.assert_close(K.T @ w, Kd.T @ w)  # the transpose swaps the ranges' i and j halves
    b = torch.randn(len(y), 1, dtype=torch.float64)
    (gl,) = torch.autograd.grad(((K @ b) ** 2).sum(), x, create_graph=True)
    (gd,) = torch.autograd.grad(((Kd @ b) ** 2).sum(), x, create_graph=True)
    torch.testing.assert_close(gl, gd)
    v = torch.randn_like(gd)
    torch.testing.assert_close(torch.autograd.grad((gl * v).sum(), y)[0], torch.autograd.grad((gd * v).sum(), y)[0])


@pytest.mark.slow
def test_block_sparse_compiled():
    x, y, ranges, mask = setup(torch.float32)
    F = -lt.Vi(x).sqdist(lt.Vj(y))
    out = F.exp().sum(1, ranges=ranges, backend="compiled")
    ref = torch.where(mask, torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)), 0.0).sum(1, keepdim=True)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


def test_from_matrix_layout():
    # The worked example of pykeops's from_matrix docstring, with our own numbers.
    r_i = torch.tensor([[0, 3], [5, 9]])
    r_j = torch.tensor([[0, 2], [2, 6], [10, 12]])
    keep = torch.tensor([[True, True, False], [False, True, True]])
    ranges_i, slices_i, red_j, ranges_j, slices_j, red_i = cluster.from_matrix(r_i, r_j, keep)
    assert slices_i.tolist() == [2, 4] and red_j.tolist() == [[0, 2], [2, 6], [2, 6], [10, 12]]
    assert slices_j.tolist() == [1, 3, 4] and red_i.tolist() == [[0, 3], [0, 3], [5, 9], [5, 9]]
    assert cluster.swap_axes((1, 2, 3, 4, 5, 6)) == (4, 5, 6, 1, 2, 3) and cluster.swap_axes(None) is None


def test_cluster_helpers():
    x = torch.tensor([[0.0], [5.0], [0.4], [0.3], [2.0]])
    labels = cluster.grid_cluster(x, 1.0)
    assert labels.tolist() == [0, 2, 0, 0, 1]  # compact labels, ordered like the cells
    xs, ls = cluster.sort_clusters(x, labels)
    assert torch.equal(xs.ravel(), x[[0, 2, 3, 4, 1], 0]) and ls.tolist() == [0, 0, 0, 1, 2]  # stable within a cluster
    ranges, centroids, weights = cluster.cluster_ranges_centroids(xs, ls, weights=torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0]))
    assert ranges.tolist() == [[0, 3], [3, 4], [4, 5]]
    torch.testing.assert_close(centroids.ravel(), torch.tensor([0.25, 2.0, 5.0]))
    torch.testing.assert_close(weights, torch.tensor([4.0, 1.0, 1.0]))
    (a, b), labels2 = cluster.sort_clusters((x, x * 2), labels)
    assert torch.equal(b, 2 * a)


@pytest.mark.parametrize(
    "ranges, match",
    [
        ((torch.tensor([[0, 5], [3, 9]]), torch.tensor([1, 2]), torch.tensor([[0, 3], [0, 3]]), None, None, None), "overlap"),
        ((torch.tensor([[0, 5]]), torch.tensor([3]), torch.tensor([[0, 3]]), None, None, None), "slices"),
        ((torch.tensor([[0, 50]]), torch.tensor([1]), torch.tensor([[0, 3]]), None, None, None), "inside"),
        ((1, 2, 3), "6-tuple"),
    ],
)
def test_bad_ranges_are_errors(ranges, match):
    F = lt.Vi(torch.randn(10, 2)).sqdist(lt.Vj(torch.randn(8, 2)))
    with pytest.raises(ValueError, match=match):
        F.sum(1, ranges=ranges)


def test_ranges_unsupported_combinations_are_errors():
    x, y, ranges, _ = setup()
    with pytest.raises(ValueError, match="quantile"):
        lt.Vi(x).sqdist(lt.Vj(y)).quantile(0.5, 1, ranges=ranges)
    with pytest.raises(ValueError, match="batch"):
        lt.Vi(x[None].expand(2, -1, -1)).sqdist(lt.Vj(y)).sum(1, ranges=ranges)


def test_block_sparse_reduction_of_keops_test():
    # pykeops test_block_sparse_reduction: points on a circle against a Gaussian blob, grid clusters of 0.05,
    # blocks kept when centroids are closer than 4 sigma; the sparse Gaussian product is within 0.2% of the dense one.
    gen = torch.Generator().manual_seed(0)
    t = torch.linspace(0, 2 * math.pi, 501)[:-1]
    x = torch.stack((0.4 + 0.4 * torch.cos(t), 0.5 + 0.3 * torch.sin(t)), 1) + 0.01 * torch.randn(500, 2, generator=gen)
    y = torch.randn(500, 2, generator=gen) / 10 + torch.tensor([0.6, 0.6])
    x, x_labels = cluster.sort_clusters(x, cluster.grid_cluster(x, 0.05))
    y, y_labels = cluster.sort_clusters(y, cluster.grid_cluster(y, 0.05))
    x_ranges, x_centroids, _ = cluster.cluster_ranges_centroids(x, x_labels)
    y_ranges, y_centroids, _ = cluster.cluster_ranges_centroids(y, y_labels)
    sigma = 0.05
    keep = ((x_centroids[:, None, :] - y_centroids[None, :, :]) ** 2).sum(2) < (4 * sigma) ** 2
    K = (-((lt.LazyTensor(x[:, None, :] / sigma) - lt.LazyTensor(y[None, :, :] / sigma)) ** 2).sum(dim=2) / 2).exp()
    b = torch.randn(500, 1, generator=gen)
    full = K @ b
    K.ranges = cluster.from_matrix(x_ranges, y_ranges, keep)
    sparse = K @ b
    assert 100 * (sparse - full).abs().sum() / full.abs().sum() < 0.2
    assert keep.float().mean() < 0.5  # most blocks are skipped
