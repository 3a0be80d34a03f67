"""Run a check on several gloo CPU processes (``torch.multiprocessing``, a file rendezvous) and collect their reports.

``run_ranks(check, world)`` starts ``world`` processes; each initialises the
default process group, runs ``check(rank, *args)`` on one thread and reports
"ok" or the exception it raised. A process that dies without reporting is
reported too, so a test never hangs on a crashed rank.
"""
import os
import queue as queue_module
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, path, queue, check, args):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        check(rank, *args)
        queue.put((rank, "ok"))
    except BaseException as exc:  # noqa: BLE001 - report to the parent, which fails the test
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_ranks(check, world: int = 2, args: tuple = ()) -> dict[int, str]:
    """{rank: "ok" or what went wrong} after ``check(rank, *args)`` ran on every rank (``check``: a module-level function)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(rank, world, path, queue, check, args)) for rank in range(world)]
        for p in procs:
            p.start()
        reports = {}
        while len(reports) < len(procs):  # until every rank reports, or one dies without reporting
            try:
                rank, report = queue.get(timeout=5)
                reports[rank] = report
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reports]
                reports.update({r: f"exited with code {procs[r].exitcode} without a report" for r in dead})
        for p in procs:
            p.join()
    return reports
