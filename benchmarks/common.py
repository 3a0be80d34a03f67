"""What the benchmark scripts share: a command line named by the script's docstring, torch's threads, one JSON line.

Scripts run as files (``python benchmarks/NAME.py``), so they import this module as ``common``.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def arguments(doc: str, *, threads: int | None = 2) -> argparse.ArgumentParser:
    """A parser described by the docstring's first line; with ``--threads`` (torch's threads) unless ``threads=None``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads, help="torch threads (default %(default)s)")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed arguments, with torch's threads set from ``--threads`` where the script has it."""
    args = parser.parse_args()
    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)
    return args


def emit(record: dict) -> None:
    """The script's result: one JSON line on stdout."""
    print(json.dumps(record), flush=True)


def call_times(fn, repeats: int = 5) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after one untimed call (compiles, allocator warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times
