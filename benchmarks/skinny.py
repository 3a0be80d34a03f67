"""Skinny problems (a few dozen rows or columns against many): eager lazytensor passes beside dense torch.

    flock /tmp/tp-bench.lock .venv/bin/python benchmarks/skinny.py [--threads 2] [--calls 21]

k-means' assignment step (argmin of 50000 points against 1-100 centroids, 2-D) and a few queries
against 200000 points (log-sum-exp and the Gaussian product, 3-D): problems that stay on the eager
tier in a script (a handful of calls), so ``backend="eager"`` is what a user meets. Each figure is
the third-fastest of ``--calls`` calls after two untimed ones, in milliseconds; one JSON line.
"""
from __future__ import annotations

import time

import torch
from common import arguments, emit, parse

import lazytensor as lt


def best(fn, calls: int) -> float:
    fn(), fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[min(2, calls - 1)] * 1e3, 2)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--calls", type=int, default=21)
    args = parse(parser)
    torch.manual_seed(0)
    rows = {}
    for m in (1, 8, 50, 100):
        x, c = torch.randn(50000, 2), torch.randn(m, 2)
        rows[f"argmin, 50000 x {m}"] = (lambda x=x, c=c: lt.Vi(x).sqdist(lt.Vj(c)).argmin(1, backend="eager"),
                                        lambda x=x, c=c: torch.cdist(x, c).argmin(1))
    y, b = torch.randn(200000, 3), torch.randn(200000, 4)
    for n in (1, 10, 100):
        q = torch.randn(n, 3)
        rows[f"logsumexp, {n} x 200000"] = (lambda q=q: (-lt.Vi(q).sqdist(lt.Vj(y))).logsumexp(1, backend="eager"),
                                            lambda q=q: torch.logsumexp(-torch.cdist(q, y) ** 2, 1))
        rows[f"Gaussian product, {n} x 200000"] = (lambda q=q: (-lt.Vi(q).sqdist(lt.Vj(y))).exp().matmul(b, backend="eager"),
                                                   lambda q=q: torch.exp(-torch.cdist(q, y) ** 2) @ b)
    rows = {name: (best(ours, args.calls), best(dense, args.calls)) for name, (ours, dense) in rows.items()}
    emit({"threads": args.threads, "ms": {k: {"lazytensor": v[0], "dense": v[1], "ratio": round(v[0] / v[1], 2)}
                                          for k, v in rows.items()}})


if __name__ == "__main__":
    main()
