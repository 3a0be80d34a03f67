"""The cases of KeOps's own test suite that once failed here, each against a dense torch twin.

clamp with formula bounds (gradients follow the value, as torch), sinc / sinxdivx
derivatives near 0 (a series, not the cancelling closed form), ``ranges`` with
slices spelled (C, 1) or (C, 2), ``K.solve(Vi(b))``, ``sum_scheme=``. KeOps's 5-D
layouts with KeOps's reduction dims are in test_keops_layer.py.
"""
import math

import mpmath
import numpy as np
import pytest
import torch

import lazytensor as lt
from lazytensor import cluster
from lazytensor.keops import torch as kt


# -- clamp(x, a, b) with LazyTensor bounds: torch's values and gradients, also where a > b and at ties --------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clamp_with_formula_bounds_follows_torch(dtype):
    n, m = 40, 30
    x = torch.randn(n, 1, dtype=dtype, requires_grad=True)
    lo = torch.randn(m, 1, dtype=dtype, requires_grad=True)
    hi = torch.randn(m, 1, dtype=dtype, requires_grad=True)  # about half the pairs have lo > hi
    with torch.no_grad():  # ties: x == lo, x == hi, lo == hi
        lo[0], hi[1], hi[2] = x[0], x[3], lo[2]
    lazy = lt.Vi(x).clamp(lt.Vj(lo), lt.Vj(hi)).exp().sum(1)
    dense = torch.clamp(x[:, None, :], lo[None], hi[None]).exp().sum(1)
    torch.testing.assert_close(lazy, dense)
    w = torch.randn_like(dense)
    for a, b in zip(torch.autograd.grad((lazy * w).sum(), (x, lo, hi)), torch.autograd.grad((dense * w).sum(), (x, lo, hi))):
        torch.testing.assert_close(a, b)


def test_clamp_with_number_bounds_as_keops_test():
    # pykeops test_lazytensor_clamp: ((x * y).clamp(a, b)).sum(dim=2), gradients through exp(-D^2)
    x = torch.randn(50, 1, 3, requires_grad=True)
    y = torch.randn(1, 60, 3)

    def fun(x, y):
        return (-((x * y).clamp(-1.23, 1.54).sum(dim=2) ** 2)).exp().sum(dim=1)

    dense, lazy = fun(x, y), fun(lt.LazyTensor(x), lt.LazyTensor(y))
    torch.testing.assert_close(lazy.squeeze(), dense.squeeze())
    grads = [torch.autograd.grad((out**2).sum(), x)[0] for out in (lazy, dense)]
    torch.testing.assert_close(*grads, rtol=1e-4, atol=1e-4)  # float32 sums of 60 terms (KeOps allows 1e-3 / 1e-2)



# keopscore's test_op protocol (300 i-rows, 500 j-rows, D = 3, float64): x.clamp(a, b) in KeOps's layout and as Vi / Vj,
# through pykeops's and lazytensor's LazyTensor, bounds as i-, j- or parameter variables with D or one feature. Issue 42's
# RuntimeError ("output with shape [300, 1, 3] doesn't match the broadcast shape [300, 500, 3]") is torch.clamp's own
# backward, the dense twin's: it fails whenever x and one bound broadcast to less than the output (torch 2.13), so the
# reference is torch.minimum / maximum for values and torch.clamp's gradient rule written out (the masks below, which
# equal torch.clamp's gradients wherever it runs, ties included). "grid" data (halves in [-1.5, 1.5]) ties x with the
# bounds and lo with hi on many pairs; "normal" data has lo > hi on about half of them.
def _clamp_operand(t, axis, spelling):
    """``t`` ((rows, D), or (D,) for a parameter) as a LazyTensor of that spelling, and as its dense broadcast twin."""
    dense = t if axis == "p" else (t[:, None, :] if axis == "i" else t[None, :, :])
    if spelling == "vivj":
        return {"i": lt.Vi, "j": lt.Vj, "p": lt.Pm}[axis](t), dense
    return (kt.LazyTensor if spelling == "pykeops" else lt.LazyTensor)(dense), dense


def _dense_clamp_grads(x, lo, hi, w):
    """torch.clamp's vector-Jacobian product for cotangent ``w``, each reduced to its input's broadcast shape."""
    masks = ((x >= lo) & (x <= hi), (x < lo) & (lo < hi), (x > hi) | (hi < lo))
    return [(w * m).sum_to_size(t.shape) for m, t in zip(masks, (x, lo, hi))]


