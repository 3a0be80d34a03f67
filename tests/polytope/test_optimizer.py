import pytest
import torch

from polytope import CandidateBatch, PolytopeOptimizer
from polytope.geometry import random_basis


def quadratic(n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, 1.5, n, dtype=torch.float64)) @ q.T
    return lambda x: 0.5 * ((x @ a) * x).sum(-1)


# The pre-defaults configuration: per-tensor full-dimensional frames, plain moves, fixed temperature.
# Tests of one mechanism use it so that the defaults' controllers do not blur what they check.
PLAIN = dict(blocks="tensor", block_dim=64, rotation="random", radius_model=None, trust_region=False, momentum=0.0,
             temperature=0.5)


def params(n=12, shapes=None):
    if shapes is None:
        return [torch.nn.Parameter(torch.ones(n, dtype=torch.float64))]
    return [torch.nn.Parameter(torch.ones(s, dtype=torch.float64)) for s in shapes]


class Recorder:
    """Closure that records every call's candidate shape."""

    def __init__(self, f):
        self.f, self.shapes = f, []

    def __call__(self, candidates, subset=None):
        self.shapes.append(tuple(candidates.shape))
        return self.f(candidates)


class FakeEvaluator:
    """Materializes the structured batch and calls a function: what evaluators must agree with."""

    def __init__(self, f):
        self.f, self.batches = f, []

    def evaluate_batch(self, batch, inputs, targets):
        assert isinstance(batch, CandidateBatch)
        self.batches.append(batch)
        return self.f(batch.materialize())


class RandomSubspace:
    """A fixed random orthonormal map from ``dim`` coordinates to the flat parameters."""

    def __init__(self, n, dim, seed=0):
        self.dim = dim
        self.basis = random_basis(n, dim, torch.Generator().manual_seed(seed))

    def to_flat(self, z):
        return z.to(self.basis.dtype) @ self.basis.T


@pytest.mark.parametrize("polytope, per_block", [("orthoplex", lambda d: 2 * d), ("simplex", lambda d: d + 1)])
def test_closure_gets_flat_candidates_counting_blocks_vertices_radii(polytope, per_block):
    shapes = [(2, 3), (3,), (4,)]
    rec = Recorder(lambda x: x.square().sum(1))
    opt = PolytopeOptimizer(params(shapes=shapes), polytope=polytope, radii=(0.1, 0.2), seed=0, **PLAIN)
    opt.step(rec)
    assert rec.shapes == [(sum(per_block(d) for d in (6, 3, 4)) * 2, 13)]
    rec.shapes.clear()
    opt = PolytopeOptimizer(params(shapes=shapes), polytope=polytope, radii=(0.1, 0.2), chunk_size=7, seed=0, **PLAIN)
    opt.step(rec)
    assert all(c <= 7 for c, _ in rec.shapes) and sum(c for c, _ in rec.shapes) == sum(per_block(d) for d in (6, 3, 4)) * 2


def test_each_chunk_is_one_candidate_batch_and_evaluator_matches_closure():
    f = quadratic()
    evaluator = FakeEvaluator(f)
    a = PolytopeOptimizer(params(), blocks=4, radii=0.1, chunk_size=10, trust_region=True, seed=3)
    b = PolytopeOptimizer(params(), blocks=4, radii=0.1, chunk_size=10, trust_region=True, seed=3)
    b.register_evaluator(evaluator, torch.zeros(1), torch.zeros(1))
    for _ in range(4):
        a.step(f)
        b.step()
    assert torch.equal(a.incumbent, b.incumbent)
    probe_batches = [batch for batch in evaluator.batches if batch.count > 1]
    assert all(batch.count <= 10 for batch in probe_batches)
    assert all(len({id(g.index) for g in batch.groups}) >= 1 for batch in probe_batches)


