"""Freed tile buffers kept in the process: glibc's malloc thresholds fixed at the first CPU pass.

An eager pass allocates every tile's intermediates anew: hundreds of KB to a
few MB each, thousands of times a call. glibc's thresholds adapt to the
allocation history, and in some processes they settle where each tile's
buffers go back to the system and are page-faulted in again, zeroed: the
README's RBF product, eager, 8192^2, 2 threads, took 1.2-2.0 s a call with
220,000-310,000 page faults in such a process, 0.4-0.6 s in the others (3 of
9 fresh processes hit it; none of 7 with the thresholds fixed). The mmap
threshold sits above the tile buffers (eager intermediates within the eager
budget, at most 32 MiB in all, ``plan``; the quantile's 64 x 8192 x ranks index tiles):
at 4 MiB the quantile's 12 MiB tile buffers were mapped and page-faulted in
anew every tile (5.6 million faults a counting pass at 20000^2, 14 s against
5.6 s at 32 MiB); eager passes measured the same either way.

A process that states its own policy keeps it: ``LAZYTENSOR_KEEP_MALLOC=0``, or
glibc's thresholds set in the environment (``MALLOC_MMAP_THRESHOLD_`` and its
kin, or ``GLIBC_TUNABLES``). The memory tests force every block onto mmap that
way, so that freed memory leaves the RSS at once; overriding them there counted
retained heap as growth (105-357 MiB against a 60 MiB limit for the quantile),
while in a plain process the quantile's peak is the same either way.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_THRESHOLD_SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")  # what mallopt here would override


def _policy_stated_elsewhere() -> bool:
    """Whether the process already chose: our switch off, or glibc's thresholds set in its environment."""
    if os.environ.get("LAZYTENSOR_KEEP_MALLOC", "1").lower() in ("0", "false", "no"):
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(f"MALLOC_{name.upper()}_" in os.environ or f"glibc.malloc.{name}" in tunables for name in _THRESHOLD_SETTINGS)


@functools.cache
def keep_tile_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds unless the process chose its own (once); whether they are raised."""
    if _policy_stated_elsewhere() or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
