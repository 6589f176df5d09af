"""The two ways to compute a segment layout (CSR offsets of sorted ids), timed in turns in one
process: a binary search per segment (the GPU kernel) and a thread per 4 ids writing the
offsets at their boundaries (the CPU kernel).

    python benchmarks/layout.py [--atoms 2097152]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from segcli.ops.kernels import LAYOUT, launch, pick


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=1 << 21)
    args = parser.parse_args()
    sizes = np.random.default_rng(0).integers(1, 64, args.atoms // 16)
    sizes = sizes[:np.searchsorted(np.cumsum(sizes), args.atoms)]
    m = len(sizes)
    idx = np.full(args.atoms, m, np.int32)  # padding rows, as the engine pads a chunk
    idx[:sizes.sum()] = np.repeat(np.arange(m, dtype=np.int32), sizes)
    idx = jnp.asarray(idx)
    by_search, by_runs = (pick(LAYOUT, "offsets", device=device) for device in ("gpu", "cpu"))
    ways = {"binary search per segment":
                jax.jit(lambda i: launch(by_search, i, dims=(m + 1,), out=(m + 1,))),
            "a thread per 4 ids": jax.jit(lambda i: launch(
                by_runs, i, dims=(-(-i.shape[0] // 4),), out=(m + 1,)))}
    results = [np.asarray(f(idx)) for f in ways.values()]
    assert all((r == results[0]).all() for r in results)
    times = {name: [] for name in ways}
    for _ in range(30):
        for name, f in ways.items():
            start = time.perf_counter()
            jax.block_until_ready(f(idx))
            times[name].append(time.perf_counter() - start)
    print(f"{jax.devices()[0]}, N = {args.atoms}, M = {m}: " + ", ".join(
        f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items()))


if __name__ == "__main__":
    main()
