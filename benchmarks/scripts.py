"""Whole user scripts, each in a fresh process with the defaults, beside the same script written in dense torch.

The table of docs/performance.md's "What a user meets: whole scripts":

    flock /tmp/tp-bench.lock .venv/bin/python benchmarks/scripts.py [--scripts kmeans,knn,solve,kde,sinkhorn,gp]
        [--threads 2] [--repeat 1] [--cache warm[,cold]] [--scale 1] [--timeout 600,solve=900]
        [--docs docs/performance.md] [--show NAME]

A new user does not call one reduction in a warm loop: they write a script, run it, and wait for it.
Each script here is such a script, written twice, as a lazytensor user and as a dense-torch user
would write it (``--show NAME`` prints both):

- ``kmeans``: KeOps's k-means tutorial, 10 Lloyd iterations of 50000 points in 2-D against 50
  centroids (``argmin`` over the centroids, then ``bincount`` / ``index_add_``); dense: ``cdist(...).argmin(1)``;
- ``knn``: k-NN classification of scikit-learn's digits (``load_digits``, shipped with sklearn): the
  last 297 samples against the first 1500, D = 64, the 5 nearest and a majority vote; dense:
  ``cdist(...).topk(5, largest=False)``;
- ``solve``: KeOps's KernelSolve tutorial, ``K.solve(Vi(b), alpha=0.01)`` for a Gaussian kernel
  (sigma 0.1) on 5000 uniform points in [0, 1]^2, float64; dense: ``torch.linalg.solve(K + 0.01 I, b)``;
- ``kde``: a Gaussian kernel density, 20000 x 20000 points in 3-D (h = 0.1); dense: one ``cdist``, ``exp``, ``sum``;
- ``sinkhorn``: log-domain Sinkhorn, 50 iterations, 5000 x 5000 points in 3-D (eps = 0.01), two
  log-sum-exps an iteration with the dual potentials as j-variables; dense: ``torch.logsumexp`` on the cost matrix;
- ``gp``: a GPyTorch exact GP (ScaleKernel(RBF), Gaussian likelihood) fitted by 20 Adam steps of the
  marginal likelihood on 2000 points in 3-D, its KeOps RBF kernel on lazytensor through
  ``lazytensor.keops.install()`` (GPyTorch's CG and Lanczos call the kernel's products); dense:
  GPyTorch's own ``RBFKernel`` (the 2000 x 2000 matrix).

Each (script, variant) runs ``--repeat`` times, each time in a fresh interpreter (a file in a temporary
folder), and reports the median. The time runs from after ``import torch`` to the script's last line,
so ``import lazytensor`` (and sklearn's import, in both variants of ``knn``) counts; ``imports_s`` is
the script's import lines alone, ``process_s`` the whole process (interpreter start and exit too).
``--cache warm`` (the default) uses the project's ``.cache/inductor`` after one untimed preparation
run of the lazytensor script in its own process, which builds every kernel the script's formulas
reach and waits for the builds (a machine that ran the script before); ``--cache cold`` gives each
run a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (a machine that never did). Every lazytensor run's
results are checked against the dense run's: ``agree`` and ``max_diff`` (relative, per script's
measure) on each lazytensor line. ``--scale`` shrinks every size (dry runs); ``--timeout`` bounds
each process (``SECONDS`` for all, ``NAME=SECONDS`` for one script: today's ``solve`` takes minutes).

One JSON line per (script, variant[, cache]), then a markdown table; ``--docs PATH`` also writes the
table between ``<!-- benchmarks/scripts.py: begin -->`` and ``<!-- benchmarks/scripts.py: end -->`` in PATH.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- benchmarks/scripts.py: begin -->", "<!-- benchmarks/scripts.py: end -->"
_MARK = "SCRIPT_RESULT "
VARIANTS = ("lazytensor", "dense")
CACHES = ("warm", "cold")


# -- the scripts, as a user writes them -------------------------------------------------------------------
# Each text is a whole script; ``{name}`` fields are its sizes. The child runs the first line
# (``import torch``) before the clock starts; everything after it is timed.

KMEANS_LT = """\
import torch
import lazytensor as lt

