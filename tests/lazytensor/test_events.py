"""Event streaming: several reductions from one pass equal the separate reductions."""
import pytest
import torch

import lazytensor as lt
from lazytensor import engine


def formula(dtype=torch.float64):
    x = torch.randn(11, 3, dtype=dtype, requires_grad=True)
    y = torch.randn(19, 3, dtype=dtype, requires_grad=True)
    b = torch.randn(19, 2, dtype=dtype, requires_grad=True)
    return x, y, b, (-lt.Vi(x).sqdist(lt.Vj(y))).exp()


@pytest.mark.parametrize("dim", [1, 0])
def test_one_pass_feeds_every_reduction(dim, monkeypatch):
    x, y, b, K = formula()
    values = b if dim == 1 else torch.randn(11, 2, dtype=torch.float64, requires_grad=True)
    specs = ["sum", "logsumexp", "max", "min_argmin", ("kmin", 3), ("softmax_weighted_sum", values)]
    calls = []
    original = engine.stream
    monkeypatch.setattr(engine, "stream", lambda *a, **k: calls.append(len(a[1])) or original(*a, **k))
    got = lt.stream(K, specs, dim, backend="eager", chunk_size=(4, 6))
    assert calls == [len(specs)]  # one pass, every consumer on it
    monkeypatch.setattr(engine, "stream", original)
    want = [
        K.sum(dim, backend="eager"), K.logsumexp(dim, backend="eager"), K.max(dim, backend="eager"),
        K.min_argmin(dim, backend="eager"), K.kmin(3, dim, backend="eager"),
        K.softmax_weighted_sum(values, dim, backend="eager"),
    ]
    torch.testing.assert_close(got[3][1], want[3][1])
    flat_got = [got[0], got[1], got[2], got[3][0], got[4], got[5]]
    flat_want = [want[0], want[1], want[2], want[3][0], want[4], want[5]]
    for a, w in zip(flat_got, flat_want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
    weights = [torch.randn_like(t) for t in flat_want]
    loss_got = sum((a * w).sum() for a, w in zip(flat_got, weights))
    loss_want = sum((a * w).sum() for a, w in zip(flat_want, weights))
    for a, w in zip(torch.autograd.grad(loss_got, [x, y, values]), torch.autograd.grad(loss_want, [x, y, values])):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


def test_bad_reduction_specs():
    _, _, _, K = formula()
    with pytest.raises(ValueError, match="unknown reduction"):
        lt.stream(K, ["median"])
    with pytest.raises(ValueError, match="k must"):
        lt.stream(K, [("kmin", 0)])
    with pytest.raises(ValueError, match="larger than"):
        lt.stream(K, [("kmin", 20)])
    with pytest.raises(ValueError, match="non-empty list"):
        lt.stream(K, "sum")
    with pytest.raises(ValueError, match="plain name"):
        lt.stream(K, [("max", 2)])
    with pytest.raises(TypeError, match="LazyTensor"):
        lt.stream(torch.ones(3), ["sum"])


def test_every_named_reduction_streams_as_its_method():
    """stream and the methods read one table: each name gives what the method of that name gives."""
    from lazytensor.reductions import named

    x, y, b, K = formula()
    K32 = (-lt.Vi(x.float()).sqdist(lt.Vj(y.float()))).exp()
    arguments = {"k": 2, "values": b, "weight": b.abs() + 0.1, "q": 0.3, "dtype_acc": torch.float64}
    for name, entry in named.NAMES.items():
        source = K32 if entry.argument == "dtype_acc" else K
        argument = arguments.get(entry.argument)
        (got,) = lt.stream(source, [name if argument is None else (name, argument)], backend="eager")
        method = getattr(source, name)
        want = method(backend="eager") if argument is None else (
            method(argument, backend="eager") if entry.argument in ("k", "values", "q") else
            method(**{entry.argument: argument}, backend="eager"))
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert lt.stream(K32, [("sum", torch.float64)])[0].dtype == torch.float64
