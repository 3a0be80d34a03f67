"""What a call does that depends only on the formula is done once: routes and caches, never timings.

A pass nothing differentiates skips the autograd function (but a gradient,
a forward-mode tangent or a torch.func transform still goes through it);
formula building, tile plans and masks are reused from one call to the next
without mixing up what differs.
"""
import pytest
import torch
from torch.autograd import forward_ad

import lazytensor as lt
from lazytensor import autograd, compile, engine, plan, run, variables


def _rbf(x, y):
    return (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()


def _dense_rbf(x, y):
    return torch.exp(-0.5 * ((x[:, None] - y[None]) ** 2).sum(-1))


@pytest.fixture
def applies(monkeypatch):
    """How many passes went through the autograd function."""
    count = []
    apply = autograd.Streamed.apply

    def counted(*args):
        count.append(1)
        return apply(*args)

    monkeypatch.setattr(autograd.Streamed, "apply", counted)
    return count


def test_a_pass_nothing_differentiates_skips_the_autograd_function(applies):
    x, y, b = torch.randn(7, 3), torch.randn(9, 3), torch.randn(9, 2)
    torch.testing.assert_close(_rbf(x, y) @ b, _dense_rbf(x, y) @ b)
    assert not applies
    x.requires_grad_()
    with torch.no_grad():
        _rbf(x, y) @ b
    assert not applies
    out = _rbf(x, y) @ b
    assert len(applies) == 1 and out.requires_grad
    (g,) = torch.autograd.grad(out.sum(), x)
    (expected,) = torch.autograd.grad((_dense_rbf(x, y) @ b).sum(), x)
    torch.testing.assert_close(g, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_mode_dual_tensors_get_their_tangents(applies, dtype):
    """``torch.autograd.forward_ad`` (not a torch.func transform) still reaches the function's jvp."""
    x, y, b, t = (torch.randn(s, dtype=dtype) for s in ((6, 3), (11, 3), (11, 2), (6, 3)))
    with forward_ad.dual_level():
        out = _rbf(forward_ad.make_dual(x, t), y) @ b
        tangent = forward_ad.unpack_dual(out).tangent
        expected = forward_ad.unpack_dual(_dense_rbf(forward_ad.make_dual(x, t), y) @ b).tangent
    assert applies and tangent is not None
    torch.testing.assert_close(tangent, expected)


def test_torch_func_transforms_go_through_the_function(applies):
    x, y, b = torch.randn(5, 3), torch.randn(8, 3), torch.randn(8, 1)
    g = torch.func.grad(lambda x: (_rbf(x, y) @ b).sum())(x)
    expected = torch.func.grad(lambda x: (_dense_rbf(x, y) @ b).sum())(x)
    assert applies
    torch.testing.assert_close(g, expected)


def test_a_formula_built_twice_shares_its_expression_and_keeps_constants_apart():
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    assert _rbf(x, y).expr is _rbf(x, y).expr  # the sympy work is memoised
    as_int, as_float = lt.Vi(x).sqnorm2() + 1, lt.Vi(x).sqnorm2() + 1.0
    assert as_int.expr != as_float.expr  # Integer 1 and Float 1.0 are different keys
    sliced = lt.Vi(x)[0:2]  # a slice option is unhashable (Python 3.11): built without the cache, twice
    assert sliced.expr == lt.Vi(x)[0:2].expr
    torch.testing.assert_close((sliced.sqnorm2() * lt.Vj(torch.ones(3, 1))).sum(1), 3 * (x[:, :2] ** 2).sum(1, keepdim=True))


def test_cached_tile_plans_follow_the_budgets_in_force(monkeypatch):
    x, y = torch.randn(3000, 3), torch.randn(3000, 3)
    expected = (-0.5 * torch.cdist(x, y) ** 2).exp().sum(1, keepdim=True)
    before = dict(engine.routes)
    torch.testing.assert_close(_rbf(x, y).sum(1, backend="eager"), expected)
    problem = _problem(lt.Vi(x).sqdist(lt.Vj(y)))
    first = plan.plan_tiles(problem, [], None, False)
    monkeypatch.setattr(plan, "TILE_BUDGET_BYTES", 4096)
    small = plan.plan_tiles(problem, [], None, False)
    assert small.rows < first.rows
    torch.testing.assert_close(_rbf(x, y).sum(1, backend="eager"), expected)  # many small row blocks, same sums
    assert engine.routes["eager"] == before.get("eager", 0) + 2


def _problem(formula):
    return variables.problem(formula.variables, "j")[0]


def test_unpadded_masks_are_marked_and_padded_ones_are_not():
    full, padded = engine._mask(64, 64, torch.float32, torch.device("cpu"), 2), engine._mask(64, 50, torch.float32,
                                                                                               torch.device("cpu"), 2)
    assert full.unpadded and not padded.unpadded and padded.shape == (1, 1, 64, 1) and padded.sum() == 50
    x, y, b = torch.randn(37, 3), torch.randn(1029, 3), torch.randn(1029, 4)
    exact = (_dense_rbf(x.double(), y.double()) @ b.double()).float()  # float32 dense is itself off by ~3e-5
    for backend in ("eager", "compiled"):  # eager blocks are cut to size; compiled ones padded (and always masked)
        torch.testing.assert_close(_rbf(x, y).matmul(b, backend=backend), exact)


def test_a_repeated_call_reuses_its_objects_and_set_up_but_not_its_values():
    """Reduction objects, pass set-ups and layouts are kept per structure; new values, sizes,
    dtypes and constants still give their own results."""
    x, y, b = torch.randn(20, 3), torch.randn(30, 3), torch.randn(30, 4)
    _rbf(x, y) @ b
    objects, setups, layouts = len(run._OBJECTS), len(engine._SETUPS), len(variables._LAYOUTS)
    for _ in range(3):
        x, y, b = torch.randn(20, 3), torch.randn(30, 3), torch.randn(30, 4)
        torch.testing.assert_close(_rbf(x, y) @ b, _dense_rbf(x, y) @ b)
    assert (len(run._OBJECTS), len(engine._SETUPS), len(variables._LAYOUTS)) == (objects, setups, layouts)
    torch.testing.assert_close(_rbf(x[:7], y[:11]) @ b[:11], _dense_rbf(x[:7], y[:11]) @ b[:11])  # another size

    def rbf(scale, x, y):
        return (-scale * lt.Vi(x).sqdist(lt.Vj(y))).exp()

    rbf(0.3, x, y) @ b  # float32 first, then float64: the constant 0.3 in float64, not rounded to float32
    x, y, b = x.double(), y.double(), b.double()
    exact = torch.exp(-0.3 * ((x[:, None] - y[None]) ** 2).sum(-1)) @ b
    torch.testing.assert_close(rbf(0.3, x, y) @ b, exact, rtol=1e-13, atol=0)
    torch.testing.assert_close(rbf(2.0, x, y) @ b, torch.exp(-2.0 * ((x[:, None] - y[None]) ** 2).sum(-1)) @ b,
                               rtol=1e-13, atol=0)  # another constant: its own value, the same kernel
    with pytest.raises(ValueError, match="k=40 is larger"):  # a failed build is not kept
        lt.Vi(x).sqdist(lt.Vj(y)).argkmin(40, dim=1)
    with pytest.raises(ValueError, match="k=40 is larger"):
        lt.Vi(x).sqdist(lt.Vj(y)).argkmin(40, dim=1)


def test_a_repeated_call_checks_its_variables_again():
    """Layouts are kept only after their checks passed, so a bad call fails every time; number-made
    parameters take each call's dtype."""
    x, y = torch.randn(5, 3), torch.randn(6, 3)
    for _ in range(2):
        (lt.Vi(x) * lt.Vj(y)).sum(1)  # the same shapes, checked and kept
        with pytest.raises(TypeError, match="variable dtypes differ"):
            (lt.Vi(x) * lt.Vj(y.double())).sum(1)
        with pytest.raises(ValueError, match="variable dtypes differ"):  # what pykeops raises (GeomLoss catches it)
            (lt.Vi(x) * lt.Vj(y.double())).sum(1)
    for dtype in (torch.float32, torch.float64, torch.float32):
        p = lt.LazyTensor([2.0])
        out = (lt.Vi(x.to(dtype)).sqdist(lt.Vj(y.to(dtype))) * p).sum(1)
        assert out.dtype == dtype
        torch.testing.assert_close(out, 2 * ((x[:, None] - y[None]) ** 2).sum(-1).sum(1, keepdim=True).to(dtype))


def test_a_problem_within_the_eager_tile_budget_is_one_eager_tile(monkeypatch):
    """The issue's small problems (100 calls at 200 x 300) run as one dense tile: one kernel call, eager;
    a larger one is cut into tiles."""
    calls = []
    kernel = engine._TileLoop.kernel

    def counting(self, plan, compiled, *args, **kwargs):
        fn = kernel(self, plan, compiled, *args, **kwargs)
        return fn if compiled else lambda *a: (calls.append(1), fn(*a))[1]

    monkeypatch.setattr(engine._TileLoop, "kernel", counting)
    monkeypatch.setattr(compile, "COMPILE_AFTER_SECONDS", 1e9)  # the larger one stays eager too
    for n, m, tiles in [(200, 300, 1), (3000, 3000, None)]:
        x, y, b = torch.randn(n, 3), torch.randn(m, 3), torch.randn(m, 16)
        calls.clear()
        before = engine.routes["eager"]
        out = (-lt.Vi(x).sqdist(lt.Vj(y)) / 8).exp() @ b
        exact = torch.exp(-((x[:, None] - y[None]).double() ** 2).sum(-1) / 8) @ b.double()
        torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-4)  # float32 sums of 3000 terms
        assert engine.routes["eager"] == before + 1
        assert len(calls) == 1 if tiles == 1 else len(calls) > 1


@pytest.mark.parametrize("compiled", [False, True])
def test_skinny_problems_keep_the_tiles_pairs(compiled, monkeypatch):
    """A narrow axis (k-means' centroids, a few queries) leaves the other its share of the tile's pairs:
    a call over 50000 points and 50 centroids cuts a dozen tiles, not ~50; one query's eager pass is one tile
    (13 of 16384 columns before, for 200000 points: the per-tile cost was most of the call); square problems
    keep their tiles."""
    seen = []
    original = engine._TileLoop.run

    def run(self, tile_plan, *args, **kw):
        seen.append(tile_plan)
        return original(self, tile_plan, *args, **kw)

    monkeypatch.setattr(engine._TileLoop, "run", run)
    backend = "compiled" if compiled else "eager"
    many, few = torch.randn(50000, 2), torch.randn(50, 2)
    got = lt.Vi(many).sqdist(lt.Vj(few)).argmin(1, backend=backend)
    torch.testing.assert_close(got.squeeze(-1), torch.cdist(many, few).argmin(1))
    assert seen[-1].rows >= 4096 and seen[-1].cols <= 64
    queries = torch.randn(30, 2)
    got = (-lt.Vi(queries).sqdist(lt.Vj(many))).logsumexp(1, backend=backend)
    torch.testing.assert_close(got.squeeze(-1), torch.logsumexp(-torch.cdist(queries, many) ** 2, 1), rtol=1e-5, atol=1e-5)
    assert seen[-1].cols >= 4096 and seen[-1].rows <= 32
    one = torch.randn(1, 2)
    got = (-lt.Vi(one).sqdist(lt.Vj(many))).exp().matmul(many, backend=backend)
    torch.testing.assert_close(got, torch.exp(-torch.cdist(one, many) ** 2) @ many, rtol=1e-4, atol=1e-4)
    if not compiled:  # an eager tile plans for the rows it has, not the compiled bucket's 16: one tile here
        assert (seen[-1].rows, seen[-1].cols) == (1, 50000)
    square = torch.randn(4096, 2)
    (-lt.Vi(square).sqdist(lt.Vj(square))).logsumexp(1, backend=backend)
    assert seen[-1].rows * seen[-1].cols <= plan.PAIRS_PER_TILE * 8  # unchanged for square problems


def test_a_repeated_backward_builds_the_same_derivative_formulas(monkeypatch):
    """A derivative pass numbers the variables it adds per pass (``ir.derived_symbol``), not from a global count:
    the next backward of the same formula is the same formulas, so sympy's caches and the engine's hit."""
    seen = []
    gradients = autograd.Backward._gradients

    def recorded(self, problem, formulas, **overrides):
        seen.append(tuple(formulas))
        return gradients(self, problem, formulas, **overrides)

    monkeypatch.setattr(autograd.Backward, "_gradients", recorded)
    x, y, b = torch.randn(7, 3), torch.randn(9, 3), torch.randn(9, 2)
    for _ in range(2):
        xi = x.clone().requires_grad_()
        loss = (-lt.Vi(xi).sqdist(lt.Vj(y))).logsumexp(1).sum() + (_rbf(xi, y) @ b).sin().sum()
        torch.autograd.grad(loss, xi)
    assert len(seen) == 4 and seen[:2] == seen[2:]


@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_a_skinny_eager_tile_reads_its_column_blocks_in_place(monkeypatch, n):
    """Below ``EAGER_FEATURES_FIRST_MIN_ROWS`` rows the column blocks are views of the points (no copy a tile,
    values unchanged); from there on they are features-first copies."""
    blocks = []
    columns = engine._TileLoop._columns

    def spy(self, plan, compiled, c0, c1):
        out = columns(self, plan, compiled, c0, c1)
        blocks.extend(out[0])
        return out

    monkeypatch.setattr(engine._TileLoop, "_columns", spy)
    x, y = torch.randn(n, 3, dtype=torch.float64, requires_grad=True), torch.randn(300, 3, dtype=torch.float64,
                                                                                 requires_grad=True)
    b = torch.randn(300, 4, dtype=torch.float64)
    got = (-lt.Vi(x).sqdist(lt.Vj(y))).exp().matmul(b, backend="eager")
    expected = torch.exp(-((x[:, None] - y[None]) ** 2).sum(-1)) @ b
    torch.testing.assert_close(got, expected)
    w = torch.randn_like(expected)  # the backward's passes read the same blocks
    for g, e in zip(torch.autograd.grad((got * w).sum(), (x, y)), torch.autograd.grad((expected * w).sum(), (x, y))):
        torch.testing.assert_close(g, e)
    in_place = [blk.untyped_storage().data_ptr() in (y.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
                for blk in blocks[:2]]  # the forward's blocks (the backward's are its own cotangents')
    assert blocks and all(in_place) == (n < engine.EAGER_FEATURES_FIRST_MIN_ROWS) and any(in_place) == all(in_place)


def test_an_eager_squared_difference_subtracts_the_columns():
    """``|x - y|^2`` by feature subtracts y's block instead of adding a negated copy of it."""
    x, y = torch.randn(5, 3), torch.randn(7, 3)
    lt.Vi(x).sqdist(lt.Vj(y)).sum(1, backend="eager")
    sources = [fn.source for fn in compile._CACHE.values() if "squares_by_feature" in getattr(fn, "source", "")]
    assert sources and all(", True)" in s and "-1.0 *" not in s for s in sources[-1:])
