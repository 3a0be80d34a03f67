"""Regression tests for answers that were once silently wrong, crashes and NaN gradients.

Each case is checked against a dense torch twin; the comments name the defect.
"""
import math
import warnings

import pytest
import torch

import lazytensor as lt
from lazytensor import compile, engine, plan

F64 = dict(rtol=1e-10, atol=1e-10)


def grads(out, inputs, weights=None):
    weights = torch.ones_like(out) if weights is None else weights
    return torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)


def assert_same(lazy_out, dense_out, inputs, **tol):
    tol = tol or F64
    torch.testing.assert_close(lazy_out, dense_out, **tol)
    w = torch.randn_like(dense_out)
    for a, b in zip(grads(lazy_out, inputs, w), grads(dense_out, inputs, w)):
        torch.testing.assert_close(a, b, **tol)


# -- feature sums of broadcast terms count D times (torch broadcasting) ----------------------
def test_feature_sum_of_a_broadcast_term():
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 1, dtype=torch.float64, requires_grad=True)
    out = (lt.Vi(x) - lt.Vj(y)).sum(-1).sum(1)
    ref = (x[:, None, :] - y[None, :, :]).sum(-1).sum(1, keepdim=True)  # sum_d x_d - 3 y
    assert_same(out, ref, [x, y])


def test_constant_inside_a_feature_sum():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = (lt.Vi(x) - lt.Vj(y) + 1.5).sum(-1).sum(1)
    ref = (x[:, None] - y[None] + 1.5).sum(-1).sum(1, keepdim=True)
    assert_same(out, ref, [x, y])


@pytest.mark.parametrize("op", ["sqdist", "dot", "norm2", "weightedsqnorm"])
def test_contractions_broadcast_size_one_operands(op):
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 1, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    X, Y = lt.Vi(x), lt.Vj(y)
    xd, yd = x[:, None, :], y[None, :, :]
    lazy, dense = {
        "sqdist": (X.sqdist(Y), ((xd - yd) ** 2).sum(-1)),
        "dot": (X | Y, (xd * yd).sum(-1)),
        "norm2": ((X - Y).norm2(), ((xd - yd) ** 2).sum(-1).sqrt()),
        "weightedsqnorm": ((X - Y).weightedsqnorm(lt.Pm(w)), (w * (xd - yd) ** 2).sum(-1)),
    }[op]
    assert_same(lazy.sum(1), dense.sum(1, keepdim=True), [x, y, w])


# -- NaN gradients at zero distance: torch's cdist convention (0) ----------------------------
@pytest.mark.parametrize("d", [3, 12])  # 12: the norm-expansion width
def test_zero_distance_gradients_are_finite(d):
    x = torch.randn(6, d, dtype=torch.float64, requires_grad=True)
    y = torch.cat([x.detach()[:3], torch.randn(4, d, dtype=torch.float64)]).requires_grad_()
    assert_same(lt.distance_sum(x, y), torch.cdist(x, y).sum(-1), [x, y])
    assert_same(lt.distance_sum(x, x.detach()), torch.cdist(x, x.detach()).sum(-1), [x])
    assert_same((lt.Vi(x) - lt.Vj(y)).norm2().sum(1), torch.cdist(x, y).sum(-1, keepdim=True), [x, y])
    assert_same(lt.Vi(x).sqdist(lt.Vj(y)).sqrt().sum(1), torch.cdist(x, y).sum(-1, keepdim=True), [x, y])


def test_quantile_zero_gradient_is_finite():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = torch.cat([x.detach(), torch.randn(6, 3, dtype=torch.float64)])
    out = lt.distance_quantile(x, y, 0.0)
    assert torch.equal(out, torch.zeros(5, dtype=torch.float64))
    (g,) = grads(out, [x])
    assert torch.isfinite(g).all()


def test_expansion_is_exact_at_zero_under_sqrt():
    """K(x, x) of a Laplacian kernel is exactly 1 also where the norm expansion would be used."""
    x = torch.randn(20, 16) * 3 + 100
    k = (-(lt.Vi(x).sqdist(lt.Vj(x)).sqrt())).exp().max(1)
    assert torch.equal(k, torch.ones(20, 1))


