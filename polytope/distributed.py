"""Candidates scored across processes (``torch.distributed``): each rank scores a contiguous range.

The optimizer itself is replicated: every rank draws the same probes from the
same seed and hands the same candidates to its objective. Only the scoring is
split: rank r scores candidates ``[C r / P, C (r + 1) / P)`` (a rank may get
none) and one all-gather of the C losses (``lazytensor``'s ``Sharding.gather_rows``)
gives every rank all of them in candidate order, so every rank takes the same
step and ends with the same parameters.
"""
from __future__ import annotations

from typing import Callable

import torch


def sharding(group):
    """The ``Sharding`` of ``group`` (a ``torch.distributed`` ProcessGroup), or None when ``group`` is None."""
    if group is None:
        return None
    import torch.distributed as dist

    from lazytensor.distributed import Sharding

    if dist.is_available() and dist.is_initialized() and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD) or None, "
                        f"got {type(group).__name__}")
    return Sharding(group)  # a clear RuntimeError when torch.distributed is not initialised


def rank_range(count: int, size: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous, balanced share ``[start, stop)`` of ``count`` candidates."""
    return count * rank // size, count * (rank + 1) // size


def scored(shards, count: int, score: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """(count,) losses: ``score(start, stop)`` on this rank's range, all-gathered (``shards`` None: everything here)."""
    if shards is None:
        return score(0, count)
    local = score(*rank_range(count, shards.size, shards.rank))
    losses, _ = shards.gather_rows(local)
    return losses
