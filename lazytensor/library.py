"""Formulas inside ``torch.compile`` and ``torch.export``: a reduction is one ``torch.library`` operator.

Why: building a formula is sympy work that Dynamo cannot usefully trace, and the engine's tile loop
and its caches cannot take symbolic sizes; as opaque calls (``torch.compiler.disable``) they break
the caller's graph. So while a compiler traces (``tracing()``, also under
``torch.export``), ``Vi`` / ``Vj`` / ``Pm`` / ``lazy`` / ``where`` return a ``Deferred``: a plain
record of the calls made on it, cheap for Dynamo to trace. A reduction turns the record into a key,
a Python literal in which every tensor is its position in one list, and calls
``lazytensor::reduce(key, tensors)``, one node in the graph. Its implementation replays the record on
the real tensors as an ordinary LazyTensor (the eager path, unchanged); its fake implementation
replays it on zeros with one row to learn the outputs' trailing shape and dtype, and takes their
batch and row sizes (symbolic under export) from the inputs; its derivative is
``lazytensor::reduce_vjp``: the engine's own streamed backward of the replay. Where a gradient will
flow (known while tracing), the forward replays with autograd on and leaves the graph on its outputs,
so the backward runs only the backward's passes, as eagerly. The key needs no registry, so an exported program runs in a new
process once ``lazytensor.library`` is imported. A named operator (``rbf_matmul``, ``attention``, ...) is
one such node too, its call replayed as a whole.

A small reduction of static sizes under ``torch.compile`` is no opaque operator: its node,
``lazytensor::replay``, is a composite that the compiler decomposes into the replay's own ATen calls
(``inlined``), where the engine, seeing fake tensors (``Problem.traced``), runs one tile without a loop,
forward and backward, and Inductor fuses them with the code around: a compiled N = 200 training step ran 5x
faster than eagerly, where the operator ran 1.3x slower.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import operator

import torch

from . import aot, lazy_tensor, ops, parse, plan, record_shapes, run, variables
from .lazy_tensor import LazyTensor
from .opaque import tracing

# The methods of a formula that reduce it (sum, min, ... over the feature axis give formulas).
REDUCTIONS = ("sum", "logsumexp", "max_sumshiftexp", "softmax_weighted_sum", "min", "argmin", "min_argmin", "max",
              "argmax", "max_argmax", "kmin", "argkmin", "kmin_argkmin", "quantile", "matmul", "matvec", "rmatvec",
              "solve")
FEATURE_REDUCTIONS = ("sum", "min", "argmin", "max", "argmax")
# every spelling of a reduction (KeOps's too: ``sum_reduction``, ``Kmin``, ``__matmul__``) -> its name in REDUCTIONS
_REDUCTION_OF = {name: reduction for name, value in vars(LazyTensor).items() for reduction in REDUCTIONS
                 if getattr(LazyTensor, reduction) is value}
OPERATORS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
             "__pow__", "__rpow__", "__neg__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
             "__or__", "__ror__", "__getitem__", "__matmul__")
NAMED_OPERATORS = ("distance_sum", "rbf_matmul", "distance_quantile", "kernel_regression", "knn_regression", "attention")
# the functions a record may call: formulas (recorded) and named operators (one node each)
FUNCTIONS = {"where": lazy_tensor.where, "formula": parse.formula, **{name: getattr(ops, name) for name in NAMED_OPERATORS}}
# The operators' arguments and derivative; in every key, so that compile caches, which key a graph by its
# forward only, and exported programs never pair a key with operators of another version.
KEY_VERSION = 4
# A reduction of static sizes whose widest intermediate, over all its pairs, takes at most this many bytes (the
# largest eager tile's budget) is traced into the caller's compiled graph (``inlined``); 0 turns that off.
INLINE_MAX_BYTES = plan.EAGER_BUDGET_GROWTH * plan.TILE_BUDGET_BYTES
_ROUTE_OPTIONS = ("backend", "chunk_size", "ranges", "group")
_replaying = [0]  # > 0 while a record is replayed (non-strict export traces the replay with tracing() true)


def recording() -> bool:
    """Whether formulas are recorded: a compiler traces, and no record is being replayed."""
    return tracing() and not _replaying[0]


def named_operator(name: str, args: tuple, kwargs: dict):
    """The named operator ``ops.<name>(*args, **kwargs)`` as one ``lazytensor::reduce`` node."""
    return _operator(Deferred(("fn", name, args, kwargs), 0), None)


def _operator(record: "Deferred", reduced: str | None):
    """The reduction ``record`` (reducing axis ``reduced``; None for a named operator) as one operator node, or
    traced into the caller's graph where it is small (``inlined``)."""
    tensors = []
    key = record_key(record, reduced, tensors)
    from torch.fx.experimental.symbolic_shapes import has_static_value  # imported by the compiler that traces this

    if not torch.compiler.is_exporting() and all(has_static_value(d) for t in tensors for d in t.shape) and \
            inlined(key, tuple(tuple(t.shape) for t in tensors), max(t.dtype.itemsize for t in tensors)):
        outs = torch.ops.lazytensor.replay(key, _source(), tensors)
    else:
        outs = torch.ops.lazytensor.reduce(key, tensors, _gradient_reaches(tensors))
    return outs[0] if len(outs) == 1 else tuple(outs)


