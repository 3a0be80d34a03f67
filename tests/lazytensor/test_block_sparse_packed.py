"""Block-sparse reductions over many tiny blocks (GeomLoss's multiscale: clusters of a few points).

A block-sparse pass packs (row piece, column piece) entries into the kernel's batch dimension
(``plan.BlockSparsity``). Its twin is the dense reduction masked to the kept blocks; the
schedule itself is checked to cover exactly the kept pairs, each once, with no row twice in a tile.
"""
import math

import pytest
import torch

import lazytensor as lt
from lazytensor import cluster, plan

from .dense import TOLERANCE


def tiny_blocks(n, m, keep_rate, dtype, seed=0, empty=False, lonely=True):
    """Points in contiguous clusters of 0-5 points (size 0 and 1 included), a random keep matrix (every fourth
    row cluster keeps nothing; ``lonely=False``: each keeps one at least), its dense mask."""
    gen = torch.Generator().manual_seed(seed)

    def sizes(total):
        out = []
        while sum(out) < total:
            out.append(int(torch.randint(0, 6, (), generator=gen)))
        out[-1] -= sum(out) - total
        return torch.tensor(out)

    rx, ry = (cluster.cluster_ranges(None, sizes(k)) for k in (n, m))
    keep = torch.rand(len(rx), len(ry), generator=gen) < keep_rate
    if lonely:
        keep[::4] = False  # some rows reduce over nothing
    else:
        keep[torch.arange(len(rx)), torch.arange(len(rx)) % len(ry)] = True
    if empty:
        keep[:] = False
    mask = torch.zeros(n, m, dtype=torch.bool)
    for a, (r0, r1) in enumerate(rx.tolist()):
        for b, (c0, c1) in enumerate(ry.tolist()):
            mask[r0:r1, c0:c1] = bool(keep[a, b])
    x = torch.randn(n, 3, generator=gen, dtype=dtype).requires_grad_()
    y = torch.randn(m, 3, generator=gen, dtype=dtype).requires_grad_()
    return x, y, cluster.from_matrix(rx, ry, keep), mask


class _Sizes:
    def __init__(self, n, m):
        self.n, self.m = n, m

    def size(self, axis):
        return self.n if axis == "i" else self.m


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("area", [64, 4096])
def test_schedule_covers_each_kept_pair_once(packed, area):
    n, m = 61, 47
    _, _, ranges, mask = tiny_blocks(n, m, 0.3, torch.float64)
    sparsity = plan.check_ranges(ranges, _Sizes(n, m), "j")
    schedule = sparsity.schedule(area, None, packed)
    rows, cols = schedule.plan.rows, schedule.plan.cols
    seen = torch.zeros(n + 1, m + 1, dtype=torch.int64)
    visited = torch.zeros(n + 1, dtype=torch.bool)
    for t in range(len(schedule.first)):
        in_tile = []
        slots = zip(schedule.row_start[t].tolist(), schedule.row_count[t].tolist(), schedule.piece[t].tolist())
        for start, count, piece in slots:
            columns = schedule.columns[piece].long()
            assert not packed or len(columns) == cols
            for r in range(start, start + count):
                seen[r, columns] += 1
                visited[r] = True
            in_tile += list(range(start, start + count))
            assert count <= rows
        assert len(in_tile) == len(set(in_tile))  # states are gathered and scattered per tile
    assert schedule.per_tile > 1 or not packed or area < 2 * rows * cols
    seen = seen[:n, :m]
    assert torch.equal(seen > 0, mask) and seen.max() <= 1
    assert visited[:n].all()  # every row, kept pairs or not, meets at least one (maybe empty) piece


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["sum", "logsumexp", "softmax", "min", "argmin"])
def test_tiny_blocks_match_masked_dense(kind, dtype):
    # Rows without kept pairs are checked further (every reduction, any cotangent) in test_empty_rows.py.
    x, y, ranges, mask = tiny_blocks(70, 53, 0.3, dtype)
    b = torch.randn(53, 2, dtype=dtype, requires_grad=True)
    F = -lt.Vi(x).sqdist(lt.Vj(y)) / 2
    f = -((x[:, None] - y[None]) ** 2).sum(-1) / 2
    inputs = [x, y]
    if kind == "sum":
        out, ref = F.exp().sum(1, ranges=ranges), torch.where(mask, f.exp(), 0.0).sum(1, keepdim=True)
    elif kind == "logsumexp":
        out, ref = F.logsumexp(1, ranges=ranges), torch.logsumexp(f.masked_fill(~mask, -math.inf), 1, keepdim=True)
    elif kind == "softmax":
        out = F.softmax_weighted_sum(b, 1, ranges=ranges)
        lonely = ~mask.any(1, keepdim=True)  # the dense softmax of an all -inf row is NaN: those rows give 0
        ref = torch.where(lonely, 0.0, torch.softmax(f.masked_fill(~mask, -math.inf).masked_fill(lonely, 0.0), 1) @ b)
        inputs = [x, y, b]
    elif kind == "min":
        out, ref = F.min(1, ranges=ranges), f.masked_fill(~mask, math.inf).min(1, keepdim=True).values
    else:
        out, ref = F.argmin(1, ranges=ranges), f.masked_fill(~mask, math.inf).argmin(1, keepdim=True)
    kept = mask.any(1)
    assert 0 < kept.sum() < len(kept)  # rows with and without kept pairs
    if kind == "argmin":
        assert torch.equal(out[kept], ref[kept])
        return
    tol = TOLERANCE[dtype]
    finite = ref.isfinite()
    torch.testing.assert_close(out[kept], ref[kept], **tol)
    torch.testing.assert_close(out[~kept], ref[~kept])  # the empty value: 0, -inf or inf
    weight = torch.randn_like(ref)
    gl = torch.autograd.grad((torch.where(finite, out, 0.0) * weight).sum(), inputs, allow_unused=True)
    gd = torch.autograd.grad((torch.where(finite, ref, 0.0) * weight).sum(), inputs, allow_unused=True)
    for a, g in zip(gl, gd):
        torch.testing.assert_close(a if a is not None else torch.zeros_like(g), g, **tol)


