"""Named operators: streamed == dense (values and first gradients), shapes, errors."""
import pytest
import torch

import lazytensor as lt

# cdist switches to its matmul expansion above 25 points; below it the dense twin is exact.
SIZES = {torch.float64: (13, 23), torch.float32: (40, 57)}


def tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)


def leaf(*shape, dtype):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def check(op, args, dtype, differentiable, **kw):
    out = op(*args, impl="streamed", backend="eager", chunk_size=(8, 16), **kw)
    ref = op(*args, impl="dense", **kw)
    torch.testing.assert_close(out, ref, **tol(dtype))
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and differentiable(a)]
    w = torch.randn_like(ref)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch", [(), (2,)])
@pytest.mark.parametrize("name", ["distance_sum", "distance_sum_p1", "distance_sum_p3", "rbf_matmul",
                                  "kernel_regression", "knn_regression", "distance_quantile"])
def test_operator_streamed_equals_dense(name, batch, dtype):
    n, m = SIZES[dtype]
    x, y = leaf(*batch, n, 3, dtype=dtype), leaf(*batch, m, 3, dtype=dtype)
    values = leaf(*batch, m, 4, dtype=dtype)
    everything = lambda t: True  # noqa: E731
    if name.startswith("distance_sum"):
        p = {"distance_sum": 2, "distance_sum_p1": 1, "distance_sum_p3": 3}[name]
        check(lt.distance_sum, (x, y), dtype, everything, p=p)
    elif name == "rbf_matmul":
        gamma = torch.tensor(0.4, dtype=dtype, requires_grad=True)
        check(lt.rbf_matmul, (x, y, values, gamma), dtype, everything)
    elif name == "kernel_regression":
        check(lt.kernel_regression, (x, y, values, 0.7), dtype, everything)
    elif name == "knn_regression":  # neighbours are locally constant: gradients reach the targets only
        check(lt.knn_regression, (x, y, values, 5), dtype, lambda t: t is values)
    else:
        check(lt.distance_quantile, (x, y, torch.tensor([0.1, 0.5, 1.0])), dtype, everything)


def test_one_dimensional_targets_give_one_dimensional_outputs():
    x, y, t = torch.randn(9, 2), torch.randn(30, 2), torch.randn(30)
    assert lt.rbf_matmul(x, y, t, 1.0).shape == (9,)
    assert lt.kernel_regression(x, y, t, 1.0).shape == (9,)
    assert lt.knn_regression(x, y, t, 3).shape == (9,)
    assert lt.distance_sum(x, y).shape == (9,)
    torch.testing.assert_close(lt.knn_regression(x, y, t, 3), lt.knn_regression(x, y, t, 3, impl="dense"))


def test_bad_inputs_are_named():
    x, y, b = torch.randn(5, 3), torch.randn(6, 3), torch.randn(6, 2)
    with pytest.raises(ValueError, match="features"):
        lt.rbf_matmul(x, torch.randn(6, 2), b, 1.0)
    with pytest.raises(ValueError, match="b must have one row"):
        lt.rbf_matmul(x, y, torch.randn(7, 2), 1.0)
    with pytest.raises(TypeError, match="y"):
        lt.distance_sum(x, y.double())
    with pytest.raises(ValueError, match="p must"):
        lt.distance_sum(x, y, p=0)
    with pytest.raises(ValueError, match="k must"):
        lt.knn_regression(x, y, b, 7)
    with pytest.raises(ValueError, match="gamma"):
        lt.kernel_regression(x, y, b, "wide")
    with pytest.raises(ValueError, match="impl"):
        lt.distance_sum(x, y, impl="keops")
    with pytest.raises(ValueError, match="y_train must have one row"):
        lt.knn_regression(x, y, torch.randn(5), 2)