def test_same_seed_same_trajectory_and_different_seed_differs():
    f = quadratic()
    runs = []
    for seed in (5, 5, 6):
        p = params()
        opt = PolytopeOptimizer(p, radii=0.1, momentum=0.5, seed=seed)
        for _ in range(5):
            opt.step(f)
        runs.append(p[0].detach().clone())
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("options", [
    dict(),
    dict(solver="sinkhorn", momentum=0.7, rotation="last_step", block_dim=3, blocks=5),
    dict(radius_model="quadratic", trust_region=True, adaptive_probes=True, radii=(0.05, 0.2)),
    dict(amortize_steps=2, momentum=0.5, polytope="simplex"),
])
def test_state_dict_round_trip_continues_bit_for_bit(options):
    f = quadratic()
    p = params()
    opt = PolytopeOptimizer(p, seed=1, **{"radii": 0.1, **options})
    for _ in range(3):
        opt.step(f, objective_token=0)
    saved = opt.state_dict()
    for _ in range(3):
        opt.step(f, objective_token=0)
    expected = p[0].detach().clone()
    q = params()
    other = PolytopeOptimizer(q, seed=99, **{"radii": 0.1, **options})
    other.load_state_dict(saved)
    assert torch.equal(q[0].detach(), saved["x"])
    for _ in range(3):
        other.step(f, objective_token=0)
    assert torch.equal(q[0].detach(), expected)
    assert other.evaluations == opt.evaluations


def test_load_state_dict_rejects_another_layout():
    saved = PolytopeOptimizer(params(), seed=0).state_dict()
    with pytest.raises(ValueError, match="layout"):
        PolytopeOptimizer(params(), blocks=3, seed=0).load_state_dict(saved)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(polytope="cube"), ValueError, "polytope"),
    (dict(radii=()), ValueError, "radii"),
    (dict(radii=(0.1, -1.0)), ValueError, "radii"),
    (dict(radii="big"), ValueError, "radii"),
    (dict(blocks="rows"), ValueError, "blocks"),
    (dict(blocks=0), ValueError, "blocks"),
    (dict(blocks=[5, 5]), ValueError, "blocks"),
    (dict(block_dim=0), ValueError, "block_dim"),
    (dict(blocks=True), ValueError, "blocks"),
    (dict(solver="exact"), ValueError, "solver"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=[0.1, 0.2]), TypeError, "temperature"),
    (dict(momentum="0.5"), TypeError, "momentum"),
    (dict(momentum=float("nan")), ValueError, "momentum"),
    (dict(seed="a"), TypeError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(lr=True), TypeError, "lr"),
    (dict(chunk_size=True), TypeError, "chunk_size"),
    (dict(chunk_size=2.0), TypeError, "chunk_size"),
    (dict(block_dim="4"), TypeError, "block_dim"),
    (dict(max_evaluations=0), ValueError, "max_evaluations"),
    (dict(candidate_autocast=torch.int8), ValueError, "candidate_autocast"),
    (dict(sinkhorn_max_iter=10.0), TypeError, "sinkhorn_max_iter"),
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(momentum=1.0), ValueError, "momentum"),
    (dict(sinkhorn_relaxation=0.0), ValueError, "sinkhorn_relaxation"),
    (dict(sinkhorn_max_iter=0), ValueError, "sinkhorn_max_iter"),
    (dict(rotation="sometimes"), ValueError, "rotation"),
    (dict(radius_model="cubic"), ValueError, "radius_model"),
    (dict(trust_region="yes"), TypeError, "trust_region"),
    (dict(trust_region={"shrink": 2.0}), ValueError, "trust_region"),
    (dict(trust_region={"size": 2.0}), ValueError, "trust_region"),
    (dict(adaptive_probes=1), TypeError, "adaptive_probes"),
    (dict(amortize_steps=0), ValueError, "amortize_steps"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(use_inplace="no"), TypeError, "use_inplace"),
    (dict(compile=1), TypeError, "compile"),
    (dict(compile_evaluator=None), TypeError, "compile_evaluator"),
    (dict(compile_forward="auto"), TypeError, "compile_forward"),
    (dict(candidate_autocast="fp8"), ValueError, "candidate_autocast"),
    (dict(candidate_autocast=16), TypeError, "candidate_autocast"),
    (dict(candidate_autocast=False), TypeError, "candidate_autocast"),
    (dict(subspace=object()), TypeError, "subspace"),
    (dict(step_schedule=3), TypeError, "step_schedule"),
    (dict(temperature_schedule="cos"), TypeError, "temperature_schedule"),
    (dict(multifidelity_screen=[1]), TypeError, "multifidelity_screen"),
    (dict(multifidelity_screen={"screen_fidelity": 8}), ValueError, "missing"),
    (dict(multifidelity_screen={"screen_fidelity": 8, "num_probe": 16, "screen_keep_ratio": 0.6}), ValueError, "< 1"),
    (dict(multifidelity_screen={"screen_fidelity": 32, "num_probe": 16, "screen_keep_ratio": 0.2}), ValueError,
     "screen_fidelity"),
    (dict(multifidelity_screen={"screen_fidelity": 2, "num_probe": 16, "screen_keep_ratio": 1.5}), ValueError,
     "screen_keep_ratio"),
    (dict(multifidelity_screen={"screen_fidelity": 2, "num_probe": 16, "screen_keep_ratio": 0.5}, radius_model="quadratic"),
     ValueError, "quadratic"),
])
def test_every_option_is_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        PolytopeOptimizer(params(), **kwargs)


