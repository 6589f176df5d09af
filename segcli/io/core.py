"""What every reader shares: field descriptions, chunks of whole structures, derived fields."""

import ctypes
import errno
import functools
import math
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from segcli.errors import DataError, for_user
from segcli.fields import STRING, all_of, unknown_field
from segcli.memory import offsets_of, plan_chunks

FORMAT = "segcli-batch"
VERSION = 1
N_ELEMENTS = 119
"""Atomic numbers are 0 (ASE's X) to N_ELEMENTS - 1."""


def are_elements(numbers):
    """Whether every entry of `numbers` (a non-empty array) is 0 to N_ELEMENTS - 1: for
    integers in one pass, the largest as unsigned (where a negative one is larger still)."""
    if numbers.dtype.kind in "iu" and numbers.dtype.isnative:
        return int(numbers.view(f"u{numbers.dtype.itemsize}").max()) < N_ELEMENTS
    return bool(numbers.min() >= 0 and numbers.max() < N_ELEMENTS)  # False for NaN


def not_an_element(path, value, structure):
    """The DataError for an atomic number `value` outside 0 to N_ELEMENTS - 1."""
    return DataError(f"{path}: field 'numbers' holds {value} in structure {structure}, not an "
                     f"atomic number (0 to {N_ELEMENTS - 1})")


def integral_numbers(numbers, where):
    """Atomic numbers read as floats, as int64; DataError naming the first that is not an
    integer (none is cut: ASE would make 1.9 a 1) or is beyond int64, its message begun by
    `where(i)` for its index i (e.g. "FILE: structure 3: atom 2")."""
    numbers = np.asarray(numbers)
    if numbers.dtype.kind in "iu":
        bad = np.flatnonzero(numbers > np.iinfo(np.int64).max)  # of uint64
    else:
        with np.errstate(invalid="ignore"):
            held = (numbers >= -2.0 ** 63) & (numbers < 2.0 ** 63)
            bad = np.flatnonzero(~held | (numbers != np.round(numbers)))
    if len(bad):
        value = numbers[bad[0]].item()
        fraction = isinstance(value, float) and (not math.isfinite(value) or value % 1)
        raise DataError(f"{where(int(bad[0]))} has atomic number {value!r}, "
                        f"{'not an integer' if fraction else 'beyond int64'}")
    return numbers.astype(np.int64, copy=False)


def path_text(path):
    """A file's path as text that HDF5 stores (UTF-8): bytes of the name that are not UTF-8
    as backslash escapes, a stream's temporary copy by the stream's name (see for_user)."""
    return os.fsencode(for_user(os.fsdecode(path))).decode("utf-8", "backslashreplace")


def standard_input():
    """sys.stdin, or DataError when the process was started with it closed (`<&-`)."""
    if sys.stdin is None:
        raise DataError("stdin: closed, nothing to read")
    return sys.stdin


WRITER_WAIT_S = 5.0
"""How long a FIFO read as input may wait for a process to open it for writing."""


def open_for_reading(path):
    """The file `path` opened for reading (binary), or OSError. A FIFO waits at most
    WRITER_WAIT_S for a writer (DataError), never for ever."""
    import select
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            waiting = select.poll()
            waiting.register(fd, select.POLLIN)
            if not waiting.poll(WRITER_WAIT_S * 1000):
                raise DataError(f"{path}: a FIFO that no process wrote to within "
                                f"{WRITER_WAIT_S:g} s; start its writer first")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_readable(path):
    """DataError naming why `path` cannot be read: it names no file (see missing), or this user
    may not read it."""
    if not os.path.exists(path):
        raise DataError(f"{path}: {missing(path)}")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: cannot read (Permission denied)")


def missing(path):
    """Why `path`, which names no file, names none: no such file, a symbolic link to a missing
    file, too many levels of symbolic links (a loop), permission denied (a directory on its
    way that cannot be searched), ..."""
    try:
        os.stat(path)
    except OSError as err:
        if err.errno != errno.ENOENT:
            return err.strerror[:1].lower() + err.strerror[1:]
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
    return "no such file"


