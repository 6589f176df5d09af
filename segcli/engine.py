"""Chunked evaluation of the ops (`segcli.registry.OPS`) over the fields of a file.

This layer sits between `segcli.ops` (pure math) and the I/O and command layers. It never
imports jax or warp at module level, so the command line starts fast.

    job = plan(path, OPS["rms_norm"], ["forces"], batch.fields)
    for chunk, (outputs,) in run(batch, [job], jax.devices("cpu")[0]):
        outputs[""]  # (structures of the chunk,)

Several jobs given to `run` share one read of the file and one compiled program per chunk.
"""

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError
from segcli.io.core import unknown_field
from segcli.registry import Arg, Op

PRECISIONS = ("float32", "float64")
DEFAULT_CHUNK_ATOMS = 1 << 21
"""Atoms per chunk: 2 Mi atoms of (N, 3) float64 are 48 MiB per field."""
MIN_BUCKET = 1024


def bucket(n):
    """The padded size of a chunk axis of n rows: the next power of two, at least MIN_BUCKET, so
    that any file compiles one of a handful of shapes rather than one per chunk."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def _describe(info):
    return Arg(info.per, tuple(info.shape)).describe()


def _field(path, name, wanted, fields, needs_float, role):
    """The FieldInfo of `name`, or DataError unless it exists and fits `wanted` (an Arg) as
    `role` ("rms_norm", "dot's second field", "--weights") needs."""
    if name not in fields:
        raise unknown_field(path, name, fields)
    info = fields[name]
    if info.per != wanted.per:
        raise DataError(f"{path}: field '{name}' is per {info.per} {_describe(info)}, but {role} "
                        f"must be per {wanted.per} {wanted.describe()}")
    if wanted.shape is not None and tuple(info.shape) != wanted.shape:
        raise DataError(f"{path}: field '{name}' has shape {_describe(info)}, but {role} must "
                        f"be {wanted.describe()}")
    kinds, what = (("iu", "integer labels") if wanted.kind == "labels"
                   else ("f", "floating-point to be differentiated") if needs_float
                   else ("biuf", "real numbers"))
    if info.dtype.kind not in kinds:
        from segcli.io.core import held

        raise DataError(f"{path}: field '{name}' holds {held(info.dtype)}, but {role} must be "
                        f"{what}")
    return info


@dataclass(frozen=True)
class Job:
    """One op (a registry.Op) over named fields of one file, checked against its fields (see
    `plan`), with its static `params` (all of the op's).

    order 0: the op's value; 1: the gradient of Σ_s w_s · OP(...)_s (summed over every entry of
    each structure's result) with respect to each distinct per-atom input field; 2: that
    gradient's derivative along `direction` (a Hessian-vector product), the direction being
    applied to every per-atom input field at once.

    `partial`: some structures lack a field the job reads (see `job_present`); their rows of
    every output are NaN (see `run`), an integer output therefore float64.
    """

    path: str
    spec: Op
    fields: tuple
    infos: tuple
    precision: str = "float64"
    order: int = 0
    weights: str | None = None
    direction: str | None = None
    params: dict = field(default_factory=dict, hash=False)
    partial: bool = False

    @property
    def wrt(self):
        """The distinct per-atom input fields, in order: what gradients are taken against."""
        return tuple(dict.fromkeys(n for n, i in zip(self.fields, self.infos) if i.per == "atom"))

    @property
    def read(self):
        """Every field the job reads: the inputs, then the weights and the direction."""
        return tuple(dict.fromkeys((*self.fields, *filter(None, (self.weights, self.direction)))))

    @property
    def shows_nan(self):
        """Whether a NaN in a per-atom input makes its structure's value NaN (see
        shows_nan)."""
        return shows_nan(self.spec, self.order)

    @property
    def integers(self):
        """The integer input fields the op reduces as integers (its `integers`, or labels),
        which are therefore read as integers (see field_dtypes), not cast to the precision."""
        return tuple(name for name, info, wanted in zip(self.fields, self.infos, self.spec.inputs)
                     if info.dtype.kind in "iu" and (self.spec.integers or wanted.kind == "labels"))

    @property
    def outputs(self):
        """label -> (per, trailing shape, dtype) of what each chunk gives: "" for the op's value,
        "d_FIELD" for the derivative with respect to FIELD."""
        dtype = np.dtype(self.precision)
        if self.order:
            shapes = dict(zip(self.fields, (i.shape for i in self.infos)))
            return {f"d_{name}": ("atom", tuple(shapes[name]), dtype) for name in self.wrt}
        spec = self.spec
        shape = spec.trailing_shape(self.infos[0].shape if self.infos else (), self.params)
        kept = bool(self.fields) and self.fields[0] in self.integers
        dtype = {"float": dtype, "count": np.dtype(np.int64),
                 "input": _integer_result(self.infos[0].dtype) if kept else dtype
                 }[spec.output_dtype]
        if self.partial:
            dtype = nan_dtype(dtype)
        return {"": (spec.output_per, shape, dtype)}

    def program(self, read):
        """The job as static data for `_compiled`, its fields given as indices into `read`
        (the fields of a pass)."""
        where = {name: read.index(name) for name in self.read}
        return _Program(self.spec, tuple(sorted(self.params.items())),
                        tuple(where[n] for n in self.fields),
                        tuple(n in self.integers for n in self.fields), self.precision,
                        self.order, tuple(where[n] for n in self.wrt), where.get(self.weights),
                        where.get(self.direction))


def _integer_result(stored):
    """The dtype an integer field stored as `stored` is reduced in and given as: uint64 as
    itself, any other in int64 (which holds every value of them)."""
    return np.dtype(np.uint64 if stored == np.uint64 else np.int64)


def shows_nan(op, order):
    """Whether a NaN in a per-atom input makes its structure's result NaN: so for the value
    (order 0) of every op with a result per structure (tests/test_engine.py checks each), whose
    inputs the engine then looks into for NaN only where a value is NaN (see shown_nan)."""
    return order == 0 and op.output_per == "structure"


class _Program(NamedTuple):
    """A job as static data: its op and params, its inputs (indices into the values of a
    pass), which of them stay integers (the others are cast to `precision`), its order, the
    inputs it differentiates against, its weights and its direction (indices or None)."""

    op: Op
    params: tuple
    inputs: tuple
    integers: tuple
    precision: str
    order: int
    wrt: tuple
    weights: int | None
    direction: int | None


def reads(jobs):
    """Every field some job of `jobs` reads, once each, in order."""
    return tuple(dict.fromkeys(name for job in jobs for name in job.read))


def field_dtypes(jobs):
    """name -> the dtype every field some job of `jobs` reads is padded in: for the integer
    fields a job reduces as integers (see Job.integers), int32 where the file stores int32 and
    every such job takes the field as labels (read as stored: the kernels count int32 labels
    as they are), else as _integer_result says; the other fields in the jobs' precision."""
    stored, counted = {}, set()
    for job in jobs:
        for name, info, wanted in zip(job.fields, job.infos, job.spec.inputs):
            if name in job.integers:
                stored[name] = info.dtype
                if wanted.kind != "labels":
                    counted.add(name)
    as_stored = {name for name, dtype in stored.items()
                 if name not in counted and dtype == np.int32}
    precision = _precision(jobs)
    return {name: np.dtype(np.int32) if name in as_stored else _integer_result(stored[name])
            if name in stored else np.dtype(precision) for name in reads(jobs)}


