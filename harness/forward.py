"""Forward-backend benchmark: candidate evaluation paths, MLP optimizer steps, attention kernels.

Modes (``python -m harness forward ...``):

``--profile``    every evaluation path on a representative model: loss parity
                 against naive per-candidate forwards, cold time, median, IQR and
                 the operators the profiler saw executing;
``--compile``    the same with ``compile_evaluator`` / ``compile_forward`` on;
``--prefix``     complete ``PolytopeOptimizer`` steps on MLPs (batch 32, hidden 64
                 and 256 in full space, hidden 256 in a 512-coordinate subspace)
                 with and without activation reuse;
``--attention``  explicit (matmul + softmax) against native scaled-dot-product
                 attention on candidate-batched tensors.

Parity is checked before anything is timed; a mismatch is an error (exit 1).
"""
from __future__ import annotations

import argparse
import copy
import functools

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.func import functional_call

from . import cli
from .method import (
    BenchmarkError,
    default_tolerance,
    measure_cuda_peak,
    relative_error,
    run_variants,
    timed,
    write_json,
)

console = Console()
# Flags that only one mode reads: flag -> (mode, default).
MODE_FLAGS = {"candidates": ("attention", 16), "seq": ("attention", [6, 64, 128]), "seeds": ("prefix", [0])}


