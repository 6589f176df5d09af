"""Where an op's time goes on a GPU: wall time and each device kernel's time, from JAX's profiler.

    python benchmarks/profile_ops.py --atoms 10000000 --dtype float32 --ops sum,mul \\
        --logdir /tmp/prof [--modes fwd,grad,grad2] [--layout segments]

For each op, mode (`--modes`, of fwd, grad and grad2) and implementation (segcli, jax) of
`benchmarks/ops.py`, with the segments given as its `--layout` says: the median latency and
throughput time per call as `benchmarks/ops.py` measures them, then the kernels that 3
profiled calls ran, with each kernel's median duration and how many times a call launched it,
and for a traced burst of `ops.BURST` calls back to back: the host's time to issue a call, the
GPU's span per call (first kernel's start to last kernel's end, over the calls) and the share
of that span its kernels kept the GPU busy (where it is well below 1 and the issue time is
near the span, the host bounds the throughput).
"""

import argparse
import collections
import glob
import os
import statistics
import time

import jax
import ops as bench
from jax.profiler import ProfileData

from segcli.registry import OPS


def gpu_events(logdir):
    """(name, start ns, duration ns) of every event on the GPU planes of the trace in logdir."""
    trace = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0]
    return [(event.name, event.start_ns, event.duration_ns)
            for plane in ProfileData.from_file(trace).planes
            if plane.name.startswith("/device:GPU")
            for line in plane.lines for event in line.events]


def kernel_times(logdir):
    """(name -> durations in µs) of every event on the GPU planes of the trace in logdir."""
    times = collections.defaultdict(list)
    for name, _, duration in gpu_events(logdir):
        times[name].append(duration / 1e3)
    return times


def burst_timeline(fn, call_args, logdir):
    """(µs to issue a call, GPU span per call, busy share of it) over a traced burst."""
    jax.block_until_ready(fn(*call_args))
    with jax.profiler.trace(logdir):
        start = time.perf_counter()
        outputs = [fn(*call_args) for _ in range(bench.BURST)]
        issued = time.perf_counter() - start
        jax.block_until_ready(outputs)
    events = gpu_events(logdir)
    if not events:  # (no GPU)
        return issued / bench.BURST * 1e6, float("nan"), float("nan")
    begin = min(at for _, at, _ in events)
    end = max(at + duration for _, at, duration in events)
    busy = sum(duration for _, _, duration in events)
    return issued / bench.BURST * 1e6, (end - begin) / bench.BURST / 1e3, busy / (end - begin)


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
            call_args = bench.call_arguments(op, rng, idx, m, v, bench.offsets_of(idx, m), dtype)
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
                    issue, span, share = burst_timeline(fn, call_args, logdir + "-burst")
                    print(f"    burst of {bench.BURST}: {issue:.0f} µs to issue a call, GPU span "
                          f"{span:.0f} µs a call, {share:.0%} of it busy")
                    for kernel, t in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
                        print(f"    {len(t) / 3:4.1f}× {statistics.median(t):7.1f} µs  "
                              f"{kernel[:100]}")


if __name__ == "__main__":
    main()
