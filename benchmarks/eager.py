"""Eager (not jitted) calls of every segcli.ops function: the first call of a shape, which
compiles, and the median of the calls after it, which reuse the compiled program.

    python benchmarks/eager.py [--atoms 1000] [--calls 50]

Prints a Markdown table: milliseconds per call, with block_until_ready after each.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def calls(n, m):
    """(name, thunk) of one eager call of each function on fresh float64 inputs."""
    from segcli import ops

    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.sort(rng.integers(0, m, n)).astype(np.int32))
    x, y = jnp.asarray(rng.normal(size=(n, 3))), jnp.asarray(rng.normal(size=(n, 3)))
    s, cell = jnp.asarray(rng.normal(size=m)), jnp.asarray(rng.normal(size=(m, 3, 3)))
    return [
        ("segmented_sum", lambda: ops.segmented_sum(x, idx, m)),
        ("segmented_mean", lambda: ops.segmented_mean(x, idx, m)),
        ("segmented_dot", lambda: ops.segmented_dot(x, y, idx, m)),
        ("segmented_mul", lambda: ops.segmented_mul(x, s, idx, m)),
        ("segmented_rms_norm", lambda: ops.segmented_rms_norm(x, idx, m)),
        ("segmented_max_norm", lambda: ops.segmented_max_norm(x, idx, m)),
        ("segmented_matvec", lambda: ops.segmented_matvec(x, cell, idx, m)),
        ("segmented_count", lambda: ops.segmented_count(idx, m)),
    ]


def timed(thunk):
    start = time.perf_counter()
    jax.block_until_ready(thunk())
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    print(f"{args.atoms} atoms, {args.atoms // 10} segments, float64 (N, 3), "
          f"{jax.devices()[0].platform}, median of {args.calls} calls after the first\n")
    print("| function | first call ms | later calls ms |")
    print("| --- | --- | --- |")
    for name, thunk in calls(args.atoms, args.atoms // 10):
        first = timed(thunk)
        later = statistics.median(timed(thunk) for _ in range(args.calls))
        print(f"| {name} | {first * 1e3:.1f} | {later * 1e3:.3f} |")


if __name__ == "__main__":
    main()
