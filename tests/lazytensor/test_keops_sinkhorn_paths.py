"""The paths GeomLoss's sinkhorn (``generic_logsumexp``, thousands of tiles a call) runs through:
the online-softmax merge folded into the tile function, and the float32 exp of compiled CPU tiles."""
import math

import pytest
import torch

import lazytensor as lt
from lazytensor import compile, inductor

from .dense import TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["logsumexp", "weighted", "softmax"])
def test_rows_whose_first_tiles_are_empty_merge_without_nan(dtype, kind):
    """F = -inf on the first column tiles, then below -88 (float32) / -709 (float64): exp(0 - top)
    overflowed in the merge (inf * 0 = NaN) before the merge weighed an empty state by exp(-inf)."""
    low = -200.0 if dtype == torch.float32 else -800.0
    m = 40
    f = torch.where(torch.arange(m) < 23, -math.inf, low - 0.01 * torch.arange(m)).to(dtype)
    x = torch.randn(3, 1, dtype=dtype)
    v = torch.randn(m, 2, dtype=dtype)
    F = lt.Vj(f[:, None]) + 0 * lt.Vi(x)
    dense_f = f.expand(3, m)
    if kind == "logsumexp":
        out, ref = F.logsumexp(1, chunk_size=(2, 8)), torch.logsumexp(dense_f, 1, keepdim=True)
    elif kind == "weighted":
        w = v.abs() + 0.1
        out = F.logsumexp(1, weight=lt.Vj(w), chunk_size=(2, 8))
        ref = torch.logsumexp(dense_f[..., None] + w.log(), 1)
    else:
        out, ref = F.sumsoftmaxweight(lt.Vj(v), 1, chunk_size=(2, 8)), torch.softmax(dense_f, 1) @ v
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_online_softmax_reductions_fold_their_merge_into_the_tile():
    """The tile function takes the running state and returns the merged one: no merge ops per tile in Python."""
    x, y = torch.randn(37, 3) + 11.0, torch.randn(29, 3)  # an offset no other test uses: a fresh kernel
    out = (-lt.Vi(x).sqdist(lt.Vj(y))).logsumexp(1, backend="eager", chunk_size=(8, 8))
    torch.testing.assert_close(out, torch.logsumexp(-torch.cdist(x, y) ** 2, 1, keepdim=True), rtol=1e-5, atol=1e-5)
    sources = [fn.source for (key, compiled), fn in compile._CACHE.items() if not compiled]
    assert any("c0 = C0.combine(S[0], C0.partial(" in src for src in sources)


def test_compiled_float32_exp_within_one_ulp_and_flushes_below_the_normal_range():
    edges = [math.inf, -math.inf, math.nan, 0.0, -0.0, 88.72283, 88.7229, 100.0, -87.336, -87.337, -103.0, -1e30, 1e30]
    x = torch.cat([torch.linspace(-88, 88.72, 200_001), torch.tensor(edges)])
    out = torch.compile(inductor.tile_exp, fullgraph=True)(x).double()
    ref = torch.exp(x.double())
    normal = (ref >= 2.0**-126) & (ref <= torch.finfo(torch.float32).max)
    ulp = torch.exp(x).double().abs().clamp_min(2.0**-126) * torch.finfo(torch.float32).eps / 2
    assert ((out - ref).abs() / ulp)[normal].max() <= 2.0  # half-ulp units at the rounded value: within 1 ulp
    assert (out[ref < 2.0**-126] == 0).all()  # flushed, as under FTZ
    assert torch.isinf(out[x > 88.7229]).all() and out[x == math.inf].item() == math.inf
    assert torch.isnan(out[x.isnan()]).all()
    assert out[x == 0].eq(1).all()


def test_float64_and_eager_exp_are_torch_exp():
    x = torch.linspace(-120, 100, 1001)
    assert torch.equal(inductor.tile_exp(x), torch.exp(x))  # eager
    xd = x.double()
    torch.testing.assert_close(torch.compile(inductor.tile_exp, fullgraph=True)(xd), torch.exp(xd), rtol=1e-15, atol=0)
