"""GeomLoss's KeOps backends run unchanged on lazytensor.keops, against its tensorized backend.

As GeomLoss's backend comparisons: SamplesLoss values and gradients with
backend="online" (Genred strings for sinkhorn, LazyTensors for kernels and
batches) equal to backend="tensorized" (dense torch), float64 and float32.
The tolerances are the tensorized backend's own error: it expands
|x - y|^2 (3e-7 relative after Sinkhorn's iterations in float64) and clamps
distances at 1e-4 (sqrt(max(d^2, 1e-8)): 1e-4 for p = 1, laplacian, energy).
Against the real pykeops 2.3 the online results agree to 1e-14 (float64,
measured when these tests were written: docs/keops.md).
"""
from unittest import mock

import pytest
import torch


def clouds(dtype, batch=None):
    torch.manual_seed(0)
    shape = (batch,) if batch else ()
    x = torch.randn(*shape, 70, 3, dtype=dtype).requires_grad_()
    y = (torch.randn(*shape, 55, 3, dtype=dtype) + 0.5).requires_grad_()
    a = torch.rand(*shape, 70, dtype=dtype).softmax(-1).requires_grad_()
    b = torch.rand(*shape, 55, dtype=dtype).softmax(-1)
    return a, x, b, y


def value_and_grads(geomloss, backend, a, x, b, y, **kwargs):
    loss = geomloss.SamplesLoss(backend=backend, **kwargs)
    value = loss(a, x, b, y)
    return (value.detach(), *torch.autograd.grad(value.sum(), (a, x, y)))


def check(geomloss, dtype, batch=None, reference="tensorized", backend="online", clamped=False, rtol=None, **kwargs):
    a, x, b, y = clouds(dtype, batch)
    got = value_and_grads(geomloss, backend, a, x, b, y, **kwargs)
    ref = value_and_grads(geomloss, reference, a, x, b, y, **kwargs)
    rtol = rtol or ((3e-4 if dtype == torch.float64 else 3e-3) if clamped else (1e-6 if dtype == torch.float64 else 3e-4))
    for name, g, r in zip(("value", "grad a", "grad x", "grad y"), got, ref):
        torch.testing.assert_close(g, r, rtol=rtol, atol=rtol * float(r.abs().max()), msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [1, 2])
def test_sinkhorn_online_equals_tensorized(geomloss, dtype, p):
    check(geomloss, dtype, loss="sinkhorn", p=p, blur=0.1, clamped=p == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sinkhorn_online_batched_uses_keops_logsumexp_axis_two(geomloss, dtype):
    check(geomloss, dtype, batch=2, loss="sinkhorn", p=2, blur=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss", ["gaussian", "laplacian", "energy"])
def test_kernel_losses_online_equal_tensorized(geomloss, dtype, loss):
    check(geomloss, dtype, loss=loss, blur=0.5, clamped=loss != "gaussian")


def _dense_mask(ranges, n: int, m: int) -> torch.Tensor:
    """The (n, m) pairs a KeOps ranges 6-tuple keeps for reductions over j."""
    ranges_i, slices_i, redranges_j = (torch.as_tensor(r).long() for r in ranges[:3])
    keep = torch.zeros(n, m, dtype=torch.bool)
    start = 0
    for (a, b), end in zip(ranges_i.tolist(), slices_i.tolist()):
        for c, d in redranges_j[start:end].tolist():
            keep[a:b, c:d] = True
        start = end
    return keep


def test_multiscale_block_sparse_reductions_equal_masked_dense(geomloss):
    """Multiscale truncates far cluster pairs (an approximation GeomLoss chooses; it equals pykeops's multiscale to
    1e-14, docs/keops.md): each block-sparse log-sum-exp it runs must equal the dense one over the kept pairs."""
    from lazytensor.keops import genred

    calls, original = [], genred.Genred.__call__

    def recording(self, *args, ranges=None, **kwargs):
        out = original(self, *args, ranges=ranges, **kwargs)
        if ranges is not None and len(calls) < 3:
            calls.append((self.formula, [t.detach() for t in args], ranges, out.detach()))
        return out

    a, x, b, y = clouds(torch.float64)
    with mock.patch.object(genred.Genred, "__call__", recording):
        value = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, backend="multiscale", truncate=3)(a, x, b, y)
    assert torch.isfinite(value) and calls, "multiscale ran no block-sparse reduction"
    for formula, (xs, ys, h, p), ranges, out in calls:
        assert "SqDist" in formula
        keep = _dense_mask(ranges, xs.shape[0], ys.shape[0])
        assert not keep.all()  # something was truncated
        scores = h.T - p * ((xs[:, None] - ys[None]) ** 2).sum(-1) / 2
        dense = torch.logsumexp(scores.masked_fill(~keep, -torch.inf), 1, keepdim=True)
        torch.testing.assert_close(out, dense, rtol=1e-12, atol=1e-12)
