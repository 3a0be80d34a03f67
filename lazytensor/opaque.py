"""``opaque``: ``torch.compiler.disable`` without importing Dynamo until a compiler exists; ``tracing``: whether one traces.

Building a formula and running a reduction must stay opaque to a caller's ``torch.compile`` (Dynamo
tracing sympy and the tile engine took 17 s at the first call, with two dozen warnings; as graph breaks
2.2 s). ``torch.compiler.disable`` gives that, but applying it imports ``torch._dynamo`` (1.4 s of
``import lazytensor``). Nobody can be compiling before ``torch._dynamo`` is imported, so the wrapper
``opaque`` returns calls the function directly until then, and through ``torch._dynamo.disable(fn)``
(made once, at the first call after) from then on. Dynamo itself never runs the wrapper: it carries
``_torchdynamo_disable`` (a traced call to it is a graph break, as for ``torch.compiler.disable``), and
its code is marked as a frame for Dynamo's frame hook to skip (what ``torch._dynamo.skip`` does), so
the call after the graph break goes straight to the disabled function. Dynamo's first import may happen
on another thread (the engine's first background compile), hence the import statement at the first call.
"""
from __future__ import annotations

import functools
import sys

import torch


def _skip_frames_of(code) -> bool:
    """Mark ``code``'s frames as skipped by Dynamo's frame hook, through the C extension (no Dynamo import)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
    except (ImportError, AttributeError, TypeError):
        return False
    return True


def opaque(fn):
    """``fn`` as an opaque call for ``torch.compile`` (``torch.compiler.disable``), Dynamo imported lazily."""
    disabled = []  # torch._dynamo.disable(fn), made at the first call once Dynamo is imported

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            import torch._dynamo  # a statement, not the attribute: waits for an import another thread has under way

            disabled.append(torch._dynamo.disable(fn))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # Dynamo graph-breaks at a traced call instead of inlining it
    call._torchdynamo_disable_msg = "lazytensor formulas and reductions are opaque to torch.compile"
    call._torchdynamo_orig_callable = fn  # Dynamo guards on fn, as for its own disable wrappers
    return call


def tracing() -> bool:
    """Whether a compiler traces this call: Dynamo (which reads this as True in its trace) or ``torch.export``.

    Not ``torch.compiler.is_compiling()``: its flag is the process's, set for as long as any thread
    compiles, so the eager tiles of a caller whose kernel compiled in a background thread took the
    traced branches meanwhile, and its formulas were recorded as if traced (``library``)."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()


if not _skip_frames_of(opaque(lambda: None).__code__):  # every wrapper shares this code object
    opaque = torch.compiler.disable  # noqa: F811 - an unknown torch: its own disable (imports Dynamo)
