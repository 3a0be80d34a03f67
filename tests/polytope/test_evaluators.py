"""Every evaluation path against naive per-candidate functional_call forwards."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import polytope.evaluators.flat as flat_module
import polytope.evaluators.paths as paths_module
from polytope.candidates import CandidateBatch, CandidateGroup
from polytope.evaluators import PATHS, NNCostEvaluator, contracts_of, parameters_swapped
from polytope.evaluators.chunking import estimate_chunk, is_out_of_memory
from polytope.evaluators.deltas import sign_pairs
from polytope.evaluators.flat import Runs, compare, flat_groups
from polytope.evaluators.paths import STRATEGIES
from polytope.param_layout import ParameterLayout
from polytope.subspaces import FactoredSubspace, HybridSubspace

F64 = torch.float64


# --------------------------------------------------------------------------- models
class CustomLinear(nn.Module):
    """A user linear layer that declares the linear contract."""

    polytope_contracts = frozenset({"linear", "vmap"})

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return x @ self.weight.T + self.bias


class Softsign(nn.Module):
    polytope_contracts = frozenset({"elementwise", "vmap"})

    def forward(self, x):
        return x / (1 + x.abs())


class Gate(nn.Module):
    """A custom parametrised layer with no declared contract: site-local vmap."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))
        self.shift = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x):
        return x * torch.sigmoid(self.scale) + self.shift * x.square()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 2, 3)
        self.head = nn.Linear(2 * 3 * 2, 3)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


class TinyAttention(nn.Module):
    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        b, length, width = x.shape
        q, k, v = (t.reshape(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, length, width)
        return self.head((x + self.proj(attended)).mean(1))


def make_case(kind: str, dtype=F64):
    """(model, inputs, targets, loss_fn, expected structured path)."""
    torch.manual_seed(1)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))
        x, y, loss = torch.randn(11, 5), torch.randn(11, 3), F.mse_loss
    elif kind == "mlp_ce":
        model = nn.Sequential(nn.Linear(4, 9), nn.GELU(), nn.Linear(9, 5))
        x, y, loss = torch.randn(13, 4), torch.randint(0, 5, (13,)), F.cross_entropy
    elif kind == "custom_linear":
        model = nn.Sequential(CustomLinear(5, 6), Softsign(), nn.Linear(6, 6), nn.Sigmoid(), CustomLinear(6, 2))
        x, y, loss = torch.randn(9, 5), torch.randn(9, 2), F.mse_loss
    elif kind == "conv":
        model = ConvNet()
        x, y, loss = torch.randn(4, 2, 5, 4), torch.randint(0, 3, (4,)), F.cross_entropy
    elif kind == "attention":
        model = TinyAttention()
        x, y, loss = torch.randn(3, 5, 8), torch.randint(0, 2, (3,)), F.cross_entropy
    elif kind == "custom_layer":
        model = nn.Sequential(nn.Linear(4, 6), Gate(6), nn.Linear(6, 2))
        x, y, loss = torch.randn(7, 4), torch.randn(7, 2), F.mse_loss
    else:
        raise AssertionError(kind)
    model = model.to(dtype)
    x = x.to(dtype)
    y = y.to(dtype) if y.is_floating_point() else y
    return model, x, y, loss


SEQUENTIAL_MLPS = ("mlp", "mlp_ce", "custom_linear")
GENERIC = ("conv", "attention", "custom_layer")


def naive(model, loss_fn, candidates, x, y):
    layout = ParameterLayout(model)
    return torch.stack([loss_fn(functional_call(model, layout.views(c), (x,)), y) for c in candidates])


def rel_err(actual, expected):
    return float((actual - expected).abs().max() / expected.abs().max())