@pytest.mark.parametrize("data", ["normal", "grid"])
@pytest.mark.parametrize("bound_features", [3, 1])
@pytest.mark.parametrize("axes", ["ijj", "iji", "jii", "ijp", "ipj"])
@pytest.mark.parametrize("spelling", ["pykeops", "lazytensor", "vivj"])
def test_clamp_with_variable_bounds_in_every_layout_follows_torch(spelling, axes, bound_features, data):
    rows = {"i": 300, "j": 500}
    shapes = [(rows[a], f) if a != "p" else (f,) for a, f in zip(axes, (3, bound_features, bound_features))]
    draw = (lambda s: torch.randn(s, dtype=torch.float64)) if data == "normal" else (
        lambda s: torch.randint(-3, 4, s, dtype=torch.float64) / 2)
    leaves = [draw(shape).requires_grad_() for shape in shapes]
    (X, xd), (A, ad), (B, bd) = (_clamp_operand(t, a, spelling) for t, a in zip(leaves, axes))
    lazy = X.clamp(A, B).sum(1)
    dense = torch.minimum(torch.maximum(xd, ad), bd).expand(300, 500, 3)
    torch.testing.assert_close(lazy, dense.sum(1), rtol=1e-12, atol=1e-10)
    w = torch.rand(300, 3, dtype=torch.float64)
    want = _dense_clamp_grads(xd, ad, bd, w[:, None, :].expand(300, 500, 3))
    for got, ref, leaf in zip(torch.autograd.grad((lazy * w).sum(), leaves), want, leaves):
        torch.testing.assert_close(got, ref.reshape(leaf.shape), rtol=1e-12, atol=1e-10)


def test_dense_clamp_gradient_rule_is_torch_clamps():
    # where torch.clamp's backward runs (x and both bounds broadcast to the output), the written-out rule is its own
    x, lo, hi = (torch.randint(-3, 4, s, dtype=torch.float64).div(2).requires_grad_() for s in ((6, 1, 3), (1, 7, 3), (1, 7, 1)))
    w = torch.rand(6, 7, 3, dtype=torch.float64)
    for got, ref in zip(_dense_clamp_grads(x, lo, hi, w), torch.autograd.grad((torch.clamp(x, lo, hi) * w).sum(), (x, lo, hi))):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("flavour", [kt.LazyTensor, lt.LazyTensor])
def test_clamp_takes_tensor_bounds_as_pykeops_does(flavour):
    # pykeops's ternary operations wrap tensors (here (1, M, D): j-variables); the operators here already did.
    x, lo, hi = (torch.randn(n, 3, dtype=torch.float64, requires_grad=True) for n in (30, 40, 40))
    lazy = flavour(x[:, None, :]).clamp(lo[None] - 0.5, hi[None] + 0.5).sum(1)
    dense = torch.clamp(x[:, None, :], lo[None] - 0.5, hi[None] + 0.5).sum(1)
    torch.testing.assert_close(lazy, dense)
    for got, ref in zip(torch.autograd.grad(lazy.sum(), (x, lo, hi)), torch.autograd.grad(dense.sum(), (x, lo, hi))):
        torch.testing.assert_close(got, ref)
    with pytest.raises(TypeError, match="clamp: low"):
        flavour(x[:, None, :]).clamp("0", 1.0)

# -- sinc / sinxdivx near 0: derivatives to float accuracy, against exact ones ----------------------------
def exact_derivative(f, v: float, order: int) -> float:
    mpmath.mp.dps = 40
    return float(mpmath.diff(f, mpmath.mpf(v), order))


def sinc_mp(t):
    return mpmath.mpf(1) if t == 0 else mpmath.sin(mpmath.pi * t) / (mpmath.pi * t)


def sinxdivx_mp(t):
    return mpmath.mpf(1) if t == 0 else mpmath.sin(t) / t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["sinc", "sinxdivx"])
def test_sinc_derivatives_near_zero(name, dtype):
    x = torch.cat([torch.tensor([0.0, 1e-8, -3e-6, 0.999, 1.001, 2.5]), (torch.rand(40) - 0.5) * 2e-2]).to(dtype)[:, None]
    leaf = x.clone().requires_grad_()
    out = (getattr(lt.Vi(leaf), name)() * lt.Vj(torch.ones(1, 1, dtype=dtype))).sum(1)
    (g1,) = torch.autograd.grad(out.sum(), leaf, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), leaf)
    f = sinc_mp if name == "sinc" else sinxdivx_mp
    points = x.double().flatten().tolist()
    tol = 1e-6 if dtype == torch.float32 else 1e-12  # absolute: KeOps's test allows 1e-4 in float32
    scale = math.pi**2 if name == "sinc" else 1.0
    for got, order in ((out, 0), (g1, 1), (g2, 2)):
        ref = torch.tensor([exact_derivative(f, v, order) for v in points], dtype=torch.float64)[:, None]
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=tol * scale, msg=lambda m, order=order: f"order {order}: {m}")


