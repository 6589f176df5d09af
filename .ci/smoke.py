"""The commands that the lowest allowed dependencies (and extras cluster, lmdb) must run: each is run with the `segcli` of two
installations (the lowest allowed versions, and the current ones) and their outputs compared,
numbers to 1e-6 relative; exit 1 naming the first command that fails or differs.

    python .ci/smoke.py LOW_BIN_DIR HIGH_BIN_DIR
"""

import json
import os
import re
import subprocess
import sys
import tempfile

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample_data")
COMMANDS = [
    "info {s}/metals.h5 --json",
    "info {s}/conformers.h5 --json",
    "reduce {s}/metals.h5 rms_norm forces",
    "reduce {s}/metals.h5 sum forces + mean forces + max_norm forces --format json",
    "reduce {s}/metals.h5 matvec scaled_positions cell --structures :5",
    "reduce {s}/metals.extxyz var forces --format csv",
    "grad {s}/metals.h5 rms_norm forces --structures :3 --format csv",
    "grad {s}/metals.h5 max_norm forces --order 2 --direction momenta --structures :3 --format csv",
    "gradcheck {s}/metals.h5 --op rms_norm --order 2 --structures :4",
    "stats {s}/metals.h5 forces energy --json",
    "stats {s}/metals.h5 forces --per-element --json",
    "fit-e0 {s}/metals.h5 --json",
    "neighbors {s}/metals.h5 --cutoff 3 --format csv",
    "convert {s}/metals.extxyz -o {t}/m.h5",
    "reduce {t}/m.h5 rms_norm forces",
    "select {s}/metals.h5 --where 'energy < 1' -o {t}/low.h5",
    "info {t}/low.h5 --json",
    "convert {s}/metals.h5 -o {t}/m.db",
    "reduce {t}/m.db sum forces",
    "reduce {t}/m.aselmdb rms_norm forces",
    "stats {s}/metals.h5 forces --scheduler local:2 --json",
]
ASELMDB = ("import ase.db, ase.io, sys; db = ase.db.connect(sys.argv[2]); "
           "[db.write(a) for a in ase.io.iread(sys.argv[1])]")
NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf")


def run(bin_dir, command, tmp):
    line = command.format(s=SAMPLE, t=tmp)
    result = subprocess.run(f"{bin_dir}/segcli {line}", shell=True, capture_output=True,
                            text=True, timeout=600)
    if result.returncode:
        sys.exit(f"{bin_dir}/segcli {line}: exit {result.returncode}\n{result.stderr[-2000:]}")
    out = result.stdout.replace(tmp, "TMP")
    return NUMBER.sub("#", out), [float(x) for x in NUMBER.findall(out)]


def same(a, b):
    return a == b or abs(a - b) <= 1e-6 * max(abs(a), abs(b)) or (a != a and b != b)


def main(low, high):
    with tempfile.TemporaryDirectory() as t_low, tempfile.TemporaryDirectory() as t_high:
        for bin_dir, tmp in [(low, t_low), (high, t_high)]:  # written by each one's ase-db-backends
            subprocess.run([f"{bin_dir}/python", "-c", ASELMDB, f"{SAMPLE}/metals.extxyz",
                            f"{tmp}/m.aselmdb"], check=True)
        for command in COMMANDS:
            (text_low, numbers_low) = run(low, command, t_low)
            (text_high, numbers_high) = run(high, command, t_high)
            differs = text_low != text_high or not (
                len(numbers_low) == len(numbers_high)
                and all(map(same, numbers_low, numbers_high)))
            if differs:
                sys.exit(f"segcli {command}: the two installations differ")
            print(f"ok  segcli {command}")
    print(json.dumps({"commands": len(COMMANDS)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
