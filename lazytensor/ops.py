"""Named operators: common N x M workloads as one call, streamed or dense.

Each operator takes ``impl="streamed"`` (default: the lazytensor engine, no
N x M storage) or ``impl="dense"`` (the native ATen formulation: ``cdist``,
``mm``, ``torch.quantile``, ``F.scaled_dot_product_attention``), so every
streamed result has a reference one keyword away. Point sets are (N, D) or
batched (B, N, D); outputs drop the feature axis where it is 1.

A streamed operator is the generic formula it names, written as a user
would (a number ``gamma`` is a constant of the formula, as in
``(-0.5 * Vi(x).sqdist(Vj(y))).exp() @ b``): one kernel, one compile, one
route for both. Half-precision inputs run in float32 and return in their
dtype (``precision``).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import distributed, precision
from .attention import streamed_attention
from .lazy_tensor import Pm, Vi, Vj
from .opaque import tracing
from .reductions.quantile import quantile_ranks

IMPLS = ("streamed", "dense")
FLOATS = (torch.float64, torch.float32, *precision.HALF)
# torch.quantile refuses inputs above 2**24 elements: the dense twin goes in row blocks.
_QUANTILE_MAX_NUMEL = 1 << 24


def _one_operator(function):
    """While a compiler traces, a streamed operator is one ``lazytensor::reduce`` node (``lazytensor.library``)."""
    @functools.wraps(function)
    def named(*args, **kwargs):
        if tracing() and kwargs.get("impl", "streamed") == "streamed":
            from . import library

            if library.recording():
                return library.named_operator(function.__name__, args, kwargs)
        return function(*args, **kwargs)

    return named


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be 'streamed' or 'dense', got {impl!r}")


def _check_points(**named: torch.Tensor) -> None:
    """Floating (N, D) / (B, N, D) tensors of one dtype and device with one feature size."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOATS:
            raise TypeError(f"{name} must be float64, float32, bfloat16 or float16, got {t.dtype}")
        if t.dim() not in (2, 3):
            raise ValueError(f"{name} must be (N, D) or (B, N, D), got shape {tuple(t.shape)}")
        if t.dtype != first.dtype or t.device != first.device:
            raise TypeError(f"{name} ({t.dtype}, {t.device}) must match {first_name} ({first.dtype}, {first.device})")
        if t.shape[-1] != first.shape[-1]:
            raise ValueError(f"{name} has {t.shape[-1]} features, {first_name} has {first.shape[-1]}")


def _check_rows(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> torch.Tensor:
    """A per-point tensor ((M,), (M, C) or (B, M, C)) aligned with the points ``like``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != like.dtype or t.device != like.device:
        raise TypeError(f"{name} ({t.dtype}, {t.device}) must match {like_name} ({like.dtype}, {like.device})")
    rows = t.shape[0] if t.dim() == 1 else t.shape[-2]
    if t.dim() > 3 or rows != like.shape[-2]:
        raise ValueError(f"{name} must have one row per point of {like_name} ({like.shape[-2]}), got shape {tuple(t.shape)}")
    return t.unsqueeze(-1) if t.dim() == 1 else t


def _as_param(value, like: torch.Tensor, name: str):
    """A scalar tensor as a parameter ``Pm`` of ``like``'s dtype; a number as itself (a constant of the formula)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        return Pm(value.to(like.dtype).reshape(1))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number or a scalar tensor, got {value!r}")
    return float(value)


def _squeeze_features(t: torch.Tensor, keep: bool) -> torch.Tensor:
    return t if keep else t.squeeze(-1)


def _sharding(impl: str, group, points: torch.Tensor):
    """The sharding of a named operator's reduced axis (``group=`` or the context), and its total length."""
    sharding = distributed.active(group)
    if sharding is None:
        return None, points.shape[-2]
    if impl == "dense":
        raise ValueError("impl='dense' computes on one process: it takes no group (and no lazytensor.distributed.sharded)")
    return sharding, sum(sharding.sizes(points.shape[-2], points.device))


@_one_operator
def distance_sum(x, y, p=2, *, impl="streamed", backend="auto", chunk_size=None, group=None):
    """sum_j ||x_i - y_j||_p for each row i: (N,) or (B, N). ``group``: y is this rank's shard (lazytensor.distributed)."""
    _check_impl(impl)
    _check_points(x=x, y=y)
    _sharding(impl, group, y)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p < math.inf):
        raise ValueError(f"p must be a positive finite number, got {p!r}")
    if impl == "dense":
        return torch.cdist(x, y, p=p).sum(-1)
    diff = Vi(x) - Vj(y)
    if p == 2:
        dist = diff.sqnorm2().sqrt()
    elif p == 1:
        dist = diff.abs().sum(-1)
    else:
        dist = (diff.abs() ** p).sum(-1) ** (1.0 / p)
    return dist.sum(1, backend=backend, chunk_size=chunk_size, group=group).squeeze(-1)


def _gaussian(x, y, gamma):
    return -_as_param(gamma, x, "gamma") * Vi(x).sqdist(Vj(y))


@_one_operator
def rbf_matmul(x, y, b, gamma, *, impl="streamed", backend="auto", chunk_size=None, group=None):
    """sum_j exp(-gamma ||x_i - y_j||^2) b_j: (N, C) (or (N,) for a 1-D b). ``group``: y, b are this rank's shard."""
    _check_impl(impl)
    _check_points(x=x, y=y)
    _sharding(impl, group, y)
    b2 = _check_rows("b", b, "y", y)
    if impl == "dense":
        out = torch.exp(-gamma * torch.cdist(x, y).square()) @ b2
    else:
        out = _gaussian(x, y, gamma).exp().matmul(b2, backend=backend, chunk_size=chunk_size, group=group)
    return _squeeze_features(out, b.dim() > 1)


