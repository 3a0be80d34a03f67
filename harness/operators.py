"""Operator benchmark: ``python -m harness operators --case CASE ...``.

Cases (N x M pair workloads, one per reduction kind): ``distance-sum`` and
``rbf-matmul`` (sums), ``logsumexp``, ``kernel-regression`` (softmax-weighted
sum), ``min`` (min/argmin), ``kmin`` (the 8 nearest: k-min/argk-min),
``distance-quantile`` and ``attention`` (queries (batch, heads, n, d),
keys/values (batch, heads, m, d); ``--channels`` is the number of heads
there, the value width elsewhere). Variants:

``eager``        the direct broadcast PyTorch formula (may allocate N x M x D);
``compiled``     the same function under ``torch.compile(fullgraph=True)``;
``dense``        native named functions (cdist/mm, torch.quantile, SDPA);
``streamed``     the lazytensor named operator where one exists, else the formula;
``generic``      the formula as a user writes it with ``lt.Vi`` / ``lt.Vj``;
``event-stream`` the same reduction through ``lazytensor.stream`` (one pass,
                 consumers subscribed); absent where it is not equivalent;
``keops``        the same formula with ``pykeops`` (the optional ``compare``
                 extra; absent where pykeops is not installed or has no
                 equivalent).

Every variant's values (and, with ``--backward``, first gradients) are checked
against ``dense`` before anything is timed; then the first call is timed
apart, warm-up calls run, and shuffled rounds are timed. CPU peak memory is
the RSS growth of one call in a child process per variant; on CUDA the extra
peak allocated bytes above the live baseline. Any failure is recorded as an
error and the command exits nonzero.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
from typing import Callable

import torch

import lazytensor as lt

from . import cli, firstcall, method, report

console = method.console()
CASES = ("distance-sum", "rbf-matmul", "logsumexp", "kernel-regression", "min", "kmin", "distance-quantile", "attention")
VARIANTS = ("eager", "compiled", "dense", "streamed", "generic", "event-stream", "keops")
GAMMA = 0.5
QUANTILES = (0.25, 0.5, 0.9)
KNN_K = 8


def register(subparsers) -> None:
    p = subparsers.add_parser("operators", help="named operators: eager, compiled, dense, streamed, event-stream",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, default="rbf-matmul")
    p.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:INDEX")
    p.add_argument("--n", type=cli.positive_int, default=4096, help="rows (queries)")
    p.add_argument("--m", type=cli.positive_int, default=None, help="columns (keys); default --n")
    p.add_argument("--d", type=cli.positive_int, default=3, help="features (head dim for attention)")
    p.add_argument("--channels", type=cli.positive_int, default=16, help="value width; heads for attention")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="attention batch")
    p.add_argument("--chunk-size", type=cli.positive_int, default=None,
                   help="tile size for streamed variants (default: auto)")
    p.add_argument("--backward", action="store_true", help="also time and check first gradients")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeats", type=cli.positive_int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=cli.nonneg_int, default=2,
                   help="untimed calls, the first call included (lazytensor's auto backend compiles on the second)")
    p.add_argument("--variants", type=cli.comma_list(VARIANTS, required=("dense",)), default=list(VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS) + " (dense, the reference, included)")
    p.add_argument("--threads", type=cli.positive_int, default=1, help="torch CPU threads")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory measurement")
    p.add_argument("--seed", type=cli.nonneg_int, default=0)
    p.add_argument("--first-call", action="store_true",
                   help="what a user meets: calls 1..--calls of each variant in a fresh process with the defaults "
                        "(no forced compilation), per --cache, instead of the compiled steady state")
    p.add_argument("--calls", type=cli.positive_int, default=3, help="calls timed per fresh process (--first-call)")
    p.add_argument("--cache", type=cli.comma_list(firstcall.CACHES), default=["warm"],
                   help="inductor disk cache for --first-call: warm (filled by a previous process), cold (empty), "
                        "or warm,cold")
    p.add_argument("--busy", action="store_true",
                   help="--first-call with one competing CPU-bound process running (a shared machine)")
    p.add_argument("--output", type=cli.output_path, default=None,
                   help="JSON path (default results/operators-<case>.json, -first-call.json with --first-call)")
    p.set_defaults(func=run)


# -- workloads: each case gives inputs and one forward function per variant ----------
def _inputs(case, n, m, d, channels, batch, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device)

    if case == "attention":
        return {"q": rand(batch, channels, n, d), "k": rand(batch, channels, m, d), "v": rand(batch, channels, m, d)}
    inputs = {"x": rand(n, d), "y": rand(m, d)}
    if case in ("rbf-matmul", "kernel-regression"):
        inputs["b"] = rand(m, channels)
    return inputs


def _broadcast(case, chunk):
    """The direct broadcast formula of each case (the eager / compiled variants)."""
    def sqd(x, y):
        return ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)

    if case == "distance-sum":
        return lambda x, y: sqd(x, y).sqrt().sum(1)
    if case == "rbf-matmul":
        return lambda x, y, b: (torch.exp(-GAMMA * sqd(x, y))[:, :, None] * b[None]).sum(1)
    if case == "logsumexp":
        return lambda x, y: torch.logsumexp(-GAMMA * sqd(x, y), 1)
    if case == "kernel-regression":
        return lambda x, y, b: (torch.softmax(-GAMMA * sqd(x, y), 1)[:, :, None] * b[None]).sum(1)
    if case == "min":
        return lambda x, y: sqd(x, y).min(1).values
    if case == "kmin":
        return lambda x, y: torch.topk(sqd(x, y), KNN_K, dim=1, largest=False).values
    if case == "distance-quantile":
        return lambda x, y: torch.quantile(sqd(x, y).sqrt(), torch.tensor(QUANTILES, dtype=x.dtype, device=x.device), dim=1).T
    return lambda q, k, v: torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), -1) @ v


def _dense(case):
    """Native named functions: the reference every variant is checked against."""
    if case == "logsumexp":
        return lambda x, y: torch.logsumexp(-GAMMA * torch.cdist(x, y).square(), 1)
    if case == "min":
        return lambda x, y: torch.cdist(x, y).square().min(1).values
    if case == "kmin":
        return lambda x, y: torch.topk(torch.cdist(x, y).square(), KNN_K, dim=1, largest=False).values
    return _named(case, "dense", None)


def _named(case, impl, chunk):
    kw = {"impl": impl} if impl == "dense" else {"impl": impl, "chunk_size": chunk}
    if case == "distance-sum":
        return lambda x, y: lt.distance_sum(x, y, **kw)
    if case == "rbf-matmul":
        return lambda x, y, b: lt.rbf_matmul(x, y, b, GAMMA, **kw)
    if case == "kernel-regression":
        return lambda x, y, b: lt.kernel_regression(x, y, b, GAMMA, **kw)
    if case == "distance-quantile":
        return lambda x, y: lt.distance_quantile(x, y, torch.tensor(QUANTILES, dtype=x.dtype), **kw)
    if case == "attention":
        return lambda q, k, v: lt.attention(q, k, v, **kw)
    return _generic(case, chunk)  # no named operator: the formula is the streamed variant


def _generic(case, chunk):
    """The case as a user writes it: a formula of lt.Vi / lt.Vj, then a reduction method."""
    kw = {"chunk_size": chunk}

    def sq(x, y):
        return lt.Vi(x).sqdist(lt.Vj(y))

    if case == "distance-sum":
        return lambda x, y: sq(x, y).sqrt().sum(1, **kw).squeeze(-1)
    if case == "rbf-matmul":
        return lambda x, y, b: (-GAMMA * sq(x, y)).exp().matmul(b, **kw)
    if case == "logsumexp":
        return lambda x, y: (-GAMMA * sq(x, y)).logsumexp(1, **kw).squeeze(-1)
    if case == "kernel-regression":
        return lambda x, y, b: (-GAMMA * sq(x, y)).softmax_weighted_sum(b, 1, **kw)
    if case == "min":
        return lambda x, y: sq(x, y).min_argmin(1, **kw)[0].squeeze(-1)
    if case == "kmin":
        return lambda x, y: sq(x, y).kmin_argkmin(KNN_K, 1, **kw)[0]
    if case == "distance-quantile":
        return lambda x, y: sq(x, y).sqrt().quantile(torch.tensor(QUANTILES, dtype=x.dtype), 1, **kw)
    return None


def _events(case, chunk):
    """The case through ``lazytensor.stream``; None where no reduction expresses it."""
    kw = {"chunk_size": chunk}

    def sq(x, y):
        return lt.Vi(x).sqdist(lt.Vj(y))

    if case == "distance-sum":
        return lambda x, y: lt.stream(sq(x, y).sqrt(), ["sum"], **kw)[0].squeeze(-1)
    if case == "rbf-matmul":
        return lambda x, y, b: lt.stream((-GAMMA * sq(x, y)).exp() * lt.Vj(b), ["sum"], **kw)[0]
    if case == "logsumexp":
        return lambda x, y: lt.stream(-GAMMA * sq(x, y), ["logsumexp"], **kw)[0].squeeze(-1)
    if case == "kernel-regression":
        return lambda x, y, b: lt.stream(-GAMMA * sq(x, y), [("softmax_weighted_sum", b)], **kw)[0]
    if case == "min":
        return lambda x, y: lt.stream(sq(x, y), ["min_argmin"], **kw)[0][0].squeeze(-1)
    if case == "kmin":
        return lambda x, y: lt.stream(sq(x, y), [("kmin_argkmin", KNN_K)], **kw)[0][0]
    return None


def _keops(case):
    """The case with pykeops's LazyTensor; None where pykeops is missing or has no equivalent."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its CUDA-not-found notice on import, on CPU machines
            import pykeops
            from pykeops.torch import LazyTensor
    except ImportError:
        return None
    pykeops.set_verbose(False)  # its one line per compiled kernel would break up the tables

    def sq(x, y):
        return ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)

    return {
        "distance-sum": lambda x, y: sq(x, y).sqrt().sum(1).squeeze(-1),
        "rbf-matmul": lambda x, y, b: (-GAMMA * sq(x, y)).exp() @ b,
        "logsumexp": lambda x, y: (-GAMMA * sq(x, y)).logsumexp(1).squeeze(-1),
        "kernel-regression": lambda x, y, b: (-GAMMA * sq(x, y)).sumsoftmaxweight(LazyTensor(b[None, :, :]), axis=1),
        "min": lambda x, y: sq(x, y).min_argmin(1)[0].squeeze(-1),
        "kmin": lambda x, y: sq(x, y).Kmin_argKmin(KNN_K, 1)[0],
    }.get(case)


