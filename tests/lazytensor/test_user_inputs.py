"""Inputs that users bring from elsewhere, each once a crash on valid input, against dense torch."""
import numpy as np
import pytest
import torch

import lazytensor as lt
from lazytensor.keops.numpy import Genred


def test_flipped_numpy_arrays_are_read_as_they_are():
    """torch.from_numpy refuses negative strides (``x[::-1]``); the formula, ``@``, solve and Genred take a copy."""
    gen = np.random.default_rng(0)
    x, v = gen.standard_normal((20, 3)), gen.standard_normal((20, 1))
    flipped, copied = (x[::-1], v[::-1]), (x[::-1].copy(), v[::-1].copy())
    results = []
    for a, w in (flipped, copied):
        K = (-lt.Vi(a).sqdist(lt.Vj(a))).exp()
        genred = Genred("Exp(-SqDist(x,y))*b", ["x=Vi(3)", "y=Vj(3)", "b=Vj(1)"], reduction_op="Sum", axis=1)
        results.append([K.sum(1), K @ w[:, 0], K.solve(w, alpha=1.0), genred(a, a, w)])
    for got, expected in zip(*results):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_zero_features_are_an_empty_sum(backend):
    """D = 0: every squared distance is 0, as dense torch's empty sum (the eager tile returned None)."""
    x, y = torch.randn(4, 0, dtype=torch.float64, requires_grad=True), torch.randn(5, 0, dtype=torch.float64)
    b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    K = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
    torch.testing.assert_close(lt.Vi(x).sqdist(lt.Vj(y)).sum(1, backend=backend), torch.zeros(4, 1, dtype=torch.float64))
    out = K.sum(1, backend=backend)
    torch.testing.assert_close(out, torch.full((4, 1), 5.0, dtype=torch.float64))
    product = (K @ b)
    torch.testing.assert_close(product, b.sum(0).expand(4, 2))
    (grad_b,) = torch.autograd.grad(product.sum(), b)
    torch.testing.assert_close(grad_b, torch.full((5, 2), 4.0, dtype=torch.float64))


def test_inference_mode_tensors_are_inputs_of_a_differentiated_reduction():
    """Features made under torch.inference_mode (a frozen encoder), weights that require grad: torch refuses to
    save inference tensors for backward, so the reduction kept them aside; the gradient is dense torch's."""
    with torch.inference_mode():
        x, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(50, 3, dtype=torch.float64)
    b = torch.randn(50, 2, dtype=torch.float64, requires_grad=True)
    lazy = ((-lt.Vi(x).sqdist(lt.Vj(y))).exp() @ b).pow(2).sum()
    dense = (torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)) @ b).pow(2).sum()
    torch.testing.assert_close(torch.autograd.grad(lazy, b)[0], torch.autograd.grad(dense, b)[0])


def test_a_callers_torch_compile_calls_lazytensor_as_opaque_steps():
    """torch.compile of a user's function: Dynamo used to trace sympy and the tile engine (17 s, two dozen
    warnings); formulas and reductions are graph breaks now, and the value and gradient are dense torch's."""
    import warnings

    torch._dynamo.reset()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randn(50, 3, dtype=torch.float64)
    b = torch.randn(50, 2, dtype=torch.float64, requires_grad=True)

    def user(x, y, b):
        return (((-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp() @ b) * 2).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = torch.compile(user)(x, y, b)
    dense = ((torch.exp(-0.5 * ((x[:, None] - y[None]) ** 2).sum(-1)) @ b) * 2).sum()
    torch.testing.assert_close(value, dense)
    torch.testing.assert_close(torch.autograd.grad(value, b)[0], torch.autograd.grad(dense, b)[0])
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:80] for w in caught]


def test_a_formula_with_a_parameter_that_requires_grad_deep_copies():
    """Pm(g) holds a reshaped view of g, which torch's deepcopy refuses; the copy holds a leaf that requires grad,
    as pickle's copy does, and the copies of one tensor stay one tensor."""
    import copy

    g, x = torch.tensor(0.5, dtype=torch.float64, requires_grad=True), torch.randn(5, 3, dtype=torch.float64)
    K = (-lt.Pm(g) * lt.Vi(x).sqdist(lt.Vj(x))).exp()
    twin = copy.deepcopy(K)
    torch.testing.assert_close(twin.sum(1), K.sum(1))
    (copied,) = [v.tensor for v in twin.variables.values() if v.tensor.requires_grad]
    torch.testing.assert_close(torch.autograd.grad(twin.sum(1).sum(), copied)[0].reshape(()),
                               torch.autograd.grad(K.sum(1).sum(), g)[0])
    assert len({id(v.tensor) for v in twin.variables.values() if not v.tensor.requires_grad}) == 1
