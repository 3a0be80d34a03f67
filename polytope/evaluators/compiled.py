"""Compiled call sites that fall back to eager execution, once, with a warning."""
from __future__ import annotations

import warnings

import torch

from .chunking import is_out_of_memory


class CompiledSite:
    """``fn`` compiled with ``torch.compile`` when enabled; eager after the first compile failure.

    A failure disables only this site; the call that failed is rerun eagerly,
    so callers always get a result (or the eager error, if ``fn`` itself fails).
    """

    def __init__(self, fn, name: str, enabled: bool, **compile_kwargs):
        self.fn = fn
        self.name = name
        self.enabled = enabled
        self.compile_kwargs = compile_kwargs
        self._compiled = None
        self.failed = False

    @property
    def active(self) -> bool:
        return self.enabled and not self.failed

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self.fn(*args, **kwargs)
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, **self.compile_kwargs)
            return self._compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eagerly
            if is_out_of_memory(exc):
                raise
            self.failed = True
            warnings.warn(
                f"compiling the {self.name} evaluation failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "running it eagerly from now on",
                stacklevel=2,
            )
            return self.fn(*args, **kwargs)
