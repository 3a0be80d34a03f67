"""Tile kernels compiled in another process: AOTInductor packages on disk, loaded in milliseconds.

The auto tier compiles while the caller's eager tiles run. Compiled in a
thread of the caller's process, Inductor's Python holds the GIL that every
eager ATen op gives up and then waits for again: 300 calls of the README
formula at 1000^2 went from 10 ms a call to 30-580 ms for the ~8 s the compile
took (3.3 ms dense), and its hundreds of MiB counted against the call. Here a
child process at the lowest CPU priority (SCHED_IDLE) exports the tile function and
compiles it with AOTInductor into a package in the inductor cache directory;
the caller loads the package (~10 ms) once it is built, and a later process
that finds it starts compiled at its first call. The child costs the caller
neither the GIL nor memory, and only the CPU time nothing else wants.

A build belongs to the process that asked for it. The child leads a process
group of its own (itself and its compilers, in the caller's session); the caller ends that group when
it exits (``stop_builds``, from ``compile``'s exit hook), and the kernel
ends the child when the caller dies without exiting (a signal:
``PR_SET_PDEATHSIG``), which then ends its group. Scripts run one after
another had left a dozen orphaned builds of 350 MB each running for minutes.

A package is keyed by everything its code depends on: the tile source, the
consumers (pickled), the example tile's shapes, strides and dtypes, the compile
options, torch's and Python's versions, and the text of this package. Anything
that goes wrong (no C++ toolchain, an export failure, a timeout) returns None
from ``build`` and the caller compiles in-process as before.
``LAZYTENSOR_COMPILE_ASIDE=thread`` turns this route off.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import getpass
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from . import inductor, lower, threads

BUILD_TIMEOUT_SECONDS = 900
OUTRANKED_BY = 2.0  # see _Turns
POLL_SECONDS = 0.5  # how often a running build looks whether it is outranked
# Inductor options of a package (on top of the kernel's own): the C++ wrapper AOTInductor adds around the
# kernels compiles in 10 s at -O0 against 19 s at -O1 on this machine, and the tile's work is in the kernels.
PACKAGE_OPTIONS = {"aot_inductor.compile_wrapper_opt_level": "O0"}


class _Turns:
    """One build at a time (each child already uses a core); the next turn goes to the waiting build
    whose ``priority()`` is highest then, and a running build that no pass has waited for since it
    started, whose priority a waiting one exceeds ``OUTRANKED_BY`` times, is stopped and queued
    again. The caller's builds had queued in the order their passes asked, and a one-off formula's
    build (a fit's first product) held up the one every iteration waited for: landmark ridge at
    n = 10^5 ran its normal product eager for 44 s, 33 s of it behind such a build."""

    def __init__(self):
        self.changed = threading.Condition()
        self.waiting: dict[object, Callable[[], float]] = {}
        self.holder: object | None = None

    @contextlib.contextmanager
    def turn(self, priority: Callable[[], float]):
        """Hold the turn; yields ``outranked()``: whether a waiting build is wanted much more than this one."""
        ticket = object()
        with self.changed:
            self.waiting[ticket] = priority
            if self.holder is None:
                self._pass_on()
            self.changed.wait_for(lambda: self.holder is ticket)
        at_start = priority()
        try:
            yield lambda: self._outranked(at_start, priority())
        finally:
            with self.changed:
                self.holder = None
                self._pass_on()

    def _outranked(self, at_start: float, mine: float) -> bool:
        """Only a build nobody has waited for since it started (its formula ran no more eager tiles:
        a one-off) gives way; builds of formulas still running would take each other's turns forever."""
        with self.changed:
            return 0 < mine <= at_start and any(wanted() > OUTRANKED_BY * mine for wanted in self.waiting.values())

    def _pass_on(self) -> None:
        if self.waiting:
            self.holder = max(self.waiting, key=lambda ticket: self.waiting[ticket]())  # ties: the first to ask
            del self.waiting[self.holder]
            self.changed.notify_all()


_TURNS = _Turns()
_CHILDREN: set[subprocess.Popen] = set()  # builds running now
stopping = threading.Event()  # set at exit: no build starts any more


def stop_builds() -> None:
    """At exit: no new build starts, and each running one ends with its compilers (its process group)."""
    stopping.set()
    for proc in list(_CHILDREN):
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """The build and its compilers; the child alone if it has not made its group yet."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def available(device: torch.device) -> bool:
    """Whether kernels for ``device`` are built aside: CPU and CUDA (AOTInductor packages hold either's kernels)."""
    return (device.type in ("cpu", "cuda") and os.environ.get("LAZYTENSOR_COMPILE_ASIDE", "process") != "thread"
            and hasattr(torch._C, "_aoti"))


@functools.cache
def code_version() -> str:
    """A digest of lazytensor's source: part of every key of a kernel or graph built from what it generates."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _tensors(args, out=None) -> list:
    """The tile's tensors in the order the package takes them (absent states are no input): the leaves
    of its nested lists and tuples, in order (as ``pytree.tree_leaves``, at a quarter of its ~20 us a call)."""
    out = [] if out is None else out
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _tensors(a, out)
    return out


def _layout(tensors: list) -> list:
    """Shapes, strides and dtypes: what a package's tiles must match (compared every call) and, as
    plain values, part of its key."""
    return [(t.shape, t.stride(), t.dtype) for t in tensors]


def _cache_dir() -> Path:
    """Inductor's cache directory, found without importing Inductor (2 s of a call that only loads a package)."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    user = "".join("_" if c in '\\/:*?"<>|' else c for c in getpass.getuser())
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


def package_path(source: str, consumers, args: tuple, options: dict) -> Path:
    """Where the package of this tile function, on tiles like ``args``, lives (or will)."""
    tiles = [(tuple(shape), stride, str(dtype)) for shape, stride, dtype in _layout(_tensors(args))]
    tiles = tiles, str(pytree.tree_structure(args))
    key = pickle.dumps((source, consumers, tiles, sorted(options.items()), torch.__version__, sys.version, code_version()))
    return _cache_dir() / "lazytensor-aot" / f"{hashlib.sha256(key).hexdigest()[:32]}.pt2"


class Package:
    """A loaded package as a tile kernel; a call on tiles it was not built for runs the eager function.

    Loaded by AOTInductor's C++ loader: the Python one imports dynamo and Inductor first (3 s in a
    fresh process), the C++ one takes 7 ms."""

    def __init__(self, path: Path, args: tuple, eager: Callable):
        device = args[-1].device  # the tile's row mask: where its kernels run
        index = -1 if device.type == "cpu" else device.index if device.index is not None else torch.cuda.current_device()
        self.runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, index)
        self.outputs = pytree.treespec_loads(self.runner.get_call_spec()[1])
        self.layout = _layout(_tensors(args))
        self.eager = eager

    def __call__(self, *args):
        tensors = _tensors(args)
        if _layout(tensors) != self.layout:
            return self.eager(*args)
        return pytree.tree_unflatten(self.runner.run(tensors), self.outputs)


def load(path: Path, args: tuple, eager: Callable) -> Package | None:
    if not path.exists():
        return None
    try:
        return Package(path, args, eager)
    except Exception:  # noqa: BLE001 - a package another torch or a crashed build left: build it again
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def build(path: Path, source: str, consumers, args: tuple, options: dict, eager: Callable,
          priority: Callable[[], float] = float) -> Package | None:
    """The package at ``path``, built by a niced child process if no other process has built it; None on failure.

    ``priority()``: how much this build is wanted now (see ``_Turns``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with _TURNS.turn(priority) as outranked, open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same package: wait for it
            if stopping.is_set():
                return None
            if path.exists() or path.with_suffix(".failed").exists():
                break
            job = path.with_suffix(".job")
            torch.save({"source": source, "consumers": consumers, "args": args, "options": {**options, **PACKAGE_OPTIONS},
                        "path": str(path)}, job)
            threads.forget()  # a build at SCHED_IDLE takes no core from a pass (``threads``); the next look says so
            try:
                result = _run_child(job, outranked)
            finally:
                threads.forget()
                job.unlink(missing_ok=True)
            if result is _OUTRANKED:
                continue
            if result is None:
                return None
            returncode, stderr = result
            if returncode == _EXPORT_FAILED:  # the same job fails every time: do not try again
                path.with_suffix(".failed").write_text(stderr[-4000:])
            if returncode != 0:
                return None
            break
    return load(path, args, eager)


_OUTRANKED = "outranked"


def _run_child(job: Path, outranked: Callable[[], bool]):
    """(returncode, stderr) of the build child; None past ``BUILD_TIMEOUT_SECONDS``; ``_OUTRANKED`` if stopped."""
    here = str(Path(__file__).resolve().parent.parent)  # the child imports this lazytensor, wherever it came from
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(job), str(os.getpid())], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _CHILDREN.add(proc)
    deadline = time.monotonic() + BUILD_TIMEOUT_SECONDS
    try:
        while True:
            try:
                stderr = proc.communicate(timeout=POLL_SECONDS)[1]
                return proc.returncode, stderr
            except subprocess.TimeoutExpired:
                stop = _OUTRANKED if outranked() else None if time.monotonic() > deadline else False
                if stop is not False:
                    _end(proc)
                    proc.communicate()
                    return stop
    finally:
        _CHILDREN.discard(proc)


_EXPORT_FAILED = 3
# The child lowers its priority before it imports anything (torch's import is seconds of CPU): SCHED_IDLE, so
# that any runnable task of the caller preempts it at once, where the platform has it; nice 19 everywhere.
# It leads a process group of its own (itself and the compilers it starts) in the caller's session: a
# session of its own (setsid) is a scheduling group of its own under Linux's autogroup, which shares the
# CPU with the caller's as an equal whatever the child's policy (eager passes ran 5x slower during a
# build). It asks the kernel for SIGTERM when its parent dies (Linux's PR_SET_PDEATHSIG, prctl option
# 1), and answers SIGTERM by ending its process group.
_CHILD = """import contextlib, os, signal, sys
os.setpgid(0, 0)
with contextlib.suppress(OSError, AttributeError):
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
os.nice(19)
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
with contextlib.suppress(OSError, AttributeError):
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[2]):  # the parent died before the request
    os.killpg(0, signal.SIGKILL)
import lazytensor.aot as aot
sys.exit(aot._child(sys.argv[1]))
"""


def _child(job_path: str) -> int:
    """The build process: export the tile function on the job's example tile, compile and package it."""
    torch.set_num_threads(1)
    inductor.settle_vector_isa()
    job = torch.load(job_path, weights_only=False)
    fn = lower.tile_function(job["source"], job["consumers"], "aot")

    class Tile(torch.nn.Module):
        def forward(self, I, J, P, S, mask, rowmask):  # noqa: E741 - the tile function's own argument names
            return fn(I, J, P, S, mask, rowmask)

    try:
        with torch.no_grad():
            program = torch.export.export(Tile(), job["args"], strict=False)
            built = torch._inductor.aoti_compile_and_package(program, package_path=job["path"][:-4] + ".partial.pt2",
                                                             inductor_configs=job["options"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which compiles in-process instead
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return _EXPORT_FAILED
    os.replace(built, job["path"])  # atomic: a reader sees no package or the whole one
    return 0

