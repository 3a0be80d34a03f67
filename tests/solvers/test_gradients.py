"""Implicit gradients of ridge and landmark fits against dense autograd (torch.cdist, torch.linalg.solve)
and gradcheck; gradients reach tensors a user formula closes over."""
import math
import warnings

import pytest
import torch

import lazytensor as lt
from solvers import ConvergenceWarning, KernelRidge, LandmarkRidge, Matern


def _inputs(n, d, q, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64),
            torch.randn(q, d, generator=g, dtype=torch.float64))


def _matern25(x, y, gamma):
    s = math.sqrt(5) * gamma * torch.cdist(x, y)
    return (1 + s + s**2 / 3) * torch.exp(-s)


def _dense_fit(name, X, Y, Xq, gamma, alpha, L):
    if name == "ridge":
        coef = torch.linalg.solve(_matern25(X, X, gamma) + alpha * torch.eye(X.shape[0], dtype=X.dtype), Y)
        return _matern25(Xq, X, gamma) @ coef
    Knm, Kmm = _matern25(X, L, gamma), _matern25(L, L, gamma)
    return _matern25(Xq, L, gamma) @ torch.linalg.solve(Knm.T @ Knm + alpha * Kmm, Knm.T @ Y)


MAKERS = {
    "ridge": lambda k, a, s: KernelRidge(k, a, source=s, rtol=1e-13, chunk_size=23, rank=30),
    "landmark": lambda k, a, s: LandmarkRidge(k, a, n_landmarks=25, source=s, rtol=1e-13, chunk_size=23),
}


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("source", ["direct", "stored", "streamed"])
def test_implicit_gradients_match_dense_autograd(name, source):
    X, Y, Xq = _inputs(97, 3, 11)
    gamma, alpha = torch.tensor(0.4, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    ref_in = _leaves(X, Y, Xq, gamma, alpha)
    L = None
    if name == "landmark":  # the training points the estimator draws as landmarks (gradients reach X through them)
        drawn = MAKERS[name](Matern(2.5, 0.4), 0.3, "direct").fit(X, Y).landmarks_
        L = ref_in[0][torch.cat([(X == row).all(1).nonzero()[0] for row in drawn])]
    ref = torch.autograd.grad(_dense_fit(name, *ref_in, L).square().mean(), ref_in)
    got_in = _leaves(X, Y, Xq, gamma, alpha)
    est = MAKERS[name](Matern(2.5, got_in[3]), got_in[4], source).fit(got_in[0], got_in[1])
    got = torch.autograd.grad(est.predict(got_in[2]).square().mean(), got_in)
    for label, a, b in zip(("X", "Y", "Xq", "gamma", "alpha"), got, ref):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-8, label


@pytest.mark.parametrize("name", MAKERS)
def test_gradcheck_tiny_streamed_fit(name):
    X, Y, Xq = _inputs(8, 2, 3, seed=1)
    landmarks = X[:4]

    def f(X, Y, Xq, gamma):
        kernel = lambda x, y: (-lt.Pm(gamma) * x.sqdist(y)).exp()  # noqa: E731 - a user formula closing over gamma
        if name == "ridge":
            est = KernelRidge(kernel, 0.5, source="streamed", rtol=1e-14, chunk_size=3)
        else:
            est = LandmarkRidge(kernel, 0.5, landmarks=landmarks, source="streamed", rtol=1e-14, chunk_size=3)
        return est.fit(X, Y).predict(Xq)

    args = _leaves(X, Y, Xq) + [torch.tensor(0.7, dtype=torch.float64, requires_grad=True)]
    torch.autograd.gradcheck(f, args, atol=1e-7, rtol=1e-6)


def test_user_formula_parameters_get_gradients():
    X, Y, Xq = _inputs(60, 3, 7)
    w = torch.tensor([0.2, 0.5, 1.0], dtype=torch.float64, requires_grad=True)  # per-feature inverse length scales
    kernel = lambda x, y: (1 + (x - y).weightedsqnorm(lt.Pm(w))).rsqrt()  # noqa: E731
    est = KernelRidge(kernel, alpha=0.1, source="streamed", rtol=1e-12).fit(X, Y)
    (g,) = torch.autograd.grad(est.predict(Xq).square().sum(), [w])

    def dense(w):
        k = lambda a, b: (1 + ((a[:, None] - b[None]) ** 2 * w).sum(-1)).rsqrt()  # noqa: E731
        return k(Xq, X) @ torch.linalg.solve(k(X, X) + 0.1 * torch.eye(60, dtype=torch.float64), Y)

    (ref,) = torch.autograd.grad(dense(w).square().sum(), [w])
    torch.testing.assert_close(g, ref, rtol=1e-8, atol=1e-10)


def test_per_target_alpha_and_its_gradient():
    X, Y, Xq = _inputs(50, 2, 5)
    alpha = torch.tensor([0.1, 1.0], dtype=torch.float64, requires_grad=True)
    est = KernelRidge(Matern(2.5, 0.4), alpha, source="streamed", rtol=1e-12).fit(X, Y)
    K = _matern25(X, X, 0.4)
    ref = torch.stack([torch.linalg.solve(K + a * torch.eye(50, dtype=torch.float64), Y[:, c])
                       for c, a in enumerate(alpha)], 1)
    torch.testing.assert_close(est.dual_coef_, ref, rtol=1e-9, atol=1e-10)
    (g,) = torch.autograd.grad(est.dual_coef_.sum(), [alpha])
    (g_ref,) = torch.autograd.grad(ref.sum(), [alpha])
    torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-10)


