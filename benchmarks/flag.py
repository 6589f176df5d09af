"""segcli.ops with and without `XLA_FLAGS=--xla_gpu_graph_min_graph_size=1`: `benchmarks/ops.py`
run in fresh processes, without and with the flag in turns (XLA reads its flags once per
process), and its tables joined cell by cell.

    python benchmarks/flag.py [--rounds 2] [--atoms 10000,100000,10000000] -- [ops.py options]

Every option after `--` goes to ops.py (e.g. `--dtype float32 --ops rms_norm --layout sorted
--impls segcli,jax`). Prints, per N, each cell's throughput µs a call without the flag and
with it (one value a round), the ratio of their medians, and segcli's ratio to pure JAX in
the same process (where ops.py ran pure JAX beside it): calls this small cost their launch,
which moves between processes more than between implementations in one process, so the
ratio to pure JAX run in turns with segcli is the steadier comparison.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

FLAG = "--xla_gpu_graph_min_graph_size=1"


def cells(path):
    """{(op, dtype, mode): (segcli throughput µs, pure JAX throughput µs or None)} of an ops.py
    table."""
    out = {}
    with open(path) as fh:
        lines = [line for line in fh if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    ours, theirs = head.index("segcli µs"), head.index("jax µs") if "jax µs" in head else None
    for line in lines[1:]:
        c = [x.strip() for x in line.strip().strip("|").split("|")]

        def throughput(cell):
            return float(cell.split("/")[1]) if "/" in cell else None

        out[tuple(c[:3])] = (throughput(c[ours]),
                             throughput(c[theirs]) if theirs is not None else None)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--atoms", default="10000,100000,10000000")
    parser.add_argument("ops_options", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extra = [a for a in args.ops_options if a != "--"]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops.py")
    plain = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as tmp:
        for atoms in args.atoms.split(","):
            runs = {"none": [], "flag": []}
            for round_ in range(args.rounds):
                for which, env in (("none", plain), ("flag", {**plain, "XLA_FLAGS": FLAG})):
                    out = os.path.join(tmp, f"{which}-{atoms}-{round_}.md")
                    subprocess.run([sys.executable, script, "--atoms", atoms, *extra, "--out", out],
                                   env=env, check=True, stdout=subprocess.DEVNULL)
                    runs[which].append(cells(out))
            print(f"\nN = {int(atoms):,}, {args.rounds} rounds; throughput µs a call\n")
            print("| op | dtype | mode | no flag | flag | no flag / flag | segcli / pure JAX, "
                  "no flag | segcli / pure JAX, flag |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for key in runs["none"][0]:
                none, flag = ([r[key] for r in runs[which]] for which in ("none", "flag"))
                ratio = (statistics.median(o for o, _ in none)
                         / statistics.median(o for o, _ in flag))
                print(f"| {' | '.join(key)} | {_listed(f'{o:.0f}' for o, _ in none)} | "
                      f"{_listed(f'{o:.0f}' for o, _ in flag)} | {ratio:.2f} | "
                      f"{_listed(f'{o / j:.2f}' for o, j in none if j)} | "
                      f"{_listed(f'{o / j:.2f}' for o, j in flag if j)} |", flush=True)


def _listed(values):
    return ", ".join(values) or "—"

if __name__ == "__main__":
    main()
