"""Freed tile buffers stay in the process (glibc's malloc thresholds).

An eager pass allocates every tile's intermediates anew: hundreds of KB to a
few MB each, thousands of times a call. glibc serves blocks that size from
mmap or returns them to the system when the heap's free top passes its trim
threshold, so each tile page-faults its buffers in again, zeroed. At 8192^2
(the README's RBF product, eager, 2 threads) that was ~300,000 faults and
three quarters of the call: 1.6-2.0 s a call against 0.42-0.48 s with the
thresholds raised. ``keep_tile_buffers`` raises them once per process, at
the first pass: blocks up to ``MMAP_THRESHOLD`` come from the heap, and up to
``TRIM_THRESHOLD`` of free heap top is kept for the next tile. Set
``LAZYTENSOR_KEEP_MALLOC=0`` to leave the allocator as it is (other libcs
are left alone).
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def keep_tile_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether they are raised."""
    if os.environ.get("LAZYTENSOR_KEEP_MALLOC", "1").lower() in ("0", "false", "no") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
