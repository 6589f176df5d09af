"""`segcli reduce FILE rms_norm forces -o OUT` against a bare h5py read of the forces and a plain
NumPy script (np.add.reduceat), each run as a fresh process on a generated file (float64 forces,
1 to 63 atoms per structure), page cache warm; then both in one process once started (the
steady state of a long run), and what padding chunks to one bucket size buys.

    python benchmarks/reduce.py [--atoms 10000000] [--runs 5] [--device auto|cpu|gpu] [--dir /tmp]

Prints a Markdown table: median wall time and peak RSS of
each, throughput in atoms per second, and segcli's throughput as a share of the bare read's.
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

READ = """
import sys, h5py
with h5py.File(sys.argv[1], "r", rdcc_nbytes=0) as f:
    forces = f["atoms/forces"]
    for lo in range(0, len(forces), int(sys.argv[2])):
        forces[lo:lo + int(sys.argv[2])]
"""

NUMPY = """
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    n_atoms, forces = f["structures/n_atoms"][()], f["atoms/forces"][()]
starts = np.concatenate([[0], np.cumsum(n_atoms)[:-1]])
rms = np.sqrt(np.add.reduceat(np.einsum("ij,ij->i", forces, forces), starts) / n_atoms)
with h5py.File(sys.argv[2], "w") as f:
    f["rms_norm_forces"] = rms
"""


def make_file(path, atoms, seed=0, compression=None, largest=63):
    """A segcli HDF5 file of `atoms` atoms in structures of 1 to `largest` atoms, float64 forces
    (compressed in chunks of 64 Ki atoms with `compression`, e.g. "gzip")."""
    rng = np.random.default_rng(seed)
    n_atoms = rng.integers(1, largest + 1, atoms * 4 // (largest + 1) + 1)
    n_atoms = n_atoms[:np.searchsorted(np.cumsum(n_atoms), atoms)]
    n_atoms = np.append(n_atoms, atoms - n_atoms.sum())
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "segcli-batch"
        f.attrs["version"] = 1
        f["structures/n_atoms"] = n_atoms
        forces = f.create_dataset("atoms/forces", (atoms, 3), np.float64,
                                  compression=compression,
                                  chunks=(min(atoms, 1 << 16), 3) if compression else None)
        step = 1 << 22
        for lo in range(0, atoms, step):
            forces[lo:lo + step] = rng.normal(size=(min(step, atoms - lo), 3))
    return len(n_atoms)


def measure(command):
    """(wall seconds, peak RSS in bytes) of one process; the peak is the kernel's high-water
    mark (VmHWM), read every few milliseconds until the process ends."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                peak = max([peak] + [int(line.split()[1]) * 1024 for line in status
                                     if line.startswith("VmHWM:")])
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.005)
    wall = time.perf_counter() - start
    if process.returncode:
        raise RuntimeError(f"{command} failed: {process.stderr.read().decode()}")
    return wall, peak


def steady_state(path, device, atoms):
    """Atoms per second, in this process and after a first pass (imports, compilation and the
    host buffers done), of engine.run over the whole file and of a bare chunked h5py read of
    its forces; each the median of three passes."""
    import jax

    from segcli import engine
    from segcli.io import open_batch
    from segcli.registry import OPS

    target = jax.devices(device)[0] if device != "auto" else jax.devices()[0]

    def read():
        with h5py.File(path, "r", rdcc_nbytes=0) as f:
            forces = f["atoms/forces"]
            for lo in range(0, len(forces), engine.DEFAULT_CHUNK_ATOMS):
                forces[lo:lo + engine.DEFAULT_CHUNK_ATOMS]

    with open_batch(path) as batch:
        job = engine.plan(path, OPS["rms_norm"], ["forces"], batch.fields)

        def reduce():
            for _ in engine.run(batch, [job], target):
                pass

        rates = {}
        for name, work in (("segcli", reduce), ("read", read)):
            work()
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                work()
                seconds.append(time.perf_counter() - start)
            rates[name] = atoms / statistics.median(seconds)
    return rates


