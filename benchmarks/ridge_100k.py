"""One recorded streamed ridge fit at n = 100,000, d = 8, float64: time, convergence, peak RSS growth.

Prints one JSON line (default estimator settings: float64 tiles, a rank-2048 pivoted-Cholesky
Nystrom preconditioner built from float32 tiles). Takes about 3.5 minutes on 2 quiet cores
(docs/solvers.md has the recorded run); `python -m harness ml` is meant for sizes where a dense
reference can be checked. `--threads N` sets torch's threads (default 2).
"""
import resource
import time

import torch
from common import arguments, emit, parse

from solvers import RBF, KernelRidge

parser = arguments(__doc__)
parser.add_argument("--n", type=int, default=100_000)
args = parse(parser)
gen = torch.Generator().manual_seed(0)
n = args.n
X = torch.randn(n, 8, generator=gen, dtype=torch.float64)
Y = torch.stack([torch.sin(X[:, 0]) + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64), torch.cos(X[:, 1])], 1)
Xq = torch.randn(128, 8, generator=gen, dtype=torch.float64)
with open("/proc/self/statm") as fh:
    before = int(fh.read().split()[1]) * 4096
start, cpu = time.perf_counter(), time.process_time()
model = KernelRidge(RBF(1 / 8), alpha=0.5, source="streamed", rtol=1e-7, atol=1e-9).fit(X, Y)
prediction = model.predict(Xq)
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
info = model.info_
emit({
    "n": n, "d": 8, "seconds": seconds, "cpu_seconds": cpu_seconds, "iterations": info.iterations,
    "matvecs": info.matvecs, "converged": bool(info.converged), "reason": info.reason,
    "relative_residuals": (info.residuals / Y.norm(dim=0)).tolist(),
    "peak_rss_growth_mib": (peak - before) / 2**20, "threads": torch.get_num_threads(),
})