# -- ranges: KeOps's 6-tuple with slices as (C,), (C, 1) or (C, 2) int32 tensors --------------------------------
def _ranges_case():
    x, y, b = (torch.randn(n, d, dtype=torch.float64) for n, d in ((30, 2), (25, 2), (25, 1)))
    rx = torch.tensor([[0, 10], [10, 22], [22, 30]], dtype=torch.int32)
    ry = torch.tensor([[0, 7], [7, 25]], dtype=torch.int32)
    keep = torch.tensor([[1, 0], [1, 1], [0, 1]], dtype=torch.bool)
    dense_mask = torch.zeros(30, 25, dtype=torch.float64)
    for k, (a, e) in enumerate(rx.tolist()):
        for m, (c, d) in enumerate(ry.tolist()):
            dense_mask[a:e, c:d] = float(keep[k, m])
    return x, y, b, cluster.from_matrix(rx, ry, keep), dense_mask


@pytest.mark.parametrize("spelling", ["flat", "column", "pairs"])
def test_ranges_with_int32_slices_of_any_keops_spelling(spelling):
    x, y, b, ranges, mask = _ranges_case()

    def spell(slices):
        slices = slices.to(torch.int32)
        if spelling == "column":
            return slices[:, None]
        if spelling == "pairs":
            return torch.stack([torch.cat([slices.new_zeros(1), slices[:-1]]), slices], 1)
        return slices

    ranges = tuple(spell(r) if k in (1, 4) else r.to(torch.int32) for k, r in enumerate(ranges))
    K = (-lt.Vi(x).sqdist(lt.Vj(y))).exp()
    dense = torch.exp(-torch.cdist(x, y) ** 2) * mask
    torch.testing.assert_close(K.matmul(b, ranges=ranges), dense @ b)
    torch.testing.assert_close((K * lt.Vi(torch.ones(30, 1, dtype=torch.float64))).sum(0, ranges=ranges), dense.sum(0)[:, None])


def test_ranges_pairs_must_be_consecutive():
    _, _, _, ranges, _ = _ranges_case()
    bad = list(ranges)
    bad[1] = torch.tensor([[0, 1], [2, 3], [3, 4]])
    x = torch.randn(30, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="slices"):
        lt.Vi(x).sqdist(lt.Vj(torch.randn(25, 2, dtype=torch.float64))).sum(1, ranges=tuple(bad))


# -- K.solve(Vi(b)): KeOps's spelling of the right-hand side --------------------------------------------------
@pytest.mark.parametrize("numpy", [False, True])
def test_solve_with_an_i_variable_right_hand_side(numpy):
    x = torch.randn(40, 2, dtype=torch.float64)
    b = torch.randn(40, 3, dtype=torch.float64)
    xs, bs = (x.numpy(), b.numpy()) if numpy else (x, b)
    K = (-lt.Vi(xs).sqdist(lt.Vj(xs))).exp()
    a = K.solve(lt.Vi(bs), alpha=0.5)
    ref = torch.linalg.solve(torch.exp(-torch.cdist(x, x) ** 2) + 0.5 * torch.eye(40, dtype=torch.float64), b)
    assert isinstance(a, np.ndarray) == numpy
    torch.testing.assert_close(torch.as_tensor(a), ref, rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError, match="b must be"):
        K.solve(lt.Vj(b), alpha=0.5) if not numpy else K.solve(lt.Vi(bs) * 2.0, alpha=0.5)


# -- KernelSolve stops by KeOps's rule (RMS residual < eps) in float32: test_torch.py::test_invkernel's accuracy --------
def test_kernel_solve_in_float32_is_as_accurate_as_keops_and_takes_eps():
    from lazytensor.keops import KernelSolve

    torch.manual_seed(0)
    x, b = torch.rand(10, 3, requires_grad=True), torch.rand(10, 3)
    g = torch.tensor([0.5])
    solve = KernelSolve("Exp(-g * SqDist(x,y)) * a", ["x = Vi(3)", "y = Vj(3)", "a = Vj(3)", "g = Pm(1)"],
                        "a", axis=1)
    dense = lambda x: torch.exp(-g * torch.cdist(x, x) ** 2) + 0.1 * torch.eye(10)  # noqa: E731
    for kw in ({}, {"eps": 1e-6}):
        c = solve(x, x, b, g, alpha=0.1, **kw)
        ref = torch.linalg.solve(dense(x), b)
        torch.testing.assert_close(c, ref, rtol=0, atol=1e-4)  # the old relative 1e-4 stop missed by 1.5e-4
        e = torch.rand_like(c)
        (got,), (want,) = torch.autograd.grad((c * e).sum(), x), torch.autograd.grad((ref * e).sum(), x)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_logsumexp_takes_its_weight_as_keops_other():
    from lazytensor.keops import LazyTensor

    x, y, w = torch.randn(7, 1, 2), torch.randn(1, 9, 2), torch.rand(1, 9, 1) + 0.1
    D = -((LazyTensor(x) - LazyTensor(y)) ** 2).sum(2)
    dense = torch.logsumexp(-((x - y) ** 2).sum(2, keepdim=True) + w.log(), dim=1)
    torch.testing.assert_close(D.logsumexp(axis=1, other=LazyTensor(w)), dense)  # test_torch_func_logsumexp.py's call
    with pytest.raises(TypeError, match="once"):
        D.logsumexp(axis=1, weight=LazyTensor(w), other=LazyTensor(w))


