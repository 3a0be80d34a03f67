"""No hidden N x M allocation: peak RSS growth at sizes where N x M would show.

Measured with the harness's mechanism (``peak_rss_growths_in_subprocess``): a
fresh process builds the inputs, runs the call once (imports, allocator,
compiled kernels), resets the kernel's peak-RSS counter and reports the growth
of a second call above the RSS just before it.
"""
import pytest
import torch

import lazytensor as lt
from harness.method import peak_rss_growths_in_subprocess

# name: (expected shape, limit MiB, the dense intermediate in MiB)
CASES = {
    "rbf-product": ((20000, 4), 300, 1526),
    "distance-quantile": ((20000,), 400, 1526),
    "attention": ((1, 4, 8192, 64), 400, 1024),
}


def workload(name: str):
    """The child's set-up (inputs count as baseline); returns the measured call."""
    torch.manual_seed(0)
    if name == "rbf-product":
        x, y, b = torch.randn(20000, 3), torch.randn(20000, 3), torch.randn(20000, 4)
        return lambda: _checked(name, ((-lt.Pm(0.5) * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)).sum(1, backend="eager"))
    if name == "distance-quantile":
        x, y = torch.randn(20000, 3), torch.randn(20000, 3)
        return lambda: _checked(name, lt.distance_quantile(x, y, 0.5, backend="compiled"))
    q, k, v = (torch.randn(1, 4, 8192, 64) for _ in range(3))
    return lambda: _checked(name, lt.attention(q, k, v))


def _checked(name, out):
    """A wrong or non-finite result fails the child (and so the test) instead of being measured."""
    if tuple(out.shape) != CASES[name][0] or not bool(torch.isfinite(out).all()):
        raise AssertionError(f"{name}: got shape {tuple(out.shape)}, finite={bool(torch.isfinite(out).all())}")


@pytest.mark.memory
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_peak_rss_growth_is_far_below_the_dense_intermediate(name):
    _, limit, dense = CASES[name]
    [growth] = peak_rss_growths_in_subprocess(f"{__name__}:workload", [{"name": name}], threads=1, timeout=600)
    growth /= 2**20
    assert growth < limit, f"{name}: peak RSS grew by {growth:.0f} MiB (limit {limit}; the dense intermediate is {dense} MiB)"
