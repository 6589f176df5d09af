"""How a run's chunks move through the host: read into and padded in reused buffers (a
BufferRing) to one of a few bucket sizes, one chunk ahead in a background thread
(`prefetch`), results written behind the computation (`behind`).

    with buffer_ring(pinned=False) as buffers:
        for chunk, padded in prefetch(padded_chunks(batch, jobs, DEFAULT_CHUNK_ATOMS,
                                                    slice(None), buffers)):
            ...  # padded.arrays: the chunk's fields, cast and padded (see _Padded)
"""

import collections
import contextlib
import math
import queue
import sys
import threading
from typing import NamedTuple

import numpy as np

from segcli.engine.checks import nan_checked
from segcli.engine.jobs import field_dtypes, shown_nan
from segcli.errors import DataError

DEFAULT_CHUNK_ATOMS = 1 << 21
"""Atoms per chunk: 2 Mi atoms of (N, 3) float64 are 48 MiB per field."""
MIN_BUCKET = 1024


def bucket(n):
    """The padded size of a chunk axis of n rows: the next power of two, at least MIN_BUCKET, so
    that any file compiles one of a handful of shapes rather than one per chunk."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def prefetch(iterable):
    """The items of `iterable`, each produced by a background thread while the caller works on
    the one before (one item ahead, no more). An exception of the producer is raised in the
    caller; a caller that stops early stops the producer."""
    items = queue.SimpleQueue()
    room = threading.Semaphore(0)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in iterable:
                items.put((item, None))
                room.acquire()
                if stop.is_set():
                    return
            items.put((done, None))
        except BaseException as err:  # noqa: BLE001  (handed to the caller)
            items.put((done, err))

    worker = threading.Thread(target=produce, name="segcli-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item, err = items.get()
            if err is not None:
                raise err
            if item is done:
                return
            room.release()
            yield item
    finally:
        stop.set()
        room.release()
        worker.join()


@contextlib.contextmanager
def behind(consume):
    """A function that hands its arguments to `consume`, which a background thread calls with
    them, in order, while the caller goes on (one call waiting, no more). Leaving the block
    waits for every call handed over; an exception of `consume` is raised in the caller, at
    its next hand-over or on leaving, and stops the calls after it; an exception of the
    caller's stops them after the one in progress."""
    calls = queue.Queue(maxsize=1)
    stop = threading.Event()
    failed = []

    def work():
        while (args := calls.get()) is not None:
            if stop.is_set():
                continue
            try:
                consume(*args)
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                failed.append(err)
                stop.set()

    def hand_over(*args):
        if failed:
            raise failed[0]
        calls.put(args)

    worker = threading.Thread(target=work, name="segcli-behind", daemon=True)
    worker.start()
    try:
        yield hand_over
    except BaseException:
        stop.set()
        raise
    finally:
        calls.put(None)
        worker.join()
    if failed:
        raise failed[0]