def inlined(key: str, shapes: tuple, itemsize: int) -> bool:
    """Whether the reduction ``key`` of tensors of static ``shapes`` (``itemsize`` bytes an entry at most) is traced
    into the caller's graph, as the ATen calls of one eager tile, instead of called as an operator. Only under
    ``torch.compile`` (an exported program keeps its operators), with the widest intermediate within
    ``INLINE_MAX_BYTES``, no option that picks the engine's route (``backend``, ``chunk_size``, ranges, a process
    group), and not for a quantile or a solve (their passes branch on values). Why: an operator call costs many
    times what Inductor's fused code for a small tile does (docs/lazytensor.md). Dynamo calls it while tracing and
    keeps its answer (``_dynamo_marked_constant``, what ``assume_constant_result`` sets: applying that imports
    Dynamo)."""
    reduced, node = decode(key)
    calls = [part for part in record_shapes.nodes(node) if part[0] == "lazy"]
    names = {part[2] if part[1] in ("call", "fn") else part[1] for part in calls}
    options = {k for part in calls if part[1] in ("call", "fn") for k, _ in part[-1][1:]}
    if names & {"ranged", "quantile", "solve", "distance_quantile"} or options & set(_ROUTE_OPTIONS) or \
            record_shapes.widest(node, reduced, shapes) * itemsize > INLINE_MAX_BYTES:
        return False
    return True


def _source() -> str:
    """lazytensor's source digest (``aot.code_version``), as a function Dynamo calls rather than traces (it cannot
    read a ``functools.cache`` wrapper's attributes)."""
    return aot.code_version()


inlined._dynamo_marked_constant = _source._dynamo_marked_constant = True


def reduced_axis(name: str, nbatch: int, args: tuple, kwargs: dict) -> str | None:
    """The axis ``formula.<name>(*args, **kwargs)`` reduces, ``formula`` a LazyTensor with ``nbatch`` batch dimensions;
    None where the call returns a formula. A LazyTensor class with reductions of its own (``lazytensor.keops``)
    answers for them in its ``_reduced_axis``."""
    reduction = _REDUCTION_OF.get(name)
    if reduction in ("matmul", "matvec", "solve", "rmatvec"):
        return "i" if reduction == "rmatvec" else "j"
    if reduction is None:
        return None
    arguments = bound(getattr(LazyTensor, name), args, kwargs, defaults=True)
    axis = arguments.get("axis")
    dim = arguments["dim"] if axis is None else axis
    if reduction in FEATURE_REDUCTIONS and lazy_tensor.is_feature_dim(dim, nbatch):
        return None
    return run.reduced_axis(dim, nbatch)


def _gradient_reaches(tensors: list) -> list[bool]:
    """Which tensors a gradient will reach, read while tracing (Dynamo guards on both): the operator builds
    the autograd graph of its replay for them in the forward, where the backward finds it."""
    return [torch.is_grad_enabled() and t.requires_grad and t.is_floating_point() for t in tensors]


def bound(method, args: tuple, kwargs: dict, *, defaults: bool = False) -> dict:
    """The arguments ``method(self, *args, **kwargs)`` binds, by parameter name (a var-keyword's entries by their own;
    ``defaults``: the parameters not given too). Where each one comes from is worked out once per method and call
    form (``_binding``, called by Dynamo rather than traced): binding signatures took a tenth of Dynamo's trace
    of a formula's reductions."""
    return {name: args[at] if kind == "arg" else kwargs[at] if kind == "kw" else at
            for name, kind, at in _binding(method, len(args), tuple(kwargs), defaults)}