class FieldInfo(NamedTuple):
    """A field: per "atom" or "structure", its trailing shape and dtype, and its units where
    the file states them (see segcli.io.units)."""

    name: str
    per: str
    shape: tuple
    dtype: np.dtype
    units: str | None = None


class Chunk(NamedTuple):
    """Consecutive whole structures from `start`: per-atom arrays (N_c, ...) and per-structure
    arrays (S_c, ...); `present` maps a field that only some of these structures have to an
    (S_c,) bool array, True where a structure has it (elsewhere its rows hold a fill).
    `selected`, for a chunk of chosen structures (see `take`), holds their numbers (S_c,),
    which then need not run on from `start`."""

    start: int
    n_atoms: np.ndarray
    atoms: dict
    structures: dict
    present: Mapping = MappingProxyType({})
    selected: np.ndarray | None = None

    @property
    def structure_numbers(self):
        """(S_c,) int64: the numbers (in the file) of the chunk's structures."""
        if self.selected is not None:
            return self.selected
        return np.arange(self.start, self.start + len(self.n_atoms), dtype=np.int64)

    def structure_of(self, row):
        """The number (in the file) of the structure that holds per-atom row `row` of the chunk."""
        return int(self.structure_numbers[np.searchsorted(np.cumsum(self.n_atoms), row,
                                                          side="right")])

    def take(self, mask):
        """The chunk's structures where `mask` (S_c,) is true, with their numbers (the chunk
        itself, its arrays not copied, where it is true everywhere)."""
        if mask.all():
            return self
        return Chunk(self.start, self.n_atoms[mask],
                     {n: _kept_rows(a, self.n_atoms, mask) for n, a in self.atoms.items()},
                     {n: a[mask] for n, a in self.structures.items()},
                     {n: m[mask] for n, m in self.present.items()}, self.structure_numbers[mask])


@functools.cache
def _native_rows():
    """`_rows.c`, loaded; None where it was not built (see segcli.native) or with
    SEGCLI_NATIVE_ROWS=0."""
    from segcli.native import ROWS, library

    lib = library(ROWS)
    if lib is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.segcli_runs.restype = None
    lib.segcli_runs.argtypes = [pointer, size, pointer, pointer, size, pointer, pointer]
    return lib


def _by_runs(a):
    """`_rows.c` where it is loaded and `a` is a C-contiguous array of numbers (not strings),
    else None (NumPy's indexing then)."""
    lib = _native_rows()
    return None if lib is None or a.dtype.hasobject or not a.flags.c_contiguous else lib


def _row_bytes(a):
    return a.itemsize * math.prod(a.shape[1:])


def _kept_rows(a, n_atoms, mask):
    """The rows of a (N_c, ...) of the structures `mask` keeps."""
    lib = _by_runs(a)
    if lib is None:
        return a[np.repeat(mask, n_atoms)]
    counts = np.ascontiguousarray(n_atoms, np.int64)
    keep = np.ascontiguousarray(mask, np.uint8)
    out = np.empty((int(counts[mask].sum()), *a.shape[1:]), a.dtype)
    lib.segcli_runs(a.ctypes.data, _row_bytes(a), counts.ctypes.data, keep.ctypes.data,
                    len(counts), None, out.ctypes.data)
    return out