def test_tiny_blocks_over_i_and_matmul():
    x, y, ranges, mask = tiny_blocks(40, 66, 0.4, torch.float64, seed=3)
    K = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
    Kd = torch.where(mask, torch.exp(-torch.cdist(x, y) ** 2), 0.0)
    K.ranges = ranges
    v, w = torch.randn(66, 2, dtype=torch.float64), torch.randn(40, 3, dtype=torch.float64)
    torch.testing.assert_close(K @ v, Kd @ v)
    torch.testing.assert_close(K.T @ w, Kd.T @ w)
    torch.testing.assert_close(K.sum(0, ranges=ranges), Kd.sum(0)[:, None])
    gl = torch.autograd.grad((K @ v).square().sum(), (x, y))
    gd = torch.autograd.grad((Kd @ v).square().sum(), (x, y))
    for a, g in zip(gl, gd):
        torch.testing.assert_close(a, g)


def test_no_kept_block_and_single_points():
    x, y, ranges, mask = tiny_blocks(30, 20, 0.3, torch.float64, empty=True)
    F = -lt.Vi(x).sqdist(lt.Vj(y))
    assert not mask.any()
    assert (F.sum(1, ranges=ranges) == 0).all() and (F.logsumexp(1, ranges=ranges) == -math.inf).all()
    (g,) = torch.autograd.grad(F.exp().sum(1, ranges=ranges).sum(), x)
    assert (g == 0).all()
    # one point per cluster, every other pair kept: blocks of a single pair
    ones = cluster.cluster_ranges(None, torch.ones(9, dtype=torch.int64))
    keep = (torch.arange(9)[:, None] + torch.arange(9)[None]) % 2 == 0
    z = torch.randn(9, 2, dtype=torch.float64)
    out = (-lt.Vi(z).sqdist(lt.Vj(z))).logsumexp(1, ranges=cluster.from_matrix(ones, ones, keep))
    ref = torch.logsumexp((-torch.cdist(z, z) ** 2).masked_fill(~keep, -math.inf), 1, keepdim=True)
    torch.testing.assert_close(out, ref)


def test_checked_ranges_are_reused_until_changed_or_dropped():
    _, _, ranges, _ = tiny_blocks(20, 20, 0.5, torch.float64)
    sizes = _Sizes(20, 20)
    first = plan.check_ranges(ranges, sizes, "j")
    assert plan.check_ranges(ranges, sizes, "j") is first  # GeomLoss reuses one ranges for dozens of passes
    assert plan.check_ranges(ranges, _Sizes(20, 21), "j") is not first
    ranges[2][0, 1] = ranges[2][0, 0]  # an in-place change is a new sparsity
    assert plan.check_ranges(ranges, sizes, "j") is not first
    held = len(plan._CHECKED)
    del ranges
    assert len(plan._CHECKED) < held  # dropped ranges free their schedules


@pytest.mark.slow
def test_tiny_blocks_compiled():
    x, y, ranges, mask = tiny_blocks(300, 250, 0.3, torch.float32, seed=5, lonely=False)
    F = -lt.Vi(x).sqdist(lt.Vj(y)) * 2
    f = -((x[:, None] - y[None]) ** 2).sum(-1) * 2
    out = F.logsumexp(1, ranges=ranges, backend="compiled")
    ref = torch.logsumexp(f.masked_fill(~mask, -math.inf), 1, keepdim=True)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])
    (gl,) = torch.autograd.grad(out.sum(), x)
    (gd,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(gl, gd, **TOLERANCE[torch.float32])
