"""Neighbour counts at a cutoff, atoms per second: segcli's cell list and Warp kernel side by
side with ASE's `neighbor_list`, vesin and matscipy (one core each, a structure at a time)
and, where it imports and a GPU is there, nvalchemiops' batched cell list.

    python benchmarks/neighbors.py [--cells 40] [--size 5] [--cutoff 5] [--runs 5]
    python benchmarks/neighbors.py --atoms 10000000 --device gpu     # streamed from a file

The first case: rattled fcc Cu supercells of 4·size³ atoms (500 for size 5), in memory,
every library given the same structures; segcli runs them as one chunk (its cell list on the
host, then the kernel) on --device. The second (--atoms N): a segcli HDF5 file of such cells
(generated in a temporary directory) streamed by `segcli.neighborlist.run` in chunks of 2 Mi
atoms (read, bin, kernel, reduce), against vesin over the first 10⁶ atoms of it in memory.
Each library's total pair count is printed beside its time: they must agree. Medians of
--runs after a first run (imports, compilation).
"""

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def cells(count, size, seed=0):
    """`count` rattled fcc Cu cells of 4·size³ atoms."""
    from ase.build import bulk

    frames = []
    for k in range(count):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (size, size, size)
        atoms.rattle(0.1, seed=seed + k)
        frames.append(atoms)
    return frames


def median_time(function, runs):
    """(median seconds of `runs` calls after a first, the last call's result)."""
    result = function()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def segcli_pairs(frames, cutoff, device):
    from segcli import neighborlist as neighbors
    from segcli.io.core import Chunk

    n_atoms = np.array([len(a) for a in frames])
    chunk = Chunk(0, n_atoms, {"positions": np.concatenate([a.positions for a in frames])}, {})
    lattices = np.stack([a.cell.array for a in frames])
    pbc = np.stack([a.pbc for a in frames])

    def run():
        ready = neighbors.prepare("memory", chunk, lattices, pbc)
        out = neighbors.compute(ready, [cutoff], device)
        return int(out["n_pairs"].sum())

    return run


def per_structure(count):
    """A run over the frames counting pairs with `count(atoms)`."""
    return lambda frames, cutoff: lambda: sum(count(a, cutoff) for a in frames)


def _ase(atoms, cutoff):
    from ase.neighborlist import neighbor_list

    return len(neighbor_list("i", atoms, cutoff))


def _vesin(atoms, cutoff):
    import vesin

    i, = vesin.NeighborList(cutoff=cutoff, full_list=True).compute(
        atoms.positions, atoms.cell.array, atoms.pbc, "i")
    return len(i)


def _matscipy(atoms, cutoff):
    from matscipy.neighbours import neighbour_list

    return len(neighbour_list("i", atoms, cutoff))


def nvalchemiops_pairs(positions, n_atoms, lattices, pbc, cutoff, device):
    """nvalchemiops' batched cell list on the GPU over structures of `n_atoms` atoms, its
    counts per atom summed (None without it, torch or a GPU). Through its torch API: its JAX
    API's cell list takes every argument for static under Warp 1.19 and fails."""
    try:
        import torch
        from nvalchemiops.torch.neighbors import batch_cell_list
    except ImportError:
        return None
    if device.platform != "gpu":
        return None
    gpu = torch.device("cuda")
    positions = torch.as_tensor(positions, device=gpu)
    lattices = torch.as_tensor(lattices, device=gpu)
    pbc = torch.as_tensor(pbc, device=gpu)
    idx = torch.as_tensor(np.repeat(np.arange(len(n_atoms)), n_atoms).astype(np.int32),
                          device=gpu)

    def run():
        _, counts, _ = batch_cell_list(positions, cutoff, lattices, pbc, idx, max_neighbors=128)
        return int(counts.sum())

    return run


def arrays(frames):
    """(positions, n_atoms, cells, pbc) of the frames."""
    return (np.concatenate([a.positions for a in frames]), np.array([len(a) for a in frames]),
            np.stack([a.cell.array for a in frames]), np.stack([a.pbc for a in frames]))


def in_memory(args, device):
    frames = cells(args.cells, args.size)
    atoms = sum(len(a) for a in frames)
    print(f"{args.cells} rattled Cu cells of {len(frames[0])} atoms ({atoms} atoms), cutoff "
          f"{args.cutoff} Å, median of {args.runs} runs after a first, segcli on "
          f"{device.platform}\n")
    runs = {"segcli (cell list + Warp kernel)": segcli_pairs(frames, args.cutoff, device)}
    for name, module, count in (("vesin", "vesin", _vesin), ("matscipy", "matscipy", _matscipy),
                                ("ASE neighbor_list", "ase", _ase)):
        if importlib.util.find_spec(module):
            runs[name] = per_structure(count)(frames, args.cutoff)
        else:
            print(f"({name}: not installed)")
    nv = nvalchemiops_pairs(*arrays(frames), args.cutoff, device)
    if nv is not None:
        runs["nvalchemiops batch_cell_list (GPU)"] = nv
    table(runs, atoms, args.runs, lambda name: 1 if name.startswith("ASE") else args.runs)


