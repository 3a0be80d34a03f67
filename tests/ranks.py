"""Run a check on several gloo CPU processes and fail the test with every rank's error.

``run_on_ranks(check, world_size)`` spawns the processes (file rendezvous in a
temporary directory, one thread each); ``check(rank, world_size)`` runs inside
an initialised process group and raises on failure. A rank that dies without
reporting fails the test instead of hanging it.
"""
import os
import queue as queue_module
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, path, queue, check):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        check(rank, world_size)
        queue.put((rank, "ok"))
    except BaseException as exc:  # noqa: BLE001 - report to the parent, which fails the test
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def run_on_ranks(check, world_size: int = 2) -> None:
    """``check(rank, world_size)`` on ``world_size`` processes; asserts every rank reported "ok"."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(rank, world_size, path, queue, check)) for rank in range(world_size)]
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
    assert reports == {rank: "ok" for rank in range(world_size)}, reports
