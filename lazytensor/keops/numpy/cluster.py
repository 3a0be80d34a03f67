"""``pykeops.numpy.cluster``: the torch helpers with NumPy arrays in and out."""
from __future__ import annotations

import functools

import numpy as np
import torch

from ... import cluster as _torch_cluster
from ...variables import tensor_of_array


def _numpy(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        def to_torch(a):
            if isinstance(a, (tuple, list)):
                return type(a)(to_torch(t) for t in a)
            return tensor_of_array(a) if isinstance(a, np.ndarray) else a

        def to_numpy(r):
            if isinstance(r, (tuple, list)):
                return type(r)(to_numpy(t) for t in r)
            return r.numpy() if isinstance(r, torch.Tensor) else r

        return to_numpy(fn(*to_torch(args), **{k: to_torch(v) for k, v in kwargs.items()}))
    return wrapped


grid_cluster = _numpy(_torch_cluster.grid_cluster)
sort_clusters = _numpy(_torch_cluster.sort_clusters)
cluster_ranges = _numpy(_torch_cluster.cluster_ranges)
cluster_centroids = _numpy(_torch_cluster.cluster_centroids)
cluster_ranges_centroids = _numpy(_torch_cluster.cluster_ranges_centroids)
from_matrix = _numpy(_torch_cluster.from_matrix)
swap_axes = _torch_cluster.swap_axes

__all__ = ["grid_cluster", "sort_clusters", "cluster_ranges", "cluster_centroids", "cluster_ranges_centroids", "from_matrix",
           "swap_axes"]
