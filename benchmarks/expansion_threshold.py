"""Norm expansion against direct differences for squared distances, by feature count (lower.EXPANSION_MIN_FEATURES).

For each D, the compiled steady-state time (median of 5 after a warm-up) of
the RBF product exp(-g |x_i - y_j|^2) @ b (b with 1 and 16 columns), its
forward + backward (gradient in x, 16 columns), logsumexp and argkmin(8),
once with every D >= 1 expanded (|x|^2 + |y|^2 - 2 x.y) and once with none.
Each route runs in its own process (the threshold is read when a kernel is
built). Usage:

    python benchmarks/expansion_threshold.py [--n 16384] [--d 8 12 16 32 64] [--backward-d 8 16] [--threads 2]
"""
import statistics
import subprocess
import sys

import torch
from common import arguments, call_times, emit, parse

import lazytensor as lt
from lazytensor import lower

ROUTES = {"expansion": 1, "direct": 10**9}


def median_time(fn, repeats=5):
    return statistics.median(call_times(fn, repeats))


def measure(n: int, d: int, backward: bool) -> dict:
    gen = torch.Generator().manual_seed(d)
    x, y = torch.randn(n, d, generator=gen) / d**0.5, torch.randn(n, d, generator=gen) / d**0.5
    b1, b16 = torch.randn(n, 1, generator=gen), torch.randn(n, 16, generator=gen)
    g = 0.5

    def rbf(x, b):
        return (-lt.Vi(x).sqdist(lt.Vj(y)) * g).exp().matmul(b, backend="compiled")

    def grad():
        xg = x.clone().requires_grad_()
        return torch.autograd.grad(rbf(xg, b16), xg, torch.ones(n, 16))

    row = {"rbf_c1": median_time(lambda: rbf(x, b1)), "rbf_c16": median_time(lambda: rbf(x, b16)),
           "logsumexp": median_time(lambda: (-lt.Vi(x).sqdist(lt.Vj(y)) * g).logsumexp(1, backend="compiled")),
           "argkmin8": median_time(lambda: lt.Vi(x).sqdist(lt.Vj(y)).argkmin(8, 1, backend="compiled"))}
    if backward:
        row["rbf_c16_fwd_bwd"] = median_time(grad)
    return row


def main():
    p = arguments(__doc__)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, nargs="+", default=[8, 12, 16, 32, 64])
    p.add_argument("--backward-d", type=int, nargs="*", default=[8, 16])
    p.add_argument("--route", choices=sorted(ROUTES), help="measure one route in this process (the parent runs both)")
    args = parse(p)
    if args.route is None:
        for route in ROUTES:
            subprocess.run([sys.executable, __file__, "--route", route, "--n", str(args.n), "--threads", str(args.threads),
                            "--d", *map(str, args.d), "--backward-d", *map(str, args.backward_d)], check=True)
        return
    lower.EXPANSION_MIN_FEATURES = ROUTES[args.route]
    for d in args.d:
        emit({"route": args.route, "n": args.n, "d": d, "threads": args.threads,
              **measure(args.n, d, d in args.backward_d)})


if __name__ == "__main__":
    main()
