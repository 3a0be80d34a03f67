"""Subspaces: linear maps with the documented block structure and dimension bounds."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from polytope.candidates import CandidateBatch, CandidateGroup
from polytope.param_layout import ParameterLayout
from polytope.subspaces import EntryBlock, FactoredBlock, FactoredSubspace, HybridSubspace

F64 = torch.float64


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 1)).double()


@pytest.mark.parametrize("make", [lambda m: HybridSubspace.from_layout(m, rank=3), lambda m: FactoredSubspace(m, rank=2),
                                  lambda m: HybridSubspace.from_layout(m, rank=3, max_subspace_dim=25)])
def test_to_flat_is_linear_and_matches_block_displacements(make):
    net = model()
    sub = make(net)
    z1, z2 = torch.randn(4, sub.dim, dtype=F64), torch.randn(4, sub.dim, dtype=F64)
    flat = sub.to_flat(z1)
    assert flat.shape == (4, ParameterLayout(net).n)
    assert torch.allclose(sub.to_flat(2 * z1 - z2), 2 * flat - sub.to_flat(z2), atol=1e-12)
    assert sub.block_sizes == [b.dim for b in sub.blocks] and sum(sub.block_sizes) == sub.dim
    # each coordinate only moves its own parameter
    for block in sub.blocks:
        z = torch.zeros(1, sub.dim, dtype=F64)
        z[0, block.offset] = 1.0
        moved = torch.nonzero(sub.to_flat(z)[0]).flatten()
        assert moved.numel() > 0 and moved.min() >= block.slot.start and moved.max() < block.slot.stop


def test_hybrid_layout_low_rank_for_matrices_entries_for_small_tensors():
    net = model()
    sub = HybridSubspace.from_layout(net, rank=3)
    kinds = {b.slot.name: type(b) for b in sub.blocks}
    assert kinds["0.weight"] is FactoredBlock and kinds["2.weight"] is FactoredBlock
    assert kinds["0.bias"] is EntryBlock and kinds["4.weight"] is EntryBlock  # 12 entries < rank-3 factorisation
    assert sub.dim == 9 + 20 + 9 + 12 + 12 + 1
    # the low-rank change really has rank <= 3 and lies in the fixed bases
    block = next(b for b in sub.blocks if b.slot.name == "2.weight")
    z = torch.zeros(1, sub.dim, dtype=F64)
    z[0, block.offset : block.offset + block.dim] = torch.randn(block.dim, dtype=F64)
    change = sub.to_flat(z)[0, block.slot.start : block.slot.stop].view(12, 20)
    assert torch.linalg.matrix_rank(change) <= 3


def test_rank_alone_does_not_bound_dimension_max_subspace_dim_does():
    deep = nn.Sequential(*[nn.Linear(30, 30) for _ in range(6)]).double()
    unbounded = HybridSubspace.from_layout(deep, rank=4)
    assert unbounded.dim == 6 * (16 + 30)
    capped = HybridSubspace.from_layout(deep, rank=4, max_subspace_dim=50, seed=1)
    assert capped.dim == 50
    again = HybridSubspace.from_layout(deep, rank=4, max_subspace_dim=50, seed=1)
    assert torch.equal(capped.to_flat(torch.eye(50, dtype=F64)), again.to_flat(torch.eye(50, dtype=F64)))


def test_factored_subspace_is_a_times_fixed_basis():
    net = model()
    basis = torch.linalg.qr(torch.randn(20, 2, dtype=F64))[0].T
    sub = FactoredSubspace(net, rank=2, bases={"2.weight": basis}, include_other=False)
    assert all(isinstance(b, FactoredBlock) for b in sub.blocks)
    block = next(b for b in sub.blocks if b.slot.name == "2.weight")
    a = torch.randn(12, 2, dtype=F64)
    z = torch.zeros(1, sub.dim, dtype=F64)
    z[0, block.offset : block.offset + block.dim] = a.reshape(-1)
    change = sub.to_flat(z)[0, block.slot.start : block.slot.stop].view(12, 20)
    assert torch.allclose(change, a @ basis, atol=1e-12)
    # the change's rows lie in span(B): the search is confined to those input directions
    assert torch.allclose(change @ basis.T @ basis, change, atol=1e-12)


def test_candidate_batch_uses_subspace_map():
    net = model()
    sub = FactoredSubspace(net, rank=2)
    base = ParameterLayout(net).flatten(net)
    delta = torch.randn(3, 2, dtype=F64)
    batch = CandidateBatch(base, [CandidateGroup(torch.tensor([1, 7]), delta)], sub)
    z = torch.zeros(3, sub.dim, dtype=F64)
    z[:, [1, 7]] = delta
    assert torch.allclose(batch.materialize(), base + sub.to_flat(z))


def test_bad_arguments():
    net = model()
    with pytest.raises(ValueError, match="rank"):
        HybridSubspace.from_layout(net, rank=0)
    with pytest.raises(ValueError, match="max_subspace_dim"):
        HybridSubspace.from_layout(net, rank=2, max_subspace_dim=0)
    with pytest.raises(ValueError, match="bases names unknown"):
        FactoredSubspace(net, bases={"nope": torch.zeros(1, 1)})
    with pytest.raises(ValueError, match=r"bases\['2.weight'\] must have shape"):
        FactoredSubspace(net, bases={"2.weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="not matrices"):
        FactoredSubspace(net, bases={"2.bias": torch.zeros(2, 12)})
    sub = HybridSubspace.from_layout(net, rank=2)
    with pytest.raises(ValueError, match="z must have shape"):
        sub.to_flat(torch.zeros(2, sub.dim + 1, dtype=F64))
    with pytest.raises(ValueError, match="subspace index must lie"):
        sub.split(torch.tensor([sub.dim]))
