"""A chunk's copy to the GPU (48 MiB, 2 Mi atoms of float64 3-vectors) by the routes a run
could take: `jax.device_put` of pageable and of page-locked (pinned) NumPy memory, four such
copies back to back, Warp's and (where installed) PyTorch's copy from pinned memory as the
link's own rate, and `jax.device_put` while 8 threads copy memory (the load of a read by 8
threads). Then from a file's pages (a file of --chunks chunks under --dir, page cache warm):
read by 8 threads into pinned memory, then `jax.device_put` (how a run on a GPU reads a chunk);
and left in the pages, mapped read-only as segcli's windows are (populated at once), locked by
the CUDA driver for the copy (cuMemHostRegister, read-only; each step timed over every chunk:
map, lock, copy, unlock), beside the same map copied unlocked. Needs a CUDA GPU.

    python benchmarks/transfer.py [--rounds 15] [--dir /dev/shm] [--chunks 24]

Prints median ms per copy and GB/s.
"""

import argparse
import concurrent.futures
import ctypes
import os
import statistics
import tempfile
import threading
import time

import jax
import numpy as np
import warp as wp

from segcli.io.direct import _Pages

CHUNK = 48 << 20


def median_seconds(call, rounds):
    call()
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def busy_copies(threads):
    """Start `threads` threads copying 6 MiB arrays until the returned event is set."""
    stop = threading.Event()

    def copy():
        source = np.ones(CHUNK // 64)
        target = np.empty_like(source)
        while not stop.is_set():
            np.copyto(target, source)

    for _ in range(threads):
        threading.Thread(target=copy, daemon=True).start()
    return stop


def driver():
    """(libcuda, lock(address, size) -> error code, unlock(address)) with GPU 0's primary
    context made current in the calling thread by each call."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cuda.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    context = ctypes.c_void_p()
    assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0

    def lock(address, size):
        cuda.cuCtxSetCurrent(context)
        return cuda.cuMemHostRegister_v2(address, size, 0x08)  # CU_MEMHOSTREGISTER_READ_ONLY

    def unlock(address):
        cuda.cuCtxSetCurrent(context)
        return cuda.cuMemHostUnregister(address)

    return cuda, lock, unlock


def from_pages(device, directory, chunks, rounds, show):
    """The routes from a file's pages (see the module)."""
    path = os.path.join(directory, "transfer.bin")
    rng = np.random.default_rng(1)
    with open(path, "wb") as f:
        for _ in range(chunks):
            f.write(rng.random(CHUNK // 8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        _, lock, unlock = driver()
        readers = concurrent.futures.ThreadPoolExecutor(8)
        pinned = wp.empty(CHUNK, dtype=wp.uint8, device="cpu", pinned=True).numpy()
        part = CHUNK // 8

        def read(chunk):
            list(readers.map(lambda k: os.preadv(fd, [memoryview(pinned)[k * part:][:part]],
                                                 chunk * CHUNK + k * part), range(8)))
            jax.device_put(pinned.view(np.float64), device).block_until_ready()

        show("read by 8 threads into pinned memory, then jax.device_put",
             median_seconds(lambda: read(3), rounds))
        steps = {"map": [], "lock": [], "jax.device_put": [], "unlock": []}
        for turn in range(3):
            for chunk in range(chunks):
                times = [time.perf_counter()]
                rows = np.asarray(_Pages(fd, chunk * CHUNK, CHUNK)).view(np.float64)
                times.append(time.perf_counter())
                assert lock(rows.ctypes.data, CHUNK) == 0, "the driver refused to lock the pages"
                times.append(time.perf_counter())
                copied = jax.device_put(rows, device).block_until_ready()
                times.append(time.perf_counter())
                unlock(rows.ctypes.data)
                times.append(time.perf_counter())
                if turn:
                    for name, a, b in zip(steps, times, times[1:]):
                        steps[name].append(b - a)
                if chunk == 0:
                    assert np.array_equal(np.asarray(copied), rows)
                del rows, copied  # unmapped when the last array over the pages goes
        for name, seconds in steps.items():
            show(f"left in the pages, locked: {name}", statistics.median(seconds))
        show("left in the pages, locked: the four steps",
             sum(statistics.median(seconds) for seconds in steps.values()))
        mapped = np.asarray(_Pages(fd, 0, CHUNK)).view(np.float64)
        show("left in the pages, not locked: jax.device_put",
             median_seconds(lambda: jax.device_put(mapped, device).block_until_ready(), rounds))
    finally:
        os.close(fd)
        os.unlink(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--chunks", type=int, default=24)
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)
    wp.init()
    device = jax.devices("gpu")[0]
    pageable = np.random.default_rng(0).random(CHUNK // 8)
    pinned_host = wp.empty(CHUNK, dtype=wp.uint8, device="cpu", pinned=True)
    pinned = pinned_host.numpy().view(np.float64)
    pinned[:] = pageable
    on_gpu = wp.empty(CHUNK, dtype=wp.uint8, device="cuda:0")

    def put(array, copies=1):
        jax.block_until_ready([jax.device_put(array, device) for _ in range(copies)])

    routes = {
        "jax.device_put, pageable memory": lambda: put(pageable),
        "jax.device_put, pinned memory": lambda: put(pinned),
        "jax.device_put, pinned memory, 4 back to back (per copy)": lambda: put(pinned, 4),
        "wp.copy from pinned memory": lambda: (wp.copy(on_gpu, pinned_host),
                                               wp.synchronize_device("cuda:0")),
    }
    try:
        import torch

        source = torch.from_numpy(pinned.view(np.uint8)).pin_memory()
        target = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
        routes["torch copy_ from pinned memory"] = lambda: (target.copy_(source, non_blocking=True),
                                                            torch.cuda.synchronize())
    except ImportError:
        pass
    per_call = {"jax.device_put, pinned memory, 4 back to back (per copy)": 4}
    print(f"{device.device_kind}, {CHUNK >> 20} MiB a copy, medians of {args.rounds}\n")
    print("| route | ms | GB/s |\n| --- | ---: | ---: |")

    def show(name, seconds):
        print(f"| {name} | {seconds * 1e3:.2f} | {CHUNK / seconds / 1e9:.1f} |", flush=True)

    for name, call in routes.items():
        show(name, median_seconds(call, args.rounds) / per_call.get(name, 1))
    stop = busy_copies(8)
    try:
        show("jax.device_put, pinned memory, 8 threads copying memory",
             median_seconds(lambda: put(pinned), args.rounds))
    finally:
        stop.set()
    from_pages(device, args.dir, args.chunks, args.rounds, show)


if __name__ == "__main__":
    main()