class BufferRing:
    """Host buffers reused from chunk to chunk, so that steady state allocates nothing: no page
    faults. A buffer is handed out again only once nothing refers to it: not the chunk read
    or padded into it, not a device array that aliases it (XLA's CPU client) or whose copy
    from it may still run (a GPU's), not a result on its way to a file. Aligned to 64 bytes,
    which lets XLA's CPU client take them without a staging copy; with `pinned`, in
    page-locked memory, which a GPU copies from 8× faster than from pageable."""

    def __init__(self, pinned=False):
        self._buffers = {}  # (key, shape, dtype) -> [(buffer, owner, references when idle)]
        self._lent = {}  # buffer address -> rows lent to a reader
        self._windows = collections.deque(maxlen=8)  # the last memory.Windows asked for
        self.pinned = pinned

    def take(self, key, shape, dtype):
        """A buffer `key` (any hashable) of `shape` and `dtype` that nothing else refers to:
        a view, which holds it (as do the views made of it) for as long as it lives."""
        key = (key, tuple(shape), np.dtype(dtype))
        entries = self._buffers.setdefault(key, [])
        for buffer, owner, idle in entries:
            if sys.getrefcount(owner) == idle:
                return buffer.view()
        buffer = _aligned(int(np.prod(shape)) * key[2].itemsize, self.pinned)
        buffer = buffer.view(key[2]).reshape(shape)
        owner = buffer[:0].base  # what every view of the buffer refers to
        entries.append((buffer, owner, None))
        idle = sys.getrefcount(owner)  # the references the loop above counts: none outside
        entries[-1] = (buffer, owner, idle)
        return buffer.view()

    def lend(self, key, shape, dtype, rows):
        """The first `rows` rows of a buffer `key`, for a reader to fill (see `holding`)."""
        buffer = self.take(key, shape, dtype)
        self._lent[buffer.ctypes.data] = rows
        return buffer[:rows]

    def window(self, key, shape, dtype, rows):
        """An segcli.memory.Window of `shape` for a reader to map, else to read `rows` rows into a
        buffer `key` (see `lend`); found again by `windowed`."""
        from segcli.memory import Window

        window = Window(shape[0], self.lend(key, shape, dtype, rows))
        self._windows.append(window)
        return window

    def windowed(self, array):
        """The segcli.memory.Window whose rows for its chunk `array` is (given once, then forgotten
        here), or None."""
        window = next((w for w in self._windows if w.holds(array)), None)
        if window is not None:
            self._windows.remove(window)
        return window

    def holding(self, array):
        """A view of the whole buffer whose lent rows `array` is, exactly (not a part of
        them), or None."""
        for entries in self._buffers.values():
            for buffer, _, _ in entries:
                if (buffer.ctypes.data == array.ctypes.data and buffer.dtype == array.dtype
                        and buffer.shape[1:] == array.shape[1:]
                        and self._lent.get(buffer.ctypes.data) == len(array)):
                    return buffer.view()
        return None


def _aligned(size, pinned):
    """`size` bytes (uint8) at an address that is a multiple of 64; page-locked if `pinned`."""
    if pinned:
        from segcli.ops.kernels import pinned_bytes

        raw = pinned_bytes(size + 64)
    else:
        raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size]


@contextlib.contextmanager
def buffer_ring(pinned, user=None):
    """A BufferRing (pinned or not) for one run of `user` (None: engine.run), the one the last
    such run left if any, and left in turn for the next: a worker running many shards
    allocates, and pins, its buffers once."""
    buffers = _SPARE_RINGS.pop((user, pinned), None) or BufferRing(pinned=pinned)
    try:
        yield buffers
    finally:
        _SPARE_RINGS[(user, pinned)] = buffers


_SPARE_RINGS = {}
"""(user, pinned) -> the BufferRing the last run of `user` left (see buffer_ring)."""


class _Padded(NamedTuple):
    """A chunk's inputs on the host, cast and padded to bucket sizes: `segments` (S_b) rows per
    structure and `rows` (N_b) per atom, the chunk's atoms at rows [skip, skip + n_rows) (skip:
    the rows ahead of them in a window of the file's pages, see segcli.memory.Window), the rows
    around them in segment -1 ahead and S_b after (out of range, so dropped by the ops).
    `offsets` (S_b + 1,) are the segments' CSR offsets, padding ones empty, which the device
    expands into ids itself (ops.segments_of_offsets). With `device_checks_nan` the device
    looks for NaN in the values, which the host has not."""

    n_structures: int
    n_rows: int
    segments: int
    rows: int
    offsets: np.ndarray
    arrays: dict
    skip: int = 0
    device_checks_nan: bool = False


