"""KeOps's vector operations: norms, weighted norms, indexing, concatenation, one-hot, feature-axis
min/max/argmin/argmax and the products of feature vectors, each against a dense torch twin.

Shapes and layouts follow KeOps's definitions (keopscore/formulas/maths: row-major MatVecMult,
VecMatMult and TensorProd; TensorDot's ``permute``; Kron as ``np.kron``; DifferenceMatrix
out[j * n + i] = x[i] - y[j] from pykeops's soft-DTW sandbox), cited per case.
"""
import math

import numpy as np
import pytest
import torch

import lazytensor as lt

from .dense import assert_sums_like

N, M = 6, 8


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def one_hot(positions, size):
    """Dense one-hot of float positions; positions outside [0, size) give zeros."""
    return (positions[..., None] == torch.arange(size, dtype=positions.dtype)).to(positions.dtype)


# name -> (feature sizes of x and y, lazy formula of (X, Y), dense formula of (x (N,1,dx), y (1,M,dy)))
CASES = {
    "normalize": ((3, 3), lambda X, Y: (X - Y).normalize(), lambda x, y: (x - y) / (x - y).norm(dim=-1, keepdim=True)),
    "norm_dim": ((3, 3), lambda X, Y: (X - Y).norm(dim=-1), lambda x, y: (x - y).norm(dim=-1, keepdim=True)),
    "weightedsqnorm_full": ((3, 9), lambda X, Y: X.weightedsqnorm(Y),
                            lambda x, y: torch.einsum("nmd,nmde,nme->nm", x.expand(-1, M, -1),
                                                      y.expand(N, -1, -1).unflatten(-1, (3, 3)), x.expand(-1, M, -1))[..., None]),
    "weightedsqnorm_diag": ((3, 3), lambda X, Y: X.weightedsqnorm(Y), lambda x, y: (y * x**2).sum(-1, keepdim=True)),
    "weightedsqnorm_iso": ((3, 1), lambda X, Y: X.weightedsqnorm(Y), lambda x, y: (y * x**2).sum(-1, keepdim=True)),
    "weightedsqdist": ((3, 3), lambda X, Y: X.weightedsqdist(2 * Y, Y.exp()),
                       lambda x, y: (y.exp() * (x - 2 * y) ** 2).sum(-1, keepdim=True)),
    "difference_matrix": ((3, 2), lambda X, Y: X.difference_matrix(Y),
                          lambda x, y: (x[..., None, :] - y[..., :, None]).flatten(-2)),
    "elem": ((3, 3), lambda X, Y: (X * Y).elem(2), lambda x, y: (x * y)[..., 2:3]),
    "extract": ((4, 4), lambda X, Y: (X - Y).extract(1, 2), lambda x, y: (x - y)[..., 1:3]),
    "getitem_int": ((3, 3), lambda X, Y: (X - Y)[-1], lambda x, y: (x - y)[..., 2:3]),
    "getitem_slice": ((4, 4), lambda X, Y: (X * Y)[..., :3], lambda x, y: (x * y)[..., :3]),
    "concat": ((3, 2), lambda X, Y: X.concat(Y.exp()),
               lambda x, y: torch.cat([x.expand(-1, M, -1), y.exp().expand(N, -1, -1)], -1)),
    "cat_three": ((2, 2), lambda X, Y: lt.LazyTensor.cat((X, Y, X * Y), dim=-1),
                  lambda x, y: torch.cat([x.expand(-1, M, -1), y.expand(N, -1, -1), x * y], -1)),
    "one_hot": ((1, 1), lambda X, Y: (3 * (X - Y).abs()).one_hot(5) * X,
                lambda x, y: one_hot(torch.floor(3 * (x - y).abs() + 0.5)[..., 0], 5) * x),
    "feature_min": ((4, 4), lambda X, Y: (X - Y).min(-1), lambda x, y: (x - y).min(-1, keepdim=True).values),
    "feature_max": ((4, 4), lambda X, Y: (X * Y).max(dim=-1), lambda x, y: (x * y).max(-1, keepdim=True).values),
    "feature_argmin": ((4, 4), lambda X, Y: (X - Y).argmin(-1) * X, lambda x, y: (x - y).argmin(-1, keepdim=True) * x),
    "feature_argmax": ((4, 4), lambda X, Y: (X - Y).argmax(axis=-1) * Y, lambda x, y: (x - y).argmax(-1, keepdim=True) * y),
    "matvecmult": ((6, 3), lambda X, Y: X.matvecmult(Y), lambda x, y: (x.unflatten(-1, (2, 3)) * y[..., None, :]).sum(-1)),
    "vecmatmult": ((2, 6), lambda X, Y: X.vecmatmult(Y), lambda x, y: (x[..., :, None] * y.unflatten(-1, (2, 3))).sum(-2)),
    "tensorprod": ((3, 2), lambda X, Y: X.tensorprod(Y), lambda x, y: (x[..., :, None] * y[..., None, :]).flatten(-2)),
    "keops_kron": ((6, 4), lambda X, Y: X.keops_kron(Y, (2, 3), (2, 2)),
                   lambda x, y: torch.einsum("nmab,nmcd->nmacbd", x.expand(-1, M, -1).unflatten(-1, (2, 3)),
                                             y.expand(N, -1, -1).unflatten(-1, (2, 2))).flatten(-4)),
}
SECOND_ORDER = ["normalize", "weightedsqnorm_full", "concat", "feature_max", "matvecmult", "tensorprod", "keops_kron"]


