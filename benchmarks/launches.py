"""Kernel launches (custom calls) and XLA fusions of each compiled program of
`benchmarks/ops.py` (fwd, grad, grad2), segcli beside pure JAX: at small N a call costs about
its launches. On a CPU, `--gpu-paths` compiles segcli's GPU code paths (the launches a GPU
makes; the fusions are the CPU compiler's).

    python benchmarks/launches.py [--ops rms_norm,...] [--atoms 10000] [--gpu-paths]
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
from ops import arguments, functions, inputs, loss_weights

from segcli import ops, reference
from segcli.ops import _primitives
from segcli.registry import OPS


def counts(fn, args):
    """(custom calls, fusions) in the entry computation of fn's compiled program."""
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    return entry.count(" custom-call("), len(re.findall(r"= \S+ fusion\(", entry))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="sum,mean,rms_norm,max_norm,dot,mul,matvec")
    parser.add_argument("--atoms", type=int, default=10_000)
    parser.add_argument("--dtype", default="float32,float64")
    parser.add_argument("--gpu-paths", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    _primitives.lower_cpu_as_gpu(args.gpu_paths)
    print(f"{jax.devices()[0]}{', GPU code paths' if args.gpu_paths else ''}, N = {args.atoms}; "
          "launches + fusions\n")
    print("| op | dtype | mode | segcli, sorted | segcli, Segments | pure JAX |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in args.dtype.split(","):
        rng, idx, m, v = inputs(args.atoms, dtype)
        offsets = jnp.asarray(np.searchsorted(np.asarray(idx), np.arange(m + 1)), jnp.int32)
        for name in args.ops.split(","):
            op = OPS[name]
            call = arguments(op, rng, args.atoms, m, dtype)
            w = loss_weights(op, call, idx, m, dtype)
            full = (w, v, *call, idx, offsets)
            programs = [functions(ops, op, m, "sorted"), functions(ops, op, m, "segments"),
                        functions(reference, op, m, "sorted")]
            for mode in programs[0]:
                cells = [" + ".join(map(str, counts(p[mode], full))) for p in programs]
                print(f"| {name} | {dtype} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
