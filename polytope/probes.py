"""Probe placement: parameter blocks, their frames and bases, the candidates around the incumbent,
what a budget-limited step can afford to probe, and the record of one sweep (``ProbeRecord``).

Block ``p`` owns coordinates ``index_p`` (``m_p`` of them) and a frame of
dimension ``d_p <= m_p``, embedded by a basis ``R_p`` (``m_p x d_p``, orthonormal
columns). Its candidates are ``x + r_pk * D_p * (R_p v)`` for every vertex
``v`` and probe radius ``r_pk``; every other block stays at the incumbent.

``D_p`` is a diagonal metric, one scale per *segment* (the block's pieces of
its parameter tensors; ``D = 1`` unless the optimizer passes segments, which
``tensor_scales=True`` does). Each segment starts at its tensor's initial
spread (the initialisation's own per-layer scale), and the last random axis of
each new frame is drawn inside one segment, picked uniformly (orthonormalising
it against the earlier axes leaves a share of about ``d / m_p`` of it outside);
``follow_curvature`` then moves that segment's scale, a little per step, until
its curvature along that axis matches the mean curvature of the frame's mixed
axes: a Jacobi (diagonal) preconditioner per tensor, from the curvature the
radius model estimates anyway. Frame statistics, moves and momentum all live
in the scaled coordinates ``y = x / D``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .candidates import CandidateGroup
from .geometry import frame, procrustes, random_basis, vertex_count

ROTATIONS = ("random", "last_step", "none")
SCALE_LIMIT = 1e3  # segment scales stay within this factor of their geometric mean
STEER_RATE = 0.125  # share of the clipped log curvature mismatch a segment's scale moves by per update


def make_blocks(spec, group_tensors: list[list[tuple[int, int]]], subspace_blocks: list[int] | None) -> list[torch.Tensor]:
    """Coordinate index tensors of the blocks; blocks never cross parameter groups.

    ``group_tensors`` holds each group's tensors as (numel, ndim) in parameter
    order; ``subspace_blocks`` the subspace's own block sizes when there is a
    subspace (its coordinates then form the one group).
    """
    group_sizes = [sum(numel for numel, _ in tensors) for tensors in group_tensors]
    total = sum(group_sizes)
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in spec):
        if sum(spec) != total:
            raise ValueError(f"blocks sizes sum to {sum(spec)} but the search space has {total} coordinates")
        if not set(_cumsum(group_sizes)) <= set(_cumsum(spec)):
            raise ValueError(f"blocks sizes {list(spec)} cut across parameter groups (groups end at {_cumsum(group_sizes)})")
        sizes = list(spec)
    elif spec in ("tensor", "layer") and subspace_blocks is not None:
        if not subspace_blocks:
            raise ValueError(f"blocks={spec!r} needs a subspace with `block_sizes`; use 'all', an int or explicit sizes")
        sizes = list(subspace_blocks)
    elif spec in ("tensor", "layer", "all") or (isinstance(spec, int) and not isinstance(spec, bool) and spec > 0):
        sizes = [size for tensors, space in zip(group_tensors, group_sizes) for size in _group_blocks(spec, tensors, space)]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        raise ValueError(f"blocks as an int is a particle size and must be positive, got {spec}")
    else:
        raise ValueError(f"blocks must be 'tensor', 'layer', 'all', a positive int or a list of positive sizes, got {spec!r}")
    offsets = [0] + _cumsum(sizes)
    return [torch.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])]


def _group_blocks(spec, tensors: list[tuple[int, int]], space: int) -> list[int]:
    if spec == "all":
        return [space] if space else []
    if isinstance(spec, int):
        return [min(spec, space - start) for start in range(0, space, spec)]
    sizes: list[int] = []
    for numel, ndim in tensors:
        if numel == 0:
            continue  # an empty tensor has no coordinates to probe
        if spec == "layer" and ndim < 2 and sizes:
            sizes[-1] += numel  # biases and norms join the layer before them
        else:
            sizes.append(numel)
    return sizes


def tensor_segments(blocks: list[torch.Tensor], tensor_sizes: list[int]) -> list[list[int]]:
    """Each (contiguous) block's pieces of the parameter tensors it overlaps, as sizes in order."""
    ends = _cumsum(tensor_sizes)
    out = []
    for index in blocks:
        start, stop = int(index[0]), int(index[-1]) + 1
        cuts = [start] + [e for e in ends if start < e < stop] + [stop]
        out.append([b - a for a, b in zip(cuts[:-1], cuts[1:])])
    return out


