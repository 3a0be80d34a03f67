"""``dtype_acc``: a float32 formula summed in float64, against float64 references; gradients; bad values."""
import pytest
import torch

import lazytensor as lt


def _data(n=130, m=90, d=3, c=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(m, d, generator=g, dtype=torch.float64),
            torch.randn(m, c, generator=g, dtype=torch.float64), torch.randn(n, c, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_float32_formula_float64_sums(backend):
    x, y, b, u = _data()
    K = torch.exp(-0.5 * torch.cdist(x.float().double(), y.float().double()) ** 2)  # the float32 inputs, exactly
    f = (-0.5 * lt.Vi(x.float()).sqdist(lt.Vj(y.float()))).exp()
    kw = dict(backend=backend, chunk_size=32, dtype_acc=torch.float64)
    cases = [((f * lt.Vj(b.float())).sum(1, **kw), K @ b.float().double()),
             ((f * lt.Vi(u.float())).sum(0, **kw), K.T @ u.float().double()),
             (f.sum(1, **kw), K.sum(1, keepdim=True)),
             ((f * lt.Vj(b.float()) + lt.Vi(u.float())).sum(1, **kw), K @ b.float().double() + 90 * u.float().double())]
    for got, ref in cases:
        assert got.dtype == torch.float64
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-6  # the float32 tile entries (exp of a float32 argument), summed exactly enough
    plain = (f * lt.Vj(b.float())).sum(1, backend=backend, chunk_size=32)
    assert plain.dtype == torch.float32


def test_gradients_flow_in_the_formula_dtype():
    x, y, b, _ = _data(20, 15)
    xs = x.float().requires_grad_()
    out = ((-0.5 * lt.Vi(xs).sqdist(lt.Vj(y.float()))).exp() * lt.Vj(b.float())).sum(1, dtype_acc="float64")
    (g,) = torch.autograd.grad(out.square().sum(), [xs])
    xd = x.float().double().requires_grad_()
    ref = torch.exp(-0.5 * torch.cdist(xd, y.float().double()) ** 2) @ b.float().double()
    (g_ref,) = torch.autograd.grad(ref.square().sum(), [xd])
    assert g.dtype == torch.float32 and torch.allclose(g.double(), g_ref, rtol=1e-4, atol=1e-5)


def test_empty_and_same_dtype():
    x, y, b, _ = _data()
    f = (lt.Vi(x[:0]) | lt.Vj(y)) * lt.Vj(b)
    assert f.sum(1, dtype_acc=torch.float64).shape == (0, 2)
    same = (lt.Vi(x) | lt.Vj(y)).sum(1, dtype_acc=torch.float64)
    assert torch.allclose(same, (x @ y.T).sum(1, keepdim=True))


@pytest.mark.parametrize("bad", [torch.float16, "int32", torch.int64, "bogus", 3])
def test_bad_dtype_acc_is_named(bad):
    x, y, _, _ = _data()
    with pytest.raises(ValueError, match="dtype_acc"):
        (lt.Vi(x.float()) | lt.Vj(y.float())).sum(1, dtype_acc=bad)
