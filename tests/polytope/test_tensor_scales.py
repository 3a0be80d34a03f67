"""``tensor_scales`` (default True): one scale per parameter tensor inside a block, from the tensors' initial spreads
steered toward equal curvature."""
import math

import pytest
import torch

from polytope import PolytopeConfig, PolytopeOptimizer
from polytope.geometry import random_basis
from polytope.probes import tensor_segments


def _stiff_and_flat(sizes=(6, 4), curvatures=(1.0, 100.0)):
    """A separable quadratic whose second tensor is 100x stiffer: Jacobi scales differ by sqrt(100) = 10."""
    h = torch.cat([torch.full((n,), c, dtype=torch.float64) for n, c in zip(sizes, curvatures)])
    return lambda x: 0.5 * (h * x * x).sum(-1)


def _params(sizes=(6, 4)):
    return [torch.nn.Parameter(torch.ones(n, dtype=torch.float64)) for n in sizes]


def test_segments_are_the_blocks_pieces_of_each_tensor():
    blocks = [torch.arange(0, 7), torch.arange(7, 10), torch.arange(10, 12)]
    assert tensor_segments(blocks, [5, 4, 3]) == [[5, 2], [2, 1], [2]]
    assert tensor_segments([torch.arange(0, 12)], [12]) == [[12]]


def test_support_confines_a_column_up_to_its_orthogonalisation():
    """The masked column is drawn on its support; QR then removes its part along the columns before it (about d / n)."""
    support = torch.ones(400, 4, dtype=torch.float64)
    support[:300, 3] = 0.0
    q = random_basis(400, 4, torch.Generator().manual_seed(0), support=support)
    assert torch.allclose(q.T @ q, torch.eye(4, dtype=torch.float64), atol=1e-12)
    assert float(q[300:, 3].square().sum()) > 0.95
    assert float(q[300:, 0].square().sum()) < 0.5  # an unmasked column spreads over all coordinates


def test_a_single_tensor_is_untouched():
    """One segment per block: the same generator draws and the same trajectory as the defaults, bit for bit."""
    f = _stiff_and_flat((10,), (3.0,))
    runs = []
    for options in ({"tensor_scales": False}, {}):
        p = _params((10,))
        opt = PolytopeOptimizer(p, seed=4, **options)
        for _ in range(6):
            opt.step(f, objective_token=0)
        runs.append(p[0].detach().clone())
        assert "segment_scales" not in opt.state_dict()
    assert torch.equal(runs[0], runs[1])


def test_scales_reach_the_jacobi_ratio_and_candidates_use_them():
    f = _stiff_and_flat()
    p = _params()
    opt = PolytopeOptimizer(p, seed=0)  # the default
    assert opt.probes.scales[0].tolist() == [1.0, 1.0]  # constant tensors: no spread to start from
    seen = []

    def closure(c):
        seen.append(c.detach().clone())
        return f(c)

    for _ in range(150):
        opt.step(closure, objective_token=0)
    flat, stiff = opt.probes.scales[0].tolist()
    assert 5.0 < flat / stiff < 20.0  # sqrt(100) = 10 at rest
    assert abs(6 * math.log(flat) + 4 * math.log(stiff)) < 1e-12  # geometric mean one (in float64, as the scales are)
    probes = [c - c.mean(0) for c in seen[-20:] if c.shape[0] == 2 * opt.dims[0]]  # orthoplex pairs: centred at x
    spread = torch.cat(probes).square()
    ratio = float((spread[:, :6].mean() / spread[:, 6:].mean()).sqrt())
    assert 0.5 < ratio / (flat / stiff) < 2.0  # the candidates are x + r D R v: the stiff tensor probed closer
    assert f(opt.incumbent[None])[0] < 1e-6 * f(torch.ones(1, 10, dtype=torch.float64))[0]


def test_scales_start_at_the_tensors_spreads():
    """Ratios of the initial standard deviations, at a geometric mean of one; a constant tensor at the typical scale."""
    g = torch.Generator().manual_seed(0)
    wide = torch.nn.Parameter(torch.randn(30, generator=g, dtype=torch.float64))
    narrow = torch.nn.Parameter(0.1 * torch.randn(10, generator=g, dtype=torch.float64))
    zeros = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    a, b, c = PolytopeOptimizer([wide, narrow, zeros], seed=0).probes.scales[0].tolist()
    assert a / b == pytest.approx(float(wide.detach().std() / narrow.detach().std()), rel=1e-12)
    assert math.log(c) == pytest.approx((30 * math.log(a) + 10 * math.log(b)) / 40, abs=1e-12)
    assert 30 * math.log(a) + 10 * math.log(b) + 5 * math.log(c) == pytest.approx(0.0, abs=1e-12)
    assert PolytopeOptimizer([wide, narrow], seed=0, tensor_scales=False).probes.metric(0) is None


def test_round_trip_with_tensor_scales_continues_bit_for_bit():
    f = _stiff_and_flat()
    p = _params()
    opt = PolytopeOptimizer(p, seed=1, tensor_scales=True)
    for _ in range(5):
        opt.step(f, objective_token=0)
    saved = opt.state_dict()
    for _ in range(5):
        opt.step(f, objective_token=0)
    q = _params()
    other = PolytopeOptimizer(q, seed=7, tensor_scales=True)
    other.load_state_dict(saved)
    for _ in range(5):
        other.step(f, objective_token=0)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(p, q))


def test_budget_holds_with_tensor_scales():
    calls = []
    f = _stiff_and_flat()
    opt = PolytopeOptimizer(_params(), seed=0, tensor_scales=True, max_evaluations=101)
    while opt.step(lambda c: (calls.append(c.shape[0]), f(c))[1], objective_token=0) is not None \
            or not opt.last_info.get("exhausted"):
        pass
    assert sum(calls) <= 101 and opt.evaluations == sum(calls)


def test_tensor_scales_must_be_a_flag():
    with pytest.raises(TypeError, match="tensor_scales"):
        PolytopeConfig(tensor_scales="yes")
