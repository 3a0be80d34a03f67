"""No hidden N x M allocation: peak RSS growth at a size where N x M would show."""
import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    import lazytensor as lt
    torch.manual_seed(0)
    n = m = 20000
    x, y, b = torch.randn(n, 3), torch.randn(m, 3), torch.randn(m, 4)
    f = (-lt.Pm(0.5) * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)
    small = (-lt.Pm(0.5) * lt.Vi(x[:64]).sqdist(lt.Vj(y[:64]))).exp() * lt.Vj(b[:64])
    small.sum(1, backend="eager")  # warm up allocator and imports
    with open("/proc/self/statm") as fh:
        before = int(fh.read().split()[1]) * 4096
    out = f.sum(1, backend="eager")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth": peak - before, "shape": list(out.shape), "finite": bool(torch.isfinite(out).all())}))
    """
)


@pytest.mark.memory
def test_rbf_product_20000_peak_rss_under_300mb():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == [20000, 4] and result["finite"]
    assert result["growth"] < 300 * 2**20, f"peak RSS grew by {result['growth'] / 2**20:.0f} MiB (dense kernel: 1526 MiB)"
