"""Start-up on a GPU: how long after `import jax` JAX's GPU backend and Warp are both ready,
with the backend started before Warp is imported (one after the other, as segcli did) or
while it is (overlapped, as `segcli.cli.common.device` does), against importing Warp alone.

    python benchmarks/gpu_start.py [--runs 5]

Each case is a fresh process, the cases in turns (one of each per round); prints the median
seconds of each.
"""

import argparse
import statistics
import subprocess
import sys

CASES = {
    "import warp alone": "import warp",
    "backend, then import warp": "jax.devices('gpu'); import warp",
    "backend while importing warp": (
        "import threading; t = threading.Thread(target=jax.devices, args=('gpu',)); t.start(); "
        "import warp; t.join()"),
}
TIMED = ("import time, jax; start = time.perf_counter(); {}; import warp as wp; wp.init(); "
         "print(time.perf_counter() - start)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, code in CASES.items():
            result = subprocess.run([sys.executable, "-c", TIMED.format(code)], check=True,
                                    capture_output=True, text=True)
            times[name].append(float(result.stdout.split()[-1]))
    print("| case | seconds after import jax (median) | each run |\n| --- | ---: | --- |")
    for name, column in times.items():
        print(f"| {name} | {statistics.median(column):.3f} | "
              f"{', '.join(f'{t:.2f}' for t in column)} |")


if __name__ == "__main__":
    main()