def spread(rows, numbers, offsets, fill):
    """(first row, block): the rows (n, ...) of the structures `numbers` (increasing), whose
    rows are offsets[s] to offsets[s + 1], placed in a block of the rows of every structure
    from numbers[0] to numbers[-1], `fill` in the rows of those not among `numbers`."""
    first, last = int(offsets[numbers[0]]), int(offsets[numbers[-1] + 1])
    rows = np.asarray(rows, np.result_type(rows.dtype, fill))
    if numbers[-1] - numbers[0] + 1 == len(numbers):  # no structure between them left out
        return first, rows
    lib = _by_runs(rows)
    if lib is not None:
        counts = np.ascontiguousarray(np.diff(offsets[numbers[0]:numbers[-1] + 2]), np.int64)
        keep = np.zeros(len(counts), np.uint8)
        keep[numbers - numbers[0]] = 1
        fill_row = np.full(rows.shape[1:], fill, rows.dtype)
        block = np.empty((last - first, *rows.shape[1:]), rows.dtype)
        lib.segcli_runs(rows.ctypes.data, _row_bytes(rows), counts.ctypes.data, keep.ctypes.data,
                        len(counts), fill_row.ctypes.data, block.ctypes.data)
        return first, block
    block = np.full((last - first, *rows.shape[1:]), fill, rows.dtype)
    lengths = offsets[numbers + 1] - offsets[numbers]
    block[np.repeat(offsets[numbers] - first - (np.cumsum(lengths) - lengths), lengths)
          + np.arange(len(rows))] = rows
    return first, block


def check_fill(path, index, name, fill):
    """Raise DataError unless there is a `fill` for field `name`, which structure `index` lacks."""
    if fill is None:
        raise DataError(f"{path}: structure {index} has no field '{name}', which other "
                        "structures have (`segcli convert --fill-missing nan` fills the gaps)")


def fill_value(dtype, fill):
    """What fills a missing entry of a field of `dtype` given `fill` (NaN): NaN for floats, 0 for
    integers and booleans, "" for strings."""
    if dtype == STRING:
        return ""
    return dtype.type(fill if dtype.kind in "fc" else 0)


def common_dtype(path, name, index, known, dtype):
    """The dtype holding both `known` and `dtype` (of field `name` in structure `index`), as
    NumPy promotes; DataError when one holds strings and the other numbers."""
    if (known == STRING) != (dtype == STRING):
        kinds = ["strings" if d == STRING else "numbers" for d in (dtype, known)]
        raise DataError(f"{path}: field '{name}' holds {kinds[0]} in structure {index}, "
                        f"{kinds[1]} before")
    return np.result_type(known, dtype)


def split_piece(piece, k):
    """The first `k` structures of a piece and the rest."""
    cut = int(piece.n_atoms[:k].sum())
    head = Chunk(piece.start, piece.n_atoms[:k],
                 {n: a[:cut] for n, a in piece.atoms.items()},
                 {n: a[:k] for n, a in piece.structures.items()},
                 {n: m[:k] for n, m in piece.present.items()})
    tail = Chunk(piece.start + k, piece.n_atoms[k:],
                 {n: a[cut:] for n, a in piece.atoms.items()},
                 {n: a[k:] for n, a in piece.structures.items()},
                 {n: m[k:] for n, m in piece.present.items()})
    return head, tail


def rechunk(pieces, chunk_atoms, bounds=None):
    """Group a stream of pieces (consecutive structures) into lists forming chunks of whole
    structures with at most `chunk_atoms` atoms; the same runs as `plan_chunks`. Given
    `bounds` (increasing structure numbers, the first where the pieces start), the chunks are
    the runs between them instead, pieces cut at them."""
    if bounds is not None:
        yield from _cut_at(pieces, bounds)
        return
    group, room = [], chunk_atoms
    for piece in pieces:
        total = int(piece.n_atoms.sum())
        while len(piece.n_atoms):
            if total <= room:  # the common case: (what is left of) the piece fits whole
                group.append(piece)
                room -= total
                break
            k = 0 if piece.n_atoms[0] > room else int(
                np.searchsorted(np.cumsum(piece.n_atoms), room, side="right"))
            if k == 0 and group:
                yield group
                group, room = [], chunk_atoms
                continue
            head, piece = split_piece(piece, max(k, 1))
            taken = int(head.n_atoms.sum())
            group.append(head)
            room, total = room - taken, total - taken
            if k == 0 or len(piece.n_atoms):
                yield group
                group, room = [], chunk_atoms
    if group:
        yield group


