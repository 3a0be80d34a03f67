"""The measurement method shared by every benchmark family.

Validation before timing, warm-up apart from steady state, shuffled variant
order, medians and IQRs, peak-memory measurement, and self-describing JSON.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class BenchmarkError(RuntimeError):
    """A benchmark could not produce a trustworthy measurement."""


def steady_state_kernels() -> None:
    """Streamed kernels start compiling at their first call (the warm-up) instead of after lazytensor's
    JIT tiering has spent a second of eager time; ``settle`` after the warm-up waits for those
    background compiles, so timed rounds and memory children all measure the same compiled steady
    state, never a compilation in the middle of the rounds."""
    from lazytensor import compile

    compile.set_compile_after(0.0)


def settle() -> None:
    """Wait until no lazytensor kernel compiles in the background (the end of a warm-up)."""
    from lazytensor import compile

    compile.wait_for_background_compiles()


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[float, Any]:
    """Run ``fn`` once and return (seconds, result), synchronized on CUDA."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, interquartile range, min and max of timing samples."""
    if not samples:
        return {"median": float("nan"), "iqr": float("nan"), "min": float("nan"), "max": float("nan")}
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q = statistics.quantiles(ordered, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {"median": statistics.median(ordered), "iqr": iqr, "min": ordered[0], "max": ordered[-1]}


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_cuda_peak(fn: Callable[[], Any], device: str | torch.device) -> tuple[int, Any]:
    """Extra peak bytes allocated by ``fn`` above the live baseline (CUDA only)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max(max |e|, tiny): one number per compared tensor."""
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    if actual.shape != expected.shape:
        raise BenchmarkError(f"shape mismatch: got {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        return float("inf")
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((actual - expected).abs().max() / scale)


def default_tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]


def environment() -> dict[str, Any]:
    """Versions, threads and hardware: enough to reproduce or to distrust a number."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "argv": sys.argv,
    }
    for name in ("sympy", "numpy", "scipy", "sklearn", "cma", "polystep", "pykeops"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", "unknown")
    return env


def checksums(packages: tuple[str, ...] = ("harness", "lazytensor", "solvers", "polytope")) -> dict[str, str]:
    """SHA-256 over each package's Python sources: which code produced the numbers."""
    root = Path(__file__).resolve().parent.parent
    out = {}
    for pkg in packages:
        digest = hashlib.sha256()
        for path in sorted((root / pkg).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
        out[pkg] = digest.hexdigest()[:16]
    return out


@dataclass
class VariantResult:
    """One variant's measurement: samples, validation and memory."""

    name: str
    first_call_s: float | None = None
    samples_s: list[float] = field(default_factory=list)
    summary: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)
    peak_extra_bytes: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def console() -> Console:
    """Tables on stdout: a terminal's own width; piped or redirected, wide enough that no column name is cut."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def progress() -> Progress:
    """The harness's progress bar: on stderr (stdout keeps tables and Markdown), gone when done."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True), transient=True)


def run_variants(
    variants: dict[str, Callable[[], Any]],
    *,
    repeats: int,
    warmup: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    results: dict[str, VariantResult] | None = None,
) -> dict[str, VariantResult]:
    """Time already-validated variants: first call apart, then shuffled rounds.

    Each round runs every variant once in a fresh random order, so drift on a
    shared machine spreads over all variants instead of biasing one. ``results``
    (name -> VariantResult, entries created where missing) is filled in place and
    summarized even when Ctrl-C stops the rounds, so a caller that holds it keeps
    every sample measured before the interrupt.
    """
    results = {} if results is None else results
    for name in variants:
        results.setdefault(name, VariantResult(name))
    rng = random.Random(seed)
    order = list(variants)
    calls = len(variants) * (max(warmup, 1) + repeats)
    try:
        with progress() as bar:
            task = bar.add_task("", total=calls)
            for name, fn in variants.items():
                bar.update(task, description=f"{name}: first call and warm-up")
                results[name].first_call_s, _ = timed(fn, device)
                bar.advance(task)
                settle()
                for _ in range(max(warmup - 1, 0)):
                    timed(fn, device)
                    bar.advance(task)
                settle()
            for round_ in range(1, repeats + 1):
                rng.shuffle(order)
                for name in order:
                    bar.update(task, description=f"round {round_}/{repeats}: {name}")
                    gc.collect()
                    seconds, _ = timed(variants[name], device)
                    results[name].samples_s.append(seconds)
                    bar.advance(task)
    finally:
        for name in variants:
            results[name].summary = summarize(results[name].samples_s)
    return results


@contextmanager
def kept_on_interrupt(record: dict[str, Any], path: str | os.PathLike | None,
                      save: Callable[[], Any] | None = None) -> Iterator[None]:
    """Ctrl-C inside the block: mark ``record`` interrupted, save it (default: JSON at ``path``), re-raise.

    Commands build their record as they measure, so what a long run had
    finished is written instead of lost; ``python -m harness`` exits 130.
    """
    try:
        yield
    except KeyboardInterrupt:
        record["interrupted"] = True
        (save or (lambda: write_json(path, record)))()
        where = f"kept the measurements finished so far in {path}" if path else "nothing written (no --output)"
        Console(stderr=True).print(f"Ctrl-C: {where}", highlight=False)
        raise


def write_json(path: str | os.PathLike | None, record: dict[str, Any]) -> None:
    """Write a benchmark record with environment and checksums attached."""
    record = dict(record)
    record.setdefault("environment", environment())
    record.setdefault("checksums", checksums())
    record.setdefault("created_unix", time.time())

    def encode(obj: Any) -> Any:
        if isinstance(obj, VariantResult):
            return asdict(obj)
        if isinstance(obj, (torch.dtype, torch.device, Path)):
            return str(obj)
        raise TypeError(f"cannot encode {type(obj).__name__} in benchmark JSON")

    text = json.dumps(record, indent=2, default=encode)
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")


# --------------------------------------------------------------------------
# CPU memory: peak RSS growth of one workload, each in its own process.
_RSS_MARK = "PEAK_RSS_RESULT "


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise BenchmarkError("/proc/self/status has no VmHWM: cannot measure peak RSS")


def _peak_rss_child() -> None:
    """Child side of :func:`peak_rss_growths_in_subprocess` (reads its request from argv)."""
    import importlib

    request = json.loads(sys.argv[1])
    torch.set_num_threads(request["threads"])
    module, _, name = request["target"].partition(":")
    factory = getattr(importlib.import_module(module), name)
    for kwargs in request["kwargs_list"]:
        workload = factory(**kwargs)
        if request["warmup"]:
            workload()  # one-time initialisation is not the workload's memory
            settle()
        worst = None
        for _ in range(request["calls"]):  # the worst of several calls, not a lucky one
            gc.collect()
            with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
                fh.write("5")
            baseline = current_rss_bytes()
            workload()
            growth = {"peak_bytes": _vm_hwm_bytes(), "baseline_bytes": baseline}
            if worst is None or growth["peak_bytes"] - baseline > worst["peak_bytes"] - worst["baseline_bytes"]:
                worst = growth
        print(_RSS_MARK + json.dumps(worst), flush=True)
        del workload
        gc.collect()


def peak_rss_growths_in_subprocess(target: str, kwargs_list: list[dict[str, Any]], *, threads: int = 1,
                                   warmup: bool = True, calls: int = 3, timeout: float = 1800.0) -> list[int]:
    """Extra peak resident memory (bytes) of workloads, measured one after another in a fresh process.

    ``target`` is ``"package.module:function"``; ``function(**kwargs)`` does the
    set-up (its inputs count as baseline) and returns the zero-argument workload.
    For each kwargs the child runs the workload once to warm up (unless
    ``warmup=False``), then runs it ``calls`` times, each after resetting the kernel's
    peak-RSS counter (``/proc/self/clear_refs``), and reports the worst call's peak
    minus the RSS just before that call.
    Allocations above 64 KiB are forced onto ``mmap`` so that freed blocks leave
    the RSS at once: neither a warm-up nor an earlier workload can hide a later
    allocation by recycling heap pages. One process serves the whole list
    because importing torch dominates a child's cost. Linux only.
    """
    import subprocess

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               OMP_NUM_THREADS=str(threads))
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    request = json.dumps({"target": target, "kwargs_list": kwargs_list, "threads": threads, "warmup": warmup,
                          "calls": calls})
    proc = subprocess.run([sys.executable, "-c", "from harness.method import _peak_rss_child; _peak_rss_child()",
                           request], capture_output=True, text=True, timeout=timeout, env=env)
    growths = [json.loads(line[len(_RSS_MARK):]) for line in proc.stdout.splitlines() if line.startswith(_RSS_MARK)]
    if proc.returncode != 0 or len(growths) != len(kwargs_list):
        raise BenchmarkError(f"memory child for {target} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return [max(0, g["peak_bytes"] - g["baseline_bytes"]) for g in growths]
