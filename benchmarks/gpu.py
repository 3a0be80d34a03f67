"""The GPU table: what a user meets on a CUDA device, in one prepared run of at most about 8 minutes.

    PYTHONPATH=. python benchmarks/gpu.py [--device cuda] [--scale 1] [--budget 420] [--docs docs/performance.md]
    PYTHONPATH=. python benchmarks/gpu.py --device cpu --scale 0.05       # a dry run on a CPU

Sections, each beside dense torch in the same run (sizes times ``--scale``):

- ``first``: calls 1-3 of the README formula, log-sum-exp, k-min and ``rbf_matmul`` at N = M = 16384
  with the defaults, each in a fresh process, with a warm inductor cache (built by an earlier process)
  and a cold one (an empty directory);
- ``loop``: the README formula called for ``--loop-seconds`` in one process with the defaults (cold
  cache): when it reaches the compiled kernel, and its last calls against the compiled kernel's time;
- ``named``: each named operator against the generic formula it names, at 65536, compiled;
- ``half``: attention in bfloat16 and float16 against SDPA (B=1, H=16, L=16384, d=64), and the
  Gaussian product in bfloat16: time, and error against float32;
- ``clients``: GeomLoss sinkhorn and the GPyTorch MLL through ``lazytensor.keops.install()`` at
  n = 20000 (beside their dense paths) and 100000 (``benchmarks/clients.py``).

Every measurement is one JSON line (``--output``); the summary tables are printed as markdown and, with
``--docs``, replace the generated part of that file's CUDA section (between its two markers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_CASES = ("formula", "logsumexp", "kmin", "rbf_matmul")
MARKERS = ("<!-- benchmarks/gpu.py: begin -->", "<!-- benchmarks/gpu.py: end -->")


# -- workloads (run in children) -----------------------------------------------------------------------
def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, calls: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(calls):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, out


def _points(n: int, device: str, dtype=None, d: int = 3, channels: int = 16, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x, y, b = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen), torch.randn(n, channels, generator=gen)
    return (t.to(device=device, dtype=dtype or torch.float32) for t in (x, y, b))


def case(name: str, n: int, device: str, variant: str):
    """``fn()`` of one case: ``variant`` "lazytensor" (the defaults) or "dense" (what a torch user writes)."""
    import torch

    import lazytensor as lt

    x, y, b = _points(n, device)
    dense = variant == "dense"
    if name in ("formula", "rbf_matmul"):
        if dense:
            return lambda: torch.exp(-0.5 * torch.cdist(x, y).square()) @ b
        if name == "rbf_matmul":
            return lambda: lt.rbf_matmul(x, y, b, 0.5)
        return lambda: (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp() @ b
    if name == "logsumexp":
        if dense:
            return lambda: torch.logsumexp(-0.5 * torch.cdist(x, y).square(), 1, keepdim=True)
        return lambda: (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).logsumexp(1)
    if name == "kmin":
        if dense:
            return lambda: torch.cdist(x, y).square().topk(8, 1, largest=False).values
        return lambda: lt.Vi(x).sqdist(lt.Vj(y)).kmin(8, 1)
    raise ValueError(f"unknown case {name!r}")


def child_first(request: dict) -> dict:
    """Calls 1-3 of one case and variant in this fresh process (``prepare``: build its kernels and wait)."""
    from lazytensor import compile

    fn = case(request["case"], request["n"], request["device"], request["variant"])
    if request.get("prepare"):
        compile.set_compile_after(0)
        fn()
        compile.wait_for_background_compiles()
        fn()
        return {"prepared": True}
    times, _ = _timed(fn, request["device"], 3)
    return {"calls_s": [round(t, 4) for t in times]}


def child_loop(request: dict) -> dict:
    """The README formula in a loop with the defaults, then the compiled kernel's own time."""
    import lazytensor as lt
    from lazytensor import compile, engine

    device, n = request["device"], request["n"]
    fn = case("formula", n, device, "lazytensor")
    times, routes, end = [], [], time.perf_counter() + request["seconds"]
    while time.perf_counter() < end:
        before = dict(engine.routes)
        times.append(_timed(fn, device, 1)[0][0])
        routes.append(next((r for r in engine.routes if engine.routes[r] != before.get(r, 0)), "?"))
    compile.wait_for_background_compiles()
    x, y, b = _points(n, device)  # the same points: only the kernel is timed
    compiled, _ = _timed(lambda: (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp().matmul(b, backend="compiled"), device, 5)
    first_compiled = next((k for k, r in enumerate(routes) if r == "compiled"), None)
    last = statistics.median(times[-5:])
    return {"calls": len(times), "first_compiled_call": first_compiled,
            "seconds_to_compiled": None if first_compiled is None else round(sum(times[:first_compiled]), 2),
            "last_calls_s": round(last, 5), "compiled_s": round(statistics.median(compiled), 5),
            "ratio": round(last / statistics.median(compiled), 2)}


def child_named(request: dict) -> dict:
    """Each named operator against the generic formula it names, compiled, steady state."""
    import lazytensor as lt
    from lazytensor import compile

    compile.set_compile_after(0)
    device, n = request["device"], request["n"]
    x, y, b = _points(n, device)
    pairs = {
        "rbf_matmul": (lambda: lt.rbf_matmul(x, y, b, 0.5), lambda: (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp() @ b),
        "kernel_regression": (lambda: lt.kernel_regression(x, y, b, 0.5),
                              lambda: (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).softmax_weighted_sum(b, 1)),
        "distance_sum": (lambda: lt.distance_sum(x, y), lambda: lt.Vi(x).sqdist(lt.Vj(y)).sqrt().sum(1)),
        "knn_regression": (lambda: lt.knn_regression(x, y, b, 8), lambda: lt.Vi(x).sqdist(lt.Vj(y)).argkmin(8, 1)),
    }
    rows = {}
    for name, (named, generic) in pairs.items():
        for fn in (named, generic):
            fn()
        compile.wait_for_background_compiles()
        named_s = statistics.median(_timed(named, device, 5)[0])
        generic_s = statistics.median(_timed(generic, device, 5)[0])
        rows[name] = {"named_s": round(named_s, 5), "generic_s": round(generic_s, 5), "ratio": round(named_s / generic_s, 2)}
    return rows


def child_half(request: dict) -> dict:
    """Half precision: attention against SDPA, and the Gaussian product, with errors against float32."""
    import torch
    import torch.nn.functional as F

    import lazytensor as lt
    from lazytensor import compile

    compile.set_compile_after(0)
    device, length = request["device"], request["n"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, length, 64, generator=gen).to(device) for _ in range(3))
    wide = lt.attention(q, k, v)
    rows = {}
    for dtype in (torch.bfloat16, torch.float16):
        qh, kh, vh = (t.to(dtype) for t in (q, k, v))
        ours = lambda qh=qh, kh=kh, vh=vh: lt.attention(qh, kh, vh)  # noqa: E731
        sdpa = lambda qh=qh, kh=kh, vh=vh: F.scaled_dot_product_attention(qh, kh, vh)  # noqa: E731
        ours(), sdpa()
        ours_s, out = _timed(ours, device, 3)
        sdpa_s, _ = _timed(sdpa, device, 3)
        err = float((out.float() - wide).abs().max() / wide.abs().max())
        rows[f"attention {str(dtype)[6:]}"] = _against(ours_s, sdpa_s, "SDPA", err)
    x, y, b = _points(request["n"], device)
    product = {d: (lambda d=d: lt.rbf_matmul(x.to(d), y.to(d), b.to(d), 0.5)) for d in (torch.float32, torch.bfloat16)}
    for fn in product.values():
        fn()
    compile.wait_for_background_compiles()
    (f32_s, f32), (bf16_s, bf16) = (_timed(product[d], device, 3) for d in (torch.float32, torch.bfloat16))
    rows["rbf_matmul bfloat16"] = _against(bf16_s, f32_s, "float32", float((bf16.float() - f32).abs().max() / f32.abs().max()))
    return rows


def _against(ours: list, reference: list, name: str, error: float) -> dict:
    ours_s, reference_s = statistics.median(ours), statistics.median(reference)
    return {"ours_s": round(ours_s, 5), "reference": name, "reference_s": round(reference_s, 5),
            "ratio": round(ours_s / reference_s, 2), "rel_err_vs_float32": error}


CHILDREN = {"first": child_first, "loop": child_loop, "named": child_named, "half": child_half}


# -- the driver ----------------------------------------------------------------------------------------
def _child(request: dict, cache: str, timeout: float) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(request)], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


