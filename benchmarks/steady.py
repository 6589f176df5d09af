"""Steady state of whole commands: `segcli reduce` and `grad` of every op, and several ops in
one pass, each run in this process after a first run (imports, compilation, page cache and
host buffers warm), against a bare chunked h5py read of the same datasets, side by side in
turns. Each is run over the whole file and over its first half (`--structures`): the steady
state is the throughput of the second half, (atoms - half's atoms) / (time - half's time),
free of what a command pays once (opening, planning, creating and renaming its output). Beside
the whole file's time, the CPU time (user + system, all this process's threads) a whole-file
run took: on a machine of few cores, what a command costs the cores shows there first.

    python benchmarks/steady.py [--atoms 10000000] [--rounds 5] [--device auto|cpu|gpu]
                                [--threads K] [--compression gzip] [--processes K]

Generates (once, under --dir) a segcli file of float64 forces and velocities (N, 3), int32
atomic numbers (N,), energy (S,) and cell (S, 3, 3), 1 to 63 atoms per structure. Each
command writes its results with `-o` (HDF5) into --out-dir (default /dev/shm, a memory file
system like the warm page cache the read comes from, so that a disk's write-back does not
time one case for another). Prints a Markdown table: median seconds per run, atoms per
second, and the share of the bare read's throughput; with `--processes K`, also of a bare
read by K processes at once (each its share of every chunk's rows). `--threads K` is passed
to the commands; `--compression gzip` makes (and reads) a file whose per-atom fields are
compressed in chunks of 64 Ki rows, shuffled.
"""

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import resource
import statistics
import tempfile
import time

import h5py
import numpy as np

CASES = [("reduce", "sum forces"), ("reduce", "mean forces"), ("reduce", "rms_norm forces"),
         ("reduce", "max_norm forces"), ("reduce", "dot forces velocities"),
         ("reduce", "mul forces energy"), ("reduce", "matvec forces cell"), ("reduce", "count"),
         ("reduce", "rms_norm forces + max_norm forces + mean forces"),
         ("reduce", "max forces"), ("reduce", "min forces"), ("reduce", "var forces"),
         ("reduce", "std forces"), ("reduce", "logsumexp forces"), ("reduce", "softmax forces"),
         ("reduce", "bincount numbers"),
         ("grad", "sum forces"), ("grad", "mean forces"), ("grad", "rms_norm forces"),
         ("grad", "max_norm forces"), ("grad", "dot forces velocities"),
         ("grad", "mul forces energy"), ("grad", "matvec forces cell"), ("grad", "max forces"),
         ("grad", "min forces"), ("grad", "var forces"), ("grad", "std forces"),
         ("grad", "logsumexp forces"), ("grad", "softmax forces")]


