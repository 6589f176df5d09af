"""A cluster's task opening the file again: `open_inputs(path)`, which reads and checks
/structures/n_atoms, against `open_inputs(layout)` of the client's layout, which takes them
as they are while the file is unchanged. One process, in turns, medians, page cache warm.

    python benchmarks/reopen.py [--structures 6250000] [--runs 9] [--dir /tmp]

Generates a segcli file of --structures structures of 1 to 3 atoms, with their atomic numbers
(opening reads n_atoms, whatever the atoms hold). Prints a Markdown table.
"""

import argparse
import os
import statistics
import tempfile
import time

import h5py
import numpy as np

from segcli import keep_freed_buffers
from segcli.io import open_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=6_250_000)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    keep_freed_buffers()
    path = os.path.join(args.dir, f"segcli-reopen-{args.structures}.h5")
    n_atoms = np.random.default_rng(0).integers(1, 4, args.structures)
    with h5py.File(path, "w") as f:
        f.attrs.update(format="segcli-batch", version=1)
        f["structures/n_atoms"] = n_atoms
        f["atoms/numbers"] = np.ones(int(n_atoms.sum()), np.int8)
    try:
        with open_inputs(path) as batch:
            layout = batch.layout
        opens = {"the path (n_atoms read and checked)": path,
                 "the layout (n_atoms taken as they are)": layout}
        times = {label: [] for label in opens}
        for _ in range(args.runs + 1):  # the first round unmeasured
            for label, spec in opens.items():
                start = time.perf_counter()
                open_inputs(spec).close()
                times[label].append(time.perf_counter() - start)
    finally:
        os.unlink(path)
    print(f"{args.structures} structures, median of {args.runs} opens\n")
    print("| open_inputs of | ms |")
    print("| --- | ---: |")
    for label, runs in times.items():
        print(f"| {label} | {1e3 * statistics.median(runs[1:]):.1f} |")


if __name__ == "__main__":
    main()