def _cumsum(values) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


class Probes:
    """Frames, bases and last displacements per block; builds the candidate groups of a step."""

    def __init__(self, blocks: list[torch.Tensor], dims: list[int], polytope: str, generator: torch.Generator,
                 segments: list[list[int]] | None = None, spread: torch.Tensor | None = None):
        """``spread``: per coordinate, its tensor's initial spread (NaN where unknown), where the segment scales start."""
        self.blocks, self.dims, self.polytope, self.generator = blocks, dims, polytope, generator
        self._frames: dict[int, torch.Tensor] = {}
        self.segments = [[int(index.numel())] for index in blocks] if segments is None else [list(s) for s in segments]
        self.scales = [torch.ones(len(s), dtype=torch.float64) if spread is None or len(s) == 1 else self._start(p, spread)
                       for p, s in enumerate(self.segments)]
        self.aligned: list[int | None] = [None] * len(blocks)  # segment holding the frame's last axis
        self.bases = [self._basis(p, None) for p in range(len(blocks))]
        self.last_move = [torch.zeros(index.numel(), dtype=torch.float64) for index in blocks]

    @property
    def scaled(self) -> bool:
        """Whether any block has several segments (then the metric and its state exist)."""
        return any(len(s) > 1 for s in self.segments)

    def state_dict(self) -> dict[str, Any]:
        state = {"bases": [b.clone() for b in self.bases], "last_move": [m.clone() for m in self.last_move]}
        if self.scaled:  # only then: saves of the default layout keep the keys earlier versions wrote
            state.update(segment_scales=[s.clone() for s in self.scales], aligned_segments=list(self.aligned))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bases = [b.clone() for b in state["bases"]]
        self.last_move = [m.clone() for m in state["last_move"]]
        if self.scaled:
            self.scales = [s.clone() for s in state["segment_scales"]]
            self.aligned = list(state["aligned_segments"])

    def metric(self, p: int) -> torch.Tensor | None:
        """Block ``p``'s per-coordinate scale ``D_p``; None where the block is one segment (``D = 1``)."""
        if len(self.segments[p]) == 1:
            return None
        return self.scales[p].repeat_interleave(torch.tensor(self.segments[p]))

    def metric_vector(self, size: int) -> torch.Tensor | None:
        """``D`` over all ``size`` coordinates, or None when every block is one segment."""
        if not self.scaled:
            return None
        out = torch.ones(size, dtype=torch.float64)
        for p, index in enumerate(self.blocks):
            metric = self.metric(p)
            if metric is not None:
                out[index] = metric
        return out

    def _basis(self, p: int, bias: torch.Tensor | None) -> torch.Tensor:
        """A new basis for block ``p``; with several segments its last axis is drawn inside one of them."""
        size, d, sizes = self.blocks[p].numel(), self.dims[p], self.segments[p]
        if len(sizes) == 1 or d < 2:
            return random_basis(size, d, self.generator, bias=bias)
        segment = int(torch.randint(len(sizes), (1,), generator=self.generator))
        support = torch.ones(size, d, dtype=torch.float64)
        support[:, -1] = (torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes)) == segment).double()
        self.aligned[p] = segment
        return random_basis(size, d, self.generator, bias=bias, support=support)

    def follow_curvature(self, p: int, curvatures: torch.Tensor) -> None:
        """Move the scale of the segment holding block ``p``'s last axis toward the frame's mean curvature.

        ``curvatures`` are the per-axis curvatures of the probed axes (scaled
        coordinates). With ``c`` the last (aligned) axis's and ``c_mix`` the mean
        of the mixed random axes (the first axis is left out: it follows the
        last move, which favours flat directions), the segment's scale gets
        ``D_t *= clip(sqrt(c_mix / c), 1/2, 2)^STEER_RATE``, so at rest every
        tensor has the same curvature per scaled unit. The rate is small: the
        scales start at the tensors' spreads and leave them slowly (a fast walk to
        the Jacobi scales lost on ``digits-mlp``, docs/polytope.md). The scales are then normalised to
        a geometric mean of one over the coordinates (the probe scale keeps its
        meaning) and kept within ``SCALE_LIMIT`` of it; ``last_move`` follows into
        the new coordinates.
        """
        segment = self.aligned[p]
        if segment is None or curvatures.numel() < self.dims[p]:
            return
        mixed = curvatures[1:-1]
        mixed = mixed[mixed > 0]
        if not mixed.numel() or not float(curvatures[-1]) > 0.0:
            return
        old = self.metric(p)
        ratio = math.sqrt(float(mixed.mean()) / float(curvatures[-1]))
        log_scales = self.scales[p].log()
        log_scales[segment] += STEER_RATE * math.log(min(max(ratio, 0.5), 2.0))
        self.scales[p] = self._normalised(p, log_scales)
        self.last_move[p] = self.last_move[p] * old / self.metric(p)

    def _start(self, p: int, spread: torch.Tensor) -> torch.Tensor:
        """Block ``p``'s first segment scales: each its tensor's spread; a tensor of unknown spread (constant) starts
        at the block's typical one."""
        starts = torch.tensor(_cumsum([0] + self.segments[p][:-1])) + int(self.blocks[p][0])
        log_spread = spread[starts].log()
        known = log_spread.isfinite()
        if not known.any():
            return torch.ones(len(self.segments[p]), dtype=torch.float64)
        sizes = torch.tensor(self.segments[p], dtype=torch.float64)
        log_spread[~known] = (log_spread[known] * sizes[known]).sum() / sizes[known].sum()
        return self._normalised(p, log_spread)

    def _normalised(self, p: int, log_scales: torch.Tensor) -> torch.Tensor:
        """Scales from logs, at a geometric mean of one over block ``p``'s coordinates and within ``SCALE_LIMIT`` of it."""
        sizes = torch.tensor(self.segments[p], dtype=torch.float64)
        log_scales = log_scales - (log_scales * sizes).sum() / sizes.sum()
        return log_scales.clamp(-math.log(SCALE_LIMIT), math.log(SCALE_LIMIT)).exp()

    def frame(self, dim: int) -> torch.Tensor:
        if dim not in self._frames:
            self._frames[dim] = frame(self.polytope, dim)
        return self._frames[dim]

    def vertex_count(self, p: int, dim: int | None = None) -> int:
        return vertex_count(self.polytope, self.dims[p] if dim is None else dim)

    def rotate(self, rotation: str, carry: bool) -> list[torch.Tensor] | None:
        """New bases (replaced, never changed in place, so records and models can share them).

        Returns, when ``carry``, each block's Procrustes map ``Q`` taking frame
        coordinates ``z`` in the old basis to ``Q.T @ z`` in the new one.
        """
        if rotation == "none":
            return None
        maps = [] if carry else None
        for p in range(len(self.blocks)):
            bias = self.last_move[p] if rotation == "last_step" else None
            new = self._basis(p, bias)
            if carry:
                maps.append(procrustes(self.bases[p], new))
            self.bases[p] = new
        return maps

    def groups(self, radii: torch.Tensor, dtype: torch.dtype, active: list[int]) -> list[CandidateGroup]:
        """Per probed block and radius, the (V, m) displacements ``r * D * (frame @ basis.T)``.

        ``radii`` is (P, K); ``active[p]`` is the frame dimension probed this step
        (0 skips the block, less than ``dims[p]`` uses the leading basis axes).
        Big blocks make this memory-bound, so temporaries are avoided: the
        orthoplex frame is [I; -I], its displacements are the basis columns,
        cast and scaled in place, and their negatives.
        """
        out = []
        for p, (index, basis) in enumerate(zip(self.blocks, self.bases)):
            d = active[p]
            if d == 0:
                continue
            basis, metric = basis[:, :d], self.metric(p)
            for k, radius in enumerate(radii[p].tolist()):
                if self.polytope == "orthoplex":
                    delta = basis.new_empty(2 * d, index.numel(), dtype=dtype)
                    delta[:d] = basis.T
                    delta[:d] *= radius
                    if metric is not None:
                        delta[:d] *= metric.to(dtype)
                    torch.neg(delta[:d], out=delta[d:])
                else:
                    delta = self.frame(d).to(dtype) @ (radius * basis.T).to(dtype)
                    if metric is not None:
                        delta *= metric.to(dtype)
                out.append(CandidateGroup(index, delta, {"block": p, "radius_index": k, "radius": radius}))
        return out

    def unpack(self, flat: torch.Tensor, radius_count: int, active: list[int]) -> torch.Tensor:
        """Flat losses in group order -> (P, Vmax, K), +inf where a block has fewer (or no) probed vertices."""
        counts = [self.vertex_count(p, d) if d else 0 for p, d in enumerate(active)]
        width = max(self.vertex_count(p) for p in range(len(self.blocks)))
        out = torch.full((len(self.blocks), width, radius_count), torch.inf, dtype=torch.float64)
        offset = 0
        for p, count in enumerate(counts):
            size = count * radius_count
            out[p, :count, :] = flat[offset:offset + size].reshape(radius_count, count).T
            offset += size
        return out

    def vertices(self, active: list[int]) -> torch.Tensor:
        """(P, Vmax, dmax) probed frame vertices, zero-padded."""
        width = max(self.vertex_count(p) for p in range(len(self.blocks)))
        out = torch.zeros(len(self.blocks), width, max(self.dims), dtype=torch.float64)
        for p, d in enumerate(active):
            if d:
                out[p, : self.vertex_count(p, d), :d] = self.frame(d)
        return out

    def candidate_count(self, active: list[int], radius_count: int) -> int:
        return radius_count * sum(self.vertex_count(p, d) for p, d in enumerate(active) if d)

    def affordable(self, room: float, unit: float) -> list[int] | None:
        """Frame dimension probed per block: all of them, or (last step) what ``room`` pays for at ``unit`` evaluations
        per vertex: a random subset of whole blocks, else the leading axes of one; None: nothing fits."""
        dims = list(self.dims)
        if unit * self.candidate_count(dims, 1) <= room:
            return dims
        active, spent = [0] * len(dims), 0.0
        order = torch.randperm(len(dims), generator=self.generator).tolist()
        for p in order:
            cost = unit * self.vertex_count(p)
            if spent + cost <= room:
                active[p], spent = dims[p], spent + cost
        if not any(active):
            p = order[0]
            fits = [d for d in range(1, dims[p] + 1) if unit * self.vertex_count(p, d) <= room]
            if not fits:
                return None
            active[p] = fits[-1]
        return active


@dataclass
class ProbeRecord:
    """What one probe sweep saw; reusable while point, objective and configuration stay put."""

    point: torch.Tensor
    token: Any
    bases: list[torch.Tensor]
    radii: torch.Tensor  # (P, K) absolute radii
    losses: torch.Tensor  # (P, Vmax, K), +inf padding
    active: list[int]

    def state_dict(self) -> dict[str, Any]:
        return {"point": self.point.clone(), "token": self.token, "bases": [b.clone() for b in self.bases],
                "radii": self.radii.clone(), "losses": self.losses.clone(), "active": list(self.active)}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> "ProbeRecord | None":
        if state is None:
            return None
        return cls(state["point"].clone(), state["token"], [b.clone() for b in state["bases"]], state["radii"].clone(),
                   state["losses"].clone(), list(state["active"]))