@_one_operator
def distance_quantile(x, y, q, *, impl="streamed", backend="auto", chunk_size=None, group=None):
    """Per-row q-quantile of ||x_i - y_j|| over j, as torch.quantile: (N,) or (N, len(q)). ``group``: y is a shard."""
    _check_impl(impl)
    _check_points(x=x, y=y)
    _, total = _sharding(impl, group, y)
    scalar, *_ = quantile_ranks(q, total, x.dtype, x.device)  # one validation for both
    if total == 0:
        raise ValueError("distance_quantile: y is empty (torch.quantile needs a non-empty input)")
    if impl == "streamed":
        out = Vi(x).sqdist(Vj(y)).sqrt().quantile(q, 1, backend=backend, chunk_size=chunk_size, group=group)
        return out.squeeze(-1) if scalar else out
    qt = torch.as_tensor(q, dtype=precision.widened(x).dtype, device=x.device)
    dist = precision.widened(torch.cdist(x, y))  # torch.quantile takes float32 and float64 only
    step = max(1, _QUANTILE_MAX_NUMEL // max(dist.shape[-1] * (dist.shape[0] if dist.dim() == 3 else 1), 1))
    parts = [torch.quantile(dist[..., r : r + step, :], qt, dim=-1) for r in range(0, dist.shape[-2], step)]
    out = precision.narrowed(torch.cat(parts, -1), x.dtype)
    return out if scalar else out.movedim(0, -1)


@_one_operator
def kernel_regression(x_query, x_train, y_train, gamma, *, impl="streamed", backend="auto", chunk_size=None, group=None):
    """Normalized RBF smoothing sum_j softmax_j(-gamma ||x_i - t_j||^2) y_j: (N, E) (or (N,)).

    ``group``: x_train and y_train are this rank's shard (lazytensor.distributed).
    """
    _check_impl(impl)
    _check_points(x_query=x_query, x_train=x_train)
    _sharding(impl, group, x_train)
    y2 = _check_rows("y_train", y_train, "x_train", x_train)
    if impl == "dense":
        weights = torch.softmax(-gamma * torch.cdist(x_query, x_train).square(), dim=-1)
        out = weights @ y2
    else:
        out = _gaussian(x_query, x_train, gamma).softmax_weighted_sum(y2, 1, backend=backend, chunk_size=chunk_size,
                                                                      group=group)
    return _squeeze_features(out, y_train.dim() > 1)


@_one_operator
def knn_regression(x_query, x_train, y_train, k, *, impl="streamed", backend="auto", chunk_size=None, group=None):
    """Mean of the targets of the k nearest training points: (N, E) (or (N,)).

    The neighbours are piecewise constant in the positions, so gradients flow
    to ``y_train`` only (as in the dense twin). ``group``: x_train and y_train
    are this rank's shard; each rank adds its own neighbours' targets.
    """
    _check_impl(impl)
    _check_points(x_query=x_query, x_train=x_train)
    y2 = precision.widened(_check_rows("y_train", y_train, "x_train", x_train))  # the mean of k targets, in float32
    sharding, total = _sharding(impl, group, x_train)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= total:
        raise ValueError(f"k must be an integer in [1, {total}], got {k!r}")
    if impl == "dense":
        index = torch.topk(torch.cdist(x_query, x_train), k, dim=-1, largest=False).indices
    else:
        index = Vi(x_query).sqdist(Vj(x_train)).argkmin(k, 1, backend=backend, chunk_size=chunk_size, group=group)
        index = index.reshape(*x_query.shape[:-1], k)
    mine = None
    if sharding is not None:  # global indices: this rank's own neighbours only
        index = index - sum(sharding.sizes(x_train.shape[-2], index.device)[: sharding.rank])
        mine = (index >= 0) & (index < x_train.shape[-2])
        index = index.clamp(0, max(x_train.shape[-2] - 1, 0))
    y3 = y2 if y2.dim() == 3 else y2.unsqueeze(0)
    if y3.shape[1] == 0:  # an empty shard picks nothing of its own: gather from one zero row
        y3 = torch.cat([y3, y3.new_zeros(y3.shape[0], 1, y3.shape[2])], 1)
    batch = index.reshape(-1, *index.shape[-2:])
    picked = torch.gather(y3.expand(batch.shape[0], -1, -1), 1, batch.flatten(1).unsqueeze(-1).expand(-1, -1, y3.shape[-1]))
    picked = picked.unflatten(1, batch.shape[1:]).reshape(*index.shape, y3.shape[-1])
    if mine is not None:
        picked = picked * mine.unsqueeze(-1)
    out = picked.sum(-2) / k
    if sharding is not None:
        out = distributed.sum_over_ranks(out, sharding)
    return _squeeze_features(precision.narrowed(out, y_train.dtype), y_train.dim() > 1)


@_one_operator
def attention(q, k, v, attn_mask=None, is_causal=False, scale=None, *, impl="streamed", chunk_size=None, group=None):
    """Scaled dot-product attention on (B, H, L, d) tensors, as F.scaled_dot_product_attention.

    ``group``: k, v (and the mask's key columns) are this rank's shard of the keys.
    """
    _check_impl(impl)
    sharding, _ = _sharding(impl, group, k)
    if impl == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return streamed_attention(q, k, v, attn_mask, is_causal, scale, chunk_size=chunk_size, sharding=sharding)
