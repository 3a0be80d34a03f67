"""Second derivatives of softmax-type reductions are centred per pair, like dense autograd's.

d^2 lse = sum_j p F'' + sum_j p F' (F' - sum_k p F'): summed as two separate streams,
sum p F'^2 - (sum p F')^2 loses every digit that the spread of F' over j does not hold. The
formulas below have values ~1e6 whose derivatives barely change with j (or not at all), where
the uncentred form lost ~1e-5 of relative accuracy in float64. The reference is dense
``torch.func.hessian`` (forward over reverse: torch's softmax tangent is centred; its
reverse-over-reverse logsumexp Hessian is not, and is off by ~1e-4 here). Both of our modes
are checked, on i-, j- and parameter variables, odd sizes and a tile that does not divide them.
"""
import pytest
import torch
from torch.func import hessian, jacrev

import lazytensor as lt


def nested(u):
    """((((u + 1)^2 + 1)^2 + 1)^2 + 1)^2: ~1e6 at u ~ 1, a derivative ~1e7."""
    u = u + 1.0
    for _ in range(3):
        u = u * u + 1.0
    return u * u


def formula(kind, x, y, t, lazy: bool):
    """F_ij as a LazyTensor or its dense (N, M, 1) twin."""
    X, Y, T = (lt.Vi(x), lt.Vj(y), lt.Pm(t)) if lazy else (x[:, None], y[None], t)
    if kind == "constant":  # constant over j: lse = F + log M
        return nested(X + T) + 0.0 * Y
    if kind == "rows":  # large in x, a small spread over j
        return nested(X + T) + X * Y
    return nested(Y + T) + X * Y  # "columns": large in y_j, y_j close together (a spread softmax)


def lse(kind, x, y, t, lazy, **options):
    f = formula(kind, x, y, t, lazy)
    if lazy:
        return f.logsumexp(1, **{"backend": "eager", "chunk_size": (4, 3), **options}).sum()
    return torch.logsumexp(f, 1).sum()


def data(kind, n, m, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 0.9 + 0.1 * torch.rand(n, 1, generator=gen, dtype=dtype)
    y = torch.randn(m, 1, generator=gen, dtype=dtype)
    if kind == "columns":
        y = 1.0 + 1e-7 * y
    return x, y, torch.tensor([0.05], dtype=dtype)


def close(a, b, rtol):
    """Relative to the largest entry (a Hessian's off-diagonal zeros carry no scale of their own)."""
    scale = b.abs().max()
    assert (a - b).abs().max() <= rtol * scale, f"relative error {((a - b).abs().max() / scale).item():.3g} > {rtol}"


SIZES = [(5, 7), (1, 1), (1, 5), (6, 1)]
KINDS = ["constant", "rows", "columns"]


# Where F ~ 1e6 rounds by ~1e-10, dense float64 itself is ~1e-10 from the exact Hessian; uncentred was ~1e-5.
TOL = 1e-9
# i-, j-variable, parameter; "columns" has no x Hessian to speak of (var_j(y) ~ 1e-14, below F's rounding)
WRT = {"constant": (0, 1, 2), "rows": (0, 1, 2), "columns": (1, 2)}


@pytest.mark.parametrize("n, m", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_lse_hessian_float64_matches_dense(kind, n, m):
    args = data(kind, n, m)

    def f(*a):
        return lse(kind, *a, True)

    for wrt in WRT[kind]:
        ref = hessian(lambda *a: lse(kind, *a, False), argnums=wrt)(*args)
        close(hessian(f, argnums=wrt)(*args), ref, TOL)  # forward over reverse
        close(jacrev(jacrev(f, argnums=wrt), argnums=wrt)(*args), ref, TOL)  # reverse over reverse


@pytest.mark.parametrize("kind", ["constant", "rows"])
def test_lse_double_backward_float64_matches_dense(kind):
    """``create_graph=True`` and a second ``autograd.grad``: a Hessian-vector product on every input at once."""
    args = data(kind, 5, 7)
    x, y, t = (a.clone().requires_grad_() for a in args)
    gen = torch.Generator().manual_seed(1)
    directions = [torch.ones_like(a) + 0.1 * torch.rand(a.shape, generator=gen, dtype=a.dtype) for a in args]
    firsts = torch.autograd.grad(lse(kind, x, y, t, True), (x, y, t), create_graph=True)
    got = torch.autograd.grad(sum((g * v).sum() for g, v in zip(firsts, directions)), (x, y, t))
    blocks = hessian(lambda *a: lse(kind, *a, False), argnums=(0, 1, 2))(*args)
    for row, g in zip(blocks, got):
        ref = sum((block * v).sum(tuple(range(-v.dim(), 0))) for block, v in zip(row, directions))
        close(g, ref, TOL)


def test_lse_hessian_float32_to_float_accuracy():
    """Values ~6e3 in float32: dense's own Hessian is ~6e-4 from float64's (uncentred: 0.33)."""
    x, y, t = data("rows", 6, 11, torch.float32)
    x, y = 0.3 * x, 0.3 * y
    ref = hessian(lambda x_: lse("rows", x_, y.double(), t.double(), False))(x.double())

    def f(x_):
        return lse("rows", x_, y, t, True)

    for got in (hessian(f)(x), jacrev(jacrev(f))(x)):
        close(got.double(), ref, 2e-3)


def test_softmax_weighted_sum_hessian_matches_dense():
    """d out / dF = p (V - out): the first and second derivatives of values ~1e6 spread by 1."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    b = 1e6 + torch.randn(7, 2, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 2, generator=gen, dtype=torch.float64)

    def lazy(x_):
        return ((-lt.Vi(x_).sqdist(lt.Vj(y))).softmax_weighted_sum(b, 1, backend="eager", chunk_size=(4, 3)) * w).sum()

    def dense(x_):
        return ((torch.softmax(-((x_[:, None] - y[None]) ** 2).sum(-1), 1) @ b) * w).sum()

    # the reference: dense on b - 1e6 (exact), which moves no derivative: the softmax sums to 1
    def shifted(x_):
        return ((torch.softmax(-((x_[:, None] - y[None]) ** 2).sum(-1), 1) @ (b - 1e6)) * w).sum()

    close(jacrev(lazy)(x), jacrev(shifted)(x), 1e-9)  # dense: 7.2e-10; summed as two sums: 1.1e-9
    for transform in (hessian, lambda f: jacrev(jacrev(f))):
        close(transform(lazy)(x), transform(shifted)(x), 2.5e-9)  # dense: 1.3e-9; uncentred: 3.2e-9


def test_block_sparse_lse_hessian_matches_masked_dense():
    """``ranges`` restricts every pass (forward, gradient, centres, second derivative) to the kept blocks."""
    from lazytensor import cluster

    args = data("rows", 6, 7)
    keep = torch.tensor([[True, False], [True, True]])
    ranges = cluster.from_matrix(torch.tensor([[0, 3], [3, 6]]), torch.tensor([[0, 4], [4, 7]]), keep)
    mask = torch.zeros(6, 7, 1, dtype=torch.bool)
    mask[:3, :4] = mask[3:] = True

    def lazy(*a):
        return formula("rows", *a, True).logsumexp(1, ranges=ranges, backend="eager").sum()

    def dense(*a):
        return torch.logsumexp(torch.where(mask, formula("rows", *a, False), -torch.inf), 1).sum()

    for wrt in (0, 1, 2):
        ref = hessian(dense, argnums=wrt)(*args)
        close(hessian(lazy, argnums=wrt)(*args), ref, TOL)
        close(jacrev(jacrev(lazy, argnums=wrt), argnums=wrt)(*args), ref, TOL)
