"""Whether one CPU kernel computing several ops per segment beats one kernel per op: Warp
kernels on the CPU over 2 Mi rows of (N, 1, 3) float64 in segments of 1-63 rows (CSR
offsets given), each thread a segment, built from the @wp.func that segcli's own ordered
kernels use: rms_norm, max_norm's search (the first row of the largest norm) and mean, one
kernel each and all three in one kernel, beside NumPy's sum and dot over the same bytes
(what one core takes to read them).

    taskset -c 0 python benchmarks/fused_cpu.py [--rows 2097152] [--repeats 15]

Prints the median milliseconds of each. (The real max_norm search falls back to its
screened search where a square is not plain or a row is NaN; none is here, so the fallback
is left out.)
"""

import argparse
import statistics
import time
from typing import Any

import numpy as np
import warp as wp

from segcli.ops.kernels import _common, norms, searches


@wp.func
def _segment_rms_norm(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int):
    # sqrt(Σ |x[i, g]|² / n) over rows lo:hi (n > 0), the even and the odd rows summed apart
    # (the CPU's rms_norm kernel before rms_norm_span)
    total = x.dtype(0.0)
    other = x.dtype(0.0)
    i = lo
    while i + 1 < hi:
        total += norms._squared_norm(x, i, g)
        other += norms._squared_norm(x, i + 1, g)
        i += 2
    if i < hi:
        total += norms._squared_norm(x, i, g)
    return norms._rms_of_squares(x, lo, hi, g, total + other)


@wp.func
def _no_fallback(x: wp.array3d(dtype=Any), lo: int, hi: int, g: int):
    return lo


_first_of_largest = searches._largest_square_first(_no_fallback, norms._norm, searches._above)


@wp.func
def _mean3(x: wp.array3d(dtype=wp.float64), lo: int, hi: int, mean: wp.array2d(dtype=wp.float64),
           s: int):
    w = wp.float64(1.0) / wp.float64(hi - lo)
    a = wp.float64(0.0)
    b = wp.float64(0.0)
    c = wp.float64(0.0)
    for i in range(lo, hi):
        a += x[i, 0, 0] * w
        b += x[i, 0, 1] * w
        c += x[i, 0, 2] * w
    mean[s, 0] = a
    mean[s, 1] = b
    mean[s, 2] = c


def segment_kernel(name, rms=False, search=False, average=False):
    """A kernel over segments (a thread each) computing the parts named: rms_norm into out,
    max_norm's search into first, mean into mean."""

    def kernel(x: wp.array3d(dtype=wp.float64), offsets: wp.array(dtype=wp.int32),
               out: wp.array(dtype=wp.float64), first: wp.array(dtype=wp.int32),
               mean: wp.array2d(dtype=wp.float64)):
        s = wp.tid()
        lo, hi = _common._segment_range(offsets, s, x.shape[0])
        if lo < hi:
            if wp.static(rms):
                out[s] = _segment_rms_norm(x, lo, hi, 0)
            if wp.static(search):
                first[s] = _first_of_largest(x, lo, hi, 0)
            if wp.static(average):
                _mean3(x, lo, hi, mean, s)

    kernel.__name__ = kernel.__qualname__ = name
    return wp.kernel(kernel)


KERNELS = [segment_kernel("rms_norm", rms=True), segment_kernel("max_norm", search=True),
           segment_kernel("mean", average=True),
           segment_kernel("all_three", rms=True, search=True, average=True)]


def median_ms(call, repeats):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 64, args.rows // 16)
    sizes = sizes[:np.searchsorted(np.cumsum(sizes), args.rows)]
    sizes = np.append(sizes, args.rows - sizes.sum())
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    x = rng.normal(size=(args.rows, 1, 3))
    m = len(sizes)
    arrays = [wp.array(x, dtype=wp.float64, device="cpu"), wp.array(offsets, device="cpu"),
              wp.zeros(m, dtype=wp.float64, device="cpu"),
              wp.zeros(m, dtype=wp.int32, device="cpu"),
              wp.zeros((m, 3), dtype=wp.float64, device="cpu")]
    flat = x.reshape(-1)
    print(f"{args.rows} rows of 3 float64 ({x.nbytes / 2**20:.0f} MiB), {m} segments; median "
          f"ms of {args.repeats}\n\n| kernel | ms |\n| --- | ---: |")
    for kernel in KERNELS:
        ms = median_ms(lambda k=kernel: wp.launch(k, dim=m, inputs=arrays, device="cpu"),
                       args.repeats)
        print(f"| {kernel.key} | {ms:.2f} |")
    print(f"| NumPy sum | {median_ms(flat.sum, args.repeats):.2f} |")
    print(f"| NumPy dot | {median_ms(lambda: np.dot(flat, flat), args.repeats):.2f} |")


if __name__ == "__main__":
    main()