def _variant_function(case, name, chunk):
    if name == "eager":
        return _broadcast(case, chunk)
    if name == "compiled":
        return torch.compile(_broadcast(case, chunk), fullgraph=True, dynamic=False)
    if name == "event-stream":
        return _events(case, chunk)
    if name == "keops":
        return _keops(case)
    if name == "generic":
        return _generic(case, chunk)
    if name == "dense":
        return _dense(case)
    return _named(case, name, chunk)


def _differentiable(case):
    return ("q", "k", "v") if case == "attention" else ("x", "y", "b")


def workload(case, name, n, m, d, channels, batch, dtype, device, seed, chunk, backward) -> Callable | None:
    """A zero-argument call of one variant (inputs built here), returning (out, grads)."""
    fn = _variant_function(case, name, chunk)
    if fn is None:
        return None
    inputs = _inputs(case, n, m, d, channels, batch, getattr(torch, dtype), device, seed)
    if backward:
        for key in _differentiable(case):
            if key in inputs:
                inputs[key].requires_grad_()
    weight = None

    def call():
        nonlocal weight
        out = fn(**inputs)
        if not backward:
            return out.detach(), ()
        if weight is None:
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype).to(out.device)
        wrt = [t for t in inputs.values() if t.requires_grad]
        return out.detach(), torch.autograd.grad((out * weight).sum(), wrt)

    return call


