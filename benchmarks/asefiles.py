"""Wall time and peak RSS of segcli on ASE files read directly (extended XYZ, or an ASE
SQLite database), against ASE's own reading loop.

    python benchmarks/asefiles.py [--workdir /tmp/segcli-asefiles] [--atoms 500000 1500000]
                                  [--runs 2] [--check] [--format extxyz|db]

Writes extxyz files of --atoms atoms (structures of 1-63 atoms with forces and energy, in the
layout ase.io.write uses; reused when present), with --format db also an ASE database of the
same structures (ase.db.connect(...).write), and times, each in a process of its own:
`segcli reduce F max_norm forces` (default and --chunk-atoms 100000), `segcli stats F forces`,
`segcli info F`, and ASE's loop over the file: `for atoms in ase.io.iread(F):
atoms.get_forces()`, or for a database `for row in db.select(): row.toatoms().get_forces()`.
Prints a markdown table of the medians over --runs. Nothing is written to the repository.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYMBOLS = np.array(["H", "C", "N", "O", "Si", "Cu"])
ROW = " {:>14.8f} {:>14.8f} {:>14.8f} {:>14.8f} {:>14.8f} {:>14.8f}\n"
IREAD = "import ase.io, sys\nfor atoms in ase.io.iread(sys.argv[1]): atoms.get_forces()"
SELECT = ("import ase.db, sys\nfor row in ase.db.connect(sys.argv[1]).select(): "
          "row.toatoms().get_forces()")


def write_extxyz(path, n_atoms, seed=0):
    """An extxyz file of about n_atoms atoms in structures of 1-63 atoms; their number."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 64, 2 * n_atoms // 32 + 2)
    sizes = sizes[: np.searchsorted(np.cumsum(sizes), n_atoms) + 1]
    species = SYMBOLS[rng.integers(0, len(SYMBOLS), int(sizes.sum()))].tolist()
    values = (rng.normal(size=(len(species), 6)) * [5, 5, 5, 1, 1, 1]).tolist()
    lines = [f"{s:<2s}" + ROW.format(*row) for s, row in zip(species, values)]
    end = 0
    with open(path + ".tmp", "w") as f:
        for i, n in enumerate(sizes.tolist()):
            a = 10 + i % 7
            f.write(f"{n}\nLattice=\"{a:.1f} 0.0 0.0 0.0 {a:.1f} 0.0 0.0 0.0 {a:.1f}\" "
                    "Properties=species:S:1:pos:R:3:forces:R:3 "
                    f"energy={-0.37 * n - i * 1e-6:.8f} pbc=\"T T T\"\n")
            f.writelines(lines[end:end + n])
            end += n
    os.replace(path + ".tmp", path)
    return end


def write_db(path, extxyz):
    """An ASE SQLite database of the structures of the extxyz file, in one transaction."""
    import ase.db
    import ase.io

    with ase.db.connect(path + ".tmp.db", append=False) as db:
        for atoms in ase.io.iread(extxyz):
            db.write(atoms)
    os.replace(path + ".tmp.db", path)


def measure(argv):
    """(seconds, peak RSS in MB) of a command in a fresh process (one started from a small
    process: Linux carries the parent's peak RSS over to a child's)."""
    t = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    if status:
        raise SystemExit(f"failed: {' '.join(argv)}")
    return seconds, usage.ru_maxrss / 1024


def cases(path, out):
    """Name -> argv of each case on `path` (reductions written to `out`)."""
    cli = [sys.executable, "-m", "segcli"]
    reduce = cli + ["reduce", path, "max_norm", "forces", "--device", "cpu", "-q", "-o", out]
    return {"reduce": reduce,
            "reduce --chunk-atoms 100000": reduce + ["--chunk-atoms", "100000"],
            "stats forces": cli + ["stats", path, "forces"],
            "info": cli + ["info", path],
            "ase.io.iread loop" if not path.endswith(".db") else "ase.db select loop":
                [sys.executable, "-c", IREAD if not path.endswith(".db") else SELECT, path]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/segcli-asefiles")
    parser.add_argument("--atoms", type=int, nargs="+", default=[500_000, 1_500_000, 4_500_000])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="check that ASE reads a small file")
    parser.add_argument("--format", choices=["extxyz", "db"], default="extxyz")
    parser.add_argument("--write", nargs=2, metavar=("ATOMS", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        path = args.write[1]
        extxyz = path.removesuffix(".db") + ".extxyz" if path.endswith(".db") else path
        if not os.path.exists(extxyz):
            write_extxyz(extxyz, int(args.write[0]))
        return write_db(args.write[1], extxyz) if args.write[1].endswith(".db") else None
    os.makedirs(args.workdir, exist_ok=True)
    if args.check:
        import ase.io

        small = os.path.join(args.workdir, "check.extxyz")
        total = write_extxyz(small, 2000)
        frames = ase.io.read(small, ":")
        assert sum(map(len, frames)) == total and frames[0].get_forces().shape[1] == 3
        print(f"ASE reads {len(frames)} structures, {total} atoms")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}\n")
    print("| case | atoms | MB | seconds | peak RSS MB |\n| --- | ---: | ---: | ---: | ---: |")
    for n in args.atoms:
        path = os.path.join(args.workdir, f"f{n}.{args.format}")
        if not os.path.exists(path):  # in a process of its own: children inherit peak RSS
            subprocess.run([sys.executable, __file__, "--write", str(n), path], check=True)
        out = os.path.join(args.workdir, "out.h5")
        for name, argv in cases(path, out).items():
            runs = []
            for _ in range(args.runs):
                if os.path.exists(out):
                    os.remove(out)
                runs.append(measure(argv))
            print(f"| {name} | {n:,} | {os.path.getsize(path) / 1e6:.0f} | "
                  f"{statistics.median(r[0] for r in runs):.1f} | "
                  f"{statistics.median(r[1] for r in runs):.0f} |", flush=True)


if __name__ == "__main__":
    main()