torch.manual_seed(0)
N, D, K = {n}, 2, {k}
x = 0.7 * torch.randn(N, D) + 0.3
c = x[:K].clone()  # the first K points start as centroids
for _ in range(10):
    labels = lt.Vi(x).sqdist(lt.Vj(c)).argmin(1).view(-1)
    counts = torch.bincount(labels, minlength=K).clamp(min=1).to(x.dtype)
    c = torch.zeros(K, D).index_add_(0, labels, x) / counts[:, None]
"""

KMEANS_DENSE = """\
import torch

torch.manual_seed(0)
N, D, K = {n}, 2, {k}
x = 0.7 * torch.randn(N, D) + 0.3
c = x[:K].clone()  # the first K points start as centroids
for _ in range(10):
    labels = torch.cdist(x, c).argmin(1)
    counts = torch.bincount(labels, minlength=K).clamp(min=1).to(x.dtype)
    c = torch.zeros(K, D).index_add_(0, labels, x) / counts[:, None]
"""

KNN_LT = """\
import torch
from sklearn.datasets import load_digits
import lazytensor as lt

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32)
y = torch.tensor(digits.target)
x_train, y_train = X[:{train}], y[:{train}]
x_test, y_test = X[-{queries}:], y[-{queries}:]
neighbours = lt.Vi(x_test).sqdist(lt.Vj(x_train)).argkmin(5, 1)
prediction = y_train[neighbours].mode(1).values
accuracy = (prediction == y_test).float().mean()
"""

KNN_DENSE = """\
import torch
from sklearn.datasets import load_digits

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32)
y = torch.tensor(digits.target)
x_train, y_train = X[:{train}], y[:{train}]
x_test, y_test = X[-{queries}:], y[-{queries}:]
neighbours = torch.cdist(x_test, x_train).topk(5, largest=False).indices
prediction = y_train[neighbours].mode(1).values
accuracy = (prediction == y_test).float().mean()
"""

SOLVE_LT = """\
import torch
import lazytensor as lt

torch.manual_seed(0)
N, sigma = {n}, 0.1
x = torch.rand(N, 2, dtype=torch.float64)
b = torch.rand(N, 1, dtype=torch.float64)
K = (-lt.Vi(x).sqdist(lt.Vj(x)) / (2 * sigma**2)).exp()
a = K.solve(lt.Vi(b), alpha=0.01)
"""

SOLVE_DENSE = """\
import torch

torch.manual_seed(0)
N, sigma = {n}, 0.1
x = torch.rand(N, 2, dtype=torch.float64)
b = torch.rand(N, 1, dtype=torch.float64)
K = torch.exp(-torch.cdist(x, x) ** 2 / (2 * sigma**2))
a = torch.linalg.solve(K + 0.01 * torch.eye(N, dtype=torch.float64), b)
"""

KDE_LT = """\
import torch
import lazytensor as lt

torch.manual_seed(0)
N, M, h = {n}, {n}, 0.1
x = torch.rand(N, 3)
y = torch.rand(M, 3)
density = (-lt.Vi(x).sqdist(lt.Vj(y)) / (2 * h**2)).exp().sum(1)
"""

KDE_DENSE = """\
import torch

torch.manual_seed(0)
N, M, h = {n}, {n}, 0.1
x = torch.rand(N, 3)
y = torch.rand(M, 3)
density = torch.exp(-torch.cdist(x, y) ** 2 / (2 * h**2)).sum(1)
"""

SINKHORN_LT = """\
import torch
import math
import lazytensor as lt

torch.manual_seed(0)
N, M, eps = {n}, {n}, 0.01
x = torch.rand(N, 3)
y = torch.rand(M, 3)
cost_xy = lt.Vi(x).sqdist(lt.Vj(y)) / 2  # uniform weights 1/N and 1/M
cost_yx = lt.Vi(y).sqdist(lt.Vj(x)) / 2
f, g = torch.zeros(N, 1), torch.zeros(M, 1)
for _ in range(50):
    f = -eps * ((lt.Vj(g) - cost_xy) / eps).logsumexp(1) + eps * math.log(M)
    g = -eps * ((lt.Vj(f) - cost_yx) / eps).logsumexp(1) + eps * math.log(N)
"""

SINKHORN_DENSE = """\
import torch
import math

