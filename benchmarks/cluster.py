"""`segcli reduce FILE rms_norm forces`, `segcli stats FILE forces` and `segcli grad FILE sum
forces` (results per atom) on K processes against one:
K shard processes started together (then `segcli merge`, copying and --virtual), `--scheduler
local:K` (which starts its cluster), and `--scheduler ADDRESS` of a LocalCluster of K worker
processes already running (its workers warmed by one run first: the steady state of a
long-lived cluster; they preload segcli.cluster, as `dask worker --preload segcli.cluster`);
with a bare h5py read of the forces by 1 and by K processes as the bound.
Each a fresh process (or set of processes) on a generated file (float64 forces, 1 to 63 atoms
per structure), page cache warm, run in turns; segcli's bytecode is written first, as an
installation has it.

    python benchmarks/cluster.py [--workers 2] [--atoms 10000000] [--runs 3] [--dir /tmp]
                                 [--device cpu|gpu] [--compression gzip] [--gpus]
                                 [--jobs reduce,stats,grad] [--largest 63]
                                 [--before-checkout DIR]
                                 [--worker-threads N]

With --before-checkout, each job also runs in one process, on `--scheduler local:K` and on a
second running cluster, all from the segcli of another checkout (DIR on PYTHONPATH: the
client, and the workers of a cluster started in a process of its own), in the same turns.
Prints a Markdown table: median wall time, speed-up over one process and its share of the
ideal K×, and the peak RSS of each process (the client, and each shard process or worker).
"""

import argparse
import compileall
import glob
import itertools
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from reduce import make_file

READ = """
import sys, h5py
lo, hi, step = (int(a) for a in sys.argv[2:5])
with h5py.File(sys.argv[1], "r", rdcc_nbytes=0) as f:
    forces = f["atoms/forces"]
    for start in range(lo, hi, step):
        forces[start:min(start + step, hi)]
"""

RUNNING_CLUSTER = """
import ast, sys
from distributed import LocalCluster
with LocalCluster(n_workers=int(sys.argv[1]), threads_per_worker=1, processes=True,
                  dashboard_address=":0", preload=["segcli.cluster"],
                  env=ast.literal_eval(sys.argv[2])) as cluster:
    print(cluster.scheduler_address, flush=True)
    sys.stdin.read()
"""


