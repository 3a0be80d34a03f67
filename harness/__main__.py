"""Command-line entry point: one sub-command per benchmark family."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes ``register(subparsers)``; the parser it adds sets ``func``.
COMMANDS = ("operators", "ml", "forward", "polytope", "report")


def main(argv: list[str] | None = None) -> int:
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
