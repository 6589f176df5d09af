"""Steady-state throughput of `segcli stats FILE forces` (and `--per-element`) against a bare
chunked h5py read of the same datasets, in one process: passes after a first one (imports,
page cache and allocator warm), in turns, medians. With --before REV, also the statistics of
`segcli/stats.py` as it was at git revision REV (loaded as a module of its own).

    python benchmarks/stats_steady.py [--atoms 10000000] [--passes 7] [--before REV]

Prints a Markdown table: atoms/s of each and its ratio to the read of the same datasets.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import h5py
from reduce import make_file
from stats import add_fields

from segcli import stats
from segcli.io import open_batch

STEP = 1 << 21
"""Rows a bare read takes at a time: the default --chunk-atoms."""


def bare_read(path, names):
    """Read the datasets `names` of `path` STEP rows at a time, and the atom counts."""
    with h5py.File(path, "r", rdcc_nbytes=0) as f:
        f["structures/n_atoms"][()]
        for name in names:
            dataset = f[name]
            for lo in range(0, len(dataset), STEP):
                dataset[lo:lo + STEP]


def module_at(revision, directory):
    """segcli/stats.py as it was at git `revision`, imported as a module of its own."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{revision}:segcli/stats.py"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(directory, "stats_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("stats_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--before", metavar="REV", help="also time segcli/stats.py at REV")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = os.path.join(directory, "steady.h5")
        make_file(path, args.atoms)
        add_fields(path)
        versions = {"segcli stats": stats}
        if args.before:
            versions[f"segcli stats at {args.before}"] = module_at(args.before, directory)
        work = {}
        for label, per_element, names in (("forces", False, ["atoms/forces"]),
                                          ("forces --per-element", True,
                                           ["atoms/forces", "atoms/numbers"])):
            work[label, "bare h5py read"] = lambda names=names: bare_read(path, names)
            for version, module in versions.items():
                def compute(module=module, per_element=per_element):
                    with open_batch(path) as batch:
                        module.field_stats(batch, ["forces"], per_element=per_element)
                work[label, version] = compute
        seconds = {key: [] for key in work}
        load = os.getloadavg()[0]
        for turn in range(args.passes + 1):  # in turns, so that a slow moment hits each alike
            for key, run in work.items():
                start = time.perf_counter()
                run()
                if turn:  # the first pass warms up
                    seconds[key].append(time.perf_counter() - start)
        print(f"{args.atoms} atoms, float64 forces, 8 elements, median of {args.passes} passes "
              f"after a first, in one process; load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after\n")
        print("| stats of | what | M atoms/s | share of the read |")
        print("| --- | --- | --- | --- |")
        for (label, what), times in seconds.items():
            rate = args.atoms / statistics.median(times)
            read = args.atoms / statistics.median(seconds[label, "bare h5py read"])
            print(f"| {label} | {what} | {rate / 1e6:.1f} | {rate / read:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
