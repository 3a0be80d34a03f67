"""Accuracy of ``LazyTensor.solve`` (KeOps's KernelSolve) against a dense float64 solve.

    .venv/bin/python benchmarks/kernel_solve.py [--n 2000] [--dtype float32] [--alpha 0.1] [--source auto]
    .venv/bin/python benchmarks/kernel_solve.py --tutorial [--n 5000] [--repeats 3]

A Gaussian kernel exp(-10 |x_i - x_j|^2) on N uniform points of the unit cube, two random
right-hand sides, default solve options (``--source``: the route, default ``auto``). Prints one
JSON line per (dtype, alpha): the condition number of K + alpha I, the relative residual and the
relative error of the solution against ``torch.linalg.solve`` in float64, the seconds of the
solve, whether CG warned and the route taken.

``--tutorial``: KeOps's KernelSolve tutorial beside its dense twin, in one process, alternated
(``--repeats`` rounds after one untimed round of each): ``K.solve(Vi(b), alpha=0.01)`` for
K = exp(-|x_i - x_j|^2 / (2 * 0.1^2)) on N uniform points of [0, 1]^2, b (N, 2), float64, against
``torch.linalg.solve(K + 0.01 I, b)`` with K formed by ``torch.cdist``; each timing includes
forming K. One JSON line: every round's seconds, the medians, their ratio, the route and the
relative difference of the two solutions.
"""
import json
import statistics
import time
import warnings

import torch
from common import arguments, parse

import lazytensor as lt
from solvers import formula_solve


def main() -> None:
    parser = arguments(__doc__, threads=1)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--dtype", choices=["float32", "float64"], action="append")
    parser.add_argument("--alpha", type=float, action="append")
    parser.add_argument("--source", default="auto", choices=["auto", "direct", "stored", "streamed"])
    parser.add_argument("--tutorial", action="store_true", help="KeOps's KernelSolve tutorial beside torch.linalg.solve")
    parser.add_argument("--repeats", type=int, default=3)
    args = parse(parser)
    if args.tutorial:
        return tutorial(args.n if args.n != 2000 else 5000, args.repeats, args.threads)
    for dtype in [getattr(torch, d) for d in (args.dtype or ["float64", "float32"])]:
        for alpha in args.alpha or [0.1, 0.001]:
            gen = torch.Generator().manual_seed(0)
            x = torch.rand(args.n, 3, generator=gen, dtype=torch.float64)
            b = torch.randn(args.n, 2, generator=gen, dtype=torch.float64)
            K = (-lt.Vi(x.to(dtype)).sqdist(lt.Vj(x.to(dtype))) * 10.0).exp()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                a = K.solve(b.to(dtype), alpha=alpha, source=args.source).double()
                seconds = time.perf_counter() - start
            A = torch.exp(-10.0 * torch.cdist(x, x) ** 2) + alpha * torch.eye(args.n, dtype=torch.float64)
            reference = torch.linalg.solve(A, b)
            print(json.dumps({
                "n": args.n, "dtype": str(dtype).removeprefix("torch."), "alpha": alpha,
                "cond": float(torch.linalg.cond(A)), "relative_residual": float((A @ a - b).norm() / b.norm()),
                "relative_error": float((a - reference).norm() / reference.norm()), "seconds": seconds,
                "warned": bool(caught), "threads": args.threads, "route": formula_solve.last_solve.route,
            }), flush=True)


def tutorial(n: int, repeats: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=gen, dtype=torch.float64)
    b = torch.rand(n, 2, generator=gen, dtype=torch.float64)

    def ours():
        K = (-lt.Vi(x).sqdist(lt.Vj(x)) / (2 * 0.1**2)).exp()
        return K.solve(lt.Vi(b), alpha=0.01)

    def dense():
        K = torch.exp(-torch.cdist(x, x) ** 2 / (2 * 0.1**2))
        return torch.linalg.solve(K + 0.01 * torch.eye(n, dtype=torch.float64), b)

    seconds = {"ours": [], "dense": []}
    for round_ in range(repeats + 1):
        for name, fn in (("ours", ours), ("dense", dense)):
            start = time.perf_counter()
            result = fn()
            if round_:
                seconds[name].append(time.perf_counter() - start)
            if name == "ours":
                a = result
        reference = result
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(json.dumps({
        "n": n, "threads": threads, "seconds": seconds, "median_ours": medians["ours"],
        "median_dense": medians["dense"], "ratio": medians["ours"] / medians["dense"],
        "route": formula_solve.last_solve.route, "reason": formula_solve.last_solve.info.reason,
        "relative_difference": float((a - reference).norm() / reference.norm()),
    }), flush=True)


if __name__ == "__main__":
    main()
