"""``lazytensor.keops``: pykeops's API with KeOps's semantics, against dense torch twins.

KeOps counts reduction axes with batch dimensions and reduces features by
default; Genred takes formula and alias strings; install() maps ``pykeops``.
The 5-D layouts follow pykeops's test_chunks_ranges / test_lazytensor_gaussian_batch.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import lazytensor as lt
import lazytensor.keops as lk
from lazytensor.keops import numpy as knp
from lazytensor.keops import torch as kt

F64 = dict(rtol=1e-10, atol=1e-10)


def five_d(dtype=torch.float64):
    B1, B2, M, N, D = 2, 3, 11, 7, 3
    x = torch.rand(B1, B2, M, 1, D, dtype=dtype, requires_grad=True)
    y = torch.rand(B1, 1, 1, N, D, dtype=dtype, requires_grad=True)
    return x, y


def test_five_d_layouts_reduce_over_keops_axes():
    x, y = five_d()
    K = (-((kt.LazyTensor(x) - kt.LazyTensor(y)) ** 2).sum(dim=4)).exp()
    dense = (-((x - y) ** 2).sum(4, keepdim=True)).exp()  # (B1, B2, M, N, 1)
    assert K.nbatchdims == 2 and K._shape == (2, 3, 11, 7, 1)
    over_j, over_i = K.sum(dim=3), K.sum(axis=2)
    torch.testing.assert_close(over_j, dense.sum(3), **F64)
    torch.testing.assert_close(over_i, dense.sum(2), **F64)
    torch.testing.assert_close(K.logsumexp(3), torch.logsumexp(dense, 3), **F64)
    torch.testing.assert_close(K.min_reduction(dim=3), dense.min(3).values, **F64)
    torch.testing.assert_close(K.argmin_reduction(dim=2).long(), dense.argmin(2))
    w = torch.randn_like(over_j)
    got = torch.autograd.grad((over_j * w).sum(), (x, y))
    ref = torch.autograd.grad((dense.sum(3) * w).sum(), (x, y))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **F64)


def test_keops_default_axes_and_errors():
    x = torch.rand(5, 3, dtype=torch.float64)
    D = kt.Vi(x) - kt.Vj(x)
    assert isinstance(D.sum(), kt.LazyTensor) and D.sum().ndim == 1  # features, as KeOps
    assert isinstance(D.min(), kt.LazyTensor) and isinstance(D.argmax(), kt.LazyTensor)
    with pytest.raises(ValueError, match="needs axis"):
        D.sum().logsumexp()
    with pytest.raises(ValueError, match="axis"):
        D.sum().sum(axis=3)
    b = torch.rand(2, 5, 1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="1 \\(over i\\), 2 \\(over j\\)"):  # one batch dim: 0 is a batch axis
        (kt.LazyTensor(b) * 1.0).sum().sum(0)


def test_geomloss_batched_logsumexp_over_axis_two():
    B, N, M = 2, 9, 6
    x, y = torch.randn(B, N, 3, dtype=torch.float64), torch.randn(B, M, 3, dtype=torch.float64)
    h = torch.randn(B, M, dtype=torch.float64)
    C = ((kt.LazyTensor(x[:, :, None, :]) - kt.LazyTensor(y[:, None, :, :])) ** 2).sum(-1) / 2
    out = (kt.LazyTensor(h[:, None, :, None]) - C * torch.tensor([4.0], dtype=torch.float64)).logsumexp(2).view(B, -1)
    dense = torch.logsumexp(h[:, None, :] - 4.0 * ((x[:, :, None] - y[:, None]) ** 2).sum(-1) / 2, 2)
    torch.testing.assert_close(out, dense, **F64)


def test_a_reduced_axis_without_variables_counts_one_point():
    x = torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(kt.Vi(x).exp().sum(dim=1), x.exp(), **F64)
    torch.testing.assert_close(kt.Vi(x).sum().logsumexp(dim=1), x.sum(1, keepdim=True), **F64)


def test_keops_options_are_translated():
    x = torch.randn(20, 3)
    K = (-kt.Vi(x).sqdist(kt.Vj(x))).exp()
    ref = torch.exp(-torch.cdist(x.double(), x.double()) ** 2).sum(1, keepdim=True)
    tuned = K.sum(1, backend="CPU", device_id=-1, enable_chunks=False, sum_scheme="block_sum", use_fast_math=True, call=True)
    torch.testing.assert_close(tuned.double(), ref, rtol=1e-5, atol=1e-5)
    accurate = K.sum(1, dtype_acc="float64")  # accumulated in float64, rounded back to float32 as KeOps returns it
    assert accurate.dtype == torch.float32
    torch.testing.assert_close(accurate, lt.LazyTensor.sum(K, 1, dtype_acc=torch.float64).float(), rtol=0, atol=0)
    torch.testing.assert_close(K.sum(1, use_double_acc=True), accurate)
    b = torch.randn(20, 2)
    assert K.matmul(b, use_double_acc=True).dtype == torch.float32
    with pytest.raises(ValueError, match="honoured by sums only"):
        K.logsumexp(1, dtype_acc="float64")
    K.logsumexp(1, dtype_acc="float32")  # the formula's own dtype changes nothing
    torch.testing.assert_close(K.sum(1, call=False)(), K.sum(1))  # KeOps's call=False: a function of nothing
    with pytest.raises(ValueError, match="backend"):
        K.sum(1, backend="TPU")
    with pytest.raises(TypeError, match="nonsense"):
        K.sum(1, nonsense=3)


def test_matmul_and_solve_with_batch_dims_and_keops_spellings():
    x = torch.randn(2, 30, 3, dtype=torch.float64)
    b = torch.randn(2, 30, 2, dtype=torch.float64)
    K = (-(kt.LazyTensor(x[:, :, None, :]) - kt.LazyTensor(x[:, None, :, :])).square().sum(-1)).exp()
    dense = torch.exp(-((x[:, :, None] - x[:, None]) ** 2).sum(-1))
    torch.testing.assert_close(K @ b, dense @ b, **F64)
    K0 = (-kt.Vi(x[0]).sqdist(kt.Vj(x[0]))).exp()
    a = K0.solve(kt.Vi(b[0]), alpha=0.1, backend="CPU")
    ref = torch.linalg.solve(dense[0] + 0.1 * torch.eye(30, dtype=torch.float64), b[0])
    torch.testing.assert_close(a, ref, rtol=1e-8, atol=1e-8)


def test_kmin_with_keops_axes():
    x, y = torch.randn(12, 2, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    D = kt.Vi(x).sqdist(kt.Vj(y))
    dense = torch.cdist(x, y) ** 2
    torch.testing.assert_close(D.Kmin(3, dim=1), dense.topk(3, 1, largest=False).values, **F64)
    torch.testing.assert_close(D.argKmin(2, axis=0).long(), dense.topk(2, 0, largest=False).indices.T)


# -- Genred and the generic_* helpers ---------------------------------------------------------------------
def gaussian_case(dtype=torch.float64):
    x, y = torch.randn(15, 3, dtype=dtype), torch.randn(11, 3, dtype=dtype)
    b, g = torch.randn(11, 2, dtype=dtype), torch.tensor([0.7], dtype=dtype)
    K = torch.exp(-g * ((x[:, None] - y[None]) ** 2).sum(-1))
    return x, y, b, g, K


def test_genred_sum_with_aliases_over_both_axes():
    x, y, b, g, K = gaussian_case()
    aliases = ["x = Vi(3)", "y = Vj(3)", "b = Vj(2)", "g = Pm(1)"]
    out = kt.Genred("Exp(-g * SqDist(x, y)) * b", aliases, reduction_op="Sum", axis=1)(x, y, b, g, backend="CPU")
    torch.testing.assert_close(out, K @ b, **F64)
    over_i = kt.Genred("Exp(-g * SqDist(x, y)) * b", ["x = Vj(3)", "y = Vi(3)", "b = Vi(2)", "g = Pm(1)"], axis=0)
    torch.testing.assert_close(over_i(x, y, b, g), K @ b, **F64)


def test_genred_indexed_aliases_inline_variables_and_intcst():
    x, y, b, g, K = gaussian_case()
    routine = kt.Genred("Exp(-Pm(3, 1) * SqDist(X, Vj(1, 3)) * IntCst(2) / IntCst(2)) * B", ["B = Vj(2, 2)", "X = Var(0, 3, 0)"],
                        reduction_op="Sum", axis=1)
    torch.testing.assert_close(routine(x, y, b, g), K @ b, **F64)


def test_generic_logsumexp_as_geomloss_calls_it():
    x, y, _, _, _ = gaussian_case()
    h, eps = torch.randn(11, 1, dtype=torch.float64), torch.tensor([20.0], dtype=torch.float64)
    lse = kt.generic_logsumexp("( B - (P * (SqDist(X,Y) / IntCst(2)) ) )", "A = Vi(1)", "X = Vi(3)", "Y = Vj(3)", "B = Vj(1)",
                               "P = Pm(1)")
    dense = torch.logsumexp(h.T - 20.0 * ((x[:, None] - y[None]) ** 2).sum(-1) / 2, 1, keepdim=True)
    torch.testing.assert_close(lse(x, y, h, eps), dense, **F64)


def test_generic_sum_argmin_argkmin_and_softmax_weights():
    x, y, b, g, K = gaussian_case()
    sums = kt.generic_sum("Exp(-g * SqDist(x, y)) * b", "out = Vj(2)", "x = Vj(3)", "y = Vi(3)", "b = Vi(2)", "g = Pm(1)")
    torch.testing.assert_close(sums(x, y, b, g), K @ b, **F64)
    D = ((x[:, None] - y[None]) ** 2).sum(-1)
    argmin = kt.generic_argmin("SqDist(x, y)", "i = Vi(1)", "x = Vi(3)", "y = Vj(3)")
    torch.testing.assert_close(argmin(x, y).long()[:, 0], D.argmin(1))
    argkmin = kt.generic_argkmin("SqDist(x, y)", "i = Vi(3)", "x = Vi(3)", "y = Vj(3)")  # K is the output's dimension
    torch.testing.assert_close(argkmin(x, y).long(), D.topk(3, 1, largest=False).indices)
    soft = kt.Genred("-g * SqDist(x, y)", ["x = Vi(3)", "y = Vj(3)", "b = Vj(2)", "g = Pm(1)"], reduction_op="SumSoftMaxWeight",
                     axis=1, formula2="b")
    torch.testing.assert_close(soft(x, y, b, g), torch.softmax(-g * D, 1) @ b, **F64)


def test_genred_errors_name_the_alias_or_argument():
    with pytest.raises(ValueError, match="alias"):
        kt.Genred("x", ["x = Vk(3)"])
    with pytest.raises(ValueError, match="reduction_op"):
        kt.Genred("x", ["x = Vi(3)"], reduction_op="Median")
    routine = kt.Genred("SqDist(x, y)", ["x = Vi(3)", "y = Vj(3)"], axis=1)
    with pytest.raises(ValueError, match="'y' is declared with 3 features"):
        routine(torch.randn(4, 3), torch.randn(5, 2))
    with pytest.raises(ValueError, match="takes 2 tensor arguments"):
        routine(torch.randn(4, 3))


def test_kernel_solve_of_a_formula_linear_in_its_variable():
    x, _, _, g, _ = gaussian_case()
    b = torch.randn(15, 2, dtype=torch.float64)
    solve = kt.KernelSolve("Exp(-g * SqDist(x, y)) * a", ["x = Vi(3)", "y = Vj(3)", "a = Vj(2)", "g = Pm(1)"], "a", axis=1)
    K = torch.exp(-0.7 * ((x[:, None] - x[None]) ** 2).sum(-1))
    ref = torch.linalg.solve(K + 0.5 * torch.eye(15, dtype=torch.float64), b)
    torch.testing.assert_close(solve(x, x, b, g, alpha=0.5), ref, rtol=1e-8, atol=1e-8)
    with pytest.raises(ValueError, match="linear"):
        kt.KernelSolve("Exp(-SqDist(x, y)) * a * a", ["x = Vi(3)", "y = Vj(3)", "a = Vj(2)"], "a", axis=1)(x, x, b)


# -- the NumPy flavour -------------------------------------------------------------------------------------
def test_numpy_flavour_returns_arrays():
    x, y, b, g, K = gaussian_case()
    out = knp.Genred("Exp(-g * SqDist(x, y)) * b", ["x = Vi(3)", "y = Vj(3)", "b = Vj(2)", "g = Pm(1)"], axis=1)(
        x.numpy(), y.numpy(), b.numpy(), g.numpy())
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, (K @ b).numpy(), rtol=1e-10)
    lazy = (-knp.Vi(x.numpy()).sqdist(knp.Vj(y.numpy()))).exp()
    np.testing.assert_allclose(lazy.sum(axis=1), torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)).sum(1, keepdim=True).numpy())
    ranges, _ = knp.cluster.sort_clusters(x.numpy(), knp.cluster.grid_cluster(x.numpy(), 1.0))
    assert isinstance(ranges, np.ndarray)


# -- install(): import pykeops resolves to lazytensor.keops ------------------------------------------------
def test_install_and_uninstall_map_the_pykeops_modules():
    before = {name: sys.modules.get(name) for name in ("pykeops", "pykeops.torch")}
    lk.install()
    try:
        import pykeops
        from pykeops.torch import LazyTensor, generic_logsumexp
        from pykeops.torch.cluster import from_matrix

        assert pykeops is lk and LazyTensor is kt.LazyTensor and generic_logsumexp is kt.generic_logsumexp
        assert from_matrix is kt.cluster.from_matrix and lk.installed()
        from pykeops.numpy.utils import squared_distances  # where pykeops's own test_torch.py imports from
        from pykeops.torch.operations import KernelSolve

        assert KernelSolve is kt.KernelSolve and squared_distances is lk.references.squared_distances
        import pykeops.config  # user code reads its flags

        assert pykeops.config.gpu_available == torch.cuda.is_available() and pykeops.config.torch_found
        pykeops.test_torch_bindings()  # pykeops's install checks: a known value, or a RuntimeError
        pykeops.test_numpy_bindings()
        pykeops.set_build_folder("/nowhere")
        assert isinstance(pykeops.get_build_folder(), str)
    finally:
        lk.uninstall()
    assert not lk.installed()
    assert {name: sys.modules.get(name) for name in before} == before


def test_environment_variable_installs_at_import():
    code = "import lazytensor, pykeops, pykeops.torch; print(pykeops.__name__, pykeops.torch.LazyTensor.__module__)"
    env = {**os.environ, "TP_KEOPS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lazytensor.keops", "lazytensor.keops.lazy"]
    bad = subprocess.run([sys.executable, "-c", "import lazytensor"], env={**env, "TP_KEOPS": "maybe"}, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "TP_KEOPS" in bad.stderr


# -- KeOps's symbolic variables and call=False (its tutorial plot_lazytensors_c) ---------------------------------
def test_symbolic_variables_make_a_reduction_called_with_their_tensors():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 3, generator=gen, dtype=torch.float64), torch.randn(40, 3, generator=gen, dtype=torch.float64)
    b, e = torch.randn(40, 4, generator=gen, dtype=torch.float64), torch.randn(30, 1, generator=gen, dtype=torch.float64)
    sigmas = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    sq = ((x[:, None] - y[None]) ** 2).sum(-1)
    dense = sum(torch.exp(-sq / s**2) for s in sigmas) @ b
    xs, ys, bs, S = kt.Vi(0, 3), kt.Vj(1, 3), kt.Vj(2, 4), kt.Pm(3, 4)
    gamma = (kt.LazyTensor.exp(-kt.LazyTensor.sum((xs - ys) ** 2) / S**2).sum() * bs).sum_reduction(axis=1)
    torch.testing.assert_close(gamma(x, y, b, sigmas), dense, **F64)
    assert gamma(x.float(), y.float(), b.float(), sigmas.float()).dtype == torch.float32  # the dtype of the call's tensors
    mixed = (kt.LazyTensor.exp(-kt.LazyTensor.sum((kt.Vi(x) - kt.Vj(0, 3)) ** 2) / sigmas**2).sum() * kt.Vj(b)).sum(axis=1)
    torch.testing.assert_close(mixed(y), dense, **F64)  # the bound tensors stay; the call brings the symbolic one
    xb, yb = x.reshape(2, 15, 3), y[:30].reshape(2, 15, 3)  # batched tensors: the axis stays as written (over j)
    batched = (kt.Vi(0, 3) * kt.Vj(1, 3)).sum_reduction(axis=1)(xb, yb[:, :7])
    torch.testing.assert_close(batched, xb * yb[:, :7].sum(1, keepdim=True), **F64)
    tupled = kt.LazyTensor((0, 3, 0)).sqdist(kt.LazyTensor((1, 3, 1))).argKmin(3, dim=1)  # KeOps's (index, dim, category)
    assert torch.equal(tupled(x, y), sq.topk(3, 1, largest=False).indices)
    numpy_sum = (-((knp.Vi(0, 3) - knp.Vj(1, 3)) ** 2).sum()).exp().sum(axis=1)
    np.testing.assert_allclose(numpy_sum(x.numpy(), y.numpy()), torch.exp(-sq).sum(1, keepdim=True).numpy(), rtol=1e-12)
    K = (-((kt.Vi(0, 3) - kt.Vj(1, 3)) ** 2).sum()).exp()
    solved = K.solve(kt.Vi(2, 1), alpha=0.1)(x, x, e)
    gram = torch.exp(-((x[:, None] - x[None]) ** 2).sum(-1)) + 0.1 * torch.eye(30, dtype=torch.float64)
    torch.testing.assert_close(solved, torch.linalg.solve(gram, e), rtol=1e-8, atol=1e-8)
    xg = x.clone().requires_grad_()
    kernels = sum(torch.exp(-((xg[:, None] - y[None]) ** 2).sum(-1) / s**2) for s in sigmas)
    (expected,) = torch.autograd.grad((kernels @ b).sum(), xg)
    torch.testing.assert_close(torch.autograd.grad(gamma(xg, y, b, sigmas).sum(), xg)[0], expected, **F64)
    with pytest.raises(TypeError, match="takes 4 tensor"):
        gamma(x, y, b)
    with pytest.raises(ValueError, match="argument 2 has 2 features"):
        gamma(x, y, b[:, :2], sigmas)
    with pytest.raises(ValueError, match="without gaps"):
        ((kt.Vi(0, 3) - kt.Vj(2, 3)) ** 2).sum().sum(axis=1)
    with pytest.raises(ValueError, match="placeholder variables"):  # a core reduction never runs on placeholders' zeros
        lt.LazyTensor.sum(K, "j")


def test_call_false_reads_the_tensors_at_each_call():
    x, b = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, 2, dtype=torch.float64)
    waiting = ((-(kt.Vi(x) - kt.Vj(x)).square().sum()).exp() * kt.Vj(b)).sum_reduction(axis=1, call=False)
    first = waiting()
    b.mul_(3)  # KeOps's loop idiom: update the tensors in place, call again
    torch.testing.assert_close(waiting(), 3 * first, **F64)
    with pytest.raises(TypeError, match="call must be True or False"):
        kt.Vi(x).sum(axis=1, call="no")
