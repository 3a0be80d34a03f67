"""Option checks shared by the optimizer, its controllers and train(): each error names the option.

Numbers must be real numbers (not strings, not bools), integers must be
integral, flags must be bools; nothing is silently converted or truncated.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence


def real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
         low_open: bool = True, high_open: bool = False) -> float:
    """A finite real number in (low, high] by default; the bounds' openness is adjustable."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or below or above:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return value


def positive(name: str, value: Any) -> float:
    return real(name, value, low=0.0)


def positives(name: str, value: Any) -> tuple[float, ...]:
    """One positive number or a non-empty sequence of them."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return (positive(name, value),)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a positive number or a non-empty sequence of them, got {value!r}")
    return tuple(positive(f"{name}[{i}]", v) for i, v in enumerate(value))


def integer(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        kind = "a bool or None" if optional else "a bool"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    return value


def choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def seed(value: Any) -> int | None:
    """None (draw from torch's global generator) or a non-negative int."""
    return integer("seed", value, minimum=0, optional=True)