def memory_workload(**kwargs):
    """Entry for the per-variant memory child (see harness.method.peak_rss_growths_in_subprocess).

    Like the timed rounds, it measures the compiled steady state.
    """
    method.steady_state_kernels()
    return workload(**kwargs)


def _encode(obj):
    return dataclasses.asdict(obj) if isinstance(obj, method.VariantResult) else str(obj)


# -- the command ------------------------------------------------------------------
def validate(results, reference, tolerance):
    errors = {"value": method.relative_error(results[0], reference[0])}
    for k, (a, b) in enumerate(zip(results[1], reference[1])):
        errors[f"grad{k}"] = method.relative_error(a, b)
    worst = max(errors.values())
    if not worst <= tolerance:
        raise method.BenchmarkError(f"relative error {worst:.2e} above {tolerance:.0e}: {errors}")
    return errors


def run(args) -> int:
    if args.batch != 1 and args.case != "attention":
        raise cli.UsageError("--batch", f"only the attention case has a batch; got --batch {args.batch} with --case {args.case}")
    if args.busy and not args.first_call:
        raise cli.UsageError("--busy", "measures first calls: use it with --first-call")
    suffix = "-first-call" if args.first_call else ""
    output = cli.output_or_default(args.output, f"results/operators-{args.case}{suffix}.json")
    config = dict(case=args.case, n=args.n, m=args.m or args.n, d=args.d, channels=args.channels, batch=args.batch,
                  dtype=args.dtype, device=args.device, seed=args.seed, chunk=args.chunk_size, backward=args.backward)
    if args.first_call:
        return firstcall.run(args, config, output, console)
    torch.set_num_threads(args.threads)
    method.steady_state_kernels()
    tolerance = method.default_tolerance(getattr(torch, args.dtype))
    results: dict[str, method.VariantResult] = {}
    record = {"command": "operators", "config": config, "tolerance": tolerance, "variants": results,
              "repeats": args.repeats, "warmup": args.warmup}
    calls = {}
    with method.kept_on_interrupt(record, output):
        reference = workload(name="dense", **config)()
        for name in args.variants:
            try:
                call = workload(name=name, **config)
                if call is None:
                    results[name] = method.VariantResult(name, error=f"not applicable: no {name} variant of this case"
                                                         + (" (pykeops not installed?)" if name == "keops" else ""))
                    continue
                results[name] = method.VariantResult(name, validation=validate(call(), reference, tolerance))
                calls[name] = call
            except Exception as exc:  # noqa: BLE001 - any failure is recorded, never timed
                results[name] = method.VariantResult(name, error=f"{type(exc).__name__}: {exc}")
        del reference
        method.run_variants(calls, repeats=args.repeats, warmup=args.warmup, device=args.device, seed=args.seed,
                            results=results)
        if not args.no_memory:
            for name in calls:
                try:
                    if torch.device(args.device).type == "cuda":
                        results[name].peak_extra_bytes, _ = method.measure_cuda_peak(calls[name], args.device)
                    else:
                        (results[name].peak_extra_bytes,) = method.peak_rss_growths_in_subprocess(
                            "harness.operators:memory_workload", [dict(name=name, **config)], threads=args.threads)
                except Exception as exc:  # noqa: BLE001
                    results[name].error = f"memory measurement failed: {type(exc).__name__}: {exc}"
    method.write_json(output, record)
    table, _ = report.table_for(json.loads(json.dumps(record, default=_encode)), f"operators {args.case} ({output})", "dense")
    console.print(table)
    failed = [r for r in results.values() if r.error and not r.error.startswith("not applicable")]
    return 1 if failed else 0
