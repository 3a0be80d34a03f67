"""On KeOps's layer, a small kernel multiplied again with the same points uses its kept matrix (kept_kernel).

The route is checked by the passes it runs: the first product streams, the second forms the matrix
(one ``Values`` pass) and the next ones run none; values always equal the dense product, and anything
that could make a kept matrix wrong (other values, a gradient, options) streams instead. lazytensor's
own ``K @ b`` keeps streaming (its routes and tiers are the engine's).
"""
import pytest
import torch

import lazytensor as lt
from lazytensor import engine, kept_kernel
from lazytensor.keops.torch import LazyTensor


@pytest.fixture
def passes(monkeypatch):
    """The consumers of each engine pass, by class name."""
    seen = []
    stream = engine.stream
    monkeypatch.setattr(engine, "stream", lambda problem, consumers, **k: seen.append(type(consumers[0]).__name__)
                        or stream(problem, consumers, **k))
    monkeypatch.setattr(kept_kernel, "_KEPT", type(kept_kernel._KEPT)())
    return seen


def _gaussian(x, y):
    return (-((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1) / 2).exp()


def _dense(x, y):
    return torch.exp(-torch.cdist(x, y) ** 2 / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("columns", [1, 3])
def test_the_third_product_of_the_same_kernel_runs_no_pass(passes, dtype, columns):
    x, y = torch.rand(37, 3, dtype=dtype), torch.rand(53, 3, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    for k, expected in enumerate((["Sum"], ["Values"], [], [])):
        b = torch.randn(53, columns, dtype=dtype)
        passes.clear()
        torch.testing.assert_close(_gaussian(x, y) @ b, _dense(x, y) @ b, **tol)
        assert passes == expected, k


def test_other_values_are_seen_even_behind_autograds_back(passes):
    """Values are compared, not versions: a change through ``.data`` bumps no version counter."""
    x, y, b = torch.rand(20, 2, dtype=torch.float64), torch.rand(30, 2, dtype=torch.float64), torch.randn(30, 2,
                                                                                                       dtype=torch.float64)
    K = _gaussian(x, y)
    for _ in range(3):
        K @ b
    y.data.mul_(2.0)
    torch.testing.assert_close(K @ b, _dense(x, y) @ b)
    assert passes[-1] == "Sum"


def test_a_product_something_differentiates_always_streams(passes):
    x, y = torch.rand(20, 2, dtype=torch.float64, requires_grad=True), torch.rand(30, 2, dtype=torch.float64)
    b = torch.randn(30, 2, dtype=torch.float64)
    for _ in range(3):
        out = _gaussian(x, y) @ b
    (got,) = torch.autograd.grad(out.sum(), x)
    x_dense = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad((_dense(x_dense, y) @ b).sum(), x_dense)
    torch.testing.assert_close(got, expected)
    assert "Values" not in passes
    with torch.no_grad():  # the same formula with gradients off: kept
        for _ in range(3):
            _gaussian(x, y) @ b
    assert passes[-2:] == ["Sum", "Values"]


@pytest.mark.parametrize("case", ["options", "ranges", "too large", "one-sided"])
def test_what_the_route_does_not_serve_streams(passes, monkeypatch, case):
    x, y, b = torch.rand(20, 2), torch.rand(30, 2), torch.randn(30, 2)
    K, options = _gaussian(x, y), {}
    expected = _dense(x, y) @ b
    if case == "options":
        options = {"backend": "eager"}  # (KeOps's own backends, "CPU" ..., are ignored: the route stays)
    elif case == "ranges":  # KeOps's block-sparse ranges: every row block against the second column block only
        K.ranges = (torch.tensor([[0, 20]]), torch.tensor([1]), torch.tensor([[10, 30]]),
                    torch.tensor([[0, 30]]), torch.tensor([1]), torch.tensor([[0, 20]]))
        expected = _dense(x, y)[:, 10:30] @ b[10:30]
    elif case == "too large":
        monkeypatch.setattr(kept_kernel, "MAX_PAIRS", 20 * 30 - 1)
    else:  # sympy folds x - x + y_j to a j-only formula
        K = (LazyTensor(x[:, None, :]).sum(-1) * 0 + LazyTensor(y[None, :, :]).sum(-1)).exp()
        expected = torch.exp(y.sum(-1))[None].expand(20, -1) @ b
    for _ in range(3):
        torch.testing.assert_close(K.matmul(b, **options), expected, rtol=1e-5, atol=1e-5)
    assert "Values" not in passes


def test_lazytensors_own_products_keep_streaming(passes):
    x, y, b = torch.rand(20, 2), torch.rand(30, 2), torch.randn(30, 2)
    for _ in range(3):
        torch.testing.assert_close((-((lt.Vi(x) - lt.Vj(y)) ** 2).sum(-1) / 2).exp() @ b, _dense(x, y) @ b)
    assert passes == ["Sum"] * 3