torch.manual_seed(0)
N, M, eps = {n}, {n}, 0.01
x = torch.rand(N, 3)
y = torch.rand(M, 3)
cost = torch.cdist(x, y) ** 2 / 2  # uniform weights 1/N and 1/M
f, g = torch.zeros(N, 1), torch.zeros(M, 1)
for _ in range(50):
    f = -eps * torch.logsumexp((g.T - cost) / eps, dim=1, keepdim=True) + eps * math.log(M)
    g = -eps * torch.logsumexp((f.T - cost.T) / eps, dim=1, keepdim=True) + eps * math.log(N)
"""

GP_LT = """\
import torch
import lazytensor.keops
lazytensor.keops.install()  # GPyTorch's KeOps kernels run on lazytensor
import gpytorch

torch.manual_seed(0)
N = {n}
x = torch.rand(N, 3)
y = torch.sin(6 * x).sum(-1) + 0.1 * torch.randn(N)

class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean = gpytorch.means.ConstantMean()
        self.covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.RBFKernel())

    def forward(self, z):
        return gpytorch.distributions.MultivariateNormal(self.mean(z), self.covar(z))

likelihood = gpytorch.likelihoods.GaussianLikelihood()
model = GP(x, y, likelihood)
model.train()
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
for _ in range({steps}):
    optimizer.zero_grad()
    loss = -mll(model(x), y)
    loss.backward()
    optimizer.step()
