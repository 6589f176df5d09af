"""Where an op's time goes on a GPU: wall time and each device kernel's time, from JAX's profiler.

    python benchmarks/profile_ops.py --atoms 10000000 --dtype float32 --ops sum,mul \\
        --logdir /tmp/prof [--modes fwd,grad,grad2] [--layout segments]

For each op, mode (`--modes`, of fwd, grad and grad2) and implementation (segcli, jax) of
`benchmarks/ops.py`, with the segments given as its `--layout` says: the median latency and
throughput time per call as `benchmarks/ops.py` measures them, then the kernels that 3
profiled calls ran, with each kernel's median duration and how many times a call launched it.
"""

import argparse
import collections
import glob
import os
import statistics

import jax
import ops as bench
from jax.profiler import ProfileData

from segcli.registry import OPS


def kernel_times(logdir):
    """(name -> durations in µs) of every event on the GPU planes of the trace in logdir."""
    times = collections.defaultdict(list)
    trace = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0]
    for plane in ProfileData.from_file(trace).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                for event in line.events:
                    times[event.name].append(event.duration_ns / 1e3)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ops", default="sum,mul")
    parser.add_argument("--layout", choices=bench.LAYOUTS, default="ids")
    parser.add_argument("--modes", default="fwd,grad", help="comma-separated modes")
    parser.add_argument("--logdir", required=True)
    args = parser.parse_args()
    impls = {k: v for k, v in bench.implementations().items() if k in ("segcli", "jax")}
    for dtype in args.dtype.split(","):
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        rng, idx, m, v = bench.inputs(args.atoms, dtype)
        for op_name in args.ops.split(","):
            op = OPS[op_name]
            data = bench.arguments(op, rng, args.atoms, m, dtype)
            call_args = (bench.loss_weights(op, data, idx, m, dtype), v, *data, idx,
                         bench.offsets_of(idx, m))
            for name, module in impls.items():
                for mode, fn in bench.functions(module, op, m, args.layout).items():
                    if mode not in args.modes.split(","):
                        continue
                    latency, throughput = bench.median_seconds({name: fn}, call_args, 10)[name]
                    logdir = os.path.join(args.logdir, f"{dtype}-{op_name}-{mode}-{name}")
                    with jax.profiler.trace(logdir):
                        for _ in range(3):
                            jax.block_until_ready(fn(*call_args))
                    kernels = kernel_times(logdir)
                    busy = sum(sum(t) for t in kernels.values()) / 3
                    print(f"{dtype} {op_name} {mode} {name}: latency {latency * 1e6:.0f} µs, "
                          f"throughput {throughput * 1e6:.0f} µs, kernels {busy:.0f} µs per call")
                    for kernel, t in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
                        print(f"    {len(t) / 3:4.1f}× {statistics.median(t):7.1f} µs  "
                              f"{kernel[:100]}")


if __name__ == "__main__":
    main()
