"""Freed tile buffers stay in the process (glibc's malloc thresholds).

An eager pass allocates every tile's intermediates anew: hundreds of KB to a
few MB each, thousands of times a call. glibc's thresholds adapt to the
allocation history, and in some processes they settle where each tile's
buffers go back to the system and are page-faulted in again, zeroed: the
README's RBF product, eager, 8192^2, 2 threads, took 1.2-2.0 s a call with
220,000-310,000 page faults in such a process, 0.4-0.6 s in the others (3 of
9 fresh processes hit it). ``keep_tile_buffers`` fixes the thresholds once
per process, at the first CPU pass: blocks up to ``MMAP_THRESHOLD`` come from
the heap, and up to ``TRIM_THRESHOLD`` of free heap top is kept for the next
tile (no run with them fixed showed the slow case, 0 of 6). Set
``LAZYTENSOR_KEEP_MALLOC=0`` to leave the allocator as it is (other libcs are
left alone).
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