def _pad(dtypes, chunk, least, buffers, device_checks_nan=False):
    """The chunk's fields (name -> dtype `dtypes`, see field_dtypes), cast and padded (see
    _Padded) to at least `least` = (rows, structures), in `buffers`,
    or where the chunk was read in place or left in the file's pages (see padded_chunks); the
    rows of structures that lack a field (Chunk.present) hold 0, not its fill."""
    n_structures, n_rows = len(chunk.n_atoms), int(chunk.n_atoms.sum())
    rows, segments = max(least[0], bucket(n_rows)), max(least[1], bucket(n_structures))
    windows = {name: buffers.windowed(data) for name, data in chunk.atoms.items()
               if name in dtypes and name not in chunk.present}
    windows = {name: w for name, w in windows.items() if w is not None
               and w.array.shape[0] == rows and w.array.dtype == dtypes[name]}
    skip = next((w.skip for w in windows.values()), 0)  # where the first window has the rows
    offsets = buffers.take("offsets", (segments + 1,), np.int32)
    offsets[0] = 0
    np.cumsum(chunk.n_atoms, out=offsets[1:n_structures + 1])
    offsets[n_structures + 1:] = n_rows
    offsets += skip
    arrays = {}
    for name, dtype in dtypes.items():
        per_atom = name in chunk.atoms
        data = chunk.atoms[name] if per_atom else chunk.structures[name]
        if name in windows and windows[name].skip == skip:
            arrays[name] = windows[name].array  # read-only: its padding is the file's rows
            continue
        shape = (rows if per_atom else segments, *data.shape[1:])
        out = buffers.holding(data) if per_atom and not skip else None
        at = skip if per_atom else 0
        if out is None or out.shape != shape or out.dtype != dtype:
            out = buffers.take(("pad", name), shape, dtype)
            out[at:at + len(data)] = data
        out[:at] = 0
        out[at + len(data):] = 0
        if name in chunk.present:
            have = chunk.present[name]
            out[at:at + len(data)][~np.repeat(have, chunk.n_atoms) if per_atom else ~have] = 0
        arrays[name] = out
    return _Padded(n_structures, n_rows, segments, rows, offsets, arrays, skip,
                   device_checks_nan)


PADDING_BYTES = 1 << 26
"""Bytes of per-structure outputs beyond which a chunk's structures are padded to no more than
the largest chunk's count (not to its bucket), so that padding never multiplies a wide output
(bincount's rows of --length counts)."""


def padded_size(n_atoms, chunk_atoms, structure_bytes=0):
    """(rows, structures) every chunk of structures with `n_atoms` atoms is padded to: the
    buckets of the largest chunk, so that a whole run compiles once; the structures only to the
    largest chunk's count where, at `structure_bytes` of outputs each, the bucket would take
    more than PADDING_BYTES."""
    from segcli.memory import plan_chunks

    bounds = np.array(plan_chunks(n_atoms, chunk_atoms))
    atoms = np.diff(np.concatenate([[0], np.cumsum(n_atoms)])[bounds])
    structures = int(np.diff(bounds).max(initial=0))
    padded = bucket(structures)
    if padded * structure_bytes > PADDING_BYTES:
        padded = max(structures, 1)
    return bucket(int(atoms.max(initial=0))), padded


def _structure_bytes(jobs):
    """Bytes that one structure's per-structure outputs of `jobs` take on the device and on the
    host together."""
    return sum(2 * dtype.itemsize * math.prod(shape) for job in jobs
               for per, shape, dtype in job.outputs.values() if per == "structure")


def _check_output_memory(jobs, structures):
    """DataError when the per-structure outputs of `jobs` for a chunk of `structures`
    (padded) cannot fit in the memory available, naming the op's params that make them wide
    (bincount's --length)."""
    from segcli.memory import available_memory

    need, have = structures * _structure_bytes(jobs), available_memory()
    if need <= have:
        return
    widest = max(jobs, key=lambda job: _structure_bytes((job,)))
    params = ", ".join(f"--{name} {value}" for name, value in widest.params.items())
    raise DataError(f"{widest.path}: {widest.spec.name}{f' with {params}' if params else ''} "
                    f"needs {need} bytes for the outputs of a chunk of {structures} structures, "
                    f"more than the {have} bytes of memory available"
                    + (f"; give a smaller {params.split()[0]}" if params else ""))