def _clients(args, n: int, backends: str, timeout: float) -> list[dict]:
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "clients.py"), "--n", str(n), "--device", args.device,
               "--workloads", "sinkhorn,gp-mll", "--backends", backends, "--repeats", "2", "--timeout", str(timeout)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=4 * timeout)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def measure(args) -> list[dict]:
    """Every section within ``args.budget`` seconds; a section past it is recorded as skipped."""
    start, records = time.perf_counter(), []
    warm = args.cache or os.path.join(ROOT, ".cache", "inductor")
    size = lambda base: max(64, int(base * args.scale))  # noqa: E731

    def left() -> float:
        return args.budget - (time.perf_counter() - start)

    def record(section: str, **fields) -> None:
        records.append({"section": section, "device": args.device, **fields})
        print(json.dumps(records[-1]), flush=True)

    def child(request: dict, cache: str) -> dict:
        if left() <= 0:
            return {"skipped": "budget"}
        return _child({**request, "device": args.device}, cache, timeout=max(left(), 30))

    n = size(16384)
    for name in FIRST_CASES if "first" in args.sections else ():
        child({"case": name, "n": n, "variant": "lazytensor", "prepare": True}, warm)
        record("first", case=name, n=n, variant="dense", **child({"case": name, "n": n, "variant": "dense"}, warm))
        record("first", case=name, n=n, variant="warm cache", **child({"case": name, "n": n, "variant": "lazytensor"}, warm))
        with tempfile.TemporaryDirectory() as cold:
            record("first", case=name, n=n, variant="cold cache", **child({"case": name, "n": n, "variant": "lazytensor"}, cold))
    if "loop" in args.sections:
        with tempfile.TemporaryDirectory() as cold:
            record("loop", n=n, **child({"kind": "loop", "n": n, "seconds": args.loop_seconds}, cold))
    if "named" in args.sections:
        record("named", n=size(65536), **child({"kind": "named", "n": size(65536)}, warm))
    if "half" in args.sections:
        record("half", n=n, **child({"kind": "half", "n": n}, warm))
    for clients_n, backends in ((size(20000), "lazytensor,dense"), (size(100000), "lazytensor")):
        if "clients" in args.sections:
            rows = _clients(args, clients_n, backends, max(left(), 30)) if left() > 0 else [{"skipped": "budget"}]
            for row in rows:
                record("clients", **row)
    return records


