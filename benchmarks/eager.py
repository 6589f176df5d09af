"""Eager (not jitted) calls of every segcli.ops function: the first call of a shape, which
compiles, and the median of the calls after it, which reuse the compiled program.

    python benchmarks/eager.py [--atoms 1000] [--calls 50] [--dtype float64,float32]

Every op of segcli.registry.OPS on the inputs benchmarks/ops.py makes from its argument data
((N, 3) per-atom fields, per-structure ones of their own shape, labels), N atoms in structures
of 1..63 atoms, given sorted int32 ids and given their Segments; `segmented_reductions` of all
its reductions; and the helpers `segment_ids`, `segments`, `segments_of_offsets` and
`check_segments` on the structures' sizes. Prints a Markdown table: milliseconds per call,
with block_until_ready after each; the calls after the first are made in turns, one of each
function per turn.
"""

import argparse
import statistics
import time

import jax
import numpy as np
from ops import arguments, inputs

from segcli.registry import OPS


def calls(n, dtype):
    """(name, thunk) of one eager call of each function, its inputs made once; and the number
    of structures."""
    from segcli import ops

    rng, idx, m, _ = inputs(n, dtype)
    sizes = np.bincount(np.asarray(idx), minlength=m)
    seg = ops.segments(sizes)
    thunks = [("segment_ids", lambda: ops.segment_ids(sizes)),
              ("segments", lambda: ops.segments(sizes)),
              ("segments_of_offsets", lambda: ops.segments_of_offsets(seg.offsets, n)),
              ("check_segments", lambda: ops.check_segments(idx, m))]
    for op in OPS.values():
        args = arguments(op, rng, n, m, dtype)
        for layout, ids in (("", idx), (" (Segments)", seg)):
            thunks.append((f"segmented_{op.name}{layout}", lambda op=op, args=args, ids=ids:
                           op.function(*args, ids, m, **op.params)))
    x = arguments(OPS["sum"], rng, n, m, dtype)[0]
    thunks.append(("segmented_reductions (all four)",
                   lambda: ops.segmented_reductions(x, idx, m, ops.REDUCTIONS)))
    return thunks, m


def timed(thunk):
    start = time.perf_counter()
    jax.block_until_ready(thunk())
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--dtype", default="float64,float32", help="comma-separated")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    dtypes = args.dtype.split(",")
    columns = {dtype: calls(args.atoms, dtype) for dtype in dtypes}
    m = next(iter(columns.values()))[1]
    print(f"{args.atoms} atoms, {m} structures, {jax.devices()[0].platform}, milliseconds: "
          f"the first call, and the median of {args.calls} calls after it\n")
    print("| function | " + " | ".join(f"{d} first | {d} later" for d in dtypes) + " |")
    print("| --- |" + " --- | --- |" * len(dtypes))
    cells = {}
    for thunks, _ in columns.values():
        firsts = [timed(thunk) for _, thunk in thunks]
        # the later calls in turns, one of each function per turn: a busy spell of the machine
        # slows them all alike
        turns = [[timed(thunk) for _, thunk in thunks] for _ in range(args.calls)]
        for (name, _), first, later in zip(thunks, firsts, zip(*turns)):
            cells.setdefault(name, []).append(
                f"{first * 1e3:.1f} | {statistics.median(later) * 1e3:.3f}")
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