# -- infinite constants and data -------------------------------------------------------------
def test_infinite_constants():
    x, y = torch.randn(6, 2, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    d = lt.Vi(x).sqdist(lt.Vj(y))
    dense = torch.cdist(x, y) ** 2
    torch.testing.assert_close(d.clamp(0, float("inf")).sum(1)[:, 0], dense.sum(1))
    masked = lt.where(d > 1, d, float("-inf")).max(1)[:, 0]
    torch.testing.assert_close(masked, torch.where(dense > 1, dense, -math.inf).max(1).values)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_norm_expansion_far_from_origin_float32(backend):
    gen = torch.Generator().manual_seed(3)
    x64 = 1000 + torch.randn(40, 16, generator=gen, dtype=torch.float64)
    y64 = 1000 + torch.randn(50, 16, generator=gen, dtype=torch.float64)
    ref = torch.exp(-0.05 * torch.cdist(x64, y64) ** 2).sum(1, keepdim=True)
    out = (-0.05 * lt.Vi(x64.float()).sqdist(lt.Vj(y64.float()))).exp().sum(1, backend=backend)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-6)


def test_infinite_data_with_the_expansion_width():
    x, y = torch.randn(4, 10), torch.randn(5, 10)
    x[1, 3] = math.inf
    out = lt.Vi(x).sqdist(lt.Vj(y)).min(1)[:, 0]
    ref = ((x[:, None] - y[None]) ** 2).sum(-1).min(1).values
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and not torch.isnan(out).any()
    torch.testing.assert_close(out[torch.isfinite(ref)], ref[torch.isfinite(ref)])


