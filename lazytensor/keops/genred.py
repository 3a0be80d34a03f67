"""KeOps's Genred / generic_* / KernelSolve: formula strings with alias strings, run as lazytensor formulas.

``Genred("Exp(-SqDist(x, y)) * b", ["x = Vi(3)", "y = Vj(3)", "b = Vj(1)"],
reduction_op="Sum", axis=1)(x, y, b)`` parses the aliases (``name = Vi(dim)``,
``Vi(index, dim)``, ``Vj``, ``Pm``, ``Var(index, dim, category)``), wraps the
call's arguments in their order as Vi / Vj / Pm, evaluates the formula with
``lazytensor.lazy_tensor`` (KeOps's operation names are part of its language; inline
``Vi(k, d)`` are the k-th argument) and runs the reduction. ``generic_sum(formula,
"out = Vi(1)", *aliases)`` is the same with the output's axis naming the kept one.
"""
from __future__ import annotations

import re

import sympy

from .. import ir, parse
from .lazy import LazyTensor, options

_ALIAS = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(Vi|Vj|Pm|Var)\s*\(([^)]*)\)\s*$")
_INLINE = re.compile(r"\b(Vi|Vj|Pm|Var)\s*\(\s*(\d+)\s*,\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)")
_CATEGORIES = {"Vi": "i", "Vj": "j", "Pm": "p", 0: "i", 1: "j", 2: "p"}
# KeOps reduction name -> (LazyTensor method, whether it takes opt_arg K, whether it takes formula2 as weights)
REDUCTIONS = {
    "Sum": ("sum_reduction", False, False),
    "LogSumExp": ("logsumexp", False, False),
    "LogSumExpWeight": ("logsumexp", False, True),
    "SumSoftMaxWeight": ("sumsoftmaxweight", False, True),
    "Max_SumShiftExp": ("max_sumshiftexp", False, False),
    "Max_SumShiftExpWeight": ("max_sumshiftexp", False, True),
    "Min": ("min_reduction", False, False),
    "ArgMin": ("argmin_reduction", False, False),
    "Min_ArgMin": ("min_argmin", False, False),
    "Max": ("max_reduction", False, False),
    "ArgMax": ("argmax_reduction", False, False),
    "Max_ArgMax": ("max_argmax", False, False),
    "KMin": ("Kmin", True, False),
    "ArgKMin": ("argKmin", True, False),
    "KMin_ArgKMin": ("Kmin_argKmin", True, False),
}


def parse_aliases(aliases) -> list[tuple[str, str, int, int]]:
    """(name, axis, dim, argument index) per alias; indices default to the order of the list, as KeOps."""
    parsed, position = [], 0
    for text in aliases:
        match = _ALIAS.match(text)
        if match is None:
            raise ValueError(f"alias {text!r} must read 'name = Vi(dim)', 'name = Vj(index, dim)', 'name = Pm(dim)' or "
                             "'name = Var(index, dim, category)'")
        name, kind, inside = match.groups()
        numbers = [int(v) for v in inside.split(",") if v.strip()]
        if kind == "Var":
            if len(numbers) != 3 or numbers[2] not in (0, 1, 2):
                raise ValueError(f"alias {text!r}: Var takes (index, dim, category in 0 / 1 / 2)")
            index, dim, axis = numbers[0], numbers[1], _CATEGORIES[numbers[2]]
        elif len(numbers) == 1:
            index, dim, axis = position, numbers[0], _CATEGORIES[kind]
        elif len(numbers) == 2:
            index, dim, axis = numbers[0], numbers[1], _CATEGORIES[kind]
        else:
            raise ValueError(f"alias {text!r}: {kind} takes (dim) or (index, dim)")
        parsed.append((name, axis, dim, index))
        position += 1
    indices = [a[3] for a in parsed]
    if len(set(indices)) != len(indices):
        raise ValueError(f"aliases {list(aliases)} give two variables the same argument index")
    return parsed


class Genred:
    """A KeOps generic reduction: ``Genred(formula, aliases, reduction_op, axis)(*tensors, **options)``.

    ``axis=1`` reduces over j (one output row per i), ``axis=0`` over i.
    ``dtype_acc`` / ``use_double_acc`` / ``sum_scheme`` are honoured by sums;
    ``dtype``, ``cuda_type``, ``enable_chunks`` and ``rec_multVar_highdim`` only
    tune KeOps and are accepted.
    """

    def __init__(self, formula, aliases, reduction_op="Sum", axis=0, dtype=None, opt_arg=None, formula2=None,
                 cuda_type=None, dtype_acc="auto", use_double_acc=False, sum_scheme="auto", enable_chunks=True,
                 rec_multVar_highdim=False):
        if reduction_op not in REDUCTIONS:
            raise ValueError(f"reduction_op must be one of {sorted(REDUCTIONS)}, got {reduction_op!r}")
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (reduce over i) or 1 (over j), got {axis!r}")
        self.method, takes_k, weighted = REDUCTIONS[reduction_op]
        if takes_k and (isinstance(opt_arg, bool) or not isinstance(opt_arg, int)):
            raise ValueError(f"{reduction_op} needs opt_arg = K, a positive int, got {opt_arg!r}")
        if weighted and formula2 is None:
            raise ValueError(f"{reduction_op} needs formula2 (the weights)")
        self.formula, self.formula2 = formula, formula2
        self.aliases = parse_aliases([aliases] if isinstance(aliases, str) else list(aliases))
        self.reduction_op, self.axis, self.opt_arg = reduction_op, axis, opt_arg if takes_k else None
        self.accuracy = {"dtype_acc": dtype_acc, "use_double_acc": use_double_acc, "sum_scheme": sum_scheme}
        # inline Vi(k, d) / Var(k, d, c) become names of the k-th argument, read here once (a call inside
        # torch.compile is traced: Dynamo cannot run regular expressions)
        self.inline = {}
        self.texts = [None if text is None else _INLINE.sub(self._inline, text) for text in (formula, formula2)]

    def _inline(self, match) -> str:
        kind, index, dim, category = match.groups()
        axis = _CATEGORIES[int(category)] if kind == "Var" else _CATEGORIES[kind]
        name = f"_arg{index}"
        self.inline.setdefault(name, (name, axis, int(dim), int(index)))
        return name

    def _variables(self, args) -> dict:
        variables = self.aliases + list(self.inline.values())
        wanted = max([index for *_, index in variables], default=-1) + 1
        if len(args) < wanted:
            raise ValueError(f"Genred({self.formula!r}) takes {wanted} tensor arguments, got {len(args)}")
        return {name: _wrap(args[index], axis, dim, name) for name, axis, dim, index in variables}

    def __call__(self, *args, backend="auto", device_id=-1, ranges=None, out=None, **kwargs):
        names = self._variables(args)
        f = parse.formula(self.texts[0], **names)
        weight = None if self.texts[1] is None else parse.formula(self.texts[1], **names)
        nbatch = f.nbatchdims
        call = {**{k: v for k, v in self.accuracy.items() if k != "sum_scheme" or v != "auto"}, **kwargs,
                "backend": backend, "ranges": ranges, "out": out, "axis": nbatch + self.axis}
        method = getattr(f, self.method)
        if self.opt_arg is not None:
            return method(self.opt_arg, **call)
        if weight is not None:
            return method(weight, **call) if self.method == "sumsoftmaxweight" else method(weight=weight, **call)
        result = method(**call)
        return result


