"""One autograd function for every pass: forward, backward, forward-mode and vmap, all streamed.

``reduce(problem, reductions)`` runs a list of reductions of one problem in
one pass over its tiles (multi-pass reductions run on their own) through
``Streamed``, a ``torch.autograd.Function`` that knows nothing about any
particular reduction:

- backward: each reduction hands a ``Backward`` collector cotangents on its
  formula's tile values (or on selected pairs); ``diff.vjp`` turns them into
  formulas for every input and they run as ONE streamed pass of sums (over j
  for i-variables and parameters, over i for j-variables), again through
  ``reduce``, so the backward is itself differentiable: gradients of any
  order, Hessian-vector products, gradient penalties. Softmax weights stay
  placeholders in those formulas (``reductions.softmax.Softmax``): their sums
  are ``SoftmaxSum``, whose derivatives are centred per pair as dense
  autograd's (a cotangent a on a weight becomes w (a - sum_j w a) on F, the
  sum known or streamed in a pass before, ``Backward._centre``);
- forward mode (``jvp``): the formula's tangent (``diff.jvp``) is summed the
  same way (``Forward`` collector), for ``torch.func.jvp`` / ``jacfwd``;
- vmap: vmapped dimensions become the problem's batch dimension.

Nothing N x M is saved or built.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import sympy
import torch
from torch.autograd import forward_ad

from . import diff, engine, ir
from .kept import Kept
from .opaque import tracing
from .problem import Problem
from .reductions import Sum
from .reductions.softmax import SoftmaxSum


@dataclass(frozen=True, eq=False)
class Pass:
    """A pass's static part: the variables' IR info and order, the reductions and the run options.

    ``ranges`` (block-sparse, from ``plan.check_ranges``) applies to every
    pass of the same problem: forward, backward sums and forward-mode sums.
    """

    info: dict
    order: tuple
    reductions: tuple
    backend: str
    chunk_size: object
    ranges: object = None  # block-sparse: the (row block, column block) pairs to visit
    sharding: object = None  # lazytensor.distributed.Sharding: the j axis is this rank's shard

    @property
    def options(self) -> dict:
        return dict(backend=self.backend, chunk_size=self.chunk_size, ranges=self.ranges, sharding=self.sharding)

    def problem(self, tensors) -> Problem:
        return Problem(self.info, dict(zip(self.order, tensors)), list(self.order))

    def split(self, flat) -> list[tuple]:
        """Flat outputs (or gradients) grouped per reduction."""
        out, at = [], 0
        for r in self.reductions:
            out.append(tuple(flat[at : at + len(r.differentiable)]))
            at += len(r.differentiable)
        return out


def _run(spec: Pass, tensors, problem: Problem | None = None) -> list[tuple]:
    problem = spec.problem(tensors) if problem is None else problem
    single = [r for r in spec.reductions if r.single_pass]
    options = spec.options
    streamed = iter(engine.stream(problem, single, **options) if single else [])
    del options["ranges"]  # multi-pass reductions (quantile) visit every tile
    return [next(streamed) if r.single_pass else r.run(problem, **options) for r in spec.reductions]


class Streamed(torch.autograd.Function):
    """The reductions of one pass; see the module docstring."""

    @staticmethod
    def forward(spec: Pass, *tensors):
        return tuple(t for outs in _run(spec, tensors) for t in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        spec, *tensors = inputs
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        # torch refuses to save inference-mode tensors (made under torch.inference_mode, then used with grad);
        # they cannot change outside that mode, so holding them on ctx is as safe as saving them
        ctx.inference = [t if t.is_inference() else None for t in tensors]
        saveable = [None if t.is_inference() else t for t in tensors]
        ctx.save_for_backward(*saveable, *output)
        ctx.save_for_forward(*saveable, *output)
        flags = [f for r in spec.reductions for f in r.differentiable]
        ctx.mark_non_differentiable(*[o for o, f in zip(output, flags) if not f])

    @staticmethod
    def _saved(ctx):
        spec, saved = ctx.spec, ctx.saved_tensors
        count = len(spec.order)
        inputs = [kept if kept is not None else t for t, kept in zip(saved[:count], ctx.inference)]
        return spec, spec.problem(inputs), spec.split(saved[count:])

    @staticmethod
    def backward(ctx, *grads):
        spec, problem, outs = Streamed._saved(ctx)
        wanted = [s for s, need in zip(spec.order, ctx.needs_input_grad[1:]) if need]
        collector = Backward(problem, wanted, spec.options, spec.reductions)
        for reduction, o, g in zip(spec.reductions, outs, spec.split(grads)):
            g = tuple(gi if flag else None for gi, flag in zip(g, reduction.differentiable))
            if wanted and any(gi is not None for gi in g):
                reduction.vjp(collector, o, g)
        result = collector.run()
        return (None, *[result.get(s) for s in spec.order])

    @staticmethod
    def jvp(ctx, *tangents):
        spec, problem, outs = Streamed._saved(ctx)
        given = {s: t for s, t in zip(spec.order, tangents[1:]) if t is not None}
        collector = Forward(problem, given, spec.options, spec.reductions)
        finish = [reduction.jvp(collector, o) for reduction, o in zip(spec.reductions, outs)]
        results = collector.run()
        flat = []
        for reduction, f, o in zip(spec.reductions, finish, outs):
            for t, x, flag in zip(f(results), o, reduction.differentiable):
                flat.append(None if not flag else (torch.zeros_like(x) if t is None else t))
        return tuple(flat)

    @staticmethod
    def vmap(info, in_dims, spec: Pass, *tensors):
        """vmapped dimensions join the batch dimension: (V, B, ...) -> (V * B, ...); a block-sparse pass,
        which takes no batch (``engine._TileLoop.run_sparse``), runs once per vmapped entry."""
        count = info.batch_size
        if spec.ranges is not None:
            per = [Streamed.apply(spec, *(t if d is None else t.select(d, k) for t, d in zip(tensors, in_dims[1:])))
                   for k in range(count)]
            return tuple(torch.stack(o) for o in zip(*per)), (0,) * len(per[0])
        moved = [t if d is None else t.movedim(d, 0) for t, d in zip(tensors, in_dims[1:])]
        batch = max(t.shape[0] if d is None else t.shape[1] for t, d in zip(moved, in_dims[1:]))
        flat = []
        for t, d in zip(moved, in_dims[1:]):
            if d is None:
                if t.shape[0] != 1:
                    t = t.unsqueeze(0).expand(count, *t.shape).reshape(count * t.shape[0], *t.shape[1:])
            else:
                t = t.expand(count, batch, *t.shape[2:]).reshape(count * batch, *t.shape[2:])
            flat.append(t)
        outs = Streamed.apply(spec, *flat)
        return tuple(o.reshape(count, batch, *o.shape[1:]) for o in outs), (0,) * len(outs)


def reduce(problem: Problem, reductions, backend: str = "auto", chunk_size=None, *, ranges=None,
           sharding=None) -> list[tuple]:
    """The outputs of each reduction of ``problem`` (reducing its j axis; sums may reduce i), differentiable.

    ``ranges`` restricts the pass to blocks (block-sparse): entries over no
    kept pair then take their value over the empty set, outside the pass
    (``Reduction.over_nothing``), also in every derivative pass; with a
    ``sharding`` the j axis is this rank's shard and the outputs are the full results.
    """
    spec = Pass(problem.info, tuple(problem.order), tuple(reductions), engine.check_backend(backend), chunk_size,
                ranges, sharding)
    tensors = [problem.tensors[s] for s in problem.order]
    if differentiated(tensors):
        outs = spec.split(Streamed.apply(spec, *tensors))
    else:  # the problem as it is (outside the function, which takes tensors)
        outs = _run(spec, tensors, problem)
    if ranges is None:
        return outs
    kept = ranges.kept(problem.device)  # sums over i (backward passes) need none: a column kept by no row stays 0
    return [o if r.reduced_axis == "i" or not r.single_pass else r.over_nothing(o, kept) for r, o in zip(reductions, outs)]


def differentiated(tensors) -> bool:
    """Whether a derivative may flow through the pass: a tensor that requires grad, a forward-mode
    dual level, a torch.func transform or a compiler tracing the call. Without one the pass runs
    outside the autograd function, whose ``apply`` costs ~0.1 ms a call (it binds the forward's
    signature with ``inspect`` each time): most of a small problem's reduction."""
    return ((torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or forward_ad._current_level >= 0
            or torch._C._are_functorch_transforms_active() or tracing())


# -- collectors: what reductions ask for while differentiating ------------------------------
class _Collector:
    def __init__(self, problem: Problem, options: dict, reductions=()):
        self.problem, self.options, self.sharding = problem, options, options["sharding"]
        self.extra: dict[sympy.Symbol, tuple[torch.Tensor, str]] = {}
        self.info = dict(problem.info)
        self.softmaxes: dict = {}  # placeholder symbol -> reductions.softmax.Softmax
        self._next = 1 + max([ir.derived_index(s) for s in problem.info] + [_last_derived(r) for r in reductions] + [-1])

    def fresh(self) -> sympy.Symbol:
        """A new symbol of this pass's formulas, after every derived symbol its problem and reductions hold."""
        self._next += 1
        return ir.derived_symbol(self._next - 1)

    def variable(self, tensor: torch.Tensor, axis: str) -> sympy.Symbol:
        """A tensor (a cotangent, a saved output) as a new variable of the derivative formulas."""
        sym = self.fresh()
        self.extra[sym] = (tensor, axis)
        self.info[sym] = ir.VarInfo(axis, tensor.shape[-1])
        return sym

    def adopt(self, softmaxes: dict) -> None:
        """Softmax weights that formulas of this pass hold as placeholders (their feature size for ``diff``)."""
        self.softmaxes.update(softmaxes)
        self.info.update({w: ir.VarInfo("i", s.dim) for w, s in softmaxes.items()})

    def _softmax_weights(self, expr: sympy.Expr) -> set:
        """The softmax weights ``expr`` holds (sympy walks the whole formula for its free symbols: only if any)."""
        return expr.free_symbols & self.softmaxes.keys() if self.softmaxes else set()

    def full_problem(self) -> Problem:
        return self.problem.extended(self.extra)

    def _sum(self, expr: sympy.Expr, info: dict, dim: int, reduced_axis: str) -> Sum:
        """The streamed sum of a derivative formula: a ``SoftmaxSum`` where it holds softmax weights. Kept (the
        next step's backward asks for the same sums), and with it the engine's set-up of the pass."""
        softmaxes = {w: self.softmaxes[w] for w in sorted(self._softmax_weights(expr), key=str)}

        def build():
            return SoftmaxSum(expr, softmaxes, info, dim, reduced_axis) if softmaxes else Sum(expr, info, dim, reduced_axis)

        return _SUMS.get((expr, tuple(softmaxes.values()), tuple(info.items()), dim, reduced_axis), build)

    def local(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global column indices as this rank's (clamped), and which are its own (None: all are)."""
        if self.sharding is None:
            return index, None
        m = self.problem.size("j")
        index = index - sum(self.sharding.sizes(m, index.device)[: self.sharding.rank])
        mine = (index >= 0) & (index < m)
        return index.clamp(0, max(m - 1, 0)), mine


_SUMS = Kept()  # derivative passes' sums (``_Collector._sum``)


@functools.lru_cache(maxsize=1024)
def _vjp(pairs: tuple, wanted: tuple, info: tuple) -> dict:
    """``diff.vjp``, kept (every collector's call): a training loop's backward differentiates the same formulas
    every step (the dict is shared: read only)."""
    return diff.vjp(list(pairs), list(wanted), dict(info))


@functools.lru_cache(maxsize=4096)
def _last_derived(reduction) -> int:
    """The highest derived symbol a reduction's formulas hold (a derivative pass's: its softmax placeholders too)."""
    symbols = set().union(*[e.free_symbols for e in getattr(reduction, "expressions", ())], getattr(reduction, "softmaxes", ()))
    return max([ir.derived_index(s) for s in symbols] + [-1])


_PAIRS = dict(backend="eager", ranges=None, sharding=None)  # a pair problem: local, one column, every pair


def _pairs(problem: Problem, index: torch.Tensor, column: sympy.Symbol) -> tuple[Problem, int]:
    """A problem whose rows are the pairs (i, index[i, s]): every variable i-indexed, j of size 1.

    Reducing over its one column evaluates a formula on the selected pairs;
    rows are (B, N * S) in (i, s) order.
    """
    batch, n, selections = index.shape
    flat = index.reshape(batch, n * selections, 1)
    info, tensors = {}, {}
    for s in problem.order:
        axis, t = problem.info[s].axis, problem.tensors[s]
        if axis == "i":
            t = t.unsqueeze(2).expand(-1, -1, selections, -1).reshape(t.shape[0], n * selections, t.shape[-1])
        elif axis == "j":
            t = torch.gather(t.expand(batch, -1, -1), 1, flat.expand(-1, -1, t.shape[-1]))
        info[s] = ir.VarInfo("p" if axis == "p" else "i", problem.info[s].dim)
        tensors[s] = t
    info[column], tensors[column] = ir.VarInfo("j", 1), index.new_zeros(1, 1, 1, dtype=problem.dtype)
    return Problem(info, tensors, list(problem.order) + [column]), selections


def _fit(grad: torch.Tensor, like: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum a gradient over the dimensions its input was broadcast along."""
    if axis == "p":
        grad = grad.sum(1)
    if like.shape[0] == 1 and grad.shape[0] != 1:
        grad = grad.sum(0, keepdim=True)
    return grad.reshape(like.shape)


class Backward(_Collector):
    """Cotangents of a pass's reductions -> gradients of the wanted variables, streamed."""

    def __init__(self, problem, wanted, options: dict, reductions=()):
        super().__init__(problem, options, reductions)
        self.wanted = wanted
        self.pairs: list[tuple[sympy.Expr, sympy.Expr]] = []
        self.selections: list[tuple[sympy.Expr, torch.Tensor, torch.Tensor]] = []
        self.weighted: list[tuple] = []  # (softmax, cotangent on its weight, its centre or None)

    def cotangent(self, expr: sympy.Expr, cot: sympy.Expr, centre: sympy.Expr | None = None) -> None:
        """A cotangent formula on every tile value of ``expr``.

        Softmax weights in ``expr`` are held fixed there; the cotangent on
        each weight goes to its F, centred (``centre``: its sum over j
        weighted by the weight, where known; else streamed before the pass).
        """
        cot = sympy.sympify(cot)
        self.pairs.append((expr, cot))
        found = self._softmax_weights(expr)
        for w in found:
            on_weight = _vjp(((expr, cot),), (w,), tuple(self.info.items()))[w]
            if on_weight != 0:
                self.weighted.append((self.softmaxes[w], on_weight, centre if len(found) == 1 else None))

    def selected(self, expr: sympy.Expr, index: torch.Tensor, cot: torch.Tensor) -> None:
        """Cotangents (B, N, S, C) on ``expr`` at the pairs (i, index[i, s]) only."""
        self.selections.append((expr, index, cot))

    def run(self) -> dict[sympy.Symbol, torch.Tensor]:
        grads: dict[sympy.Symbol, torch.Tensor] = {}

        def add(sym, g):
            g = _fit(g, self.problem.tensors[sym], self.problem.info[sym].axis)
            grads[sym] = g if sym not in grads else grads[sym] + g

        if self.pairs:
            self._centre()
            full = self.full_problem()
            groups: dict[frozenset, list] = {}  # formulas in different softmax weights sum apart
            for expr, cot in self.pairs:
                groups.setdefault(frozenset(self._softmax_weights(expr) | self._softmax_weights(cot)), []).append((expr, cot))
            formulas = [f for pairs in groups.values() for f in _vjp(tuple(pairs), tuple(self.wanted),
                                                                      tuple(self.info.items())).items()]
            for sym, g in self._gradients(full, formulas).items():
                add(sym, g)
        for expr, index, cot in self.selections:
            index, mine = self.local(index)  # sharded: each rank differentiates the pairs in its shard
            contributions = {}
            if self.problem.size("j") > 0:
                if mine is not None:
                    cot = cot * mine.unsqueeze(-1)
                pairs, selections = _pairs(self.full_problem(), index, self.fresh())
                g = pairs.extended({self.fresh(): (cot.reshape(cot.shape[0], -1, cot.shape[-1]), "i")})
                formulas = _vjp(((expr, g.order[-1]),), tuple(self.wanted), tuple(g.info.items())).items()
                contributions = {sym: self._unpair(sym, c, index, selections)
                                 for sym, c in self._gradients(g, formulas, **_PAIRS).items()}
            for sym in self.wanted:
                if self.sharding is not None and self.problem.info[sym].axis != "j":  # replicated: every rank's pairs
                    contributions[sym] = self.sharding.all_reduce(
                        contributions.get(sym, torch.zeros_like(self.problem.tensors[sym])))
            for sym, contribution in contributions.items():
                add(sym, contribution)
        normalisers = {s.total for s in self.softmaxes.values()}  # no cotangent (see ``_centre``): none to run
        for sym in self.wanted:  # used by the formula but folded away (x * 0): zero, as torch gives
            if sym not in normalisers:
                grads.setdefault(sym, torch.zeros_like(self.problem.tensors[sym]))
        return grads

    def _centre(self) -> None:
        """Cotangents a on softmax weights w as w (a - sum_j w a) on their F, one factor per pair.

        w = exp(F - shift) / total depends on F directly and through the
        total; summed apart (the total's cotangent sent back to the pass that
        made it) the two shares cancel catastrophically. Unknown centres are
        streamed first, all in one pass.
        """
        missing = [(s, a) for s, a, centre in self.weighted if centre is None]
        if missing:
            full = self.full_problem()
            values = {w: s.value for w, s in self.softmaxes.items()}
            sums = [Sum((s.symbol * a).xreplace(values), full.info, s.dim, "j") for s, a in missing]
            centres = iter(self.variable(c, "i") for (c,) in reduce(full, sums, **self.options))
        for s, a, centre in self.weighted:
            self.pairs.append((s.expr, s.on_expr(a, next(centres) if centre is None else centre)))
        self.weighted = []

    def _gradients(self, problem, formulas, **overrides) -> dict:
        """Wanted variables' formulas (several per variable) summed over the axis each is not indexed by, in one pass."""
        todo = [(s, f) for s, f in formulas if f != 0]
        reductions = [self._sum(f, problem.info, self.problem.info[s].dim, "i" if problem.info[s].axis == "j" else "j")
                      for s, f in todo]
        outs = reduce(problem, reductions, **{**self.options, **overrides}) if reductions else []
        grads: dict[sympy.Symbol, torch.Tensor] = {}
        for (s, _), (g,) in zip(todo, outs):
            grads[s] = grads[s] + g if s in grads else g
        return grads

    def _unpair(self, sym, contribution, index, selections):
        """Per-pair gradients (B, N * S, D) back onto the variable's own rows."""
        axis = self.problem.info[sym].axis
        batch, n = index.shape[:2]
        if axis == "i":
            return contribution.reshape(contribution.shape[0], n, selections, contribution.shape[-1]).sum(2)  # n may be 0
        if axis == "j":
            like = self.problem.tensors[sym]
            target = contribution.new_zeros(contribution.shape[0], like.shape[1], contribution.shape[-1])
            where = index.reshape(batch, n * selections, 1).expand(-1, -1, contribution.shape[-1])
            return target.scatter_add(1, where, contribution)
        return contribution


class Forward(_Collector):
    """Input tangents -> output tangents: sums and selected values of the formulas' tangents."""

    def __init__(self, problem, tangents: dict, options: dict, reductions=()):
        super().__init__(problem, options, reductions)
        self.tangents = {s: self.variable(t, problem.info[s].axis) for s, t in tangents.items()}
        self.sums: list[tuple[sympy.Expr, str, int]] = []
        self.selections: list[tuple[sympy.Expr, torch.Tensor]] = []

    def tangent(self, expr: sympy.Expr) -> sympy.Expr:
        """The tangent formula of ``expr``; softmax weights in it move as w (dF - sum_j w dF), centred per pair."""
        tangents = dict(self.tangents)
        for w in expr.free_symbols & self.softmaxes.keys():
            s = self.softmaxes[w]
            tangents[w] = s.tangent(diff.jvp(s.expr, self.tangents, self.info), self.tangents.get(s.total))
        return diff.jvp(expr, tangents, self.info)

    def summed(self, expr: sympy.Expr, reduced_axis: str, dim: int):
        self.sums.append((expr, reduced_axis, dim))
        return ("sum", len(self.sums) - 1)

    def at_selection(self, expr: sympy.Expr, index: torch.Tensor):
        self.selections.append((expr, index))
        return ("selection", len(self.selections) - 1)

    def run(self) -> dict:
        full = self.full_problem()
        results = {}
        live = [(k, self._sum(e, full.info, dim, axis)) for k, (e, axis, dim) in enumerate(self.sums) if e != 0]
        outs = reduce(full, [r for _, r in live], **self.options) if live else []
        for (k, _), (out,) in zip(live, outs):
            results[("sum", k)] = out
        for k, (_, axis, dim) in enumerate(self.sums):
            if ("sum", k) not in results:
                rows = full.size("i" if axis == "j" else "j")
                results[("sum", k)] = torch.zeros(full.batch, rows, dim, dtype=full.dtype, device=full.device)
        for k, (expr, index) in enumerate(self.selections):
            index, mine = self.local(index)
            values = torch.zeros(*index.shape, ir.feature_dim(expr, full.info), dtype=full.dtype, device=full.device)
            if expr != 0 and full.size("j") > 0:
                pairs, selections = _pairs(full, index, self.fresh())
                ((values,),) = reduce(pairs, [Sum(expr, pairs.info)], **{**self.options, **_PAIRS})
                values = values.reshape(values.shape[0], index.shape[1], selections, values.shape[-1])
            if mine is not None:  # sharded: each rank evaluates the pairs in its shard
                values = self.sharding.all_reduce(values * mine.unsqueeze(-1))
            results[("selection", k)] = values
        return results
