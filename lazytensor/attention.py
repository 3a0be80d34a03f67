"""Streamed scaled-dot-product attention: online softmax over key tiles.

``out_i = sum_j softmax_j(scale q_i.k_j + mask_ij) v_j`` is a softmax-weighted
sum over j, evaluated the flash way: for a block of queries, key blocks are
visited one at a time, each score tile is a batched matrix product, and a
running maximum, normalizer and weighted sum are rescaled as new tiles
arrive. Only O(L d) state and one (queries x keys) tile per batch-head are
ever live; the log-sum-exp per query is saved for the backward pass, which
recomputes every score tile from it (P = exp(S - lse)) and accumulates
dQ, dK, dV (and the additive mask's gradient) tile by tile: L x S is never
stored. Semantics follow ``F.scaled_dot_product_attention``: boolean masks
mark allowed pairs, float masks are added to the scores, ``is_causal``
keeps key j <= query i, and a query with no allowed key returns zeros.
"""
from __future__ import annotations

import math

import torch

from .reductions.softmax import finite, merge

# Bytes of one score tile across all batch-heads: the tile loop's working set, kept near the
# L2 cache (B=1, H=4, L=S=4096, d=64 on 2 cores: 256 x 512 tiles ran 1.08x SDPA's time,
# whole-row 256 x 4096 tiles 1.47x).
TILE_BUDGET_BYTES = 2 << 20
KEY_BLOCK = 512
MIN_QUERY_BLOCK = 16