def _cut_at(pieces, bounds):
    """The pieces grouped into lists that end at each structure number of `bounds`."""
    ends = iter(bounds[1:])
    end, group = next(ends, None), []
    for piece in pieces:
        while len(piece.n_atoms):
            if end is None:  # past the last bound
                group.append(piece)
                break
            head, piece = split_piece(piece, min(int(end) - piece.start, len(piece.n_atoms)))
            group.append(head)
            if head.start + len(head.n_atoms) == end:
                yield group
                end, group = next(ends, None), []
    if group:
        yield group


def segment_bounds(n_atoms, breaks, chunk_atoms):
    """Bounds (0 to len(n_atoms)) of the segments of structures of `n_atoms` atoms: the runs
    between the structure numbers `breaks`, one of more than `chunk_atoms` atoms cut into the
    runs of `plan_chunks` from its start."""
    runs = np.unique(np.clip(np.concatenate([[0], breaks, [len(n_atoms)]]).astype(np.int64),
                             0, len(n_atoms)))
    offsets = offsets_of(n_atoms)
    big = np.flatnonzero(np.diff(offsets[runs]) > chunk_atoms)
    cuts = [a + np.array(plan_chunks(n_atoms[a:b], chunk_atoms), np.int64)
            for a, b in zip(runs[big], runs[big + 1])]
    return np.unique(np.concatenate([runs, *cuts]))


def segment_runs(n_atoms, breaks, chunk_atoms):
    """Bounds of the runs of whole segments (see segment_bounds) that hold at most
    `chunk_atoms` atoms each (a bigger segment alone), from the first (0)."""
    bounds = segment_bounds(n_atoms, breaks, chunk_atoms)
    offsets = offsets_of(n_atoms)
    return bounds[plan_chunks(np.diff(offsets[bounds]), chunk_atoms)]


def merge_pieces(path, pieces, schema, fill=None):
    """One Chunk from consecutive pieces, with every field of `schema` (name -> FieldInfo), in
    the schema's dtype or a wider one that the pieces need, and `present` for the fields that
    some of its structures lack.

    A piece without a field raises DataError naming its first structure, or, given `fill`
    (NaN), gets the field filled (see `fill_value`).
    """
    n_atoms = np.concatenate([p.n_atoms for p in pieces]) if len(pieces) > 1 else pieces[0].n_atoms
    out = {"atom": {}, "structure": {}}
    present = {}
    for name, info in schema.items():
        parts = [(p.atoms if info.per == "atom" else p.structures).get(name) for p in pieces]
        given = [(p, part) for p, part in zip(pieces, parts) if part is not None]
        if {part.shape[1:] for _, part in given} - {info.shape}:
            p, part = next((p, part) for p, part in given if part.shape[1:] != info.shape)
            raise DataError(f"{path}: field '{name}' has shape {part.shape[1:]} per "
                            f"{info.per} in structure {p.start}, {info.shape} elsewhere")
        dtype = info.dtype
        for other in {part.dtype for _, part in given} - {dtype}:
            p = next(p for p, part in given if part.dtype == other)
            dtype = common_dtype(path, name, p.start, dtype, other)
        masks = [p.present.get(name) for p in pieces]
        for i in [i for i, part in enumerate(parts) if part is None]:
            other = pieces[i].structures if info.per == "atom" else pieces[i].atoms
            if name in other:  # not lacking it: holding it the other way, which no fill hides
                raise DataError(f"{path}: field '{name}' is per "
                                f"{'structure' if info.per == 'atom' else 'atom'} with shape "
                                f"{other[name].shape[1:]} in structure {pieces[i].start}, per "
                                f"{info.per} with shape {info.shape} elsewhere")
            check_fill(path, pieces[i].start, name, fill)
            rows = int(pieces[i].n_atoms.sum()) if info.per == "atom" else len(pieces[i].n_atoms)
            parts[i] = np.full((rows, *info.shape), fill_value(dtype, fill), dtype)
            masks[i] = np.zeros(len(pieces[i].n_atoms), bool)
        merged = parts[0] if len(parts) == 1 else np.concatenate(parts)
        out[info.per][name] = merged.astype(dtype, copy=False)
        if any(m is not None for m in masks):
            mask = np.concatenate([np.ones(len(p.n_atoms), bool) if m is None else m
                                   for p, m in zip(pieces, masks)])
            if not mask.all():
                present[name] = mask
    return Chunk(pieces[0].start, n_atoms, out["atom"], out["structure"], present)