def test_integer_parameters_are_rejected_at_construction():
    with pytest.raises(TypeError, match="params must be floating-point tensors, got one of dtype torch.int64"):
        PolytopeOptimizer([torch.zeros(3), torch.zeros(2, dtype=torch.long)])


def test_step_without_objective_and_wrong_loss_count_are_errors():
    opt = PolytopeOptimizer(params(), seed=0)
    with pytest.raises(ValueError, match="closure"):
        opt.step()
    with pytest.raises(ValueError, match="losses"):
        opt.step(lambda x: torch.zeros(3))


def test_optimizer_decreases_a_quadratic_with_every_solver_and_controller():
    f = quadratic()
    start = float(f(torch.ones(1, 12, dtype=torch.float64)))
    for options in (dict(), dict(solver="sinkhorn"), dict(solver="argmin"), dict(polytope="simplex"),
                    dict(radius_model="quadratic", trust_region=True), dict(momentum=0.5, rotation="last_step", block_dim=4)):
        p = params()
        opt = PolytopeOptimizer(p, radii=0.1, seed=0, **options)
        for _ in range(30):
            opt.step(f, objective_token=0)
        # one block: Sinkhorn's column penalty pulls the plan toward uniform, so it moves less
        factor = 0.8 if options.get("solver") == "sinkhorn" else 0.5
        assert float(f(p[0].detach()[None])) < factor * start, options


def test_subspace_search_moves_only_inside_the_subspace():
    f = quadratic()
    sub = RandomSubspace(12, 4)
    evaluator = FakeEvaluator(f)
    p = params()
    opt = PolytopeOptimizer(p, subspace=sub, blocks="all", radii=0.1, seed=0)
    opt.register_evaluator(evaluator, None, None)
    for _ in range(10):
        opt.step()
    batch = evaluator.batches[-1]
    assert batch.subspace is sub and batch.count == 8 and int(batch.groups[0].index.max()) == 3
    moved = p[0].detach() - 1.0
    assert float((moved - sub.basis @ (sub.basis.T @ moved)).norm()) < 1e-12
    assert float(f(p[0].detach()[None])) < float(f(torch.ones(1, 12, dtype=torch.float64)))
    with pytest.raises(ValueError, match="block_sizes"):
        PolytopeOptimizer(params(), subspace=sub, blocks="tensor")


def test_momentum_survives_rotation_like_flat_heavy_ball():
    """Full-dimensional blocks: Procrustes-carried velocity equals the flat velocity exactly."""
    f = quadratic()
    p = params()
    opt = PolytopeOptimizer(p, radii=0.1, seed=2, **{**PLAIN, "momentum": 0.6})
    velocity = torch.zeros(12, dtype=torch.float64)
    previous = p[0].detach().clone()
    for _ in range(5):
        opt.step(f)
        step = p[0].detach() - previous
        move = step - 0.6 * velocity
        velocity = step
        previous = p[0].detach().clone()
        assert float(move.norm()) <= 0.1 * 1.0 + 1e-12  # the OT move itself stays inside the probe radius
    assert float((opt.probes.bases[0] @ opt.momentum_state.velocity[0] - velocity).norm()) < 1e-12


