"""A Gaussian kernel product on clustered points with KeOps-style block sparsity (``ranges=``).

Points in well-separated blobs are clustered on a grid, sorted so each cluster is contiguous,
and only the cluster pairs whose centroids are close interact; the result is checked against
the dense product of the kernel truncated to those blocks (exact), and against the full dense
product (the truncation error). Gradients go through the same blocks.
Run: .venv/bin/python docs/examples/block_sparse.py
"""
import torch

import lazytensor as lt
from lazytensor import cluster

torch.manual_seed(0)
centres = 8.0 * torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1], [3, 3], [3, 0]], dtype=torch.float64)
x = torch.cat([c + torch.randn(400, 2, dtype=torch.float64) for c in centres])
y = torch.cat([c + torch.randn(300, 2, dtype=torch.float64) for c in centres])
b = torch.randn(len(y), 3, dtype=torch.float64)

x, x_labels = cluster.sort_clusters(x, cluster.grid_cluster(x, 8.0))
y, y_labels = cluster.sort_clusters(y, cluster.grid_cluster(y, 8.0))
x_ranges, x_centres, _ = cluster.cluster_ranges_centroids(x, x_labels)
y_ranges, y_centres, _ = cluster.cluster_ranges_centroids(y, y_labels)
keep = torch.cdist(x_centres, y_centres) < 10.0
ranges = cluster.from_matrix(x_ranges, y_ranges, keep)

x.requires_grad_()
K = (-lt.Vi(x).sqdist(lt.Vj(y)) / 2).exp()
sparse = K.matmul(b, ranges=ranges)

dense_kernel = torch.exp(-torch.cdist(x, y) ** 2 / 2)
block = torch.zeros_like(dense_kernel, dtype=torch.bool)
for k, (r0, r1) in enumerate(x_ranges.tolist()):
    for m, (c0, c1) in enumerate(y_ranges.tolist()):
        block[r0:r1, c0:c1] = bool(keep[k, m])
truncated = torch.where(block, dense_kernel, 0.0) @ b
torch.testing.assert_close(sparse, truncated)
(g_sparse,) = torch.autograd.grad(sparse.sum(), x)
(g_dense,) = torch.autograd.grad(truncated.sum(), x)
torch.testing.assert_close(g_sparse, g_dense)
with torch.no_grad():
    error = float((sparse - dense_kernel @ b).norm() / (dense_kernel @ b).norm())
print(f"block-sparse product: {keep.sum()} of {keep.numel()} cluster blocks kept ({block.float().mean():.0%} of pairs); "
      f"values and gradients match the truncated dense kernel; truncation error {error:.1e}")