def _tree(root):
    """The pids of `root` and all its descendants (from the parent pids in /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status
                        if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ProcessLookupError):
        return 0


def measure_together(commands):
    """Start `commands` together; (wall seconds until the last one ends, [peak RSS in bytes of
    each command's own process], peak RSS of the largest of their descendants, 0 if none).
    Peaks are the kernel's high-water marks (VmHWM), read every few milliseconds."""
    start = time.perf_counter()
    processes = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for c in commands]
    peaks, child_peak, polls = [0] * len(processes), 0, 0
    while any(p.poll() is None for p in processes):
        for k, p in enumerate(processes):
            peaks[k] = max(peaks[k], _hwm(p.pid))
        if len(processes) == 1 and polls % 10 == 0:  # dask's nannies and workers, less often
            for p in processes:
                for pid in _tree(p.pid) - {p.pid}:
                    child_peak = max(child_peak, _hwm(pid))
        polls += 1
        time.sleep(0.005)
    wall = time.perf_counter() - start
    for command, p in zip(commands, processes):
        if p.returncode:
            raise RuntimeError(f"{command} failed: {p.stderr.read().decode()}")
    return wall, peaks, child_peak


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="K")
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                        help="where reduce computes (every process on the one GPU with gpu)")
    parser.add_argument("--compression", help="compress the forces (e.g. gzip)")
    parser.add_argument("--largest", type=int, default=63,
                        help="structures of 1 to LARGEST atoms (fewer: more structures, whose "
                             "count is what a command's client pays for)")
    parser.add_argument("--gpus", action="store_true",
                        help="K = the visible GPUs: clusters of one worker per GPU (local:gpus)")
    parser.add_argument("--steady", action="store_true",
                        help="also the first half of the file by the bare reads and the running "
                             "cluster: their steady state, free of what a command pays once")
    parser.add_argument("--running-only", action="store_true",
                        help="only the bare reads and the running cluster")
    parser.add_argument("--jobs", default="reduce,stats",
                        help="the commands to run, of reduce, stats and grad")
    parser.add_argument("--before-checkout", metavar="DIR",
                        help="also run one process, local:K and a second running cluster "
                             "(K plain workers, even with --gpus) from this checkout's segcli")
    parser.add_argument("--worker-threads", type=int,
                        help="SEGCLI_THREADS of the running cluster's workers (default: unset, "
                             "as `dask worker` leaves it: each takes the cores, at most 8)")
    parser.add_argument("-v", "--verbose", action="store_true", help="each run's time on stderr")
    args = parser.parse_args()
    from distributed import Client, LocalCluster

    import segcli
    from segcli.cluster import _local_cluster, visible_gpus

    compileall.compile_dir(os.path.dirname(segcli.__file__), quiet=1)

    k = len(visible_gpus()) if args.gpus else args.workers
    local = "local:gpus" if args.gpus else f"local:{k}"

    load = os.getloadavg()
    root = tempfile.mkdtemp(prefix="segcli-cluster-bench-", dir=args.dir)
    cluster = before_cluster = None
    try:
        path = os.path.join(root, "data.h5")
        structures = make_file(path, args.atoms, compression=args.compression,
                               largest=args.largest)
        size = os.path.getsize(path) / 1e6
        with open(path, "rb") as f:  # warm the page cache
            while f.read(1 << 24):
                pass
        parts = os.path.join(root, "parts")
        os.makedirs(parts)
        out = os.path.join(root, "out.h5")
        segcli = [sys.executable, "-m", "segcli"]
        jobs = {
            "reduce": (segcli + ["reduce", path, "rms_norm", "forces", "--device", args.device,
                                 "-q", "--force"], "r"),
            "stats": (segcli + ["stats", path, "forces", "-q", "--force"], "s"),
            "grad": (segcli + ["grad", path, "sum", "forces", "--device", args.device, "-q",
                               "--force"], "g"),
        }
        jobs = {job: jobs[job] for job in args.jobs.split(",")}
        step = 1 << 21
        cuts = [args.atoms * i // k for i in range(k + 1)]
        import h5py

        with h5py.File(path) as f:
            half_atoms = int(f["structures/n_atoms"][:structures // 2].sum())
        half_cuts = [half_atoms * i // k for i in range(k + 1)]

        def clear_parts():
            for name in glob.glob(os.path.join(parts, "*")):
                os.unlink(name)

        # (label, kind, what): kind "one" = one command, "together" = K commands at once
        cases = [
            ("h5py read of the forces, 1 process", "read",
             [[sys.executable, "-c", READ, path, "0", str(args.atoms), str(step)]]),
            (f"h5py read, {k} processes (1/{k} each)", "read",
             [[sys.executable, "-c", READ, path, str(a), str(b), str(step)]
              for a, b in itertools.pairwise(cuts)]),
        ]
        worker_env = {"SEGCLI_THREADS": str(args.worker_threads)} if args.worker_threads else None
        cluster = (_local_cluster(local) if args.gpus else
                   LocalCluster(n_workers=k, threads_per_worker=1, processes=True,
                                dashboard_address=":0", preload=["segcli.cluster"],
                                env=worker_env))
        client = Client(cluster)
        address = cluster.scheduler_address
        before_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.abspath(args.before_checkout or "."), os.environ.get("PYTHONPATH", "")])}
        if args.before_checkout:  # its workers import the other checkout's segcli
            before_cluster = subprocess.Popen(
                [sys.executable, "-c", RUNNING_CLUSTER, str(k), repr(worker_env)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=before_env)
            before_address = before_cluster.stdout.readline().strip()
        if args.steady:
            cases.append((f"h5py read, {k} processes, first half", "read",
                          [[sys.executable, "-c", READ, path, str(a), str(b), str(step)]
                           for a, b in itertools.pairwise(half_cuts)]))
        before = ["env", "PYTHONPATH=" + before_env["PYTHONPATH"]]
        clusters = [("", [], address)] + ([(f", {args.before_checkout}", before, before_address)]
                                          if args.before_checkout else [])
        for job, (base, prefix) in jobs.items():
            for tag, env, at in clusters:  # a running cluster and its client, either checkout
                cases.append((f"{job}: --scheduler ADDRESS (running cluster){tag}", job,
                              [env + base + ["-o", out, "--scheduler", at]]))
                if args.steady:
                    label = f"{job}: --scheduler ADDRESS (running cluster){tag}, first half"
                    cases.append((label, job, [env + base + ["-o", out, "--scheduler", at,
                                                             "--structures",
                                                             f":{structures // 2}"]]))
            if args.running_only:
                continue
            pattern = os.path.join(parts, f"{prefix}-{{shard}}.h5")
            cases += [
                (f"{job}: 1 process", job, [base + ["-o", out]]),
                (f"{job}: {k} shard processes", job,  # with --gpus, each on its own GPU
                 [(["env", f"CUDA_VISIBLE_DEVICES={visible_gpus()[i]}"] if args.gpus else [])
                  + base + ["--shard", f"{i}/{k}", "-o", pattern] for i in range(k)]),
                (f"{job}: merge (copy)", "merge",
                 [segcli + ["merge", os.path.join(parts, f"{prefix}-*.h5"), "-o", out, "-q",
                            "--force"]]),
            ]
            if job != "stats":  # statistics parts merge into new moments, never virtually
                cases.append((f"{job}: merge --virtual", "merge",
                              [segcli + ["merge", os.path.join(parts, f"{prefix}-*.h5"), "-o",
                                         out, "-q", "--force", "--virtual"]]))
            cases += [
                (f"{job}: --scheduler {local}", job,
                 [base + ["-o", out, "--scheduler", local]]),
            ]
            if args.before_checkout:
                cases += [(f"{job}: 1 process, {args.before_checkout}", job,
                           [before + base + ["-o", out]]),
                          (f"{job}: --scheduler {local}, {args.before_checkout}", job,
                           [before + base + ["-o", out, "--scheduler", local]])]
        # warm the running cluster's workers (imports, Warp kernels, compilation) and time it
        first = {}
        for job, (base, _) in jobs.items():
            for tag, env, at in clusters:
                first[job + tag] = measure_together([env + base + ["-o", out, "--scheduler",
                                                                   at]])[0]
        results = {label: [] for label, _, _ in cases}
        for _ in range(args.runs):  # in turns, so that a slow moment hits each alike
            clear_parts()
            for label, _, commands in cases:
                results[label].append(measure_together(commands))
                if args.verbose:
                    print(f"{label}: {results[label][-1][0]:.2f} s", file=sys.stderr)
        worker_peak = max(client.run(
            lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024).values())
    finally:
        if cluster is not None:
            client.close()
            cluster.close()
        if before_cluster is not None:
            before_cluster.communicate("")
        shutil.rmtree(root, ignore_errors=True)

    median = {label: statistics.median(r[0] for r in runs) for label, runs in results.items()}
    print(f"{args.atoms} atoms in {structures} structures, float64 forces ({size:.0f} MB"
          f"{', ' + args.compression if args.compression else ''}), "
          f"K = {k} on {os.cpu_count()} cores, median of {args.runs} runs, page cache warm, "
          f"load average {load[0]:.1f} before and {os.getloadavg()[0]:.1f} after\n")
    print("| run | wall s | speed-up over 1 process | share of ideal K× | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- |")
    base_of = {"read": median["h5py read of the forces, 1 process"],
               **{job: median.get(f"{job}: 1 process") for job in jobs}}
    for label, kind, commands in cases:
        wall = median[label]
        runs = results[label]
        peaks = [max(r[1][i] for r in runs) / 2**20 for i in range(len(commands))]
        child = max(r[2] for r in runs) / 2**20
        if "running cluster" in label:
            rss = f"client {peaks[0]:.0f}, workers ≤ {worker_peak / 2**20:.0f}"
        elif child:
            rss = f"client {peaks[0]:.0f}, workers ≤ {child:.0f}"
        else:
            rss = ", ".join(f"{p:.0f}" for p in peaks)
        if kind == "merge" or "1 process" in label or base_of[kind] is None:
            speed = share = ""
        else:
            shard_label = f"{label.split(':')[0]}: {k} shard processes"
            merged = ""
            speedup = base_of[kind] / wall
            speed, share = f"{speedup:.2f}×", f"{speedup / k:.0%}"
            if label == shard_label:
                copy = median[f"{kind}: merge (copy)"]
                merged = f" ({base_of[kind] / (wall + copy):.2f}× with the merge"
                virtual = median.get(f"{kind}: merge --virtual")
                if virtual is not None:
                    merged += (f" copying, {base_of[kind] / (wall + virtual):.2f}× with "
                               f"--virtual")
                merged += ")"
            speed += merged
        print(f"| {label} | {wall:.2f} | {speed} | {share} | {rss} |")
    read_k = median[f"h5py read, {k} processes (1/{k} each)"]
    for job in jobs:
        running = median[f"{job}: --scheduler ADDRESS (running cluster)"]
        print(f"\n{job} on the running cluster of {k} workers: {read_k / running:.0%} of the "
              f"throughput of the bare read by {k} processes")
    if args.steady:
        def steady(label, half_label):
            return (args.atoms - half_atoms) / (median[label] - median[half_label])

        read = steady(f"h5py read, {k} processes (1/{k} each)", f"h5py read, {k} processes, "
                      "first half")
        for job, (tag, _, _) in itertools.product(jobs, clusters):
            label = f"{job}: --scheduler ADDRESS (running cluster){tag}"
            rate = steady(label, label + ", first half")
            print(f"\n{job} on the running cluster of {k} workers{tag}, steady state (the "
                  f"second half of the file: whole file less first half): {rate / 1e6:.1f} M "
                  f"atoms/s against the {k}-process read's {read / 1e6:.1f} M atoms/s: "
                  f"{rate / read:.0%}")
    for job, seconds in first.items():
        print(f"\n{job}: --scheduler ADDRESS, first run on the fresh cluster (workers import "
              f"JAX and Warp, load kernels): {seconds:.2f} s")


if __name__ == "__main__":
    main()
