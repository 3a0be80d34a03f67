"""Sharded reductions on two gloo processes equal the single-process results, values and gradients.

One spawn runs every check (starting processes dominates the cost). Each
rank holds an uneven shard of the reduced axis (10 and 7 rows; then 17 and
0: an empty shard) and must return the full result; its gradient for its
shard must be its rows of the full gradient, and replicated variables' full
gradients on every rank.
"""
import pytest
import torch
import torch.distributed as dist

import lazytensor as lt
from tests.ranks import run_on_ranks

TOL = dict(rtol=1e-10, atol=1e-10)


def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(17, 3, generator=gen, dtype=torch.float64)
    y[12] = y[2]  # a tie across the two shards: the lower global index must win
    b = torch.randn(17, 2, generator=gen, dtype=torch.float64)
    return x, y, b


REDUCTIONS = {
    "sum": lambda f, b: (f.exp() * lt.Vj(b)).sum(1),
    "logsumexp": lambda f, b: (f + lt.Vj(b)).logsumexp(1),
    "softmax": lambda f, b: f.softmax_weighted_sum(lt.Vj(b), 1),
    "min": lambda f, b: (-f).min_argmin(1),
    "kmin": lambda f, b: (-f).kmin_argkmin(4, 1),
    "quantile": lambda f, b: (-f).quantile(torch.tensor([0.2, 0.5], dtype=torch.float64), 1),
    "stream": lambda f, b: lt.stream(f, ["logsumexp", ("kmin_argkmin", 3)], 1),
}


def run_all(x, y, b, backend="eager"):
    """Every reduction of -|x_i - y_j|^2 and its gradients w.r.t. x, y, b (ints: the index outputs)."""
    results = {}
    for name, reduce in REDUCTIONS.items():
        xs, ys, bs = (t.detach().requires_grad_() for t in (x, y, b))
        f = -lt.Vi(xs).sqdist(lt.Vj(ys)) * 0.5
        outs = reduce(f, bs)
        outs = [outs] if isinstance(outs, torch.Tensor) else [o for group in outs for o in
                                                              (group if isinstance(group, tuple) else (group,))]
        values = [o for o in outs if o.is_floating_point()]
        loss = sum((v * torch.linspace(0.5, 1.5, v.numel(), dtype=v.dtype).reshape(v.shape)).sum() for v in values)
        grads = torch.autograd.grad(loss, [xs, ys, bs], allow_unused=True)
        results[name] = (outs, grads)
    return results


NAMED = {
    "rbf_matmul": lambda x, y, b, **kw: lt.rbf_matmul(x, y, b, 0.5, **kw),
    "distance_sum": lambda x, y, b, **kw: lt.distance_sum(x, y, **kw),
    "distance_quantile": lambda x, y, b, **kw: lt.distance_quantile(x, y, torch.tensor([0.3, 0.6], dtype=x.dtype), **kw),
    "kernel_regression": lambda x, y, b, **kw: lt.kernel_regression(x, y, b, 0.7, **kw),
    "knn_regression": lambda x, y, b, **kw: lt.knn_regression(x, y, b, 4, **kw),
}


def _with_grads(op, a, b, c, kw):
    a, b, c = (t.detach().requires_grad_() for t in (a, b, c))
    out = op(a, b, c, **kw)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    return out, torch.autograd.grad((out * w).sum(), [a, b, c], allow_unused=True)


