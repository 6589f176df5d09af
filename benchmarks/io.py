"""Throughput and memory of segcli.io; prints a markdown table (rerunnable).

    python benchmarks/io.py [--workdir /tmp/segcli-bench] [--atoms 10000000] [--runs 5]

1. read: `iter_chunks(["positions", "forces"])` over a segcli HDF5 file of --atoms atoms
   (float64) against a bare h5py read of the same two datasets, alternating, page cache warm;
2. convert: `segcli.io.convert` of an extxyz file of --convert-atoms atoms against
   `ase.io.read(path, ":")` of the same file, alternating;
3. memory: peak RSS of `python -m segcli convert --chunk-atoms C` on extxyz files of 1x and
   10x C atoms, each in a process of its own.

The generated files stay in --workdir (reused when present); nothing is written to the repository.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import h5py
import numpy as np


def structures(n_atoms_total, rng, max_size):
    """Sizes 1..max_size summing to n_atoms_total."""
    sizes = rng.integers(1, max_size + 1, 2 * n_atoms_total // max_size + 2)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n_atoms_total) + 1]
    sizes[-1] -= sizes.sum() - n_atoms_total
    return sizes[sizes > 0]


def make_h5(path, n_atoms_total):
    """A segcli HDF5 file written by segcli's own writer, a million atoms at a time."""
    from segcli.io.core import Chunk
    from segcli.io.writers import BatchWriter

    rng = np.random.default_rng(0)
    sizes = structures(n_atoms_total, rng, 200)
    with h5py.File(path, "w") as h5:
        writer = BatchWriter(h5)
        bounds = np.searchsorted(np.cumsum(sizes), np.arange(10**6, n_atoms_total, 10**6))
        for part in np.split(sizes, bounds + 1):
            n = int(part.sum())
            writer.append(path, [Chunk(0, part, {
                "numbers": rng.integers(1, 90, n), "positions": rng.normal(0, 10, (n, 3)),
                "forces": rng.normal(0, 1, (n, 3))}, {"energy": rng.normal(0, 1, len(part))})])
        writer.finish()


def make_extxyz(path, n_atoms_total, seed=1):
    import ase.io
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)

    def frames():
        for n in structures(n_atoms_total, rng, 200):
            atoms = Atoms(numbers=rng.integers(1, 90, n), positions=rng.normal(0, 5, (n, 3)),
                          cell=np.eye(3) * 20, pbc=True)
            atoms.set_momenta(rng.normal(0, 1, (n, 3)))
            atoms.calc = SinglePointCalculator(atoms, energy=rng.normal(),
                                               forces=rng.normal(0, 1, (n, 3)),
                                               stress=rng.normal(0, 0.1, 6))
            yield atoms

    ase.io.write(path, frames(), format="extxyz")


def alternate(runs, **candidates):
    """Median wall-clock seconds of each candidate, run alternately `runs` times."""
    times = {name: [] for name in candidates}
    for _ in range(runs):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_read(path, runs):
    from segcli.io import open_batch

    def bare():
        with h5py.File(path, "r") as h5:
            h5["atoms/positions"][:]
            h5["atoms/forces"][:]

    def chunks():
        with open_batch(path) as batch:
            for _ in batch.iter_chunks(["positions", "forces"]):
                pass

    bare()  # warm the page cache
    result = alternate(runs, bare=bare, iter_chunks=chunks)
    with h5py.File(path, "r") as h5:
        size = (h5["atoms/positions"].size + h5["atoms/forces"].size) * 8
    return result, size


def bench_convert(path, out, runs):
    import ase.io

    from segcli.io import convert

    return alternate(runs, ase_read=lambda: ase.io.read(path, ":"),
                     convert=lambda: convert([path], out, force=True))


def peak_rss_mib(args):
    """Peak RSS of one child process running `args`."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True,
                         text=True).stdout
    return int(out.split()[-1]) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/segcli-bench")
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--convert-atoms", type=int, default=500_000)
    parser.add_argument("--chunk-atoms", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    files = {
        "read": (os.path.join(args.workdir, f"read_{args.atoms}.h5"), make_h5, args.atoms),
        "convert": (os.path.join(args.workdir, f"convert_{args.convert_atoms}.extxyz"),
                    make_extxyz, args.convert_atoms),
        "mem1": (os.path.join(args.workdir, f"mem_{args.chunk_atoms}.extxyz"), make_extxyz,
                 args.chunk_atoms),
        "mem10": (os.path.join(args.workdir, f"mem_{10 * args.chunk_atoms}.extxyz"),
                  make_extxyz, 10 * args.chunk_atoms),
    }
    for path, make, n in files.values():
        if not os.path.exists(path):
            print(f"making {path} ...", file=sys.stderr)
            make(path + ".part", n)
            os.replace(path + ".part", path)

    read, size = bench_read(files["read"][0], args.runs)
    conv = bench_convert(files["convert"][0], os.path.join(args.workdir, "convert_out.h5"),
                         args.runs)
    rss = {}
    for key in ("mem1", "mem10"):
        rss[key] = peak_rss_mib([sys.executable, "-m", "segcli", "convert", files[key][0], "-o",
                                 os.path.join(args.workdir, "mem_out.h5"), "--force", "-q",
                                 "--chunk-atoms", str(args.chunk_atoms)])
    gbs = {k: size / v / 1e9 for k, v in read.items()}
    mb = os.path.getsize(files["convert"][0]) / 1e6
    print(f"{time.strftime('%Y-%m-%d')}, {platform.node()}, {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, "
          f"h5py {h5py.__version__}, median of {args.runs} alternating runs\n")
    print("| measurement | reference | segcli | segcli / reference | target |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| read positions+forces, {args.atoms:.0e} atoms ({size / 1e9:.2f} GB) | bare h5py "
          f"{read['bare']:.3f} s ({gbs['bare']:.2f} GB/s) | iter_chunks "
          f"{read['iter_chunks']:.3f} s ({gbs['iter_chunks']:.2f} GB/s) | "
          f"{gbs['iter_chunks'] / gbs['bare']:.2f} (throughput) | >= 0.70 |")
    print(f"| convert extxyz, {args.convert_atoms:.0e} atoms ({mb:.0f} MB) | ase.io.read "
          f"{conv['ase_read']:.3f} s | convert {conv['convert']:.3f} s | "
          f"{conv['convert'] / conv['ase_read']:.2f} (time) | <= 1.00 |")
    print(f"| peak RSS of convert, --chunk-atoms {args.chunk_atoms} | 1x chunk: "
          f"{rss['mem1']:.0f} MiB | 10x chunk: {rss['mem10']:.0f} MiB | "
          f"{rss['mem10'] / rss['mem1']:.2f} | <= 2.00 |")


if __name__ == "__main__":
    main()
