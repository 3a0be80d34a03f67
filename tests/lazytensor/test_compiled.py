"""The compiled path: every lowering rule and every reduction through torch.compile once.

Kernels are cached per process, so these tests share them; they use float32
tiles on small ragged sizes (padding and masks are exercised).
"""
import json
import platform
import warnings

import pytest
import torch

import lazytensor as lt
from lazytensor import compile, inductor

from .dense import dense_reduce, pm, vi, vj
from .test_reductions import check

TOL = dict(rtol=2e-4, atol=2e-4)

pytestmark = pytest.mark.slow  # ~60 s of cold compiles on 2 cores; the inductor cache makes reruns fast


def test_every_lowering_rule_compiled_values_and_grads():
    x = (torch.rand(37, 9) + 0.5).requires_grad_()
    y = (torch.rand(21, 9) + 0.5).requires_grad_()
    z = torch.randn(37, 2, requires_grad=True)
    w = torch.randn(21, 2, requires_grad=True)
    p = torch.tensor([0.3], requires_grad=True)
    X, Y, Z, W, P = vi(x), vj(y), vi(z), vj(w), pm(p)
    zw = Z - W
    f = (
        (-(P * X.sqdist(Y))).unary("exp") * W  # norm expansion (9 features) + mm consumer
        + (zw.sqdist(Z * 0.0)).unary("sqrt")  # direct difference (2 features)
        + X.dot(Y).unary("log") + zw.unary("tanh") + zw.unary("sigmoid", torch.sigmoid) + zw.unary("relu", torch.relu)
        + zw.unary("abs") + zw.unary("sin") * zw.unary("cos") + (X * Y).unary("rsqrt", torch.rsqrt).sqdist(Y * 0.0) / 9.0
        + zw.unary("square")
    )
    lazy = f.lazy + lt.where(zw.lazy > 0, zw.lazy.clamp(-0.2, 0.4), zw.lazy ** 3)
    d = zw.dense()
    ref = dense_reduce(f.dense() + torch.where(d > 0, d.clamp(-0.2, 0.4), d**3), "sum", "j", False)
    out = lazy.sum(1, backend="compiled", chunk_size=(16, 8))
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(ref)
    gl = torch.autograd.grad((out * g).sum(), [x, y, z, w, p])
    gd = torch.autograd.grad((ref * g).sum(), [x, y, z, w, p])
    for a, b in zip(gl, gd):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["lse", "min", "kmin", "softmax"])
def test_every_reduction_compiled(kind):
    check(kind, "j", 19, 27, torch.float32, chunk=(8, 16), backend="compiled")


@pytest.mark.parametrize("dtype,width", [(torch.float64, 3), (torch.float32, 11)])
def test_narrow_and_wide_weight_sums_compiled_both_axes(dtype, width):
    """Narrow weights are summed by a reduction fused into the tile (``sum.FUSED_PRODUCT_BYTES``), wide ones by
    a matrix product: both against float64 dense, over j and over i."""
    g = torch.Generator().manual_seed(width)
    x, y = torch.randn(37, 3, generator=g, dtype=dtype), torch.randn(29, 3, generator=g, dtype=dtype)
    b, c = torch.randn(29, width, generator=g, dtype=dtype), torch.randn(37, width, generator=g, dtype=dtype)
    K = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()
    rows = (K * lt.Vj(b)).sum(1, backend="compiled", chunk_size=(16, 8))
    columns = (K * lt.Vi(c)).sum(0, backend="compiled", chunk_size=(16, 8))
    dense = torch.exp(-0.5 * torch.cdist(x.double(), y.double()) ** 2)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows.double(), dense @ b.double(), **tol)
    torch.testing.assert_close(columns.double(), dense.T @ c.double(), **tol)


@pytest.mark.parametrize("width", [2, 9])
def test_normal_product_compiled_with_narrow_and_wide_weights(width):
    """``K^T (K W)`` in one compiled pass: the inner product fused for narrow weights, a matrix product for wide."""
    from lazytensor.reductions.normal import normal_product

    g = torch.Generator().manual_seed(width)
    x, y = torch.randn(45, 3, generator=g, dtype=torch.float64), torch.randn(21, 3, generator=g, dtype=torch.float64)
    w = torch.randn(21, width, generator=g, dtype=torch.float64)
    out = normal_product((-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(w), backend="compiled", chunk_size=16)
    dense = torch.exp(-0.5 * torch.cdist(x, y) ** 2)
    torch.testing.assert_close(out, dense.T @ (dense @ w), rtol=1e-10, atol=1e-10)


def test_new_sizes_reuse_the_kernel():
    def run(n, m):
        x, y = torch.randn(n, 3), torch.randn(m, 3)
        b = torch.randn(m, 4)
        return ((-lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)).sum(1, backend="compiled", chunk_size=(16, 32))

    run(40, 70)
    before = compile.cache_size()
    out = run(45, 93)
    assert compile.cache_size() == before
    assert out.shape == (45, 4)


def test_compile_failure_falls_back_with_one_warning(monkeypatch):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    x, y = torch.randn(5, 2), torch.randn(6, 2)
    f = lt.Vi(x).sqdist(lt.Vj(y)) * 1.2345  # a formula no other test compiles
    with pytest.warns(compile.CompileFallbackWarning):
        out = f.sum(1, backend="compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out2 = f.sum(1, backend="compiled")
    ref = (torch.cdist(x, y) ** 2 * 1.2345).sum(1, keepdim=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="Inductor probes vector ISAs on x86 only")
def test_vector_isa_probed_once_per_machine(monkeypatch, tmp_path, request):
    """The first process probes the ISA Inductor will use and records it; later ones skip the probe."""
    from torch._inductor import config, cpu_vec_isa

    probed = []
    for cls in {type(isa) for isa in cpu_vec_isa.supported_vec_isa_list}:
        monkeypatch.setattr(cls, "__bool__", lambda self: probed.append(str(self)) or verdict[0])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # Not monkeypatch.setattr: its undo deletes the entry of Inductor's config module, which then
    # hides it ("does not exist") and every later compile in the process fails.
    saved = config.cpp.vec_isa_ok
    request.addfinalizer(lambda: setattr(config.cpp, "vec_isa_ok", saved))
    record = tmp_path / "lazytensor-vec-isa.json"
    verdict = [True]

    def settle():
        probed.clear()
        config.cpp.vec_isa_ok = None
        monkeypatch.setattr(inductor, "_ISA_SETTLED", [])
        inductor.settle_vector_isa()
        inductor.settle_vector_isa()  # once per process
        return probed[:], config.cpp.vec_isa_ok

    if not any(all(f in cpu_vec_isa.x86_isa_checker() for f in str(isa).split()) for isa in cpu_vec_isa.supported_vec_isa_list):
        pytest.skip("this CPU claims no vector ISA")
    probed_now, ok = settle()
    assert len(probed_now) == 1 and ok is True and record.exists()  # no record: one ISA probed, then recorded
    first = json.loads(record.read_text())
    assert settle() == ([], True)  # recorded: no probe
    for stale in ("not json", json.dumps({**first, "torch": "0.0"})):  # unreadable or another torch: probe again
        record.write_text(stale)
        probed_now, ok = settle()
        assert len(probed_now) == 1 and ok is True and json.loads(record.read_text()) == first
    record.unlink()
    verdict[0] = False  # the ISA fails: nothing recorded, Inductor's own probe stays in charge
    assert settle()[1] is None and not record.exists()