def test_trust_region_rejects_a_bad_move_on_the_same_batch_and_shrinks():
    f = quadratic()
    p = params()
    opt = PolytopeOptimizer(p, radii=0.1, radius_model="quadratic", trust_region=True, adaptive_probes=True, seed=0)
    opt.step(f, objective_token="a")
    before = opt._trust_radius
    worse = lambda x: f(x) + 1e3 * (x - 1.0).square().sum(-1)  # noqa: E731  # the new objective punishes the move
    rec = Recorder(worse)
    opt.step(rec, objective_token="b")
    assert opt.last_info["accepted"] is False and opt._trust_radius < before
    assert rec.shapes[:2] == [(1, 12), (1, 12)]  # both incumbents scored on the new objective
    assert not opt.last_info["reused_probes"]  # the objective changed: no reuse


def test_adaptive_probes_reuse_losses_after_rejection_on_an_unchanged_objective():
    f = quadratic()
    p = params()
    opt = PolytopeOptimizer(p, radii=0.5, lr=8.0, radius_model="quadratic", trust_region={"initial": 64.0, "maximum": 64.0},
                            adaptive_probes=True, seed=0)
    steep = lambda x: f(x) + (x - 1.0).abs().sum(-1) ** 3  # noqa: E731
    for _ in range(6):
        rec = Recorder(steep)
        opt.step(rec, objective_token=0)
        if opt.last_info.get("accepted") is False:
            assert opt.last_info["reused_probes"] and rec.shapes == [(1, 12)]
            return
    pytest.fail("no step was rejected")


def test_amortized_steps_do_not_evaluate():
    f = quadratic()
    rec = Recorder(f)
    opt = PolytopeOptimizer(params(), radii=0.1, amortize_steps=3, seed=0, **{**PLAIN, "momentum": 0.5})
    for _ in range(6):
        opt.step(rec)
    assert len(rec.shapes) == 2 and opt.evaluations == 48


def test_multifidelity_screen_is_unbiased_and_charged_fractionally():
    torch.manual_seed(0)
    full = torch.randn(40, dtype=torch.float64)
    screen = full + 0.3 * torch.randn(40, dtype=torch.float64)
    from polytope.controllers import MultifidelityScreen

    s = MultifidelityScreen(screen_fidelity=4, num_probe=32, screen_keep_ratio=0.3)
    probs = s.keep_probabilities(screen)
    assert probs.sum().item() == pytest.approx(0.3 * 40) and probs.min() >= 0.05 - 1e-12 and probs.max() <= 1.0
    draws = torch.rand(20000, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64) < probs
    estimates = s.combine(screen.expand(20000, -1), full.expand(20000, -1), draws, probs).mean(0)
    assert torch.allclose(estimates, full, atol=0.05)

    data = torch.randn(32, 12, dtype=torch.float64)
    calls = []

    def closure(x, subset=None):
        calls.append(None if subset is None else len(subset))
        rows = data if subset is None else data[subset]
        return ((x[:, None, :] - rows) ** 2).sum(-1).mean(1)

    screen = dict(screen_fidelity=4, num_probe=32, screen_keep_ratio=0.3)
    opt = PolytopeOptimizer(params(), radii=0.1, multifidelity_screen=screen, seed=0, **PLAIN)
    opt.step(closure)
    assert calls[0] == 4 and calls[1] is None
    assert opt.evaluations == pytest.approx(24 * 4 / 32 + opt.last_info["screen_kept"])


def test_resync_adopts_external_weight_changes():
    f = quadratic()
    p = params()
    opt = PolytopeOptimizer(p, radii=0.1, trust_region=True, seed=0)
    opt.step(f, objective_token=0)
    with torch.no_grad():
        p[0].fill_(2.0)
    opt.resync_from_model()
    assert torch.equal(opt.incumbent, torch.full((12,), 2.0, dtype=torch.float64))
    rec = Recorder(f)
    opt.step(rec, objective_token=0)
    assert rec.shapes[0] == (1, 12)  # only the new incumbent: no stale comparison
    assert float((p[0].detach() - 2.0).abs().max()) <= 0.1 * 2 + 1e-12


