"""No hidden N x M allocation: peak RSS growth at sizes where N x M would show.

Measured with the harness's mechanism (``peak_rss_growths_in_subprocess``): a
fresh process builds the inputs, runs the call once (imports, allocator,
compiled kernels), then reports the worst growth of two more calls above the
RSS just before each (the peak-RSS counter reset before each call). Every
reduction kind's working set, int64 intermediates included, stays within a
small multiple of the ~1 MiB tile budget: under 60 MiB where the dense
N x M intermediate is 275 MiB (N, M = 12000, 6000; the suite's time is
proportional to N x M).
"""
import pytest
import torch

import lazytensor as lt
from harness.method import peak_rss_growths_in_subprocess

# name: (expected shape, limit MiB, the dense intermediate in MiB)
N, M = 12000, 6000
CASES = {
    "rbf-product": ((N, 4), 60, 275),
    "rbf-product-backward": ((N, 3), 60, 550),
    "logsumexp": ((N, 1), 60, 275),
    "kmin": ((N, 8), 60, 275),
    "distance-quantile": ((N,), 60, 275),
    "attention": ((1, 4, 4096, 64), 60, 256),
}


def workload(name: str):
    """The child's set-up (inputs count as baseline); returns the measured call."""
    torch.manual_seed(0)
    if name == "rbf-product":
        x, y, b = torch.randn(N, 3), torch.randn(M, 3), torch.randn(M, 4)
        return lambda: _checked(name, ((-lt.Pm(0.5) * lt.Vi(x).sqdist(lt.Vj(y))).exp() * lt.Vj(b)).sum(1, backend="eager"))
    if name == "rbf-product-backward":
        x, y, b = torch.randn(N, 3, requires_grad=True), torch.randn(M, 3), torch.randn(M, 4)
        return lambda: _checked(name, torch.autograd.grad(lt.rbf_matmul(x, y, b, 0.5, backend="compiled").sum(), x)[0])
    if name == "logsumexp":
        x, y = torch.randn(N, 3), torch.randn(M, 3)
        return lambda: _checked(name, (-lt.Vi(x).sqdist(lt.Vj(y))).logsumexp(1, backend="compiled"))
    if name == "kmin":
        x, y = torch.randn(N, 3), torch.randn(M, 3)
        return lambda: _checked(name, lt.Vi(x).sqdist(lt.Vj(y)).kmin(8, 1, backend="compiled"))
    if name == "distance-quantile":
        x, y = torch.randn(N, 3), torch.randn(M, 3)
        return lambda: _checked(name, lt.distance_quantile(x, y, 0.5, backend="compiled"))
    q, k, v = (torch.randn(1, 4, 4096, 64) for _ in range(3))
    return lambda: _checked(name, lt.attention(q, k, v))


def _checked(name, out):
    """A wrong or non-finite result fails the child (and so the test) instead of being measured."""
    if tuple(out.shape) != CASES[name][0] or not bool(torch.isfinite(out).all()):
        raise AssertionError(f"{name}: got shape {tuple(out.shape)}, finite={bool(torch.isfinite(out).all())}")


@pytest.mark.memory
@pytest.mark.slow
def test_peak_rss_growth_is_far_below_the_dense_intermediate():
    names = sorted(CASES)  # one child process for all: importing torch dominates a child's cost
    growths = peak_rss_growths_in_subprocess(f"{__name__}:workload", [{"name": n} for n in names], threads=1, calls=2,
                                             timeout=900)
    report = {n: g / 2**20 for n, g in zip(names, growths)}
    over = {n: f"{g:.0f} MiB (limit {CASES[n][1]}, dense {CASES[n][2]})" for n, g in report.items() if g >= CASES[n][1]}
    assert not over, f"peak RSS growth above the limit: {over}"



def test_cpu_passes_keep_freed_tile_buffers_in_the_process(monkeypatch):
    """Every CPU pass applies ``lazytensor.allocator``'s setting: on by default (glibc only), off when
    ``LAZYTENSOR_KEEP_MALLOC=0`` or the environment sets glibc's thresholds itself."""
    import os
    import platform
    import subprocess
    import sys

    from lazytensor import allocator

    calls = []
    monkeypatch.setattr(allocator, "keep_tile_buffers", lambda: calls.append(1))
    lt.Vi(torch.randn(5, 2)).sqdist(lt.Vj(torch.randn(4, 2))).sum(1, backend="eager")
    assert calls == [1]
    probe = "from lazytensor import allocator; print(allocator.keep_tile_buffers())"
    glibc = str(platform.libc_ver()[0] == "glibc")
    stated = ({"LAZYTENSOR_KEEP_MALLOC": "1"}, glibc), ({"LAZYTENSOR_KEEP_MALLOC": "0"}, "False"), ({}, glibc), \
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "False"), ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "False")
    for setting, expected in stated:
        ours = ("LAZYTENSOR_KEEP_MALLOC", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
        env = {k: v for k, v in os.environ.items() if k not in ours}
        env.update(setting)
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
        assert out.strip() == expected