def plan(path, spec, names, fields, *, precision="float64", order=0, weights=None,
         direction=None, params=None, present=None):
    """A Job running `spec` (a registry.Op) on the fields `names` (one per input) of a file
    whose fields are `fields` (name -> FieldInfo), with `params` overriding the op's static
    params (those it lacks are ignored); DataError naming the file and field when one does not
    fit. `present(name)` (Batch.present) says which structures have a field: the job is
    `partial` when some lack one it reads."""
    names = tuple(names)
    if len(names) != len(spec.inputs):
        raise ValueError(f"{spec.name} takes {len(spec.inputs)} field(s), got {len(names)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    roles = [spec.name] if len(names) == 1 else [f"{spec.name}'s {n} field"
                                                   for n in ("first", "second")]
    infos = tuple(_field(path, name, wanted, fields, order > 0 and wanted.per == "atom", role)
                  for name, wanted, role in zip(names, spec.inputs, roles))
    shared = [(name, info) for name, info, wanted in zip(names, infos, spec.inputs)
              if wanted.shape is None]  # these share one trailing shape *F
    if any(info.shape != shared[0][1].shape for _, info in shared):
        (a, first), (b, second) = shared[:2]
        raise DataError(f"{path}: {spec.name} needs fields of the same shape, but "
                        f"'{a}' is {_describe(first)} and '{b}' is {_describe(second)}")
    params = {**spec.params, **{k: v for k, v in (params or {}).items() if k in spec.params}}
    job = Job(path, spec, names, infos, precision, order, weights, direction, params)
    if weights is not None:
        _field(path, weights, Arg("structure", ()), fields, False, "--weights")
    if direction is not None:
        shape = tuple(fields[job.wrt[0]].shape)
        _field(path, direction, Arg("atom", shape), fields, False,
               f"--direction (the shape of '{job.wrt[0]}')")
    if present is not None and any(present(name) is not None for name in job.read):
        job = dataclasses.replace(job, partial=True)
    return job