def bucketing(path, device, atoms, chunk_atoms):
    """Seconds of engine.run over the first `atoms` atoms in chunks of `chunk_atoms`, with every
    chunk padded to one bucket size and with each chunk at its own size (a compile each),
    after a warm-up run (Warp's kernels loaded, page cache warm)."""
    import jax

    from segcli import engine
    from segcli.engine import pipeline, program
    from segcli.io import open_batch
    from segcli.registry import OPS

    target = jax.devices(device)[0] if device != "auto" else jax.devices()[0]
    out = {}
    with open_batch(path) as batch:
        stop = int(np.searchsorted(np.cumsum(batch.n_atoms), atoms)) + 1
        job = engine.plan(path, OPS["rms_norm"], ["forces"], batch.fields)
        for label, size in (("warm-up", engine.padded_size), ("padded", engine.padded_size),
                            ("exact", None)):
            program._compiled.cache_clear()
            saved = pipeline.padded_size, pipeline.bucket
            if size is None:
                pipeline.padded_size, pipeline.bucket = (lambda *a: (0, 0)), (lambda n: n)
            try:
                start = time.perf_counter()
                chunks = sum(1 for _ in engine.run(batch, [job], target, chunk_atoms=chunk_atoms,
                                                   structures=slice(0, stop)))
                out[label] = time.perf_counter() - start
            finally:
                pipeline.padded_size, pipeline.bucket = saved
    return chunks, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    path = os.path.join(args.dir, f"segcli-bench-{args.atoms}.h5")
    tiny = os.path.join(args.dir, "segcli-bench-tiny.h5")
    out = os.path.join(args.dir, "segcli-bench-out.h5")
    if not os.path.exists(path):
        make_file(path, args.atoms)
    make_file(tiny, 16)
    with h5py.File(path, "r") as f:
        structures = len(f["structures/n_atoms"])
    with open(path, "rb") as f:  # warm the page cache
        while f.read(1 << 24):
            pass
    from segcli.engine import DEFAULT_CHUNK_ATOMS

    segcli = [sys.executable, "-m", "segcli"]
    reduce = ["reduce", "rms_norm", "forces", "-o", out, "--force", "-q", "--device", args.device]
    commands = {
        "h5py read of the forces": [sys.executable, "-c", READ, path, str(DEFAULT_CHUNK_ATOMS)],
        "h5py read, 16-atom file (fixed cost)": [sys.executable, "-c", READ, tiny, "16"],
        "NumPy np.add.reduceat script": [sys.executable, "-c", NUMPY, path, out],
        "segcli reduce": segcli + [reduce[0], path, *reduce[1:]],
        "segcli reduce, 16-atom file (fixed cost)": segcli + [reduce[0], tiny, *reduce[1:]],
        "segcli --help": segcli + ["--help"],
    }
    times = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, command in commands.items():
            times[name].append(measure(command))
    median = {name: (statistics.median(t for t, _ in runs), statistics.median(r for _, r in runs))
              for name, runs in times.items()}

    print(f"{args.atoms} atoms in {structures} structures, float64 forces "
          f"({os.path.getsize(path) / 1e6:.0f} MB), device {args.device}, "
          f"median of {args.runs} runs, page cache warm\n")
    print("| run | wall | peak RSS | atoms/s |")
    print("| --- | --- | --- | --- |")
    for name, (wall, rss) in median.items():
        rate = "" if "16-atom" in name or "help" in name else f"{args.atoms / wall / 1e6:.1f} M"
        print(f"| {name} | {wall:.3f} s | {rss / 2**20:.0f} MiB | {rate} |")
    read, read_fixed, seg, seg_fixed = (median[k][0] for k in (
        "h5py read of the forces", "h5py read, 16-atom file (fixed cost)", "segcli reduce",
        "segcli reduce, 16-atom file (fixed cost)"))
    beyond = ("within the noise of the fixed costs" if min(seg - seg_fixed, read - read_fixed) <= 0
              else f"segcli {args.atoms / (seg - seg_fixed) / 1e6:.1f} M atoms/s, read "
                   f"{args.atoms / (read - read_fixed) / 1e6:.1f} M atoms/s: "
                   f"{(read - read_fixed) / (seg - seg_fixed):.0%}")
    print(f"\nsegcli reduce / bare read throughput: {read / seg:.0%} of wall time; beyond each "
          f"one's fixed cost (start-up, imports, compilation): {beyond}")

    rates = steady_state(path, args.device, args.atoms)
    print(f"\nsteady state in one process (engine.run, second and later passes over the file): "
          f"segcli {rates['segcli'] / 1e6:.1f} M atoms/s, h5py read {rates['read'] / 1e6:.1f} M "
          f"atoms/s: {rates['segcli'] / rates['read']:.0%}")

    small = min(args.atoms, 2_000_000)
    chunks, seconds = bucketing(path, args.device, small, max(small // 10, 1))
    print(f"\nengine.run over {small} atoms in {chunks} chunks of varying size (in process): "
          f"padded to one bucket {seconds['padded']:.2f} s, each chunk its own shape "
          f"{seconds['exact']:.2f} s")


if __name__ == "__main__":
    main()
