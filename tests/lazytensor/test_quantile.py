"""Exact streamed quantile == torch.quantile: values, gradients, ties, q=0/1, NaN, errors."""
import math
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lazytensor as lt
from lazytensor.reductions import quantile as quantile_module


def direct_distances(x, y):
    """|x_i - y_j| by direct differences (cdist's matmul expansion is less exact)."""
    return ((x.unsqueeze(-2) - y.unsqueeze(-3)) ** 2).sum(-1).sqrt()


def reference(dense, q, dim=-1):
    """torch.quantile over ``dim`` with q's axis moved after the rows, like the streamed result."""
    qt = torch.as_tensor(q, dtype=dense.dtype)
    out = torch.quantile(dense, qt, dim=dim)
    return out if qt.dim() == 0 else out.movedim(0, -1)


def tolerance(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


QS = [0.0, 0.37, 0.5, 1.0, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 70, 300])
@pytest.mark.parametrize("q", QS, ids=["0", "0.37", "0.5", "1", "vector"])
def test_distance_quantile_values_and_grads(dtype, m, q):
    x = torch.randn(13, 3, dtype=dtype, requires_grad=True)
    y = torch.randn(m, 3, dtype=dtype, requires_grad=True)
    out = lt.Vi(x).sqdist(lt.Vj(y)).sqrt().quantile(q, 1, backend="eager", chunk_size=(5, 16))
    ref = reference(direct_distances(x, y), q)
    out = out.squeeze(-1) if out.dim() == ref.dim() + 1 else out
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), [x, y])
    want = torch.autograd.grad((ref * w).sum(), [x, y])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ties_and_constant_rows(dtype):
    """Many equal values (brackets that shrink to one key) and rows of one repeated value."""
    x = torch.tensor([[0.0], [0.5], [100.0]], dtype=dtype)
    y = torch.randint(0, 4, (500, 1)).to(dtype)
    f = (lt.Vi(x) - lt.Vj(y)).abs()
    q = torch.tensor([0.0, 0.25, 0.33, 0.5, 0.77, 0.999, 1.0])
    ref = reference((x - y.T).abs(), q)
    torch.testing.assert_close(f.quantile(q, 1, backend="eager"), ref, rtol=0, atol=0)
    same = (lt.Vi(x) * 0.0 + lt.Vj(y * 0.0 + 2.5)).quantile(0.41, 1, backend="eager")
    assert torch.equal(same.squeeze(-1), torch.full((3,), 2.5, dtype=dtype))


def test_signed_values_infinities_and_nan():
    x = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    y = torch.cat([torch.randn(90, 1, dtype=torch.float64) * 1e3, torch.tensor([[-math.inf], [math.inf], [-0.0]])])
    q = torch.tensor([0.0, 0.2, 0.5, 0.93, 1.0])
    out = (lt.Vi(x) - lt.Vj(y)).quantile(q, 1, backend="eager")
    torch.testing.assert_close(out, reference(x - y.T, q), equal_nan=True)  # torch.quantile lerps inf - inf to NaN
    y[5] = math.nan
    for m in (93, 40):  # with counting passes (the first one flags NaN), and without (the selection does)
        out = (lt.Vi(x) - lt.Vj(y[:m])).quantile(q, 1, backend="eager")
        assert torch.isnan(out).all() and torch.isnan(reference(x - y[:m].T, q)).all()


def test_channels_batch_and_reduction_over_i():
    x = torch.randn(2, 11, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 90, 2, dtype=torch.float64, requires_grad=True)
    f = lt.Vi(x) * lt.Vj(y)  # feature size 2: one quantile per channel
    dense = x.unsqueeze(2) * y.unsqueeze(1)  # (B, N, M, C)
    q = torch.tensor([0.2, 0.8])
    out = f.quantile(q, 1, backend="eager", chunk_size=(4, 32))  # (B, N, Q, C)
    ref = torch.quantile(dense, q.double(), dim=2).permute(1, 2, 0, 3)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * w).sum(), [x, y]), torch.autograd.grad((ref * w).sum(), [x, y])):
        torch.testing.assert_close(a, b)
    over_i = f.quantile(0.3, 0, backend="eager", chunk_size=(16, 4))  # (B, M, C)
    torch.testing.assert_close(over_i, torch.quantile(dense, 0.3, dim=1))


