"""PolytopeConfig and EvaluatorOptions: one validated, frozen home for the settings and one rule per option."""
import dataclasses
import inspect

import pytest
import torch
from torch import nn

from polytope import EvaluatorOptions, NNCostEvaluator, PolytopeConfig, PolytopeOptimizer, train


def params(n=6):
    return [nn.Parameter(torch.linspace(-1.0, 1.0, n, dtype=torch.float64))]


def sphere(c):
    return (c - 0.3).square().sum(1)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    x = torch.randn(16, 3)
    return model, nn.functional.mse_loss, x, x.sum(1, keepdim=True)


@pytest.mark.parametrize("options", [dict(), dict(solver="sinkhorn", radii=(0.05, 0.2), momentum=0.0, trust_region=False)])
def test_config_gives_the_keywords_trajectory(options):
    p, q = params(), params()
    by_keywords = PolytopeOptimizer(p, seed=4, **options)
    by_config = PolytopeOptimizer(q, config=PolytopeConfig(seed=4, **options))
    for _ in range(4):
        assert by_keywords.step(sphere, objective_token=0) == by_config.step(sphere, objective_token=0)
    assert torch.equal(p[0], q[0]) and by_keywords.config == by_config.config


def test_config_is_frozen_and_not_mixed_with_keywords():
    config = PolytopeConfig(radii=0.1)
    assert config.radii == (0.1,) and config.trust_region is not None and PolytopeConfig().radii is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 2.0
    with pytest.raises(TypeError, match=r"not both.*'lr'"):
        PolytopeOptimizer(params(), lr=0.5, config=config)
    with pytest.raises(TypeError, match="config must be a PolytopeConfig"):
        PolytopeOptimizer(params(), config={"lr": 0.5})
    again = dataclasses.replace(config, lr=0.5)  # normalised values validate again
    assert again.lr == 0.5 and again.radii == (0.1,) and again.trust_region == config.trust_region
    with pytest.raises(ValueError, match="lr"):
        dataclasses.replace(config, lr=-1.0)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", torch.bfloat16])
def test_candidate_autocast_has_one_rule_everywhere(spelling):
    model, loss_fn, x, y = mlp()
    assert PolytopeOptimizer(params(), candidate_autocast=spelling).evaluator_options.candidate_autocast is torch.bfloat16
    assert NNCostEvaluator(model, loss_fn, candidate_autocast=spelling).autocast_dtype is torch.bfloat16
    seen = []
    train(model, loss_fn, (x, y), steps=2, seed=0, progress=False, candidate_autocast=spelling,
          callback=lambda step, opt, history: seen.append(opt.evaluator_options.candidate_autocast))
    assert seen == [torch.bfloat16, torch.bfloat16]
    for bad, error in (("fp8", ValueError), (torch.int8, ValueError), (16, TypeError), (False, TypeError)):
        with pytest.raises(error, match="candidate_autocast"):
            PolytopeOptimizer(params(), candidate_autocast=bad)
        with pytest.raises(error, match="candidate_autocast"):
            NNCostEvaluator(model, loss_fn, candidate_autocast=bad)
        with pytest.raises(error, match="candidate_autocast"):
            train(model, loss_fn, (x, y), steps=1, progress=False, candidate_autocast=bad)


def test_evaluator_options_are_checked_by_one_rule():
    model, loss_fn, _, _ = mlp()
    for name, bad, error in (("chunk_size", 0, ValueError), ("chunk_size", True, TypeError), ("use_inplace", 1, TypeError),
                             ("compile_forward", "auto", TypeError), ("sparse_fraction", 0.0, ValueError)):
        with pytest.raises(error, match=name):
            EvaluatorOptions(**{name: bad})
        with pytest.raises(error, match=name):
            NNCostEvaluator(model, loss_fn, **{name: bad})
    assert NNCostEvaluator(model, loss_fn, chunk_size=3).options == EvaluatorOptions(chunk_size=3)


def test_compile_switches_on_the_evaluators_compiled_paths():
    assert PolytopeOptimizer(params()).evaluator_options == EvaluatorOptions()
    on = PolytopeOptimizer(params(), compile=True).evaluator_options
    assert on.compile_evaluator is True and on.compile_forward is True
    kept = PolytopeOptimizer(params(), compile=True, compile_forward=False).evaluator_options
    assert kept.compile_evaluator is True and kept.compile_forward is False


def test_state_keys_are_those_of_earlier_saves():
    """Each component writes its own keys; together they are the keys saves have always had, so those still load."""
    opt = PolytopeOptimizer(params(), seed=0)
    opt.step(sphere, objective_token=0)
    assert set(opt.state_dict()) == {
        "layout", "x", "bases", "velocity", "last_move", "scale", "trust_radius", "potentials", "model", "pending", "record",
        "step_count", "evaluations", "candidates_scored", "generator", "last_info", "groups", "temperature"}


def test_the_optimizers_keywords_are_the_configs_fields_with_the_same_defaults():
    signature = inspect.signature(PolytopeOptimizer.__init__).parameters
    keywords = {name: p.default for name, p in signature.items() if name not in ("self", "params", "config")}
    fields = {f.name: f.default for f in dataclasses.fields(PolytopeConfig) if f.init}
    assert keywords == fields
