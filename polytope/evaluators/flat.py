"""Flat candidates -> groups: which tensors and which entries each candidate changes.

A closure hands the evaluator a dense ``(C, n)`` matrix even when every
candidate moves a few entries (a block of the optimizer, the last layer). One
pass compares it with the model's parameters, tensor by tensor in cache-sized
pieces: ``|candidate - base|``, reduced per candidate and tensor (which
tensors does it change?) and, when the delta paths can run, per candidate and
short run of entries (which runs does it move?). A few sampled entries per
tensor settle dense changes first: a candidate that moves all of them keeps
its own values there, and that tensor is not read in full for it (random
search and evolution strategies move everything). Candidates that move the same
runs form a group, as the blocks of a ``CandidateBatch`` would; a group whose
moved entries are few takes the delta form (base + differences on exactly
those entries), otherwise it keeps the candidates' own values of the tensors
it changes. Too many distinct run sets (scattered changes) fall back to one
group per set of changed tensors.

An entry is the base's only when ``candidate - base == 0``; anything else
(NaN included) counts as a change, so no change is ever dropped. Every
reduction is a float max of ``|difference|``: comparisons and boolean
reductions are several times slower on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..param_layout import ParameterLayout
from .chunking import memory_budget
from .groups import Group, delta_group

# Numbers differenced per piece on the CPU: the difference stays in cache. 2^18
# was fastest of 2^15 .. 2^20 on the hidden-256 MLPs of harness forward.
CPU_PIECE = 1 << 18
SAMPLE = 16  # entries per tensor read first to spot dense changes
RUN = 64  # entries per run (at least; larger when the run flags would exceed MAX_FLAGS)
MAX_FLAGS = 1 << 22


@dataclass
class Runs:
    """Runs of ``width`` consecutive entries of each tensor (the last run of a tensor may be shorter)."""

    layout: ParameterLayout
    width: int
    device: torch.device

    @classmethod
    def for_candidates(cls, layout: ParameterLayout, candidates: torch.Tensor) -> "Runs":
        """``RUN`` entries per run, doubled until the (C, runs) flags fit ``MAX_FLAGS``."""
        width = RUN
        while candidates.shape[0] * layout.n > MAX_FLAGS * width:
            width *= 2
        return cls(layout, width, candidates.device)

    def __post_init__(self):
        starts = [torch.arange(slot.start, slot.stop, self.width) for slot in self.layout.slots]
        self.offsets = [0]  # first run of each tensor
        for first in starts:
            self.offsets.append(self.offsets[-1] + first.numel())
        self.count = self.offsets[-1]
        self.starts = torch.cat(starts).to(self.device)
        stops = [(first + self.width).clamp(max=slot.stop) for first, slot in zip(starts, self.layout.slots)]
        self.stops = torch.cat(stops).to(self.device)

    def entries(self, runs: torch.Tensor) -> torch.Tensor:
        """Sorted flat indices of the entries in the given runs."""
        grid = self.starts[runs, None] + torch.arange(self.width, device=self.device)
        return grid[grid < self.stops[runs, None]]


def compare(candidates: torch.Tensor, base: torch.Tensor, layout: ParameterLayout, runs: Runs | None):
    """``|candidates - base|`` reduced to (C, S) max per candidate and tensor and, with ``runs``, (C, R) max per run.

    A matrix of at most one piece is differenced at once. For larger ones,
    ``SAMPLE`` entries spread over each tensor are read first: a candidate that
    moves all of them changes the tensor densely (it will keep its own values),
    so the rest of that tensor is not read for it and its runs are all marked.
    The other candidates are read in pieces of whole rows of one tensor, so the
    differences of all candidates never exist together (on the CPU a piece
    stays in cache); runs are only reduced for pieces that change something.
    ``x + (-b)`` is ``x - b`` exactly and broadcasts twice as fast on the CPU.
    """
    count, minus = candidates.shape[0], -base
    piece = CPU_PIECE if candidates.device.type == "cpu" else memory_budget(candidates.device) // (2 * candidates.element_size())
    tensors = candidates.new_zeros(len(layout.slots), count)
    moved = candidates.new_zeros(count, runs.count) if runs is not None else None
    whole = (candidates + minus).abs_() if candidates.numel() <= piece else None
    if whole is None:  # one buffer for every piece: fresh large allocations cost page faults on the CPU
        buffer = candidates.new_empty(max(min(max(1, piece // max(slot.numel, 1)), count) * slot.numel for slot in layout.slots))
    for s, slot in enumerate(layout.slots):
        if not slot.numel:
            continue
        own, largest = minus[slot.start : slot.stop], tensors[s]
        marks = None if moved is None else moved[:, runs.offsets[s] : runs.offsets[s + 1]]
        if whole is not None:
            rows, step = slice(0, count), count
        else:
            rows, step = _screen(candidates, minus, slot, largest, marks), max(1, piece // slot.numel)
        for a in range(0, _count(rows), step):
            part = _part(rows, a, min(a + step, _count(rows)))
            if whole is not None:
                diff = whole[part, slot.start : slot.stop]
            else:
                diff = buffer[: _count(part) * slot.numel].view(_count(part), slot.numel)
                torch.add(_take(candidates, part, slot.start, slot.stop), own, out=diff).abs_()
            largest[part] = torch.amax(diff, 1)
            if marks is not None and bool(largest[part].any()):
                marks[part] = _runs_max(diff, runs.width)
    return tensors.T, moved


def _screen(candidates, minus, slot, largest, marks):
    """The rows still to read for ``slot``: rows that move all of its sampled entries are settled here."""
    count, k = candidates.shape[0], min(SAMPLE, slot.numel)
    sampled = slice(slot.start, slot.start + k * (slot.numel // k), slot.numel // k)
    diff = (candidates[:, sampled] + minus[sampled]).abs_()
    dense = diff.amin(1) != 0
    if not bool(dense.any()):
        return slice(0, count)
    largest[dense] = diff.amax(1)[dense]
    if marks is not None:
        marks[dense] = 1
    rest = torch.nonzero(~dense).flatten()
    return _rows(rest)


def _runs_max(diff: torch.Tensor, width: int) -> torch.Tensor:
    """max over runs of ``width`` columns of ``diff`` (rows, w): (rows, ceil(w / width))."""
    rows, full = diff.shape[0], diff.shape[1] // width
    parts = [diff[:, : full * width].reshape(rows, full, width).amax(2)] if full else []
    if diff.shape[1] > full * width:
        parts.append(diff[:, full * width :].amax(1, keepdim=True))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def flat_groups(
    candidates: torch.Tensor, base: torch.Tensor, layout: ParameterLayout, *, coordinates: bool, sparse_fraction: float
) -> list[Group]:
    """Groups covering every candidate; with ``coordinates``, delta form where a group moves at most
    ``sparse_fraction`` of the tensors it changes."""
    count = candidates.shape[0]
    if not count:
        return []
    runs = Runs.for_candidates(layout, candidates) if coordinates else None
    tensors, moved = compare(candidates, base, layout, runs)
    changed = tensors != 0
    kinds = None
    if moved is not None:
        kinds = _kinds(moved != 0)
        if 2 * len(kinds) > count:  # scattered changes: groups by changed tensors, entries pooled
            kinds = None
    groups = []
    for rows, key in kinds if kinds is not None else _kinds(changed):
        slots = _true(changed[_first(rows)]) if kinds is not None else _true(key)
        if not slots:  # candidates equal to the base
            nothing = base.new_zeros(0, dtype=torch.long)
            groups.append(delta_group(layout, base, nothing, candidates.new_zeros(_count(rows), 0), rows))
            continue
        limit = sparse_fraction * sum(layout.slots[s].numel for s in slots)
        parts = []
        if moved is not None:
            touched = key if kinds is not None else _take(moved, rows, 0, runs.count).amax(0) != 0
            parts = _delta_parts(candidates, base, rows, runs.entries(torch.nonzero(touched).flatten()), limit)
        for part, cols, delta in parts or [(rows, None, None)]:
            if cols is not None and cols.numel() <= limit:
                groups.append(delta_group(layout, base, cols, delta, part))
            else:
                values = {s: _take(candidates, part, layout.slots[s].start, layout.slots[s].stop) for s in slots}
                groups.append(Group(base, _count(part), tuple(slots), part, values=values))
    return groups


def whole_groups(candidates: torch.Tensor, base: torch.Tensor, layout: ParameterLayout) -> list[Group]:
    """Every candidate as new values of every tensor, without comparing (for paths that write whole rows anyway)."""
    if not candidates.shape[0]:
        return []
    values = {s: candidates[:, slot.start : slot.stop] for s, slot in enumerate(layout.slots)}
    return [Group(base, candidates.shape[0], tuple(values), slice(0, candidates.shape[0]), values=values)]


def _delta_parts(candidates, base, rows, cols: torch.Tensor, limit: float) -> list:
    """(rows, moved entries, differences) for ``rows``, whose changes lie in ``cols``: one part per set of
    entries moved when such sets repeat (blocks finer than a run), else one. Empty when the first row alone
    moves more than ``limit`` entries: a dense change, whose other rows are then not gathered."""
    if cols.numel() > limit and int((_take_columns(candidates, _part(rows, 0, 1), cols) - base[cols]).count_nonzero()) > limit:
        return []
    delta = _take_columns(candidates, rows, cols) - base[cols]
    keep = delta.abs().amax(0) != 0
    cols, delta = cols[keep], delta[:, keep]
    kinds = _kinds(delta != 0)
    if len(kinds) == 1 or 2 * len(kinds) > delta.shape[0]:
        return [(rows, cols, delta)]
    positions = torch.arange(delta.shape[0], device=delta.device)
    return [(_within(rows, positions[members]), cols[kind], delta[members][:, kind]) for members, kind in kinds]


def _kinds(flags: torch.Tensor) -> list[tuple[slice | torch.Tensor, torch.Tensor]]:
    """(rows, flags) per distinct row of the boolean matrix ``flags``."""
    if bool((flags == flags[0]).all()):
        return [(slice(0, flags.shape[0]), flags[0])]
    kinds, inverse = torch.unique(flags, dim=0, return_inverse=True)
    return [(_rows(torch.nonzero(inverse == k).flatten()), kind) for k, kind in enumerate(kinds)]


def _true(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def _rows(index: torch.Tensor) -> slice | torch.Tensor:
    """Sorted row indices as a slice when they are consecutive (views instead of gathers)."""
    if not index.numel():
        return slice(0, 0)
    first, last = int(index[0]), int(index[-1])
    return slice(first, last + 1) if last - first + 1 == index.numel() else index


def _within(rows, members: torch.Tensor):
    """Rows ``members`` of the rows ``rows`` (a slice or an index), in the caller's numbering."""
    return _rows(members + rows.start) if isinstance(rows, slice) else rows[members]


def _first(rows) -> int:
    return rows.start if isinstance(rows, slice) else int(rows[0])


def _part(rows, a: int, b: int):
    """Rows ``a:b`` of the rows ``rows`` (a slice or an index)."""
    return slice(rows.start + a, rows.start + b) if isinstance(rows, slice) else rows[a:b]


def _count(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.numel()


def _take(matrix: torch.Tensor, rows, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of ``rows``: a view for consecutive rows."""
    if isinstance(rows, slice):
        return matrix[rows, start:stop]
    return matrix[:, start:stop].index_select(0, rows)


def _take_columns(matrix: torch.Tensor, rows, cols: torch.Tensor) -> torch.Tensor:
    if isinstance(rows, slice):
        return matrix[rows].index_select(1, cols)
    return matrix[rows[:, None], cols]