def flat_candidates(layout: ParameterLayout, base: torch.Tensor, kind: str, count: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    noise = lambda *shape: torch.randn(*shape, generator=gen, dtype=base.dtype)  # noqa: E731
    if kind == "dense":
        return base + 0.3 * noise(count, layout.n)
    cand = base.repeat(count, 1)
    if kind == "sparse":
        cols = torch.randperm(layout.n, generator=gen)[:3]
    else:  # last layer: every coordinate of the last two tensors
        cols = torch.arange(layout.slots[-2].start, layout.n)
    cand[:, cols] += 0.3 * noise(count, cols.numel())
    return cand


def structured_batch(layout: ParameterLayout, base: torch.Tensor) -> CandidateBatch:
    gen = torch.Generator().manual_seed(4)
    noise = lambda *shape: 0.3 * torch.randn(*shape, generator=gen, dtype=base.dtype)  # noqa: E731
    first = layout.slots[0]
    last = torch.arange(layout.slots[-2].start, layout.n)
    pair = noise(2, layout.slots[2].numel)
    frame = noise(2, first.numel)
    groups = [
        CandidateGroup(torch.randperm(layout.n, generator=gen)[:4], noise(5, 4)),  # sparse
        CandidateGroup(torch.arange(first.start, first.stop), noise(4, first.numel)),  # a whole tensor, dense
        CandidateGroup(last, noise(3, last.numel())),  # last layer only
        CandidateGroup(torch.arange(3, 40), noise(6, 37)),  # a particle across tensors
        CandidateGroup(torch.zeros(0, dtype=torch.long), base.new_zeros(1, 0)),  # the incumbent
        CandidateGroup(torch.arange(layout.slots[2].start, layout.slots[2].stop), torch.cat([pair, -pair, pair])),  # +- pairs
        CandidateGroup(torch.arange(first.start, first.stop), torch.cat([frame, -frame])),  # a whole tensor, orthoplex order
        CandidateGroup(torch.arange(layout.n), noise(3, layout.n)),  # every tensor, whole
    ]
    return CandidateBatch(base, groups)


# --------------------------------------------------------------------------- parity
FLAT_PATHS = {
    ("sparse", True): "sparse_delta",
    ("dense", True): "dense_bmm",
    ("last", True): "dense_bmm",
    ("sparse", False): "site_vmap",
    ("dense", False): "vmap",
    ("last", False): "site_vmap",
}


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("kind", ["sparse", "dense", "last"])
@pytest.mark.parametrize("model_kind", SEQUENTIAL_MLPS + GENERIC)
def test_flat_candidates_match_naive(model_kind, kind, chunk_size):
    model, x, y, loss = make_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    cand = flat_candidates(layout, base, kind)
    ev = NNCostEvaluator(model, loss, chunk_size=chunk_size)
    got = ev.evaluate(cand, x, y)
    assert rel_err(got, naive(model, loss, cand, x, y)) < 1e-10
    assert ev.last_path == FLAT_PATHS[kind, model_kind in SEQUENTIAL_MLPS]
    assert torch.equal(layout.flatten(model), base)


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("model_kind", SEQUENTIAL_MLPS + GENERIC)
def test_structured_candidates_match_naive(model_kind, chunk_size):
    model, x, y, loss = make_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    batch = structured_batch(layout, base)
    ev = NNCostEvaluator(model, loss, chunk_size=chunk_size)
    got = ev.evaluate_batch(batch, x, y)
    assert rel_err(got, naive(model, loss, batch.materialize(), x, y)) < 1e-10
    everything = batch.groups[-1].count  # the group that moves every tensor
    if model_kind in SEQUENTIAL_MLPS:
        expected = {"sparse_delta": batch.count}
    else:
        expected = {"site_vmap": batch.count - everything, "vmap": everything}
    assert ev.path_counts == expected
    assert torch.equal(layout.flatten(model), base)


@pytest.mark.parametrize("subspace_kind", ["hybrid", "hybrid_capped", "factored"])
@pytest.mark.parametrize("model_kind", ["mlp", "custom_linear", "conv"])
def test_subspace_candidates_match_naive(model_kind, subspace_kind):
    model, x, y, loss = make_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    subspace = {
        "hybrid": lambda: HybridSubspace.from_layout(model, rank=2),
        "hybrid_capped": lambda: HybridSubspace.from_layout(model, rank=3, max_subspace_dim=17, seed=5),
        "factored": lambda: FactoredSubspace(model, rank=2),
    }[subspace_kind]()
    gen = torch.Generator().manual_seed(6)
    groups = [
        CandidateGroup(torch.randperm(subspace.dim, generator=gen)[:5], torch.randn(6, 5, generator=gen, dtype=F64)),
        CandidateGroup(torch.arange(subspace.dim), torch.randn(4, subspace.dim, generator=gen, dtype=F64)),
    ]
    batch = CandidateBatch(base, groups, subspace)
    for chunk_size in (None, 2):
        ev = NNCostEvaluator(model, loss, chunk_size=chunk_size)
        got = ev.evaluate_batch(batch, x, y)
        assert rel_err(got, naive(model, loss, batch.materialize(), x, y)) < 1e-10
        if model_kind == "conv":  # "vmap" where a group moves every tensor
            assert set(ev.path_counts) <= {"site_vmap", "vmap"}
        else:
            assert set(ev.path_counts) == {"factored" if subspace_kind == "factored" else "subspace_delta"}
    assert torch.equal(layout.flatten(model), base)


@pytest.mark.parametrize("model_kind", ["mlp", "conv"])
def test_inplace_path_matches_naive_and_restores_bits(model_kind):
    model, x, y, loss = make_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    ev = NNCostEvaluator(model, loss, use_inplace=True)
    cand = flat_candidates(layout, base, "dense")
    assert rel_err(ev.evaluate(cand, x, y), naive(model, loss, cand, x, y)) < 1e-10
    batch = structured_batch(layout, base)
    assert rel_err(ev.evaluate_batch(batch, x, y), naive(model, loss, batch.materialize(), x, y)) < 1e-10
    sub = HybridSubspace.from_layout(model, rank=2)
    sbatch = CandidateBatch(base, [CandidateGroup(torch.arange(sub.dim), torch.randn(3, sub.dim, dtype=F64))], sub)
    assert rel_err(ev.evaluate_batch(sbatch, x, y), naive(model, loss, sbatch.materialize(), x, y)) < 1e-10
    assert ev.last_path == "inplace" and ev.path_counts["inplace"] == cand.shape[0] + batch.count + sbatch.count
    assert torch.equal(layout.flatten(model), base)


def test_batch_base_other_than_model_parameters():
    """The batch's base, not the model's current weights, defines the candidates on every path."""
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    params = layout.flatten(model)
    base = params + 0.05 * torch.randn(layout.n, dtype=F64)
    batch = structured_batch(layout, base)
    expected = naive(model, loss, batch.materialize(), x, y)
    for options in ({}, {"use_inplace": True}, {"reuse": False}):
        got = NNCostEvaluator(model, loss, **options).evaluate_batch(batch, x, y)
        assert rel_err(got, expected) < 1e-10
    assert torch.equal(layout.flatten(model), params)


def test_float32_paths_match_float32_reference():
    model, x, y, loss = make_case("mlp", torch.float32)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    batch = structured_batch(layout, base)
    ev = NNCostEvaluator(model, loss)
    expected = naive(model.double(), loss, batch.materialize().double(), x.double(), y.double())
    model.float()
    got = ev.evaluate_batch(batch, x, y)
    assert got.dtype == torch.float32 and rel_err(got.double(), expected) < 1e-5
    cand = flat_candidates(layout, base, "dense")
    assert rel_err(ev.evaluate(cand, x, y).double(), naive(model, loss, cand, x, y).double()) < 1e-5


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    batch=st.integers(1, 6),
    k=st.integers(1, 12),
    count=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_sparse_delta_property(widths, batch, k, count, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).double()
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    index = torch.randperm(layout.n)[: min(k, layout.n)]
    batch_ = CandidateBatch(base, [CandidateGroup(index, torch.randn(count, index.numel(), dtype=F64))])
    x, y = torch.randn(batch, widths[0], dtype=F64), torch.randn(batch, widths[-1], dtype=F64)
    ev = NNCostEvaluator(model, F.mse_loss)
    got = ev.evaluate_batch(batch_, x, y)
    expected = naive(model, F.mse_loss, batch_.materialize(), x, y)
    assert (got - expected).abs().max() <= 1e-10 * max(1.0, float(expected.abs().max()))
    assert ev.last_path == "sparse_delta"


def test_sign_pairs_found_and_expanded_exactly():
    d = torch.randn(3, 10, dtype=F64)
    d[1, 0] = 0.0  # leading zeros do not confuse the sign
    pairs = sign_pairs(torch.cat([d, -d, d[:1]]))
    assert pairs is not None and pairs.representatives.numel() == 3
    full = torch.cat([d, -d, d[:1]])
    assert torch.equal(full[pairs.representatives][pairs.inverse] * pairs.signs[:, None].to(F64), full)
    assert sign_pairs(torch.randn(4, 3, dtype=F64)) is None
    halves = sign_pairs(torch.cat([d, -d]))  # the orthoplex's order, found without sorting
    assert halves is not None and halves.halves and torch.equal(halves.select(torch.cat([d, -d])), d)
    correction = torch.randn(3, 2, 5, dtype=F64)
    assert torch.equal(halves.expand(correction), torch.cat([correction, -correction]))


# ------------------------------------------------------------------- flat candidates
class BatchNormNet(nn.Sequential):
    """Training-mode BatchNorm: declared sequential, never vmapped."""

    def __init__(self):
        super().__init__(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))


