"""How many threads a tile pass uses: only the cores that other work leaves free.

A pass runs thousands of short parallel regions, and each waits for its
slowest thread: with one of two cores taken by another process, every region
waits for a descheduled thread (the issue measured the RBF product's first call at 42.6 s
with one of two cores busy, dense 2.8 s; with this module the later calls slow down 1.5x
busy against quiet, dense 1.15-1.5x: ``python -m harness operators --first-call --busy``,
docs/performance.md). A pass therefore counts the
tasks runnable on the machine right now (``/proc/loadavg``), less this
process's own and, where that leaves any, less those of the idle scheduling
class (kernel builds, ours or anyone's: ``aot`` builds at ``SCHED_IDLE``, and
they get a core only when nothing else wants it), plus this process's
background compiles (they take a core too), and runs with the cores left,
at least one. It looks again at each row
block (at most every ``RECHECK_SECONDS``), and torch's setting is restored
when the pass ends. Compiled kernels read the thread count when they run
(``inductor.COMPILE_OPTIONS``) and are compiled without dynamo's guard on it
(``compile._without_global_state``), so this never recompiles.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch

RECHECK_SECONDS = 0.1
background_compiles = 0  # compiles running in this process's background threads (compile keeps it)
_SCHED_IDLE = "5"  # a task's scheduling policy, field 41 of /proc/PID/task/TID/stat
_seen = [-math.inf, 0, 0]  # (when, threads wanted, threads granted)
_wanted: list[int] = []  # torch's thread count when the outermost pass began (a stack of one)


def threads_left(wanted: int, cores: int, others: int) -> int:
    """``wanted`` threads, at most the cores that ``others`` runnable tasks leave, at least one."""
    return max(1, min(wanted, cores - max(0, others)))


def free_threads(wanted: int) -> int:
    """Threads for a pass that wants ``wanted`` (see the module docstring); /proc read once per interval."""
    if wanted <= 1:
        return wanted
    now = time.monotonic()
    if now - _seen[0] >= RECHECK_SECONDS or _seen[1] != wanted:
        _seen[:] = [now, wanted, _measure(wanted)]
    return _seen[2]


def forget() -> None:
    """The load changed here (a background compile started or ended): look again at the next row block."""
    _seen[0] = -math.inf


def _measure(wanted: int) -> int:
    try:
        with open("/proc/loadavg") as fh:
            runnable = int(fh.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/stat") as fh:
                own += fh.read().rsplit(")", 1)[1].split()[0] == "R"
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: keep torch's setting
        return wanted
    others = runnable - max(own, 1)
    if others > 0:
        others = min(others, _runnable_elsewhere())
    return threads_left(wanted, cores, others + background_compiles)


def _runnable_elsewhere() -> int:
    """Runnable tasks of other processes, those of the idle scheduling class left out.

    Read only when the load average counts other runnable tasks (~1 ms for a
    hundred tasks, at most every ``RECHECK_SECONDS``): a kernel build with its
    compiler processes, niced to ``SCHED_IDLE``, counted as load halved the
    threads of the eager passes it exists to speed up (the distance sum at
    16384^2 ran 0.5-0.7 s a call against 0.3 s), and orphaned builds of
    processes that had exited did the same to the next process."""
    me, count = str(os.getpid()), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    count += counts_as_load(fh.read())
        except (OSError, IndexError):  # the task ended while we looked
            continue
    return count


def counts_as_load(stat: str) -> bool:
    """Whether the task of this ``/proc/.../stat`` line is runnable and not of the idle scheduling class."""
    fields = stat.rsplit(")", 1)[1].split()  # from field 3 (the state) on; the command name may hold spaces
    return fields[0] == "R" and fields[38] != _SCHED_IDLE


@contextlib.contextmanager
def pass_threads(device: torch.device):
    """Run one pass with ``free_threads`` on CPU (followed at each row block), then restore torch's count."""
    if device.type != "cpu" or _wanted:  # a pass inside a pass (none today) keeps the outer one's setting
        yield
        return
    wanted = torch.get_num_threads()
    _wanted.append(wanted)
    try:
        follow_load()
        yield
    finally:
        _wanted.pop()
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)


def follow_load() -> None:
    """Inside a CPU pass: set torch's thread count to what is free now."""
    if _wanted:
        use = free_threads(_wanted[0])
        if use != torch.get_num_threads():
            torch.set_num_threads(use)
