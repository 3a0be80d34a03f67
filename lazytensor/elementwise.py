"""The IR's elementwise nodes that sympy lacks or would rewrite: torch's functions, each with its derivative.

Each folds to a sympy value when its arguments are constants (``_constants``),
so no node of ours reaches the lowering's ``evalf``; ``lower`` emits the torch
call and ``diff`` takes the derivative from ``fdiff``.
"""
from __future__ import annotations

import sympy
from sympy.core.logic import fuzzy_and


def _constants(*args: sympy.Expr, finite: bool = False) -> bool:
    """Whether a function's arguments are all constants, so that it folds to a sympy value.

    Any constant folds (``1 / (1 + exp(-1))`` as well as ``2``), not only
    number literals: no function of ours of constants may reach the lowering,
    which turns constants into floats with sympy's ``evalf``, and that knows
    only sympy's own functions. ``finite`` for folds that compare their argument.
    """
    return all(a.is_number and (not finite or a.is_finite) for a in args)


class Sigmoid(sympy.Function):
    nargs = 1

    @classmethod
    def eval(cls, arg):  # constants fold (see ``_constants``)
        return 1 / (1 + sympy.exp(-arg)) if _constants(arg) else None

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)


class _ZeroDerivative(sympy.Function):
    """Piecewise constant (indicators, floor, rounding): the derivative is 0 wherever one exists."""

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


class Step(_ZeroDerivative):
    """Indicator of a positive argument (the derivative of relu)."""

    nargs = 1

    @classmethod
    def eval(cls, arg):
        return (sympy.Integer(1) if arg > 0 else sympy.Integer(0)) if _constants(arg, finite=True) else None


class Relu(sympy.Function):
    nargs = 1

    @classmethod
    def eval(cls, arg):
        return sympy.Max(arg, 0) if _constants(arg) else None

    def fdiff(self, argindex=1):
        return Step(self.args[0])


class InRange(_ZeroDerivative):
    """Indicator of lo <= a <= hi (the derivative of clamp)."""

    nargs = 3

    @classmethod
    def eval(cls, a, lo, hi):
        if _constants(a, lo, hi, finite=True):
            return sympy.Integer(1) if lo <= a <= hi else sympy.Integer(0)
        return None


class Clamp(sympy.Function):
    """min(max(a, lo), hi); the bounds may be formulas too (torch.clamp with tensor bounds).

    Values and gradients follow torch.clamp, also where lo > hi (value hi,
    gradient to hi; KeOps would give lo) and at ties.
    """

    nargs = 3

    @classmethod
    def eval(cls, a, lo, hi):
        return sympy.Min(sympy.Max(a, lo), hi) if _constants(a, lo, hi) else None

    def fdiff(self, argindex=1):
        a, lo, hi = self.args
        if argindex == 1:
            return InRange(a, lo, hi)
        if argindex == 2:  # torch's rule, consistent with the value when lo > hi (then the value is hi)
            return indicator(sympy.And(a < lo, lo < hi))
        return indicator(sympy.Or(a > hi, lo > hi))


class ZeroSafePow(sympy.Function):
    """base**exponent where base != 0, else 0.

    The derivative of u**e for 0 < e < 1 (sqrt, norms, p-norms) is infinite at
    u = 0; torch's distance functions (``cdist``, ``norm``) use 0 there, the
    usual subgradient. Local partials of such powers use this node, so the
    gradient of a distance at zero distance is 0, not NaN.
    """

    nargs = 2

    @classmethod
    def eval(cls, base, exponent):
        if _constants(base, exponent):
            return sympy.Integer(0) if base == 0 else base**exponent
        return None

    def fdiff(self, argindex=1):
        base, exponent = self.args
        if argindex == 1:
            return exponent * ZeroSafePow(base, exponent - 1)
        return ZeroSafePow(base, exponent) * sympy.log(base)


class IsNaN(_ZeroDerivative):
    """1 where the argument is NaN, else 0: what ``x != x`` means, which sympy folds to false."""

    nargs = 1

    @classmethod
    def eval(cls, arg):
        return (sympy.Integer(1) if arg is sympy.nan else sympy.Integer(0)) if _constants(arg) else None


class Floor(_ZeroDerivative):
    """floor(a); piecewise constant, so its derivative is 0 (KeOps's Floor)."""

    nargs = 1

    @classmethod
    def eval(cls, arg):
        return sympy.floor(arg) if _constants(arg) else None


class Round(_ZeroDerivative):
    """a rounded to ``decimals`` decimal places, halves away from zero (C's round, as KeOps); derivative 0."""

    nargs = 2

    @classmethod
    def eval(cls, a, decimals):
        if not _constants(a, decimals, finite=True):
            return None
        scale = sympy.Integer(10) ** decimals
        return sympy.sign(a) * sympy.floor(abs(a) * scale + sympy.Rational(1, 2)) / scale


