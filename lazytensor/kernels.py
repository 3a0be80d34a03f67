"""Compiled tile kernels: one cache, one fallback.

A kernel is the generated tile function for a set of consumers, compiled by
torch.compile on a fixed tile shape (ragged tiles are padded by the engine, so
a new N or M never recompiles). Kernels are cached by (IR signature, dtype,
device, tile shape, backend). If compilation fails, the eager function takes
over for that key after one warning: a slow answer beats no answer, and the
warning says why it is slow.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch

from . import lower

_CACHE: dict[tuple, Callable] = {}
_LOCK = threading.Lock()


class CompileFallbackWarning(RuntimeWarning):
    """torch.compile failed for a tile kernel; the eager lowering runs instead."""


def _compiled(eager: Callable, label: str) -> Callable:
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    state = {"fn": compiled, "checked": False}

    def run(*args):
        if state["checked"]:
            return state["fn"](*args)
        try:
            out = compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
            warnings.warn(
                f"torch.compile failed for tile kernel {label} ({type(exc).__name__}: {exc}); running eager",
                CompileFallbackWarning,
                stacklevel=3,
            )
            state["fn"] = eager
            out = eager(*args)
        state["checked"] = True
        return out

    return run


def tile_kernel(consumers, info, order, *, key: tuple, compiled: bool) -> Callable:
    """The (cached) tile function for ``consumers`` under ``key``."""
    full_key = (key, compiled)
    with _LOCK:
        fn = _CACHE.get(full_key)
        if fn is None:
            label = f"{abs(hash(key)) % 10**8:08d}"
            eager = lower.build_tile_function(consumers, info, order, label)
            fn = _compiled(eager, label) if compiled else eager
            fn.source = eager.source
            _CACHE[full_key] = fn
    return fn


def cache_size() -> int:
    return len(_CACHE)


def compile_available() -> bool:
    """torch.compile needs a working C++ toolchain on CPU; allow opting out."""
    return os.environ.get("LAZYTENSOR_DISABLE_COMPILE", "") not in ("1", "true", "yes")
