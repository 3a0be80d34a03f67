import torch

from polytope.transport import argmin_plan, barycentric_directions, normalize_costs, sinkhorn_plan, softmax_plan


def costs(rows=4, cols=6, seed=0):
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_softmax_rows_carry_their_mass_and_favour_low_costs():
    c = costs()
    plan = softmax_plan(c, 0.3).plan
    assert torch.allclose(plan.sum(1), torch.full((4,), 0.25, dtype=torch.float64))
    assert torch.equal(plan.argmax(1), c.argmin(1))


def test_argmin_is_the_zero_temperature_limit():
    c = costs()
    assert torch.allclose(softmax_plan(c, 1e-6).plan, argmin_plan(c).plan, atol=1e-12)


def test_balanced_sinkhorn_matches_both_marginals():
    c = costs(5, 5)
    result = sinkhorn_plan(c, 0.1, relaxation=None, max_iter=5000, tol=1e-10)
    assert result.info["converged"]
    assert torch.allclose(result.plan.sum(1), torch.full((5,), 0.2, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(result.plan.sum(0), torch.full((5,), 0.2, dtype=torch.float64), atol=1e-8)


def test_sinkhorn_reports_non_convergence():
    result = sinkhorn_plan(costs(5, 5), 1e-3, relaxation=None, max_iter=2)
    assert not result.info["converged"]


def test_unbalanced_sinkhorn_tends_to_row_softmax_when_the_column_penalty_vanishes():
    c = costs()
    assert torch.allclose(sinkhorn_plan(c, 0.2, relaxation=1e-9).plan, softmax_plan(c, 0.2).plan, atol=1e-8)


def test_sinkhorn_warm_start_saves_iterations():
    c = costs(6, 6)
    cold = sinkhorn_plan(c, 0.05, relaxation=None, max_iter=5000, tol=1e-10)
    warm = sinkhorn_plan(c + 1e-3 * costs(6, 6, seed=1), 0.05, relaxation=None, warm_start=cold.potentials, max_iter=5000,
                         tol=1e-10)
    assert warm.info["iterations"] < cold.info["iterations"]


def test_padding_gets_no_mass_and_normalisation_is_row_relative():
    c = costs()
    c[0, 3:] = torch.inf
    for plan in (softmax_plan(normalize_costs(c), 0.5).plan, sinkhorn_plan(normalize_costs(c), 0.5).plan):
        assert torch.all(plan[0, 3:] == 0)
        assert torch.allclose(plan.sum(1), torch.full((4,), 0.25, dtype=torch.float64))
    shifted = c.clone()
    shifted[1] += 100.0  # a block's baseline does not matter, only its differences
    assert torch.allclose(normalize_costs(shifted), normalize_costs(c))


def test_barycentric_direction_is_the_weighted_vertex_mean():
    vertices = torch.randn(2, 3, 4, dtype=torch.float64)
    plan = torch.tensor([[0.5, 0.0, 0.0], [0.1, 0.1, 0.3]], dtype=torch.float64)
    out = barycentric_directions(plan, vertices)
    assert torch.allclose(out[0], vertices[0, 0])
    assert torch.allclose(out[1], (0.2 * vertices[1, 0] + 0.2 * vertices[1, 1] + 0.6 * vertices[1, 2]))
