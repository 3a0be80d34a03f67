"""Half precision (bfloat16, float16): evaluated and accumulated in float32, returned in the input dtype.

A half-precision formula keeps 8 (bfloat16) or 11 (float16) bits of mantissa:
summed over thousands of j in its own dtype, a reduction loses every digit
(KeOps's ``dtype_acc`` exists for this). Inputs are O(N + M), so the engine
widens them once to float32 on entry (a differentiable cast: gradients
return in the input dtype), runs every pass in float32, and narrows the
floating results on the way out. The result is the float32 result of the
rounded inputs, rounded once: within half precision of the float32 one.
"""
from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def widened(t):
    """A half-precision tensor as float32 (anything else as it is)."""
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t


def narrowed(t, dtype: torch.dtype):
    """A floating result in ``dtype`` when that is a half precision (indices and the rest as they are)."""
    return t.to(dtype) if dtype in HALF and isinstance(t, torch.Tensor) and t.is_floating_point() else t