def run_case(name, dtype, axis, order=1):
    (dx, dy), lazy_fn, dense_fn = CASES[name]
    x, y = rand(N, dx, dtype=dtype), rand(M, dy, dtype=dtype)
    assert_sums_like(lazy_fn(lt.Vi(x), lt.Vj(y)), dense_fn(x[:, None], y[None]), [x, y], axis, order=order)


@pytest.mark.parametrize("axis", ["j", "i"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_vector_op_matches_dense(name, dtype, axis):
    run_case(name, dtype, axis)


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_vector_op_second_order(name):
    run_case(name, torch.float64, "j", order=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("permute", [None, (1, 0, 2)])
def test_keops_tensordot_matches_torch_tensordot(permute, dtype):
    # a: (2, 3, 4) with axes 1, 2 contracted against b: (3, 4, 5) axes 0, 1, plus a third kept axis from b.
    x, y = rand(N, 2 * 3 * 4, dtype=dtype), rand(M, 4 * 3 * 5 * 2, dtype=dtype)
    dimfa, dimfb, contfa, contfb = (2, 3, 4), (4, 3, 5, 2), (1, 2), (1, 0)
    args = (dimfa, dimfb, contfa, contfb) + ((permute,) if permute else ())
    lazy = lt.Vi(x).keops_tensordot(lt.Vj(y), *args)
    a = x.reshape(N, 1, *dimfa).expand(N, M, *dimfa)
    b = y.reshape(1, M, *dimfb).expand(N, M, *dimfb)
    dense = torch.einsum("nmabc,nmcbde->nmade", a, b)  # kept axes: a0, b2, b3
    if permute:
        dense = dense.permute(0, 1, *[2 + k for k in np.argsort(permute)])
    assert_sums_like(lazy, dense.flatten(2), [x, y], "j")


def test_tensordot_with_permute_of_keops_test_torch():
    # pykeops test_torch.test_TensorDot_with_permute: the same shapes, contractions and permutation.
    x = torch.randn(10, 2, 3, 2, 2, 4, requires_grad=True, dtype=torch.float64)
    y = torch.randn(6, 2, 4, 2, 3, 2, 3, requires_grad=True, dtype=torch.float64)
    dimfa, dimfb = x.shape[1:], y.shape[1:]
    contfa, contfb, perm = [5, 1, 3], [2, 5, 3], [4, 3, 2, 0, 1]
    inverse = tuple(int(i) + 1 for i in np.argsort(perm))
    dense = torch.tensordot(x, y, dims=(contfa, contfb)).sum(3).permute((0,) + inverse)
    lazy = lt.LazyTensor(x.reshape(10, 1, -1)).keops_tensordot(
        lt.LazyTensor(y.reshape(1, 6, -1)), dimfa, dimfb, tuple(c - 1 for c in contfa), tuple(c - 1 for c in contfb), tuple(perm)
    ).sum_reduction(dim=1)
    torch.testing.assert_close(lazy.flatten(), dense.flatten())
    e = torch.randn_like(dense)
    for v in (x, y):
        gl = torch.autograd.grad(lazy, v, e.reshape(10, -1), retain_graph=True)[0]
        gd = torch.autograd.grad(dense, v, e, retain_graph=True)[0]
        torch.testing.assert_close(gl, gd)


def test_tensordot_as_matrix_product_of_keops_test_lazytensor_tensordot():
    # pykeops test_lazytensor_tensordot: a (4 x 7 matrix as parameters) times b (7,), reduced over a size-1 axis.
    a = torch.randn(4 * 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    x = torch.zeros(1, 1, dtype=torch.float64)  # KeOps reduces a parameter-only formula over size-1 axes
    C = (lt.LazyTensor(a[None, None, :]).keops_tensordot(lt.LazyTensor(b[None, None, :]), (4, 7), (7,), (1,), (0,))
         + 0 * lt.Vi(x) + 0 * lt.Vj(x)).sum_reduction(dim=1)
    torch.testing.assert_close(C.flatten(), a.reshape(4, 7) @ b)


@pytest.mark.parametrize("dims", [([3, 2, 1, 2], [1, 2, 2, 3]), ([2, 3], [2, 2]), ([2, 3, 2], [2, 2, 3])])
def test_kron_of_keops_test_kron(dims):
    # pykeops test_kron: np.kron of the reshaped features, summed over j, in NumPy (LazyTensor of arrays).
    dimfa, dimfb = dims
    x = np.random.rand(11, int(np.prod(dimfa)))
    y = np.random.rand(15, int(np.prod(dimfb)))
    ref = sum(np.stack([np.kron(x[i].reshape(dimfa), y[j].reshape(dimfb)).ravel() for i in range(11)]) for j in range(15))
    out = lt.LazyTensor(x[:, None, :]).keops_kron(lt.LazyTensor(y[None, :, :]), dimfa, dimfb).sum(axis=1)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, ref, atol=1e-10)


def test_matvec_and_vecmat_are_row_major():
    # KeOps's MatVecMult(A, b)[i] = sum_k A[i * p + k] b[k]; VecMatMult(b, A)[i] = sum_k b[k] A[k * p + i].
    A = torch.arange(6.0, dtype=torch.float64).reshape(1, 6)  # [[0, 1, 2], [3, 4, 5]]
    v3 = torch.tensor([[1.0, 10.0, 100.0]], dtype=torch.float64)
    v2 = torch.tensor([[1.0, 10.0]], dtype=torch.float64)
    zero = lt.Vj(torch.zeros(1, 1, dtype=torch.float64))
    expected = torch.tensor([[210.0, 543.0]], dtype=torch.float64)
    torch.testing.assert_close((lt.Vi(A).matvecmult(lt.Vi(v3)) + zero).sum(1), expected)
    expected = torch.tensor([[30.0, 41.0, 52.0]], dtype=torch.float64)
    torch.testing.assert_close((lt.Vi(v2).vecmatmult(lt.Vi(A)) + zero).sum(1), expected)


def test_one_hot_rounds_like_keops():
    # KeOps's OneHot sets position (int)(x + 0.5): round half up for non-negative x.
    v = torch.tensor([[0.0], [0.49], [0.5], [2.2], [2.5]], dtype=torch.float64)
    out = (lt.Vi(v).one_hot(4) + lt.Vj(torch.zeros(1, 1, dtype=torch.float64))).sum(1)
    expected = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)


def test_feature_argmin_ties_go_to_the_first_feature():
    v = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 3.0]], dtype=torch.float64)
    zero = lt.Vj(torch.zeros(1, 1, dtype=torch.float64))
    f = lt.Vi(v) + zero
    torch.testing.assert_close(f.argmin(-1).sum(1)[:, 0], torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(f.argmax(-1).sum(1)[:, 0], torch.tensor([0.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda X: X.elem(3), "elem"),
        (lambda X: X.extract(2, 2), "extract"),
        (lambda X: X[0:3:2], "step 1"),
        (lambda X: X[:, 0, 1], "feature axis only"),
        (lambda X: X.one_hot(3), "feature size 1"),
        (lambda X: X.matvecmult(lt.Vj(torch.randn(4, 2))), "do not match"),
        (lambda X: X.weightedsqnorm(lt.Vj(torch.randn(4, 4))), "1, D or D\\*D"),
        (lambda X: X.keops_tensordot(X, (3,), (2,), (0,), (0,)), "do not match"),
        (lambda X: X.keops_tensordot(X, (3,), (3,), (), (), (0, 0)), "permutation"),
        (lambda X: X.norm(dim=0), "feature axis"),
        (lambda X: lt.LazyTensor.concatenate((X, X), axis=0), "feature axis"),
    ],
)
def test_bad_vector_arguments_name_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make(lt.Vi(torch.randn(5, 3)))


def test_normalize_of_zero_is_zero_with_zero_gradient():
    # KeOps's Normalize is Rsqrt(SqNorm2(x)) * x with Rsqrt(0) = 0.
    x = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    out = (lt.Vi(x) - lt.Vj(torch.zeros(1, 3, dtype=torch.float64))).normalize().sum(1)
    assert out.abs().max() == 0
    (g,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(g).all() and g.abs().max() == 0
    assert math.isclose(float(lt.Vi(torch.ones(1, 4)).normalize().norm2().sum(0)), 1.0, rel_tol=1e-6)


@pytest.mark.slow
def test_new_lowerings_compiled():
    """Every new lowering entry through torch.compile once (one kernel, float32, ragged tiles)."""
    x, y = torch.rand(37, 6, requires_grad=True), torch.rand(21, 3, requires_grad=True)
    X, Y = lt.Vi(x), lt.Vj(y)
    lazy = (X.matvecmult(Y.extract(0, 2)) + X[:2].vecmatmult(X) * Y + X[1:4].tensorprod(Y.elem(0)).extract(0, 3)
            + X[:3].concat(Y)[2:5] + (X[:3] - Y).normalize() + (4 * X[0] - Y).round(1) + (X[:3] - Y).sinxdivx()
            + X[:3].atan2(Y) + (X[:3] * Y).xlogx()
            + (3 * Y[0]).one_hot(3) + (X[:3] - Y).min(-1) + (X[:3] - Y).argmax(-1) + (5 * X[:3]).mod(0.3) + X[:3].asin())
    out = lazy.sum(1, backend="compiled", chunk_size=(16, 8))
    ref = lazy.sum(1, backend="eager")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * g).sum(), [x, y]), torch.autograd.grad((ref * g).sum(), [x, y])):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
