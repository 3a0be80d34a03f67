"""Generic models: torch.func forwards with only the changed parameters batched.

``functional_call`` runs the model with some parameters replaced; under
``vmap`` only the replaced (candidate) tensors carry a batch dimension, so
every operation that does not depend on them (the prefix before the changed
site) runs once, unbatched, and only the changed site and what follows it run
per candidate. (When nothing can be vmapped, the sequential path runs the
candidates one at a time in the model's own tensors: ``inplace.py``.)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call


def as_args(inputs) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def call_with(model: nn.Module, params: dict, inputs):
    """``functional_call``, then every module's own parameters put back.

    torch swaps the tensors in and out name by name, so a module reachable
    under two names (one layer used twice) kept a candidate's tensors
    afterwards (torch 2.13): the model changed, or held an escaped vmap tensor.
    """
    saved = [(module, dict(module._parameters)) for module in model.modules()]
    try:
        return functional_call(model, params, as_args(inputs))
    finally:
        for module, own in saved:
            module._parameters.update(own)


def vmap_forward(model: nn.Module, fixed: dict, varying: dict, inputs) -> torch.Tensor:
    """Outputs ``(C, ...)`` of the model with ``varying`` tensors (C, *shape) batched."""

    def one(params):
        return call_with(model, {**fixed, **params}, inputs)

    return torch.func.vmap(one)(varying)


@contextmanager
def buffers_restored(model: nn.Module):
    """Undo in-place buffer updates (e.g. BatchNorm running statistics) made by candidate forwards."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


def activation_numel(model: nn.Module, inputs) -> int:
    """Elements of every module output in one forward: the activation storage per candidate."""
    total = 0

    def hook(_module, _args, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel()

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad(), buffers_restored(model):
            model(*as_args(inputs))
    finally:
        for h in handles:
            h.remove()
    return total
