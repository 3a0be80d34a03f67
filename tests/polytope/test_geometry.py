import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polytope.geometry import curvature_estimate, frame, gradient_estimate, procrustes, random_basis, vertex_count


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["simplex", "orthoplex"]), dim=st.integers(1, 17))
def test_frame_is_centred_unit_and_tight(kind, dim):
    v = frame(kind, dim)
    assert v.shape == (vertex_count(kind, dim), dim)
    assert torch.allclose(v.sum(0), torch.zeros(dim, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(v.norm(dim=1), torch.ones(len(v), dtype=torch.float64), atol=1e-12)
    tight = v.T @ v - (len(v) / dim) * torch.eye(dim, dtype=torch.float64)
    assert tight.abs().max() < 1e-12


def test_simplex_vertices_are_equidistant():
    v = frame("simplex", 5)
    dist = torch.cdist(v, v)
    off = dist[~torch.eye(6, dtype=torch.bool)]
    assert torch.allclose(off, off[0].expand_as(off), atol=1e-12)


def test_frame_rejects_bad_arguments():
    with pytest.raises(ValueError, match="polytope"):
        frame("cube", 3)
    with pytest.raises(ValueError, match="dimension"):
        frame("simplex", 0)


def test_random_basis_is_orthonormal_and_follows_bias():
    gen = torch.Generator().manual_seed(0)
    q = random_basis(9, 4, gen)
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    bias = torch.randn(9, dtype=torch.float64)
    q = random_basis(9, 4, gen, bias=bias)
    assert torch.allclose(q[:, 0], bias / bias.norm(), atol=1e-12)
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="exceeds"):
        random_basis(3, 4, gen)


def test_procrustes_recovers_a_rotation_of_the_basis():
    gen = torch.Generator().manual_seed(1)
    old = random_basis(7, 7, gen)
    rotation = random_basis(7, 7, gen)
    q = procrustes(old, old @ rotation)
    assert torch.allclose(q, rotation, atol=1e-10)
    z = torch.randn(7, dtype=torch.float64)
    assert torch.allclose((old @ rotation) @ (q.T @ z), old @ z, atol=1e-10)  # same vector, new coordinates


def quadratic(dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    a = a @ a.T + torch.diag(torch.logspace(0, 2, dim, dtype=torch.float64))  # anisotropic
    b = torch.randn(dim, generator=gen, dtype=torch.float64)
    f = lambda x: 0.5 * ((x @ a) * x).sum(-1) + x @ b  # noqa: E731
    return f, a, b


@pytest.mark.parametrize("kind", ["simplex", "orthoplex"])
def test_curvature_estimate_is_exact_on_quadratics(kind):
    dim = 6
    f, a, b = quadratic(dim)
    x = torch.randn(dim, dtype=torch.float64)
    basis = random_basis(dim, dim, torch.Generator().manual_seed(3))
    for h in (1e-2, 0.3, 2.0):
        losses = f(x + h * frame(kind, dim) @ basis.T)
        estimate = curvature_estimate(losses, f(x), h)
        assert torch.allclose(estimate, torch.trace(a) / dim, rtol=1e-8)


def test_gradient_estimate_exact_on_orthoplex_and_first_order_on_simplex():
    dim = 5
    f, a, b = quadratic(dim)
    x = torch.randn(dim, dtype=torch.float64)
    basis = random_basis(dim, dim, torch.Generator().manual_seed(4))
    grad = basis.T @ (a @ x + b)  # frame coordinates
    for h in (1e-3, 0.5):
        estimate = gradient_estimate(f(x + h * frame("orthoplex", dim) @ basis.T), frame("orthoplex", dim), h)
        assert torch.allclose(estimate, grad, rtol=1e-7, atol=1e-9)
    errors = []
    for h in (0.2, 0.1, 0.05):
        vertices = frame("simplex", dim)
        estimate = gradient_estimate(f(x + h * vertices @ basis.T), vertices, h)
        errors.append(float((estimate - grad).norm()))
    assert errors[0] > 1e-6  # the simplex's third moment leaves a bias ...
    assert errors[0] / errors[1] == pytest.approx(2.0, rel=1e-6)  # ... linear in the radius
    assert errors[1] / errors[2] == pytest.approx(2.0, rel=1e-6)