lengthscale = model.covar.base_kernel.lengthscale.detach()
noise = likelihood.noise.detach()
"""

_GP_INSTALL = "import lazytensor.keops\nlazytensor.keops.install()  # GPyTorch's KeOps kernels run on lazytensor\n"
GP_DENSE = GP_LT.replace(_GP_INSTALL, "").replace("gpytorch.kernels.keops.RBFKernel()", "gpytorch.kernels.RBFKernel()")



def _relative(ours, reference) -> float:
    ours, reference = ours.double().reshape(reference.shape), reference.double()
    return float((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-300))


def _compare_kmeans(ours: dict, dense: dict, sizes: dict) -> dict:
    differ = int((ours["labels"] != dense["labels"]).sum())
    diff = _relative(ours["c"], dense["c"])
    # the same labels give the same centroids; a point on a near-tie may go the other way (cdist's rounding)
    return {"agree": differ <= max(1, sizes["n"] // 10000) and diff <= 1e-3, "max_diff": diff, "labels_differ": differ}


def _compare_knn(ours: dict, dense: dict, sizes: dict) -> dict:
    """The neighbours' distances, exact (the digits are small integers): ties may pick other indices, never others' distances."""
    from sklearn.datasets import load_digits

    X = torch.tensor(load_digits().data, dtype=torch.float64)
    train, test = X[:sizes["train"]], X[-sizes["queries"]:]

    def distances(idx):
        return ((test[:, None, :] - train[idx.long()]) ** 2).sum(-1).sort(1).values

    diff = float((distances(ours["neighbours"]) - distances(dense["neighbours"])).abs().max())
    same = float((ours["prediction"] == dense["prediction"]).double().mean())
    return {"agree": diff == 0.0, "max_diff": diff, "same_prediction": same,
            "accuracy": float(ours["accuracy"]), "dense_accuracy": float(dense["accuracy"])}


def _compare_solve(ours: dict, dense: dict, sizes: dict) -> dict:
    diff = _relative(ours["a"], dense["a"])
    return {"agree": diff <= 1e-6, "max_diff": diff}


def _compare_kde(ours: dict, dense: dict, sizes: dict) -> dict:
    diff = _relative(ours["density"], dense["density"])
    return {"agree": diff <= 1e-4, "max_diff": diff}


def _compare_gp(ours: dict, dense: dict, sizes: dict) -> dict:
    """The fitted hyperparameters: float32 CG and Lanczos in both, so agreement to 1e-3, not to rounding."""
    diff = max(_relative(ours["lengthscale"], dense["lengthscale"]), _relative(ours["noise"], dense["noise"]))
    return {"agree": diff <= 1e-3, "max_diff": diff}


def _compare_sinkhorn(ours: dict, dense: dict, sizes: dict) -> dict:
    diff = max(_relative(ours["f"], dense["f"]), _relative(ours["g"], dense["g"]))
    return {"agree": diff <= 1e-3, "max_diff": diff}


@dataclass(frozen=True)
class Script:
    title: str  # the table's row, formatted with the sizes
    sizes: Callable[[float], dict]  # scale -> the template's fields
    lazytensor: str
    dense: str
    outputs: tuple  # the script's variables the comparison reads
    compare: Callable[[dict, dict, dict], dict]


def _n(base: int, scale: float, least: int) -> int:
    return max(least, round(base * scale))


SCRIPTS = {
    "kmeans": Script("KeOps's k-means tutorial: 10 Lloyd iterations, {n} points in 2-D, {k} centroids (`argmin`)",
                     lambda s: {"n": _n(50000, s, 500), "k": 50}, KMEANS_LT, KMEANS_DENSE, ("c", "labels"), _compare_kmeans),
    "knn": Script("k-NN classification of scikit-learn's digits ({queries} queries, {train} points, D = 64, `argkmin(5)`)",
                  lambda s: {"queries": _n(297, s, 10), "train": _n(1500, s, 20)}, KNN_LT, KNN_DENSE,
                  ("neighbours", "prediction", "accuracy"), _compare_knn),
    "solve": Script("KeOps's KernelSolve tutorial: `K.solve(Vi(b), alpha=0.01)`, {n} points in 2-D, float64, sigma 0.1",
                    lambda s: {"n": _n(5000, s, 50)}, SOLVE_LT, SOLVE_DENSE, ("a",), _compare_solve),
    "kde": Script("Gaussian KDE, {n} x {n}, 3-D", lambda s: {"n": _n(20000, s, 100)}, KDE_LT, KDE_DENSE,
                  ("density",), _compare_kde),
    "sinkhorn": Script("log-domain Sinkhorn, 50 iterations, {n} x {n}, 3-D", lambda s: {"n": _n(5000, s, 50)},
                       SINKHORN_LT, SINKHORN_DENSE, ("f", "g"), _compare_sinkhorn),
    "gp": Script("GPyTorch exact GP fit, KeOps RBF kernel (`install()`): {steps} Adam steps of the marginal likelihood, "
                 "{n} points in 3-D", lambda s: {"n": _n(2000, s, 100), "steps": 20}, GP_LT, GP_DENSE,
                 ("lengthscale", "noise"), _compare_gp),
}


# -- one fresh process ------------------------------------------------------------------------------------
def child_source(text: str, outputs: tuple, out_path: str, threads: int, prepare: bool = False) -> str:
    """The file a child runs: the user's script between a clock and the saving of its ``outputs`` (after the clock).

    ``prepare``: the untimed run that fills the warm cache; every formula builds its kernel from its first
    call (``compile.set_compile_after(0)``) and the run waits for the builds before it exits.
    """
    lines = text.rstrip("\n").split("\n")
    if lines[0] != "import torch":
        raise ValueError("a script starts with `import torch`")
    body = lines[1:]
    imports = 0
    while imports < len(body) and body[imports].startswith(("import ", "from ")):
        imports += 1
    head = ["import time as _time", "import torch", f"torch.set_num_threads({threads})"]
    if prepare:
        head += ["import lazytensor.compile as _compile", "_compile.set_compile_after(0.0)"]
    tail = ["_seconds = _time.perf_counter() - _start"]
    if prepare:
        tail += ["_compile.wait_for_background_compiles()"]
    tail += ["import json as _json, resource as _resource",
             f"torch.save({{_name: globals()[_name] for _name in {list(outputs)!r}}}, {out_path!r})",
             "_peak = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1024",
             "_times = {'seconds': _seconds, 'imports_s': _imports_s, 'peak_rss_mb': _peak}",
             f"print({_MARK!r} + _json.dumps(_times), flush=True)"]
    return "\n".join(head + ["_start = _time.perf_counter()", *body[:imports], "_imports_s = _time.perf_counter() - _start",
                             *body[imports:], *tail]) + "\n"


def run_child(text: str, outputs: tuple, threads: int, cache_dir: str, timeout: float, prepare: bool = False) -> dict:
    """Run one script in a fresh interpreter: its times (and ``outputs``, loaded), or ``error``."""
    with tempfile.TemporaryDirectory(prefix="tp-script-") as folder:
        path, out_path = os.path.join(folder, "script.py"), os.path.join(folder, "outputs.pt")
        with open(path, "w") as fh:
            fh.write(child_source(text, outputs, out_path, threads, prepare))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:g} s"}
        process_s = time.perf_counter() - start
        lines = [line[len(_MARK):] for line in done.stdout.splitlines() if line.startswith(_MARK)]
        if done.returncode != 0 or not lines:
            return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
        record = {**json.loads(lines[-1]), "process_s": process_s}
        record["outputs"] = torch.load(out_path, weights_only=True)
        return record


# -- the driver -------------------------------------------------------------------------------------------
def _timeouts(spec: str, names) -> dict:
    """``600`` or ``600,solve=900``: seconds per process, for every script or for one."""
    default, per = None, {}
    for part in filter(None, spec.split(",")):
        name, _, value = part.rpartition("=")
        if name and name not in names:
            raise ValueError(f"unknown script {name!r}")
        seconds = float(value)
        if not seconds > 0:
            raise ValueError(f"seconds must be > 0, got {value!r}")
        if name:
            per[name] = seconds
        else:
            default = seconds
    return {name: per.get(name, default if default is not None else 600.0) for name in names}


def _summary(runs: list[dict]) -> dict:
    return {"seconds": round(statistics.median(r["seconds"] for r in runs), 3),
            "samples_s": [round(r["seconds"], 3) for r in runs],
            "imports_s": round(statistics.median(r["imports_s"] for r in runs), 3),
            "process_s": [round(r["process_s"], 3) for r in runs],
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1)}


def measure(name: str, args, timeout: float, emit: Callable[[dict], None]) -> list[dict]:
    """Every variant of one script: ``args.repeat`` fresh runs each, alternating; one record per variant and cache."""
    script = SCRIPTS[name]
    sizes = script.sizes(args.scale)
    base = {"script": name, "sizes": sizes, "threads": args.threads, "scale": args.scale}
    texts = {"lazytensor": script.lazytensor.format(**sizes), "dense": script.dense.format(**sizes)}
    runs: dict[tuple, list] = {("dense", None): [], **{("lazytensor", c): [] for c in args.cache}}
    errors: dict[tuple, str] = {}
    prepare_s = None
    if "warm" in args.cache:
        start = time.perf_counter()
        prepared = run_child(texts["lazytensor"], script.outputs, args.threads, args.cache_dir, timeout, prepare=True)
        prepare_s = round(time.perf_counter() - start, 3)
        if "error" in prepared:
            errors["lazytensor", "warm"] = f"preparation: {prepared['error']}"
    for _ in range(args.repeat):
        for variant, cache in runs:
            if (variant, cache) in errors:
                continue
            if cache == "cold":
                folder = tempfile.mkdtemp(prefix="tp-cold-inductor-")
                try:
                    record = run_child(texts[variant], script.outputs, args.threads, folder, timeout)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
            else:
                record = run_child(texts[variant], script.outputs, args.threads, args.cache_dir, timeout)
            if "error" in record:
                errors[variant, cache] = record["error"]
            else:
                runs[variant, cache].append(record)
    records = []
    dense = runs["dense", None][0]["outputs"] if runs["dense", None] else None
    for (variant, cache), done in runs.items():
        record = {**base, "variant": variant, **({"cache": cache} if cache else {})}
        if done:
            record.update(_summary(done))
        if (variant, cache) in errors:
            record["error"] = errors[variant, cache]
        if cache == "warm":
            record["prepare_s"] = prepare_s
        if variant == "lazytensor" and done and dense is not None:
            checks = [script.compare(r["outputs"], dense, sizes) for r in done]
            worst = max(checks, key=lambda c: (not c["agree"], c["max_diff"]))
            record.update(worst)
        emit(record)
        records.append(record)
    return records


def _seconds(record: dict | None) -> str:
    if record is None:
        return "-"
    if "seconds" not in record:
        return record.get("error", "-").split("\n")[0][:40]
    seconds = record["seconds"]
    return f"{seconds:.0f}" if seconds >= 100 else f"{seconds:#.3g}" if seconds >= 1 else f"{seconds:.3g}"


def table(records: list[dict]) -> str:
    """The markdown table: one row per script (and per cache, where both ran)."""
    caches = sorted({r["cache"] for r in records if "cache" in r}, key=CACHES.index)
    lines = ["| script | lazytensor s | dense s | ratio | agree |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["script"] for r in records):
        mine = [r for r in records if r["script"] == name]
        dense = next((r for r in mine if r["variant"] == "dense"), None)
        title = SCRIPTS[name].title.format(**mine[0]["sizes"])
        for cache in caches:
            ours = next((r for r in mine if r.get("cache") == cache), None)
            ratio = (f"{ours['seconds'] / dense['seconds']:.2f}x" if ours and dense and "seconds" in ours and "seconds" in dense
                     and dense["seconds"] > 0 else "-")
            agree = "-" if not ours or "agree" not in ours else f"{'yes' if ours['agree'] else '**no**'} ({ours['max_diff']:.1e})"
            label = title + (f" ({cache} cache)" if len(caches) > 1 else "")
            lines.append(f"| {label} | {_seconds(ours)} | {_seconds(dense)} | {ratio} | {agree} |")
    return "\n".join(lines)


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def write_docs(path: str, block: str) -> None:
    """Replace what lies between the markers in ``path`` with ``block``."""
    with open(path) as fh:
        text = fh.read()
    if BEGIN not in text or END not in text or text.index(END) < text.index(BEGIN):
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w") as fh:
        fh.write(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main() -> None:
    from common import arguments, emit, parse  # here: a test may import this module as benchmarks.scripts

    parser = arguments(__doc__, threads=2)
    parser.add_argument("--scripts", default=",".join(SCRIPTS), help="comma list of %(default)s")
    parser.add_argument("--repeat", type=int, default=1, help="fresh-process runs per variant; the median is reported")
    parser.add_argument("--cache", default="warm", help="warm, cold or warm,cold (default %(default)s)")
    parser.add_argument("--cache-dir", default=os.path.join(ROOT, ".cache", "inductor"),
                        help="the warm inductor cache (default: the project's .cache/inductor)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size (dry runs: 0.05)")
    parser.add_argument("--timeout", default="600", help="seconds per process: SECONDS, NAME=SECONDS or both, comma-separated")
    parser.add_argument("--docs", metavar="PATH", help="write the table between the markers in PATH")
    parser.add_argument("--show", metavar="NAME", help="print the script's two variants at --scale and exit")
    args = parse(parser)
    if args.show:
        if args.show not in SCRIPTS:
            parser.error(f"--show: unknown script {args.show!r}; known: {list(SCRIPTS)}")
        script = SCRIPTS[args.show]
        sizes = script.sizes(args.scale)
        print(f"# lazytensor\n{script.lazytensor.format(**sizes)}\n# dense\n{script.dense.format(**sizes)}")
        return
    names, args.cache = args.scripts.split(","), args.cache.split(",")
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        parser.error(f"--scripts: unknown {unknown}; known: {list(SCRIPTS)}")
    if not args.cache or any(c not in CACHES for c in args.cache):
        parser.error(f"--cache: one or more of {list(CACHES)}, got {','.join(args.cache)!r}")
    if args.repeat < 1 or args.threads < 1 or not args.scale > 0:
        parser.error("--repeat and --threads are integers >= 1, --scale a number > 0")
    try:
        timeouts = _timeouts(args.timeout, SCRIPTS)
    except ValueError as exc:
        parser.error(f"--timeout: {exc}")
    records = []
    for name in names:
        records += measure(name, args, timeouts[name], emit)
    text = table(records)
    print(text)
    if args.docs:
        command = "python benchmarks/scripts.py " + " ".join(sys.argv[1:])
        stamp = datetime.date.today().isoformat()
        note = (f"`{command}` ({stamp}, {_machine()}; {args.threads} threads, scale {args.scale:g}, "
                f"{' and '.join(args.cache)} cache, median of {args.repeat} fresh process{'es' if args.repeat > 1 else ''} "
                f"per variant; ratio = lazytensor / dense, agree: the relative max difference):")
        write_docs(args.docs, f"{note}\n\n{text}")


if __name__ == "__main__":
    main()