class XLogX(sympy.Function):
    """a log a, with 0 log 0 = 0 (KeOps's XLogX)."""

    nargs = 1

    @classmethod
    def eval(cls, a):
        if _constants(a, finite=True):  # like torch: nan below 0
            return sympy.Integer(0) if a == 0 else (a * sympy.log(a) if a > 0 else sympy.nan)
        return None

    def fdiff(self, argindex=1):
        return sympy.log(self.args[0]) + 1


SERIES_RADIUS = 1.0  # |a| below which SinXDivXDiff uses its Taylor series


class Atan2(sympy.Function):
    """torch.atan2(y, x). Not sympy's atan2, which ``sin`` / ``cos`` / ``tan`` rewrite as ``y / sqrt(x^2 + y^2)``
    and such: NaN at (0, 0), where torch's value is finite (sin(atan2(0, 0)) = 0)."""

    nargs = 2

    @classmethod
    def eval(cls, y, x):
        return sympy.atan2(y, x) if _constants(y, x) else None  # constants fold (see ``_constants``)

    def fdiff(self, argindex=1):
        y, x = self.args
        return (x if argindex == 1 else -y) / (x**2 + y**2)

    def _eval_is_extended_real(self):
        return True


class SinXDivXDiff(sympy.Function):
    """The ``order``-th derivative of sin(a) / a, continuous at a = 0 (KeOps's SinXDivX(0) = 1).

    Each order is its own node, lowered with its Taylor series near 0, so
    derivatives of every order are finite and accurate there (a quotient rule
    would give 0/0 at 0 and cancel catastrophically around it).
    """

    nargs = 2

    @classmethod
    def eval(cls, a, order):
        if not _constants(a, finite=True):
            return None
        t = sympy.Dummy("t", real=True)
        return sympy.limit(sympy.diff(sympy.sin(t) / t, t, int(order)), t, 0) if a == 0 else cls.expansion_at(a, order)

    def fdiff(self, argindex=1):
        return SinXDivXDiff(self.args[0], self.args[1] + 1) if argindex == 1 else sympy.Integer(0)

    def expansion(self, arg: sympy.Expr) -> sympy.Expr:
        """The closed form away from 0."""
        return self.expansion_at(arg, self.args[1])

    @staticmethod
    def expansion_at(arg: sympy.Expr, order) -> sympy.Expr:
        t = sympy.Dummy("t", real=True)
        return sympy.diff(sympy.sin(t) / t, t, int(order)).xreplace({t: arg})

    def series(self, arg: sympy.Expr) -> sympy.Expr:
        """The Taylor series at 0 in Horner form, to double precision for |arg| <= SERIES_RADIUS.

        The closed form cancels near 0 (cos a / a - sin a / a^2 for the first
        derivative loses digits as 1 / a^2), so small arguments use this.
        From sin(t) / t = sum_k (-1)^k t^(2k) / (2k + 1)!, the n-th derivative
        is sum over 2k >= n of (-1)^k t^(2k - n) / ((2k + 1) (2k - n)!); terms
        up to t^20 leave a remainder below 1 / 21! ~ 2e-20 on |t| <= 1.
        """
        order = int(self.args[1])
        t = sympy.Dummy("t", real=True)
        terms = [sympy.Integer(-1) ** k * t ** (2 * k - order) / ((2 * k + 1) * sympy.factorial(2 * k - order))
                 for k in range((order + 1) // 2, (order + 21) // 2 + 1)]
        return sympy.horner(sympy.Add(*terms), t).xreplace({t: arg})


def sinxdivx(arg: sympy.Expr) -> sympy.Expr:
    return SinXDivXDiff(arg, sympy.Integer(0))


class Select(sympy.Function):
    """``a`` where ``cond`` holds, else ``b`` (torch.where), feature by feature.

    Not sympy's Piecewise: sympy folds a Piecewise out of whatever function
    holds it (``piecewise_fold``, which every Piecewise condition goes
    through), and out of a feature-vector node that changes which feature's
    condition applies: ``where((y > 0)[0], x, 0)`` tested each feature of x
    against its own feature of y, and a where inside a condition became an
    ``ITE`` nothing could lower.
    """

    nargs = 3

    @classmethod
    def eval(cls, cond, a, b):
        if cond == sympy.true:
            return a
        if cond == sympy.false:
            return b
        return None

    def _eval_is_extended_real(self):
        return fuzzy_and([self.args[1].is_extended_real, self.args[2].is_extended_real])


def indicator(cond) -> sympy.Expr:
    return Select(cond, sympy.Integer(1), sympy.Integer(0))
