import copy

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


def test_scoring_candidates_leaves_batchnorm_statistics_alone_on_both_paths():
    states = []
    for use_evaluator in (True, False):
        torch.manual_seed(3)
        x, y = torch.randn(32, 3), torch.randn(32)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
        loss_fn = lambda out, t: nn.functional.mse_loss(out.squeeze(-1), t)  # noqa: E731
        train(model, loss_fn, (x, y), steps=5, seed=0, progress=False, use_evaluator=use_evaluator, radii=0.1)
        states.append(model.state_dict())
    assert states[0]["1.num_batches_tracked"] == states[1]["1.num_batches_tracked"] <= 5
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_batchnorm_statistics_follow_one_forward_per_step_with_the_accepted_parameters():
    """What docs/polytope.md says: scoring leaves the buffers alone, the uncharged History forward moves them."""
    torch.manual_seed(4)
    x, y = 3 * torch.randn(48, 3) + 1, torch.randn(48)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    replay = copy.deepcopy(model)
    accepted = []
    loss_fn = lambda out, t: nn.functional.mse_loss(out.squeeze(-1), t)  # noqa: E731
    history = train(model, loss_fn, (x, y), steps=4, seed=0, progress=False,
                    callback=lambda step, opt, hist: accepted.append([p.detach().clone() for p in model.parameters()]))
    with torch.no_grad():
        for params in accepted:
            for target, value in zip(replay.parameters(), params):
                target.copy_(value)
            replay(x)
    assert int(model[1].num_batches_tracked) == len(history) == 4
    for name, value in replay.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, msg=name)


def test_train_calls_on_one_optimizer_never_share_an_objective():
    """A loop calling train() once per batch: each call's batch is a new objective, so the incumbent is scored
    again on it (as opt.step with a new objective_token), never compared with a loss from another batch."""
    from polytope import flat_closure

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = torch.tanh(x @ torch.randn(4)) + torch.cat([torch.zeros(32), torch.full((32,), 10.0)])
    batches = [(x[:32], y[:32]), (x[32:], y[32:])] * 2
    spent = {}
    for route in ("train", "tokens"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        loss_fn = lambda out, t: nn.functional.mse_loss(out.squeeze(-1), t)  # noqa: E731
        opt, spent[route] = PolytopeOptimizer(model.parameters(), seed=0), []
        for token, batch in enumerate(batches):
            before = opt.evaluations
            if route == "train":
                train(model, loss_fn, batch, optimizer=opt, steps=1, progress=False, use_evaluator=False)
            else:
                opt.step(flat_closure(model, loss_fn, *batch), objective_token=token)
            spent[route].append(opt.evaluations - before)
    assert spent["train"] == spent["tokens"] and spent["train"][1] > spent["train"][0]


def test_minibatch_order_follows_the_seed_and_without_one_torch_manual_seed():
    x, y = torch.arange(40.0).reshape(20, 2), torch.arange(20.0)

    def batches_seen(seed, global_seed):
        seen = []

        def loss_fn(out, t):
            if not seen or seen[-1] != t.tolist():
                seen.append(t.tolist())
            return nn.functional.mse_loss(out.squeeze(-1), t)

        torch.manual_seed(global_seed)
        train(nn.Linear(2, 1), loss_fn, (x, y), steps=3, seed=seed, batch_size=4, progress=False, use_evaluator=False)
        return seen

    assert batches_seen(None, 5) == batches_seen(None, 5) != batches_seen(None, 6)
    assert batches_seen(7, 5) == batches_seen(7, 6)


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


@pytest.mark.parametrize("budget", [3, 50, 401])
@pytest.mark.parametrize("options", [
    dict(radii=0.1),
    dict(radii=0.1, chunk_size=3, radius_model="quadratic", trust_region=True, blocks="all", block_dim=2),
    dict(radii=(0.05, 0.2), polytope="simplex", momentum=0.5),
])
def test_train_never_scores_more_than_max_evaluations(budget, options):
    model, mse, x, y = problem()
    calls = []
    loss_fn = lambda out, t: calls.append(None) or mse(out, t)  # noqa: E731  # the closure fallback: one call per candidate
    opt = PolytopeOptimizer(model.parameters(), seed=0, **options)
    history = train(model, loss_fn, (x, y), optimizer=opt, max_evaluations=budget, progress=False, use_evaluator=False)
    scored = len(calls) - len(history)  # train() also scores the incumbent once per step, uncharged, for the history
    assert scored == opt.evaluations <= budget
    assert budget - opt.evaluations < 2 * len(opt.radius_ratios) + 2
    assert not history.evaluations or history.evaluations[-1] == opt.evaluations


def test_train_default_budget_holds_with_minibatches():
    model, loss_fn, x, y = problem(4)
    for budget in (10, 999):
        history = train(model, loss_fn, (x, y), max_evaluations=budget, batch_size=16, seed=0, progress=False)
        assert history.evaluations[-1] <= budget and budget - history.evaluations[-1] < 4


@pytest.mark.parametrize("data, error, match", [
    ([], ValueError, "empty"),
    ((), ValueError, "empty"),
    ((torch.zeros(0, 3), torch.zeros(0)), ValueError, "empty"),
    ("batches", TypeError, "pair"),
    (torch.zeros(4, 3), TypeError, "pair"),
    ([(torch.zeros(4, 3), torch.zeros(4), torch.zeros(4))], TypeError, "length 3"),
    ((torch.zeros(4, 3), torch.zeros(4), torch.zeros(4)), TypeError, "length 3"),
    ([torch.zeros(4, 3)], TypeError, "pair"),
    ((torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4)), TypeError, "float64"),
])
def test_train_rejects_data_it_cannot_use_with_a_message_naming_the_forms(data, error, match):
    model, loss_fn, _, _ = problem()
    with pytest.raises(error, match=match):
        train(model, loss_fn, data, steps=2, progress=False)