RESERVED = frozenset({"n_atoms"})
"""Names that segcli's layout gives to what is not a field (/structures/n_atoms)."""


def check_name(path, index, name):
    """DataError, naming `path`, structure `index` and the option of `segcli convert` that
    leaves the field out, unless `name` can be a field's: a string, not reserved, not empty,
    `.` or `..`, no NUL byte and no `/` (an HDF5 group)."""
    import shlex

    if not isinstance(name, str):
        problem = f"is not a string ({type(name).__name__})"
    elif name in RESERVED:
        problem = "is reserved for the atom counts"
    elif name in ("", ".", ".."):
        problem = "is not a name"
    elif "\0" in name:
        problem = "holds a NUL byte"
    elif "/" in name:
        problem = "holds a '/' (an HDF5 group)"
    else:
        return
    droppable = isinstance(name, str) and name == name.strip() != "" and \
        name not in RESERVED and not {"\0", ","} & set(name)  # what --drop A,B can name
    hint = (f"`segcli convert --rename {shlex.quote(name + '=NEW')}` renames it, "
            f"`--drop {shlex.quote(name)}` leaves it out" if droppable
            else "`segcli convert --fields` naming the other fields leaves it out")
    raise DataError(f"{path}: structure {index}: field name {name!r} {problem}; {hint}")


class FieldConflict(DataError):
    """A field whose structures hold it per atom and per structure, or in different shapes."""


class Schema(dict):
    """Fields seen so far (name -> FieldInfo); dtypes promote as NumPy does, shapes and units
    must agree (see segcli.io.units.join), names must be fields' (see check_name), but for
    results' (GROUP/NAME)."""

    def add(self, path, info, index, result=False):
        """Add a field (or with `result`, a result) found in structure `index` of `path`."""
        known = self.get(info.name)
        if known is None:
            if not result:
                check_name(path, index, info.name)
            self[info.name] = info
        elif (known.per, known.shape) != (info.per, info.shape):
            raise FieldConflict(
                f"{path}: field '{info.name}' is per {info.per} with shape {info.shape} in "
                f"structure {index}, per {known.per} with shape {known.shape} before")
        elif (known.dtype, known.units) != (info.dtype, info.units):
            from segcli.io.units import join

            self[info.name] = known._replace(
                dtype=common_dtype(path, info.name, index, known.dtype, info.dtype),
                units=join(path, info.name, index, known.units, info.units))

    def add_piece(self, path, piece):
        for per, data in (("atom", piece.atoms), ("structure", piece.structures)):
            for name, array in data.items():
                self.add(path, FieldInfo(name, per, array.shape[1:], array.dtype), piece.start)


def derivable(stored):
    """Derived fields (name -> FieldInfo) that the stored fields allow and do not hold."""
    out = {}

    def shaped(name, shape):  # only fields of the shapes ASE's are derive: not a cell (S, 3)
        return name in stored and tuple(stored[name].shape) == shape

    if "velocities" not in stored and shaped("momenta", (3,)) and (
            shaped("masses", ()) or ("masses" not in stored and shaped("numbers", ()))):
        mass = stored["masses"].dtype if "masses" in stored else np.float64
        out["velocities"] = FieldInfo("velocities", "atom", stored["momenta"].shape,
                                      np.result_type(stored["momenta"].dtype, mass))
    if "scaled_positions" not in stored and shaped("positions", (3,)) and shaped("cell", (3, 3)):
        out["scaled_positions"] = FieldInfo("scaled_positions", "atom", (3,), np.dtype(np.float64))
    return out