def lending(buffers, dtypes, fields, least_rows, windows=False):
    """An `into` for Batch.iter_chunks: a buffer of `buffers` (a BufferRing), padded to at
    least `least_rows` rows (a bucket), to read the next piece of per-atom field `name`
    (fields[name] its FieldInfo) into as dtypes[name]; None for other fields. With `windows`,
    a field stored as dtypes[name] is asked for as an segcli.memory.Window of that many rows (left
    in the file's pages where the reader can, else read into the buffer)."""

    def into(name, rows):
        if name not in dtypes:
            return None
        shape = (max(least_rows, bucket(int(rows))), *fields[name].shape)
        if windows and fields[name].dtype == dtypes[name]:
            return buffers.window(("read", name), shape, dtypes[name], rows)
        return buffers.lend(("read", name), shape, dtypes[name], rows)

    return into


def padded_chunks(batch, jobs, chunk_atoms, structures, buffers, on_device=False, keep=None,
                   whole=None):
    """(Chunk, _Padded) for each chunk (of the structures `keep` marks, see Batch.iter_chunks;
    or, given `whole`, of those it marks, see _whole_or_taken), holding every field the jobs
    read, in `buffers` (a BufferRing); DataError if one holds NaN, with the count over the
    whole selection and the first structure. With `on_device` the NaN check is left to the
    device (see program._compiled)."""
    from segcli.memory import check_memory

    dtypes = field_dtypes(jobs)
    read = tuple(dtypes)
    fields = batch.fields
    # per atom: its segment id and each per-atom field, read and padded (to up to twice the rows)
    row_bytes = 2 * (np.dtype(np.int32).itemsize + 2 * sum(
        dtype.itemsize * math.prod(fields[name].shape) for name, dtype in dtypes.items()
        if fields[name].per == "atom"))
    check_memory(jobs[0].path, batch.n_atoms[structures], structures.start or 0, row_bytes)
    least = padded_size(batch.n_atoms[structures], chunk_atoms, _structure_bytes(jobs))
    _check_output_memory(jobs, least[1])
    # a CPU computes from the file's pages as they are, where they can be mapped: no copy
    windows = not on_device and not buffers.pinned
    chunks = batch.iter_chunks(list(read), chunk_atoms=chunk_atoms, structures=structures,
                               into=lending(buffers, dtypes, fields, least[0], windows),
                               keep=keep if whole is None else None)
    if whole is not None:
        chunks = _whole_or_taken(chunks, whole)
    if not on_device:
        shown = shown_nan(jobs, fields)
        chunks = nan_checked(jobs[0].path, chunks, [n for n in read if n not in shown],
                             where_present=True, keep=whole)
    for chunk in chunks:
        yield chunk, _pad(dtypes, chunk, least, buffers, on_device)


WHOLE = 0.25
"""The share of a chunk's atoms that the structures a selection keeps must hold for the chunk
to be computed whole (see _whole_or_taken): copying the kept rows costs more than the kernels
of the others (on a 2-core VM a copy of 2 Mi rows of 3 float64 takes 4 times rms_norm's)."""


def _whole_or_taken(chunks, keep):
    """The chunks, each as it is where the structures `keep` ((S,) bool) marks hold at least
    WHOLE of its atoms (computed whole: the results of the others are left out, see
    engine._finished), else those structures taken (copied, see Chunk.take); chunks with none
    left out."""
    for chunk in chunks:
        mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
        if not mask.any():
            continue
        kept_atoms = int(chunk.n_atoms[mask].sum())
        yield chunk if kept_atoms >= WHOLE * int(chunk.n_atoms.sum()) else chunk.take(mask)
