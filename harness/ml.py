"""Complete kernel-learning fits: ridge, landmark ridge, PCA, LDA and rectangular SVD.

Variants share inputs, start vectors and stopping rules:
``stored`` keeps the kernel matrix and runs the same iterative method with
direct ATen products; ``streamed`` computes every product as a lazytensor
reduction and stores nothing n x n; ``direct`` (``--dense-direct``) is a
different algorithm (Cholesky, augmented QR, eigh, SVD); ``auto`` is the
estimators' default, the route ``source="auto"`` picks (shown next to it); ``sklearn`` is
scikit-learn's dense estimator where one exists (``KernelRidge``,
``Nystroem`` + ``Ridge`` on the same landmarks, ``KernelPCA``), on NumPy
copies of the inputs, with BLAS limited to ``--threads``. The timed scope is
source construction, fit and held-out prediction (SVD: the leading factors;
``--backward`` adds a mean squared prediction objective and the gradients of
X, Y and the queries). Wall and CPU seconds are both recorded. Every variant
must converge and agree with a float64 direct reference before anything is
timed; failures exit nonzero.
"""
from __future__ import annotations

import argparse
import gc
import math
import time
import warnings
from typing import Any, Callable

import torch

from . import cli, method

CASES = ("ridge", "landmark", "pca", "lda", "svd")
REFERENCE_MAX_BYTES = 4 << 30  # largest dense kernel the float64 reference may build
VARIANTS = ("stored", "streamed", "direct", "auto", "sklearn")
SKLEARN_CASES = ("ridge", "landmark", "pca")  # scikit-learn has no kernel LDA or kernel SVD estimator
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def register(subparsers) -> None:
    p = subparsers.add_parser("ml", help="kernel ridge / landmark / PCA / LDA / SVD fits", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:INDEX")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float64")
    p.add_argument("--n", type=cli.int_at_least(2), default=2048, help="training points (rows of the kernel)")
    p.add_argument("--m", type=cli.positive_int, default=None,
                   help="landmarks (landmark, default min(256, n)) or columns (svd, default n / 2)")
    p.add_argument("--d", type=cli.positive_int, default=8, help="feature width")
    p.add_argument("--queries", type=cli.positive_int, default=128, help="held-out points predicted / transformed")
    p.add_argument("--targets", type=cli.positive_int, default=2, help="right-hand sides (ridge, landmark)")
    p.add_argument("--gamma", type=cli.positive_float, default=None, help="RBF gamma (default 1 / d)")
    p.add_argument("--regularization", type=cli.positive_float, default=0.5, help="ridge alpha / LDA regularization")
    p.add_argument("--classes", type=cli.int_at_least(2), default=4, help="LDA classes")
    p.add_argument("--components", type=cli.positive_int, default=2, help="PCA / SVD / LDA components")
    p.add_argument("--search-width", type=cli.nonneg_int, default=10)
    p.add_argument("--rank", type=cli.positive_int, default=None,
                   help="Nystrom preconditioner rank (ridge, LDA; default: the estimators' 'auto', 8 sqrt(n))")
    p.add_argument("--preconditioner", choices=("nystrom", "jacobi", "none"), default="nystrom",
                   help="ridge / LDA preconditioner")
    p.add_argument("--rtol", type=cli.positive_float, default=1e-7)
    p.add_argument("--atol", type=cli.nonneg_float, default=1e-9)
    p.add_argument("--chunk-size", type=cli.positive_int, default=None, help="rows per streamed tile (default: 8 MiB budget)")
    p.add_argument("--tile-dtype", choices=("float32", "float64"), default=None,
                   help="dtype of the iterations' tiles (default: the estimators', float32 for CG fits of float64 data)")
    p.add_argument("--backward", action="store_true", help="ridge/landmark: also differentiate the predictions")
    p.add_argument("--dense-direct", action="store_true", help="also time the direct dense algorithm")
    p.add_argument("--variants", type=cli.comma_list(VARIANTS), default=["stored", "streamed"],
                   help="comma-separated variants to time (stored, streamed, direct, auto, sklearn)")
    p.add_argument("--check-tol", type=cli.positive_float, default=None,
                   help="relative error allowed against the direct reference (default 1e3 * rtol, at least 1e-6)")
    p.add_argument("--repeats", type=cli.positive_int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=cli.nonneg_int, default=1, help="untimed calls, the first call included")
    p.add_argument("--threads", type=cli.positive_int, default=1, help="torch CPU threads")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory measurement")
    p.add_argument("--seed", type=cli.nonneg_int, default=0)
    p.add_argument("--output", type=cli.output_path, default=None, help="JSON file for the record")
    p.set_defaults(func=run)


