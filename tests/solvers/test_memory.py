"""A streamed ridge fit at n = 8192 grows peak RSS by a small fraction of its 512 MiB kernel matrix.

The kernel would be 8192^2 float64 entries (512 MiB): a hidden n x n allocation would show. The
n = 100,000 run (80 GB kernel) is benchmarks/ridge_100k.py.
"""
import pytest

from harness.method import peak_rss_growths_in_subprocess


@pytest.mark.memory
@pytest.mark.slow  # a child process and ~10 passes over 67M kernel entries
def test_streamed_ridge_fit_stays_far_below_the_kernel_size():
    cfg = dict(case="ridge", device="cpu", dtype="float64", n=8192, m=None, d=8, queries=128, targets=2,
               gamma=1 / 8, regularization=0.5, classes=4, components=2, search_width=10, rank=512,
               preconditioner="nystrom", rtol=1e-3, atol=0.0, chunk_size=None, tile_dtype="float32", backward=False,
               seed=0)
    [growth] = peak_rss_growths_in_subprocess("harness.ml:memory_workload", [{"cfg": cfg, "source": "streamed"}],
                                              threads=1, warmup=True, timeout=600)
    assert growth < 64 << 20, f"peak RSS grew by {growth / 2**20:.0f} MiB (the kernel is 512 MiB)"
    assert growth > 8 << 20  # the rank-512 float32 Nystrom factor alone is 16 MiB: the measurement sees allocations
