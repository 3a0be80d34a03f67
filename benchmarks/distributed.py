"""Scale-out benchmark: one process against two (gloo, one thread each) on the same problems.

    python benchmarks/distributed.py [--n 16384] [--repeats 3] [--ridge-n 16384] [--fits ridge,landmark,pca]
                                     [--polytope-samples 4096]

Cases, each checked against the single-process result before it is timed:
- ``rbf``: ``(-0.5 |x_i - y_j|^2).exp() @ b`` (D = 3, C = 16, float32) with y and b
  sharded over j, x replicated: every rank gets the full (N, C) result;
- ``ridge``, ``landmark``, ``pca``: ``KernelRidge(RBF(0.5), 1.0)``, ``LandmarkRidge(RBF(0.5), 1.0,
  n_landmarks=512)`` and ``KernelPCA(RBF(0.5), 4)`` with ``source="sharded"`` fitted on row shards
  of an n x 8 float64 problem (one process: ``source="streamed"``); every rank's coefficients or
  eigenvectors (``--fits`` picks them);
- ``polytope``: two ``polytope.train`` steps (default options) of a 16-64-64-1 float64 MLP on
  that many samples, where scoring the candidates dominates; ``group=`` splits them over the ranks.

Prints the best-of-repeats seconds for 1 and 2 processes and the speed-up.
"""
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import arguments, parse

import lazytensor as lt


def rbf_inputs(n):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=gen), torch.randn(n, 3, generator=gen), torch.randn(n, 16, generator=gen)


def rbf(x, y, b):
    return (-0.5 * lt.Vi(x).sqdist(lt.Vj(y))).exp().matmul(b, backend="compiled")


def ridge_inputs(n):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    return X, torch.sin(X.sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=gen, dtype=torch.float64)


def fit(name, X, Y, source):
    from solvers import RBF, KernelPCA, KernelRidge, LandmarkRidge
    if name == "ridge":
        return KernelRidge(RBF(0.5), alpha=1.0, source=source).fit(X, Y).dual_coef_
    if name == "landmark":
        return LandmarkRidge(RBF(0.5), alpha=1.0, n_landmarks=512, source=source).fit(X, Y).coef_
    return KernelPCA(RBF(0.5), n_components=4, source=source).fit(X).eigenvectors_


def polytope_steps(samples, group):
    from torch import nn

    from polytope import train

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:, :4].sum(1, keepdim=True))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    train(model, nn.functional.mse_loss, (x, y), steps=2, seed=0, progress=False, group=group)
    return nn.utils.parameters_to_vector(model.parameters()).detach()


def best_of(fn, repeats):
    fn()  # warm-up: compilation and allocations
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def shard(t, rank, world):
    rows = (t.shape[0] + world - 1) // world
    return t[rank * rows:(rank + 1) * rows]


def cases(args, rank, world):
    """(name, zero-argument function of this rank) per case."""
    x, y, b = rbf_inputs(args.n)
    yield "rbf", lambda: rbf(x, shard(y, rank, world), shard(b, rank, world))
    if args.ridge_n:
        X, Y = ridge_inputs(args.ridge_n)
        source = "sharded" if world > 1 else "streamed"
        for name in args.fits.split(","):
            yield name, lambda name=name: fit(name, shard(X, rank, world), shard(Y, rank, world), source)
    if args.polytope_samples:
        group = dist.group.WORLD if world > 1 else None
        yield "polytope", lambda: polytope_steps(args.polytope_samples, group)


def worker(rank, world, path, args, queue):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for name, fn in cases(args, rank, world):
        with lt.distributed.sharded() if world > 1 else _nothing():
            out = fn()
            norm = float(out.double().norm())
            results[name] = (best_of(fn, args.repeats), norm)
    queue.put((rank, results))
    if world > 1:
        dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run(world, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "rv"), args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        reports = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    return {name: (max(r[name][0] for r in reports.values()), reports[0][name][1]) for name in reports[0]}


def main():
    p = arguments(__doc__, threads=None)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--ridge-n", type=int, default=0, help="also run the sharded fits at this size (0: skip)")
    p.add_argument("--fits", default="ridge", help="comma-separated fits: ridge, landmark, pca")
    p.add_argument("--polytope-samples", type=int, default=0, help="also time polytope.train steps on this many samples")
    p.add_argument("--repeats", type=int, default=3)
    args = parse(p)
    one, two = run(1, args), run(2, args)
    for name in one:
        (t1, n1), (t2, n2) = one[name], two[name]
        check = "" if n2 is None else f", results agree to {abs(n1 - n2) / n1:.1e}"
        print(f"{name}: 1 process {t1:.3f} s, 2 processes {t2:.3f} s, speed-up {t1 / t2:.2f}x{check}")


if __name__ == "__main__":
    main()
