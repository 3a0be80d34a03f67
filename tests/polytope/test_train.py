import pytest
import torch
from torch import nn

from polytope import PolytopeOptimizer, train


def problem(seed=0):
    torch.manual_seed(seed)
    inputs = torch.randn(64, 3)
    targets = inputs @ torch.tensor([1.0, -2.0, 0.5]) + 0.3
    model = nn.Sequential(nn.Linear(3, 1))
    loss_fn = lambda out, y: nn.functional.mse_loss(out.squeeze(-1), y)  # noqa: E731
    return model, loss_fn, inputs, targets


def test_train_full_batch_closure_fallback_records_history_and_respects_budget():
    model, loss_fn, x, y = problem()
    start = float(loss_fn(model(x), y))
    history = train(model, loss_fn, (x, y), max_evaluations=400, seed=0, progress=False, use_evaluator=False, radii=0.1)
    assert len(history) == len(history.evaluations) == len(history.seconds) > 5
    assert history.evaluations == sorted(history.evaluations) and history.evaluations[-2] < 400
    assert history.loss[-1] < 0.5 * start
    assert history.loss[-1] == pytest.approx(float(loss_fn(model(x), y)))


def test_train_minibatches_with_trust_region_compares_on_the_same_batch():
    model, loss_fn, x, y = problem(1)
    start = float(loss_fn(model(x), y))
    history = train(model, loss_fn, (x, y), steps=25, batch_size=16, seed=0, progress=False, use_evaluator=False,
                    radii=0.1, radius_model="quadratic", trust_region=True)
    assert len(history) == 25
    assert float(loss_fn(model(x), y)) < 0.5 * start
    assert any("rho" in info for info in history.info)


def test_train_with_registered_evaluator_matches_the_closure_fallback():
    finals = []
    for use_evaluator in (True, False):
        model, loss_fn, x, y = problem(2)
        train(model, loss_fn, (x, y), steps=10, seed=0, progress=False, use_evaluator=use_evaluator, radii=0.1, trust_region=True)
        finals.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    assert torch.allclose(finals[0], finals[1], atol=1e-5)


def test_train_same_seed_same_result_and_iterable_batches():
    results = []
    for _ in range(2):
        model, loss_fn, x, y = problem(3)
        batches = [(x[:32], y[:32]), (x[32:], y[32:])]
        train(model, loss_fn, batches, steps=6, seed=4, progress=False, use_evaluator=False, radii=0.1)
        results.append(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
    assert torch.equal(results[0], results[1])


def test_train_validates_its_arguments():
    model, loss_fn, x, y = problem()
    with pytest.raises(ValueError, match="steps or max_evaluations"):
        train(model, loss_fn, (x, y), progress=False)
    with pytest.raises(ValueError, match="steps"):
        train(model, loss_fn, (x, y), steps=0, progress=False)
    with pytest.raises(TypeError, match="model"):
        train(lambda t: t, loss_fn, (x, y), steps=1, progress=False)
    with pytest.raises(ValueError, match="sample count"):
        train(model, loss_fn, (x, y[:3]), steps=1, progress=False, use_evaluator=False)
    with pytest.raises(TypeError, match="together"):
        train(model, loss_fn, (x, y), optimizer=PolytopeOptimizer(model.parameters()), steps=1, radii=0.1, progress=False)