def test_named_operator_matches_dense_and_shapes():
    x, y = torch.randn(17, 3), torch.randn(101, 3)
    q = torch.tensor([0.25, 0.75])
    assert lt.distance_quantile(x, y, 0.5).shape == (17,)
    out = lt.distance_quantile(x, y, q, chunk_size=(8, 32), backend="eager")
    assert out.shape == (17, 2)
    torch.testing.assert_close(out, lt.distance_quantile(x, y, q, impl="dense"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "q, error",
    [(1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), (torch.ones(2, 2) * 0.5, ValueError),
     (torch.tensor([]), ValueError), ("half", TypeError), (torch.tensor([1]), TypeError)],
)
def test_bad_q_is_rejected(q, error):
    x, y = torch.randn(4, 2), torch.randn(5, 2)
    with pytest.raises(error, match="q"):
        lt.Vi(x).sqdist(lt.Vj(y)).quantile(q, 1)
    with pytest.raises(error, match="q"):
        lt.distance_quantile(x, y, q, impl="dense")


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 200),
    levels=st.integers(1, 400),
    q=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_random_rows_with_duplicates(m, levels, q, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 1, generator=gen, dtype=torch.float64)
    y = torch.randint(-levels, levels + 1, (m, 1), generator=gen).double() / 7.0
    out = (lt.Vi(x) * lt.Vj(y)).quantile(q, 1, backend="eager", chunk_size=(2, 17))
    torch.testing.assert_close(out, reference(x * y.T, q).unsqueeze(-1), rtol=1e-12, atol=1e-12)


def test_few_passes_on_typical_data(monkeypatch):
    """Counting passes stop once every bracket holds a handful of values."""
    calls = []
    original = quantile_module.engine.stream
    monkeypatch.setattr(quantile_module.engine, "stream", lambda *a, **k: calls.append(1) or original(*a, **k))
    x, y = torch.randn(50, 3), torch.randn(3000, 3)
    lt.distance_quantile(x, y, 0.5, backend="eager")
    assert len(calls) <= 3  # <= 2 counting passes + the selection


@pytest.mark.slow
def test_compiled_quantile():
    x, y = torch.randn(37, 3), torch.randn(301, 3)
    q = torch.tensor([0.1, 0.5])
    out = lt.distance_quantile(x, y, q, backend="compiled", chunk_size=(16, 64))
    torch.testing.assert_close(out, reference(direct_distances(x, y), q), rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 90),
    channels=st.integers(1, 2),
    levels=st.integers(1, 30),
    nan=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_eager_candidates_agree_with_the_compiled_selection(m, channels, levels, nan, seed):
    """One candidates tile both ways: eager (the in-bracket entries gathered, the key above by bit operations)
    and as a compiled tile selects them (the smallest of every column), on rows with ties and NaN, brackets
    of up to CANDIDATES values or of one repeated key."""
    gen = torch.Generator().manual_seed(seed)
    ranks, rows = 3, 4
    f = torch.randint(-levels, levels + 1, (1, rows, m, channels), generator=gen).float() / 3
    if nan:
        f[0, 1, m // 2, 0] = math.nan
    keys = quantile_module.ordered_keys(f).transpose(2, 3)  # (1, rows, C, m)
    ends = torch.randint(0, m, (2, 1, rows, ranks, channels), generator=gen).sort(0).values
    low, high = (keys.sort(-1).values.gather(-1, e.transpose(2, 3).reshape(1, rows, 1, -1).expand(1, rows, 1, -1)
                                                 .view(1, rows, ranks, channels).transpose(2, 3)).transpose(2, 3)
                 for e in ends)
    low, high = (t.reshape(1, rows, 1, ranks * channels) for t in (low, high))
    if m > quantile_module.CANDIDATES:  # as the counting passes leave them: at most CANDIDATES values, or one key
        high = low
    need = torch.randint(0, 3, (1, rows, 1, ranks * channels), generator=gen)
    mask = torch.ones(1, 1, m, 1)
    mask.unpadded = True
    consumer = quantile_module.Candidates(None, channels=channels, ranks=ranks)
    eager = consumer.partial([f, low, high, need], mask)
    with unittest.mock.patch("torch.compiler.is_compiling", return_value=True):
        compiled = consumer.partial([f, low, high, need], mask)
    (best, where, count, above, above_at, _, flags), (best2, where2, count2, above2, above_at2, _, flags2) = eager, compiled
    real = ~best2.isnan()
    torch.testing.assert_close(best, best2, equal_nan=True)
    assert torch.equal(where[real], where2[real]) and torch.equal(count, count2) and torch.equal(flags, flags2)
    torch.testing.assert_close(above, above2)
    assert torch.equal(above_at[above.isfinite()], above_at2[above.isfinite()])