def needs(name, stored):
    """Stored fields that a requested field is read from."""
    if name in stored:
        return [name]
    if name == "velocities":
        return ["momenta", "masses" if "masses" in stored else "numbers"]
    return ["positions", "cell"]


def derive(path, name, chunk):
    """Compute a derived field of a chunk (of the file `path`) exactly as ASE's Atoms methods
    do; DataError for an atomic number that has no mass, or a cell that cannot be inverted."""
    atoms = chunk.atoms
    if name == "velocities":
        if "masses" in atoms:
            masses = atoms["masses"]
        else:
            from ase.data import atomic_masses
            numbers = atoms["numbers"]
            bad = np.flatnonzero((numbers < 0) | (numbers >= len(atomic_masses)))
            if len(bad):
                raise DataError(f"{path}: structure {chunk.structure_of(bad[0])}: atomic "
                                f"number {numbers[bad[0]]} has no mass (velocities need one)")
            masses = atomic_masses[numbers]
        return atoms["momenta"] / masses[:, np.newaxis]
    try:
        return scaled_positions(atoms["positions"], chunk.structures["cell"], chunk.n_atoms)
    except np.linalg.LinAlgError as err:
        numbers = chunk.structure_numbers
        s = _first_singular(chunk.structures["cell"])
        raise DataError(f"{path}: structures {numbers[0]} to {numbers[-1]}: a cell that cannot "
                        f"be inverted (structure {numbers[s]}'s: {err}): scaled_positions need "
                        "cells of finite, independent vectors") from None


def _first_singular(cells):
    """The index of the first of `cells` (S, 3, 3) that cannot be inverted: one holding NaN or
    infinity, else one whose vectors, completed as ASE does, are not independent (the first
    where that cannot even be told)."""
    cells = np.asarray(cells, np.float64)
    broken = ~np.isfinite(cells).all(axis=(1, 2))
    if broken.any():
        return int(np.argmax(broken))
    try:
        return int(np.argmax(np.linalg.slogdet(_completed(cells))[0] == 0))
    except np.linalg.LinAlgError:
        return 0


def _completed(cells):
    """The cells (S, 3, 3) as float64, zero cell vectors completed as ASE does."""
    from ase.geometry.cell import complete_cell

    cells = np.array(cells, dtype=np.float64)
    for s in np.flatnonzero((~cells.any(axis=2)).any(axis=1)):
        cells[s] = complete_cell(cells[s])
    return cells


def scaled_positions(positions, cells, n_atoms):
    """Positions in the basis of each structure's cell (zero cell vectors completed as ASE does);
    structures of equal size are solved together."""
    cells = _completed(cells)
    offsets = offsets_of(n_atoms)
    out = np.empty(positions.shape, np.float64)
    for n in np.unique(n_atoms):
        which = np.flatnonzero(n_atoms == n)
        rows = offsets[which][:, None] + np.arange(n)
        block = np.linalg.solve(cells[which].transpose(0, 2, 1), positions[rows].transpose(0, 2, 1))
        out[rows] = block.transpose(0, 2, 1)
    return out


class Fields(dict):
    """name -> FieldInfo of a batch's fields, and `conflicts`: name -> why, for the names its
    files hold in ways that do not merge (see segcli.io.multi), which are no field of it."""

    def __init__(self, fields, conflicts=MappingProxyType({})):
        super().__init__(fields)
        self.conflicts = conflicts