def _binding(method, count: int, keywords: tuple, defaults: bool) -> tuple:
    """Where each parameter of a call of ``method`` with ``count`` positional arguments and ``keywords`` comes from:
    (name, "arg", position), (name, "kw", keyword) or (name, "default", value); a call that does not bind raises
    ``inspect``'s TypeError."""
    form = (method, count, keywords, defaults)
    if form not in _BINDINGS:
        signature = inspect.signature(method)
        try:
            given = signature.bind(None, *[_Given("arg", k) for k in range(count)], **{k: _Given("kw", k) for k in keywords})
        except TypeError as error:
            raise TypeError(f"{method.__qualname__}(): {error}") from None
        if defaults:
            given.apply_defaults()
        slots = []
        for name, value in list(given.arguments.items())[1:]:
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                slots.extend((k, *v) for k, v in value.items())
            elif signature.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
                slots.append((name, *value) if isinstance(value, _Given) else (name, "default", value))
        _BINDINGS[form] = tuple(slots)
    return _BINDINGS[form]


class _Given(tuple):
    """A placeholder ``_binding`` binds: where the call gives that parameter."""

    def __new__(cls, kind: str, at):
        return super().__new__(cls, (kind, at))


_BINDINGS: dict = {}
_binding._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets (without importing Dynamo)


