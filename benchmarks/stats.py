"""`segcli stats FILE forces energy --per-element --per-atom` against a bare h5py read of the
same datasets and an in-memory NumPy script computing the same statistics (what training
frameworks do), each a fresh process on a generated file (float64 forces, 1 to 63 atoms per
structure, 8 elements), page cache warm: median wall time and peak RSS as the file grows.

    python benchmarks/stats.py [--atoms 10000000 40000000] [--runs 3] [--dir /tmp]

Prints a Markdown table.
"""

import argparse
import os
import statistics
import sys
import tempfile

import h5py
import numpy as np
from reduce import make_file, measure

READ = """
import sys, h5py
step = 1 << 21
with h5py.File(sys.argv[1], "r", rdcc_nbytes=0) as f:
    for name in ("atoms/forces", "atoms/numbers"):
        for lo in range(0, len(f[name]), step):
            f[name][lo:lo + step]
    f["structures/energy"][()], f["structures/n_atoms"][()]
"""

NUMPY = """
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    forces, numbers = f["atoms/forces"][()], f["atoms/numbers"][()]
    energy, n_atoms = f["structures/energy"][()], f["structures/n_atoms"][()]
def moments(x):
    return (x.mean(axis=0), x.std(axis=0), np.sqrt((x * x).mean(axis=0)), x.min(axis=0),
            x.max(axis=0))
norm = np.sqrt(np.einsum("ij,ij->i", forces, forces))[:, None]
values = np.concatenate([forces, norm], axis=1)
out = [moments(values[numbers == z]) for z in np.unique(numbers)]
out.append(moments(energy / n_atoms))
"""


def add_fields(path, seed=1):
    """Atomic numbers (8 elements) per atom and an energy per structure."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        atoms, structures = len(f["atoms/forces"]), len(f["structures/n_atoms"])
        numbers = f.create_dataset("atoms/numbers", (atoms,), np.int64)
        step = 1 << 22
        for lo in range(0, atoms, step):
            numbers[lo:lo + step] = rng.choice([1, 6, 7, 8, 16, 26, 29, 79],
                                               min(step, atoms - lo))
        f["structures/energy"] = rng.normal(-100, 20, structures)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, nargs="+", default=[10_000_000, 40_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    print("| atoms | file MB | what | wall s (median) | peak RSS MiB | M atoms/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for atoms in args.atoms:
        path = os.path.join(args.dir, f"segcli-stats-bench-{atoms}.h5")
        try:
            make_file(path, atoms)
            add_fields(path)
            commands = {
                "bare h5py read": [sys.executable, "-c", READ, path],
                "NumPy in memory": [sys.executable, "-c", NUMPY, path],
                "segcli stats": [sys.executable, "-m", "segcli", "stats", path, "forces",
                                 "energy", "--per-element", "--per-atom", "--json"],
            }
            measure(commands["bare h5py read"])  # warm the page cache
            runs = {name: [] for name in commands}
            for _ in range(args.runs):  # in turns, so that a slow moment hits each alike
                for name, command in commands.items():
                    runs[name].append(measure(command))
            size = os.path.getsize(path) / 1e6
            for name, results in runs.items():
                wall = statistics.median(r[0] for r in results)
                peak = max(r[1] for r in results) / 2**20
                print(f"| {atoms:.0e} | {size:.0f} | {name} | {wall:.2f} | {peak:.0f} | "
                      f"{atoms / wall / 1e6:.1f} |", flush=True)
        finally:
            if os.path.exists(path):
                os.unlink(path)


if __name__ == "__main__":
    main()
