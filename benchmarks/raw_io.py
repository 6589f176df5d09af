"""What the machine's page cache gives without HDF5: a chunk of 48 MiB (2 Mi atoms of float64
3-vectors) read with `os.preadv` by K threads of one process (into pageable memory, and into
pinned memory where Warp sees a GPU) and by K processes, and written with h5py and with
`os.pwritev` by K threads: the bounds of segcli's reading threads and of its per-atom outputs.

    python benchmarks/raw_io.py [--dir /dev/shm] [--chunks 24] [--rounds 3]

Prints a Markdown table: median ms per 48 MiB and GB/s.
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import tempfile
import time

import h5py
import numpy as np

CHUNK = 48 << 20


def _parts(k):
    return [(j * CHUNK // k, (j + 1) * CHUNK // k) for j in range(k)]


def read_by_threads(pool, k, path, chunks, buffer):
    """Each chunk of the file read into `buffer`, in k parts at once."""
    fd = os.open(path, os.O_RDONLY)
    view = memoryview(buffer).cast("B")
    for i in range(chunks):
        list(pool.map(lambda p, i=i: os.preadv(fd, [view[p[0]:p[1]]], i * CHUNK + p[0]),
                      _parts(k)))
    os.close(fd)


def read_share(path, chunks, j, k):
    """Part j of k of every chunk, by this process."""
    fd = os.open(path, os.O_RDONLY)
    a, b = _parts(k)[j]
    view = memoryview(bytearray(b - a))
    for i in range(chunks):
        os.preadv(fd, [view], i * CHUNK + a)
    os.close(fd)


def write_by_threads(pool, k, path, chunks, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    view = memoryview(data).cast("B")
    for i in range(chunks):
        list(pool.map(lambda p, i=i: os.pwritev(fd, [view[p[0]:p[1]]], i * CHUNK + p[0]),
                      _parts(k)))
    os.close(fd)


def write_h5py(path, chunks, data):
    rows = len(data)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("r", (chunks * rows, 3), np.float64)
        for i in range(chunks):
            ds[i * rows:(i + 1) * rows] = data


def pinned():
    """A pinned buffer of CHUNK bytes where Warp sees a GPU, else None."""
    try:
        import warp as wp

        from segcli.ops.kernels import pinned_bytes
    except ImportError:
        return None
    return pinned_bytes(CHUNK) if wp.is_cuda_available() else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                        else tempfile.gettempdir())
    parser.add_argument("--chunks", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = sorted({1, 2, 4, 8, min(16, os.cpu_count() or 1)})
    source = os.path.join(args.dir, "segcli-raw-io.bin")
    target = os.path.join(args.dir, "segcli-raw-io-out")
    with open(source, "wb") as f:
        for i in range(args.chunks):
            f.write(np.random.default_rng(i).bytes(CHUNK))
    data = np.random.default_rng(0).normal(size=(CHUNK // 24, 3))
    buffers = {"pageable": np.ones(CHUNK, np.uint8)}
    if (buffer := pinned()) is not None:
        buffer[:] = 1
        buffers["pinned"] = buffer
    work = {}
    for k in counts:
        pool = concurrent.futures.ThreadPoolExecutor(k)
        for name, buffer in buffers.items():
            work[f"read, {k} threads, {name}"] = (
                lambda pool=pool, k=k, buffer=buffer:
                read_by_threads(pool, k, source, args.chunks, buffer))
        work[f"write, {k} threads (os.pwritev)"] = (
            lambda pool=pool, k=k: write_by_threads(pool, k, target, args.chunks, data))
    processes = {k: concurrent.futures.ProcessPoolExecutor(
        k, mp_context=multiprocessing.get_context("spawn")) for k in counts if k > 1}
    for k, pool in processes.items():
        list(pool.map(read_share, [source] * k, [1] * k, range(k), [k] * k))  # start them
        work[f"read, {k} processes"] = (lambda pool=pool, k=k: list(pool.map(
            read_share, [source] * k, [args.chunks] * k, range(k), [k] * k)))
    work["write, h5py"] = lambda: write_h5py(target + ".h5", args.chunks, data)
    seconds = {name: [] for name in work}
    for _ in range(args.rounds):
        for name, run in work.items():
            for path in (target, target + ".h5"):
                if os.path.exists(path):
                    os.remove(path)
            start = time.perf_counter()
            run()
            seconds[name].append((time.perf_counter() - start) / args.chunks)
    for pool in processes.values():
        pool.shutdown()
    for path in (source, target, target + ".h5"):
        if os.path.exists(path):
            os.remove(path)
    print(f"{os.cpu_count()} cores, {args.dir}, {args.chunks} chunks of 48 MiB, median of "
          f"{args.rounds} rounds\n")
    print("| what | ms per 48 MiB | GB/s |")
    print("| --- | ---: | ---: |")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"| {name} | {median * 1e3:.2f} | {CHUNK / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
