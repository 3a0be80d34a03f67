"""Accuracy of ``LazyTensor.solve`` (KeOps's KernelSolve) against a dense float64 solve.

    .venv/bin/python benchmarks/kernel_solve.py [--n 2000] [--dtype float32] [--alpha 0.1]

A Gaussian kernel exp(-10 |x_i - x_j|^2) on N uniform points of the unit cube, two random
right-hand sides, default solve options. Prints one JSON line per (dtype, alpha): the condition
number of K + alpha I, the relative residual and the relative error of the solution against
``torch.linalg.solve`` in float64, the seconds of the solve, and whether CG warned.
"""
import json
import time
import warnings

import torch
from common import arguments, parse

import lazytensor as lt


def main() -> None:
    parser = arguments(__doc__, threads=1)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--dtype", choices=["float32", "float64"], action="append")
    parser.add_argument("--alpha", type=float, action="append")
    args = parse(parser)
    for dtype in [getattr(torch, d) for d in (args.dtype or ["float64", "float32"])]:
        for alpha in args.alpha or [0.1, 0.001]:
            gen = torch.Generator().manual_seed(0)
            x = torch.rand(args.n, 3, generator=gen, dtype=torch.float64)
            b = torch.randn(args.n, 2, generator=gen, dtype=torch.float64)
            K = (-lt.Vi(x.to(dtype)).sqdist(lt.Vj(x.to(dtype))) * 10.0).exp()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                a = K.solve(b.to(dtype), alpha=alpha).double()
                seconds = time.perf_counter() - start
            A = torch.exp(-10.0 * torch.cdist(x, x) ** 2) + alpha * torch.eye(args.n, dtype=torch.float64)
            reference = torch.linalg.solve(A, b)
            print(json.dumps({
                "n": args.n, "dtype": str(dtype).removeprefix("torch."), "alpha": alpha,
                "cond": float(torch.linalg.cond(A)), "relative_residual": float((A @ a - b).norm() / b.norm()),
                "relative_error": float((a - reference).norm() / reference.norm()), "seconds": seconds,
                "warned": bool(caught), "threads": args.threads,
            }), flush=True)


if __name__ == "__main__":
    main()