class Deferred:
    """A formula recorded while a compiler traces: ``node`` is ("var", axis, tensor, flavour),
    ("new", flavour, value) (a constant), ("call", method, formula, args, kwargs), ("fn", name, args, kwargs)
    (``where``, ``formula``) or ("ranged", formula, ranges); ``nbatch`` its batch dimensions, ``flavour`` the
    LazyTensor class whose methods it records (``lazytensor.keops``'s keeps KeOps's semantics; its parents', as an
    eager formula's). ``literal`` is the node as a Python literal, ``holes`` the tensors in it (``encode``): made
    here, once, from the operands' own, so the key of a reduction costs Dynamo's trace a few steps, not a walk
    of the whole formula (a walk per reduction was most of the trace of a Sinkhorn loop, whose 20 reductions
    share their cost matrix)."""

    __hash__ = object.__hash__

    def __init__(self, node: tuple, nbatch: int, flavour: type = LazyTensor):
        holes: list = []
        literal = "('lazy'," + "".join(encode(part, holes) + "," for part in node) + ")"
        record = object.__setattr__  # Deferred.__setattr__ takes only ``ranges``
        record(self, "node", node)
        record(self, "nbatch", nbatch)
        record(self, "flavour", flavour)
        record(self, "literal", literal)
        record(self, "holes", tuple(holes))

    @staticmethod
    def call(name: str, *args, **kwargs) -> "Deferred":
        """``where`` / ``formula`` (``FUNCTIONS``) of ``args``, or ``new``: ``flavour(x, axis)``, the constructor."""
        if name == "new":
            return _constructed(*args)
        operands = (*args, *kwargs.values())
        return Deferred(("fn", name, args, kwargs), _batch_of(operands), _flavour_of(operands))

    def _record(self, name: str, args: tuple, kwargs: dict) -> "Deferred":
        operands = (self, *args, *kwargs.values())
        return Deferred(("call", name, self, args, kwargs), _batch_of(operands), _flavour_of(operands))

    def _call(self, name: str, args: tuple, kwargs: dict):
        """``formula.<name>(*args, **kwargs)``: a formula recorded, or a reduction as one operator node."""
        reduced = getattr(self.flavour, "_reduced_axis", reduced_axis)(name, self.nbatch, args, kwargs)
        if reduced is None:
            return self._record(name, args, kwargs)
        if kwargs.get("out") is not None:
            raise ValueError("out= is not supported while a compiler traces a reduction")
        return _operator(Deferred(("call", name, self, args, kwargs), self.nbatch), reduced)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A tensor and a formula under an operator (``t * K``; Dynamo passes ``K @ b`` as ``matmul(b, K)``)."""
        if len(args) == 2 and not kwargs and isinstance(args[1], Deferred):
            for functions, method in _SWAPPED:
                if any(func is f for f in functions):
                    return getattr(args[1], method)(args[0])
        if len(args) == 2 and not kwargs and isinstance(args[0], Deferred):  # strict export: operator.mul(K, t)
            for function, method in _OPERATORS:
                if func is function:
                    return getattr(args[0], method)(args[1])
        return NotImplemented

    @property
    def T(self):
        return self._record("t", (), {})

    @property
    def nbatchdims(self) -> int:
        return self.nbatch

    def __setattr__(self, name, value):
        """``K.ranges = ...`` (KeOps's block sparsity, read by K's reductions) is part of the record: ignored, the
        compiled reduction summed every block (a silent wrong value)."""
        if name != "ranges":
            raise AttributeError(f"LazyTensor.{name} cannot be set while a compiler traces (lazytensor.library)")
        ranged = Deferred(("ranged", Deferred(self.node, self.nbatch, self.flavour), value), self.nbatch, self.flavour)
        for part in ("node", "literal", "holes"):
            object.__setattr__(self, part, getattr(ranged, part))

    def __getattr__(self, name):
        """A method only the flavour has (KeOps's ``Kmin``, ``sum_reduction``, ...), recorded as the others are; any
        other attribute (``shape``, ``dim()``, ...) breaks the graph and is read from the formula built eagerly."""
        if not name.startswith("_") and name not in vars(LazyTensor) and inspect.isfunction(getattr(self.flavour, name, None)):
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        if name.startswith("__") or not hasattr(self.flavour, name):
            raise AttributeError(f"{self.flavour.__name__} has no attribute {name!r}")
        if recording():
            torch._dynamo.graph_break(msg=f"LazyTensor.{name} is not available while a compiler traces "
                                          "(lazytensor.library): reduce the formula to a tensor first")
        return getattr(self.materialized(), name)

    def materialized(self) -> LazyTensor:
        """The formula as an eager LazyTensor of its own tensors: a record met by code that runs eagerly (after
        a graph break, in a call opaque to the compiler: ``lt.formula``, KeOps's ``Genred``)."""
        tensors = []
        return _replayed(ast.literal_eval(numbered(self, tensors)), tensors)

    def __bool__(self):
        raise TypeError("a LazyTensor has no truth value; reduce it first")


def _batch_of(operands) -> int:
    return max([a.nbatch for a in operands if isinstance(a, Deferred)] + [0])


def _flavour_of(operands) -> type:
    """The operands' LazyTensor class: the first that is not lazytensor's own, as ``LazyTensor._build`` picks."""
    return next((a.flavour for a in operands if isinstance(a, Deferred) and a.flavour is not LazyTensor), LazyTensor)


def _constructed(flavour: type, x, axis) -> Deferred:
    """``flavour(x, axis)``: a tensor's variable, its axis and shape read as the constructor reads them; a constant."""
    if isinstance(x, Deferred):
        return x
    if isinstance(x, torch.Tensor):
        x, axis = variables.keops_layout(x) if axis is None else (x, variables.axis_name(axis))
        t = variables.normalized(x, axis)
        return Deferred(("var", axis, t, _flavour_name(flavour)), t.dim() - (1 if axis == "p" else 2), flavour)
    if isinstance(x, tuple):
        raise TypeError("a symbolic KeOps variable (Vi(index, dim)) cannot be used while a compiler traces: "
                        "give the variable its tensor")
    return Deferred(("new", _flavour_name(flavour), x), 0, flavour)


def _flavour_name(flavour: type) -> str:
    return f"{flavour.__module__}:{flavour.__qualname__}"


@functools.lru_cache(maxsize=None)
def _flavour(name: str) -> type:
    """The LazyTensor class a key names (lazytensor's own, or a subclass in lazytensor: nothing else is imported)."""
    module, _, qualname = name.partition(":")
    flavour = getattr(importlib.import_module(module), qualname, None) if module.split(".")[0] == "lazytensor" else None
    if not (isinstance(flavour, type) and issubclass(flavour, LazyTensor)):
        raise ValueError(f"a lazytensor::reduce key names {name!r}, which is no LazyTensor class of lazytensor")
    return flavour


def _tensor_methods(*names):
    return tuple(getattr(torch.Tensor, n) for n in names if hasattr(torch.Tensor, n))


# torch's operator with (tensor, formula) arguments -> the formula's method taking the tensor
_SWAPPED = ((_tensor_methods("add", "__add__", "__radd__"), "__radd__"),
            (_tensor_methods("mul", "__mul__", "__rmul__"), "__rmul__"),
            (_tensor_methods("sub", "__sub__"), "__rsub__"), (_tensor_methods("__rsub__"), "__sub__"),
            (_tensor_methods("div", "true_divide", "__truediv__", "__div__"), "__rtruediv__"),
            (_tensor_methods("__rdiv__", "__rtruediv__"), "__truediv__"),
            (_tensor_methods("pow", "__pow__"), "__rpow__"), (_tensor_methods("__rpow__"), "__pow__"),
            (_tensor_methods("matmul", "__matmul__", "__rmatmul__"), "__matmul__"),
            ((operator.add,), "__radd__"), ((operator.mul,), "__rmul__"), ((operator.sub,), "__rsub__"),
            ((operator.truediv,), "__rtruediv__"), ((operator.pow,), "__rpow__"))
_OPERATORS = tuple((getattr(operator, n), f"__{n}__") for n in ("add", "mul", "sub", "truediv", "pow", "matmul"))


def _method(name: str):
    def method(self, *args, **kwargs):
        return self._call(name, args, kwargs)

    method.__name__ = name
    return method


for _name, _value in list(vars(LazyTensor).items()):
    if inspect.isfunction(_value) and (not _name.startswith("_") or _name in OPERATORS) and _name != "dim":
        setattr(Deferred, _name, _method(_name))


# -- the key: a Python literal of the record, tensors as positions --------------------------------
HOLE = "\x00"  # a tensor's place in a record's literal until its key numbers it (no repr writes a NUL character)


def encode(value, holes: list) -> str:
    """``value`` as a literal, each tensor a ``HOLE`` (appended to ``holes``); a record's is the one it made.
    The commonest kinds are asked first: Dynamo traces every check."""
    if value is None or isinstance(value, (str, bool, int)):
        return repr(value)
    if isinstance(value, Deferred):
        holes.extend(value.holes)
        return value.literal
    if isinstance(value, torch.Tensor):
        holes.append(value)
        return HOLE
    if isinstance(value, (tuple, list)):
        kind = "'tuple'" if isinstance(value, tuple) else "'list'"
        return "(" + kind + "," + "".join(encode(v, holes) + "," for v in value) + ")"
    if isinstance(value, dict):
        return "('dict'," + "".join(f"({k!r},{encode(v, holes)})," for k, v in value.items()) + ")"
    if isinstance(value, float):
        return f"('float',{repr(value)!r})"  # repr(inf) is no literal
    if isinstance(value, slice):
        return "('slice'," + encode((value.start, value.stop, value.step), holes) + ")"
    if isinstance(value, torch.dtype):
        return f"('dtype',{str(value)!r})"
    if value is Ellipsis:
        return "('ellipsis',)"
    raise TypeError(f"a {type(value).__name__} cannot be recorded in a formula while a compiler traces")


def record_key(record: Deferred, reduced: str | None, tensors: list) -> str:
    """The operator's key of ``record``, a reduction over axis ``reduced`` (None: a named operator): the version of
    the operators it is read by, the axis, the record's literal (``numbered``)."""
    return f"({KEY_VERSION},{reduced!r},{numbered(record, tensors)})"


def numbered(record: Deferred, tensors: list) -> str:
    """``record``'s literal, each of its tensors appended to ``tensors`` once (by identity) and named by position."""
    positions = []
    for t in record.holes:
        known = [at for at, seen in enumerate(tensors) if seen is t]
        if not known:
            tensors.append(t)
        positions.append(known[0] if known else len(tensors) - 1)
    return _filled(record.literal, tuple(positions))


def _filled(literal: str, positions: tuple) -> str:
    """``literal``'s holes replaced by ``('tensor', position)``; called by Dynamo rather than traced."""
    first, *rest = literal.split(HOLE)
    return first + "".join(f"('tensor',{at})" + piece for at, piece in zip(positions, rest))


_filled._dynamo_marked_constant = True


@functools.lru_cache(maxsize=1024)
def decode(key: str) -> tuple:
    """(reduced axis, record) of a key; a key of other operators (an older program or compile cache) is refused."""
    version, *rest = ast.literal_eval(key)
    if version != KEY_VERSION:
        raise ValueError(f"a lazytensor::reduce key of version {version}, this lazytensor reads {KEY_VERSION}: "
                         "export the program again, or clear the compile cache (TORCHINDUCTOR_CACHE_DIR)")
    return tuple(rest)


def replay(node, tensors):
    """The value ``node`` (decoded) stands for, computed on ``tensors``: LazyTensors, their reductions."""
    if not isinstance(node, tuple):
        return node
    kind, *parts = node
    if kind == "tensor":
        return tensors[parts[0]]
    if kind in ("tuple", "list"):
        items = [replay(p, tensors) for p in parts]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: replay(v, tensors) for k, v in parts}
    if kind == "float":
        return float(parts[0])
    if kind == "slice":
        return slice(*replay(parts[0], tensors))
    if kind == "dtype":
        return getattr(torch, parts[0].removeprefix("torch."))
    if kind == "ellipsis":
        return Ellipsis
    return _formula(parts, tensors)


def _formula(parts, tensors):
    kind, *parts = parts
    if kind == "var":
        axis, (_, k), flavour = parts
        return _flavour(flavour)(tensors[k], axis)
    if kind == "new":
        return _flavour(parts[0])(replay(parts[1], tensors))
    if kind == "ranged":
        formula = replay(parts[0], tensors)
        formula.ranges = replay(parts[1], tensors)
        return formula
    if kind == "fn":
        name, args, kwargs = parts
        return FUNCTIONS[name](*replay(args, tensors), **replay(kwargs, tensors))
    name, formula, args, kwargs = parts
    return getattr(replay(formula, tensors), name)(*replay(args, tensors), **replay(kwargs, tensors))


def _outputs(result) -> list:
    return list(result) if isinstance(result, tuple) else [result]


def _evaluated(key: str, tensors, **override) -> list:
    """The record's outputs on ``tensors`` (``override``: options replacing the reduction's own)."""
    _, node = decode(key)
    if override:
        node = node[:-1] + (("dict", *[p for p in node[-1][1:] if p[0] not in override],
                             *override.items()),)
    return _outputs(_replayed(node, tensors))


def _replayed(node, tensors):
    _replaying[0] += 1
    try:
        return replay(node, tensors)
    finally:
        _replaying[0] -= 1


# -- the operators ----------------------------------------------------------------------------
def _replay(key: str, source: str, tensors: list) -> list:
    """``lazytensor::replay``: an inlined reduction (``inlined``), the record replayed in Python wherever the node
    runs. Registered as a composite (CompositeImplicitAutograd), it is decomposed by whoever traces it (Dynamo for
    its outputs, AOTAutograd for the graph): the engine, seeing fake tensors (``Problem.traced``), runs one tile, and
    its ATen calls, forward and backward, are what Inductor compiles. As a node in Dynamo's graph (its first form
    was a Python call, ``nonstrict_trace``, which AOTAutograd's cache refuses) the graph is cached: with a warm
    cache a fresh process's first training step costs what the operators' does (docs/performance.md, "Session 45").
    ``source``, lazytensor's source digest, is unused here but in every cache key: a cached graph holds the ATen
    calls this lazytensor traced."""
    return _outputs(_replayed(decode(key)[1], list(tensors)))


_COMPOSITES = torch.library.Library("lazytensor", "FRAGMENT")
_COMPOSITES.define("replay(str key, str source, Tensor[] tensors) -> Tensor[]")
_COMPOSITES.impl("replay", _replay, "CompositeImplicitAutograd")


@torch.library.custom_op("lazytensor::reduce", mutates_args=())
def reduce(key: str, tensors: list[torch.Tensor], needs: list[bool]) -> list[torch.Tensor]:
    """The reduction ``key`` records, of ``tensors``: its outputs, as the eager call returns them. Where a gradient
    will reach ``needs``-ed tensors, the replay runs with autograd on and its graph stays on the outputs
    (``_graph``): the backward differentiates it as eager's would, with no second forward."""
    if not any(needs):
        with torch.no_grad():
            return [_own(o) for o in _evaluated(key, tensors)]
    with _autograd_back(), torch.enable_grad():
        inputs = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
        graph = _evaluated(key, inputs)
    outs = [_own(o.detach()) for o in graph]
    for o in outs:  # aliases of the graph's outputs, not the outputs themselves: no reference cycle
        o._lazytensor_graph = (inputs, graph, o._version)
    return outs


def _own(output: torch.Tensor) -> torch.Tensor:
    """An output as an operator returns it: no view of an input, contiguous (as its fake is; a solve's is not)."""
    return output.clone(memory_format=torch.contiguous_format) if output._is_view() or not output.is_contiguous() else output


@reduce.register_fake
def _(key, tensors, needs):
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    reduced, node = decode(key)
    batch, rows, shrunk = record_shapes.leading_call(node, tensors) if reduced is None else \
        record_shapes.leading(node, reduced, tensors)
    hints = [[optimization_hint(s) for s in t.shape] for t in tensors]
    for k in shrunk:
        hints[k][-2] = 1
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        zeros = [torch.zeros(h, dtype=t.dtype, device=t.device) for h, t in zip(hints, tensors)]
        outs = _evaluated(key, zeros, **({} if node[2] == "attention" else {"backend": "eager"}))
    return [tensors[0].new_empty((*batch, rows, *o.shape[len(batch) + 1:]), dtype=o.dtype) for o in outs]


@torch.library.custom_op("lazytensor::reduce_vjp", mutates_args=())
def reduce_vjp(key: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor], grads: list[torch.Tensor | None],
               needs: list[bool]) -> list[torch.Tensor]:
    """Cotangents ``grads`` of the ``outputs`` of ``reduce(key, tensors)`` pulled back to the ``needs``-ed tensors
    through the engine's streamed backward; zeros for the others. The graph the forward left on its outputs is
    differentiated (``_graph``); without one (a compiler copied the outputs, one changed in place, a program
    exported without gradients) the record is replayed with autograd on: its forward passes run again."""
    with _autograd_back(), torch.enable_grad():
        inputs, outs = _graph(outputs, needs)
        if inputs is None:
            inputs = [t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(tensors, needs)]
            outs = _evaluated(key, inputs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t, need in zip(inputs, needs) if need and t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True,
                                       retain_graph=True)
                   if pairs and wanted else [None] * len(wanted))
    out = [next(got) if need and t.requires_grad else None for t, need in zip(inputs, needs)]
    return [torch.zeros_like(t) if g is None else g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)
            for g, t in zip(out, tensors)]  # laid out as the fake's, the tensors' own