class Counter:
    """Closure that counts the candidates it actually scored (not trusting the optimizer's counter)."""

    def __init__(self, f):
        self.f, self.scored = f, 0

    def __call__(self, candidates, subset=None):
        self.scored += candidates.shape[0]
        return self.f(candidates)


BUDGET_OPTIONS = [
    dict(),
    dict(radius_model="quadratic", trust_region=True, rotation="last_step", momentum=0.5, blocks="all", block_dim=3),
    dict(polytope="simplex", radii=(0.05, 0.2), blocks=5),
    dict(adaptive_probes=True, radius_model="quadratic", trust_region=True, radii=(0.05, 0.2)),
]


@pytest.mark.parametrize("options", BUDGET_OPTIONS)
@pytest.mark.parametrize("budget", [1, 5, 37, 200])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_optimizer_budget_is_a_hard_cap_and_the_last_step_uses_what_is_left(options, budget, chunk_size):
    f = Counter(quadratic())
    opt = PolytopeOptimizer(params(shapes=[(3, 3), (3,)]), seed=0, chunk_size=chunk_size, max_evaluations=budget,
                            **{"radii": 0.1, **options})
    results = [opt.step(f, objective_token=0) for _ in range(300)]
    assert f.scored == opt.candidates_scored == opt.evaluations <= budget
    smallest = 2 * len(opt.radius_ratios) + 2  # one probe pair per radius, two incumbents
    assert budget - opt.evaluations < smallest
    assert results[-1] is None and opt.last_info["exhausted"]


def test_per_step_cap_shrinks_the_step_to_a_subset_of_blocks_or_axes():
    f = Counter(quadratic())
    opt = PolytopeOptimizer(params(shapes=[(3, 3), (3,)]), radii=0.1, seed=0, **PLAIN)
    opt.step(f, max_evaluations=10)  # full step: 18 + 6 probes
    assert f.scored == 6 and opt.last_info["probed_blocks"] == 1  # the 3-vector block alone fits
    opt.step(f, max_evaluations=5)
    assert f.scored == 10  # two axes of one block
    assert opt.step(f, max_evaluations=1) is None and f.scored == 10


def test_multifidelity_screen_keeps_its_budget():
    data = torch.randn(32, 12, dtype=torch.float64)

    def closure(x, subset=None):
        rows = data if subset is None else data[subset]
        return ((x[:, None, :] - rows) ** 2).sum(-1).mean(1)

    screen = dict(screen_fidelity=4, num_probe=32, screen_keep_ratio=0.3)
    for budget in (3, 17, 100):
        opt = PolytopeOptimizer(params(), radii=0.1, multifidelity_screen=screen, max_evaluations=budget, seed=0,
                                radius_model=None)
        for _ in range(40):
            opt.step(closure)
        assert opt.evaluations <= budget + 1e-9


def test_lr_and_radius_live_in_param_groups_and_lr_schedulers_change_the_step():
    from polytope import ProbeRadius

    f = quadratic()
    moves = []
    for factor in (1.0, 0.5):
        p = params()
        opt = PolytopeOptimizer(p, radii=0.1, seed=0, **PLAIN)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step, factor=factor: factor)  # sets lr = factor * initial lr at once
        opt.step(f)
        moves.append(p[0].detach() - 1.0)
    assert torch.allclose(moves[1], 0.5 * moves[0], rtol=1e-12, atol=0)

    rec = Recorder(f)
    opt = PolytopeOptimizer(params(), radii=0.1, seed=0, **PLAIN)
    radius = torch.optim.lr_scheduler.StepLR(ProbeRadius(opt), step_size=1, gamma=0.5)
    for _ in range(2):
        rec.shapes.clear()
        spread = []

        def measured(x, spread=spread):
            spread.append(float((x - opt.incumbent).norm(dim=1).max()))
            return f(x)

        opt.step(measured)
        radius.step()
    assert opt.param_groups[0]["radius"] == pytest.approx(0.025) and spread[0] == pytest.approx(0.05)