def test_train_rejects_numpy_data_and_empty_dataloaders():
    np = pytest.importorskip("numpy")
    model, loss_fn, x, y = problem()
    with pytest.raises(TypeError, match="torch.as_tensor"):
        train(model, loss_fn, (x.numpy(), y.numpy()), steps=2, progress=False)
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:0], y[:0]), batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        train(model, loss_fn, empty, steps=2, progress=False)
    assert np is not None


def test_train_accepts_a_dataloader():
    model, loss_fn, x, y = problem(5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    history = train(model, loss_fn, loader, steps=5, seed=0, progress=False, radii=0.1)
    assert len(history) == 5


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_train_leaves_no_evaluator_registered(interrupt):
    model, loss_fn, x, y = problem()
    opt = PolytopeOptimizer(model.parameters(), radii=0.1, seed=0, trust_region=False, radius_model=None)

    def stop(step, optimizer, history):
        raise interrupt("stop")

    with pytest.raises(interrupt):
        train(model, loss_fn, (x, y), optimizer=opt, steps=5, progress=False, callback=stop)
    calls = []
    opt.step(lambda c: calls.append(c.shape[0]) or c.square().sum(1))
    assert calls == [8]  # the closure scored the step, not the stale evaluator


def test_train_validates_every_option():
    model, loss_fn, x, y = problem()
    for kwargs, error, match in [
        (dict(steps=2.0), TypeError, "steps"), (dict(steps=True), TypeError, "steps"),
        (dict(max_evaluations="100"), TypeError, "max_evaluations"), (dict(max_evaluations=-5), ValueError, "max_evaluations"),
        (dict(steps=2, seed=1.5), TypeError, "seed"), (dict(steps=2, seed="a"), TypeError, "seed"),
        (dict(steps=2, batch_size=0), ValueError, "batch_size"), (dict(steps=2, progress="no"), TypeError, "progress"),
        (dict(steps=2, use_evaluator=1), TypeError, "use_evaluator"), (dict(steps=2, callback=3), TypeError, "callback"),
        (dict(steps=2, temperature=[0.1, 0.2]), TypeError, "temperature"), (dict(steps=2, momentum="0.5"), TypeError, "momentum"),
        (dict(steps=2, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), TypeError, "PolytopeOptimizer"),
        (dict(steps=2, optimizer=PolytopeOptimizer([torch.nn.Parameter(torch.ones(2))])), ValueError, "model.parameters"),
    ]:
        with pytest.raises(error, match=match):
            train(model, loss_fn, (x, y), progress=False, **kwargs)
    with pytest.raises(TypeError, match="loss_fn"):
        train(model, "mse", (x, y), steps=2, progress=False)


def test_train_warns_when_no_step_is_accepted_for_long():
    model, loss_fn, x, y = problem()
    noisy = lambda out, t: loss_fn(out, t) + 1e3 * torch.rand(())  # noqa: E731  # noise swamps the probes
    with pytest.warns(RuntimeWarning, match="no step was accepted"):
        train(model, noisy, (x, y), steps=80, seed=0, progress=False, use_evaluator=False, radii=1e-6,
              radius_model="quadratic", trust_region=True)


def _reference_closure(model, loss_fn, x, y, params):
    """Candidates in the order of ``params`` (the optimizer's), scored on a copy of the model: written
    independently of flat_closure and the evaluator's ParameterLayout."""
    import copy

    def closure(candidates):
        losses = []
        for row in candidates:
            twin = copy.deepcopy(model)
            twins = dict(zip(map(id, model.parameters()), twin.parameters()))
            torch.nn.utils.vector_to_parameters(row, [twins[id(p)] for p in params])
            with torch.no_grad():
                losses.append(loss_fn(twin(x), y))
        return torch.stack(losses)

    return closure


@pytest.mark.parametrize("route", ["evaluator", "flat_closure", "train"])
def test_groups_in_another_order_and_frozen_tensors_score_the_optimizers_own_coordinates(route):
    """An optimizer's coordinates follow its own parameter list: groups in another order than the model's, or
    only the trainable tensors. Every scoring route must read them that way (they read model order before)."""
    from polytope import NNCostEvaluator, flat_closure

    finals = []
    for reference in (True, False):
        torch.manual_seed(4)
        x, y = torch.randn(24, 3, dtype=torch.float64), torch.randn(24, 2, dtype=torch.float64)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        model[2].requires_grad_(False)
        frozen = model[2].weight.detach().clone()
        loss_fn = nn.functional.mse_loss
        head, body = list(model[4].parameters()), list(model[0].parameters())
        params = head + body  # the optimizer's order: not the model's, and without the frozen layer
        opt = PolytopeOptimizer([{"params": head}, {"params": body, "radius": 0.05}], seed=0, radii=0.1)
        if reference:
            for _ in range(4):
                opt.step(_reference_closure(model, loss_fn, x, y, params))
        elif route == "evaluator":
            opt.register_evaluator(NNCostEvaluator(model, loss_fn), x, y)
            for _ in range(4):
                opt.step()
        elif route == "flat_closure":
            for _ in range(4):
                opt.step(flat_closure(model, loss_fn, x, y, params=params))
        else:
            train(model, loss_fn, (x, y), optimizer=opt, steps=4, progress=False)
        assert torch.equal(model[2].weight, frozen)
        finals.append(opt.incumbent.clone())
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-12, atol=1e-12)


