"""Steady-state throughput of `segcli stats FILE forces` (and `--per-element`) against a bare
chunked h5py read of the same datasets, in one process: passes after a first one (imports,
page cache and allocator warm; freed blocks kept for reuse, as in the segcli program), in
turns, medians; the moments in C (segcli/_moments.c) and, beside them, by their NumPy twin
(SEGCLI_NATIVE_STATS=0, the path taken where the C was not built at install). With
--before REV, also the statistics module as it was at git revision REV (loaded as a module
of its own). On a shared machine, a pass during which other processes kept more
than a tenth of a core busy (Linux /proc/stat) is left out and made again.

    python benchmarks/stats_steady.py [--atoms 10000000] [--passes 7] [--before REV] [--dir DIR]

Prints a Markdown table: atoms/s of each and its ratio to the read of the same datasets.
"""

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import tempfile
import time

import h5py
from reduce import make_file
from stats import add_fields

from segcli import keep_freed_buffers
from segcli.curate import statistics as stats
from segcli.io import open_batch

STEP = 1 << 21
"""Rows a bare read takes at a time: the default --chunk-atoms."""
BUSY = 0.1
"""A pass is left out when other processes used more than this share of a core meanwhile."""


def bare_read(path, names):
    """Read the datasets `names` of `path` STEP rows at a time, and the atom counts."""
    with h5py.File(path, "r", rdcc_nbytes=0) as f:
        f["structures/n_atoms"][()]
        for name in names:
            dataset = f[name]
            for lo in range(0, len(dataset), STEP):
                dataset[lo:lo + STEP]


def module_at(revision, directory):
    """The statistics module (segcli/curate/statistics.py, once segcli/stats.py) as it was at
    git `revision`, imported as a module of its own."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("segcli/curate/statistics.py", "segcli/stats.py"):
        shown = subprocess.run(["git", "-C", root, "show", f"{revision}:{name}"],
                               capture_output=True, text=True, check=False)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"{revision}: no statistics module")
    source = shown.stdout
    path = os.path.join(directory, "stats_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("stats_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_native(value):
    """SEGCLI_NATIVE_STATS set to `value` (unset for None) for the statistics from now on."""
    if value is None:
        os.environ.pop("SEGCLI_NATIVE_STATS", None)
    else:
        os.environ["SEGCLI_NATIVE_STATS"] = value
    stats._native_moments.cache_clear()


def cpu_seconds():
    """(CPU seconds of the whole machine, of this process), both busy time."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return ((sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"),
            usage.ru_utime + usage.ru_stime)


def timed(run):
    """(wall seconds of run(), share of a core that other processes used meanwhile)."""
    machine, own = cpu_seconds()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    machine_after, own_after = cpu_seconds()
    return wall, max(0.0, (machine_after - machine) - (own_after - own)) / wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--before", metavar="REV", help="also time the statistics module at REV")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    keep_freed_buffers()  # as the segcli program does
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = os.path.join(directory, "steady.h5")
        make_file(path, args.atoms)
        add_fields(path)
        versions = {"segcli stats": (stats, "1"),
                    "segcli stats, NumPy twin": (stats, "0")}
        if args.before:
            versions[f"segcli stats at {args.before}"] = (module_at(args.before, directory),
                                                         None)
        work = {}
        for label, per_element, names in (("forces", False, ["atoms/forces"]),
                                          ("forces --per-element", True,
                                           ["atoms/forces", "atoms/numbers"])):
            work[label, "bare h5py read"] = lambda names=names: bare_read(path, names)
            for version, (module, native) in versions.items():
                def compute(module=module, native=native, per_element=per_element):
                    with_native(native)
                    with open_batch(path) as batch:
                        module.field_stats(batch, ["forces"], per_element=per_element)
                work[label, version] = compute
        for run in work.values():  # the first pass warms up
            run()
        seconds, left_out = {key: [] for key in work}, 0
        for _ in range(10 * args.passes):  # in turns, so that a slow moment hits each alike
            for key, run in work.items():
                if len(seconds[key]) < args.passes:
                    wall, others = timed(run)
                    if others <= BUSY:
                        seconds[key].append(wall)
                    else:
                        left_out += 1
        print(f"{args.atoms} atoms, float64 forces, 8 elements; median of {args.passes} passes "
              f"after a first, in one process ({left_out} passes left out: other processes "
              f"busy)\n")
        print("| stats of | what | M atoms/s | share of the read |")
        print("| --- | --- | --- | --- |")
        rates = {key: args.atoms / statistics.median(times) if times else float("nan")
                 for key, times in seconds.items()}
        for (label, what), rate in rates.items():
            share = rate / rates[label, "bare h5py read"]
            print(f"| {label} | {what} | {rate / 1e6:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main()
