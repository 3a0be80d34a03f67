"""Simulated scale-out of a sharded ridge fit: per CG iteration, compute and communication per rank.

    python benchmarks/scale_model.py [--pair-rate 5.6e8] [--bandwidth 10e9] [--latency 50e-6] [--targets 1]

One iteration of ``KernelRidge(source="sharded")`` evaluates the kernel on this
rank's n/P rows against all n points (n^2/P pairs) and all-gathers the n x c
product (each rank receives (P - 1)/P of it, 8 bytes per float64 number), in
log2(P) latency steps. ``--pair-rate`` is one core's kernel pairs per second
(default: measured here, float32 tiles summed in float64, d = 8, c = 2,
``exp(-g |x - y|^2) @ b`` at n = 8192: 0.12 s per pass); ``--bandwidth`` the
network's bytes per second per rank. What is *not* split: the Nystrom
preconditioner (rank r = min(2048, 8 sqrt(n))) is built and applied on every
rank, ``--flop-rate`` flops per second: its set-up (randomly pivoted Cholesky,
~n r^2) and its application (~4 n r per iteration). Prints a markdown table.
"""
import math

from common import arguments, parse


def main():
    p = arguments(__doc__, threads=None)
    p.add_argument("--pair-rate", type=float, default=5.6e8)
    p.add_argument("--bandwidth", type=float, default=10e9)
    p.add_argument("--latency", type=float, default=50e-6)
    p.add_argument("--targets", type=int, default=1)
    p.add_argument("--flop-rate", type=float, default=2e10)
    args = parse(p)
    print("| n | ranks P | pairs per rank | kernel s | received per rank | communication s | preconditioner s "
          "(replicated) | set-up s (replicated, once) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in (10**5, 10**6, 10**7):
        for ranks in (2, 8, 64, 512):
            pairs = n * n / ranks
            compute = pairs / args.pair_rate
            received = (ranks - 1) / ranks * n * args.targets * 8
            comm = received / args.bandwidth + math.ceil(math.log2(ranks)) * args.latency
            rank = min(2048, 8 * math.sqrt(n))
            apply, setup = 4 * n * rank / args.flop_rate, n * rank**2 / args.flop_rate
            print(f"| {n:.0e} | {ranks} | {pairs:.1e} | {compute:.3g} | {received / 2**20:.3g} MiB | {comm:.2g} | "
                  f"{apply:.2g} | {setup:.3g} |")


if __name__ == "__main__":
    main()
