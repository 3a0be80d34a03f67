"""Block-sparse (``ranges=``) against dense streamed kernel products on clustered points, side by side.

    .venv/bin/python benchmarks/block_sparse.py --n 50000 --clusters 64 [--backward]

Points: ``clusters`` Gaussian blobs (spread 1) on a 3-D grid of spacing 10; a Gaussian kernel of
bandwidth ``sigma``; clusters from ``grid_cluster`` (cubic cells of side ``cell``), cluster pairs kept
when their centroids are closer than ``cutoff`` sigma. Both variants run the same formula through the
same engine (backend "auto"); the sparse one skips the dropped blocks. Prints one JSON line: median
seconds over shuffled rounds (warm-up and cluster preprocessing timed apart), the speed-up, the
kept fraction of pairs, and the relative error of the sparse result against the dense one.
"""
import random
import statistics
import time

import torch
from common import arguments, emit, parse

import lazytensor as lt
from lazytensor import cluster


def clustered(n: int, clusters: int, gen: torch.Generator, dtype) -> torch.Tensor:
    side = round(clusters ** (1 / 3) + 0.5)
    grid = torch.stack(torch.meshgrid(*[torch.arange(side, dtype=dtype)] * 3, indexing="ij"), -1).reshape(-1, 3)[:clusters]
    labels = torch.randint(0, clusters, (n,), generator=gen)
    return 10.0 * grid[labels] + torch.randn(n, 3, generator=gen, dtype=dtype)


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--clusters", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--cell", type=float, default=10.0, help="side of the grid_cluster cells")
    parser.add_argument("--cutoff", type=float, default=8.0, help="keep cluster pairs with centroids closer than this many sigma")
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backward", action="store_true", help="time forward + backward (gradient in x)")
    args = parse(parser)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32
    x, y = clustered(args.n, args.clusters, gen, dtype), clustered(args.n, args.clusters, gen, dtype)
    b = torch.randn(args.n, args.channels, generator=gen, dtype=dtype)

    start = time.perf_counter()
    x, x_labels = cluster.sort_clusters(x, cluster.grid_cluster(x, args.cell))
    y, y_labels = cluster.sort_clusters(y, cluster.grid_cluster(y, args.cell))
    x_ranges, x_centres, _ = cluster.cluster_ranges_centroids(x, x_labels)
    y_ranges, y_centres, _ = cluster.cluster_ranges_centroids(y, y_labels)
    keep = torch.cdist(x_centres, y_centres) < args.cutoff * args.sigma
    ranges = cluster.from_matrix(x_ranges, y_ranges, keep)
    preprocessing = time.perf_counter() - start
    sizes_x, sizes_y = (x_ranges[:, 1] - x_ranges[:, 0]).double(), (y_ranges[:, 1] - y_ranges[:, 0]).double()
    kept_pairs = float(sizes_x @ keep.double() @ sizes_y) / args.n**2

    def run(sparse: bool):
        xs = x.clone().requires_grad_(args.backward)
        K = (-lt.Vi(xs).sqdist(lt.Vj(y)) / (2 * args.sigma**2)).exp()
        out = K.matmul(b, ranges=ranges if sparse else None)
        if args.backward:
            (grad,) = torch.autograd.grad(out.sum(), xs)
            return out.detach(), grad
        return out, None

    results = {name: run(name == "sparse") for name in ("dense", "sparse")}  # warm-up (and compiles)
    times = {"dense": [], "sparse": []}
    order = ["dense", "sparse"] * args.repeats
    random.Random(0).shuffle(order)
    for name in order:
        start = time.perf_counter()
        run(name == "sparse")
        times[name].append(time.perf_counter() - start)
    (dense, dense_grad), (sparse, sparse_grad) = results["dense"], results["sparse"]
    record = {
        "n": args.n, "clusters": args.clusters, "grid_cells_x": len(x_ranges), "grid_cells_y": len(y_ranges),
        "sigma": args.sigma, "cell": args.cell, "cutoff_sigma": args.cutoff, "channels": args.channels, "backward": args.backward,
        "threads": args.threads, "kept_pair_fraction": kept_pairs, "kept_block_fraction": float(keep.float().mean()),
        "dense_s": statistics.median(times["dense"]), "sparse_s": statistics.median(times["sparse"]),
        "preprocessing_s": preprocessing,
        "relative_error": float((sparse - dense).norm() / dense.norm()),
    }
    if args.backward:
        record["relative_error_grad"] = float((sparse_grad - dense_grad).norm() / dense_grad.norm())
    record["speedup"] = record["dense_s"] / record["sparse_s"]
    emit(record)


if __name__ == "__main__":
    main()