def register(subparsers) -> None:
    parser = subparsers.add_parser("forward", help="candidate evaluation paths and forward backends", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_argument_group("mode (exactly one; --compile alone means --profile --compile)")
    mode.add_argument("--profile", action="store_true", help="time every evaluation path and list executed operators")
    mode.add_argument("--compile", action="store_true",
                      help="with --profile: compiled evaluators (cold time includes compilation)")
    mode.add_argument("--prefix", action="store_true", help="complete MLP optimizer steps with and without activation reuse")
    mode.add_argument("--attention", action="store_true", help="explicit vs native scaled-dot-product attention kernels")
    parser.add_argument("--repeats", type=cli.positive_int, default=7, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=cli.positive_int, default=2,
                        help="untimed calls per variant before timing (the first is reported as cold)")
    parser.add_argument("--batch", type=cli.positive_int, default=32, help="inputs per forward (the attention table uses 16)")
    parser.add_argument("--candidates", type=cli.positive_int, default=MODE_FLAGS["candidates"][1],
                        help="candidates for --attention")
    parser.add_argument("--seq", type=cli.positive_int, nargs="+", default=MODE_FLAGS["seq"][1],
                        help="sequence lengths for --attention")
    parser.add_argument("--seeds", type=cli.nonneg_int, nargs="+", default=MODE_FLAGS["seeds"][1],
                        help="seeds for --prefix (median over all)")
    parser.add_argument("--threads", type=cli.positive_int, default=1, help="torch CPU threads")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--device", type=cli.device, default="cpu", help="cpu, cuda or cuda:INDEX")
    parser.add_argument("--output", type=cli.output_path, default=None, help="JSON path (default results/forward-<mode>.json)")
    parser.set_defaults(func=run)


def _mode(args) -> str:
    """The one mode the flags ask for; flags of another mode are a usage error, not silently ignored."""
    modes = [m for m in ("prefix", "attention") if getattr(args, m)]
    modes += ["profile"] if args.profile or args.compile else []
    if len(modes) != 1:
        raise cli.UsageError("--profile/--prefix/--attention",
                             "choose exactly one of --profile (optionally with --compile), --prefix, --attention"
                             + (f"; got {', '.join('--' + m for m in modes)}" if modes else ""))
    mode = "compile" if args.compile else modes[0]
    for flag, (owner, default) in MODE_FLAGS.items():
        if getattr(args, flag) != default and mode != owner:
            raise cli.UsageError(f"--{flag}", f"applies to --{owner} only, not --{mode}")
    return mode


def run(args) -> int:
    mode = _mode(args)
    output = cli.output_or_default(args.output, f"results/forward-{mode}.json")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    try:
        if mode == "prefix":
            record = prefix_benchmark(args, dtype, device)
        elif mode == "attention":
            record = attention_benchmark(args, dtype, device)
        else:
            record = paths_benchmark(args, dtype, device, compiled=args.compile)
    except BenchmarkError as exc:
        console.print(f"[red]benchmark failed:[/red] {exc}")
        return 1
    record.update(mode=mode, config=vars(args) | {"func": None})
    write_json(output, record)
    return 0


# ----------------------------------------------------------------------------- helpers
def mlp(width_in: int, hidden: int, width_out: int, layers: int = 2) -> nn.Sequential:
    modules, width = [], width_in
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    return nn.Sequential(*modules, nn.Linear(width, width_out))


def naive_losses(model, loss_fn, candidates, inputs, targets) -> torch.Tensor:
    """The reference: one functional forward per candidate."""
    from polytope.param_layout import ParameterLayout

    layout = ParameterLayout(model)
    with torch.no_grad():
        return torch.stack([loss_fn(functional_call(model, layout.views(c), (inputs,)), targets) for c in candidates])


def check_parity(name: str, got: torch.Tensor, expected: torch.Tensor, dtype) -> float:
    error = relative_error(got, expected)
    if not error <= default_tolerance(dtype):
        raise BenchmarkError(f"{name}: losses differ from naive forwards (relative error {error:.3g})")
    return error


def executed_operators(fn, device, top: int = 10) -> list[dict]:
    """The profiler's view of one call: operators by self time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"name": e.key, "calls": e.count, "self_cpu_us": round(e.self_cpu_time_total, 1),
         "self_device_us": round(getattr(e, "self_device_time_total", 0.0), 1)}
        for e in events[:top]
    ]


def ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


# ----------------------------------------------------------------------------- paths
def path_cases(dtype, device, batch: int) -> list[tuple]:
    """(name, evaluator options, model, loss, inputs, targets, make candidates) per path."""
    from polytope.candidates import CandidateBatch, CandidateGroup
    from polytope.param_layout import ParameterLayout
    from polytope.subspaces import FactoredSubspace, HybridSubspace

    gen = torch.Generator().manual_seed(0)
    net = mlp(16, 256, 4).to(device, dtype)
    x = torch.randn(batch, 16, generator=gen).to(device, dtype)
    y = torch.randn(batch, 4, generator=gen).to(device, dtype)
    layout = ParameterLayout(net)
    base = layout.flatten(net)

    def noise(*shape):
        return (0.05 * torch.randn(*shape, generator=gen)).to(device, dtype)

    def particles(size=64, count=128, blocks=4):
        """Orthoplex-like dense probes inside a few 64-coordinate particles of the middle layer."""
        start = layout.by_name["2.weight"].start
        return CandidateBatch(base, [CandidateGroup(torch.arange(start + b * 1000, start + b * 1000 + size, device=device),
                                                    noise(count, size))
                                     for b in range(blocks)])

    def subspace_batch(subspace):
        return CandidateBatch(base, [CandidateGroup(torch.arange(b.offset, b.offset + b.dim, device=device),
                                                    noise(2 * min(b.dim, 8), b.dim))
                                     for b in subspace.blocks], subspace)

    hybrid = HybridSubspace.from_layout(net, rank=8, max_subspace_dim=512)
    factored = FactoredSubspace(net, rank=4)

    conv = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 8 * 8, 10)).to(device, dtype)
    cx = torch.randn(batch, 3, 8, 8, generator=gen).to(device, dtype)
    cy = torch.randint(0, 10, (batch,), generator=gen).to(device)
    clayout = ParameterLayout(conv)
    cbase = clayout.flatten(conv)
    c2 = clayout.by_name["2.weight"]

    def conv_batch():
        return CandidateBatch(cbase, [CandidateGroup(torch.arange(c2.start, c2.start + 64, device=device), noise(32, 64))])

    return [
        ("sparse_delta", {}, net, F.mse_loss, x, y, particles),
        ("subspace_delta", {}, net, F.mse_loss, x, y, lambda: subspace_batch(hybrid)),
        ("factored", {}, net, F.mse_loss, x, y, lambda: subspace_batch(factored)),
        ("dense_bmm", {}, net, F.mse_loss, x, y, lambda: base + noise(64, layout.n)),
        ("vmap", {"reuse": False}, net, F.mse_loss, x, y, particles),
        ("inplace", {"use_inplace": True}, net, F.mse_loss, x, y, lambda: particles(count=16, blocks=2)),
        ("site_vmap", {}, conv, F.cross_entropy, cx, cy, conv_batch),
    ]


def paths_benchmark(args, dtype, device, compiled: bool) -> dict:
    from polytope.candidates import CandidateBatch
    from polytope.evaluators import NNCostEvaluator

    rows = {}
    table = Table(title=f"candidate evaluation paths ({'compiled' if compiled else 'eager'}, {args.dtype}, {device}, "
                        f"{torch.get_num_threads()} thread(s))")
    for column in ("path", "candidates", "parity", "cold ms", "median ms", "IQR ms", "us/candidate", "top operator"):
        table.add_column(column)
    for name, options, model, loss, x, y, make in path_cases(dtype, device, args.batch):
        candidates = make()
        options = dict(options, compile_evaluator=compiled, compile_forward=compiled)
        evaluator = NNCostEvaluator(model, loss, **options)
        evaluate = evaluator.evaluate_batch if isinstance(candidates, CandidateBatch) else evaluator.evaluate
        call = functools.partial(evaluate, candidates, x, y)
        cold, got = timed(call, device)
        if evaluator.last_path != name:
            raise BenchmarkError(f"expected the {name} path, the evaluator ran {evaluator.last_path}")
        flat = candidates.materialize() if isinstance(candidates, CandidateBatch) else candidates
        error = check_parity(name, got, naive_losses(model, loss, flat, x, y), dtype)
        result = run_variants({name: call}, repeats=args.repeats, warmup=args.warmup, device=device)[name]
        result.first_call_s = cold
        result.validation = {"relative_error": error}
        operators = executed_operators(call, device)
        result.extra = {"candidates": flat.shape[0], "operators": operators,
                        "compiled_region_ran": any("compiled" in op["name"].lower() for op in operators)}
        if device.type == "cuda":
            result.peak_extra_bytes, _ = measure_cuda_peak(call, device)
        rows[name] = result
        median = result.summary["median"]
        table.add_row(name, str(flat.shape[0]), f"{error:.1e}", ms(cold), ms(median), ms(result.summary["iqr"]),
                      f"{1e6 * median / flat.shape[0]:.1f}", operators[0]["name"] if operators else "-")
    console.print(table)
    return {"variants": rows}


# ----------------------------------------------------------------------------- prefix
class Recorder:
    """Passes batches to an evaluator and keeps them (for the parity check)."""

    def __init__(self, evaluator):
        self.evaluator = evaluator
        self.batches: list = []
        self.losses: list = []

    def evaluate_batch(self, batch, inputs, targets):
        losses = self.evaluator.evaluate_batch(batch, inputs, targets)
        self.batches.append(batch)
        self.losses.append(losses)
        return losses


PREFIX_ROWS = (
    ("hidden 64, full space", 64, None),
    ("hidden 256, full space", 256, None),
    ("hidden 256, 512 coordinates", 256, 512),
)
SEED_CPU_MS = {"hidden 64, full space": 39.23, "hidden 256, full space": 659.79, "hidden 256, 512 coordinates": 28.23}


def prefix_benchmark(args, dtype, device) -> dict:
    """Complete optimizer steps: orthoplex, per-tensor blocks with an 8-dim frame each, one radius."""
    try:
        from polytope.optimizer import PolytopeOptimizer
    except ImportError as exc:
        raise BenchmarkError(f"--prefix needs polytope.optimizer ({exc})") from exc
    from polytope.evaluators import NNCostEvaluator
    from polytope.subspaces import HybridSubspace

    records, table = {}, Table(title=f"MLP optimizer steps, batch {args.batch}, {args.dtype}, "
                                     f"{torch.get_num_threads()} thread(s) (ms per step)")
    for column in ("model", "candidates/step", "without reuse", "with reuse", "speed-up", "seed CPU figure"):
        table.add_column(column)
    for label, hidden, coordinates in PREFIX_ROWS:
        medians = {"without reuse": [], "with reuse": []}
        per_seed = []
        for seed in args.seeds:
            gen = torch.Generator().manual_seed(seed)
            torch.manual_seed(seed)
            template = mlp(16, hidden, 4).to(device, dtype)
            x = torch.randn(args.batch, 16, generator=gen).to(device, dtype)
            y = torch.randn(args.batch, 4, generator=gen).to(device, dtype)
            subspace = (HybridSubspace.from_layout(template, rank=8, max_subspace_dim=coordinates, seed=seed)
                        if coordinates else None)
            steppers, counts = {}, {}
            for variant, reuse in (("without reuse", False), ("with reuse", True)):
                model = copy.deepcopy(template)
                optimizer = PolytopeOptimizer(model.parameters(), polytope="orthoplex", radii=(0.02,), blocks="tensor",
                                              block_dim=8, subspace=subspace, seed=seed)
                recorder = Recorder(NNCostEvaluator(model, F.mse_loss, reuse=reuse))
                optimizer.register_evaluator(recorder, x, y)
                optimizer.step()  # parity: every batch of this step against naive forwards
                for batch, losses in zip(recorder.batches, recorder.losses):
                    expected = naive_losses(template, F.mse_loss, batch.materialize(), x, y)
                    check_parity(f"{label} {variant}", losses, expected, dtype)
                counts[variant] = sum(b.count for b in recorder.batches)
                recorder.batches, recorder.losses = [], []
                steppers[variant] = optimizer.step
            results = run_variants(steppers, repeats=args.repeats, warmup=args.warmup, device=device, seed=seed)
            per_seed.append({"seed": seed, "variants": results, "candidates_per_step": counts})
            for variant, res in results.items():
                medians[variant].extend(res.samples_s)
        summary = {v: sorted(s)[len(s) // 2] for v, s in medians.items()}
        records[label] = {"per_seed": per_seed, "median_s": summary}
        speedup = summary["without reuse"] / summary["with reuse"]
        table.add_row(label, str(per_seed[0]["candidates_per_step"]["with reuse"]), ms(summary["without reuse"]),
                      ms(summary["with reuse"]),
                      f"{speedup:.2f}x", f"{SEED_CPU_MS[label]:.2f}")
    console.print(table)
    return {"rows": records, "seed_cpu_ms": SEED_CPU_MS}


# ----------------------------------------------------------------------------- attention
def explicit_attention(q, k, v):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v


def attention_benchmark(args, dtype, device) -> dict:
    """Candidate-batched attention (C x B, heads 4, head dim 16): explicit matmuls vs native SDPA."""
    rows, table = {}, Table(title=f"attention kernels: {args.candidates} candidates, batch {args.batch}, {args.dtype}, "
                                  f"{device} (ms)")
    for column in ("sequence", "explicit", "native SDPA", "ratio", "parity"):
        table.add_column(column)
    gen = torch.Generator().manual_seed(0)
    for length in args.seq:
        shape = (args.candidates * args.batch, 4, length, 16)
        q, k, v = (torch.randn(*shape, generator=gen).to(device, dtype) for _ in range(3))
        variants = {"explicit": functools.partial(explicit_attention, q, k, v),
                    "native": functools.partial(F.scaled_dot_product_attention, q, k, v)}
        error = check_parity(f"attention L={length}", variants["native"](), variants["explicit"](), dtype)
        results = run_variants(variants, repeats=args.repeats, warmup=args.warmup, device=device)
        for name, res in results.items():
            res.validation = {"relative_error_vs_explicit": error}
            if device.type == "cuda":
                res.peak_extra_bytes, _ = measure_cuda_peak(variants[name], device)
        rows[str(length)] = results
        a, b = results["explicit"].summary["median"], results["native"].summary["median"]
        table.add_row(str(length), ms(a), ms(b), f"{a / b:.2f}x", f"{error:.1e}")
    console.print(table)
    return {"rows": rows}
