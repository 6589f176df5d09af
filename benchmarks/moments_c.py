"""The moments in C (`segcli/_moments.c`, as `segcli stats` takes them a chunk at a time) on one
chunk in memory: rows (N, 3) float64 in 100 leaves, plain (with their norms) and per element
(8 atomic numbers, as uint8 and as int64), ns a row, the median of the rounds. Run on one
core, with one thread:

    SEGCLI_THREADS=1 taskset -c 0 python benchmarks/moments_c.py [--rows 2097152] [--rounds 15]

Run with PYTHONPATH set to another checkout to time its C.
"""

import argparse
import statistics
import time

import numpy as np

from segcli.curate import statistics as stats
from segcli.curate.statistics import Moments, _Buffers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    moments = stats._native_moments()
    if moments is None:
        raise SystemExit("the moments in C are not available here (not built at install?)")
    rng = np.random.default_rng(0)
    n, leaves = args.rows, 100
    x = rng.normal(size=(n, 3))
    numbers = rng.choice(np.array([1, 6, 7, 8, 9, 15, 16, 17], np.uint8), n)
    count = np.full(leaves, n // leaves, np.int64)
    count[-1] += n - count.sum()
    buffers = _Buffers()
    cases = {"plain": (None, 1), "per element, uint8": (numbers, 119),
             "per element, int64": (numbers.astype(np.int64), 119)}
    seconds = {name: [] for name in cases}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, (labels, groups) in cases.items():
            out = Moments.empty(groups, 4, leaves=leaves)
            start = time.perf_counter()
            moments(x, True, count, labels, out, buffers)
            seconds[name].append(time.perf_counter() - start)
    print(f"{n} rows of 3 float64 in {leaves} leaves, median of {args.rounds} rounds\n")
    print("| case | ns a row |\n| --- | ---: |")
    for name, times in seconds.items():
        print(f"| {name} | {statistics.median(times[1:]) * 1e9 / n:.2f} |")


if __name__ == "__main__":
    main()
