"""What a launch costs at small N: k segcli sums in one jitted program against k
`jax.ops.segment_sum` calls, k = 1, 2, 4, 8, beside a jitted `x * 2` (a call with one XLA
kernel); latency and throughput as `benchmarks/ops.py` measures them. Each sum reads x
scaled by its own factor, so that XLA cannot merge them.

    python benchmarks/launch_cost.py [--atoms 10000] [--repeats 30]
"""

import argparse

import jax
from ops import inputs, median_seconds, offsets_of

from segcli import ops


def chained(k, m, segcli):
    """A jitted Σ_{j < k} sum((1 + j) · x) over the segments, by segcli or by pure JAX."""

    def total(x, idx, offsets):
        segments = ops.Segments(idx, offsets)
        out = 0
        for j in range(k):
            y = x * (1.0 + j)
            out = out + (ops.segmented_sum(y, segments, m) if segcli else
                         jax.ops.segment_sum(y, idx, m, indices_are_sorted=True))
        return out

    return jax.jit(total)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    _, idx, m, x = inputs(args.atoms, "float32")
    offsets = offsets_of(idx, m)
    fns = {"x * 2": jax.jit(lambda x, idx, offsets: x * 2)}
    for k in (1, 2, 4, 8):
        fns[f"segcli × {k}"] = chained(k, m, True)
        fns[f"pure JAX × {k}"] = chained(k, m, False)
    print(f"{jax.devices()[0]}, N = {args.atoms}, float32; µs a call\n")
    print("| program | latency | throughput |\n| --- | ---: | ---: |")
    for name, (latency, throughput) in median_seconds(fns, (x, idx, offsets),
                                                      args.repeats).items():
        print(f"| {name} | {latency * 1e6:.1f} | {throughput * 1e6:.1f} |")


if __name__ == "__main__":
    main()
