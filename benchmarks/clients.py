"""KeOps's clients on lazytensor.keops, beside pykeops and their dense paths: the table of docs/keops.md.

    flock /tmp/tp-bench.lock .venv/bin/python benchmarks/clients.py [--n 5000] [--threads 1]
        [--workloads sinkhorn,gp-mll,gp-predict] [--backends lazytensor,pykeops,dense] [--dtype float32]

Workloads, as a user runs them with default settings:

- ``sinkhorn``: GeomLoss ``SamplesLoss("sinkhorn", p=2, blur=0.05, backend="online")`` value and
  gradient on n = m points in 3-D (dense: ``backend="tensorized"``);
- ``multiscale``: the same loss with ``backend="multiscale"`` (clustered, block-sparse log-sum-exps
  over KeOps ``ranges``; dense: ``backend="tensorized"``);
- ``gp-mll``: a GPyTorch exact GP with the KeOps RBF kernel (ScaleKernel, Gaussian likelihood),
  negative marginal log-likelihood and its backward on n points in 3-D (dense: GPyTorch's RBFKernel);
- ``gp-predict``: the same model's predictive mean and variance on 1000 points;
- ``lse-pass`` / ``rbf-pass``: one of sinkhorn's passes alone, written with ``pykeops.torch.LazyTensor``:
  ``(h_j - 200 |x_i - y_j|^2).logsumexp(1)`` (blur 0.05), and the product ``exp(-2 |x_i - y_j|^2) @ b``
  (dense: the same on the full matrix).

Each (workload, backend) runs in a fresh process, because GPyTorch and GeomLoss bind pykeops when
they are imported: ``lazytensor`` through ``lazytensor.keops.install()``, ``pykeops`` the real one
(skipped when absent), ``dense`` without KeOps. The first call (lazytensor's compile, KeOps's C++
build) is timed apart from the steady state (the median of ``--repeats`` later calls). One JSON
line per run: seconds, the value (loss, or the mean of the prediction) to compare backends.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("sinkhorn", "multiscale", "gp-mll", "gp-predict", "lse-pass", "rbf-pass")
BACKENDS = ("lazytensor", "pykeops", "dense")


def _points(n: int, dtype, seed: int, device: str = "cpu"):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, generator=gen).to(dtype=dtype, device=device)


def _sinkhorn(n: int, dtype, backend: str, multiscale: bool = False, device: str = "cpu"):
    import geomloss
    import torch

    x, y = _points(n, dtype, 0, device).requires_grad_(), _points(n, dtype, 1, device) + 0.2
    keops = "multiscale" if multiscale else "online"
    loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.05, backend="tensorized" if backend == "dense" else keops)

    def call():
        value = loss(x, y)
        (grad,) = torch.autograd.grad(value, x)
        return float(value) + 0.0 * float(grad.sum())

    return call


def _pass(n: int, dtype, backend: str, lse: bool, device: str = "cpu"):
    import torch

    x, y = _points(n, dtype, 0, device), _points(n, dtype, 1, device) + 0.2
    h = torch.randn(n, 1, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=device)
    if backend == "dense":
        d = ((x[:, None] - y[None]) ** 2).sum(-1)
        return lambda: float((h.T - 200 * d).logsumexp(1).sum() if lse else ((-2 * d).exp() @ h).sum())
    from pykeops.torch import LazyTensor

    x_i, y_j, h_j = LazyTensor(x[:, None, :]), LazyTensor(y[None, :, :]), LazyTensor(h[None, :, :])
    d_ij = ((x_i - y_j) ** 2).sum(-1)
    return lambda: float((h_j - 200 * d_ij).logsumexp(1).sum() if lse else ((-2 * d_ij).exp() @ h).sum())


def exact_gp(gpytorch, kernel, x, y):
    """GPyTorch's exact GP regression model (constant mean, scaled ``kernel``, Gaussian likelihood) on ``(x, y)``.

    ``gpytorch`` is passed in: it binds pykeops at import, so the caller imports it under the backend it
    measures (tests/clients imports it over ``lazytensor.keops.install()`` and uses this model too).
    """
    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
            self.mean, self.covar = gpytorch.means.ConstantMean(), gpytorch.kernels.ScaleKernel(kernel)

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(self.mean(z), self.covar(z))

    return GP()


def _gp(n: int, dtype, backend: str, predict: bool, device: str = "cpu"):
    import gpytorch
    import torch

    x = _points(n, dtype, 0, device)
    y = torch.sin(6 * x).sum(-1) + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=device)
    kernel = gpytorch.kernels.RBFKernel() if backend == "dense" else gpytorch.kernels.keops.RBFKernel()
    model = exact_gp(gpytorch, kernel, x, y).to(dtype=dtype, device=device)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    x_test = _points(1000, dtype, 3, device)

    def train_step():
        model.train()
        model.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        return float(loss)

    def prediction():
        model.eval()
        with torch.no_grad():
            pred = model.likelihood(model(x_test))
            return float(pred.mean.mean()) + 0.0 * float(pred.variance.mean())

    return prediction if predict else train_step


def run_one(workload: str, backend: str, n: int, dtype_name: str, threads: int, repeats: int, device: str = "cpu") -> dict:
    """In this process: bind the backend, build the workload, time its first call and its steady state."""
    if backend == "lazytensor":
        import lazytensor.keops

        lazytensor.keops.install()
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    if workload in ("sinkhorn", "multiscale"):
        call = _sinkhorn(n, dtype, backend, workload == "multiscale", device)
    elif workload.endswith("-pass"):
        call = _pass(n, dtype, backend, workload == "lse-pass", device)
    else:
        call = _gp(n, dtype, backend, workload == "gp-predict", device)
    start = time.perf_counter()
    value = call()
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        value = call()
        samples.append(time.perf_counter() - start)
    return {"workload": workload, "backend": backend, "n": n, "dtype": dtype_name, "threads": threads, "device": device,
            "first_s": round(first, 3), "steady_s": round(statistics.median(samples), 3) if samples else None,
            "samples_s": [round(s, 3) for s in samples], "value": value}


def main() -> None:
    from common import arguments, parse  # here: tests import this module as benchmarks.clients

    parser = arguments(__doc__, threads=1)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="steady-state calls after the first (0: the first call only)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (workload, backend) run")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "BACKEND"), help=argparse.SUPPRESS)
    args = parse(parser)
    if args.child:
        print(json.dumps(run_one(*args.child, args.n, args.dtype, args.threads, args.repeats, args.device)))
        return
    workloads, backends = args.workloads.split(","), args.backends.split(",")
    for name, allowed in (("workloads", WORKLOADS), ("backends", BACKENDS)):
        unknown = set(locals()[name]) - set(allowed)
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}; known: {list(allowed)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    for workload in workloads:
        for backend in backends:
            if backend == "pykeops" and importlib.util.find_spec("pykeops") is None:
                print(json.dumps({"workload": workload, "backend": backend, "skipped": "pykeops is not installed"}))
                continue
            command = [sys.executable, __file__, "--child", workload, backend, "--n", str(args.n), "--dtype", args.dtype,
                       "--threads", str(args.threads), "--repeats", str(args.repeats), "--device", args.device]
            try:
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(json.dumps({"workload": workload, "backend": backend, "n": args.n, "error": f"over {args.timeout} s"}))
                continue
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                print(json.dumps({"workload": workload, "backend": backend, "n": args.n, "error": done.stderr[-2000:]}))
                continue
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
