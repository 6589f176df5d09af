"""What a command on a cluster pays, in its client, to cut its structures into shards
(`segcli.shards.shard_bounds`), each time in a fresh process as a command is: the first call
(whose new arrays fault their pages in) and a second. This checkout and, with --before DIR,
another one (DIR on sys.path), in turns; medians.

    python benchmarks/shard_bounds.py [--structures 31250000] [--shards 32] [--runs 5]
                                      [--before DIR]

Structures of 1 to 63 atoms. Prints a Markdown table of milliseconds.
"""

import argparse
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMED = """
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from segcli.shards import shard_bounds
n_atoms = np.random.default_rng(0).integers(1, 64, int(sys.argv[2]))
times = []
for _ in range(2):
    start = time.perf_counter()
    shard_bounds(n_atoms, int(sys.argv[3]))
    times.append(time.perf_counter() - start)
print(*times)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=31_250_000)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", metavar="DIR", help="another checkout to time beside")
    args = parser.parse_args()
    trees = {"this checkout": ROOT} | ({args.before: args.before} if args.before else {})
    times = {label: [] for label in trees}
    for _ in range(args.runs):
        for label, tree in trees.items():
            out = subprocess.run([sys.executable, "-c", TIMED, os.path.abspath(tree),
                                  str(args.structures), str(args.shards)],
                                 check=True, capture_output=True, text=True).stdout
            times[label].append([float(t) for t in out.split()])
    print(f"shard_bounds of {args.structures} structures into {args.shards} shards, a fresh "
          f"process each run, median of {args.runs}\n")
    print("| code | first call, ms | second call, ms |")
    print("| --- | ---: | ---: |")
    for label, runs in times.items():
        first, second = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"| {label} | {1e3 * first:.0f} | {1e3 * second:.0f} |")


if __name__ == "__main__":
    main()
