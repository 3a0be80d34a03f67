"""Implicit gradients of ridge and landmark fits against dense autograd and gradcheck."""
import pytest
import torch

from solvers import RBF, KernelRidge, LandmarkRidge, Matern


def _inputs(n, d, q, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64),
            torch.randn(q, d, generator=g, dtype=torch.float64))


def _grads(make, source, X, Y, Xq):
    X, Y, Xq = (t.clone().requires_grad_() for t in (X, Y, Xq))
    gamma = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    est = make(Matern(2.5, gamma), alpha, source).fit(X, Y)
    loss = est.predict(Xq).square().mean()
    return torch.autograd.grad(loss, [X, Y, Xq, gamma, alpha])


MAKERS = {
    "ridge": lambda k, a, s: KernelRidge(k, a, source=s, rtol=1e-13, chunk_size=23, rank=30),
    "landmark": lambda k, a, s: LandmarkRidge(k, a, n_landmarks=25, source=s, rtol=1e-13, chunk_size=23),
}


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("source", ["stored", "streamed"])
def test_implicit_gradients_match_dense_autograd(name, source):
    data = _inputs(97, 3, 11)
    ref = _grads(MAKERS[name], "direct", *data)
    got = _grads(MAKERS[name], source, *data)
    for label, a, b in zip(("X", "Y", "Xq", "gamma", "alpha"), got, ref):
        assert ((a - b).abs().max() / b.abs().max()) < 1e-8, label


@pytest.mark.parametrize("name", MAKERS)
def test_gradcheck_tiny_streamed_fit(name):
    X, Y, Xq = _inputs(8, 2, 3, seed=1)
    landmarks = X[:4]

    def f(X, Y, Xq, gamma):
        kernel = RBF(gamma)
        if name == "ridge":
            est = KernelRidge(kernel, 0.5, source="streamed", rtol=1e-14, chunk_size=3)
        else:
            est = LandmarkRidge(kernel, 0.5, landmarks=landmarks, source="streamed", rtol=1e-14, chunk_size=3)
        return est.fit(X, Y).predict(Xq)

    args = [t.clone().requires_grad_() for t in (X, Y, Xq)] + [torch.tensor(0.7, dtype=torch.float64,
                                                                              requires_grad=True)]
    torch.autograd.gradcheck(f, args, atol=1e-7, rtol=1e-6)


def test_backward_uses_one_adjoint_solve_and_reports_it():
    X, Y, Xq = _inputs(60, 3, 5)
    X.requires_grad_()
    est = KernelRidge(RBF(0.5), 0.5, source="streamed", rtol=1e-10).fit(X, Y)
    est.predict(Xq).sum().backward()
    assert est.adjoint_info_.converged and est.adjoint_info_.iterations <= est.info_.iterations + 5
    assert torch.isfinite(X.grad).all()


def test_no_graph_through_iterations_without_grad():
    X, Y, Xq = _inputs(40, 2, 4)
    est = KernelRidge(RBF(0.5), 0.5, source="streamed").fit(X, Y)
    assert not est.dual_coef_.requires_grad and not est.predict(Xq).requires_grad
