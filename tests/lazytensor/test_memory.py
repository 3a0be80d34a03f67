"""No hidden N x M allocation: peak RSS growth at sizes where N x M would show.

Each case runs in a fresh subprocess: it warms up on a small problem with the
same tile shapes (imports, allocator, compiled kernels), then measures the
peak RSS growth of one call at full size.
"""
import json
import subprocess
import sys
import textwrap

import pytest

CASES = {
    # name: (setup, small call, full call, expected shape, limit MiB, dense MiB)
    "rbf-product": (
        "x, y, b = torch.randn(20000, 3), torch.randn(20000, 3), torch.randn(20000, 4)\n"
        "f = lambda n: ((-lt.Pm(0.5) * lt.Vi(x[:n]).sqdist(lt.Vj(y[:n]))).exp() * lt.Vj(b[:n])).sum(1, backend='eager')",
        "f(64)", "f(20000)", [20000, 4], 300, 1526,
    ),
    "distance-quantile": (
        "x, y = torch.randn(20000, 3), torch.randn(20000, 3)\n"
        "f = lambda n: lt.distance_quantile(x[:n], y[:n], 0.5, backend='compiled')",
        "f(4096)", "f(20000)", [20000], 400, 1526,
    ),
    "attention": (
        "q, k, v = (torch.randn(1, 4, 8192, 64) for _ in range(3))\n"
        "f = lambda n: lt.attention(q[:, :, :n], k[:, :, :n], v[:, :, :n])",
        "f(1024)", "f(8192)", [1, 4, 8192, 64], 400, 1024,
    ),
}

SCRIPT = """
import json, resource, torch
import lazytensor as lt
torch.manual_seed(0)
torch.set_num_threads(1)
{setup}
{small}
with open("/proc/self/statm") as fh:
    before = int(fh.read().split()[1]) * 4096
out = {full}
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"growth": peak - before, "shape": list(out.shape), "finite": bool(torch.isfinite(out).all())}}))
"""


@pytest.mark.memory
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_peak_rss_growth_is_far_below_the_dense_intermediate(name):
    setup, small, full, shape, limit, dense = CASES[name]
    script = SCRIPT.format(setup=setup, small=small, full=full)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == shape and result["finite"]
    growth = result["growth"] / 2**20
    assert growth < limit, f"{name}: peak RSS grew by {growth:.0f} MiB (limit {limit}; the dense intermediate is {dense} MiB)"
