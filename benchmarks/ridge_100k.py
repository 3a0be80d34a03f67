"""One recorded streamed ridge fit at n = 100,000, d = 8, float64: time, convergence, peak RSS growth.

Prints one JSON line. Takes ~25 minutes on 2 cores (docs/solvers.md has the recorded run);
the harness's `ml` command is meant for sizes where a dense reference can be checked.
"""
import json
import resource
import time

import torch

from solvers import RBF, KernelRidge

torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
n = 100_000
X = torch.randn(n, 8, generator=gen, dtype=torch.float64)
Y = torch.stack([torch.sin(X[:, 0]) + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64), torch.cos(X[:, 1])], 1)
Xq = torch.randn(128, 8, generator=gen, dtype=torch.float64)
with open("/proc/self/statm") as fh:
    before = int(fh.read().split()[1]) * 4096
start = time.perf_counter()
model = KernelRidge(RBF(1 / 8), alpha=0.5, source="streamed", rtol=1e-7, atol=1e-9).fit(X, Y)
prediction = model.predict(Xq)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
info = model.info_
print(json.dumps({
    "n": n, "d": 8, "seconds": seconds, "iterations": info.iterations, "matvecs": info.matvecs,
    "converged": bool(info.converged), "reason": info.reason,
    "relative_residuals": (info.residuals / Y.norm(dim=0)).tolist(),
    "peak_rss_growth_mib": (peak - before) / 2**20, "threads": torch.get_num_threads(),
}))
