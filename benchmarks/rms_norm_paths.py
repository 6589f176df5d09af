"""float32 rms_norm over a Segments on a GPU by its two paths, side by side in one process: the
sums of squares per feature then the norms (two kernels), and rms_norm_span (one), by N, for
the forward pass, the gradient and the second order (the modes of `benchmarks/ops.py`); the
crossover sets `segcli.ops._primitives.norms.SQUARES_ROWS`.

    python benchmarks/rms_norm_paths.py [--atoms 10000,100000,...] [--repeats 30]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from ops import functions, inputs, median_seconds

from segcli import ops
from segcli.ops import _primitives
from segcli.registry import OPS

PATHS = {"two kernels": 0, "span": 1 << 62}
"""SQUARES_ROWS that sends every input down each path."""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", default="10000,100000,300000,1000000,3000000,10000000")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    print(f"{jax.devices()[0]}; µs a call, latency / throughput (bursts of 20)\n")
    print("| N | mode | two kernels | span | span / two kernels (throughput) |")
    print("| --- | --- | --- | --- | --- |")
    for n in (int(a) for a in args.atoms.split(",")):
        rng, idx, m, v = inputs(n, np.float32)
        x = jnp.asarray(rng.normal(size=(n, 3)).astype(np.float32))
        offsets = jnp.asarray(np.searchsorted(np.asarray(idx), np.arange(m + 1)), jnp.int32)
        w = jnp.asarray(rng.normal(size=m).astype(np.float32))
        call = (w, v, x, idx, offsets)
        compiled = {}
        for path, rows in PATHS.items():  # traced (and compiled) under each threshold
            _primitives.norms.SQUARES_ROWS = rows
            for mode, fn in functions(ops, OPS["rms_norm"], m, "segments").items():
                jax.block_until_ready(fn(*call))
                compiled[mode, path] = fn
        for mode in ("fwd", "grad", "grad2"):
            times = median_seconds({p: compiled[mode, p] for p in PATHS}, call, args.repeats)
            (two, span) = (times[p] for p in PATHS)
            print(f"| {n} | {mode} | {two[0] * 1e6:.0f} / {two[1] * 1e6:.1f} | "
                  f"{span[0] * 1e6:.0f} / {span[1] * 1e6:.1f} | {span[1] / two[1]:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
