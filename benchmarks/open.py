"""Opening files: `segcli info FILE`, each run a fresh process, in turns, for this checkout
and (with --before REV) the code at REV, on files where opening is most of the work:

- labels.h5: a segcli file of --labels one-atom structures, each with a string label
  (chunked, gzip): the text whose global heap collections are walked on opening;
- atoms.h5: a segcli file of --atoms atoms (numbers and float64 forces, 16 atoms a
  structure): what `info` reads to count elements;
- conformers.h5: --groups molecule groups in the SPICE layout (smiles and subset strings,
  atomic numbers, conformations, energies): an object-heavy file.

    python benchmarks/open.py [--runs 5] [--before REV] [--labels N] [--atoms N] [--groups N]
                              [--only labels|atoms|conformers]

Files are generated once under --dir, named by their size (labels-N.h5, ...); REV is checked
out there (a git worktree). Prints a Markdown table of the median wall seconds of each, and
their ratio.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_files(directory, labels, atoms, groups, only=None):
    """The three files (see the module docstring), or the one named `only`, made if missing;
    their paths."""
    rng = np.random.default_rng(0)
    sizes = {"labels": labels, "atoms": atoms, "conformers": groups}
    paths = {name: os.path.join(directory, f"{name}-{size}.h5") for name, size in sizes.items()
             if only in (None, name)}
    if "labels" in paths and not os.path.exists(paths["labels"]):
        with h5py.File(paths["labels"], "w") as f:
            f.attrs.update(format="segcli-batch", version=1)
            f["structures/n_atoms"] = np.ones(labels, np.int64)
            f["atoms/positions"] = rng.normal(size=(labels, 3))
            f.create_dataset("structures/label", data=np.array(
                [f"config-{i % 977}" for i in range(labels)], dtype=h5py.string_dtype()),
                chunks=(1 << 16,), compression="gzip", maxshape=(None,))
    if "atoms" in paths and not os.path.exists(paths["atoms"]):
        with h5py.File(paths["atoms"], "w") as f:
            f.attrs.update(format="segcli-batch", version=1)
            f["structures/n_atoms"] = np.full(atoms // 16, 16, np.int64)
            f["atoms/numbers"] = rng.integers(1, 80, atoms // 16 * 16)
            f["atoms/forces"] = rng.normal(size=(atoms // 16 * 16, 3))
    if "conformers" in paths and not os.path.exists(paths["conformers"]):
        with h5py.File(paths["conformers"], "w") as f:
            for g in range(groups):
                group = f.create_group(f"mol{g}")
                group["smiles"] = f"C{g}O"
                group["subset"] = "PubChem"
                group["atomic_numbers"] = np.array([6, 8, 1, 1], np.int16)
                group["conformations"] = rng.normal(size=(2, 4, 3)).astype(np.float32)
                group["dft_total_energy"] = rng.normal(size=2)
    return paths


def checkout(rev, directory):
    """A worktree of the repository at `rev` under `directory`; its path."""
    path = os.path.join(directory, f"segcli-{rev}")
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev],
                       check=True, capture_output=True)
    return path


def seconds(code, path):
    """Wall seconds of `segcli info PATH` run from the checkout `code`."""
    env = {**os.environ, "PYTHONPATH": code}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "segcli", "info", path], check=False, env=env,
                          cwd=code, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{code}: segcli info {path}: {done.stderr}")
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", metavar="REV")
    parser.add_argument("--labels", type=int, default=1_000_000)
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--groups", type=int, default=2_000)
    parser.add_argument("--only", choices=["labels", "atoms", "conformers"],
                        help="time only this file")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    directory = os.path.join(args.dir, "segcli-bench-open")
    os.makedirs(directory, exist_ok=True)
    paths = make_files(directory, args.labels, args.atoms, args.groups, args.only)
    codes = {"now": ROOT}
    if args.before:
        codes[args.before] = checkout(args.before, directory)
    times = {(name, code): [] for name in paths for code in codes}
    for _ in range(args.runs):
        for name, path in paths.items():
            for code, where in codes.items():
                times[name, code].append(seconds(where, path))
    header = ["file", *(f"`info`, {code}, s" for code in codes)]
    if args.before:
        header.append(f"now / {args.before}")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for name, path in paths.items():
        medians = [statistics.median(times[name, code]) for code in codes]
        cells = [os.path.basename(path), *(f"{m:.2f}" for m in medians)]
        if args.before:
            cells.append(f"{medians[0] / medians[1]:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
