"""Reductions of one chunk on a CPU, as `segcli reduce` computes them: jitted ops over 2 Mi rows
of (N, 3) float64 in segments of 1-63 rows, given a Segments; each op alone, the gradients of
sum and mean (`segcli grad`), matvec and its gradient (beside XLA's `x * 2` over the same
rows), rms_norm + max_norm + mean as three ops in one program, and the same (and all four)
by segmented_reductions, beside NumPy's sum over the same bytes (what one core takes to read
them). Cases run in turns, each round once; the median of the rounds.
Freed blocks are kept for reuse, as in the segcli program.

    taskset -c 0 python benchmarks/reductions_cpu.py [--rows 2097152] [--rounds 21]

Run with PYTHONPATH set to another checkout to time its ops (cases it lacks are left out).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

from segcli import keep_freed_buffers, ops  # noqa: E402  (after x64 is on)

THREE = ("rms_norm", "max_norm", "mean")


def cases(seg, m):
    alone = {name: getattr(ops, f"segmented_{name}") for name in ("sum", "mean", "rms_norm",
                                                                    "max_norm")}
    found = {name: lambda x, f=f: f(x, seg, m) for name, f in alone.items()}
    weights = jax.random.normal(jax.random.key(0), (m, 3), jnp.float64)
    for name in ("sum", "mean"):  # their derivatives: each segment's weights to its rows
        found[f"grad {name}"] = lambda x, f=alone[name]: jax.grad(
            lambda a: jnp.sum(weights * f(a, seg, m)))(x)
    cells = jax.random.normal(jax.random.key(1), (m, 3, 3), jnp.float64)
    found["matvec"] = lambda x: ops.segmented_matvec(x, cells, seg, m)
    found["grad matvec"] = jax.grad(lambda a: jnp.sum(ops.segmented_matvec(a, cells, seg, m)))
    found["XLA's x * 2"] = lambda x: x * 2
    found["three, one op each"] = lambda x: tuple(alone[n](x, seg, m) for n in THREE)
    if hasattr(ops, "segmented_reductions"):
        found["three together"] = lambda x: ops.segmented_reductions(x, seg, m, THREE)
        found["all four together"] = lambda x: ops.segmented_reductions(
            x, seg, m, ("sum", "mean", "rms_norm", "max_norm"))
    return {name: jax.jit(f) for name, f in found.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    keep_freed_buffers()  # as the segcli program does
    rng = np.random.default_rng(0)
    n_atoms = rng.integers(1, 64, args.rows)
    n_atoms = n_atoms[np.cumsum(n_atoms) <= args.rows]
    rows = rng.normal(size=(int(n_atoms.sum()), 3))
    x = jax.device_put(rows)
    functions = cases(ops.segments(n_atoms), len(n_atoms))
    functions["NumPy sum of the rows"] = lambda _: rows.sum()
    for f in functions.values():
        jax.block_until_ready(f(x))
    times = {name: [] for name in functions}
    for _ in range(args.rounds):
        for name, f in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times[name].append(time.perf_counter() - start)
    print(f"{len(rows)} rows of 3 float64 in {len(n_atoms)} segments, median of {args.rounds} "
          "rounds, ms\n\n| case | ms |\n| --- | ---: |")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
