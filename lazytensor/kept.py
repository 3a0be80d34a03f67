"""Values a call derives from its structure alone, kept for the calls that repeat that structure.

A formula evaluated in a loop builds the same reduction objects, pass set-up
and problem layout every call; each is kept under a key of everything it is
built from (expressions, axes, shapes, dtypes, devices), so a new size, dtype
or constant builds its own. A build that raises is not kept.
"""
from __future__ import annotations

from typing import Callable


class Kept:
    """Built values by key; past ``limit`` entries the oldest goes first."""

    def __init__(self, limit: int = 1024):
        self.limit, self._values = limit, {}

    def get(self, key, build: Callable):
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = build()
            if len(self._values) > self.limit:
                del self._values[next(iter(self._values))]
        return value

    def __len__(self) -> int:
        return len(self._values)