def _check(cfg: dict[str, Any]) -> None:
    """Flags that only make sense together, named before anything is computed."""
    case, n = cfg["case"], cfg["n"]
    if cfg["backward"] and case not in ("ridge", "landmark"):
        raise cli.UsageError("--backward", f"only ridge and landmark fits are differentiated, not {case}")
    if case == "landmark" and cfg["m"] > n:
        raise cli.UsageError("--m", f"at most --n ({n}) landmarks, got {cfg['m']}")
    if "sklearn" in cfg["variants"] and (case not in SKLEARN_CASES or cfg["backward"]):
        why = "scikit-learn's estimators are not differentiable" if cfg["backward"] else f"scikit-learn has no {case}"
        raise cli.UsageError("--variants", f"sklearn: {why} (sklearn variants: {', '.join(SKLEARN_CASES)}, no --backward)")
    limit = {"pca": n, "lda": cfg["classes"] - 1, "svd": min(n, cfg["m"] or n)}.get(case)
    if limit is not None and cfg["components"] > limit:
        why = {"pca": "--n", "lda": "--classes - 1", "svd": "min(--n, --m)"}[case]
        raise cli.UsageError("--components", f"at most {why} = {limit} for {case}, got {cfg['components']}")
    if case == "lda" and cfg["classes"] > n:
        raise cli.UsageError("--classes", f"at most --n ({n}) classes, got {cfg['classes']}")