def make_file(path, atoms, seed=0, compression=None):
    """The benchmark's file (see the module docstring)."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(1, 64, atoms // 16)
    n_atoms = n_atoms[:np.searchsorted(np.cumsum(n_atoms), atoms)]
    n_atoms = np.append(n_atoms, atoms - n_atoms.sum())
    with h5py.File(path, "w") as f:
        f.attrs["format"], f.attrs["version"] = "segcli-batch", 1
        f["structures/n_atoms"] = n_atoms
        f["structures/energy"] = rng.normal(size=len(n_atoms))
        f["structures/cell"] = rng.normal(size=(len(n_atoms), 3, 3))
        f["atoms/numbers"] = rng.integers(1, 119, atoms, dtype=np.int32)
        for name in ("forces", "velocities"):
            data = f.create_dataset(f"atoms/{name}", (atoms, 3), np.float64,
                                    chunks=(min(atoms, 1 << 16), 3) if compression else None,
                                    compression=compression, shuffle=bool(compression))
            for lo in range(0, atoms, 1 << 22):
                data[lo:lo + (1 << 22)] = rng.normal(size=(min(1 << 22, atoms - lo), 3))


def bare_read(path, names, chunk_atoms, structures, part=0, parts=1):
    """Read the rows of the first `structures` structures of the datasets `names` (atoms/ or
    structures/) chunk by chunk, as a plain script would; with `parts`, only part `part` of
    every chunk (for one of `parts` processes reading it together)."""
    with h5py.File(path, "r", rdcc_nbytes=0) as f:
        n_atoms = f["structures/n_atoms"][:structures]
        for name in names:
            data = f[name]
            stop = int(n_atoms.sum()) if name.startswith("atoms/") else len(n_atoms)
            share = -(-chunk_atoms // parts)
            for lo in range(part * share, stop, chunk_atoms):
                data[lo:min(lo + share, stop)]


def bare_read_by(pool, parts, *args):
    """bare_read by `parts` processes of `pool` at once."""
    list(pool.map(bare_read, *zip(*[(*args, k, parts) for k in range(parts)])))


def datasets_of(words):
    """The datasets a case reads."""
    per_structure = {"energy", "cell"}
    names = dict.fromkeys(w for w in words.split()
                          if w in per_structure | {"forces", "velocities", "numbers"})
    return ["structures/n_atoms"] + [("structures/" if n in per_structure else "atoms/") + n
                                     for n in names]


def _cpu_seconds():
    """User and system seconds this process (every thread) has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--only", help="run only the cases whose command contains one of "
                                           "these comma-separated texts")
    parser.add_argument("--threads", type=int, help="--threads K for every command")
    parser.add_argument("--chunk-atoms", type=int, help="--chunk-atoms for every command "
                                                        "and the bare reads' step")
    parser.add_argument("--compression", help="compress the per-atom fields (e.g. gzip)")
    parser.add_argument("--where", help="--where for every command (e.g. 'energy > -1e300', "
                                        "which keeps every structure on a selection's path)")
    parser.add_argument("--processes", type=int, help="also a bare read by K processes")
    args = parser.parse_args()
    path = os.path.join(args.dir, f"segcli-steady-{args.atoms}"
                                  f"{'-' + args.compression if args.compression else ''}.h5")
    out = os.path.join(args.out_dir or args.dir, "segcli-steady-out.h5")
    current = False  # a file of this version (earlier ones lack atoms/numbers)
    if os.path.exists(path):
        with h5py.File(path, "r") as f:
            current = "atoms/numbers" in f
    if not current:
        make_file(path, args.atoms, compression=args.compression)
    pool = None
    if args.processes:
        pool = concurrent.futures.ProcessPoolExecutor(
            args.processes, mp_context=multiprocessing.get_context("spawn"))

    from segcli.cli import main as cli
    from segcli.cli.common import as_program

    as_program()  # this process's settings are those of the segcli program
    from segcli.engine import DEFAULT_CHUNK_ATOMS

    step = args.chunk_atoms or DEFAULT_CHUNK_ATOMS

    with h5py.File(path, "r") as f:
        n_atoms = f["structures/n_atoms"][()]
    half = len(n_atoms) // 2
    atoms = {len(n_atoms): args.atoms, half: int(n_atoms[:half].sum())}
    cases = [c for c in CASES
             if not args.only or any(o in " ".join(c) for o in args.only.split(","))]
    work = {}
    for command, words in cases:
        reads = tuple(datasets_of(words))
        for stop in atoms:
            argv = [command, path, *words.split(), "-o", out, "--force", "-q", "--device",
                    args.device, "--structures", f"0:{stop}",
                    *(["--threads", str(args.threads)] if args.threads else []),
                    *(["--where", args.where] if args.where else []),
                    *(["--chunk-atoms", str(args.chunk_atoms)] if args.chunk_atoms else [])]
            work[(command, words, stop)] = (lambda argv=argv: cli.main(argv,
                                                                       standalone_mode=False))
            work.setdefault((reads, stop), lambda reads=reads, stop=stop: bare_read(
                path, reads, step, stop))
            if pool:
                work.setdefault(("processes", reads, stop), lambda reads=reads, stop=stop:
                                bare_read_by(pool, args.processes, path, reads,
                                             step, stop))
    seconds = {name: [] for name in work}
    cpu = {name: [] for name in work}
    for round_ in range(args.rounds + 1):
        for name, run in work.items():
            # untimed: a run replacing the previous run's output would free its pages in the
            # timed part, and the whole file's run and the half's replace each other's
            if os.path.exists(out):
                os.remove(out)
            start, used = time.perf_counter(), _cpu_seconds()
            run()
            if round_:  # the first round warms everything up
                seconds[name].append(time.perf_counter() - start)
                cpu[name].append(_cpu_seconds() - used)
    median = {name: statistics.median(s) for name, s in seconds.items()}

    def steady(key):
        """Atoms per second of the second half; NaN where the first half took as long as the
        whole file (the run's noise hides the second half's time)."""
        whole, first = median[(*key, len(n_atoms))], median[(*key, half)]
        return (atoms[len(n_atoms)] - atoms[half]) / (whole - first) if whole > first else math.nan

    def figure(value, spec):
        return format(value, spec) if math.isfinite(value) else "—"

    k = args.processes
    print(f"{args.atoms} atoms, float64{', ' + args.compression if args.compression else ''}, "
          f"device {args.device}, threads {args.threads or 'default'}, chunks of {step} atoms, "
          f"{'--where ' + repr(args.where) + ', ' if args.where else ''}"
          f"median of {args.rounds} "
          f"rounds in turns, each after a first run in this process, -o into "
          f"{os.path.dirname(out)}\n")
    print("| command | read of | whole file, s | CPU s | steady state, M atoms/s "
          "| bare read, M atoms/s | share of the read |"
          + (f" bare read by {k} processes | share of it |" if k else ""))
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if k else ""))
    for command, words in cases:
        reads = tuple(datasets_of(words))
        rate, read = steady((command, words)), steady((reads,))
        whole = (command, words, len(n_atoms))
        line = (f"| `{command} {words}` | {', '.join(r.split('/')[1] for r in reads[1:]) or '-'} "
                f"| {median[whole]:.3f} | {statistics.median(cpu[whole]):.3f} "
                f"| {figure(rate / 1e6, '.1f')} | {figure(read / 1e6, '.1f')} "
                f"| {figure(rate / read, '.0%')} |")
        if k:
            many = steady(("processes", reads))
            line += f" {figure(many / 1e6, '.1f')} | {figure(rate / many, '.0%')} |"
        print(line)


if __name__ == "__main__":
    main()
