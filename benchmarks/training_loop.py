"""segcli.ops against pure JAX at training-batch sizes, called as a training loop calls them.

    python benchmarks/training_loop.py --atoms 10000,100000 --ops sum,rms_norm,var,softmax

For each op, mode (fwd, grad, grad2, as `benchmarks/ops.py` builds them, `--dtype`, ids given as
a `Segments`) and N, the time per call of 20 calls back to back with one synchronisation, two
ways, segcli and pure JAX in turns (median of `--rounds`, after as many unmeasured; see
`benchmarks/ops.py`'s `median_seconds`):
  kept     every call's result held until the end (`benchmarks/ops.py`'s throughput): each call
           writes into new buffers;
  dropped  each result dropped as the next call starts, as a training step's are: XLA reuses
           the same buffers, and a CUDA graph it recorded (an FFI call in it by tracing) is
           replayed from its cache.
"""

import argparse

import jax
import ops as bench

from segcli.registry import OPS


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", default="10000,100000", help="comma-separated N")
    parser.add_argument("--ops", default="sum,rms_norm,var,softmax")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args()
    print(jax.devices()[0].device_kind)
    impls = bench.implementations(("jax",))
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    print("| N | op | mode | kept: segcli µs | jax µs | jax / segcli | dropped: segcli µs | jax µs "
          "| jax / segcli |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in map(int, args.atoms.split(",")):
        rng, idx, m, v = bench.inputs(n, args.dtype)
        for name in args.ops.split(","):
            op = OPS[name]
            call_args = bench.call_arguments(op, rng, idx, m, v, bench.offsets_of(idx, m),
                                             args.dtype)
            modes = {impl: bench.functions(module, op, m, "segments")
                     for impl, module in impls.items()}
            for mode in [mode for mode in modes["segcli"] if mode in modes["jax"]]:
                t = bench.median_seconds({impl: fns[mode] for impl, fns in modes.items()},
                                         call_args, args.rounds, dropped=True)
                (_, sk, sd), (_, jk, jd) = t["segcli"], t["jax"]
                print(f"| {n} | {name} | {mode} | {sk * 1e6:.0f} | {jk * 1e6:.0f} | {jk / sk:.2f} "
                      f"| {sd * 1e6:.0f} | {jd * 1e6:.0f} | {jd / sd:.2f} |", flush=True)


if __name__ == "__main__":
    main()