def table(runs, atoms, n_runs, runs_of):
    rows, times = [], {}
    for name, run in runs.items():
        seconds, pairs = median_time(run, runs_of(name))
        times[name] = seconds
        rows.append((name, seconds, pairs))
    vesin = times.get("vesin")
    print("| library | seconds | M atoms/s | pairs | vesin time / its time |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds, pairs in rows:
        ratio = f"{vesin / seconds:.2f}" if vesin else ""
        print(f"| {name} | {seconds:.4f} | {atoms / seconds / 1e6:.3f} | {pairs} | {ratio} |")


def streamed(args, device):
    import h5py

    from segcli import neighborlist as neighbors
    from segcli.io import open_batch

    per_cell = 4 * args.size ** 3
    count = max(1, args.atoms // per_cell)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "cells.h5"
        template = cells(64, args.size)
        with h5py.File(path, "w") as f:
            f.attrs["format"], f.attrs["version"] = "segcli-batch", 1
            f["structures/n_atoms"] = np.full(count, per_cell, np.int64)
            f["structures/cell"] = np.broadcast_to(template[0].cell.array, (count, 3, 3))
            f["structures/pbc"] = np.ones((count, 3), bool)
            positions = f.create_dataset("atoms/positions", (count * per_cell, 3), np.float64)
            block = np.concatenate([a.positions for a in template])
            for start in range(0, count, len(template)):
                n = min(len(template), count - start)
                positions[start * per_cell:(start + n) * per_cell] = block[:n * per_cell]
        atoms = count * per_cell
        print(f"{count} rattled Cu cells of {per_cell} atoms ({atoms} atoms, "
              f"{path.stat().st_size / 1e6:.0f} MB), cutoff {args.cutoff} Å, streamed from "
              f"a segcli HDF5 file on {device.platform}; vesin over the first 10⁶ atoms\n")

        def segcli_run():
            with open_batch(str(path)) as batch:
                return int(sum(int(stats["n_pairs"].sum()) for _, stats in neighbors.run(
                    batch, [args.cutoff], device)))

        seconds, pairs = median_time(segcli_run, args.runs)
        others = {}
        if importlib.util.find_spec("nvalchemiops") and device.platform == "gpu":
            def nvalchemiops_run():
                total = 0
                per_chunk = max(1, (1 << 21) // per_cell)
                with h5py.File(path) as f:
                    for start in range(0, count, per_chunk):
                        n = min(per_chunk, count - start)
                        rows = f["atoms/positions"][start * per_cell:(start + n) * per_cell]
                        total += nvalchemiops_pairs(
                            rows, np.full(n, per_cell), f["structures/cell"][start:start + n],
                            f["structures/pbc"][start:start + n], args.cutoff, device)()
                return total

            others["nvalchemiops batch_cell_list, read per 2 Mi atoms"] = median_time(
                nvalchemiops_run, args.runs)
        sample = template * max(1, 10 ** 6 // (per_cell * len(template)))
        vesin_seconds, vesin_pairs = median_time(per_structure(_vesin)(sample, args.cutoff), 1)
        vesin_atoms = sum(len(a) for a in sample)
        print("| library | atoms | seconds | M atoms/s | pairs | speed over vesin |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        rate, vesin_rate = atoms / seconds, vesin_atoms / vesin_seconds
        print(f"| segcli neighborlist.run | {atoms} | {seconds:.3f} | {rate / 1e6:.3f} | {pairs} | "
              f"{rate / vesin_rate:.1f} |")
        print(f"| vesin, one core | {vesin_atoms} | {vesin_seconds:.3f} | "
              f"{vesin_rate / 1e6:.3f} | {vesin_pairs} | 1.0 |")
        command_seconds, rss = whole_command(path, args.cutoff, device.platform)
        rate = atoms / command_seconds
        print(f"| `segcli neighbors FILE --cutoff {args.cutoff:g} -q` (a process; peak RSS "
              f"{rss:.0f} MiB) | {atoms} | {command_seconds:.3f} | {rate / 1e6:.3f} |  | "
              f"{rate / vesin_rate:.1f} |")
        for name, (other_seconds, other_pairs) in others.items():
            print(f"| {name} | {atoms} | {other_seconds:.3f} | "
                  f"{atoms / other_seconds / 1e6:.3f} | {other_pairs} | "
                  f"{atoms / other_seconds / vesin_rate:.1f} |")


def whole_command(path, cutoff, platform):
    """(wall seconds, peak RSS in MiB) of `segcli neighbors` on the file, as a process of its
    own (its results to /dev/null)."""
    import subprocess
    import sys

    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "segcli", "neighbors", str(path),
                                "--cutoff", str(cutoff), "-q", "--device", platform],
                               stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"segcli neighbors failed ({status})")
    return seconds, usage.ru_maxrss / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--size", type=int, default=5)
    parser.add_argument("--cutoff", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--atoms", type=int, help="stream a generated file of this many atoms")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    import jax

    device = jax.devices(args.device)[0]
    (streamed if args.atoms else in_memory)(args, device)


if __name__ == "__main__":
    main()