# -- Grad(f, x, e) in formula strings (test_numpy.py::test_formula_simplification) and LazyTensor.grad --------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grad_is_the_exact_vector_jacobian_product_to_second_order(dtype):
    from lazytensor.keops import Genred

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(11, 3, generator=g, dtype=dtype), torch.rand(7, 3, generator=g, dtype=dtype)
    b, e, u = (torch.rand(7, 2, generator=g, dtype=dtype), torch.rand(11, 2, generator=g, dtype=dtype),
               torch.rand(11, 3, generator=g, dtype=dtype))
    xg = x.clone().requires_grad_()
    f = torch.exp(-((xg[:, None] - y[None]) ** 2).sum(-1, keepdim=True)) * torch.sin(xg[:, None, :2] * b[None])  # (11, 7, 2)
    first = torch.autograd.grad((f * e[:, None]).sum(), xg, create_graph=True)[0]  # = sum_j Grad(f_ij, x, e_i)
    second = torch.autograd.grad((first * u).sum(), xg)[0]
    aliases = ["x = Vi(3)", "y = Vj(3)", "b = Vj(2)", "e = Vi(2)", "u = Vi(3)"]
    text = "Exp(-SqDist(x,y)) * Sin(Extract(x, 0, 2) * b)"
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    ours = Genred(f"Grad({text}, x, e)", aliases, reduction_op="Sum", axis=1)(x, y, b, e, u)
    torch.testing.assert_close(ours, first.detach(), **tol)
    ours2 = Genred(f"Grad(Grad({text}, x, e), x, u)", aliases, reduction_op="Sum", axis=1)(x, y, b, e, u)
    torch.testing.assert_close(ours2, second, **tol)
    xi = lt.Vi(x)  # the method: matched by the variable the formula was written with
    core = (-xi.sqdist(lt.Vj(y))).exp().grad(xi, lt.Vi(e[:, :1])).sum(1)
    torch.testing.assert_close(core, torch.autograd.grad(
        (torch.exp(-((xg[:, None] - y[None]) ** 2).sum(-1)) * e[:, :1]).sum(), xg)[0], **tol)
    with pytest.raises(ValueError, match="other must be a variable"):
        xi.sqnorm2().grad(xi * 2, lt.Vi(e[:, :1]))


# -- sum_scheme: KeOps's summation orders are accepted; kahan_scheme sums in float64 -----------------------------
@pytest.mark.parametrize("scheme", ["auto", "direct_sum", "block_sum", "kahan_scheme"])
def test_sum_scheme_is_accepted(scheme):
    # pykeops test_chunks_ranges: x (B1, B2, M, 1, D), y (B1, 1, 1, N, D), b (1, B2, N, DV), K.__matmul__(b, sum_scheme=...)
    B1, B2, M, N, D, DV = 2, 3, 20, 31, 30, 1
    x = torch.rand(B1, B2, M, 1, D) / math.sqrt(D)
    y = torch.rand(B1, 1, 1, N, D) / math.sqrt(D)
    b = torch.randn(1, B2, N, DV)

    def kernel(x, y):
        return (-((x - y).square()).sum(dim=4)).exp()

    out = kernel(lt.LazyTensor(x), lt.LazyTensor(y)).__matmul__(b, sum_scheme=scheme)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, kernel(x, y) @ b, rtol=1e-4, atol=1e-4)


def test_kahan_scheme_is_more_accurate_in_float32():
    v = torch.full((1, 200000, 1), 1.0 + 2.0**-20)
    exact = 200000 * (1.0 + 2.0**-20)
    ones = lt.Vi(torch.ones(1, 1, 1))
    plain = float((ones * lt.Vj(v)).sum(1))
    kahan = float((ones * lt.Vj(v)).sum(1, sum_scheme="kahan_scheme"))
    assert abs(kahan - exact) <= abs(plain - exact) and abs(kahan - exact) < 0.02


