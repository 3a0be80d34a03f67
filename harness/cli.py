"""Argument types and usage errors shared by every ``python -m harness`` command.

A mistake on the command line must cost the user one line, not a traceback or a
finished benchmark whose results cannot be written. So every flag converts
through one of these ``type=`` functions (argparse turns their
``ArgumentTypeError`` into ``error: argument --n: ...`` and exit status 2), and
checks that involve several flags raise :class:`UsageError`, which
``harness.__main__`` reports the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any, Callable


class UsageError(ValueError):
    """A command-line mistake found after parsing (flags that do not go together)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag


def _bounded(kind: Callable[[str], Any], low: float, *, strict: bool, name: str) -> Callable[[str], Any]:
    bound = f"> {low:g}" if strict else f">= {low:g}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}") from None
        if not math.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"expected {name} {bound}, got {text!r}")
        return value

    convert.__name__ = f"{name.replace(' ', '_')}_{'gt' if strict else 'ge'}_{low:g}"
    return convert


positive_int = _bounded(int, 1, strict=False, name="an integer")
nonneg_int = _bounded(int, 0, strict=False, name="an integer")
positive_float = _bounded(float, 0, strict=True, name="a number")
nonneg_float = _bounded(float, 0, strict=False, name="a number")


def int_at_least(low: int) -> Callable[[str], int]:
    return _bounded(int, low, strict=False, name="an integer")


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:INDEX`` that this machine has."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:INDEX, got {text!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device "
                                             "(torch.cuda.is_available() is False); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:INDEX, got {text!r}")
    return str(dev)


def comma_list(choices: tuple[str, ...], required: tuple[str, ...] = ()) -> Callable[[str], list[str]]:
    """``a,b,c``: a non-empty, duplicate-free subset of ``choices`` that includes ``required``."""

    def convert(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(choices)}; "
                                             f"got {text!r}" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        missing = [name for name in required if name not in names]
        if missing:
            raise argparse.ArgumentTypeError(f"must include {', '.join(missing)} (the reference), got {text!r}")
        return list(dict.fromkeys(names))

    convert.__name__ = "comma_list"
    return convert


def output_path(text: str) -> str:
    """A file path this process can create or overwrite; missing parent folders are created later.

    Probed by creating a temporary file in the nearest existing folder, so the
    check is right for root and read-only file systems alike.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(folder)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(folder)!r} is not writable "
                                         f"({exc.strerror or exc})") from None
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: not a regular file")
    return text


def output_or_default(given: str | None, default: str) -> str:
    """``--output`` as given (checked while parsing), else the command's default path, checked now."""
    if given is not None:
        return given
    try:
        return output_path(default)
    except argparse.ArgumentTypeError as exc:
        raise UsageError("--output", f"(default) {exc}") from None


def json_record(text: str) -> tuple[str, dict[str, Any]]:
    """A readable JSON file holding one object (a benchmark record): ``(path, record)``."""
    path = Path(text)
    if not path.is_file():
        problem = "no such file" if not path.exists() else "is a directory" if path.is_dir() else "not a regular file"
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a text file; expected a JSON benchmark record") from None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(record, dict):
        raise argparse.ArgumentTypeError(f"{text!r} holds a JSON {type(record).__name__}; "
                                         "expected an object (a benchmark record)")
    return text, record