def test_param_groups_get_their_own_radius_and_blocks_stay_inside_groups():
    a, b = torch.nn.Parameter(torch.ones(4, dtype=torch.float64)), torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    seen = []
    opt = PolytopeOptimizer([{"params": [a]}, {"params": [b], "radius": 0.5}], radii=0.1, seed=0, **{**PLAIN, "blocks": "all"})
    opt.step(lambda x: seen.append(x.clone()) or x.square().sum(1))
    change = seen[0] - 1.0
    assert [int(i.numel()) for i in opt.blocks] == [4, 3]
    assert torch.allclose(change[:8, :4].norm(dim=1), torch.full((8,), 0.1, dtype=torch.float64))
    assert torch.allclose(change[8:, 4:].norm(dim=1), torch.full((6,), 0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="radius"):
        PolytopeOptimizer([{"params": [a], "radius": -1.0}])
    with pytest.raises(ValueError, match="cut across"):
        PolytopeOptimizer([{"params": [a]}, {"params": [b]}], blocks=[2, 5])


def test_load_state_dict_names_a_missing_key():
    saved = PolytopeOptimizer(params(), seed=0).state_dict()
    del saved["velocity"]
    with pytest.raises(KeyError, match="velocity"):
        PolytopeOptimizer(params(), seed=0).load_state_dict(saved)


def test_automatic_radius_follows_the_parameter_scale_and_frames_follow_the_budget():
    from polytope.defaults import FRAME_DIM, MIN_STEPS, frame_dims, initial_radius

    assert initial_radius([torch.randn(100, dtype=torch.float64)]) == pytest.approx(0.05)
    assert initial_radius([1e-4 * torch.randn(100, dtype=torch.float64)]) < 2e-4  # small weights: within their spread
    assert initial_radius([1e4 * torch.randn(100, dtype=torch.float64)]) > 50.0
    assert initial_radius([torch.zeros(10)]) == pytest.approx(0.05)  # all zeros: spread 1
    count = lambda d: 2 * d  # noqa: E731
    assert frame_dims([1000], count, None) == [FRAME_DIM] and frame_dims([3, 1000], count, None) == [3, FRAME_DIM]
    for budget in (100, 500, 2000):
        (dim,) = frame_dims([1000], count, budget)
        assert dim == FRAME_DIM or budget / (2 * (dim + 1) + 2) < MIN_STEPS  # the largest frame that pays for MIN_STEPS
        assert dim == 1 or budget / (2 * dim + 2) >= MIN_STEPS
    assert frame_dims([1000], count, 10) == [1]


def test_defaults_solve_a_conditioned_quadratic_at_a_small_budget():
    """The harness's 20-D quadratic (condition 100) at 2,000 evaluations: sep-CMA-ES reaches ~0.1, the defaults far below."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, 2, 20, dtype=torch.float64)) @ q.T
    f = lambda x: 0.5 * ((x @ a) * x).sum(-1)  # noqa: E731
    p = [torch.nn.Parameter(torch.randn(20, generator=gen, dtype=torch.float64))]
    start = float(f(p[0].detach()[None]))
    opt = PolytopeOptimizer(p, seed=0, max_evaluations=2000)
    while opt.step(f, objective_token=0) is not None or not opt.last_info.get("exhausted"):
        pass
    assert opt.evaluations <= 2000 and float(f(p[0].detach()[None])) < 1e-3 * start


def test_a_copied_optimizer_steps_on_as_the_original():
    """torch.optim's pickling keeps defaults, state and groups only: a deepcopy / pickle / torch.save copy of a
    PolytopeOptimizer lost its incumbent and configuration, and its step() raised AttributeError."""
    import copy
    import io
    import pickle

    f = quadratic()
    x = torch.nn.Parameter(torch.ones(12, dtype=torch.float64))
    opt = PolytopeOptimizer([x], seed=0)
    opt.step(lambda c: f(c))

    def saved(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)

    copies = [copy.deepcopy((x, opt)), pickle.loads(pickle.dumps((x, opt))), saved((x, opt))]
    for _ in range(3):
        opt.step(lambda c: f(c))
    for x_copy, opt_copy in copies:
        for _ in range(3):
            opt_copy.step(lambda c: f(c))
        assert torch.equal(x_copy, x) and opt_copy.evaluations == opt.evaluations
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