def nan_dtype(dtype):
    """`dtype`, or float64 where it is an integer or bool dtype: one whose rows can be NaN."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if dtype.kind in "biu" else dtype


def singular(matrices):
    """(S,) bool: whether each of `matrices` (S, 3, 3) is singular as
    `np.linalg.matrix_rank(np.nan_to_num(matrices)) < 3` says. Divided by its largest entry
    (to within float64's rounding, far below what follows), a matrix has rank 3 when
    |det| > 1000 eps (float32's, the larger): its smallest singular value is at least
    |det| / 9, over 30 eps times its largest (at most 3), so far above matrix_rank's
    threshold of 3 eps times the largest. The others, zero matrices aside, are left to
    matrix_rank."""
    matrices = np.nan_to_num(matrices)
    flat = matrices.reshape(len(matrices), 9).astype(np.float64)
    largest = np.abs(flat).max(axis=1, initial=0)
    zero = largest == 0
    a = (flat / np.where(zero, 1, largest)[:, None]).reshape(-1, 3, 3)
    det = (a[:, 0, 0] * (a[:, 1, 1] * a[:, 2, 2] - a[:, 1, 2] * a[:, 2, 1])
           - a[:, 0, 1] * (a[:, 1, 0] * a[:, 2, 2] - a[:, 1, 2] * a[:, 2, 0])
           + a[:, 0, 2] * (a[:, 1, 0] * a[:, 2, 1] - a[:, 1, 1] * a[:, 2, 0]))
    out = zero.copy()
    unsettled = np.flatnonzero(~zero & ~(np.abs(det) > 1000 * np.finfo(np.float32).eps))
    out[unsettled] = np.linalg.matrix_rank(matrices[unsettled]) < 3
    return out


def job_present(have, job):
    """(S,) bool, True where a structure has every field `job` reads, given `have(name)`
    (Batch.present, or a Chunk's present.get); None where all do."""
    from segcli.io.core import all_of

    return all_of([have(name) for name in job.read])


class _Padded(NamedTuple):
    """A chunk's inputs on the host, cast and padded to bucket sizes: `segments` (S_b) rows per
    structure and `rows` (N_b) per atom, the chunk's atoms at rows [skip, skip + n_rows) (skip:
    the rows ahead of them in a window of the file's pages, see io.core.Window), the rows
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


def _nan_rows(chunk, name, where_present, keep=None):
    """The rows of field `name` of `chunk` that hold NaN (with `where_present`, only in
    structures that have the field, see Chunk.present; only in those `keep` marks, see
    _whole_kept), or None where none does."""
    array = chunk.atoms.get(name, chunk.structures.get(name))
    # the max is NaN where an entry is (never otherwise, where a sum of ±inf is), and takes
    # half the time of a sum
    if array.dtype.kind != "f" or not np.isnan(np.max(array, initial=-np.inf)):
        return None
    rows = np.isnan(array.reshape(len(array), -1)).any(axis=1)
    have = chunk.present.get(name) if where_present else None
    for mask in (have, _whole_kept(chunk, keep)):
        if mask is not None:
            rows &= np.repeat(mask, chunk.n_atoms) if name in chunk.atoms else mask
    return rows if rows.any() else None


def _whole_kept(chunk, keep):
    """The structures of `chunk` that `keep` ((S,) bool over the file's, or None) marks, where
    the chunk holds them all (computed whole, see _padded_chunks), else None."""
    if keep is None or chunk.selected is not None:
        return None
    return keep[chunk.start:chunk.start + len(chunk.n_atoms)]


def nan_checked(path, chunks, names, where_present=False, keep=None):
    """The chunks, each given once checked: DataError naming the first of the fields `names`
    that holds NaN (with `where_present`, only in structures that have the field, see
    Chunk.present; only in those `keep` marks of a chunk computed whole, see _whole_kept),
    with its count over all the chunks and the first structure."""
    bad = None  # [field, NaN count, first structure]
    for chunk in chunks:
        for name in names if bad is None else [bad[0]]:
            rows = _nan_rows(chunk, name, where_present, keep)
            if rows is None:
                continue
            array = chunk.atoms.get(name, chunk.structures.get(name))
            if bad is None:
                first = int(np.argmax(rows))
                first = (chunk.structure_of(first) if name in chunk.atoms
                         else int(chunk.structure_numbers[first]))
                bad = [name, 0, first]
            if name == bad[0]:  # not another field's NaN in the same chunk
                bad[1] += int(np.count_nonzero(np.isnan(array[rows])))
        if bad is None:
            yield chunk
    if bad is not None:
        name, count, first = bad
        raise DataError(f"{path}: field '{name}' holds {count} NaN value(s), the first in "
                        f"structure {first}")


class _BufferRing:
    """Host buffers reused from chunk to chunk, so that steady state allocates nothing: no page
    faults. A buffer is handed out again only once nothing refers to it: not the chunk read
    or padded into it, not a device array that aliases it (XLA's CPU client) or whose copy
    from it may still run (a GPU's), not a result on its way to a file. Aligned to 64 bytes,
    which lets XLA's CPU client take them without a staging copy; with `pinned`, in
    page-locked memory, which a GPU copies from 8× faster than from pageable."""

    def __init__(self, pinned=False):
        self._buffers = {}  # (key, shape, dtype) -> [(buffer, owner, references when idle)]
        self._lent = {}  # buffer address -> rows lent to a reader
        self._windows = collections.deque(maxlen=8)  # the last io.core.Windows asked for
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
        """An io.core.Window of `shape` for a reader to map, else to read `rows` rows into a
        buffer `key` (see `lend`); found again by `windowed`."""
        from segcli.io.core import Window

        window = Window(shape[0], self.lend(key, shape, dtype, rows))
        self._windows.append(window)
        return window

    def windowed(self, array):
        """The io.core.Window whose rows for its chunk `array` is (given once, then forgotten
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


def _pad(dtypes, chunk, least, buffers, device_checks_nan=False):
    """The chunk's fields (name -> dtype `dtypes`, see field_dtypes), cast and padded (see
    _Padded) to at least `least` = (rows, structures), in `buffers`,
    or where the chunk was read in place or left in the file's pages (see _padded_chunks); the
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
    from segcli.io.core import plan_chunks

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
    from segcli.io.core import available_memory

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
    """An `into` for Batch.iter_chunks: a buffer of `buffers` (a _BufferRing), padded to at
    least `least_rows` rows (a bucket), to read the next piece of per-atom field `name`
    (fields[name] its FieldInfo) into as dtypes[name]; None for other fields. With `windows`,
    a field stored as dtypes[name] is asked for as an io.core.Window of that many rows (left
    in the file's pages where the reader can, else read into the buffer)."""

    def into(name, rows):
        if name not in dtypes:
            return None
        shape = (max(least_rows, bucket(int(rows))), *fields[name].shape)
        if windows and fields[name].dtype == dtypes[name]:
            return buffers.window(("read", name), shape, dtypes[name], rows)
        return buffers.lend(("read", name), shape, dtypes[name], rows)

    return into


def _padded_chunks(batch, jobs, chunk_atoms, structures, buffers, on_device=False, keep=None,
                   whole=None):
    """(Chunk, _Padded) for each chunk (of the structures `keep` marks, see Batch.iter_chunks;
    or, given `whole`, of those it marks, see _whole_or_taken), holding every field the jobs
    read, in `buffers` (a _BufferRing); DataError if one holds NaN, with the count over the
    whole selection and the first structure. With `on_device` the NaN check is left to the
    device (see _compiled)."""
    from segcli.io.core import check_memory

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
    _finished), else those structures taken (copied, see Chunk.take); chunks with none left
    out."""
    for chunk in chunks:
        mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
        if not mask.any():
            continue
        kept_atoms = int(chunk.n_atoms[mask].sum())
        yield chunk if kept_atoms >= WHOLE * int(chunk.n_atoms.sum()) else chunk.take(mask)


def whole_selection(jobs, keep):
    """`keep` where the jobs may compute chunks whole and leave out the results of the
    structures it does not mark (every output per structure, so leaving them out copies
    little), else None."""
    if keep is None or any(per != "structure" for job in jobs
                           for per, _, _ in job.outputs.values()):
        return None
    return keep


def shown_nan(jobs, fields):
    """The per-atom fields (fields: name -> FieldInfo) whose NaN the values of the jobs that
    read them show (Job.shows_nan), every job that reads them: the host looks for NaN in them
    only once a value is NaN (see _finished), not in every chunk as it reads it."""
    readers = {}
    for job in jobs:
        for name in job.read:
            readers.setdefault(name, []).append(job)
    return {name for name, some in readers.items()
            if fields[name].per == "atom" and all(job.shows_nan for job in some)}


def _precision(jobs):
    """The one precision of the jobs of a pass."""
    precisions = {job.precision for job in jobs}
    if len(precisions) != 1:
        raise ValueError(f"the jobs of one pass need one precision, got {sorted(precisions)}")
    return precisions.pop()


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


def runs_on(device):
    """Whether the kernels can run on `device` (a jax.Device): a Warp build without its CPU
    backend runs them on GPUs only."""
    from segcli.ops import kernels

    return device.platform != "cpu" or kernels.cpu_available()


@functools.cache
def _compiled(programs, on_device=False, host_outputs=None):
    """A jitted function (values, offsets, rows, num_segments) -> (a tuple of outputs per
    program, see Job.program; whether a value holds NaN): the op's value (order 0), or the
    gradient (order 1) or Hessian-vector product along values[direction] (order 2) of
    Σ_s w_s · op_s, w = values[weights] or 1, with respect to the values `wrt`, over the
    segments of `offsets` (their ids expanded there, where a program reads them: XLA drops
    them where none does). With `on_device` the values are checked for NaN there; else the NaN
    flag says whether a value of a program that shows its inputs' NaN (Job.shows_nan) is
    NaN. With `host_outputs` (a device that offers it, see _pinned_outputs), the program
    writes its outputs into that device's pinned host memory itself: on an H100, a chunk's
    three results of 65 Ki structures come back in 0.1 ms, against 1.7 ms copied one by one
    into pageable NumPy arrays (benchmarks/RESULTS.md)."""
    import jax
    import jax.numpy as jnp

    from segcli import ops

    def outputs(program, values, idx, num_segments):
        spec, params, inputs, integers, precision, order, wrt, weights, direction = program

        def value(moving):
            given = dict(zip(wrt, moving))
            arrays = [given.get(k, values[k]) for k in inputs]
            unsigned = spec.integers and arrays[0].dtype == jnp.uint64
            out = spec.apply(*(_signed(a, spec) if unsigned and not i else a if kept
                               else a.astype(precision)
                               for i, (a, kept) in enumerate(zip(arrays, integers))),
                             idx=idx, num_segments=num_segments, indices_are_sorted=True,
                             **dict(params))
            return _unsigned(out, spec) if unsigned else out

        moving = tuple(values[k] for k in wrt)
        if order == 0:
            return (value(moving),)
        w = values[weights] if weights is not None else jnp.ones(num_segments, moving[0].dtype)

        def objective(moving):
            out = value(moving)
            if spec.output_per == "atom":
                return jnp.sum(ops.segmented_mul(out, w, idx, num_segments))
            return jnp.sum(out * w.reshape(-1, *(1,) * (out.ndim - 1)))

        if order == 1:
            return jax.grad(objective)(moving)
        return jax.jvp(jax.grad(objective), (moving,), ((values[direction],) * len(wrt),))[1]

    def all_outputs(values, offsets, rows, num_segments):
        idx = ops.segments_of_offsets(offsets, rows)
        together = _reduced_together(programs, values, idx, num_segments)
        out = tuple(together[i] if i in together else outputs(p, values, idx, num_segments)
                    for i, p in enumerate(programs))
        seen = values if on_device else [o for p, results in zip(programs, out)
                                         if shows_nan(p.op, p.order) for o in results
                                         if jnp.issubdtype(o.dtype, jnp.floating)]
        nan = jnp.any(jnp.stack([jnp.isnan(v).any() for v in seen])) if seen \
            else jnp.zeros((), bool)
        return out, nan

    placed = {} if host_outputs is None else {"out_shardings": jax.sharding.SingleDeviceSharding(
        host_outputs, memory_kind="pinned_host")}
    return jax.jit(all_outputs, static_argnames=("rows", "num_segments"), **placed)


_SIGN = -(2 ** 63)


def _signed(x, op):
    """uint64 `x` as the int64 that the op (sum, max or min: the library reduces signed
    integers) reduces in its place: its bits for the sum (which wraps alike), its bits with
    the sign bit flipped (the order kept) for the others; _unsigned undoes it."""
    import jax

    bits = jax.lax.bitcast_convert_type(x, np.int64)
    return bits if op.name == "sum" else bits ^ _SIGN


def _unsigned(out, op):
    """The uint64 result of `op` over the uint64 values `_signed` gave it as int64."""
    import jax

    return jax.lax.bitcast_convert_type(out if op.name == "sum" else out ^ _SIGN, np.uint64)


def _reduced_together(programs, values, idx, num_segments):
    """{index: (value,)} of the programs (see _compiled) that are plain reductions among
    ops.REDUCTIONS (order 0, no parameters) of a float field in a precision that two or more
    of them reduce: each such group by one ops.segmented_reductions, which reads the rows once
    for all of them on CPUs, with the bits each op gives alone."""
    from segcli import ops

    groups = {}
    for i, p in enumerate(programs):
        if (p.order == 0 and not p.params and p.op.name in ops.REDUCTIONS
                and not any(p.integers)):
            groups.setdefault((p.inputs[0], p.precision), []).append(i)
    together = {}
    for (name, precision), members in groups.items():
        if len(members) > 1:
            results = ops.segmented_reductions(
                values[name].astype(precision), idx, num_segments,
                tuple(programs[i].op.name for i in members), indices_are_sorted=True)
            together.update({i: (result,) for i, result in zip(members, results)})
    return together


def launch(jobs, padded, device):
    """Start computing the jobs' outputs for one padded chunk on `device` (a jax.Device), by
    one program, and return at once; `finish` waits for them. The NaN check runs there only
    for a chunk the host has not checked (see _Padded)."""
    import jax

    from segcli._jax import enable_x64

    read = reads(jobs)
    function = _compiled(tuple(job.program(read) for job in jobs), padded.device_checks_nan,
                         _pinned_outputs(device))
    with enable_x64(True):
        values, offsets = jax.device_put(
            (tuple(padded.arrays[name] for name in read), padded.offsets), device,
            may_alias=True)
        return jobs, padded, function(values, offsets, rows=padded.rows,
                                      num_segments=padded.segments)


@functools.cache
def _pinned_outputs(device):
    """`device` where a chunk's program on it writes its outputs into its pinned host memory
    (see _compiled's `host_outputs`): an accelerator whose runtime offers that memory; else
    None (on CPUs the outputs are in host memory already)."""
    takes = device.platform != "cpu" and "pinned_host" in {
        memory.kind for memory in device.addressable_memories()}
    return device if takes else None


def finish(launched, numbers, kept=None):
    """(Each job's outputs (label -> NumPy array, see Job.outputs), whether an input holds
    NaN) of a `launch` of the structures `numbers`; DataError where an integer result that a
    job gives as float64 (see Job.partial) is one that float64 does not hold exactly, in a
    structure that `kept` marks (None: any)."""
    jobs, padded, (out, nan) = launched
    out = [[np.asarray(o) for o in outputs] for outputs in out]
    rows = {"atom": slice(padded.skip, padded.skip + padded.n_rows),
            "structure": slice(padded.n_structures)}
    given = []
    for job, arrays in zip(jobs, out):
        given.append({})
        for (label, (per, _, dtype)), array in zip(job.outputs.items(), arrays):
            array = array[rows[per]]
            if dtype.kind == "f" and per == "structure":
                mask = slice(None) if kept is None else kept
                check_float64(job.path, f"the {job.spec.name} of '{job.fields[0]}'",
                              array[mask], numbers[mask])
            given[-1][label] = array.astype(dtype, copy=False)
    return tuple(given), bool(nan)


def inexact_in_float64(integers):
    """(rows,) bool: the rows of `integers` (rows, ...) holding a value that float64 does not
    hold exactly (as 2**53 + 1 or 2**64 - 1)."""
    flat = integers.reshape(len(integers), -1)
    wide = flat.astype(np.float64)
    inside = wide < float(np.iinfo(flat.dtype).max) + 1  # 2**63 rounds int64's max up to it
    return (~inside | (np.where(inside, wide, 0).astype(flat.dtype) != flat)).any(axis=1)


def check_float64(path, what, array, numbers):
    """DataError naming the first of the structures `numbers` (one a row of `array`) whose
    integer result `what` float64, the type of an integer result with NaN rows, does not hold
    exactly; nothing for a float `array`."""
    if array.dtype.kind not in "iu" or not array.size:
        return
    wrong = inexact_in_float64(array)
    if wrong.any():
        row = int(np.argmax(wrong))
        raise DataError(f"{path}: {what} in structure {int(numbers[row])} is "
                        f"{array[row].tolist()}, which a float64 result (NaN where a structure "
                        "has no value) does not hold exactly")


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
        items = prefetch(_padded_chunks(batch, jobs, chunk_atoms, structures, buffers, on_device,
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


def peers(device):
    """The devices that take turns at a run's chunks on `device`: for a CPU, the CPU devices
    of the process, as many as the threads it uses (threads.count(): a cluster worker its
    share) — one, unless XLA was started with several (the segcli program starts it with one
    a thread, up to HOST_DEVICES, see cli.common.device); else `device` alone."""
    import jax

    from segcli import threads

    if device.platform != "cpu":
        return [device]
    return jax.devices("cpu")[:threads.count()]


HOST_DEVICES = 4
"""The most CPU devices the segcli program starts XLA with: chunks in flight at once on a
CPU, each holding its buffers and results."""


def _finished(jobs, chunk, launched, rest, keep=None):
    """(chunk, outputs) of a launched chunk; DataError counting and naming NaN over it and the
    chunks `rest` (those after it) where the device found one, or a value is NaN that a NaN
    input would make so and the chunk holds one (not where ±inf made it). Of a chunk computed
    whole (see _whole_kept), the structures `keep` marks: their results, and the chunk of
    them without its per-atom fields (which no consumer of per-structure results reads)."""
    kept = _whole_kept(chunk, keep)
    for job in jobs:
        _check_integer_sum(job, chunk, kept)
    outputs, nan = finish(launched, chunk.structure_numbers, kept)
    for job, out in zip(jobs, outputs):
        _check_overflow(job, chunk, out, kept)
    read = reads(jobs)
    if nan and any(_nan_rows(chunk, name, True, keep) is not None for name in read):
        for _ in nan_checked(jobs[0].path, itertools.chain([chunk], rest), read,
                             where_present=True, keep=keep):  # counted and named, the rest too
            pass
    outputs = tuple(_blank_absent(job, chunk, out) for job, out in zip(jobs, outputs))
    if kept is None or kept.all():
        return chunk, outputs
    return (chunk._replace(atoms={}).take(kept),
            tuple({label: array[kept] for label, array in out.items()} for out in outputs))


def _check_integer_sum(job, chunk, kept=None):
    """DataError naming the first structure of the chunk (of those `kept` marks, None: all)
    whose exact sum of the integer field that `job` sums leaves the range of its result
    (int64, or uint64 for a uint64 field: see _integer_result), where the ops would wrap.
    Exact: each value is split into its high and low 32 bits, whose sums over a structure
    (of fewer than 2**31 rows, as a chunk's int32 offsets hold) int64 holds, and the
    sum's high word, their carry included, must fit the result's."""
    if job.order or job.spec.name != "sum" or job.fields[0] not in job.integers:
        return
    filled = np.flatnonzero(chunk.n_atoms)
    if not len(filled):
        return
    name = job.fields[0]
    result = _integer_result(job.infos[0].dtype)
    n_rows = int(chunk.n_atoms.sum())
    values = np.asarray(chunk.atoms[name])[:n_rows].reshape(n_rows, -1)
    values = values.view(np.uint64) if result == np.uint64 else values.astype(np.int64)
    high, low = (values >> 32).astype(np.int64), (values & 0xFFFFFFFF).astype(np.int64)
    starts = (np.cumsum(chunk.n_atoms) - chunk.n_atoms)[filled]
    top = np.add.reduceat(high, starts) + (np.add.reduceat(low, starts) >> 32)
    bound = 32 if result == np.uint64 else 31
    wrong = ((top < (0 if result == np.uint64 else -(1 << bound))) | (top >= 1 << bound)).any(1)
    for mask in (kept, job_present(chunk.present.get, job)):
        if mask is not None:
            wrong &= mask[filled]
    if wrong.any():
        first = int(chunk.structure_numbers[filled[np.argmax(wrong)]])
        raise DataError(f"{job.path}: the sum of field '{name}' over structure {first} does "
                        f"not fit in {result} (it would wrap around)")


def _check_overflow(job, chunk, outputs, kept=None):
    """DataError naming the first structure (of at least one atom, holding the job's fields,
    and of those `kept` marks, None: all) whose per-structure float value is not finite though
    every value it reads is: a value past its dtype's range (the var of 1e308 and -1e308, a sum
    of 1e308s), refused rather than given as inf or NaN."""
    if job.order:
        return
    bad = np.zeros(len(chunk.n_atoms), bool)
    for label, array in outputs.items():
        per, _, dtype = job.outputs[label]
        if per == "structure" and dtype.kind == "f":
            bad |= ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    bad &= chunk.n_atoms > 0
    for mask in (kept, job_present(chunk.present.get, job)):
        if mask is not None:
            bad &= mask
    if bad.any():
        bad &= _finite_inputs(job, chunk)
    if bad.any():
        first = int(np.argmax(bad))
        raise DataError(f"{job.path}: the {job.spec.name} of '{job.fields[0]}' over structure "
                        f"{int(chunk.structure_numbers[first])} overflows {job.precision} "
                        "(its values are finite, the result is not)")


def _finite_inputs(job, chunk):
    """(S_c,) bool: True for the chunk's structures whose values of every float field that
    `job` reads are finite."""
    finite = np.ones(len(chunk.n_atoms), bool)
    n_rows = int(chunk.n_atoms.sum())
    filled = chunk.n_atoms > 0
    starts = (np.cumsum(chunk.n_atoms) - chunk.n_atoms)[filled]
    for name in job.read:
        if name in chunk.atoms and n_rows:
            values = np.asarray(chunk.atoms[name])[:n_rows].reshape(n_rows, -1)
            if values.dtype.kind == "f":
                rows = np.isfinite(values).all(axis=1)
                finite[filled] &= np.logical_and.reduceat(rows, starts)
        elif name in chunk.structures:
            values = np.asarray(chunk.structures[name])
            if values.dtype.kind == "f":
                finite &= np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return finite


def _blank_absent(job, chunk, outputs):
    """A job's outputs of a chunk with NaN in the rows of structures that lack a field the job
    reads (an integer output as float64, as a `partial` job declares it)."""
    have = job_present(chunk.present.get, job)
    if have is None:
        return outputs
    return blanked(outputs, {label: o[0] for label, o in job.outputs.items()}, have,
                   chunk.n_atoms)


def blanked(outputs, per, have, n_atoms):
    """`outputs` (label -> array of a chunk's rows, per structure or per atom as per[label]
    says; labels not in `per` as they are) with NaN in the rows of the structures where
    `have` is False (and of their atoms), an integer array as float64 (see nan_dtype)."""
    rows = {"structure": ~have, "atom": np.repeat(~have, n_atoms)}
    out = dict(outputs)
    for label, array in outputs.items():
        if label in per:
            out[label] = np.array(array, nan_dtype(array.dtype))
            out[label][rows[per[label]]] = np.nan
    return out


@contextlib.contextmanager
def buffer_ring(pinned, user=None):
    """A _BufferRing (pinned or not) for one run of `user` (None: engine.run), the one the last
    such run left if any, and left in turn for the next: a worker running many shards
    allocates, and pins, its buffers once."""
    buffers = _SPARE_RINGS.pop((user, pinned), None) or _BufferRing(pinned=pinned)
    try:
        yield buffers
    finally:
        _SPARE_RINGS[(user, pinned)] = buffers


_SPARE_RINGS = {}
"""(user, pinned) -> the _BufferRing the last run of `user` left (see buffer_ring)."""
