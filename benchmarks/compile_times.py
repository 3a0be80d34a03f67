"""Compilation cost of a new formula: cold (empty inductor cache) and warm (cache on disk, fresh process).

    python benchmarks/compile_times.py [--n 4096] [--threads 2]

Each measurement runs in a fresh Python process: the first forward call of
``(-g |x_i - y_j|^2).exp() @ b`` (``backend="compiled"``, N = M = n, D = 3,
C = 16, float32), then its first backward (gradient in x), then a second
call of each (the compiled kernels reused). Run 1 uses an empty
``TORCHINDUCTOR_CACHE_DIR`` (a machine that never compiled); run 2 a fresh
process over the cache run 1 left (warm disk cache); run 3 a fresh process,
same cache, a formula not compiled before (``1 / (1 + |x_i - y_j|^2) @ b``:
a user's next new formula). Prints one JSON line per run.
"""
import json
import os
import subprocess
import sys
import tempfile

from common import arguments, parse

CHILD = r"""
import json, sys, time, torch
import lazytensor as lt
torch.set_num_threads(int(sys.argv[2]))
n, formula = int(sys.argv[1]), sys.argv[3]
gen = torch.Generator().manual_seed(0)
x, y, b = (torch.randn(n, w, generator=gen) for w in (3, 3, 16))
def forward(x):
    d2 = lt.Vi(x).sqdist(lt.Vj(y))
    k = (-0.37 * d2).exp() if formula == "gaussian" else 1 / (1 + d2)
    return (k * lt.Vj(b)).sum(1, backend="compiled")
def timed(fn):
    start = time.perf_counter(); fn(); return time.perf_counter() - start
start = time.perf_counter(); import torch._inductor  # noqa: the import is part of a cold start
xs = x.clone().requires_grad_()
out = {"import_s": time.perf_counter() - start}
out["first_forward_s"] = timed(lambda: forward(x))
out["first_backward_s"] = timed(lambda: forward(xs).sum().backward())
out["second_forward_s"] = timed(lambda: forward(x))
out["second_backward_s"] = timed(lambda: forward(xs).sum().backward())
print(json.dumps(out))
"""


def main():
    p = arguments(__doc__)
    p.add_argument("--n", type=int, default=4096)
    args = parse(p)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label, formula in (("cold", "gaussian"), ("warm", "gaussian"), ("new formula", "cauchy")):
            done = subprocess.run([sys.executable, "-c", CHILD, str(args.n), str(args.threads), formula], env=env,
                                  capture_output=True, text=True, check=True)
            print(json.dumps({"cache": label, **json.loads(done.stdout.strip().splitlines()[-1])}))


if __name__ == "__main__":
    main()