# -- comparisons are formulas of the inputs' dtype ---------------------------------------------
def test_comparisons_reduce_and_keep_the_dtype():
    x, z = torch.randn(6, 1, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    out = (lt.Vi(x) < lt.Vj(z)).sum(1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out[:, 0], (x < z.T).double().sum(1))
    eq = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    K = (-lt.Vi(eq).sqdist(lt.Vj(eq))).exp()
    same = ((lt.Vi(eq) == lt.Vj(eq)) * K).sum(1)[:, 0]
    other = ((lt.Vi(eq) != lt.Vj(eq)) * K).sum(1)[:, 0]
    dense = torch.exp(-torch.cdist(eq, eq) ** 2)
    torch.testing.assert_close(same, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(other, dense.sum(1) - 1)
    only = lt.where(lt.Vi(x) > lt.Vj(z), 1.0, 0.0).sum(1)
    assert only.dtype == torch.float64


# -- empty sizes: what torch returns for the dense twin ------------------------------------------
@pytest.mark.parametrize("n,m", [(0, 5), (4, 0), (0, 0)])
def test_empty_sizes(n, m):
    x = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(m, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(m, 2, dtype=torch.float64, requires_grad=True)
    K = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
    dense = torch.exp(-torch.cdist(x, y) ** 2)
    assert_same(K @ b, dense @ b, [x, y, b])
    torch.testing.assert_close(K.logsumexp(1)[:, 0], torch.logsumexp(dense, 1))
    torch.testing.assert_close(K.softmax_weighted_sum(b, 1), torch.softmax(dense, 1) @ b)
    assert K.sum(0).shape == (m, 1)
    if m == 0 and n > 0:
        with pytest.raises(ValueError, match="empty"):
            K.min(1)
        with pytest.raises(ValueError):
            K.quantile(0.5, 1)
    elif m > 0:
        assert K.min(1).shape == (0, 1) and K.argkmin(2, 1).shape == (0, 2) and K.quantile(0.5, 1).shape == (0, 1)


@pytest.mark.parametrize("length,keys", [(0, 5), (3, 0)])
def test_empty_attention(length, keys):
    q = torch.randn(1, 2, length, 4, requires_grad=True)
    k, v = torch.randn(1, 2, keys, 4, requires_grad=True), torch.randn(1, 2, keys, 3, requires_grad=True)
    out = lt.attention(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    out.sum().backward()


# -- ties go to the lowest index ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, (3, 4)])
def test_argkmin_ties_lowest_index_first(chunk):
    x = torch.zeros(5, 1)
    y = torch.tensor([[2.0], [1.0], [1.0], [0.0], [1.0], [0.0], [1.0], [2.0], [1.0]])
    values, index = (lt.Vi(x) - lt.Vj(y)).abs().kmin_argkmin(6, 1, chunk_size=chunk, backend="eager")
    order = torch.sort(y[:, 0].abs(), stable=True).indices[:6]
    assert torch.equal(index, order.expand(5, 6))
    assert torch.equal(values, y[order, 0].abs().expand(5, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_kmin_group_selection_ties_and_nan(dtype, backend):
    """Wide tiles select through column groups: heavy ties, +-inf and NaN still follow a stable sort."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (21, 1), generator=gen).to(dtype)
    y = torch.randint(0, 4, (700, 1), generator=gen).to(dtype)
    y[::97] = math.nan
    y[5::131] = math.inf
    y[7::151] = -math.inf
    values, index = (lt.Vi(x) - lt.Vj(y)).abs().kmin_argkmin(9, 1, chunk_size=(8, 512), backend=backend)
    dense = (x - y.T).abs()
    order = torch.sort(dense, dim=1, stable=True).indices[:, :9]
    assert torch.equal(index, order)
    torch.testing.assert_close(values, torch.gather(dense, 1, order), equal_nan=True)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_kmin_group_selection_channels_batches_and_wide_features(backend):
    """The entries the groups select are recomputed from the points: per channel, per batch, and at D >= 8
    (where the tile itself uses the norm expansion)."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 21, 2, generator=gen), torch.randn(2, 700, 2, generator=gen)
    xs, ys, xd, yd = (t.clone().requires_grad_() for t in (x, y, x, y))
    values, index = (lt.Vi(xs) - lt.Vj(ys)).abs().kmin_argkmin(5, 1, chunk_size=(8, 512), backend=backend)
    dense = (xd[:, :, None] - yd[:, None]).abs()  # (B, N, M, C)
    best = torch.sort(dense, dim=2, stable=True)
    assert torch.equal(index, best.indices[:, :, :5])
    torch.testing.assert_close(values, best.values[:, :, :5])
    weights = torch.randn(values.shape, generator=gen)
    grads = torch.autograd.grad((values * weights).sum(), (xs, ys))
    for got, want in zip(grads, torch.autograd.grad((best.values[:, :, :5] * weights).sum(), (xd, yd))):
        torch.testing.assert_close(got, want)
    x, y = torch.randn(21, 9, generator=gen) + 10, torch.randn(700, 9, generator=gen) + 10
    values, index = lt.Vi(x).sqdist(lt.Vj(y)).kmin_argkmin(7, 1, chunk_size=(8, 512), backend=backend)
    best = torch.sort(((x[:, None] - y[None]) ** 2).sum(-1), dim=1, stable=True)
    assert torch.equal(index, best.indices[:, :7])
    torch.testing.assert_close(values, best.values[:, :7])
    x, y = torch.full((3, 1), 50.0), torch.full((700, 1), 1000.0)
    y[699] = 50.0  # chooses the group the zero padding of the last tile shares; padding must not win
    values, index = (lt.Vi(x) - lt.Vj(y)).abs().kmin_argkmin(5, 1, chunk_size=(8, 512), backend=backend)
    assert index.tolist() == [[699, 0, 1, 2, 3]] * 3 and values.tolist() == [[0.0] + [950.0] * 4] * 3


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("sign", [1, -1])
def test_min_and_max_through_column_groups(backend, sign):
    """min/argmin picks the best group of columns, then recomputes it: ties, +-inf, NaN rows
    (NaN propagates, as torch.min), channels and zero padding behave as one torch.min / max."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (21, 2), generator=gen).float()
    y = torch.randint(0, 4, (700, 2), generator=gen).float()
    y[5::131, 0], y[7::151, 1] = math.inf, -math.inf
    x[4, 1] = math.nan  # one row's second channel is NaN everywhere
    y[300, 0] = math.nan  # one column NaN in the first channel: every row's answer there
    f = (lt.Vi(x) - lt.Vj(y)).abs()
    values, index = (f.min_argmin if sign == 1 else f.max_argmax)(1, chunk_size=(8, 512), backend=backend)
    dense = (x[:, None] - y[None]).abs()
    ref = dense.min(1) if sign == 1 else dense.max(1)
    assert torch.equal(index, ref.indices)
    torch.testing.assert_close(values, ref.values, equal_nan=True)
    ys, yd = y.clone().requires_grad_(), y.clone().requires_grad_()  # gradients go to the selected pairs
    f = (lt.Vi(x[:4]) - lt.Vj(ys)).abs()
    got = torch.autograd.grad((f.min_argmin if sign == 1 else f.max_argmax)(1, chunk_size=(8, 512), backend=backend)[0].sum(), ys)
    d = (x[:4, None] - yd[None]).abs()
    want = torch.autograd.grad((d.min(1) if sign == 1 else d.max(1)).values.sum(), yd)
    torch.testing.assert_close(got[0], want[0])
    x, y = torch.full((3, 1), 50.0), torch.full((700, 1), -1000.0)
    y[699] = 60.0  # the best entry shares its group with the last tile's zero padding, which must not win
    values, index = (-(lt.Vi(x) - lt.Vj(y)).abs()).max_argmax(1, chunk_size=(8, 512), backend=backend)
    assert index.tolist() == [[699]] * 3 and values.tolist() == [[-10.0]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selections_resolve_exact_ties_with_many_features(dtype):
    """At D >= 9 sums use the norm expansion, which rounds equal distances apart; selections (min,
    k-min, quantile) compare direct differences, so ties on a grid go to the lowest index."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randint(-3, 4, (30, 9), generator=gen).to(dtype)
    y = torch.randint(-3, 4, (1777, 9), generator=gen).to(dtype)
    f = lt.Vi(x).sqdist(lt.Vj(y))
    dense = ((x[:, None] - y[None]) ** 2).sum(-1)
    values, index = f.kmin_argkmin(5, 1, backend="eager")
    best = torch.sort(dense, dim=1, stable=True)
    assert torch.equal(index, best.indices[:, :5]) and torch.equal(values, best.values[:, :5])
    assert torch.equal(f.min_argmin(1, backend="eager")[1][:, 0], dense.argmin(1))
    assert torch.equal(f.quantile(0.5, 1, backend="eager")[:, 0], dense.quantile(0.5, dim=1))


def test_kmin_with_fewer_numbers_than_k():
    """Rows with fewer than k non-NaN values: every number first, then NaN (torch.topk's order)."""
    x = torch.zeros(2, 1, dtype=torch.float64)
    y = torch.full((10, 1), math.nan, dtype=torch.float64)
    y[3], y[7] = 2.0, -1.0
    values, index = (lt.Vi(x) + lt.Vj(y)).kmin_argkmin(5, 1, backend="eager")
    assert index[0, :2].tolist() == [7, 3] and torch.isnan(values[:, 2:]).all()
    torch.testing.assert_close(values[:, :2], torch.tensor([[-1.0, 2.0]] * 2, dtype=torch.float64))


# -- options and odd inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [2.5, "big", (4,), (0, 4), True, (4, 2.0)])
def test_bad_chunk_sizes_name_the_argument(chunk):
    K = lt.Vi(torch.randn(4, 2)).sqdist(lt.Vj(torch.randn(5, 2)))
    with pytest.raises(ValueError, match="chunk_size"):
        K.sum(1, chunk_size=chunk)


@pytest.mark.parametrize("dim", [True, False, 1.0])
def test_a_bool_or_float_dim_is_not_an_axis(dim):
    K = lt.Vi(torch.randn(4, 2)).sqdist(lt.Vj(torch.randn(5, 2)))
    with pytest.raises(ValueError, match="dim must be 0/'i' or 1/'j'"):
        K.sum(dim)


def test_meta_tensors_are_named():
    K = lt.Vi(torch.randn(4, 2, device="meta")).sqdist(lt.Vj(torch.randn(5, 2, device="meta")))
    with pytest.raises(ValueError, match="meta device"):
        K.sum(1)


@pytest.mark.parametrize("b", [torch.ones(5, 2, dtype=torch.long), torch.tensor(1.0), torch.ones(5, 2, dtype=torch.bool)])
def test_matmul_names_a_b_it_cannot_multiply(b):
    K = (-lt.Vi(torch.randn(4, 2)).sqdist(lt.Vj(torch.randn(5, 2)))).exp()
    with pytest.raises(TypeError, match="K @ b needs b floating-point"):
        K @ b


def test_log_of_a_folded_zero_is_minus_inf():
    x = lt.Vi(torch.randn(3, 2))
    out = ((x - x).sum(-1).log() + lt.Vj(torch.randn(4, 1))).max(1)
    assert torch.equal(out, torch.full((3, 1), -math.inf))


def test_logsumexp_float32_gradient_at_large_values():
    """|lse| ~ 3e4: gradients keep ~1e-5 relative accuracy (weights from the max shift, not lse)."""
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(30, 2, generator=gen, dtype=torch.float64) + 170
    y64 = torch.randn(40, 2, generator=gen, dtype=torch.float64) - 170
    x = x64.float().requires_grad_()
    out = lt.Vi(x).sqdist(lt.Vj(y64.float())).logsumexp(1)
    assert out.abs().min() > 1e4
    (g,) = grads(out, [x])
    x64.requires_grad_()
    ref = torch.logsumexp(((x64[:, None] - y64[None]) ** 2).sum(-1), 1).sum()
    (g64,) = torch.autograd.grad(ref, [x64])
    assert ((g.double() - g64).abs().max() / g64.abs().max()) < 1e-4


# -- compilation: buckets, constants as values, a bounded cache, fallback at any call -------------
@pytest.fixture
def compiled_stats():
    frames = torch._dynamo.utils.counters["frames"]
    return lambda: (compile.stats["built"], frames["ok"])


@pytest.mark.slow
def test_fifty_sizes_compile_once_per_bucket(compiled_stats):
    """50 distinct (N, M) in two tile buckets: two kernels, no recompile, no recompile-limit error."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(int(n), int(m)) for n, m in zip(torch.randint(257, 513, (40,), generator=gen),
                                              torch.randint(129, 257, (40,), generator=gen))]
    sizes += [(17 + k, 30 - k) for k in range(10)]
    y, b = torch.randn(256, 3), torch.randn(256, 4)
    buckets, built_before = set(), compiled_stats()[0]
    for n, m in sizes:
        x = torch.randn(n, 3)
        before = compiled_stats()
        out = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y[:m]))).exp().matmul(b[:m], backend="compiled")
        torch.testing.assert_close(out, torch.exp(-0.5 * torch.cdist(x, y[:m]) ** 2) @ b[:m], rtol=1e-4, atol=1e-4)
        bucket = (plan.bucket(n), plan.bucket(m))
        if bucket in buckets:
            assert compiled_stats() == before, f"(N, M) = {(n, m)} recompiled inside a known bucket"
        buckets.add(bucket)
    assert len(buckets) == 2 and compiled_stats()[0] - built_before <= 2


@pytest.mark.slow
def test_new_constant_values_reuse_the_kernel(compiled_stats):
    x, y, b = torch.randn(50, 3), torch.randn(60, 3), torch.randn(60, 2)
    K = lambda g: (-g * lt.Vi(x).sqdist(lt.Vj(y))).exp()  # noqa: E731
    K(0.25).matmul(b, backend="compiled")
    before = compiled_stats()
    for g in (0.1, 0.33, 1.7, 2.0000001):
        out = K(g).matmul(b, backend="compiled")
        torch.testing.assert_close(out, torch.exp(-g * torch.cdist(x, y) ** 2) @ b, rtol=1e-4, atol=1e-5)
    assert compiled_stats() == before


def test_auto_backend_compiles_once_eager_time_would_pay_for_it(monkeypatch):
    compiles = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or fn)
    monkeypatch.setattr(compile, "AUTO_COMPILE_MIN_PAIRS", 1)
    x, y = torch.randn(9, 2), torch.randn(7, 2)
    f = lt.Vi(x).sqdist(lt.Vj(y)) * lt.Vj(y).sum(-1) * 3 - 1  # a formula no other test runs
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", math.inf)
    f.sum(1), f.sum(1)
    assert not compiles  # a one-off (or cheap) formula never compiles
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 0.0)
    ref = (torch.cdist(x, y) ** 2 * y.sum(1) * 3 - 1).sum(1, keepdim=True)
    torch.testing.assert_close(f.sum(1), ref)  # its eager time so far exceeds the threshold: compiles aside, answers eager
    assert len(compiles) == 1 and compile.wait_for_background_compiles(60)
    before, built = engine.routes["compiled"], compile.stats["built"]
    torch.testing.assert_close(f.sum(1), ref)  # the compiled kernel is ready: used, not built again
    assert len(compiles) == 1 and compile.stats["built"] == built and engine.routes["compiled"] == before + 1


def test_kernel_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(compile, "MAX_KERNELS", 3)
    x, y = torch.randn(4, 2), torch.randn(5, 2)
    for k in range(6):
        (lt.Vi(x).sqdist(lt.Vj(y)) ** (k + 2)).sum(1, backend="eager")
    assert compile.cache_size() <= 3


def test_compile_failure_at_a_later_call_falls_back(monkeypatch):
    calls = {"n": 0}

    def flaky(fn, **kwargs):
        def run(*args):
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("recompile limit")
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", flaky)
    x, y = torch.randn(5, 2), torch.randn(6, 2)
    f = lt.Vi(x).sqdist(lt.Vj(y)) * lt.Vj(y).sqnorm2() * 7  # a formula no other test compiles
    ref = (torch.cdist(x, y) ** 2 * (y**2).sum(1) * 7).sum(1, keepdim=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(f.sum(1, backend="compiled"), ref)
    with pytest.warns(compile.CompileFallbackWarning):
        torch.testing.assert_close(f.sum(1, backend="compiled"), ref)


# -- a formula that folds to a constant function of constants crashed the lowering (sympy's evalf
#    does not know our functions: Sigmoid(1 / (1 + exp(-1))) raised "Cannot convert expression to float")
def _round_away(t, decimals):
    scale = 10.0**decimals
    return torch.sign(t) * torch.floor(t.abs() * scale + 0.5) / scale


def _sinc(t):
    return torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)


@pytest.mark.parametrize("name, lazy, dense", [
    ("sigmoid", lambda c: c.sigmoid().sigmoid(), lambda t: torch.sigmoid(torch.sigmoid(t))),
    ("relu", lambda c: (c.exp() - 3).relu(), lambda t: torch.relu(torch.exp(t) - 3)),
    ("relu+", lambda c: (c.exp() - 2).relu(), lambda t: torch.relu(torch.exp(t) - 2)),
    ("step", lambda c: (c.exp() - 2).step(), lambda t: (torch.exp(t) - 2 > 0).double()),
    ("floor", lambda c: (c.exp() * 2).floor(), lambda t: torch.floor(torch.exp(t) * 2)),
    ("round", lambda c: (c.exp() * 2).round(1), lambda t: _round_away(torch.exp(t) * 2, 1)),
    ("clamp", lambda c: c.exp().clamp(0.5, 2.0), lambda t: torch.exp(t).clamp(0.5, 2.0)),
    ("xlogx", lambda c: c.exp().xlogx(), lambda t: torch.exp(t) * t),
    ("xlogx<0", lambda c: (-c.exp()).xlogx(), lambda t: torch.full_like(t, math.nan)),
    ("sinxdivx", lambda c: c.exp().sinxdivx(), lambda t: _sinc(torch.exp(t))),
    ("sinxdivx(0)", lambda c: (c - 1).sinxdivx(), lambda t: _sinc(t - 1)),
    ("sqrt(-1)", lambda c: (-c).sqrt(), lambda t: torch.sqrt(-t)),
])
def test_constant_functions_of_constants_fold(name, lazy, dense):
    x = torch.randn(3, 2, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    a = lt.Vi(x)
    one = a - a + 1  # folds to the constant 1 in the IR (of width 2)
    out = (lazy(one) + lt.Vi(x).dot(lt.Vj(y)) * 0.0).sum(1)
    ref = dense(torch.ones((), dtype=torch.float64)) * 4
    torch.testing.assert_close(out, ref.expand(3, 2), equal_nan=True, **F64)


# -- symbols name positions (ir.position_symbol): formulas built apart combine on their own variables ----
def test_formulas_built_apart_keep_their_variables_when_combined():
    torch.manual_seed(0)
    x, z = torch.randn(7, 2, dtype=torch.float64, requires_grad=True), torch.randn(7, 2, dtype=torch.float64, requires_grad=True)
    y, w = torch.randn(5, 2, dtype=torch.float64, requires_grad=True), torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    first = lt.Vi(x).sqdist(lt.Vj(y))  # x at position 0, y at 1
    second = (lt.Vj(w) - lt.Vi(z)).sqnorm2()  # w at position 0, z at 1: both clash with the first's
    lazy = ((-first).exp() * second + lt.Vi(x).sqnorm2()).sum(1)
    d1, d2 = torch.cdist(x, y) ** 2, torch.cdist(z, w) ** 2
    assert_same(lazy, ((-d1).exp() * d2 + (x**2).sum(1, keepdim=True)).sum(1, keepdim=True), [x, y, z, w])


def test_arguments_built_apart_are_aligned_with_the_reduced_formula():
    torch.manual_seed(1)
    x, y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True), torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 2, dtype=torch.float64, requires_grad=True)
    K = -lt.Vi(x).sqdist(lt.Vj(y))
    values = lt.Vj(v) * 2.0  # its own x0 is v, not x
    weights = torch.softmax(-torch.cdist(x, y) ** 2, dim=1)
    assert_same(K.softmax_weighted_sum(values, dim=1), weights @ (2 * v), [x, y, v])
    lse = K.logsumexp(dim=1, weight=lt.Vj(v.exp()))
    assert_same(lse, torch.logsumexp(-torch.cdist(x, y)[..., None] ** 2 + v[None], dim=1), [x, y, v])


def test_a_formula_plus_its_transpose_and_the_same_formula_on_new_tensors():
    torch.manual_seed(2)
    x = torch.randn(8, 2, dtype=torch.float64, requires_grad=True)
    a = torch.randn(8, 1, dtype=torch.float64, requires_grad=True)
    K = (-lt.Vi(x).sqdist(lt.Vj(x))).exp() * lt.Vi(a)
    dense = (-torch.cdist(x, x) ** 2).exp() * a
    assert_same((K + K.T).sum(1), (dense + dense.T).sum(1, keepdim=True), [x, a])
    x2 = torch.randn(8, 2, dtype=torch.float64)
    again = ((-lt.Vi(x2).sqdist(lt.Vj(x2))).exp() * lt.Vi(a)).sum(1)  # the same expression, other tensors
    torch.testing.assert_close(again, ((-torch.cdist(x2, x2) ** 2).exp() * a).sum(1, keepdim=True), **F64)


# -- tile masks are cached across passes: one made under inference mode must serve autograd later --
def test_masks_cached_under_inference_mode_serve_a_later_backward():
    x = torch.randn(37, 3, dtype=torch.float64, requires_grad=True)
    y, b = torch.randn(29, 3, dtype=torch.float64), torch.randn(29, 2, dtype=torch.float64)

    def product(x):
        return ((-lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)).sum(1, backend="eager", chunk_size=(16, 8))

    dense = torch.exp(-torch.cdist(x, y) ** 2) @ b
    engine._mask.cache_clear()
    with torch.inference_mode():
        torch.testing.assert_close(product(x.detach()), dense.detach(), **F64)
    assert_same(product(x), dense, [x])
    assert engine._mask.cache_info().hits > 0


@pytest.mark.parametrize("case", ["sum", "kmin", "quantile"])
def test_row_blocks_are_written_into_one_buffer_per_output(monkeypatch, case):
    """A pass keeps no tensor per row block (each one pinned a hole on glibc's heap that the next tile's buffers
    did not fit: the quantile's first counting pass grew a process by ~1 GiB at 20000^2); values unchanged."""
    monkeypatch.setattr(plan, "TILE_BUDGET_BYTES", 4096)  # many eager row blocks
    kept = []
    original = engine._TileLoop.results

    def results(self):
        kept.append([len(blocks) for blocks in self.outputs])
        return original(self)

    monkeypatch.setattr(engine._TileLoop, "results", results)
    x, y = torch.randn(203, 3, dtype=torch.float64), torch.randn(61, 3, dtype=torch.float64)
    d = lt.Vi(x).sqdist(lt.Vj(y))
    dense = torch.cdist(x, y) ** 2
    if case == "sum":
        got, want = d.sum(1, backend="eager"), dense.sum(1, keepdim=True)
    elif case == "kmin":
        got, want = d.kmin(3, dim=1, backend="eager"), dense.topk(3, largest=False).values[..., None]
    else:
        got, want = d.quantile(0.3, 1, backend="eager"), dense.quantile(0.3, 1)[:, None]
    torch.testing.assert_close(got.reshape(want.shape), want)
    assert kept and all(count == [1] for count in kept)


# -- a formula compared with itself is a NaN test (sympy folded x != x to false, x >= x to true) ----
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_self_comparisons_follow_torch_at_nan(backend):
    x = torch.tensor([[1.0], [math.nan], [-math.inf]], dtype=torch.float64)
    X, one = lt.Vi(x), lt.Vj(torch.ones(2, 1, dtype=torch.float64))
    cases = {"!=": (X != X, x != x), "==": (X == X, x == x), ">=": (X >= X, x >= x), "<=": (X <= X, x <= x),
             "<": (X < X, x < x), ">": (X > X, x > x), "parsed !=": (lt.formula("x != x", x=X), x != x)}
    for name, (lazy, dense) in cases.items():
        torch.testing.assert_close((lazy * one).sum(1, backend=backend), 2 * dense.double(), msg=name)
    kept = (lt.where(X == X, X, 0.0) * one).sum(1, backend=backend)
    torch.testing.assert_close(kept, 2 * torch.where(x == x, x, 0.0))


# -- a +inf entry: the online softmax weighed its state 0 (log-sum-exp NaN, weighted sum 0) ---------
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_an_infinite_entry_gives_torchs_logsumexp_and_softmax(backend, chunk_size):
    y = torch.tensor([[0.0], [math.inf], [1.0], [-math.inf]], dtype=torch.float64)
    x = torch.tensor([[0.0], [-math.inf]], dtype=torch.float64)
    v = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
    F, dense = lt.Vi(x) + lt.Vj(y), x + y.T
    kw = dict(backend=backend, chunk_size=chunk_size)
    torch.testing.assert_close(F.logsumexp(1, **kw)[:, 0], torch.logsumexp(dense, 1), equal_nan=True)
    torch.testing.assert_close(F.logsumexp(0, **kw)[:, 0], torch.logsumexp(dense, 0), equal_nan=True)
    torch.testing.assert_close(F.softmax_weighted_sum(v, 1, **kw), torch.softmax(dense, 1) @ v, equal_nan=True)
