"""A chunk's copy to the GPU (48 MiB, 2 Mi atoms of float64 3-vectors) by the routes a run
could take: `jax.device_put` of pageable and of page-locked (pinned) NumPy memory, four such
copies back to back, Warp's and (where installed) PyTorch's copy from pinned memory as the
link's own rate, and `jax.device_put` while 8 threads copy memory (the load of a read by 8
threads). Needs a CUDA GPU.

    python benchmarks/transfer.py [--rounds 15]

Prints median ms per copy and GB/s.
"""

import argparse
import statistics
import threading
import time

import jax
import numpy as np
import warp as wp

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
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


if __name__ == "__main__":
    main()