def _check(q, k, v, attn_mask, is_causal, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"attention: {name} must be float32 or float64, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"attention: {name} must be (..., length, features), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("attention: q, k, v must be on one device")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            "attention: batch dims of q, k, v must match, got "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"attention: k must have q's feature size {q.shape[-1]}, got {k.shape[-1]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention: v must have k's length {k.shape[-2]}, got {v.shape[-2]}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"attention: scale must be a finite number or None, got {scale!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"attention: is_causal must be a bool, got {type(is_causal).__name__}")
    if attn_mask is None:
        return
    if is_causal:
        raise ValueError("attention: pass either attn_mask or is_causal=True, not both")
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise TypeError(f"attention: attn_mask must be bool or {q.dtype} (q's dtype), got {attn_mask.dtype}")
    target = (*q.shape[:-1], k.shape[-2])
    try:
        torch.broadcast_shapes(attn_mask.shape, target)
        ok = torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attention: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {target}")


class _Tiles:
    """Flattened views and tile accessors shared by the forward and backward loops."""

    def __init__(self, q, k, v, attn_mask, is_causal, scale, chunk_size):
        self.batch_shape = q.shape[:-2]
        self.q, self.k, self.v = (t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:]) for t in (q, k, v))
        groups, self.L, _ = self.q.shape
        self.S = self.k.shape[1]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.causal = is_causal
        self.mask = None
        if attn_mask is not None:  # a broadcast view: tiles are sliced, never the full L x S
            self.mask = attn_mask.reshape((1,) * (q.dim() - attn_mask.dim()) + tuple(attn_mask.shape))
        if chunk_size is None:
            cols = max(1, min(self.S, KEY_BLOCK))
            rows = max(MIN_QUERY_BLOCK, TILE_BUDGET_BYTES // (max(groups, 1) * cols * q.element_size()))
        else:
            rows, cols = (chunk_size, chunk_size) if isinstance(chunk_size, int) else tuple(chunk_size)
            if rows < 1 or cols < 1:
                raise ValueError(f"attention: chunk_size must be positive, got {chunk_size}")
        self.rows, self.cols = max(1, min(rows, self.L)), max(1, min(cols, self.S))  # empty L or S: no tiles

    def blocks(self):
        for r0 in range(0, self.L, self.rows):
            yield r0, min(r0 + self.rows, self.L)

    def key_blocks(self, r0, r1):
        stop = min(self.S, r1) if self.causal else self.S  # causal: keys after the last query are out
        for c0 in range(0, stop, self.cols):
            yield c0, min(c0 + self.cols, stop)

    def _mask_index(self, r0, r1, c0, c1):
        rows = slice(r0, r1) if self.mask.shape[-2] != 1 else slice(None)
        cols = slice(c0, c1) if self.mask.shape[-1] != 1 else slice(None)
        return (..., rows, cols)

    def scores(self, r0, r1, c0, c1):
        """scale q k^T + mask on one tile, (G, rows, cols); disallowed pairs are -inf."""
        s = torch.matmul(self.q[:, r0:r1], self.k[:, c0:c1].transpose(1, 2)).mul_(self.scale)
        if self.mask is not None:
            tile = self.mask[self._mask_index(r0, r1, c0, c1)]
            tile = tile.expand(*self.batch_shape, r1 - r0, c1 - c0).reshape(s.shape)
            s = s.masked_fill_(~tile, -math.inf) if tile.dtype == torch.bool else s.add_(tile)
        if self.causal and c1 - 1 > r0:  # the tile crosses the diagonal
            above = torch.arange(c0, c1, device=s.device)[None, :] > torch.arange(r0, r1, device=s.device)[:, None]
            s = s.masked_fill_(above, -math.inf)
        return s

    def mask_grad_into(self, grad, ds, r0, r1, c0, c1):
        """Add a tile's score cotangent to the additive mask's gradient (summed over broadcast dims)."""
        index = self._mask_index(r0, r1, c0, c1)
        target = grad[index]
        target += ds.reshape(*self.batch_shape, r1 - r0, c1 - c0).sum_to_size(target.shape)


def _forward(tiles: _Tiles):
    """Each key tile's online-softmax state merged into the running one (``reductions.merge``)."""
    q, v = tiles.q, tiles.v
    out = q.new_zeros(*q.shape[:2], v.shape[-1])
    lse = q.new_full(q.shape[:2], -math.inf)
    for r0, r1 in tiles.blocks():
        state = None
        for c0, c1 in tiles.key_blocks(r0, r1):
            s = tiles.scores(r0, r1, c0, c1)
            top = s.amax(-1, keepdim=True)
            p = s.sub_(finite(top)).exp_()
            state = merge(state, (top, p.sum(-1, keepdim=True), torch.bmm(p, v[:, c0:c1])))
        if state is not None:  # a causal block before its first key has none
            top, total, acc = state
            out[:, r0:r1] = torch.where(total > 0, acc / total, 0.0)
            lse[:, r0:r1] = (torch.log(total) + finite(top))[..., 0]
    return out, lse


def _backward(tiles: _Tiles, out, lse, grad_out, want_mask_grad: bool):
    q, k, v = tiles.q, tiles.k, tiles.v
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dmask = torch.zeros_like(tiles.mask) if want_mask_grad else None
    grad_out = grad_out.reshape(out.shape)
    delta = (grad_out * out).sum(-1, keepdim=True)  # (G, L, 1): rowsum(dO * O)
    live = torch.isfinite(lse).unsqueeze(-1)  # queries with at least one allowed key
    lse = torch.where(live[..., 0], lse, 0.0).unsqueeze(-1)
    for r0, r1 in tiles.blocks():
        go, qb = grad_out[:, r0:r1], q[:, r0:r1]
        for c0, c1 in tiles.key_blocks(r0, r1):
            p = tiles.scores(r0, r1, c0, c1).sub_(lse[:, r0:r1]).exp_().mul_(live[:, r0:r1])
            dv[:, c0:c1].baddbmm_(p.transpose(1, 2), go)
            ds = torch.matmul(go, v[:, c0:c1].transpose(1, 2)).sub_(delta[:, r0:r1]).mul_(p)
            if dmask is not None:
                tiles.mask_grad_into(dmask, ds, r0, r1, c0, c1)
            dq[:, r0:r1].baddbmm_(ds, k[:, c0:c1], alpha=tiles.scale)
            dk[:, c0:c1].baddbmm_(ds.transpose(1, 2), qb, alpha=tiles.scale)
    return dq, dk, dv, dmask


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, chunk_size):
        tiles = _Tiles(q, k, v, attn_mask, is_causal, scale, chunk_size)
        out, lse = _forward(tiles)
        ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        ctx.options = (is_causal, scale, chunk_size)
        return out.reshape(*q.shape[:-1], v.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, attn_mask, out, lse = ctx.saved_tensors
        tiles = _Tiles(q, k, v, attn_mask, *ctx.options)
        want_mask = attn_mask is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dmask = _backward(tiles, out, lse, grad_out, want_mask)
        if dmask is not None:
            dmask = dmask.reshape(attn_mask.shape)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dmask, None, None, None


def streamed_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, *, chunk_size=None):
    """``F.scaled_dot_product_attention`` without the L x S score matrix, forward and backward."""
    _check(q, k, v, attn_mask, is_causal, scale)
    return _Attention.apply(q, k, v, attn_mask, is_causal, scale, chunk_size)
