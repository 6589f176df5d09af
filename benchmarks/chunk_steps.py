"""Where one chunk's time goes in `segcli reduce FILE rms_norm forces`: read, pad, copy to the
device, kernels, copy back (each timed alone, with a fresh chunk read without the engine's
in-place reads); the prefetch thread's work per chunk as engine.run does it (read in place,
NaN check, pad); and engine.run's time per chunk, reading and computing overlapped.

    python benchmarks/chunk_steps.py [--atoms 10000000] [--device auto|cpu|gpu] [--dir /tmp]
                                     [--threads K]

Uses the file `benchmarks/reduce.py` generates (made here if missing). Every number is taken
after a first pass, so imports, compilation and buffer allocation are left out.
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from reduce import make_file


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=10_000_000)
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--threads", type=int, help="threads reading the file (default: the "
                                                    "cores, at most 8)")
    args = parser.parse_args()
    path = os.path.join(args.dir, f"segcli-bench-{args.atoms}.h5")
    if not os.path.exists(path):
        make_file(path, args.atoms)

    import jax

    from segcli import engine, threads
    from segcli._jax import enable_x64
    from segcli.engine import pipeline, program
    from segcli.io import open_batch
    from segcli.registry import OPS

    threads.set_count(args.threads)

    device = jax.devices(args.device)[0] if args.device != "auto" else jax.devices()[0]
    gpu = device.platform != "cpu"  # pinned buffers, NaN checked on the device: as engine.run
    with open_batch(path) as batch:
        job = engine.plan(path, OPS["rms_norm"], ["forces"], batch.fields)
        runs = []
        for _ in range(4):
            start, chunks = time.perf_counter(), 0
            for _ in engine.run(batch, [job], device):
                chunks += 1
            runs.append((time.perf_counter() - start) / chunks)
        producer = []  # the prefetch thread's work per chunk: read, NaN check and pad
        ring = pipeline.BufferRing(pinned=gpu)  # reused, as a run reuses its ring
        for _ in range(4):
            start, chunks = time.perf_counter(), 0
            for _ in pipeline.padded_chunks(batch, [job], engine.DEFAULT_CHUNK_ATOMS,
                                            slice(None), ring, on_device=gpu):
                chunks += 1
            producer.append((time.perf_counter() - start) / chunks)
        least = engine.padded_size(batch.n_atoms, engine.DEFAULT_CHUNK_ATOMS)
        ring = pipeline.BufferRing(pinned=gpu)
        function = program._compiled((job.program(job.read),), gpu)
        steps = {k: [] for k in ("read", "pad", "device_put", "kernels", "to host")}
        for k in range(5):
            t0 = time.perf_counter()
            chunk = next(batch.iter_chunks(list(job.read), chunk_atoms=engine.DEFAULT_CHUNK_ATOMS))
            t1 = time.perf_counter()
            padded = pipeline._pad(engine.field_dtypes([job]), chunk, least, ring, gpu)
            t2 = time.perf_counter()
            with enable_x64(True):
                forces, offsets = jax.block_until_ready(jax.device_put(
                    (padded.arrays["forces"], padded.offsets), device, may_alias=True))
                t3 = time.perf_counter()
                out = jax.block_until_ready(function((forces,), offsets, rows=padded.rows,
                                                     num_segments=padded.segments))
                t4 = time.perf_counter()
                jax.tree.map(np.asarray, out)
                t5 = time.perf_counter()
            if k >= 2:  # the first two fill the ring (the last chunk's are held while padding)
                for name, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    steps[name].append(seconds)
    print(f"{device}, {args.atoms} atoms, chunks of {engine.DEFAULT_CHUNK_ATOMS} atoms, float64, "
          f"{threads.count()} threads; median ms per chunk")
    print("| " + " | ".join(steps) + " | prefetch thread per chunk | engine.run per chunk |")
    print("|" + " --- |" * (len(steps) + 2))
    print("| " + " | ".join(f"{statistics.median(v) * 1e3:.1f}" for v in steps.values())
          + f" | {statistics.median(producer[1:]) * 1e3:.1f}"
          + f" | {statistics.median(runs[1:]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
