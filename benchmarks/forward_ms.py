"""Milliseconds of one jitted forward call of segcli.ops ops on this machine's default device,
given a Segments of equal structures: the median of --repeats calls, each waited for.

    python benchmarks/forward_ms.py --atoms 2097152 --ops max,min,max_norm,logsumexp
"""

import argparse
import statistics
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

from segcli import ops  # noqa: E402  (after float64 is enabled)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=2_097_152)
    parser.add_argument("--per-structure", type=int, default=32)
    parser.add_argument("--ops", default="max,min,max_norm,logsumexp")
    parser.add_argument("--dtype", default="float64,float32")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    m = args.atoms // args.per_structure
    seg = ops.segments(np.full(m, args.per_structure))
    rng = np.random.default_rng(0)
    print("| op | dtype | ms |\n| --- | --- | ---: |")
    for dtype in args.dtype.split(","):
        x = jax.numpy.asarray(rng.normal(size=(m * args.per_structure, 3)).astype(dtype))
        for name in args.ops.split(","):
            op = getattr(ops, "segmented_" + name)
            f = jax.jit(lambda a, ids, offsets, op=op: op(a, ops.Segments(ids, offsets), m))
            f(x, seg.ids, seg.offsets).block_until_ready()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                f(x, seg.ids, seg.offsets).block_until_ready()
                times.append(time.perf_counter() - start)
            print(f"| {name} | {dtype} | {statistics.median(times) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
