"""Freed tile buffers kept in the process (glibc's malloc thresholds): opt-in, ``LAZYTENSOR_KEEP_MALLOC=1``.

An eager pass allocates every tile's intermediates anew: hundreds of KB to a
few MB each, thousands of times a call. glibc's thresholds adapt to the
allocation history, and in some processes they settle where each tile's
buffers go back to the system and are page-faulted in again, zeroed: the
README's RBF product, eager, 8192^2, 2 threads, took 1.2-2.0 s a call with
220,000-310,000 page faults in such a process, 0.4-0.6 s in the others (3 of
9 fresh processes hit it; none of 7 with the thresholds fixed). Fixing them
costs memory elsewhere: the exact quantile's peak growth in the memory test
(N, M = 12000, 6000) went from under 60 MiB to 105-357 MiB (heap fragments
the system no longer gets back). Until that is understood the setting is
off by default; ``keep_tile_buffers`` applies it once per process, at the
first CPU pass, when ``LAZYTENSOR_KEEP_MALLOC=1`` (glibc only).
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def keep_tile_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds if asked (once per process); whether they are raised."""
    if os.environ.get("LAZYTENSOR_KEEP_MALLOC", "0").lower() not in ("1", "true", "yes") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
