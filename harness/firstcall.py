"""What a user meets: the first calls of each variant in a fresh process, with the defaults.

``python -m harness operators --first-call`` runs every variant in its own
child process (nothing forced: lazytensor's ``backend="auto"`` decides when
to compile, as in a user's script) and times calls 1..K with the peak
resident memory each call adds. ``--cache warm`` reuses an inductor disk
cache a previous child filled (a machine that has run the formula before),
``--cache cold`` gives each child an empty one (a machine that never
compiled); pykeops's first call includes its own g++ build in both (its
cache is not ours to empty). ``--busy`` runs one CPU-bound process beside
each child for the whole measurement: a shared machine. Every child checks
its first call's values against the dense twin, after the timed calls, so
that the reference warms nothing. The child keeps the user's malloc settings
(nothing forced onto mmap, unlike the memory tests' children): its times and
peak memory are what a process with the defaults gets, freed heap pages that
glibc keeps included.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import method

_MARK = "FIRST_CALL_RESULT "
CACHES = ("warm", "cold")
# Calls 1..3 start from a collected heap with the peak counter reset (each call's own peak); later calls
# run back to back like a user's loop. A collection before every call cost more than a small call itself
# (200 x 300: ~1.8 ms a call timed after one, 0.5 ms back to back; sympy's objects make our heap large)
# and left the caches cold for the call it preceded.
ISOLATED_CALLS = 3


@contextlib.contextmanager
def busy_core(enabled: bool):
    """One competing CPU-bound process for the duration of the block (a machine where something else runs)."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # let it reach the run queue before the measurement starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _child() -> None:
    """Child side of :func:`measure`: time the calls, then validate call 1 against the dense twin."""
    import torch

    request = json.loads(sys.argv[1])
    torch.set_num_threads(request["threads"])
    from . import operators

    config = request["config"]
    call = operators.workload(name=request["variant"], **config)
    if request["prepare"]:  # fill the disk cache, as a previous run on this machine would have
        method.steady_state_kernels()
        call()
        method.settle()
        call()
        print(_MARK + json.dumps({"prepared": True}), flush=True)
        return
    seconds, peaks, first = [], [], None
    for k in range(request["calls"]):
        if k <= ISOLATED_CALLS:  # calls 1..3 alone; from call 4 on back to back (one collection, one peak for them all)
            gc.collect()
            with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
                fh.write("5")
            baseline = method.current_rss_bytes()
        elapsed, out = method.timed(call, config["device"])
        seconds.append(elapsed)
        peak = max(0, method._vm_hwm_bytes() - baseline)
        if k <= ISOLATED_CALLS:
            peaks.append(peak)
        else:
            peaks[-1] = max(peaks[-1], peak)
        first = out if first is None else first
    errors = {}
    if request["variant"] != "dense":
        errors = operators.validate(first, operators.workload(name="dense", **config)(),
                                    method.default_tolerance(getattr(torch, config["dtype"])))
    print(_MARK + json.dumps({"seconds": seconds, "peak_bytes": peaks, "validation": errors}), flush=True)


def _run_child(request: dict, cache_dir: str, timeout: float) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS=str(request["threads"]))
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", "from harness.firstcall import _child; _child()", json.dumps(request)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line[len(_MARK):] for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise method.BenchmarkError(f"first-call child for {request['variant']} failed (exit {proc.returncode}): "
                                    f"{proc.stderr[-1500:]}")
    return json.loads(lines[-1])


def measure(variant: str, config: dict, *, cache: str, calls: int, threads: int, busy: bool,
            warm_cache_dir: str, timeout: float = 3600.0) -> dict[str, Any]:
    """Calls 1..``calls`` of ``variant`` in a fresh process: seconds, peak extra bytes, validation errors.

    ``cache="warm"``: a preparing child fills ``warm_cache_dir`` first (outside
    the measurement and the busy process); ``"cold"``: an empty cache.
    """
    request = {"variant": variant, "config": config, "calls": calls, "threads": threads, "prepare": False}
    with contextlib.ExitStack() as stack:
        if cache == "warm" and variant not in ("dense", "eager"):  # nothing of theirs is cached
            _run_child({**request, "prepare": True}, warm_cache_dir, timeout)
            cache_dir = warm_cache_dir
        else:
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="inductor-cold-"))
        with busy_core(busy):
            return _run_child(request, cache_dir, timeout)


def table(record: dict, title: str):
    """Calls 1-3 and the total of all calls, each with its ratio to dense under the same conditions, and peak memory."""
    from rich.table import Table

    rows, calls = record["first_calls"], record["calls"]
    dense = next((r for r in rows if r["variant"] == "dense" and not r.get("error")), None)
    shown = min(calls, 3)
    calls_label = "/".join(str(k + 1) for k in range(shown))
    out = Table(title=title)
    columns = ["variant", "cache", f"call {calls_label} s", "x dense", f"{calls} calls s", "x dense ", "peak MiB", "x dense mem"]
    for name in columns + ["note"]:
        out.add_column(name, justify="left" if name in ("variant", "cache", "note") else "right", no_wrap=name != "note")

    def ratios(values, references):
        return " / ".join(f"{v / max(r, 1e-12):.2f}" for v, r in zip(values, references)) if dense else ""

    for r in rows:
        if r.get("error"):
            out.add_row(r["variant"], r["cache"], *[""] * (len(columns) - 2), f"[red]{r['error'][:80]}[/red]")
            continue
        secs, peak = r["seconds"], max(r["peak_bytes"])
        out.add_row(r["variant"], r["cache"], " / ".join(f"{s:.3f}" for s in secs[:shown]),
                    ratios(secs[:shown], dense["seconds"] if dense else []),
                    f"{sum(secs):.3f}", ratios([sum(secs)], [sum(dense["seconds"])] if dense else []),
                    f"{peak / 2**20:.1f}", ratios([peak], [max(dense["peak_bytes"])] if dense else []), r.get("note", ""))
    return out


def run(args, config: dict, output: str, console) -> int:
    """The ``--first-call`` mode of ``python -m harness operators``: one fresh process per (variant, cache)."""
    rows: list[dict] = []
    record = {"command": "operators", "mode": "first-call", "config": config, "calls": args.calls, "busy": args.busy,
              "threads": args.threads, "first_calls": rows}
    persistent = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(".cache/inductor").resolve())
    with method.kept_on_interrupt(record, output), method.progress() as bar:
        task = bar.add_task("", total=len(args.variants) * len(args.cache))
        for name in args.variants:
            for cache in args.cache:
                bar.update(task, description=f"{name}, {cache} cache{', busy core' if args.busy else ''}")
                row = {"variant": name, "cache": cache}
                if name == "keops":
                    row["note"] = "includes pykeops's g++ build" if cache == "cold" else "pykeops's own cache"
                try:
                    row.update(measure(name, config, cache=cache, calls=args.calls, threads=args.threads, busy=args.busy,
                                       warm_cache_dir=persistent))
                except Exception as exc:  # noqa: BLE001 - a failed variant is an error row, never a timing
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                bar.advance(task)
    method.write_json(output, record)
    console.print(table(record, f"operators {config['case']}, first calls in fresh processes"
                                f"{' (one core busy)' if args.busy else ''} ({output})"))
    return 1 if any(r.get("error") for r in rows) else 0