def _wrap(tensor, axis: str, dim: int, name: str) -> LazyTensor:
    if not hasattr(tensor, "shape"):
        raise TypeError(f"Genred argument {name!r} must be a tensor or an array, got {type(tensor).__name__}")
    width = tensor.shape[-1] if tensor.ndim >= (1 if axis == "p" else 2) else 1
    if width != dim:
        raise ValueError(f"Genred argument {name!r} is declared with {dim} features, got shape {tuple(tensor.shape)}")
    return LazyTensor(tensor, axis)


def _generic(reduction_op: str, takes_k: bool = False):
    def make(formula, output, *aliases, **kwargs):
        """KeOps's generic_{reduction}(formula, output alias, *aliases): the output's axis is the kept one
        (and for ArgKMin its dimension is K: ``"a = Vi(3)"`` keeps 3 indices)."""
        (_, axis, dim, _), = parse_aliases([output])
        if takes_k:
            kwargs["opt_arg"] = dim
        if axis == "p":
            raise ValueError(f"the output alias {output!r} must be Vi (reduce over j) or Vj (reduce over i)")
        return Genred(formula, list(aliases), reduction_op=reduction_op, axis=1 if axis == "i" else 0, **kwargs)
    make.__name__ = f"generic_{reduction_op.lower()}"
    return make


generic_sum = _generic("Sum")
generic_logsumexp = _generic("LogSumExp")
generic_argmin = _generic("ArgMin")
generic_argkmin = _generic("ArgKMin", takes_k=True)


class KernelSolve:
    """KeOps's KernelSolve: ``KernelSolve(formula, aliases, varinvalias, axis)(*tensors, alpha=...)``.

    The formula must be K_ij * a_j with ``a`` the alias ``varinvalias`` and K_ij a
    scalar kernel; the call passes the right-hand side b in a's slot and
    returns the solution of (K + alpha I) x = b (the project's block CG).
    """

    def __init__(self, formula, aliases, varinvalias, axis=0, dtype=None, opt_arg=None, cuda_type=None,
                 dtype_acc="auto", use_double_acc=False, sum_scheme="auto", enable_chunks=True, rec_multVar_highdim=None):
        self.formula, self.varinvalias, self.axis = formula, varinvalias, axis
        self.aliases = parse_aliases([aliases] if isinstance(aliases, str) else list(aliases))
        if varinvalias not in [a[0] for a in self.aliases]:
            raise ValueError(f"varinvalias {varinvalias!r} is none of the aliases {[a[0] for a in self.aliases]}")
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 or 1, got {axis!r}")

    def __call__(self, *args, alpha=1e-10, eps=None, backend="auto", device_id=-1, ranges=None, **kwargs):
        genred = Genred(self.formula, [f"{n} = {dict(i='Vi', j='Vj', p='Pm')[a]}({k}, {d})" for n, a, d, k in self.aliases])
        names = genred._variables(args)
        rhs = names[self.varinvalias]
        f = parse.formula(genred.texts[0], **names)
        (solved,) = rhs.variables.values()
        sym = next(s for s, v in f.variables.items() if v is solved)  # its symbol in f (symbols name positions)
        kernel_expr = sympy.diff(f.expr, sym)
        if f.expr.subs(sym, 0) != 0 or sym in kernel_expr.free_symbols:
            raise ValueError(f"KernelSolve: the formula {self.formula!r} must be linear in {self.varinvalias!r} (K_ij * a)")
        if ir.feature_dim(kernel_expr, f.info) != 1:
            raise ValueError("KernelSolve: K_ij (the formula's derivative in the solved variable) must be a scalar")
        K = LazyTensor._build(lambda _: kernel_expr, f, width=1)
        K.variables = {s: v for s, v in f.variables.items() if s != sym}
        if self.axis == 0:
            K = K.T
        b = next(iter(rhs.variables.values())).tensor
        solved = options({"backend": backend, **kwargs}, "solve", f.dtype)
        return K.solve(b, alpha=alpha, eps=eps, ranges=ranges, **solved)
