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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch.func import functional_call

from . import cli, method
from .method import (
    BenchmarkError,
    default_tolerance,
    measure_cuda_peak,
    relative_error,
    run_variants,
    timed,
    write_json,
)

console = method.console()
# Flags that only one mode reads: flag -> (mode, default).
MODE_FLAGS = {"candidates": ("attention", 16), "seq": ("attention", [6, 64, 128]), "seeds": ("prefix", [0]),
              "cases": ("profile", None)}


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
    parser.add_argument("--cases", nargs="+", default=MODE_FLAGS["cases"][1],
                        help="with --profile: only the path cases whose names contain one of these")
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
        if getattr(args, flag) != default and modes[0] != owner:
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
    from polytope import ParameterLayout

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
class SelfAttention(nn.Module):
    """One attention block and a linear head: the attention case of the path table."""

    def __init__(self, width: int = 32, heads: int = 4, classes: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        b, length, width = x.shape
        q, k, v = (t.reshape(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, length, width)
        return self.head((x + self.proj(attended)).mean(1))


class DataDependent(nn.Module):
    """Python control flow on tensor values: cannot run under vmap (the sequential case)."""

    def __init__(self, width_in: int = 16, hidden: int = 64, width_out: int = 4):
        super().__init__()
        self.body = mlp(width_in, hidden, width_out, layers=1)

    def forward(self, x):
        out = self.body(x)
        return out * 2 if float(out.sum()) > 0 else out


@dataclass
class PathCase:
    """One row of the path table: a model, its data, and candidates in both entry forms."""

    name: str
    model: nn.Module
    loss: object
    inputs: torch.Tensor
    targets: torch.Tensor
    flat: torch.Tensor  # (C, n) candidates for ``evaluate``
    batch: object = None  # the same candidates as a CandidateBatch for ``evaluate_batch`` (None: flat only)
    options: dict = field(default_factory=dict)


class _Probes:
    """Seeded data and candidate batches for the path table (one generator: the same cases every run)."""

    def __init__(self, dtype, device):
        from polytope import CandidateBatch, CandidateGroup, ParameterLayout

        self.batch_type, self.group, self.layout = CandidateBatch, CandidateGroup, ParameterLayout
        self.gen, self.dtype, self.device = torch.Generator().manual_seed(0), dtype, device

    def data(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device, self.dtype)

    def noise(self, *shape):
        return 0.05 * self.data(*shape)

    def indices(self, start, stop):
        return torch.arange(start, stop, device=self.device)

    def blocks(self, model, name, size, count, number=1):
        """Orthoplex-like probes: ``number`` blocks of ``size`` coordinates of one tensor, ``count`` candidates each."""
        base = self.layout(model).flatten(model)
        slot = self.layout(model).by_name[name]
        step = max(size, (slot.numel - size) // max(number - 1, 1))
        starts = [slot.start + b * step for b in range(number)]
        return self.batch_type(base, [self.group(self.indices(a, a + size), self.noise(count, size)) for a in starts])

    def subspace(self, model, subspace):
        """One group per subspace block, ``2 min(dim, 8)`` candidates each."""
        return self.batch_type(self.layout(model).flatten(model),
                               [self.group(self.indices(b.offset, b.offset + b.dim), self.noise(2 * min(b.dim, 8), b.dim))
                                for b in subspace.blocks], subspace)

    def tail(self, model, count):
        """``count`` candidates moving the last two parameter tensors (the last layer)."""
        layout = self.layout(model)
        tail = self.indices(layout.slots[-2].start, layout.n)
        return self.batch_type(layout.flatten(model), [self.group(tail, self.noise(count, tail.numel()))])


def _models(dtype, device) -> dict[str, nn.Module]:
    """The model kinds the path table covers, besides the 16-256-4 MLP."""
    def to(module):
        return module.to(device, dtype)

    return {"last": to(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                                     nn.ReLU(), nn.Linear(256, 10))),
            "conv": to(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(16 * 8 * 8, 10))),
            "attention": to(SelfAttention()),
            "batchnorm": to(nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))).train(),
            "datadep": to(DataDependent())}


