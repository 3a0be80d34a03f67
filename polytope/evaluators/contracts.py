"""Which evaluation contracts a layer supports.

The fast paths rely on promises about a layer's forward. Builtin layers are
known; a custom layer declares its promises with a class (or instance)
attribute::

    class MyLinear(nn.Module):
        polytope_contracts = frozenset({"linear", "vmap"})

Contracts:

``"linear"``
    The layer owns ``weight`` of shape ``(out, in)`` and an optional ``bias``
    of shape ``(out,)`` (no other parameters) and computes
    ``x @ weight.T + bias`` over the last dimension. Sequential models made of
    such layers and ``"elementwise"`` layers get the delta, subspace, factored
    and dense batched paths.
``"elementwise"``
    The layer has no parameters and maps every entry independently (any
    leading dimensions pass through), so a change confined to a few units stays
    confined to them.
``"vmap"``
    The forward is safe under ``torch.func.vmap`` (no in-place updates of
    buffers, no data-dependent Python control flow). Undeclared layers are tried
    under vmap and fall back to the sequential path if that fails.
``"sequential"``
    Never vmap this layer: models containing it use the sequential path.
"""
from __future__ import annotations

from torch import nn

LINEAR = "linear"
ELEMENTWISE = "elementwise"
VMAP = "vmap"
SEQUENTIAL = "sequential"
KNOWN = frozenset({LINEAR, ELEMENTWISE, VMAP, SEQUENTIAL})

_ELEMENTWISE_BUILTINS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.LogSigmoid, nn.Identity,
)


def contracts_of(module: nn.Module) -> frozenset[str]:
    """The contracts ``module`` supports: declared ones, else those known for builtins."""
    declared = getattr(module, "polytope_contracts", None)
    if declared is not None:
        if isinstance(declared, str) or not all(isinstance(c, str) for c in declared):
            raise TypeError(
                f"{type(module).__name__}.polytope_contracts must be a set of strings from {sorted(KNOWN)}, got {declared!r}"
            )
        unknown = set(declared) - KNOWN
        if unknown:
            raise ValueError(f"{type(module).__name__}.polytope_contracts has unknown contracts {sorted(unknown)}; "
                             f"known: {sorted(KNOWN)}")
        return frozenset(declared)
    if type(module) is nn.Linear:
        return frozenset({LINEAR, VMAP})
    if isinstance(module, _ELEMENTWISE_BUILTINS):
        return frozenset({ELEMENTWISE, VMAP})
    if isinstance(module, nn.Dropout) and (module.p == 0 or not module.training):
        return frozenset({ELEMENTWISE, VMAP})
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training and module.track_running_stats:
        return frozenset({SEQUENTIAL})  # updates running statistics in place
    return frozenset()


def vmap_forbidden(model: nn.Module) -> bool:
    """True when some layer of ``model`` declares it must not run under vmap."""
    return any(SEQUENTIAL in contracts_of(m) for m in model.modules())