def _check(rank, world_size):
    x, y, b = data()
    full = run_all(x, y, b)
    for split in (10, 17):  # uneven shards, then an empty one
        rows = slice(0, split) if rank == 0 else slice(split, 17)
        with lt.distributed.sharded():
            sharded = run_all(x, y[rows], b[rows])
        for name in REDUCTIONS:
            (outs, grads), (ref_outs, ref_grads) = sharded[name], full[name]
            label = f"{name} split {split}"
            for a, r in zip(outs, ref_outs):
                torch.testing.assert_close(a, r, **TOL, msg=lambda m, label=label: f"{label}: {m}")
            gx, gy, gb = grads
            rx, ry, rb = ref_grads
            for a, r in ((gx, rx), (gy, None if ry is None else ry[rows]), (gb, None if rb is None else rb[rows])):
                if r is None:
                    assert a is None or not a.abs().any()
                else:
                    torch.testing.assert_close(a, r, **TOL, msg=lambda m, label=label: f"{label} gradient: {m}")
    # several row blocks (300 rows in blocks of 64), merged across ranks in one batch and block by block
    from lazytensor import engine

    x_tall = torch.randn(300, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rows = slice(0, 10) if rank == 0 else slice(10, 17)
    blocked = {
        "sum": lambda f, b: (f.exp() * lt.Vj(b)).sum(1, chunk_size=64),
        "kmin": lambda f, b: (-f).kmin_argkmin(4, 1, chunk_size=64),
        "quantile": lambda f, b: (-f).quantile(torch.tensor([0.2, 0.5], dtype=torch.float64), 1, chunk_size=64),
    }
    saved = engine.MERGE_BYTES
    try:
        for merge_bytes in (saved, 1):
            engine.MERGE_BYTES = merge_bytes
            for name, reduce in blocked.items():
                expected = reduce(-lt.Vi(x_tall).sqdist(lt.Vj(y)) * 0.5, b)
                with lt.distributed.sharded():
                    got = reduce(-lt.Vi(x_tall).sqdist(lt.Vj(y[rows])) * 0.5, b[rows])
                as_tuple = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
                label = f"{name}, merged per {merge_bytes} bytes"
                for a, r in zip(as_tuple(got), as_tuple(expected)):
                    torch.testing.assert_close(a, r, **TOL, msg=lambda m, label=label: f"{label}: {m}")
    finally:
        engine.MERGE_BYTES = saved
    # the group= keyword, the reduction over i (the i axis sharded) and every named operator
    rows = slice(0, 10) if rank == 0 else slice(10, 17)
    world = dist.group.WORLD
    out = (-lt.Vi(y[rows]).sqdist(lt.Vj(x))).exp().sum(0, group=world)
    torch.testing.assert_close(out, torch.exp(-torch.cdist(y, x) ** 2).sum(0).unsqueeze(-1), **TOL)
    for name, op in NAMED.items():
        full_out, full_grads = _with_grads(op, x, y, b, {})
        for split in (10, 17):  # uneven shards, then an empty one
            mine = slice(0, split) if rank == 0 else slice(split, 17)
            out, grads = _with_grads(op, x, y[mine], b[mine], {"group": world})
            label = f"{name} split {split}"
            torch.testing.assert_close(out, full_out, **TOL, msg=lambda m, n=label: f"{n}: {m}")
            for a, r, local in zip(grads, full_grads, (False, True, True)):
                if r is not None:
                    torch.testing.assert_close(a, r[mine] if local else r, **TOL, msg=lambda m, n=label: f"{n} grad: {m}")
    q, kk, vv = (torch.randn(2, 3, 17, 4, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                 for s in (1, 2, 3))
    for causal in (False, True):
        def attend(a, b_, c, causal=causal, **kw):
            return lt.attention(a, b_, c, is_causal=causal, **kw)

        full_out, full_grads = _with_grads(attend, q[:, :, :13], kk, vv, {})
        out, grads = _with_grads(attend, q[:, :, :13], kk[:, :, rows], vv[:, :, rows], {"group": world})
        torch.testing.assert_close(out, full_out, **TOL)
        for a, r, local in zip(grads, full_grads, (False, True, True)):
            torch.testing.assert_close(a, r[:, :, rows] if local else r, **TOL)



@pytest.mark.slow
def test_sharded_reductions_equal_single_process():
    run_on_ranks(_check)
