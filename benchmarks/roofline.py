"""How close the RBF product gets to this CPU's limits: its time against sgemm and exp throughput.

The product out = exp(-g |x_i - y_j|^2) @ b costs, per pair (i, j), one
exponential and 2 C flops for the value product (plus ~3 D flops for the
distance, which a fused tile hides behind the exponential). This script
measures, in one process and with the same threads:

- sgemm throughput (GFLOP/s of a large float32 matrix product),
- exp throughput (float32 exponentials per second, in place on a 1 MiB array),
- the streamed RBF product (``lt.rbf_matmul``, compiled, after a warm-up),

and prints the lower bound N M (1 / exp_rate + 2 C / sgemm_rate) with the
fraction of it the streamed product achieves. Usage:

    python benchmarks/roofline.py [--n 16384] [--d 3] [--channels 16] [--threads 2]
"""

import torch
from common import arguments, call_times, parse

import lazytensor as lt


def best_of(fn, repeats=5):
    return min(call_times(fn, repeats))


def main():
    p = arguments(__doc__)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", type=int, default=3)
    p.add_argument("--channels", type=int, default=16)
    args = parse(p)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    sgemm = 2 * 2048**3 / best_of(lambda: torch.mm(a, b))
    z = torch.randn(1 << 18)  # 1 MiB: cache-resident, as a tile is
    exp_rate = z.numel() * 64 / best_of(lambda: [z.clamp_(-10, 10).exp_() for _ in range(64)])
    x, y = torch.randn(args.n, args.d), torch.randn(args.n, args.d)
    values = torch.randn(args.n, args.channels)
    streamed = best_of(lambda: lt.rbf_matmul(x, y, values, 0.5, backend="compiled"), repeats=3)
    pairs = args.n * args.n
    bound_exp, bound_gemm = pairs / exp_rate, pairs * 2 * args.channels / sgemm
    print(f"threads {args.threads}: sgemm {sgemm / 1e9:.1f} GFLOP/s, exp {exp_rate / 1e9:.2f} G/s")
    print(f"RBF product N = M = {args.n}, D = {args.d}, C = {args.channels}: streamed {streamed:.3f} s")
    print(f"lower bound: exp {bound_exp:.3f} s + product {bound_gemm:.3f} s = {bound_exp + bound_gemm:.3f} s; "
          f"achieved {100 * (bound_exp + bound_gemm) / streamed:.0f}% of it")


if __name__ == "__main__":
    main()
