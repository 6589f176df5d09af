"""Chunked evaluation of the ops (`segcli.registry.OPS`) over the fields of a file.

This layer sits between `segcli.ops` (pure math) and the I/O and command layers. It never
imports jax or warp at module level, so the command line starts fast.

    job = plan(path, OPS["rms_norm"], ["forces"], batch.fields)
    for chunk, (outputs,) in run(batch, [job], jax.devices("cpu")[0]):
        outputs[""]  # (structures of the chunk,)

Several jobs given to `run` share one read of the file and one compiled program per chunk.
A run goes jobs → pipeline → program → checks → its caller (the sink):

- `jobs`: what to compute: a Job per op, checked against the file's fields (`plan`); the
  dtypes fields are read in and outputs given in;
- `pipeline`: chunks read and padded into reused host buffers one ahead in a background
  thread (`prefetch`), results written behind (`behind`);
- `program`: one jitted program per set of jobs, launched on a chunk and finished;
- `checks`: NaN, wrapping integer sums, overflows and inexact float64 refused; NaN rows for
  structures that lack a field.
"""

import collections
import contextlib
import itertools

from segcli.engine.checks import (
    blank_absent,
    blanked,
    check_float64,
    check_integer_sum,
    check_overflow,
    nan_checked,
    nan_rows,
    singular,
    whole_kept,
)
from segcli.engine.jobs import (
    PRECISIONS,
    Job,
    field_dtypes,
    job_present,
    nan_dtype,
    plan,
    reads,
    shown_nan,
    whole_selection,
)
from segcli.engine.pipeline import (
    DEFAULT_CHUNK_ATOMS,
    MIN_BUCKET,
    PADDING_BYTES,
    behind,
    bucket,
    buffer_ring,
    lending,
    padded_chunks,
    padded_size,
    prefetch,
)
from segcli.engine.program import HOST_DEVICES, finish, launch, peers, runs_on

__all__ = ["DEFAULT_CHUNK_ATOMS", "HOST_DEVICES", "MIN_BUCKET", "PADDING_BYTES", "PRECISIONS",
           "Job", "behind", "blanked", "bucket", "buffer_ring", "check_float64", "field_dtypes",
           "finish", "job_present", "launch", "lending", "nan_checked", "nan_dtype",
           "padded_size", "peers", "plan", "prefetch", "reads", "run", "runs_on", "shown_nan",
           "singular", "whole_selection"]


def run(batch, jobs, device, *, chunk_atoms=DEFAULT_CHUNK_ATOMS, structures=slice(None),
        on_device=None, keep=None):
    """Yield (Chunk, outputs) for each chunk of whole structures of `batch`, outputs holding
    each of `jobs`' outputs (see finish): every field read once, the next chunk read and
    padded in a background thread, and launched, before this one's outputs are waited for.
    Every chunk is padded to the same power-of-two sizes (`padded_size`): one compilation (per
    device). With `on_device` (default: on GPUs, where it leaves the host thread little but
    the read), the device expands the segment ids and checks for NaN itself; else the
    background thread does. On GPUs the host buffers are pinned. On a CPU the chunks take
    turns on every CPU device of the process (see `peers`), each computing while the others
    do. A chunk's arrays are valid until the next is asked for. With `keep` ((S,) bool), only
    the structures it marks are read into chunks and computed."""
    jobs = tuple(jobs)
    on_device = device.platform != "cpu" if on_device is None else on_device
    devices = peers(device)
    whole = whole_selection(jobs, keep)
    with buffer_ring(device.platform != "cpu") as buffers:
        items = prefetch(padded_chunks(batch, jobs, chunk_atoms, structures, buffers, on_device,
                                        keep, whole))
        with contextlib.closing(items):
            flying = collections.deque()  # (chunk, launch) in flight, one more than devices
            for number, (chunk, padded) in enumerate(items):
                flying.append((chunk, launch(jobs, padded, devices[number % len(devices)])))
                if len(flying) > len(devices):
                    yield _finished(jobs, *flying.popleft(), itertools.chain(
                        [c for c, _ in flying], (c for c, _ in items)), whole)
            while flying:
                yield _finished(jobs, *flying.popleft(), [c for c, _ in flying], whole)


def _finished(jobs, chunk, launched, rest, keep=None):
    """(chunk, outputs) of a launched chunk; DataError counting and naming NaN over it and the
    chunks `rest` (those after it) where the device found one, or a value is NaN that a NaN
    input would make so and the chunk holds one (not where ±inf made it). Of a chunk computed
    whole (see whole_kept), the structures `keep` marks: their results, and the chunk of
    them without its per-atom fields (which no consumer of per-structure results reads)."""
    kept = whole_kept(chunk, keep)
    for job in jobs:
        check_integer_sum(job, chunk, kept)
    outputs, nan = finish(launched, chunk.structure_numbers, kept)
    for job, out in zip(jobs, outputs):
        check_overflow(job, chunk, out, kept)
    read = reads(jobs)
    if nan and any(nan_rows(chunk, name, True, keep) is not None for name in read):
        for _ in nan_checked(jobs[0].path, itertools.chain([chunk], rest), read,
                             where_present=True, keep=keep):  # counted and named, the rest too
            pass
    outputs = tuple(blank_absent(job, chunk, out) for job, out in zip(jobs, outputs))
    if kept is None or kept.all():
        return chunk, outputs
    return (chunk._replace(atoms={}).take(kept),
            tuple({label: array[kept] for label, array in out.items()} for out in outputs))
