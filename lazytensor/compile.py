"""Compiled tile kernels: one bounded cache, one fallback, and when the "auto" tier compiles.

A kernel is the generated tile function for a set of consumers, compiled by
torch.compile on a fixed tile shape (the engine pads ragged tiles into
fixed-stride buffers and passes float constants as values, so a new N, M or
constant never recompiles). Kernels are cached by (IR signature, dtype,
device, tile shape, backend) in a least-recently-used cache of
``MAX_KERNELS`` entries. If compilation fails at any call, the eager function
takes over for that key after one warning: a slow answer beats no answer, and
the warning says why it is slow.

The "auto" backend tiers like a JIT: a formula runs eagerly until the eager
time it has cost (this process, problems of at least AUTO_COMPILE_MIN_PAIRS
pairs) exceeds COMPILE_AFTER_SECONDS, then compiles, in a background thread
(``CompiledKernel.compile_in_background``) while the caller's eager tiles
go on; a formula already compiled in this process compiles its new tile
shapes at once. A one-off call never waits seconds for a compile it cannot
amortise; a loop pays one. The engine decides when to look
(``worth_compiling``); this module keeps the time each formula has cost.

At exit (``_at_exit``) builds in child processes end at once and nothing new
starts; a compile running in a thread of this process is waited for: an
interpreter that finalized under it crashed (a segmentation fault, exit 139).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import sys
import threading
import warnings
from collections import OrderedDict
from typing import Callable

import torch

from . import aot, inductor, lower, threads

MAX_KERNELS = 64
# The auto tier weighs compiling passes from 256 x 256 pairs on (a judgement, not a measured
# optimum: smaller passes keep the eager route of the small-problem tests). Repeated medium passes need it: GeomLoss's sinkhorn at
# n = m = 2000 (42 log-sum-exp passes of 4e6 pairs a call) never compiled under a 4e6-pair floor,
# 4.18 s a call; now 1.21 s from call 2 (call 1 7.89 s, compiling aside; docs/keops.md).
AUTO_COMPILE_MIN_PAIRS = 1 << 16
# A sharded pass cannot consult its history (every rank must cut the same row blocks): it compiles
# from this size on, where one compile pays for itself within the call.
SHARDED_COMPILE_MIN_PAIRS = 1 << 22
COMPILE_AFTER_SECONDS = 1.0
# On an accelerator the same rule with another measure: an eager tile there costs microseconds of launches
# (host time, which is all a pass can time without synchronizing), and a compiled kernel ran 5.5x faster
# than eager tiles at 16384^2 on an H200 (1.42 against 7.8 ms a call; the 1 s rule had not compiled after
# 6 calls). Where its build runs aside (``aot``: no GIL, no memory of the caller's), a large formula is
# built at its first call.
ACCELERATOR_COMPILE_AFTER_SECONDS = 0.0
# A kernel build runs at SCHED_IDLE (``aot``): while passes keep every core busy it gets none, so a long
# fit ran eager to its end (landmark ridge at n = 10^5: 31 of 31 passes). An eager pass of a formula whose
# build is pending therefore leaves it a core once the formula has cost this much eager time (a build
# is ~20 s of one core). Measured, cold cache: at 10 s the quantile at 20000^2 (five formulas, three
# calls) took 68-78 s against 53-56 s, its builds too late to pay back the halved passes; at 30 s it
# takes 56 s, and landmark ridge at n = 10^6 still builds its product within its first passes (374 s, was 486).
BUILD_CORE_AFTER_SECONDS = 30.0
_CACHE: OrderedDict[tuple, Callable] = OrderedDict()
_LOCK = threading.RLock()
stats = {"built": 0, "fallbacks": 0}  # kernels generated (cache misses) and compile failures
_EAGER_SECONDS: dict[tuple, float] = {}  # formula -> eager time spent on it (the "auto" tiering)
_COMPILED_FORMULAS: set[tuple] = set()


class CompileFallbackWarning(RuntimeWarning):
    """torch.compile failed for a tile kernel; the eager lowering runs instead."""


class CompiledKernel:
    """``torch.compile`` of one tile function at one tile shape; the eager function after a failure.

    Compilation happens at the first call, on the caller's thread, or ahead of
    it in a background thread (``compile_in_background``) while the caller's
    eager tiles run: the "auto" tier switches to this kernel once ``ready``.
    A failure in the background is warned about on the caller's thread, at
    its next look.
    """

    def __init__(self, eager: Callable, label: str, options: dict, formula: tuple, consumers):
        self.eager, self.label, self.source, self.formula, self.options = eager, label, eager.source, formula, options
        self.consumers = consumers
        self.fn: Callable | None = None  # a loaded package, or torch.compile'd at the first compiled call
        self.looked_on_disk = False
        self.compiled = True
        self.first = True
        self.background: threading.Thread | None = None
        self.compiled_once = threading.Event()  # set after the first call returned (compiled or fallen back)
        self.failure: str | None = None  # a background compile's error, not yet warned about

    def __call__(self, *args):
        self._warn_failure()
        if self.compiled:
            try:
                return self._compiled_call(args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
                self._fall_back(exc)
                self._warn_failure(stacklevel=3)
        return self.fn(*args)

    @property
    def ready(self) -> bool:
        """Compiled and usable without waiting: the auto tier switches to it."""
        self._warn_failure()
        return self.compiled and self.compiled_once.is_set()

    def _compiled_call(self, args: tuple):
        if self.fn is None:
            self.from_disk(args)
        if self.first and self.fn is None and args[-1].device.type == "cpu":  # tile(I, J, P, S, mask, rowmask): CPU
            inductor.settle_vector_isa()
        self.first = False
        if self.fn is None:  # the process's first torch.compile imports dynamo and inductor (~2 s): not on the caller's thread
            options = {**self.options, **({"guard_filter_fn": _without_global_state} if _GUARD_FILTERS else {})}
            self.fn = torch.compile(self.eager, fullgraph=True, dynamic=False, options=options)
        out = self.fn(*args)
        self._compiled_once()
        return out

    def _package_path(self, args: tuple):
        return aot.package_path(self.source, self.consumers, args, self.options)

    def from_disk(self, args: tuple) -> bool:
        """Use the package an earlier build left for tiles like ``args`` (``aot``), once looked for; True if ready."""
        if not self.looked_on_disk and self.fn is None and aot.available(args[-1].device):
            self.looked_on_disk = True
            self._use(aot.load(self._package_path(args), args, self.eager))
        return self.ready

    def _use(self, package) -> None:
        if package is not None:
            self.fn = package
            self._compiled_once()

    def _compiled_once(self) -> None:
        if not self.compiled_once.is_set():
            _COMPILED_FORMULAS.add(self.formula)  # its other tile shapes compile without waiting for eager time
            self.compiled_once.set()

    def _fall_back(self, exc: Exception) -> None:
        stats["fallbacks"] += 1
        self.fn, self.compiled = self.eager, False
        self.failure = f"{type(exc).__name__}: {exc}"
        self.compiled_once.set()

    def _warn_failure(self, stacklevel: int = 4) -> None:
        if self.failure is not None:
            failure, self.failure = self.failure, None
            warnings.warn(f"torch.compile failed for tile kernel {self.label} ({failure}); running eager",
                          CompileFallbackWarning, stacklevel=stacklevel)

    def compile_in_background(self, args: tuple) -> None:
        """Compile by one call on ``args`` (copies of a real tile's) in a daemon thread; at most once."""
        with _LOCK:
            if self.background is not None or not self.compiled:
                return
            self.background = threading.Thread(target=contextvars.copy_context().run, args=(self._background_call, args),
                                               name=f"lazytensor-compile-{self.label}", daemon=True)
        _BACKGROUND.start(self.background)

    def _background_call(self, args: tuple) -> None:
        """A package built by a niced child process (``aot``); where that fails, torch.compile in this thread."""
        try:
            if aot.available(args[-1].device):
                self._use(aot.build(self._package_path(args), self.source, self.consumers, args, self.options, self.eager,
                                    priority=lambda: eager_seconds(self.formula)))  # the costliest formula first
            if self.fn is None:
                with _BACKGROUND.compiling_here() as allowed:
                    if allowed:
                        self._compiled_call(args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
            self._fall_back(exc)
        finally:
            _BACKGROUND.finished()


_GUARD_FILTERS = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 9)  # the option is new in 2.9


def _without_global_state(guards) -> list[bool]:
    """Dynamo's guards for a tile kernel, less the global-state one.

    That guard compares grad mode and the thread count, among others, with the
    tracing thread's: a kernel compiled in the background thread (grad mode on,
    one thread while the caller's pass ran) failed it at its first call from the
    pass (grad mode off, two threads) and recompiled there, on the caller's thread,
    once per thread count the pass moved to. A tile needs neither: its inputs are
    detached, and it reads the thread count when it runs (``cpp.dynamic_threads``).
    What else that guard covers and can change a tile's values (default dtype,
    autocast) is in the kernel's key instead (``formula_key``).
    """
    return [entry.guard_type != "GLOBAL_STATE" for entry in guards]


class _Background:
    """Background compiles in flight (``wait`` blocks until none is). While one compiles in this process
    (not in a child: ``aot``), the interpreter switches threads every ``SWITCH_SECONDS`` instead of
    every 5 ms: the caller's eager tiles give up the GIL inside each ATen op, and with the default
    interval each op's return could wait 5 ms for the compiler's Python to yield it back.
    The cores a background compile takes from the passes (``threads.background_compiles``): one per
    compile in this process, and one during an eager pass that leaves it to its formula's pending
    build (``BUILD_CORE_AFTER_SECONDS``; compiled passes keep every core)."""

    SWITCH_SECONDS = 2e-4

    def __init__(self):
        self.running, self.here, self.saved_interval = 0, 0, None
        self.build_core = 0
        self.idle = threading.Condition(_LOCK)

    def _take_cores(self) -> None:
        threads.background_compiles = self.here + self.build_core
        threads.forget()

    def start(self, thread: threading.Thread) -> None:
        with _LOCK:
            self.running += 1
        thread.start()

    def finished(self) -> None:
        with _LOCK:
            self.running -= 1
            if self.running == 0:
                self.idle.notify_all()

    @contextlib.contextmanager
    def eager_pass(self):
        """An auto-tier pass's eager tiles; yields ``leave_core(bool)``: whether they leave the builds a core now."""
        try:
            yield self._leave_core
        finally:
            self._leave_core(False)

    def _leave_core(self, leave: bool) -> None:
        with _LOCK:
            if self.build_core != leave:
                self.build_core = int(leave)
                self._take_cores()

    @contextlib.contextmanager
    def compiling_here(self):
        """Around a compile in this process; yields False (compile nothing) once the process exits."""
        with _LOCK:
            if aot.stopping.is_set():
                allowed = False
            else:
                allowed = True
                if self.here == 0:
                    self.saved_interval = sys.getswitchinterval()
                    sys.setswitchinterval(min(self.saved_interval, self.SWITCH_SECONDS))
                self.here += 1
                self._take_cores()  # the compiler takes a core from the passes
        if not allowed:
            yield False
            return
        try:
            yield True
        finally:
            with _LOCK:
                self.here -= 1
                self._take_cores()
                if self.here == 0:
                    sys.setswitchinterval(self.saved_interval)
                    self.idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with _LOCK:
            return self.idle.wait_for(lambda: self.running == 0, timeout)


_BACKGROUND = _Background()


@atexit.register
def _at_exit() -> None:
    """The process ends: its builds end with it, and an in-process compile is waited for (see the module doc)."""
    aot.stop_builds()  # before the lock: a compile that starts after it sees ``stopping``
    with _LOCK:
        _BACKGROUND.idle.wait_for(lambda: _BACKGROUND.here == 0)


def eager_pass():
    """Around an auto-tier pass's eager tiles; yields ``leave_core(bool)`` (``BUILD_CORE_AFTER_SECONDS``)."""
    return _BACKGROUND.eager_pass()


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Block until no background compile runs (tests, benchmarks that want the steady state); False on timeout."""
    return _BACKGROUND.wait(timeout)


def formula_key(problem, consumers, exprs, expand: bool) -> tuple:
    """What a pass's kernels are keyed by besides their tile shapes: consumers, the formula's structure
    (``exprs`` per consumer, symbols renamed by position), axes, dtype, device type, the norm expansion,
    and the global state a traced tile could depend on (default dtype, autocast; see ``_without_global_state``)."""
    return (
        tuple(c.signature for c in consumers),
        problem.canonical([e for es in exprs for e in es]),
        tuple(problem.info[s].axis for s in problem.order),
        problem.dtype,
        problem.device.type,
        expand,
        torch.get_default_dtype(),
        torch.is_autocast_enabled(problem.device.type) and torch.get_autocast_dtype(problem.device.type),
    )


def tile_kernel(consumers, exprs, info, order, *, formula: tuple, shapes, compiled: bool, expand: bool = True) -> Callable:
    """The (cached) tile function for ``consumers`` evaluating ``exprs``: one per (formula, tile shapes, backend)."""
    key = (formula, shapes)
    full_key = (key, compiled)
    with _LOCK:
        fn = _CACHE.get(full_key)
        if fn is not None:
            _CACHE.move_to_end(full_key)
            return fn
        label = f"{abs(hash(key)) % 10**8:08d}"
        eager = lower.build_tile_function(consumers, exprs, info, order, label, expand=expand, eager=not compiled)
        options = {**inductor.COMPILE_OPTIONS, **{k: v for c in consumers for k, v in c.compile_options.items()}}
        fn = CompiledKernel(eager, label, options, formula, consumers) if compiled else eager
        _CACHE[full_key] = fn
        stats["built"] += 1
        while len(_CACHE) > MAX_KERNELS:
            _CACHE.popitem(last=False)
    return fn


def cached_kernel(formula: tuple, shapes, compiled: bool):
    """The kernel ``tile_kernel`` would return, if it is cached; None otherwise (nothing is built)."""
    with _LOCK:
        return _CACHE.get(((formula, shapes), compiled))


def record_eager(formula_key: tuple, seconds: float) -> None:
    _EAGER_SECONDS[formula_key] = _EAGER_SECONDS.get(formula_key, 0.0) + seconds


def eager_seconds(formula_key: tuple) -> float:
    return _EAGER_SECONDS.get(formula_key, 0.0)


def compiled_before(formula_key: tuple) -> bool:
    return formula_key in _COMPILED_FORMULAS


def set_compile_after(seconds: float) -> None:
    """The auto tier compiles a formula once it has cost ``seconds`` of eager time (0: at its first large call;
    benchmarks that measure the compiled steady state set that)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
    global COMPILE_AFTER_SECONDS
    COMPILE_AFTER_SECONDS = float(seconds)


_CPU = torch.device("cpu")


def compile_after(device: torch.device) -> float:
    """The eager seconds after which the auto tier compiles a formula on ``device`` (see the constants above)."""
    if device.type != "cpu" and aot.available(device):
        return min(COMPILE_AFTER_SECONDS, ACCELERATOR_COMPILE_AFTER_SECONDS)
    return COMPILE_AFTER_SECONDS


def worth_compiling(formula_key: tuple, pairs: int, eager_time: float, device: torch.device = _CPU) -> bool:
    """The auto tier's rule: a problem of ``pairs`` pairs compiles once ``eager_time`` (the formula's eager
    seconds, spent or projected) reaches ``compile_after(device)``, or at once if the formula compiled before."""
    return pairs >= AUTO_COMPILE_MIN_PAIRS and (compiled_before(formula_key) or eager_time >= compile_after(device))


def cache_size() -> int:
    return len(_CACHE)


def compile_available() -> bool:
    """torch.compile needs a working C++ toolchain on CPU; allow opting out."""
    return os.environ.get("LAZYTENSOR_DISABLE_COMPILE", "") not in ("1", "true", "yes")