def test_train_leaves_frozen_tensors_alone_and_a_model_with_none_trainable_trains_them_all():
    model, loss_fn, x, y = problem()
    model = nn.Sequential(nn.Linear(3, 3), model[0])
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    train(model, loss_fn, (x, y), steps=3, seed=0, progress=False, radii=0.1)
    assert torch.equal(model[0].weight, frozen) and not torch.equal(model[1].weight, torch.zeros(1))
    model.requires_grad_(False)  # derivative-free users often switch autograd off altogether
    train(model, loss_fn, (x, y), steps=3, seed=0, progress=False, radii=0.1)
    assert not torch.equal(model[0].weight, frozen)
    with pytest.raises(ValueError, match=r"params\[0\] .* is not a parameter of the model"):
        train(model, loss_fn, (x, y), optimizer=PolytopeOptimizer([nn.Parameter(torch.zeros(2))]), steps=1,
              progress=False)


def test_a_layer_used_twice_is_scored_right_and_left_as_it_was():
    """torch.func.functional_call restores a module reachable under two names once, leaving a candidate's tensor
    (or an escaped vmap tensor) in the model; every route must leave the model's Parameters in place."""
    from polytope import NNCostEvaluator, flat_closure

    torch.manual_seed(5)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    base = torch.cat([p.detach().reshape(-1) for p in params])
    candidates = base + 0.3 * torch.randn(3, base.numel(), dtype=torch.float64)
    expected = _reference_closure(model, nn.functional.mse_loss, x, y, params)(candidates)
    for score in (NNCostEvaluator(model, nn.functional.mse_loss).evaluate,
                  lambda c, a, b: flat_closure(model, nn.functional.mse_loss, a, b)(c)):
        torch.testing.assert_close(score(candidates, x, y), expected)
        assert all(p is q and torch.equal(p, b) for p, q, b in zip(model.parameters(), params, before))
    train(model, nn.functional.mse_loss, (x, y), steps=2, seed=0, progress=False, radii=0.1)
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_parameters_never_alias_the_optimizer_state_and_any_strides_work():
    weight = nn.Parameter(torch.randn(4, 3).t())  # not contiguous
    empty = nn.Parameter(torch.zeros(0))
    opt = PolytopeOptimizer([weight, empty], blocks="tensor", seed=0, radii=0.1)
    opt.step(lambda c: (c**2).sum(1))
    assert not weight.is_contiguous() and torch.equal(weight.detach().reshape(-1), opt.incumbent)
    with torch.no_grad():
        weight.mul_(0)  # the user's own in-place edit
    assert opt.incumbent.abs().sum() > 0
