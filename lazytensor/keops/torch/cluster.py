"""``pykeops.torch.cluster``: lazytensor's block-sparsity helpers, which already follow KeOps's names and formats."""
from ...cluster import (  # noqa: F401 - re-exported
    cluster_centroids,
    cluster_ranges,
    cluster_ranges_centroids,
    from_matrix,
    grid_cluster,
    sort_clusters,
    swap_axes,
)

__all__ = ["grid_cluster", "sort_clusters", "cluster_ranges", "cluster_centroids", "cluster_ranges_centroids", "from_matrix",
           "swap_axes"]
