"""Forward (or other modes') calls of some ops, for a profiler such as Nsight Compute to
attach to: two calls of each, through `benchmarks/ops.py`'s jitted functions and inputs.

    ncu --clock-control none --kernel-name regex:cuda_kernel_forward \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats python benchmarks/ncu_ops.py --dtype float32 --ops sum,rms_norm
"""

import argparse

import jax
import ops as bench

from segcli import ops
from segcli.registry import OPS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ops", default="sum,rms_norm,max_norm,dot")
    parser.add_argument("--layout", choices=bench.LAYOUTS, default="segments")
    parser.add_argument("--modes", default="fwd")
    args = parser.parse_args()
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    rng, idx, m, v = bench.inputs(args.atoms, args.dtype)
    offsets = bench.offsets_of(idx, m)
    for name in args.ops.split(","):
        op = OPS[name]
        call_args = bench.call_arguments(op, rng, idx, m, v, offsets, args.dtype)
        functions = bench.functions(ops, op, m, args.layout)
        for mode in args.modes.split(","):
            for _ in range(2):
                jax.block_until_ready(functions[mode](*call_args))


if __name__ == "__main__":
    main()
