"""Block-sparse rows that keep no pair (or fewer than k) reduce over the empty set.

Their twin is the dense reduction with the dropped pairs masked out: sum 0, log-sum-exp and max
-inf, min and k-min +inf (index 0, as KeOps), softmax-weighted sum 0 (the dense softmax of an
all -inf row is NaN; we take the empty weighted sum). Their gradients are 0 for every input,
whatever their cotangent, and they must not leak into the other rows' gradients. Both
schedules: packed (many tiny blocks per tile) and one block per tile (a given ``chunk_size``).
"""
import math

import pytest
import torch

import lazytensor as lt

from .dense import TOLERANCE
from .test_block_sparse_packed import tiny_blocks

N, M, K = 70, 53, 3
SELECTIONS = ("min", "max", "argmin", "argmax", "min_argmin", "kmin", "argkmin", "kmin_argkmin")


def _case(kind, dtype, chunk_size, backend="eager"):
    """(ours, the dense masked reference, differentiable inputs, kept pairs per row)."""
    x, y, ranges, mask = tiny_blocks(N, M, 0.1, dtype)
    s = torch.tensor([0.7], dtype=dtype, requires_grad=True)  # a parameter: its gradient sums every row
    b = torch.randn(M, 2, dtype=dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()
    F = -lt.Vi(x).sqdist(lt.Vj(y)) * lt.Pm(s)
    f = -((x[:, None] - y[None]) ** 2).sum(-1) * s
    opts = dict(ranges=ranges, backend=backend, chunk_size=chunk_size)
    kept = mask.any(1, keepdim=True)
    inputs = [x, y, s]
    low, high = f.masked_fill(~mask, math.inf), f.masked_fill(~mask, -math.inf)
    if kind == "sum":
        out, ref = F.exp().sum(1, **opts), torch.where(mask, f.exp(), 0.0).sum(1, keepdim=True)
    elif kind == "logsumexp":
        out, ref = F.logsumexp(1, **opts), torch.logsumexp(high, 1, keepdim=True)
    elif kind == "softmax":
        out = F.softmax_weighted_sum(b, 1, **opts)
        safe = high.masked_fill(~kept, 0.0)  # an empty row's softmax is NaN densely: taken apart, then 0
        ref = torch.where(kept, torch.softmax(safe, 1) @ b, 0.0)
        inputs = [x, y, s, b]
    elif kind in ("min", "argmin", "min_argmin"):
        value, index = low.min(1, keepdim=True)
        out, ref = getattr(F, kind)(1, **opts), {"min": value, "argmin": index, "min_argmin": (value, index)}[kind]
    elif kind in ("max", "argmax"):
        value, index = high.max(1, keepdim=True)
        out, ref = getattr(F, kind)(1, **opts), value if kind == "max" else index
    else:
        value = low.topk(K, 1, largest=False).values
        index = torch.sort(low, dim=1, stable=True).indices[:, :K]  # ties to the lowest index (slots past the kept ones: any)
        out = getattr(F, kind)(K, 1, **opts)
        ref = {"kmin": value, "argkmin": index, "kmin_argkmin": (value, index)}[kind]
    return out, ref, inputs, mask.sum(1)


def _check(kind, dtype, chunk_size, backend="eager"):
    out, ref, inputs, kept = _case(kind, dtype, chunk_size, backend)
    assert bool((kept == 0).any()) and bool(((kept > 0) & (kept < K)).any())  # empty rows, and rows short of k
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        if o.dtype == torch.int64:  # indices: exact where a pair is kept, 0 (KeOps's) where none is
            slots = torch.arange(K)[None] < kept[:, None] if "kmin" in kind else (kept > 0)[:, None]
            assert torch.equal(o[slots], r[slots]) and bool((o[~slots] == 0).all())
        else:
            torch.testing.assert_close(o, r.detach(), **TOLERANCE[dtype])  # inf / -inf / 0 on empty rows included
    value, ref_value = outs[0], refs[0]
    if value.dtype == torch.int64:
        return
    weight = torch.randn(value.shape, dtype=dtype, generator=torch.Generator().manual_seed(2))  # also on empty rows
    ours = torch.autograd.grad(value, inputs, weight, allow_unused=True)
    dense = torch.autograd.grad(ref_value, inputs, weight, allow_unused=True)
    for a, g in zip(ours, dense):
        assert bool(g.isfinite().all())
        torch.testing.assert_close(a if a is not None else torch.zeros_like(g), g, **TOLERANCE[dtype])


@pytest.mark.parametrize("chunk_size", [None, (8, 8)], ids=["packed", "block-per-tile"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["sum", "logsumexp", "softmax", *SELECTIONS])
def test_rows_without_kept_pairs_match_masked_dense(kind, dtype, chunk_size):
    _check(kind, dtype, chunk_size)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["logsumexp", "kmin"])
def test_rows_without_kept_pairs_compiled(kind):
    _check(kind, torch.float32, None, backend="compiled")


def test_empty_row_gradient_does_not_leak_into_kept_rows():
    # The case: a loss over the kept rows only (cotangent 0 on the empty ones) came back NaN.
    out, ref, inputs, kept = _case("logsumexp", torch.float64, None)
    keep = (kept > 0)[:, None]
    ours = torch.autograd.grad(torch.where(keep, out, 0.0).sum(), inputs)
    dense = torch.autograd.grad(torch.where(keep, ref, 0.0).sum(), inputs)
    for a, g in zip(ours, dense):
        torch.testing.assert_close(a, g)


def test_empty_rows_forward_mode():
    # Tangents of rows over nothing are 0 (the dense log-sum-exp gives NaN there: 0 * exp(-inf + inf)).
    x, y, ranges, mask = tiny_blocks(N, M, 0.1, torch.float64)
    x, y = x.detach(), y.detach()
    dx = torch.randn_like(x)
    kept = mask.any(1)

    def ours(kind):
        return lambda x: getattr(-lt.Vi(x).sqdist(lt.Vj(y)), kind)(1, ranges=ranges, backend="eager")

    def dense(x):
        return torch.logsumexp((-((x[:, None] - y[None]) ** 2).sum(-1)).masked_fill(~mask, -math.inf), 1, keepdim=True)

    tangents = {kind: torch.func.jvp(ours(kind), (x,), (dx,))[1] for kind in ("logsumexp", "min")}
    assert all(bool((t[~kept] == 0).all()) for t in tangents.values())
    torch.testing.assert_close(tangents["logsumexp"][kept], torch.func.jvp(dense, (x,), (dx,))[1][kept])
