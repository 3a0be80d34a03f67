"""Streamed attention == F.scaled_dot_product_attention: values and gradients, masks, errors."""
import pytest
import torch
import torch.nn.functional as F

import lazytensor as lt


def inputs(dtype, batch=(2, 3), L=13, S=17, d=8, dv=5):
    q = torch.randn(*batch, L, d, dtype=dtype, requires_grad=True)
    k = torch.randn(*batch, S, d, dtype=dtype, requires_grad=True)
    v = torch.randn(*batch, S, dv, dtype=dtype, requires_grad=True)
    return q, k, v


def compare(q, k, v, dtype, wrt=(), chunk=(4, 5), **kw):
    out = lt.attention(q, k, v, chunk_size=chunk, **kw)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    w = torch.randn_like(ref)
    tensors = [q, k, v, *wrt]
    for a, b in zip(torch.autograd.grad((out * w).sum(), tensors), torch.autograd.grad((ref * w).sum(), tensors)):
        torch.testing.assert_close(a, b, **tol)


def bool_mask(*shape):
    mask = torch.rand(*shape) > 0.3
    mask[..., 2, :] = False  # a query with no allowed key: zeros, like SDPA
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "case", ["plain", "causal", "bool", "bool-broadcast", "additive", "additive-key-padding", "scale", "one-tile"]
)
@pytest.mark.parametrize("dv", [5, 8])  # 8 = the query size: CPU tiles run ATen's fused kernel
def test_attention_matches_sdpa(dtype, case, dv):
    q, k, v = inputs(dtype, dv=dv)
    kw, wrt, chunk = {}, (), (4, 5) if case != "causal" else (5, 5)
    if case == "causal":
        kw = dict(is_causal=True)
    elif case == "bool":
        kw = dict(attn_mask=bool_mask(2, 3, 13, 17))
    elif case == "bool-broadcast":
        kw = dict(attn_mask=bool_mask(13, 17))
    elif case == "additive":
        mask = torch.randn(2, 1, 13, 17, dtype=dtype, requires_grad=True)
        kw, wrt = dict(attn_mask=mask), (mask,)
    elif case == "additive-key-padding":
        mask = torch.randn(2, 1, 1, 17, dtype=dtype, requires_grad=True)
        kw, wrt = dict(attn_mask=mask), (mask,)
    elif case == "scale":
        kw = dict(scale=0.3)
    elif case == "one-tile":
        chunk = None
    compare(q, k, v, dtype, wrt, chunk, **kw)


@pytest.mark.parametrize("dv", [5, 8])
def test_causal_with_more_keys_than_queries_and_three_dims(dv):
    q, k, v = inputs(torch.float64, batch=(3,), L=6, S=11, dv=dv)
    compare(q, k, v, torch.float64, is_causal=True)


@pytest.mark.parametrize("chunk", [(4, 5), (3, 3), None])
def test_fused_and_explicit_tiles_agree(chunk):
    """Rectangular causal tiles, masks with fully masked tile rows: both tile kernels give SDPA's answer."""
    q, k, v = inputs(torch.float64, L=21, S=23, dv=8)
    mask = bool_mask(21, 23)
    mask[..., 5:9, :12] = False  # rows empty in the first key tiles only
    compare(q, k, v, torch.float64, attn_mask=mask, chunk=chunk)
    compare(q, k, v, torch.float64, is_causal=True, chunk=chunk)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batch_dims_broadcast_as_in_sdpa(dtype):
    """One key/value head for several query heads, and queries broadcast over a batch of keys."""
    q, _, _ = inputs(dtype)
    _, k, v = inputs(dtype, batch=(2, 1))
    compare(q, k, v, dtype)
    compare(q, k, v, dtype, is_causal=True)
    q1, _, _ = inputs(dtype, batch=(1, 3))
    _, k2, v2 = inputs(dtype, batch=(2, 3))
    compare(q1, k2, v2[:1], dtype, attn_mask=bool_mask(2, 3, 13, 17))


def test_bad_inputs_are_named():
    q, k, v = inputs(torch.float32)
    with pytest.raises(ValueError, match="attn_mask"):
        lt.attention(q, k, v, attn_mask=torch.ones(13, 16, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        lt.attention(q, k, v, attn_mask=torch.ones(13, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="not both"):
        lt.attention(q, k, v, attn_mask=torch.ones(13, 17, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="feature size"):
        lt.attention(q, k[..., :4], v)
    with pytest.raises(ValueError, match="length"):
        lt.attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="batch dims of q, k, v must broadcast"):
        lt.attention(q, k[:, :2], v[:, :2])
    with pytest.raises(TypeError, match="dtypes"):
        lt.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="impl"):
        lt.attention(q, k, v, impl="fast")
    for chunk in (True, 0, (4, 0), 2.5, (4, 5, 6)):  # the engine's one chunk_size check (True is no size)
        with pytest.raises(ValueError, match="chunk_size"):
            lt.attention(q, k, v, chunk_size=chunk)