# ----------------------------------------------------------------- workloads
def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("case", "device", "dtype", "n", "m", "d", "queries", "targets", "gamma", "regularization", "classes",
            "components", "search_width", "rank", "preconditioner", "rtol", "atol", "chunk_size", "tile_dtype",
            "backward", "seed")
    cfg = {k: getattr(args, k) for k in keys}
    cfg["variants"] = list(dict.fromkeys(args.variants + (["direct"] if args.dense_direct else [])))
    cfg["gamma"] = cfg["gamma"] if cfg["gamma"] is not None else 1.0 / cfg["d"]
    cfg["preconditioner"] = None if cfg["preconditioner"] == "none" else cfg["preconditioner"]
    if cfg["m"] is None:
        cfg["m"] = {"landmark": min(256, cfg["n"]), "svd": cfg["n"] // 2}.get(cfg["case"])
    elif cfg["case"] not in ("landmark", "svd"):
        raise cli.UsageError("--m", f"only landmark (landmarks) and svd (columns) take --m, not {cfg['case']}")
    _check(cfg)
    return cfg


def make_data(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Seeded inputs: smooth targets for regression, Gaussian clusters for LDA."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    dtype = DTYPES[cfg["dtype"]]

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    n, d = cfg["n"], cfg["d"]
    data = {"X": normal(n, d), "Xq": normal(cfg["queries"], d)}
    if cfg["case"] in ("ridge", "landmark"):
        w = normal(d, cfg["targets"])
        data["Y"] = torch.sin(data["X"] @ w / math.sqrt(d)) + 0.1 * normal(n, cfg["targets"])
    elif cfg["case"] == "lda":
        labels = torch.arange(n) % cfg["classes"]
        data["X"] = data["X"] + 2.0 * normal(cfg["classes"], d)[labels]
        data["labels"] = labels
    elif cfg["case"] == "svd":
        data["Y"] = normal(cfg["m"], d)
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(cfg["device"]) for k, v in data.items()}


def make_workload(cfg: dict[str, Any], source: str, data: dict[str, torch.Tensor]) -> Callable[[], dict]:
    """The timed scope of one variant; returns the outputs that validation compares."""
    if source == "sklearn":
        return _sklearn_workload(cfg, data)
    import solvers

    kernel = solvers.RBF(cfg["gamma"])
    tile_dtype = DTYPES.get(cfg["tile_dtype"]) if source == "streamed" else None
    common = dict(source=source, chunk_size=cfg["chunk_size"], tile_dtype=tile_dtype, random_state=cfg["seed"])
    rank = cfg["rank"] or "auto"
    case = cfg["case"]

    if case in ("ridge", "landmark"):
        def run():
            X, Y, Xq = (data[k].clone().requires_grad_(cfg["backward"]) for k in ("X", "Y", "Xq"))
            if case == "ridge":
                est = solvers.KernelRidge(kernel, cfg["regularization"], preconditioner=cfg["preconditioner"],
                                          rank=rank, rtol=cfg["rtol"], atol=cfg["atol"], **common)
            else:
                est = solvers.LandmarkRidge(kernel, cfg["regularization"], n_landmarks=cfg["m"], rtol=cfg["rtol"],
                                            atol=cfg["atol"], **common)
            predictions = est.fit(X, Y).predict(Xq)
            out = {"predictions": predictions.detach(), "info": est.info_, "source": est.source_}
            if cfg["backward"]:
                with warnings.catch_warnings(record=True) as caught:  # the adjoint solve reports by warning
                    warnings.simplefilter("always", solvers.ConvergenceWarning)
                    gx, gy, gq = torch.autograd.grad(predictions.square().mean(), [X, Y, Xq])
                failed = [w for w in caught if issubclass(w.category, solvers.ConvergenceWarning)]
                for w in caught:
                    if w not in failed:
                        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
                out.update(grad_X=gx, grad_Y=gy, grad_Xq=gq, adjoint_failure=str(failed[0].message) if failed else None)
            return out
    elif case == "pca":
        def run():
            est = solvers.KernelPCA(kernel, cfg["components"], search_width=cfg["search_width"], rtol=cfg["rtol"],
                                    **common).fit(data["X"])
            return {"eigenvalues": est.eigenvalues_, "vectors": est.eigenvectors_,
                    "transform": est.transform(data["Xq"]), "info": est.info_, "source": est.source_}
    elif case == "lda":
        def run():
            est = solvers.KernelLDA(kernel, cfg["components"], regularization=cfg["regularization"],
                                    preconditioner=cfg["preconditioner"] and "nystrom", rank=rank,
                                    rtol=cfg["rtol"], atol=cfg["atol"], **common)
            est.fit(data["X"], data["labels"])
            return {"eigenvalues": est.eigenvalues_, "transform": est.transform(data["Xq"]), "info": est.info_,
                    "source": est.source_}
    else:
        def run():
            est = solvers.KernelSVD(kernel, cfg["components"], search_width=cfg["search_width"], rtol=cfg["rtol"],
                                    **common).fit(data["X"], data["Y"])
            return {"singular_values": est.singular_values_, "left": est.left_vectors_,
                    "right": est.right_vectors_, "info": est.info_, "source": est.source_}
    return run


def _sklearn_workload(cfg: dict[str, Any], data: dict[str, torch.Tensor]) -> Callable[[], dict]:
    """scikit-learn's dense estimator on NumPy copies of the inputs (made before timing)."""
    from sklearn.decomposition import KernelPCA
    from sklearn.kernel_approximation import Nystroem
    from sklearn.kernel_ridge import KernelRidge
    from sklearn.linear_model import Ridge
    from threadpoolctl import threadpool_limits

    arrays = {k: v.cpu().numpy() for k, v in data.items()}
    gamma, alpha, case = cfg["gamma"], cfg["regularization"], cfg["case"]
    if case == "landmark":  # the landmarks the solvers draw: Nystroem fitted on exactly those points
        gen = torch.Generator().manual_seed(int(cfg["seed"]))
        arrays["L"] = arrays["X"][torch.randperm(cfg["n"], generator=gen)[:cfg["m"]].sort().values.numpy()]

    def run():
        with threadpool_limits(torch.get_num_threads()):
            if case == "ridge":
                est = KernelRidge(alpha=alpha, kernel="rbf", gamma=gamma).fit(arrays["X"], arrays["Y"])
                return {"predictions": torch.from_numpy(est.predict(arrays["Xq"])), "info": None}
            if case == "landmark":
                features = Nystroem(kernel="rbf", gamma=gamma, n_components=cfg["m"]).fit(arrays["L"])
                est = Ridge(alpha=alpha, fit_intercept=False).fit(features.transform(arrays["X"]), arrays["Y"])
                return {"predictions": torch.from_numpy(est.predict(features.transform(arrays["Xq"]))), "info": None}
            est = KernelPCA(cfg["components"], kernel="rbf", gamma=gamma, random_state=cfg["seed"]).fit(arrays["X"])
            return {"eigenvalues": torch.from_numpy(est.eigenvalues_.copy()), "vectors": torch.from_numpy(est.eigenvectors_),
                    "transform": torch.from_numpy(est.transform(arrays["Xq"])), "info": None}
    return run


def memory_workload(cfg: dict[str, Any], source: str) -> Callable[[], Any]:
    """Entry point for :func:`harness.method.peak_rss_growth_in_subprocess`: inputs are baseline."""
    method.steady_state_kernels()
    return make_workload(cfg, source, make_data(cfg))


# ---------------------------------------------------------------- validation
def _subspace_error(A: torch.Tensor, B: torch.Tensor) -> float:
    """Sine of the largest principal angle between the column spans of A and B."""
    qa, qb = torch.linalg.qr(A.double())[0], torch.linalg.qr(B.double())[0]
    cosines = torch.linalg.svdvals(qa.T @ qb).clamp(max=1.0)
    return float(torch.sqrt(1 - cosines.min() ** 2))


def _aligned(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Flip columns of ``actual`` to the sign of ``expected`` (eigenvectors are defined up to sign)."""
    signs = torch.sign((actual.double() * expected.double()).sum(0))
    return actual * torch.where(signs == 0, 1.0, signs).to(actual.dtype)


def validate(case: str, out: dict, ref: dict) -> dict[str, float]:
    """Relative errors against the reference outputs (subspace sines for vectors)."""
    err = method.relative_error
    if case in ("ridge", "landmark"):
        keys = [k for k in ("predictions", "grad_X", "grad_Y", "grad_Xq") if k in ref]
        return {k: err(out[k], ref[k]) for k in keys}
    if case == "pca":
        return {"eigenvalues": err(out["eigenvalues"], ref["eigenvalues"]),
                "subspace": _subspace_error(out["vectors"], ref["vectors"]),
                "transform": err(_aligned(out["transform"], ref["transform"]), ref["transform"])}
    if case == "lda":
        return {"eigenvalues": err(out["eigenvalues"], ref["eigenvalues"]),
                "transform": err(_aligned(out["transform"], ref["transform"]), ref["transform"])}
    return {"singular_values": err(out["singular_values"], ref["singular_values"]),
            "left_subspace": _subspace_error(out["left"], ref["left"]),
            "right_subspace": _subspace_error(out["right"], ref["right"])}


def _dense_bytes(cfg: dict[str, Any]) -> int:
    cols = cfg["m"] if cfg["case"] == "svd" else cfg["n"]
    return 8 * cfg["n"] * cols


def _info_summary(info) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"iterations": info.iterations, "matvecs": info.matvecs, "converged": info.converged,
            "reason": info.reason, "max_residual": float(info.residuals.max()) if info.residuals.numel() else 0.0}


# -------------------------------------------------------------------- driver
def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=140)
    cfg = _config(args)
    torch.set_num_threads(args.threads)
    method.steady_state_kernels()
    tol = args.check_tol if args.check_tol is not None else max(1e-6, 1e3 * args.rtol)
    record: dict[str, Any] = {"command": "ml", "config": cfg, "variants": {}, "tolerance": tol,
                              "reference": "direct in float64 on the same inputs"}
    try:
        with method.kept_on_interrupt(record, args.output):
            data = make_data(cfg)
            ref_cfg = dict(cfg, dtype="float64", tile_dtype=None)
            if _dense_bytes(cfg) <= REFERENCE_MAX_BYTES:
                ref = make_workload(ref_cfg, "direct", make_data(ref_cfg))()
            else:  # a dense reference would not fit: only the solvers' true-residual convergence is checked
                ref = None
                record["reference"] = "none: the dense reference would not fit in memory; convergence checked"
            workloads, cpu_seconds = _validated(cfg, data, ref, tol, record["variants"])
            results = record["variants"]
            method.run_variants(workloads, repeats=args.repeats, warmup=args.warmup, device=args.device, seed=args.seed,
                                results=results)
            for name, samples in cpu_seconds.items():  # the timed rounds are the last calls of each variant
                results[name].extra["cpu_s"] = method.summarize(samples[-args.repeats:])
            if not args.no_memory:
                for name, peak in zip(results, _memory(cfg, list(results), args)):
                    results[name].peak_extra_bytes = peak
    except method.BenchmarkError as exc:
        record["error"] = str(exc)
        method.write_json(args.output, record)
        console.print(f"[red]ml {cfg['case']}: {exc}[/red]")
        return 1
    method.write_json(args.output, record)
    console.print(_table(cfg, record))
    return 0


def _validated(cfg: dict[str, Any], data: dict, ref: dict | None, tol: float, results: dict) -> tuple[dict, dict]:
    """Each variant's workload run once and checked (converged, forward and adjoint; within ``tol`` of ``ref``)
    before any timing; ``results`` gets a VariantResult per variant. Returns the (CPU-timed) workloads and
    their CPU-second lists."""
    workloads, cpu_seconds = {}, {}
    for name in cfg["variants"]:
        workloads[name] = _cpu_timed(make_workload(cfg, name, data), cpu_seconds.setdefault(name, []))
        out = workloads[name]()
        errors = validate(cfg["case"], out, ref) if ref is not None else {}
        res = results[name] = method.VariantResult(name, validation=errors, extra={
            "info": _info_summary(out["info"]), "adjoint_failure": out.get("adjoint_failure"),
            "algorithm": {"direct": "direct", "sklearn": "scikit-learn"}.get(out.get("source", name), "iterative"),
            "source": out.get("source")})
        bad = {k: v for k, v in errors.items() if not v <= tol}
        if out["info"] is not None and not out["info"].converged:
            res.error = f"solver did not converge ({out['info'].reason})"
        elif out.get("adjoint_failure"):
            res.error = f"the adjoint solve did not converge ({out['adjoint_failure']})"
        elif bad:
            res.error = f"validation failed against the direct reference: {bad} > {tol}"
        if res.error:
            raise method.BenchmarkError(f"{name}: {res.error}")
        del out
    gc.collect()
    return workloads, cpu_seconds


def _table(cfg: dict[str, Any], record: dict):
    from rich.table import Table

    table = Table(title=f"ml {cfg['case']} n={cfg['n']} m={cfg['m']} d={cfg['d']} {cfg['dtype']}"
                        + (" +backward" if cfg["backward"] else ""))
    for col in ("variant", "median s", "IQR s", "median CPU s", "extra MiB", "iterations", "matvecs", "max rel. error"):
        table.add_column(col)
    for name, res in record["variants"].items():
        info = res.extra["info"] or {"iterations": "-", "matvecs": "-"}
        mib = "-" if res.peak_extra_bytes is None else f"{res.peak_extra_bytes / 2**20:.2f}"
        label = f"auto ({res.extra.get('source')})" if name == "auto" else name
        table.add_row(label, f"{res.summary['median']:.4f}", f"{res.summary['iqr']:.4f}",
                      f"{res.extra['cpu_s']['median']:.4f}", mib, str(info["iterations"]), str(info["matvecs"]),
                      f"{max(res.validation.values(), default=0):.2e}")
    return table


def _cpu_timed(workload: Callable[[], dict], samples: list[float]) -> Callable[[], dict]:
    """The workload, appending the CPU seconds of each call (all threads) to ``samples``."""
    def run():
        start = time.process_time()
        out = workload()
        samples.append(time.process_time() - start)
        return out
    return run


def _memory(cfg: dict[str, Any], variants: list[str], args: argparse.Namespace) -> list[int]:
    """Extra peak memory per variant: CUDA allocator peak, or CPU peak RSS growth in a child process."""
    if torch.device(args.device).type == "cuda":
        data, peaks = make_data(cfg), []
        for variant in variants:
            workload = make_workload(cfg, variant, data)
            workload()
            peaks.append(method.measure_cuda_peak(workload, args.device)[0])
        return peaks
    return method.peak_rss_growths_in_subprocess(
        "harness.ml:memory_workload", [{"cfg": cfg, "source": v} for v in variants], threads=args.threads,
        warmup=args.warmup > 0)
