"""Candidates scored across two gloo processes give the single-process losses and trajectory.

One spawn runs every check (starting processes dominates the cost). Each
rank scores a contiguous range of the candidates (uneven ranges cutting a
group in two, and a single candidate: one rank scores none); every rank must
get all the losses, equal to one process's, and train() must take the same
steps on both ranks as one process does (float64 MLP).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from polytope import CandidateBatch, CandidateGroup, NNCostEvaluator, train
from polytope.distributed import rank_range
from tests.ranks import run_on_ranks

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def problem():
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(F64)
    x = torch.randn(48, 4, generator=gen, dtype=F64)
    y = torch.sin(x.sum(1, keepdim=True))
    return model, nn.functional.mse_loss, x, y


def batch_of(model, counts):
    """A structured batch with a group of each count on different parameter blocks."""
    gen = torch.Generator().manual_seed(1)
    base = nn.utils.parameters_to_vector(model.parameters()).detach()
    groups = [CandidateGroup(torch.arange(3 * g, 3 * g + 5), 0.1 * torch.randn(c, 5, generator=gen, dtype=F64), {"block": g})
              for g, c in enumerate(counts)]
    return CandidateBatch(base, groups)


def params(model):
    return nn.utils.parameters_to_vector(model.parameters()).detach()


TRAINS = {  # train() options: the evaluator (default options), screening, and the closure fallback
    "evaluator": dict(radii=0.1),
    "screen": dict(radii=0.1, batch_size=16, radius_model=None,
                   multifidelity_screen={"screen_fidelity": 4, "num_probe": 16, "screen_keep_ratio": 0.5}),
    "closure": dict(radii=0.1, use_evaluator=False),
}


def _check(rank, world_size):
    world = dist.group.WORLD
    model, loss_fn, x, y = problem()
    for counts in ((3, 4, 0, 5), (1,)):  # 12 candidates split 6/6 inside the second group; 1: rank 1 scores none
        batch = batch_of(model, counts)
        ref = NNCostEvaluator(model, loss_fn).evaluate_batch(batch, x, y)
        got = NNCostEvaluator(model, loss_fn, group=world).evaluate_batch(batch, x, y)
        torch.testing.assert_close(got, ref, **TOL)
        flat = batch.materialize()
        torch.testing.assert_close(NNCostEvaluator(model, loss_fn, group=world).evaluate(flat, x, y),
                                   NNCostEvaluator(model, loss_fn).evaluate(flat, x, y), **TOL)
    for name, options in TRAINS.items():
        results = []
        for group in (None, world):
            model, loss_fn, x, y = problem()
            history = train(model, loss_fn, (x, y), steps=4, seed=0, progress=False, group=group, **options)
            results.append((params(model), torch.tensor(history.loss, dtype=F64)))
        (ref_p, ref_loss), (p, loss) = results
        torch.testing.assert_close(p, ref_p, **TOL, msg=lambda m, name=name: f"{name} parameters: {m}")
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m, name=name: f"{name} losses: {m}")
        assert not torch.equal(p, params(problem()[0])), f"{name}: train() did not move"
        both = [torch.empty_like(p) for _ in range(2)]
        dist.all_gather(both, p)
        assert torch.equal(both[0], both[1]), f"{name}: the ranks' parameters differ"
    with pytest.raises(TypeError, match="ProcessGroup"):
        NNCostEvaluator(model, loss_fn, group="world")


@pytest.mark.slow
def test_candidates_scored_across_ranks_equal_single_process():
    run_on_ranks(_check)


def test_rank_ranges_are_contiguous_balanced_and_may_be_empty():
    for count in (0, 1, 5, 12):
        for size in (1, 2, 3, 7):
            ranges = [rank_range(count, size, r) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_batch_rows_are_the_materialized_rows():
    model = problem()[0]
    batch = batch_of(model, (3, 4, 0, 5))
    dense = batch.materialize()
    for start, stop in ((0, 12), (2, 9), (6, 6), (7, 12), (3, 7)):
        assert torch.equal(batch.rows(start, stop).materialize(), dense[start:stop])


def test_group_without_an_initialised_process_group_is_a_clear_error():
    model, loss_fn, x, y = problem()
    with pytest.raises(RuntimeError, match="not initialised"):
        NNCostEvaluator(model, loss_fn, group=object())
    with pytest.raises(RuntimeError, match="not initialised"):
        train(model, loss_fn, (x, y), steps=1, progress=False, group=object())