def test_unknown_sum_scheme_is_refused():
    with pytest.raises(ValueError, match="sum_scheme"):
        (lt.Vi(torch.randn(3, 1)) * lt.Vj(torch.randn(4, 1))).sum(1, sum_scheme="pairwise")


# -- pykeops.numpy.utils / torch.utils: the dense references KeOps's test_numpy.py / test_torch.py import -----------
SCALAR_KERNELS = {"gaussian": lambda u: torch.exp(-u), "laplacian": lambda u: torch.exp(-u.sqrt()),
                  "cauchy": lambda u: 1 / (1 + u), "inverse_multiquadric": lambda u: (1 + u) ** -0.5}


@pytest.mark.parametrize("kernel", sorted(SCALAR_KERNELS))
def test_keops_reference_kernels_match_their_definitions_and_derivatives(kernel):
    from lazytensor.keops import install, references, uninstall

    install()
    try:
        from pykeops.numpy.utils import grad_np_kernel, log_np_kernel, np_kernel
        from pykeops.torch.utils import torch_kernel
    finally:
        uninstall()
    gen = torch.Generator().manual_seed(0)
    x, y, s = torch.randn(7, 3, generator=gen, dtype=torch.float64), torch.randn(5, 3, generator=gen, dtype=torch.float64), 0.7
    sq = ((x[:, None] - y[None]) ** 2).sum(-1).requires_grad_()  # the squared distances, directly
    k = SCALAR_KERNELS[kernel](sq / s**2)
    dk = torch.autograd.grad(k.sum(), sq)[0]  # each entry depends on its own distance only
    xn, yn = x.numpy(), y.numpy()
    for value, expected in ((np_kernel(xn, yn, s, kernel), k), (log_np_kernel(xn, yn, s, kernel), k.log()),
                            (grad_np_kernel(xn, yn, s, kernel), dk), (torch_kernel(x, y, s, kernel), k)):
        torch.testing.assert_close(torch.as_tensor(value), expected.detach())
    # chain_rules: the gradient in x of sum_i <q_i, (K p)_i>, against autograd through the kernel
    q, p = torch.randn(7, 2, generator=gen, dtype=torch.float64), torch.randn(5, 2, generator=gen, dtype=torch.float64)
    xg = x.clone().requires_grad_()
    expected = torch.autograd.grad((q * (SCALAR_KERNELS[kernel](((xg[:, None] - y[None]) ** 2).sum(-1) / s**2) @ p)).sum(), xg)[0]
    chained = references.chain_rules(q.numpy(), x.numpy(), y.numpy(), grad_np_kernel(x.numpy(), y.numpy(), s, kernel), p.numpy())
    torch.testing.assert_close(torch.as_tensor(chained), expected)
    with pytest.raises(ValueError, match="kernel must be one of"):
        np_kernel(x.numpy(), y.numpy(), s, "gausian")


def test_keops_reference_helpers_on_the_sphere_and_log_sum_exp():
    from lazytensor.keops import references

    gen = torch.Generator().manual_seed(1)
    a, b = [torch.nn.functional.normalize(torch.randn(n, 3, generator=gen, dtype=torch.float64), dim=1) for n in (6, 4)]
    angle_cos = a @ b.T
    chord = ((a[:, None] - b[None]) ** 2).sum(-1)  # |a - b|^2 = 2 - 2c on the sphere
    expected = {"binet": angle_cos**2, "linear": angle_cos, "gaussian_oriented": torch.exp(-chord / 0.5**2),
                "gaussian_unoriented": torch.exp(-(2 - 2 * angle_cos**2) / 0.5**2)}
    for name, value in expected.items():
        torch.testing.assert_close(torch.as_tensor(references.np_kernel_sphere(a.numpy(), b.numpy(), 0.5, name)), value)
    mat = 800 * torch.randn(5, 9, generator=gen, dtype=torch.float64)  # exp would overflow unfactored
    for axis in (0, 1):
        torch.testing.assert_close(torch.as_tensor(references.log_sum_exp(mat.numpy(), axis=axis)), mat.logsumexp(axis))
    differences = (a[:, None] - b[None]).permute(2, 0, 1)
    torch.testing.assert_close(torch.as_tensor(references.differences(a.numpy(), b.numpy())), differences)
    torch.testing.assert_close(torch.as_tensor(references.squared_distances(a.numpy(), b.numpy())), chord)