def path_cases(dtype, device, batch: int) -> list[PathCase]:
    """The path table's cases, in the evaluator's selection order, and one row per model kind the tests cover."""
    from polytope import FactoredSubspace, HybridSubspace

    p = _Probes(dtype, device)

    def case(name, model, loss, x, y, batch_=None, flat=None, **options):
        return PathCase(name, model, loss, x, y, batch_.materialize() if flat is None else flat, batch_, options)

    net = mlp(16, 256, 4).to(device, dtype)
    x, y = p.data(batch, 16), p.data(batch, 4)
    layout = p.layout(net)
    base = layout.flatten(net)
    dense = p.noise(64, layout.n)
    everything = p.batch_type(base, [p.group(p.indices(0, layout.n), dense)])
    hybrid = HybridSubspace.from_layout(net, rank=8, max_subspace_dim=512)
    m = _models(dtype, device)
    last_batch = p.tail(m["last"], 256)
    labels = torch.randint(0, 10, (batch,), generator=p.gen).to(device)
    return [
        case("inplace", net, F.mse_loss, x, y, p.blocks(net, "2.weight", 64, 8, number=2), use_inplace=True),
        case("sparse_delta", net, F.mse_loss, x, y, p.blocks(net, "2.weight", 64, 128, number=4)),
        case("subspace_delta", net, F.mse_loss, x, y, p.subspace(net, hybrid)),
        case("factored", net, F.mse_loss, x, y, p.subspace(net, FactoredSubspace(net, rank=4))),
        case("dense_bmm", net, F.mse_loss, x, y, everything, flat=base + dense),
        case("last layer (issue 14)", m["last"], F.cross_entropy, p.data(batch, 64), labels, last_batch),
        case("vmap (reuse=False)", net, F.mse_loss, x, y, p.blocks(net, "2.weight", 64, 128, number=4), reuse=False),
        case("site_vmap (CNN)", m["conv"], F.cross_entropy, p.data(batch, 3, 8, 8), labels,
             p.blocks(m["conv"], "2.weight", 64, 32)),
        case("site_vmap (attention)", m["attention"], F.cross_entropy, p.data(batch, 16, 32), labels % 4,
             p.blocks(m["attention"], "proj.weight", 64, 32)),
        case("sequential (BatchNorm)", m["batchnorm"], F.mse_loss, x, y, p.blocks(m["batchnorm"], "3.weight", 64, 32)),
        case("sequential (not vmappable)", m["datadep"], F.mse_loss, x, y, p.blocks(m["datadep"], "body.2.weight", 64, 32)),
    ]


def paths_benchmark(args, dtype, device, compiled: bool) -> dict:
    """Every case through the naive loop, the flat entry ``evaluate`` and the structured entry ``evaluate_batch``.

    Timed beside them: the flat entry's analysis alone (``evaluator.analyse``) and one plain read of the
    ``(C, n)`` candidates (``sum(1)``), the floor of any exact analysis.
    """
    import warnings

    from polytope import NNCostEvaluator

    rows = {}
    table = Table(title=f"candidate evaluation paths ({'compiled' if compiled else 'eager'}, {args.dtype}, {device}, "
                        f"{torch.get_num_threads()} thread(s); ms per call, median)")
    for column in ("case", "candidates", "naive loop", "flat", "of which analysis", "reading (C, n)", "flat path", "structured",
                   "structured path", "naive / flat", "naive / structured"):
        table.add_column(column)
    cases = [c for c in path_cases(dtype, device, args.batch) if not args.cases or any(part in c.name for part in args.cases)]
    if not cases:
        raise cli.UsageError("--cases", f"no path case matches {args.cases}; the cases are: "
                                        f"{', '.join(case.name for case in path_cases(dtype, device, 1))}")
    for case in cases:
        options = dict(case.options, compile_evaluator=compiled, compile_forward=compiled)
        entries = {"naive loop": lambda c=case: naive_losses(c.model, c.loss, c.flat, c.inputs, c.targets)}
        evaluators = {"flat": NNCostEvaluator(case.model, case.loss, **options)}
        entries["flat"] = lambda c=case, ev=evaluators["flat"]: ev.evaluate(c.flat, c.inputs, c.targets)
        if case.batch is not None:
            evaluators["structured"] = NNCostEvaluator(case.model, case.loss, **options)
            entries["structured"] = lambda c=case, ev=evaluators["structured"]: ev.evaluate_batch(c.batch, c.inputs, c.targets)
        entries["analysis"] = lambda c=case, ev=evaluators["flat"]: ev.analyse(c.flat)
        entries["reading"] = lambda c=case: c.flat.sum(1)  # the floor of any exact analysis: every number read once
        expected = entries["naive loop"]()
        record = {"candidates": case.flat.shape[0], "paths": {}, "errors": {}}
        for entry, ev in evaluators.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the not-vmappable case warns once, by design
                cold, got = timed(entries[entry], device)
            record["paths"][entry] = dict(ev.path_counts)
            record["errors"][entry] = check_parity(f"{case.name} ({entry} entry)", got, expected, dtype)
            record[f"{entry}_cold_s"] = cold
        results = run_variants(entries, repeats=args.repeats, warmup=args.warmup, device=device)
        for entry, result in results.items():
            if entry in evaluators:
                result.extra = {"paths": record["paths"][entry], "operators": executed_operators(entries[entry], device)}
                if device.type == "cuda":
                    result.peak_extra_bytes, _ = measure_cuda_peak(entries[entry], device)
        record["variants"] = results
        rows[case.name] = record
        median = {entry: res.summary["median"] for entry, res in results.items()}
        paths = {entry: "+".join(sorted(counts)) for entry, counts in record["paths"].items()}
        ratios = {entry: f"{median['naive loop'] / median[entry]:.1f}x" for entry in evaluators}
        table.add_row(case.name, str(record["candidates"]), ms(median["naive loop"]), ms(median["flat"]), ms(median["analysis"]),
                      ms(median["reading"]), paths["flat"], ms(median.get("structured")), paths.get("structured", "-"),
                      ratios["flat"], ratios.get("structured", "-"))
    console.print(table)
    return {"cases": rows}


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
    from polytope import HybridSubspace, NNCostEvaluator, PolytopeOptimizer

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
