"""Causal attention with O(L x d) memory, same semantics as F.scaled_dot_product_attention.

Run: .venv/bin/python docs/examples/attention.py
"""
import torch

import lazytensor as lt

torch.manual_seed(0)
B, H, L, d = 2, 4, 300, 32
q, k, v = (torch.randn(B, H, L, d, dtype=torch.float64, requires_grad=True) for _ in range(3))

out = lt.attention(q, k, v, is_causal=True, chunk_size=64)  # key tiles of 64, online softmax
ref = lt.attention(q, k, v, is_causal=True, impl="dense")  # F.scaled_dot_product_attention
torch.testing.assert_close(out, ref)

# A boolean mask (True = attend) works the same way; here every query sees the first 100 keys.
mask = torch.zeros(L, L, dtype=torch.bool)
mask[:, :100] = True
torch.testing.assert_close(lt.attention(q, k, v, attn_mask=mask), lt.attention(q, k, v, attn_mask=mask, impl="dense"))

w = torch.randn_like(out)
grads = torch.autograd.grad((out * w).sum(), [q, k, v])  # streamed backward: scores recomputed per tile
grads_ref = torch.autograd.grad((ref * w).sum(), [q, k, v])
for a, b in zip(grads, grads_ref):
    torch.testing.assert_close(a, b)
print(f"attention: {tuple(out.shape)} causal and masked values and q/k/v gradients match SDPA")