def all_kinds_case(kind: str, dtype=F64):
    """make_case plus the two models that take the sequential path."""
    if kind not in ("batchnorm", "data_dependent"):
        return make_case(kind, dtype)
    torch.manual_seed(2)
    model = (BatchNormNet().train() if kind == "batchnorm" else DataDependent()).to(dtype)
    return model, torch.randn(6, 3, dtype=dtype), torch.randn(6, 2, dtype=dtype), F.mse_loss


ALL_KINDS = SEQUENTIAL_MLPS + GENERIC + ("batchnorm", "data_dependent")


def mixed_candidates(layout: ParameterLayout, base: torch.Tensor) -> torch.Tensor:
    """Flat candidates of every kind, shuffled: equal to the model, a few entries of one tensor (shared by
    three rows, as a block would be), entries of two tensors, a whole tensor, every entry."""
    gen = torch.Generator().manual_seed(7)
    noise = lambda *shape: 0.3 * torch.randn(*shape, generator=gen, dtype=base.dtype)  # noqa: E731
    first, last = layout.slots[0], layout.slots[-2]
    rows = [base.clone() for _ in range(8)]
    for r in rows[1:4]:
        r[first.start : first.start + 3] += noise(3)
    rows[4][[first.start + 5, last.start + 1]] += noise(2)
    rows[5][last.start : last.stop] += noise(last.numel)
    rows[6] += noise(layout.n)
    return torch.stack(rows)[torch.randperm(len(rows), generator=gen)]


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("model_kind", ALL_KINDS)
def test_flat_mixes_match_naive(model_kind, chunk_size):
    """Every kind of change in one call, in shuffled order: losses in the caller's order, every candidate scored once."""
    model, x, y, loss = all_kinds_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    cand = mixed_candidates(layout, base)
    ev = NNCostEvaluator(model, loss, chunk_size=chunk_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the data-dependent model warns once about vmap
        got = ev.evaluate(cand, x, y)
    assert rel_err(got, naive(model, loss, cand, x, y)) < 1e-10
    assert sum(ev.path_counts.values()) == cand.shape[0]
    if model_kind == "batchnorm":
        assert set(ev.path_counts) == {"sequential"}
    if model_kind == "data_dependent":  # the candidates equal to the model need one plain forward, no vmap
        assert ev.path_counts["sequential"] == cand.shape[0] - 2
    assert torch.equal(layout.flatten(model), base)


def test_flat_analysis_groups_by_changed_tensors_and_entries():
    model, *_ = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    cand = mixed_candidates(layout, base)
    groups = flat_groups(cand, base, layout, coordinates=True, sparse_fraction=0.125)
    rows = torch.cat([torch.arange(cand.shape[0])[g.rows] for g in groups])
    assert sorted(rows.tolist()) == list(range(cand.shape[0]))  # a partition of the candidates
    for g in groups:
        members = torch.arange(cand.shape[0])[g.rows]
        moved = (cand[members] != base).any(0)
        touched = sorted({int(i) for i in layout.slot_ids(torch.nonzero(moved).flatten())})
        assert list(g.slots) == touched
        if not g.slots:  # the two candidates equal to the model
            assert g.count == 2 and g.is_delta and g.index.numel() == 0
        elif g.is_delta:  # exactly the moved entries, and the candidates' own differences
            assert torch.equal(g.index, torch.nonzero(moved).flatten())
            assert torch.equal(base[g.index] + g.delta, cand[members][:, g.index])
        else:  # a whole tensor or everything: the candidates' own numbers
            for s, v in g.values.items():
                assert torch.equal(v, cand[members][:, layout.slots[s].start : layout.slots[s].stop])
    forms = sorted((len(g.slots), g.count, g.is_delta) for g in groups)
    assert forms == [(0, 2, True), (1, 1, False), (1, 3, True), (2, 1, True), (6, 1, False)]


def test_flat_candidates_take_the_structured_paths():
    """A CandidateBatch materialized: the flat analysis recovers its groups and runs the same paths."""
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    gen = torch.Generator().manual_seed(8)
    groups = []
    for start in (0, 10, 20, layout.slots[2].start + 3):  # blocks of 4 entries, orthoplex +- pairs, two radii
        d = 0.1 * torch.randn(3, 4, generator=gen, dtype=F64)
        groups.append(CandidateGroup(torch.arange(start, start + 4), torch.cat([d, -d, 2 * d, -2 * d])))
    batch = CandidateBatch(base, groups)
    flat = batch.materialize()
    found = sorted(flat_groups(flat, base, layout, coordinates=True, sparse_fraction=0.125), key=lambda g: int(g.index[0]))
    assert [(g.index.tolist(), g.count) for g in found] == [(g.index.tolist(), g.count) for g in groups]
    assert all(rel_err(f.delta, g.delta) < 1e-12 for f, g in zip(found, groups))
    structured, plain = NNCostEvaluator(model, loss), NNCostEvaluator(model, loss)
    expected = naive(model, loss, flat, x, y)
    assert rel_err(structured.evaluate_batch(batch, x, y), expected) < 1e-10
    assert rel_err(plain.evaluate(flat, x, y), expected) < 1e-10
    assert structured.path_counts == plain.path_counts == {"sparse_delta": batch.count}


def test_flat_analysis_in_pieces_matches_whole(monkeypatch):
    """Matrices larger than one piece are compared piece by piece: same findings, same losses."""
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    cand = mixed_candidates(layout, base)
    runs = Runs(layout, 4, base.device)
    whole = compare(cand, base, layout, runs)
    monkeypatch.setattr(flat_module, "CPU_PIECE", 16)  # 16 numbers per piece: every tensor in several pieces
    monkeypatch.setattr(flat_module, "SAMPLE", 4)
    pieces = compare(cand, base, layout, runs)
    assert torch.equal(whole[0] != 0, pieces[0] != 0)  # the same changed tensors
    for s, slot in enumerate(layout.slots):  # a tensor a candidate moves everywhere is settled by the sample: all its runs marked
        dense = (cand[:, slot.start : slot.stop] != base[slot.start : slot.stop]).all(1)
        own = slice(runs.offsets[s], runs.offsets[s + 1])
        assert torch.equal(pieces[1][~dense, own], whole[1][~dense, own]) and bool((pieces[1][dense, own] != 0).all())
    moved = (cand - base).abs()
    for s, slot in enumerate(layout.slots):  # the reference: plain reductions of the whole difference
        assert torch.equal(whole[0][:, s], moved[:, slot.start : slot.stop].amax(1))
        for r in range(runs.offsets[s], runs.offsets[s + 1]):
            assert torch.equal(whole[1][:, r], moved[:, runs.starts[r] : runs.stops[r]].amax(1))
    assert rel_err(NNCostEvaluator(model, loss).evaluate(cand, x, y), naive(model, loss, cand, x, y)) < 1e-10


def test_nan_entries_count_as_changes():
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    cand = base.repeat(3, 1)
    cand[1, 4] = float("nan")
    cand[2, 7] += 0.5
    got = NNCostEvaluator(model, loss).evaluate(cand, x, y)
    expected = naive(model, loss, cand, x, y)
    assert torch.isnan(got[1]) and torch.isnan(expected[1])
    assert rel_err(got[[0, 2]], expected[[0, 2]]) < 1e-10


@pytest.mark.parametrize("model_kind", ["mlp", "conv", "batchnorm"])
def test_zero_candidates_give_an_empty_tensor(model_kind):
    model, x, y, loss = all_kinds_case(model_kind)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    ev = NNCostEvaluator(model, loss)
    for got in (ev.evaluate(base.new_zeros(0, layout.n), x, y), ev.evaluate_batch(CandidateBatch(base, []), x, y)):
        assert got.shape == (0,) and got.dtype == F64
    assert not ev.path_counts


def test_path_order_is_the_documented_table():
    """The strategies run in the order of the path table in docs/performance.md."""
    assert [path.name for path in STRATEGIES] == list(PATHS)
    page = (Path(__file__).parents[2] / "docs" / "performance.md").read_text()
    table = page.split("### Paths", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    assert documented == list(PATHS)


def test_inplace_writes_into_non_contiguous_parameters():
    model, x, y, loss = make_case("mlp")
    with torch.no_grad():
        model[0].weight = nn.Parameter(model[0].weight.detach().T.contiguous().T)  # same values, transposed strides
    assert not model[0].weight.is_contiguous()
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    batch = structured_batch(layout, base)
    for options in ({"use_inplace": True}, {}):
        ev = NNCostEvaluator(model, loss, **options)
        assert rel_err(ev.evaluate_batch(batch, x, y), naive(model, loss, batch.materialize(), x, y)) < 1e-10
        assert rel_err(ev.evaluate(batch.materialize(), x, y), naive(model, loss, batch.materialize(), x, y)) < 1e-10
    assert torch.equal(layout.flatten(model), base)


# ------------------------------------------------------------------- path selection
def test_reuse_false_runs_whole_forwards():
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    batch = structured_batch(layout, layout.flatten(model))
    ev = NNCostEvaluator(model, loss, reuse=False)
    assert rel_err(ev.evaluate_batch(batch, x, y), naive(model, loss, batch.materialize(), x, y)) < 1e-10
    assert set(ev.path_counts) == {"vmap"}


class DataDependent(nn.Module):
    """Python control flow on tensor values: cannot run under vmap."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        out = self.lin(x)
        return out * 2 if float(out.sum()) > 0 else out


def test_vmap_failure_falls_back_to_sequential_once():
    model = DataDependent().double()
    x, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "dense")
    ev = NNCostEvaluator(model, F.mse_loss)
    with pytest.warns(UserWarning, match="does not run under torch.vmap"):
        got = ev.evaluate(cand, x, y)
    assert rel_err(got, naive(model, F.mse_loss, cand, x, y)) < 1e-10 and ev.last_path == "sequential"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ev.evaluate(cand, x, y)  # remembered: no second warning
    ev.reset_vmap()
    assert ev.vmap_ok


def test_declared_sequential_layer_and_buffers_restored():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double().train()
    x, y = torch.randn(6, 3, dtype=F64), torch.randn(6, 1, dtype=F64)
    assert "sequential" in contracts_of(model[1])
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    stats = model[1].running_mean.clone()
    cand = flat_candidates(layout, base, "sparse")
    ev = NNCostEvaluator(model, F.mse_loss)
    got = ev.evaluate(cand, x, y)
    assert ev.last_path == "sequential"
    assert torch.equal(model[1].running_mean, stats)
    copy = [m for m in [nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double().train()]][0]
    copy.load_state_dict(model.state_dict())
    assert rel_err(got, naive(copy, F.mse_loss, cand, x, y)) < 1e-10


def test_loss_without_vmap_support_is_applied_per_candidate():
    model, x, y, _ = make_case("mlp")

    def loss(out, target):  # .item() cannot run under vmap
        return F.mse_loss(out, target) * (1.0 if out.sum().item() > -1e9 else 0.0)

    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "sparse")
    ev = NNCostEvaluator(model, loss)
    with pytest.warns(UserWarning, match="loss_fn does not run under torch.vmap"):
        got = ev.evaluate(cand, x, y)
    assert rel_err(got, naive(model, F.mse_loss, cand, x, y)) < 1e-10


def test_a_loss_that_is_wrong_either_way_raises_without_giving_up_vmap():
    model, x, y, _ = make_case("mlp")
    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "sparse")
    ev = NNCostEvaluator(model, lambda out, target: (out - target) ** 2)  # not a scalar
    with pytest.raises(ValueError, match="scalar tensor per model"):
        ev.evaluate(cand, x, y)
    assert ev.loss.vmap_ok  # the error was the loss's, so the next (fixed) loss still runs under vmap


def test_custom_contracts_validated():
    class Bad(nn.Module):
        polytope_contracts = {"linear", "fast"}

    class AlsoBad(nn.Module):
        polytope_contracts = "linear"

    with pytest.raises(ValueError, match="unknown contracts"):
        contracts_of(Bad())
    with pytest.raises(TypeError, match="set of strings"):
        contracts_of(AlsoBad())

    class NotLinear(nn.Module):
        polytope_contracts = frozenset({"linear"})

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 2))

    with pytest.raises(ValueError, match="linear"):
        NNCostEvaluator(nn.Sequential(NotLinear()), F.mse_loss)


# ----------------------------------------------------------------- reuse and memory
def test_prefix_reused_within_sweep_and_rebuilt_on_new_batch_or_base():
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    ev = NNCostEvaluator(model, loss)
    batch = structured_batch(layout, base)
    ev.evaluate_batch(batch, x, y)
    ev.evaluate_batch(batch, x, y)
    assert ev.prefix.builds == 1
    ev.evaluate_batch(batch, x[:7], y[:7])  # a lower fidelity level
    assert ev.prefix.builds == 2
    x2 = x.clone()
    ev.evaluate_batch(batch, x2, y)
    x2.mul_(2)  # changed in place: same tensor, new contents
    got = ev.evaluate_batch(batch, x2, y)
    assert ev.prefix.builds == 4
    assert rel_err(got, naive(model, loss, batch.materialize(), x2, y)) < 1e-10
    moved = CandidateBatch(base + 0.01, batch.groups)
    ev.evaluate_batch(moved, x2, y)
    assert ev.prefix.builds == 5


def test_automatic_chunk_from_memory_budget():
    assert estimate_chunk(100, 1000, 10_000) == 10
    assert estimate_chunk(100, 10**9, 10) == 1
    assert estimate_chunk(5, 1, 10**9) == 5
    model, x, y, loss = make_case("conv")
    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "dense")
    calls = []
    ev = NNCostEvaluator(model, loss, memory_budget=1)
    original = ev.vmap_site.fn
    ev.vmap_site.fn = lambda *a: calls.append(1) or original(*a)
    got = ev.evaluate(cand, x, y)
    assert len(calls) == cand.shape[0]  # a one-byte budget: one candidate per chunk
    assert rel_err(got, naive(model, loss, cand, x, y)) < 1e-10


def test_out_of_memory_retries_with_smaller_chunk(monkeypatch):
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    batch = structured_batch(layout, layout.flatten(model))
    real = paths_module.mlp_outputs
    sizes = []

    def limited(plan, prefix, changes, count):
        sizes.append(count)
        if count > 2:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(plan, prefix, changes, count)

    monkeypatch.setattr(paths_module, "mlp_outputs", limited)
    ev = NNCostEvaluator(model, loss, chunk_size=8)
    with pytest.warns(UserWarning, match="chunk_size=5; retrying with chunk_size=2"):
        got = ev.evaluate_batch(batch, x, y)
    assert rel_err(got, naive(model, loss, batch.materialize(), x, y)) < 1e-10
    assert ev.chunks.cap == 2 and max(sizes[-3:]) <= 2
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(ValueError("out of memory"))


# --------------------------------------------------------- compilation and precision
def test_compile_failure_falls_back_to_eager_once(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    model, x, y, loss = make_case("conv")
    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "dense")
    ev = NNCostEvaluator(model, loss, compile_evaluator=True, compile_forward=True)
    with pytest.warns(UserWarning, match="compiling the vmap evaluation failed"):
        got = ev.evaluate(cand, x, y)
    assert rel_err(got, naive(model, loss, cand, x, y)) < 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ev.evaluate(cand, x, y)
    ev.use_inplace = True
    with pytest.warns(UserWarning, match="compiling the in-place forward evaluation failed"):
        assert rel_err(ev.evaluate(cand, x, y), naive(model, loss, cand, x, y)) < 1e-10


@pytest.mark.slow
def test_compiled_dense_path_matches():
    model, x, y, loss = make_case("mlp", torch.float32)
    layout = ParameterLayout(model)
    cand = flat_candidates(layout, layout.flatten(model), "dense")
    ev = NNCostEvaluator(model, loss, compile_evaluator=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="compiling the")  # compilation must really succeed
        got = ev.evaluate(cand, x, y)
    assert ev.last_path == "dense_bmm" and ev.dense_site.active
    assert rel_err(got, naive(model, loss, cand, x, y)) < 1e-5


@pytest.mark.parametrize("model_kind", ["mlp", "conv"])
def test_candidate_autocast_disables_delta_and_accumulates_in_fp32(model_kind):
    model, x, y, loss = make_case(model_kind, torch.float32)
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    batch = structured_batch(layout, base)
    ev = NNCostEvaluator(model, loss, candidate_autocast=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = ev.evaluate_batch(batch, x, y)
    assert got.dtype == torch.float32
    # torch 2.13 cannot vmap a convolution under autocast (the batched bias stays fp32): sequential
    assert set(ev.path_counts) == ({"dense_bmm"} if model_kind == "mlp" else {"site_vmap", "sequential"})
    assert rel_err(got, naive(model, loss, batch.materialize(), x, y)) < 5e-2
    assert torch.equal(layout.flatten(model), base)


# ------------------------------------------------------------------ bad input
def test_bad_arguments_name_themselves():
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    ev = NNCostEvaluator(model, loss)
    expected = rf"candidates must be a \(C, {layout.n}\) tensor of torch.float64 on cpu"
    with pytest.raises(ValueError, match=expected + ".*got shape \\(111,\\)"):
        ev.evaluate(base, x, y)
    with pytest.raises(ValueError, match=expected + ".*got shape \\(2, 110\\)"):
        ev.evaluate(base[None, :-1].expand(2, -1), x, y)
    with pytest.raises(TypeError, match=expected + ".*got torch.float32 on cpu"):
        ev.evaluate(base.float()[None], x, y)
    with pytest.raises(TypeError, match=expected + ".*got list"):
        ev.evaluate(base.tolist(), x, y)
    with pytest.raises(ValueError, match=rf"batch.base must be a \({layout.n},\) tensor"):
        ev.evaluate_batch(CandidateBatch(base[:-1], []), x, y)
    with pytest.raises(ValueError, match="inputs must be a tensor whose last dimension is 5"):
        ev.evaluate(base[None], x[:, :4], y)
    with pytest.raises(TypeError, match="batch must be a CandidateBatch"):
        ev.evaluate_batch(base[None], x, y)
    with pytest.raises(ValueError, match="flat_index must lie in"):
        ev.evaluate_batch(CandidateBatch(base, [CandidateGroup(torch.tensor([layout.n]), base.new_ones(1, 1))]), x, y)
    with pytest.raises(ValueError, match="chunk_size"):
        NNCostEvaluator(model, loss, chunk_size=0)
    with pytest.raises(ValueError, match="candidate_autocast"):
        NNCostEvaluator(model, loss, candidate_autocast="fp8")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        NNCostEvaluator(model, "mse")
    with pytest.raises(TypeError, match="model must be"):
        NNCostEvaluator(lambda t: t, loss)


def test_parameters_swapped_restores_after_error():
    model, *_ = make_case("mlp")
    layout = ParameterLayout(model)
    base = layout.flatten(model)
    with pytest.raises(RuntimeError, match="boom"):
        with parameters_swapped(model, base + 1.0) as params:
            assert torch.equal(params[0], (base + 1.0)[: params[0].numel()].view_as(params[0]))
            raise RuntimeError("boom")
    assert torch.equal(layout.flatten(model), base)


# ------------------------------------------------------------------ optimizer
def test_optimizer_with_evaluator_matches_closure():
    optimizer_module = pytest.importorskip("polytope.optimizer")
    model, x, y, loss = make_case("mlp")
    layout = ParameterLayout(model)
    start = layout.flatten(model)

    def run(use_evaluator):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(start.clone(), model.parameters())
        opt = optimizer_module.PolytopeOptimizer(model.parameters(), blocks=8, radii=(0.05, 0.1), seed=0)
        if use_evaluator:
            ev = NNCostEvaluator(model, loss)
            opt.register_evaluator(ev, x, y)
            opt.step()
            assert ev.last_path == "sparse_delta"
        else:
            opt.step(lambda c: naive(model, loss, c, x, y))
        return opt.incumbent

    assert torch.allclose(run(True), run(False), rtol=0, atol=1e-10)
