"""A training step that reduces formulas: eager, under torch.compile(fullgraph=True), and dense torch.

    flock /tmp/tp-bench.lock .venv/bin/python benchmarks/training_step.py [--threads 2] [--sizes 200,4000,16000]
        [--api keops] [--loss sinkhorn [--iterations 10]]
    ... [--fresh [--cold] [--processes 2]]   # the first three steps of each route, a fresh process each

The steps are issue 44's, on N points against N in 3-D, float32, the loss's value and its gradient in the
points: a Gaussian kernel product and a log-sum-exp (``--loss kernel``), or a log-domain Sinkhorn loss of
``--iterations`` (10) iterations, two log-sum-exps each on one cost matrix (``--loss sinkhorn``). "compiled" is the step under
``torch.compile(fullgraph=True)`` as a user gets it (small static problems traced into the graph,
``lazytensor.library.inlined``); "operators" the same with every reduction a ``lazytensor::reduce``
operator (``INLINE_MAX_BYTES`` 0 while it traces). The steps alternate round by round (after three
untimed rounds, the compiles among them), so a busy moment hits them alike; each figure is the median
step in milliseconds, with compiled / eager and eager / dense beside it, and ``first`` the first step
of each in this process (a compiled one's includes Dynamo and Inductor's compile of the step, with the
project's warm or cold inductor cache as it is); one JSON line. ``--fresh`` measures what a user meets instead: the
first three steps (seconds) of each route, eager, compiled, operators and dense torch compiled, each in a fresh
process (``--processes`` of them a route, one after the other: the later ones find the cache the first left;
``--cold``: each with an empty ``TORCHINDUCTOR_CACHE_DIR``).
Dense torch builds the N x N matrix (skipped above ``--dense-max``). ``--api keops`` writes the step
with pykeops's spellings (``lazytensor.keops``: ``LazyTensor(x[:, None, :])``, ``sum(-1)``, ``dim=1``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import arguments, emit, parse

import lazytensor as lt
from lazytensor import library
from lazytensor.keops import LazyTensor


def loss(x, y, b):
    K = (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp()
    return (K @ b).sin().sum() + (-lt.Vi(x).sqdist(lt.Vj(y))).logsumexp(1).sum()


def keops_loss(x, y, b):
    D = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
    return ((-0.5 * D).exp() @ b).sin().sum() + (-D).logsumexp(dim=1).sum()


def dense_loss(x, y, b):
    D = ((x[:, None] - y[None]) ** 2).sum(-1)
    return (torch.exp(-0.5 * D) @ b).sin().sum() + torch.logsumexp(-D, 1).sum()


SINKHORN = {"iterations": 10, "blur": 0.1}  # --iterations sets the first


def sinkhorn_loss(x, y, b):
    """Uniform weights; ``b`` unused (the steps share a signature)."""
    C = lt.Vi(x).sqdist(lt.Vj(y)) / 2
    f, g = None, torch.zeros(len(y), 1)
    for _ in range(SINKHORN["iterations"]):
        f = -SINKHORN["blur"] * ((lt.Vj(g) - C) / SINKHORN["blur"] - math.log(len(y))).logsumexp(1)
        g = -SINKHORN["blur"] * ((lt.Vi(f) - C) / SINKHORN["blur"] - math.log(len(x))).logsumexp(0)
    return f.mean() + g.mean()


def dense_sinkhorn_loss(x, y, b):
    C = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    f, g = None, torch.zeros(len(y), 1)
    for _ in range(SINKHORN["iterations"]):
        f = -SINKHORN["blur"] * torch.logsumexp((g.T - C) / SINKHORN["blur"] - math.log(len(y)), 1, keepdim=True)
        g = -SINKHORN["blur"] * torch.logsumexp((f - C) / SINKHORN["blur"] - math.log(len(x)), 0).unsqueeze(1)
    return f.mean() + g.mean()


STEPS = {("lazytensor", "kernel"): (loss, dense_loss), ("keops", "kernel"): (keops_loss, dense_loss),
         ("lazytensor", "sinkhorn"): (sinkhorn_loss, dense_sinkhorn_loss)}


def as_operators(step):
    """``step`` compiled with every reduction a ``lazytensor::reduce`` operator: nothing inlined while it traces."""
    compiled = torch.compile(lambda x, y, b: step(x, y, b), fullgraph=True)  # its own code object: its own graphs

    def call(x, y, b):
        limit, library.INLINE_MAX_BYTES = library.INLINE_MAX_BYTES, 0
        try:
            return compiled(x, y, b)
        finally:
            library.INLINE_MAX_BYTES = limit

    return call


FRESH_ROUTES = ("eager", "compiled", "operators", "dense compiled")


def first_steps(route: str, step, dense_step, n: int) -> list[float]:
    """Seconds of the first three steps of ``route`` in this process (meant to be a fresh one)."""
    if route == "operators":
        library.INLINE_MAX_BYTES = 0
    fn = step if route == "eager" else torch.compile(dense_step if route == "dense compiled" else step, fullgraph=True)
    torch.manual_seed(0)
    x, y, b = torch.randn(n, 3), torch.randn(n, 3), torch.randn(n, 1)
    seconds = []
    for _ in range(3):
        xi = x.clone().requires_grad_()
        start = time.perf_counter()
        torch.autograd.grad(fn(xi, y, b), xi)
        seconds.append(round(time.perf_counter() - start, 3))
    return seconds


def fresh(args) -> dict:
    """{size: {route: [first three steps of each process]}}, every process a new one."""
    rows = {}
    for n in (int(s) for s in args.sizes.split(",")):
        rows[n] = {route: [] for route in FRESH_ROUTES}
        for route in FRESH_ROUTES:
            for _ in range(args.processes):
                env = dict(os.environ, **({"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()} if args.cold else {}))
                command = [sys.executable, __file__, "--threads", str(args.threads), "--api", args.api, "--loss", args.loss,
                           "--iterations", str(args.iterations), "--sizes", str(n), "--child", route]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                rows[n][route].append(json.loads(done.stdout.splitlines()[-1]))
    return rows


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sizes", default="200,4000,16000")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default: about 20 s a size)")
    parser.add_argument("--dense-max", type=int, default=8000)
    parser.add_argument("--api", choices=("lazytensor", "keops"), default="lazytensor")
    parser.add_argument("--loss", choices=("kernel", "sinkhorn"), default="kernel")
    parser.add_argument("--iterations", type=int, default=SINKHORN["iterations"], help="the Sinkhorn loss's iterations")
    parser.add_argument("--fresh", action="store_true", help="first steps of each route, a fresh process each")
    parser.add_argument("--cold", action="store_true", help="with --fresh: an empty inductor cache each process")
    parser.add_argument("--processes", type=int, default=2, help="with --fresh: processes a route")
    parser.add_argument("--child", choices=FRESH_ROUTES, help=argparse.SUPPRESS)
    args = parse(parser)
    if (args.api, args.loss) not in STEPS:
        parser.error(f"--loss {args.loss} is written with lazytensor's spellings only (--api lazytensor)")
    SINKHORN["iterations"] = args.iterations
    step, dense_step = STEPS[(args.api, args.loss)]
    if args.child:
        return print(json.dumps(first_steps(args.child, step, dense_step, int(args.sizes))))
    if args.fresh:
        return emit({"benchmark": "training_step", "fresh": "cold" if args.cold else "as the cache is", "api": args.api,
                     "loss": args.loss, "iterations": args.iterations, "threads": args.threads, "seconds": fresh(args)})
    rows = {}
    for n in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        x, y, b = torch.randn(n, 3), torch.randn(n, 3), torch.randn(n, 1)
        steps = {"eager": step, "compiled": torch.compile(step, fullgraph=True), "operators": as_operators(step)}
        if n <= args.dense_max:
            steps["dense"] = dense_step
        times = {name: [] for name in steps}
        rounds, k = args.rounds, 0
        while k < 3 + (rounds or 3):
            for name, fn in steps.items():
                xi = x.clone().requires_grad_()
                start = time.perf_counter()
                torch.autograd.grad(fn(xi, y, b), xi)
                times[name].append(time.perf_counter() - start)
            k += 1
            if not rounds and k == 4:  # about 20 s a size from the first timed round
                rounds = max(3, min(200, int(20 / sum(t[-1] for t in times.values()))))
        ms = {name: round(statistics.median(t[3:]) * 1e3, 2) for name, t in times.items()}
        rows[n] = {**ms, "first": {name: round(t[0] * 1e3, 1) for name, t in times.items()},
                   "compiled/eager": round(ms["compiled"] / ms["eager"], 2),
                   "operators/eager": round(ms["operators"] / ms["eager"], 2),
                   **({"eager/dense": round(ms["eager"] / ms["dense"], 2)} if "dense" in ms else {}),
                   "rounds": len(times["eager"]) - 3}
        torch._dynamo.reset()
    emit({"benchmark": "training_step", "api": args.api, "loss": args.loss, "threads": args.threads, "ms": rows})


if __name__ == "__main__":
    main()
