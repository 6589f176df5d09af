"""Start-up: the wall time of short segcli commands, each a fresh process, against the time
Python takes to import JAX and Warp.

    python benchmarks/startup.py [--runs 15] [--device auto|cpu|gpu] [--dir /tmp]

Runs, in turns (one of each per round, so that a slow moment of a shared machine falls on
all of them), `python -c pass`, `import jax`, `import jax, warp`, `segcli --help`, and
`segcli reduce FILE rms_norm forces`, `segcli grad FILE rms_norm forces` and `segcli stats
FILE forces` on a 16-atom file, these with an empty compilation cache (cold: a new
SEGCLI_COMPILATION_CACHE directory each run) and with one a first run filled (warm), and
`segcli select` and `segcli convert` of that file into a new HDF5 file. Warp's
kernel cache is warm throughout (the first runs fill it), and segcli's bytecode is written
first, as an installation has it. Prints a Markdown table: the median wall and CPU time of
each, and its fixed cost: that median less the one of `import jax, warp`.
"""

import argparse
import compileall
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

from reduce import make_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds(command, env):
    """(wall, CPU) seconds of one run of `command` (CPU: user and system time, which a busy
    machine inflates less than the wall time); RuntimeError if it fails or writes to stderr."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    errors = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.stderr.close()
    if status or errors:
        raise RuntimeError(f"{command} (wait status {status}): {errors.decode()}")
    return wall, usage.ru_utime + usage.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    compileall.compile_dir(os.path.join(ROOT, "segcli"), quiet=1)
    with tempfile.TemporaryDirectory(prefix="segcli-startup-", dir=args.dir) as work:
        median = measure(work, args.runs, args.device)

    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"JAX {version('jax')}, Warp {version('warp-lang')}, device {args.device}; "
          f"16-atom file, median of {args.runs} runs\n")
    print("| command | wall s | fixed cost s | CPU s | fixed cost CPU s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = median["import jax, warp"]
    for name, times in median.items():
        fixed = name.startswith("segcli ") and "--help" not in name
        print(f"| {name} | " + " | ".join(
            f"{t:.3f} | " + (f"{t - b:+.3f}" if fixed else "") for t, b in zip(times, base)) + " |")


def measure(work, runs, device):
    """{command: (median wall, median CPU seconds)} over `runs` rounds, the files in `work`."""
    small = os.path.join(work, "small.h5")
    make_file(small, 16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        ROOT, os.environ.get("PYTHONPATH")]))}
    python, segcli = [sys.executable, "-c"], [sys.executable, "-m", "segcli"]
    on = ["--device", device]
    commands = {
        "python -c pass": (python + ["pass"], None),
        "import jax": (python + ["import jax"], None),
        "import jax, warp": (python + ["import jax, warp"], None),
        "segcli --help": (segcli + ["--help"], None),
    }
    for name, tail in (("reduce", ["rms_norm", "forces", *on]),
                       ("grad", ["rms_norm", "forces", *on]), ("stats", ["forces"])):
        for cache in ("cold", "warm"):
            commands[f"segcli {name} ({cache} cache)"] = (segcli + [name, small, *tail], cache)
    out, listed = os.path.join(work, "out.h5"), os.path.join(work, "structures.txt")
    with open(listed, "w") as f:
        f.write("0\n")
    commands["segcli select -o OUT.h5"] = (segcli + ["select", small, "--structures-from", listed,
                                                     "-o", out, "--force", "-q"], None)
    commands["segcli convert -o OUT.h5"] = (segcli + ["convert", small, "-o", out, "--force",
                                                      "-q"], None)

    warm = os.path.join(work, "warm")
    for command, cache in commands.values():
        if cache == "warm":
            seconds(command, {**env, "SEGCLI_COMPILATION_CACHE": warm})
    times = {name: [] for name in commands}
    for _ in range(runs):
        for name, (command, cache) in commands.items():
            extra = {}
            if cache:
                extra["SEGCLI_COMPILATION_CACHE"] = (warm if cache == "warm"
                                                     else tempfile.mkdtemp(dir=work))
            times[name].append(seconds(command, {**env, **extra}))
    return {name: tuple(statistics.median(column) for column in zip(*t))
            for name, t in times.items()}


if __name__ == "__main__":
    main()
