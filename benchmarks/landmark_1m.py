"""Landmark (Nystrom) ridge at n = 1,000,000, d = 8, m = 4096: fit + predict time, peak RSS, accuracy.

    python benchmarks/landmark_1m.py [--n 1000000] [--m 4096] [--queries 10000] [--reference-n 16384] [--threads 2]
    python benchmarks/landmark_1m.py --n 100000 --trace 100


Prints one JSON line. Float64 data: CG iterates on float64 tiles (compiled, they ran the fused
normal product 1.1x faster than float32 tiles summed in float64), preconditioned by the normal
matrix of a row sample formed from float32 tiles (``solvers.ridge.SAMPLE_SCALE``).
The timed scope is ``LandmarkRidge(...).fit(X, y)`` and ``predict`` on
``--queries`` held-out points (default estimator settings, ``source="streamed"``: every
``K_nm`` product is a lazytensor reduction, nothing n x m is stored). Accuracy:
R^2 of the held-out predictions against the noise-free target, next to an exact
``KernelRidge`` fitted on the first ``--reference-n`` points (not timed; 0 skips it).
Peak RSS is the process's (``ru_maxrss``), with its value before the fit.

``--trace K`` times nothing: it runs K iterations of CG preconditioned by Falkon's
``Falkon(K_mm, n, alpha)`` (the sample of the landmarks alone; float32-tile fused normal products)
and records per iteration the relative preconditioned and Euclidean recurrence residuals,
the held-out R^2 and the relative distance of the held-out predictions from the last
iterate's: what the preconditioned stopping rule is judged by (docs/solvers.md).
"""
import resource
import time

import torch
from common import arguments, emit, parse

from solvers import RBF, Falkon, KernelRidge, LandmarkRidge, StreamedKernel

LAMBDA = 1e-5  # ridge penalty per training point: alpha = LAMBDA * n for either estimator


def target(X):
    return torch.sin(X[:, 0]) + torch.cos(X[:, 1]) * X[:, 2] + 0.5 * torch.tanh(X[:, 3] * X[:, 4])


def r2(prediction, truth):
    return float(1 - (prediction - truth).square().sum() / (truth - truth.mean()).square().sum())


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trace(kernel, X, y, Xq, m: int, alpha: float, iterations: int) -> list[dict]:
    """Per-iteration residuals and held-out accuracy of the Falkon-preconditioned normal equations."""
    landmarks = X[torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))[:m].sort().values]
    K_nm = StreamedKernel(kernel, X, landmarks).with_tile_dtype(torch.float32)
    K_mm = StreamedKernel(kernel, landmarks).with_tile_dtype(torch.float32).columns(torch.arange(m))
    M, K_qm = Falkon(K_mm, X.shape[0], alpha), StreamedKernel(kernel, Xq, landmarks).dense()
    b = K_nm.rmatmul(y.unsqueeze(1))
    c, r = torch.zeros_like(b), b.clone()
    z = M(r)
    p, rz = z.clone(), float((r * z).sum())
    b_pre, b_norm, rows, predictions = rz ** 0.5, float(b.norm()), [], []
    for k in range(1, iterations + 1):
        Hp = K_nm.gram(p) + alpha * (K_mm @ p)
        step = rz / float((p * Hp).sum())
        c, r = c + step * p, r - step * Hp
        z = M(r)
        rz, previous = float((r * z).sum()), rz
        p = z + (rz / previous) * p
        predictions.append((K_qm @ c).squeeze(1))
        rows.append({"iteration": k, "preconditioned": rz ** 0.5 / b_pre, "euclidean": float(r.norm()) / b_norm,
                     "held_out_r2": r2(predictions[-1], target(Xq))})
    for row, prediction in zip(rows, predictions):
        row["predictions_vs_last"] = float((prediction - predictions[-1]).norm() / predictions[-1].norm())
    return rows


def main():
    p = arguments(__doc__)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--queries", type=int, default=10_000)
    p.add_argument("--reference-n", type=int, default=16384)
    p.add_argument("--trace", type=int, default=0, help="iterations to trace instead of the timed fit")
    args = parse(p)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(args.n, 8, generator=gen, dtype=torch.float64)
    y = target(X) + 0.1 * torch.randn(args.n, generator=gen, dtype=torch.float64)
    Xq = torch.randn(args.queries, 8, generator=gen, dtype=torch.float64)
    kernel = RBF(1 / 8)
    if args.trace:
        with torch.no_grad():
            emit({"n": args.n, "m": args.m, "trace": trace(kernel, X, y, Xq, args.m, LAMBDA * args.n, args.trace)})
        return
    before = peak_rss_mib()
    start, cpu = time.perf_counter(), time.process_time()
    model = LandmarkRidge(kernel, alpha=LAMBDA * args.n, n_landmarks=args.m, source="streamed").fit(X, y)
    fitted = time.perf_counter() - start
    prediction = model.predict(Xq)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    info = model.info_
    record = {
        "n": args.n, "m": args.m, "d": 8, "queries": args.queries,
        "dtype": "float64 data and tiles (float32 for the preconditioner)",
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
