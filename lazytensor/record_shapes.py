"""The shapes of a decoded record (``library``'s key), read without running it: the outputs' leading sizes that
the operators' fake implementation gives, and the pairs and widest intermediate that decide whether a
reduction is traced into the caller's graph (``library.inlined``)."""
from __future__ import annotations

import math

import torch


def nodes(node):
    """Every tuple of a decoded record, depth first."""
    if isinstance(node, tuple):
        yield node
        for part in node[1:]:
            yield from nodes(part)


def widest(node, reduced: str | None, shapes: tuple) -> int:
    """The entries of a one-tile pass's widest intermediate, bounded as ``plan`` bounds an eager tile's: its pairs
    times the widest feature size (of its variables, and its tensor arguments': a vector's is 1) plus two."""
    width = max([shapes[k][-1] if axis != "tensor" or len(shapes[k]) > 1 else 1 for axis, k in leaves(node, False)
                 if shapes[k]] + [1])
    return pairs(node, reduced, [torch.empty(shape, device="meta") for shape in shapes]) * (width + 2)


def pairs(node, reduced: str | None, tensors: list) -> int:
    """The pairs a reduction evaluates: batch x rows x columns (a named operator's: its first two tensors' rows)."""
    if reduced is None:
        batch, rows, _ = leading_call(node, tensors)
        first, second = (tensor_positions(node[3]) + [None, None])[:2]
        return math.prod(batch) * rows * (tensors[second].shape[-2] if second is not None else 1)
    batch, rows, _ = leading(node, reduced, tensors)
    _, _, _, formula, args, kwargs = node
    arguments = [(reduced if axis == "tensor" else axis, k) for axis, k in leaves(("arguments", args, kwargs), False)]
    columns = next((tensors[k].shape[-2] for axis, k in [*leaves(formula, False), *arguments] if axis == reduced), 1)
    return math.prod(batch) * rows * columns


def leading(node, reduced: str, tensors) -> tuple:
    """The outputs' batch shape and rows (of the axis not ``reduced``), and the tensors that only hold that axis's
    rows (none in a solve). Tensors among the reduction's arguments (``K @ b``'s b, weights, values) lie along the
    reduced axis."""
    _, _, name, formula, args, kwargs = node
    rows = "i" if reduced == "j" else "j"
    arguments = [(reduced if axis == "tensor" else axis, k) for axis, k in leaves(("arguments", args, kwargs), False)]
    variables = list(leaves(formula, False)) + arguments
    shapes = [tensors[k].shape[:-1] if axis == "p" else tensors[k].shape[:-2] for axis, k in variables
              if axis != "tensor" and tensors[k].dim() >= (1 if axis == "p" else 3)]
    batch = torch.broadcast_shapes(*shapes) if shapes else ()
    size = next((tensors[k].shape[-2] for axis, k in variables if axis == rows), 1)
    shrunk = {k for axis, k in variables if axis == rows} - {k for axis, k in variables if axis != rows}
    return tuple(batch), size, set() if name == "solve" else shrunk  # a solve's rows are its columns


def leading_call(node, tensors) -> tuple:
    """``leading`` for a named operator: the batch of its tensors, the rows of its first (queries, points)."""
    _, _, _, args, kwargs = node
    used = tensor_positions(node)
    first = tensor_positions(args)[0]
    batch = torch.broadcast_shapes(*[tensors[k].shape[:-2] for k in set(used) if tensors[k].dim() >= 3])
    return tuple(batch), tensors[first].shape[-2], {first} if used.count(first) == 1 else set()


def leaves(node, flipped: bool):
    """(axis, tensor position) of every variable of a formula record, transposes applied."""
    if not isinstance(node, tuple):
        return
    if node[:2] == ("lazy", "var"):
        axis = {"i": "j", "j": "i"}.get(node[2], node[2]) if flipped else node[2]
        yield axis, node[3][1]
        return
    if node[0] == "tensor":
        yield "tensor", node[1]
        return
    flip = flipped != (node[:3] == ("lazy", "call", "t"))
    for part in node[1:]:
        yield from leaves(part, flip)


def tensor_positions(node) -> list:
    return [k for axis, k in leaves(node, False) if axis == "tensor"]
