"""Dense references of KeOps's named kernels (``pykeops.numpy.utils``, ``pykeops.torch.utils``).

KeOps's own tests, benchmarks and tutorials import these to check a reduction
against the full matrix, so they must import here too. Each takes NumPy arrays
or torch tensors alike and stores the M x N matrix: they are references, not
reductions. ``s`` is the kernel's scale, ``kernel`` one of ``KERNELS``.
"""
from __future__ import annotations

import numpy as np
import torch

KERNELS = ("gaussian", "laplacian", "cauchy", "inverse_multiquadric")


def _lib(x):
    return torch if isinstance(x, torch.Tensor) else np


def squared_distances(x, y):
    """|x_i - y_j|^2 as (M, N), by the norms' expansion as KeOps's references write it."""
    return (x**2).sum(1).reshape(-1, 1) + (y**2).sum(1).reshape(1, -1) - 2.0 * (x @ y.T)


def differences(x, y):
    """x_i[d] - y_j[d] as (D, M, N)."""
    return x.T[:, :, None] - y.T[:, None, :]


def _scaled(x, y, s, kernel):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    return squared_distances(x, y) / (s * s), _lib(x)


def np_kernel(x, y, s, kernel):
    """k(|x_i - y_j| / s) as (M, N)."""
    u, lib = _scaled(x, y, s, kernel)
    if kernel == "gaussian":
        return lib.exp(-u)
    if kernel == "laplacian":
        return lib.exp(-lib.sqrt(u))
    if kernel == "cauchy":
        return 1.0 / (1.0 + u)
    return 1.0 / lib.sqrt(1.0 + u)


def log_np_kernel(x, y, s, kernel):
    """log k(|x_i - y_j| / s) as (M, N)."""
    u, lib = _scaled(x, y, s, kernel)
    if kernel == "gaussian":
        return -u
    if kernel == "laplacian":
        return -lib.sqrt(u)
    if kernel == "cauchy":
        return -lib.log(1.0 + u)
    return -0.5 * lib.log(1.0 + u)


def grad_np_kernel(x, y, s, kernel):
    """The kernel's derivative in the squared distance |x_i - y_j|^2 (not in |x_i - y_j| / s), as (M, N)."""
    u, lib = _scaled(x, y, s, kernel)
    if kernel == "gaussian":
        return -lib.exp(-u) / (s * s)
    if kernel == "laplacian":
        r = lib.sqrt(u)
        return -lib.exp(-r) / (2.0 * s * s * r)
    if kernel == "cauchy":
        return -1.0 / (s * s * (1.0 + u) ** 2)
    return -0.5 / (s * s * (1.0 + u) ** 1.5)


SPHERE_KERNELS = ("binet", "linear", "gaussian_unoriented", "gaussian_oriented")


def np_kernel_sphere(nalpha, nbeta, s, kernel):
    """Kernels of unit normals (M, D) and (N, D) through their inner products c: c^2, c, and the Gaussians of
    the distance between them on the sphere, exp((2c^2 - 2) / s^2) unoriented and exp((2c - 2) / s^2) oriented."""
    c = nalpha @ nbeta.T
    if kernel == "binet":
        return c**2
    if kernel == "linear":
        return c
    if kernel == "gaussian_unoriented":
        return _lib(c).exp((2.0 * c**2 - 2.0) / (s * s))
    if kernel == "gaussian_oriented":
        return _lib(c).exp((2.0 * c - 2.0) / (s * s))
    raise ValueError(f"kernel must be one of {', '.join(SPHERE_KERNELS)}; got {kernel!r}")


def chain_rules(q, ax, by, Aa, p):
    """The gradient in ``ax`` of sum_i <q_i, sum_j k(x_i, y_j) p_j> given ``Aa`` = grad_np_kernel(ax, by): (M, D)."""
    return 2.0 * _lib(ax).einsum("me,mn,dmn,ne->md", q, Aa, differences(ax, by), p)


def log_sum_exp(mat, axis=0):
    """log sum exp of a NumPy array along ``axis``, its largest term factored out so that nothing overflows."""
    top = np.max(mat, axis=axis, keepdims=True)
    return np.squeeze(top, axis) + np.log(np.sum(np.exp(mat - top), axis=axis))


def WarmUpGpu():  # noqa: N802 - pykeops's name
    """Accepted for pykeops compatibility: there is no GPU build to warm up."""


torch_kernel = np_kernel  # pykeops.torch.utils's name for the same reference