def _graph(outputs: list[torch.Tensor], needs: list[bool]) -> tuple:
    """(inputs, outputs) of the autograd graph ``reduce`` left on ``outputs``, if every output still carries it
    unchanged and it reaches every ``needs``-ed input; else (None, None)."""
    marks = [getattr(o, "_lazytensor_graph", None) for o in outputs]
    if not marks or marks[0] is None:
        return None, None
    inputs, graph, _ = marks[0]
    if any(m is None or m[1] is not graph or m[2] != o._version for m, o in zip(marks, outputs)) or \
            any(need and not t.requires_grad for t, need in zip(inputs, needs)):
        return None, None
    return inputs, graph


def _autograd_back():
    """Autograd's dispatch keys, which an operator's kernel runs without, back on for the replay it differentiates.
    Only those: the others the kernel excludes stay so (autocast's, turned on, would run float32 in bfloat16)."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


_AUTOGRAD_KEYS = functools.reduce(operator.or_, [torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
                                                 for name in dir(torch._C.DispatchKey)
                                                 if name.startswith("Autograd") or name == "ADInplaceOrView"])


@reduce_vjp.register_fake
def _(key, tensors, outputs, grads, needs):
    return [torch.empty_like(t) for t in tensors]


def _setup(ctx, inputs, output):
    ctx.key, tensors, _ = inputs
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.count = len(tensors)
    ctx.save_for_backward(*tensors, *output)


def _backward(ctx, grads):
    saved = list(ctx.saved_tensors)
    grads = torch.ops.lazytensor.reduce_vjp(ctx.key, saved[:ctx.count], saved[ctx.count:], list(grads), ctx.needs)
    return None, [g if need else None for g, need in zip(grads, ctx.needs)], None


reduce.register_autograd(_backward, setup_context=_setup)
