"""pykeops's public API with KeOps's semantics, on lazytensor's engine (docs/keops.md).

    import lazytensor.keops
    lazytensor.keops.install()        # from now on `import pykeops` is this module
    import gpytorch, geomloss          # their KeOps code paths run on lazytensor

or set ``TP_KEOPS=1`` in the environment: ``import lazytensor`` then installs it
(``TP_KEOPS=auto``: only where the real pykeops is not importable). Packages
that imported pykeops before ``install()`` keep the real one.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from . import config, genred, lazy, numpy, references, torch
from .genred import Genred, KernelSolve, generic_argkmin, generic_argmin, generic_logsumexp, generic_sum
from .lazy import LazyTensor, Pm, Vi, Vj

__version__ = "2.3"  # the pykeops API this layer follows
ENVIRONMENT_VARIABLE = "TP_KEOPS"
_MODULES = {"pykeops": __name__, "pykeops.config": config.__name__,
            "pykeops.torch": torch.__name__, "pykeops.torch.cluster": torch.cluster.__name__,
            "pykeops.numpy": numpy.__name__, "pykeops.numpy.cluster": numpy.cluster.__name__,
            # where pykeops's own tests import from: its dense references and its operations module
            "pykeops.numpy.utils": references.__name__, "pykeops.torch.utils": references.__name__,
            "pykeops.torch.operations": torch.__name__, "pykeops.numpy.operations": numpy.__name__}
_saved: dict = {}


def install(force: bool = True) -> bool:
    """Make ``import pykeops`` (and ``pykeops.torch``, ``pykeops.numpy``, their ``cluster``, ``utils`` and
    ``operations``) resolve to this module.

    With ``force=False`` nothing changes where the real pykeops is importable.
    Returns whether the mapping is in place. ``uninstall()`` restores the previous modules.
    """
    if installed():
        return True
    if not force and _real_pykeops_available():
        return False
    for name, ours in _MODULES.items():
        if name in sys.modules:
            _saved[name] = sys.modules[name]
        sys.modules[name] = sys.modules[ours]
    return True


def uninstall() -> None:
    """Undo ``install()``: the modules that were there before (the real pykeops, if it had been imported) come back."""
    if not installed():
        return
    for name in _MODULES:
        sys.modules.pop(name, None)
    sys.modules.update(_saved)
    _saved.clear()


def installed() -> bool:
    return sys.modules.get("pykeops") is sys.modules[__name__]


def _real_pykeops_available() -> bool:
    return "pykeops" in sys.modules or importlib.util.find_spec("pykeops") is not None


def install_from_environment() -> None:
    """``TP_KEOPS=1`` installs, ``TP_KEOPS=auto`` installs where the real pykeops is absent, unset or 0 does nothing."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        install()
    elif value == "auto":
        install(force=False)
    elif value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE} must be 1, auto or 0, got {os.environ[ENVIRONMENT_VARIABLE]!r}")


def set_verbose(level) -> None:
    """Accepted for pykeops compatibility: there is no build to report on."""


def clean_pykeops() -> None:
    """Accepted for pykeops compatibility: there is no KeOps build cache (compiled kernels live in Inductor's cache)."""


def get_build_folder() -> str:
    """pykeops's build folder: none here; Inductor's cache directory is the nearest thing."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # another torch's layout
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    return cache_dir()


def set_build_folder(path=None) -> None:
    """Accepted for pykeops compatibility: kernels are built by Inductor, in its own cache."""


def _check_bindings(flavour, points) -> None:
    """One reduction whose value is known: sum_j |x_i - x_j| over the points 0, 1, 3."""
    got = (flavour.Vi(points) - flavour.Vj(points)).abs().sum(axis=1)
    if [float(v) for v in got.reshape(-1)] != [4.0, 3.0, 5.0]:
        raise RuntimeError(f"pykeops bindings check failed: got {got}, expected [4, 3, 5]")
    print(f"pyKeOps with {flavour.__name__.rsplit('.', 1)[-1]} bindings is working (on lazytensor)!")


def test_torch_bindings() -> None:
    """pykeops's install check: one small reduction against its known value."""
    import torch as torch_module

    _check_bindings(torch, torch_module.tensor([[0.0], [1.0], [3.0]]))


def test_numpy_bindings() -> None:
    """pykeops's install check for the NumPy flavour."""
    import numpy as numpy_module

    _check_bindings(numpy, numpy_module.array([[0.0], [1.0], [3.0]]))


__all__ = ["install", "uninstall", "installed", "LazyTensor", "Vi", "Vj", "Pm", "Genred", "KernelSolve", "generic_sum",
           "generic_logsumexp", "generic_argmin", "generic_argkmin", "torch", "numpy", "genred", "lazy"]