def _cell(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.3g}"


def tables(records: list[dict]) -> str:
    """The records as the markdown tables of docs/performance.md's CUDA section."""
    lines = []
    first = [r for r in records if r["section"] == "first"]
    if first:
        lines += ["| first calls in a fresh process (s) | dense | warm cache | cold cache |", "|---|---|---|---|"]
        for name in dict.fromkeys(r["case"] for r in first):
            by = {r["variant"]: r for r in first if r["case"] == name}
            cells = [" / ".join(_cell(t) for t in by.get(v, {}).get("calls_s", [])) or by.get(v, {}).get("error", "-")[:60]
                     for v in ("dense", "warm cache", "cold cache")]
            lines.append(f"| {name}, N = M = {by['dense']['n']} | " + " | ".join(cells) + " |")
        lines.append("")
    for r in records:
        if r["section"] == "loop" and "ratio" in r:
            lines += [f"Loop of the README formula at {r['n']}^2 with the defaults (cold cache): {r['calls']} calls, first "
                      f"compiled call #{r['first_compiled_call']} after {r['seconds_to_compiled']} s; last calls "
                      f"{_cell(r['last_calls_s'])} s against the compiled kernel's {_cell(r['compiled_s'])} s "
                      f"({r['ratio']}x).", ""]
        if r["section"] in ("named", "half"):
            rows = {k: v for k, v in r.items() if isinstance(v, dict)}
            if rows:
                columns = list(next(iter(rows.values())))
                lines += [f"| {r['section']} (n = {r['n']}) | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
                lines += [f"| {k} | " + " | ".join(_cell(v.get(c)) if isinstance(v.get(c), (int, float)) else str(v.get(c))
                                                  for c in columns) + " |" for k, v in rows.items()]
                lines.append("")
    clients = [r for r in records if r["section"] == "clients" and "first_s" in r]
    if clients:
        lines += ["| client (calls 1 / 2 / 3, s) | n | lazytensor | dense |", "|---|---|---|---|"]
        for workload, n in dict.fromkeys((r["workload"], r["n"]) for r in clients):
            by = {r["backend"]: r for r in clients if (r["workload"], r["n"]) == (workload, n)}
            cells = [" / ".join(_cell(t) for t in [by[b]["first_s"], *by[b]["samples_s"]]) if b in by else "-"
                     for b in ("lazytensor", "dense")]
            lines.append(f"| {workload} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_docs(path: str, text: str) -> None:
    with open(path) as fh:
        doc = fh.read()
    begin, end = doc.index(MARKERS[0]) + len(MARKERS[0]), doc.index(MARKERS[1])
    with open(path, "w") as fh:
        fh.write(doc[:begin] + "\n" + text + "\n" + doc[end:])


def main() -> None:
    from common import arguments

    parser = arguments(__doc__, threads=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="sizes times this (a CPU dry run: 0.05)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run")
    parser.add_argument("--loop-seconds", type=float, default=20.0)
    parser.add_argument("--sections", default="first,loop,named,half,clients")
    parser.add_argument("--cache", help="the warm inductor cache (default: the project's .cache/inductor)")
    parser.add_argument("--output", default=os.path.join(ROOT, "results", "gpu.jsonl"))
    parser.add_argument("--docs", help="a markdown file whose generated GPU section to replace (docs/performance.md)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        request = json.loads(args.child)
        print(json.dumps(CHILDREN[request.get("kind", "first")](request)))
        return
    records = measure(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    text = tables(records)
    print(text)
    if args.docs:
        write_docs(args.docs, f"`PYTHONPATH=. python benchmarks/gpu.py --device {args.device} --scale {args.scale:g}`\n\n{text}")


if __name__ == "__main__":
    main()
