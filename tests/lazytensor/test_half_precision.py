"""bfloat16 and float16: every reduction, named operator and attention runs in float32 and answers in the input dtype.

The reference is the float32 computation on the same (rounded) inputs: the half-precision result must be it,
rounded once (one unit in the last place), which a pass accumulating in half precision misses by many.
"""
import pytest
import torch

import lazytensor as lt

HALF = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
TILES = (8, 16)  # many tiles: the accumulation order matters


def rounded(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def assert_rounded_once(got, want32, dtype):
    """``got`` (half) is ``want32`` (float32) rounded to ``dtype``, within one unit in the last place."""
    assert got.dtype == dtype
    scale = want32.abs().amax().clamp_min(1e-3)
    torch.testing.assert_close(got.float(), want32, rtol=ULP[dtype], atol=ULP[dtype] * 1e-2 * scale.item())


REDUCTIONS = {
    "matmul": lambda K, b: K.exp() @ b,
    "sum": lambda K, b: K.exp().sum(1),
    "sum_i": lambda K, b: K.exp().sum(0),
    "logsumexp": lambda K, b: K.logsumexp(1),
    "softmax_weighted_sum": lambda K, b: K.softmax_weighted_sum(b, 1),
    "min": lambda K, b: (-K).min(1),
    "kmin": lambda K, b: (-K).kmin(3, 1),
    "quantile": lambda K, b: (-K).quantile(0.3, 1),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_generic_reductions_accumulate_in_float32(name, dtype):
    x, y, b = rounded(37, 3, dtype=dtype), rounded(1203, 3, dtype=dtype), rounded(1203, 4, dtype=dtype)
    reduce = REDUCTIONS[name]
    got = reduce(-0.5 * lt.Vi(x).sqdist(lt.Vj(y)), b)
    want = reduce(-0.5 * lt.Vi(x.float()).sqdist(lt.Vj(y.float())), b.float())
    assert_rounded_once(got, want, dtype)
    if name == "matmul":  # many small tiles do not move the answer either
        tiled = (lt.Vi(x).sqdist(lt.Vj(y)) * -0.5).exp().matmul(b, backend="eager", chunk_size=TILES)
        assert_rounded_once(tiled, want, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_selections_keep_integer_indices(dtype):
    x, y = rounded(20, 2, dtype=dtype), rounded(300, 2, dtype=dtype)
    index = lt.Vi(x).sqdist(lt.Vj(y)).argkmin(4, 1)
    assert index.dtype == torch.int64
    torch.testing.assert_close(index, lt.Vi(x.float()).sqdist(lt.Vj(y.float())).argkmin(4, 1))


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


NAMED = {
    "rbf_matmul": lambda x, y, b: lt.rbf_matmul(x, y, b, 0.7, chunk_size=TILES),
    "rbf_matmul_tensor_gamma": lambda x, y, b: lt.rbf_matmul(x, y, b, torch.tensor(0.75), chunk_size=TILES),
    "kernel_regression": lambda x, y, b: lt.kernel_regression(x, y, b, 0.7, chunk_size=TILES),
    "distance_sum": lambda x, y, b: lt.distance_sum(x, y, chunk_size=TILES),
    "distance_quantile": lambda x, y, b: lt.distance_quantile(x, y, 0.4, chunk_size=TILES),
    "knn_regression": lambda x, y, b: lt.knn_regression(x, y, b, 3, chunk_size=TILES),
    "attention": lambda q, k, v: lt.attention(q, k, v, chunk_size=TILES),
    "attention_causal_mask": lambda q, k, v: lt.attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2]).tril().bool(),
                                                          chunk_size=TILES),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_operators_and_attention(name, dtype):
    if name.startswith("attention"):
        shapes = [(2, 3, 45, 8), (2, 3, 45, 8), (2, 3, 45, 5)]
    else:
        shapes = [(41, 3), (203, 3), (203, 4)]
    half = _leaves(*(rounded(*s, dtype=dtype) for s in shapes))
    wide = _leaves(*(t.detach().float() for t in half))
    got, want = NAMED[name](*half), NAMED[name](*wide)
    assert_rounded_once(got, want, dtype)
    differentiable = [k for k, t in enumerate(half) if not (name == "knn_regression" and k < 2)
                      and not (name.startswith("distance") and k == 2)]
    w = torch.randn(want.shape).to(dtype).float()  # a cotangent the half-precision output carries exactly
    grads = torch.autograd.grad((got.float() * w).sum(), [half[k] for k in differentiable])
    wants = torch.autograd.grad((want * w).sum(), [wide[k] for k in differentiable])
    for g, r in zip(grads, wants):
        assert g.dtype == dtype  # gradients come back in the input dtype
        assert_rounded_once(g, r, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_dense_twins_take_half_precision(dtype):
    x, y, b = rounded(30, 3, dtype=dtype), rounded(50, 3, dtype=dtype), rounded(50, 2, dtype=dtype)
    for op, args in [(lt.rbf_matmul, (x, y, b, 0.5)), (lt.distance_quantile, (x, y, 0.5)), (lt.distance_sum, (x, y))]:
        dense = op(*args, impl="dense")
        assert dense.dtype == dtype
        bound = 4 * ULP[dtype]
        torch.testing.assert_close(op(*args).float(), dense.float(), rtol=bound, atol=bound * dense.float().abs().max().item())


def test_named_operator_is_the_generic_formula():
    """lt.rbf_matmul with a number gamma runs the kernel of the formula a user writes: no second compile."""
    from lazytensor import compile as kernels

    x, y, b = torch.randn(300, 3), torch.randn(400, 3), torch.randn(400, 16)
    generic = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp().matmul(b, backend="eager")
    built = kernels.stats["built"]
    named = lt.rbf_matmul(x, y, b, 0.5, backend="eager")
    assert kernels.stats["built"] == built
    torch.testing.assert_close(named, generic)
    lt.rbf_matmul(x, y, b, 0.25, backend="eager")  # another constant: the same kernel again
    assert kernels.stats["built"] == built
