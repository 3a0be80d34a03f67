"""Candidates scored across processes (``torch.distributed``): each rank scores a contiguous range.

The optimizer itself is replicated: every rank draws the same probes from the
same seed and hands the same candidates to its objective. Only the scoring is
split: rank r scores candidates ``[C r / P, C (r + 1) / P)`` (a rank may get
none) and one all-gather of the losses (``Ranks.gather``) gives every rank all
C of them in candidate order, so every rank takes the same step and ends with
the same parameters. The split is polytope's own (no dependency on
``lazytensor.distributed``, whose shards are data, not candidates).
"""
from __future__ import annotations

from typing import Callable

import torch


class Ranks:
    """A process group seen as ranks that each score their range of the candidates."""

    def __init__(self, group):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("polytope: group= needs torch.distributed, which is not initialised "
                               "(call torch.distributed.init_process_group first, e.g. under torchrun)")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD) or None, "
                            f"got {type(group).__name__}")
        self.dist, self.group = dist, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def gather(self, local: torch.Tensor, count: int) -> torch.Tensor:
        """Every rank's ``rank_range`` of ``count`` losses, in rank order: one all-gather, padded to the longest range."""
        lengths = [stop - start for start, stop in (rank_range(count, self.size, r) for r in range(self.size))]
        longest = max(lengths)
        padded = torch.cat([local, local.new_zeros(longest - local.shape[0])]).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:length] for part, length in zip(parts, lengths)])


def ranks(group) -> Ranks | None:
    """The ``Ranks`` of ``group`` (a ``torch.distributed`` ProcessGroup), or None when ``group`` is None."""
    return None if group is None else Ranks(group)


def rank_range(count: int, size: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous, balanced share ``[start, stop)`` of ``count`` candidates."""
    return count * rank // size, count * (rank + 1) // size


def scored(shards: Ranks | None, count: int, score: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """(count,) losses: ``score(start, stop)`` on this rank's range, all-gathered (``shards`` None: everything here)."""
    if shards is None:
        return score(0, count)
    return shards.gather(score(*rank_range(count, shards.size, shards.rank)), count)