def test_backward_uses_one_adjoint_solve_and_reports_it():
    """The adjoint solve runs with the fit's preconditioner: it converges within the fit's iterations + 5
    (a ConvergenceWarning otherwise), and the backward writes nothing on the estimator."""
    X, Y, Xq = _inputs(60, 3, 5)
    X.requires_grad_()
    iterations = KernelRidge(Matern(2.5, 0.5), 0.5, source="streamed", rtol=1e-10).fit(X.detach(), Y).info_.iterations
    est = KernelRidge(Matern(2.5, 0.5), 0.5, source="streamed", rtol=1e-10, maxiter=iterations + 5).fit(X, Y)
    before = dict(vars(est))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        est.predict(Xq).sum().backward()
    assert vars(est).keys() == before.keys() and all(vars(est)[k] is v for k, v in before.items())
    assert torch.isfinite(X.grad).all()
    with pytest.warns(ConvergenceWarning, match="the fit"):
        starved = KernelRidge(Matern(2.5, 0.5), 0.5, source="streamed", preconditioner=None, rtol=1e-10, maxiter=2).fit(X, Y)
    with pytest.warns(ConvergenceWarning, match="adjoint solve"):  # a starved adjoint says so
        torch.autograd.grad(starved.predict(Xq).sum(), [X])


def test_no_graph_through_iterations_without_grad():
    X, Y, Xq = _inputs(40, 2, 4)
    est = KernelRidge(Matern(2.5, 0.5), 0.5, source="streamed").fit(X, Y)
    assert not est.dual_coef_.requires_grad and not est.predict(Xq).requires_grad


def test_clone_shares_tensor_hyperparameters_and_numpy_output_warns_of_its_lost_gradient():
    from sklearn.base import clone

    X, Y, Xq = _inputs(40, 3, 5)
    g = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    est = KernelRidge(Matern(2.5, g * 2), g * 0.5, source="streamed", rtol=1e-12)  # non-leaf tensors
    copy = clone(est)
    assert copy is not est and copy.kernel is not est.kernel
    assert copy.kernel.gamma is est.kernel.gamma and copy.alpha is est.alpha
    copy.fit(X, Y).predict(Xq).sum().backward()
    reference = _leaves(g.detach())[0]
    _dense_fit("ridge", X, Y, Xq, reference * 2, reference * 0.5, None).sum().backward()
    torch.testing.assert_close(g.grad, reference.grad)
    with pytest.warns(UserWarning, match="drops its gradient") as caught:
        pred = KernelRidge(Matern(2.5, 0.7), 0.5).fit(X.numpy(), Y.clone().requires_grad_()).predict(Xq.numpy())
    assert pred.shape == (5, 2) and {w.filename for w in caught} == {__file__}  # it points at the caller's line
