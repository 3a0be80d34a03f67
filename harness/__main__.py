"""Command-line entry point: one sub-command per benchmark family."""
from __future__ import annotations

import argparse
import importlib
import sys

from .cli import UsageError

# Each module exposes ``register(subparsers)``; the parser it adds sets ``func``.
COMMANDS = ("operators", "ml", "forward", "polytope", "report")
INTERRUPTED = 130  # the shell's status for a process stopped by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command; a user mistake exits 2 with argparse's one-line message.

    Flags are checked by their ``type=`` functions while parsing. What only the
    command can find (flags that do not go together, and the ``ValueError`` /
    ``OSError`` that the libraries raise for bad input) is reported here the
    same way, never as a traceback. Ctrl-C exits 130 after the command has
    written the records measured so far.
    """
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"harness.{name}")
        except ModuleNotFoundError as exc:  # a family not built yet
            if exc.name != f"harness.{name}":
                raise
            continue
        module.register(sub)
    args = parser.parse_args(argv)
    command = sub.choices[args.command]
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{command.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, OSError) as exc:  # UsageError, and bad input the libraries refused
        command.error(str(exc) if isinstance(exc, UsageError) else f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