def file_stamp(path):
    """What tells that a file changed: its device, inode, size and modification time (ns);
    None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Batch:
    """The structures of one file, read as chunks of whole structures.

    Subclasses provide `n_atoms`, `_stored` (name -> FieldInfo of the fields in the file),
    `_present(name)` (see `present`, for a stored field or result) and
    `_pieces(start, stop, names, chunk_atoms, into=None, bounds=None)`, which yields Chunks of
    consecutive structures from `start` to `stop` (None: the end) holding those of `names`
    (None: all stored fields) they have, reading a per-atom field into `into(name, rows)` where
    they can (see iter_chunks), and where the format reads any structures as cheaply as any
    others, ending them at the structure numbers `bounds` (the chunks to come, see rechunk).
    `_result_fields` (name -> FieldInfo) are the stored results that `_pieces` also reads.
    """

    format = ""
    input_format = None  # the format `--format` forced on the file (see segcli.io.open_batch)
    _result_fields = MappingProxyType({})
    _conflicts = MappingProxyType({})  # see Fields
    _states_units = False
    """Whether the format's fields may state units (known once the file is open); ASE's
    formats state none, so `units` reads no file of theirs through."""

    def __init__(self, path):
        self.path = path
        self.stamp = file_stamp(path)  # before n_atoms are read: a change after shows

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def unchanged(self, pieces):
        """`pieces` read from the file, then DataError if it was replaced or written to since
        it was opened (its stamp differs): what was read may mix two versions of it."""
        yield from pieces
        if self.stamp is not None and file_stamp(self.path) != self.stamp:
            raise DataError(f"{self.path}: changed while this run read it (replaced or written "
                            "to); run again once it stays as it is")

    def close(self):
        """Release the file."""

    @property
    def n_structures(self):
        return len(self.n_atoms)

    @property
    def counted(self):
        """n_structures where that needs no pass over the file, else None."""
        return self.n_structures

    @property
    def fields(self):
        """name -> FieldInfo: the stored fields, those derivable from them, and the stored
        results (/results/NAME) not named as one of these."""
        fields = {**self._stored, **derivable(self._stored)}
        return Fields({**fields, **{n: f for n, f in self._result_fields.items()
                                    if n not in fields}}, self._conflicts)

    @property
    def units(self):
        """name -> units of each field whose units are stated."""
        if not self._states_units:
            return {}
        return {name: f.units for name, f in self.fields.items() if f.units}

    @property
    def derived(self):
        """Names of the fields that are computed, not stored."""
        return set(derivable(self._stored))

    @property
    def result_fields(self):
        """Names of the fields that are stored results."""
        return set(self.fields).difference(self._stored, self.derived)

    @property
    def results(self):
        """name -> attrs of the results stored in the file."""
        return {}

    @property
    def sources(self):
        """The files read, in order: this one."""
        return [self.path]

    def source_of(self, structures):
        """Where the structures of a slice come from: (S,) int32 indices into `sources` and
        (S,) int64 numbers of the structures inside their files."""
        start, stop, _ = structures.indices(self.n_structures)
        return np.zeros(max(stop - start, 0), np.int32), np.arange(start, stop, dtype=np.int64)

    @property
    def layout(self):
        """A small picklable description of the batch that `segcli.io.open_inputs` opens again,
        in any process, without reading the files first (see segcli.io.multi.Layout)."""
        from segcli.io.multi import member_layout

        return member_layout(self)

    def present(self, name):
        """(S,) bool array, True where a structure has field `name` (a derived field: what it
        is computed from); None when every structure has it."""
        self.check_fields([name])
        if name in self.derived:
            return all_of([self._present(n) for n in needs(name, self._stored)])
        return self._present(name)

    def fill_value(self, name):
        """The value that stands in the rows of structures without field `name`, or None."""

    def _present(self, name):
        return None

    def check_fields(self, names):
        """DataError naming the file and the first of `names` that is not one of its fields."""
        available = self.fields
        for name in names:
            if name not in available:
                raise unknown_field(self.path, name, available)

    def iter_chunks(self, fields, *, chunk_atoms=1_000_000, structures=slice(None), into=None,
                    breaks=(), keep=None):
        """Yield Chunks of whole structures, at most `chunk_atoms` atoms each (a bigger structure
        alone), holding the requested per-atom and per-structure fields. With `breaks`
        (structure numbers), a chunk holds whole segments (see segment_bounds): runs between
        breaks, but for those of more than `chunk_atoms` atoms, cut from their start; as many
        as it can (see segment_runs), read as one piece where the format can.

        `into(name, rows)`, if given, may return an array to read a chunk's stored per-atom field
        into (or None); a format that can read in place (segcli HDF5, when the array has the
        field's shape and dtype) then returns that array in the Chunk, saving a copy.

        `keep` ((S,) bool over the batch's structures), if given, leaves in each chunk only the
        structures where it is true (see Chunk.take), and out the chunks left empty."""
        if isinstance(fields, str):
            fields = [fields]
        fields = list(dict.fromkeys(fields))
        self.check_fields(fields)
        if chunk_atoms < 1:
            raise ValueError(f"chunk_atoms must be at least 1, got {chunk_atoms}")
        start, stop, step = structures.indices(self.n_structures)
        if step != 1:
            raise ValueError(f"structures must be a slice with step 1, got {structures}")
        available, derived = self.fields, self.derived
        sources = {name: needs(name, self._stored) if name in derived else [name]
                   for name in fields}
        read = {n: available[n] for names in sources.values() for n in names}
        stop = max(start, stop)
        bounds = None
        if len(breaks):
            bounds = start + segment_runs(self.n_atoms[start:stop],
                                          np.asarray(breaks, np.int64) - start, chunk_atoms)
        chunks = self._chunks(self.unchanged(self._pieces(start, stop, list(read), chunk_atoms,
                                                          into, bounds)),
                              chunk_atoms, read, sources, bounds)
        if keep is None:
            yield from chunks
            return
        for chunk in chunks:
            mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
            if mask.any():
                yield chunk.take(mask)

    def _chunks(self, pieces, chunk_atoms, read, sources, bounds=None):
        """Chunks of the pieces (see rechunk), with each field of `sources` (name -> the fields
        of `read` that it is read or derived from); a field that some structures lack is filled
        there (see fill_value) and marked in the chunk's `present`, as in a converted file."""
        available = self.fields
        for group in rechunk(pieces, chunk_atoms, bounds):
            chunk = merge_pieces(self.path, group, read, np.nan)
            out = {"atom": {}, "structure": {}}
            present = {}
            for name, names in sources.items():
                data = chunk.atoms if available[name].per == "atom" else chunk.structures
                out[available[name].per][name] = (data[name] if name in data
                                                  else derive(self.path, name, chunk))
                mask = all_of([chunk.present.get(n) for n in names])
                if mask is not None:
                    present[name] = mask
            yield Chunk(chunk.start, chunk.n_atoms, out["atom"], out["structure"], present)

    def stream(self, chunk_atoms, keep=None):
        """Groups of pieces, each group one chunk, with every stored field and streamed result
        (for which `keep(name)`, if given, is true) that each structure has; one pass over the
        file, even for ASE files (used by convert)."""
        names = None if keep is None else [n for n in self._stored if keep(n)]
        results = [n for n in self.streamed_results if keep is None or keep(n)]
        if results:
            names = (list(self._stored) if names is None else names) + results
        return rechunk(self.unchanged(self._pieces(0, None, names, chunk_atoms)), chunk_atoms)

    @property
    def streamed_results(self):
        """name -> attrs of the stored results that `stream` reads: those not named as a
        stored field."""
        if not self._result_fields:  # no pass over a file without results
            return {}
        return {n: self.results[n] for n in self._result_fields if n not in self._stored}


class EmptyBatch(Batch):
    """A file of zero bytes: zero structures."""

    format = "empty"
    n_atoms = np.zeros(0, np.int64)
    _stored = MappingProxyType({})

    def _pieces(self, start, stop, names, chunk_atoms, into=None, bounds=None):
        return iter(())
