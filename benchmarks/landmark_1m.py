"""Landmark (Nystrom) ridge at n = 1,000,000, d = 8, m = 4096, float32 tiles: fit + predict time, peak RSS, accuracy.

    python benchmarks/landmark_1m.py [--n 1000000] [--m 4096] [--queries 10000] [--reference-n 16384] [--threads 2]

Prints one JSON line. Float64 data, so the default float32 tiles (sums in float64) run the CG
iterations and float64 products check each restart (float32 data would iterate the normal
equations, whose conditioning is K_nm's squared, in single precision: breakdown at n = 10^5).
The timed scope is ``LandmarkRidge(...).fit(X, y)`` and ``predict`` on
``--queries`` held-out points (default estimator settings, ``source="streamed"``: every
``K_nm`` product is a lazytensor reduction, nothing n x m is stored; at this size the
normal matrix would cost n m^2, so K_mm alone preconditions CG, Falkon-style). Accuracy:
R^2 of the held-out predictions against the noise-free target, next to an exact
``KernelRidge`` fitted on the first ``--reference-n`` points (not timed; 0 skips it).
Peak RSS is the process's (``ru_maxrss``), with its value before the fit.
"""
import resource
import time

import torch
from common import arguments, emit, parse

from solvers import RBF, KernelRidge, LandmarkRidge

LAMBDA = 1e-5  # ridge penalty per training point: alpha = LAMBDA * n for either estimator


def target(X):
    return torch.sin(X[:, 0]) + torch.cos(X[:, 1]) * X[:, 2] + 0.5 * torch.tanh(X[:, 3] * X[:, 4])


def r2(prediction, truth):
    return float(1 - (prediction - truth).square().sum() / (truth - truth.mean()).square().sum())


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = arguments(__doc__)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--queries", type=int, default=10_000)
    p.add_argument("--reference-n", type=int, default=16384)
    args = parse(p)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(args.n, 8, generator=gen, dtype=torch.float64)
    y = target(X) + 0.1 * torch.randn(args.n, generator=gen, dtype=torch.float64)
    Xq = torch.randn(args.queries, 8, generator=gen, dtype=torch.float64)
    kernel = RBF(1 / 8)
    before = peak_rss_mib()
    start, cpu = time.perf_counter(), time.process_time()
    model = LandmarkRidge(kernel, alpha=LAMBDA * args.n, n_landmarks=args.m, source="streamed").fit(X, y)
    fitted = time.perf_counter() - start
    prediction = model.predict(Xq)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    info = model.info_
    record = {
        "n": args.n, "m": args.m, "d": 8, "dtype": "float64 data, float32 tiles", "queries": args.queries,
        "threads": torch.get_num_threads(),
        "seconds": seconds, "fit_seconds": fitted, "cpu_seconds": cpu_seconds,
        "iterations": info.iterations, "pairs_per_second": info.pairs_per_second, "matvecs": info.matvecs,
        "converged": bool(info.converged), "reason": info.reason, "stopping_norm": info.norm,
        "max_residual": float(info.residuals.max()),
        "peak_rss_mib": peak_rss_mib(), "peak_rss_before_fit_mib": before,
        "held_out_r2": r2(prediction, target(Xq)),
    }
    if args.reference_n:
        ref = KernelRidge(kernel, alpha=LAMBDA * args.reference_n).fit(X[:args.reference_n], y[:args.reference_n])
        record["reference_n"] = args.reference_n
        record["reference_held_out_r2"] = r2(ref.predict(Xq), target(Xq))
    emit(record)


if __name__ == "__main__":
    main()
