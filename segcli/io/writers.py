"""Writing segcli HDF5 files: results a block of rows at a time (ResultWriter, RowsInto) and
whole batches of structures (BatchWriter, convert), each through an output that appears whole
or not at all (segcli.io.outputs)."""

import os
from contextlib import ExitStack
from datetime import datetime, timezone
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from segcli import __version__
from segcli.errors import DataError
from segcli.fields import STRING
from segcli.io.core import (
    FORMAT,
    VERSION,
    FieldInfo,
    Schema,
    check_fill,
    fill_value,
    merge_pieces,
    path_text,
)
from segcli.io.formats import capable
from segcli.io.outputs import atomic_output, ensure_room, locked, new_output, refuse_overwrite

CHUNK_BYTES = 1 << 20
"""The most bytes of a dataset's chunk (rows of results, of a batch's fields)."""


def _set_attrs(obj, attrs):
    for key, value in attrs.items():
        if value is not None:
            obj.attrs[key] = value


def _existing_result(h5, name):
    """The path of what stands where /results/<name> would go (the result itself, or a
    dataset where one of its groups would be), or None."""
    import h5py

    parts = name.split("/")
    for depth in range(1, len(parts) + 1):
        key = "results/" + "/".join(parts[:depth])
        obj = h5.get(key)
        if obj is None:
            return None
        if depth == len(parts) or isinstance(obj, h5py.Dataset):
            return key
    return None


class _BlockRows:
    """Rows of /results/<name> datasets written a block at a time (`_write_block(ds, start_row,
    array)`, `ds` having the dataset's shape, dtype and fillvalue); a result created with a
    fill gets it, as the writer finishes, in the rows no block covered."""

    def write(self, name, start_row, array):
        """Write rows [start_row, start_row + len(array)) of /results/<name>, created by
        `create`."""
        ds = self._results[name]
        array = np.ascontiguousarray(array)
        if array.shape[1:] != ds.shape[1:]:
            raise ValueError(f"rows of shape {array.shape[1:]} for /results/{name}, whose rows "
                             f"are {ds.shape[1:]}")
        if not len(array):
            return
        self._write_block(ds, start_row, array)
        if name in self._written:
            self._written[name].append((start_row, start_row + len(array)))

    def _fill_unwritten(self, step=1 << 16):
        """Write each result's fill value in the rows no block covered, `step` rows at a time."""
        for name, written in self._written.items():
            ds = self._results[name]
            rows = ds.shape[0]
            block = np.full((min(step, rows), *ds.shape[1:]), ds.fillvalue, ds.dtype)
            row = 0
            for start, stop in [*sorted(written), (rows, rows)]:
                for at in range(row, start, step):
                    self._write_block(ds, at, block[:min(step, start - at)])
                row = max(row, stop)


class ResultWriter(_BlockRows):
    """Writes /results/<name> datasets, either to a new file (`output_path`, which then also
    holds /structures/n_atoms) or into the segcli HDF5 file `in_place_of`.

    Everything goes to a temporary file beside the target, renamed over it only when the
    `with` block ends cleanly: a failure leaves nothing behind and the input untouched.
    `names`, the results about to be created in place, are checked before the input is copied.
    """

    def __init__(self, output_path=None, in_place_of=None, force=False, names=()):
        if (output_path is None) == (in_place_of is None):
            raise ValueError("give exactly one of output_path and in_place_of")
        self.in_place = in_place_of is not None
        self.path = os.fspath(in_place_of if self.in_place else output_path)
        self.force = force
        self.names = tuple(names)
        self._n_atoms = None
        self._results = {}  # name -> its dataset, as created
        self._written = {}  # name -> the (start, stop) rows written, for a result with a fill
        self._placed = set()  # the results created `placed`

    def _refuse(self, key):
        if not self.force:
            raise DataError(f"{self.path}: result '{key[len('results/'):]}' already exists; "
                            "use --force to replace it")

    def __enter__(self):
        import h5py

        from segcli.io import open_batch

        with ExitStack() as stack:
            if self.in_place:
                stack.enter_context(locked(self.path))  # until the copy replaces the file
                with open_batch(self.path) as batch:
                    if not capable(batch, "stores_results"):
                        raise DataError(f"{self.path}: results can only be stored in a segcli "
                                        f"HDF5 file; convert it first: segcli convert "
                                        f"{self.path} -o OUT.h5")
                    self._n_atoms = batch.n_atoms
                # refuse before copying a large file, where the results to be created are known
                with h5py.File(self.path, "r") as h5:
                    for name in self.names:
                        existing = _existing_result(h5, name)
                        if existing is not None:
                            self._refuse(existing)
                tmp = stack.enter_context(atomic_output(self.path, copy_of=self.path))
            else:
                tmp = stack.enter_context(new_output(self.path, self.force))
            self._h5 = stack.enter_context(h5py.File(tmp, "r+" if self.in_place else "w"))
            if not self.in_place:
                _set_attrs(self._h5, {"format": FORMAT, "version": VERSION})
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                if self._n_atoms is None:
                    raise ValueError("ResultWriter: set_n_atoms() was not called")
                self._fill_unwritten()
            except BaseException as error:
                self._stack.__exit__(type(error), error, error.__traceback__)
                raise
        return self._stack.__exit__(exc_type, exc, tb)

    def set_n_atoms(self, n_atoms):
        """Atoms per structure: stored in a new file, checked against an in-place one."""
        n_atoms = np.asarray(n_atoms, np.int64)
        if not self.in_place:
            self._h5.create_dataset("structures/n_atoms", data=n_atoms)
            self._n_atoms = n_atoms
        elif not np.array_equal(n_atoms, self._n_atoms):
            raise DataError(f"{self.path}: results stored in place must cover all its "
                            f"{len(self._n_atoms)} structures, not {len(n_atoms)}")

    def set_sources(self, paths, source_of, start, stop, step=1 << 20):
        """Where a new file's structures, structures [start, stop) of a batch, come from: the
        root attribute `sources` (the input files' paths), /structures/source (indices into
        them) and /structures/source_index (the structures' numbers inside their files), as
        `source_of(slice)` (see Batch.source_of) gives them, `step` structures at a time."""
        import h5py

        if self.in_place:
            raise ValueError("ResultWriter: sources describe the structures of a new file")
        self._h5.attrs["sources"] = np.array([path_text(p) for p in paths],
                                             dtype=h5py.string_dtype())
        source = self._h5.create_dataset("structures/source", (stop - start,), np.int32)
        index = self._h5.create_dataset("structures/source_index", (stop - start,), np.int64)
        for at in range(start, stop, step):
            block = source_of(slice(at, min(at + step, stop)))
            for ds, values, dtype in ((source, block[0], np.int32), (index, block[1], np.int64)):
                self._write_block(ds, at - start, np.ascontiguousarray(values, dtype))

    def create(self, name, shape, dtype, attrs, fill=None, placed=False):
        """Create /results/<name>, `fill` (default 0) in the rows not written when the `with`
        block ends; a result already there (or a result where one of its groups would go) is
        replaced only with force. The rows are filled then, by this writer, not by HDF5 as
        the dataset's storage is allocated, which writes every row twice (10⁷ rows of 3
        float64 in 147 ms against 94, benchmarks/RESULTS.md). With `placed`, its storage is
        allocated in the file at once, so that other processes can write its rows there (see
        `places`)."""
        import h5py

        existing = _existing_result(self._h5, name)
        if existing is not None:
            self._refuse(existing)
            del self._h5[existing]
        ensure_room(self._h5, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        dcpl = None
        if placed:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            self._placed.add(name)
        ds = self._h5.create_dataset(f"results/{name}", shape=shape, dtype=dtype, fillvalue=fill,
                                     fill_time=None if fill is None and not placed else "never",
                                     dcpl=dcpl)
        if fill is not None:
            self._written[name] = []
        _set_attrs(ds, {"segcli_version": __version__,
                        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        **attrs})
        self._results[name] = ds

    @property
    def temporary(self):
        """The file being written, renamed to `path` (or over it) as the `with` block ends."""
        return self._h5.filename

    def places(self):
        """{name: (the byte offset of its first row in the file, its shape, dtype and fill)}
        of the results created `placed`, the file flushed: where RowsInto writes their rows
        from other processes, which this writer then leaves alone (see `written_elsewhere`).
        HDF5 keeps none of their bytes in memory here, as it never reads or writes them."""
        self._h5.flush()
        return {name: RowsPlace(ds.id.get_offset() or 0, ds.shape, ds.dtype.str,
                                ds.fillvalue if name in self._written else None)
                for name, ds in self._results.items() if name in self._placed}

    def written_elsewhere(self, name, start, stop):
        """Rows [start, stop) of /results/<name> were written by another process (RowsInto):
        they get no fill here."""
        if name in self._written:
            self._written[name].append((start, stop))

    def add_attrs(self, name, attrs):
        """Set attributes of /results/<name>."""
        _set_attrs(self._results[name], attrs)

    @staticmethod
    def _write_block(ds, start_row, array):
        """By HDF5's own write of that block of rows, which h5py's slicing and the lookup by
        name cost about as much again as a block of 64 Ki float64 rows (benchmarks/RESULTS.md)."""
        from h5py import h5s

        rows = ds.id.get_space()
        rows.select_hyperslab((start_row,) + (0,) * (array.ndim - 1), array.shape)
        ds.id.write(h5s.create_simple(array.shape), rows, array)


class RowsPlace(NamedTuple):
    """Where the rows of a result lie in its file (see ResultWriter.places): the byte offset of
    its first row, its shape, its dtype (NumPy's str) and fill value (None: no fill)."""
    offset: int
    shape: tuple
    dtype: str
    fillvalue: object


class RowsInto(_BlockRows):
    """Writes rows of /results/<name> datasets that another process created (allocated, see
    ResultWriter.places) in the HDF5 file `path` and holds open: straight into their bytes
    there, so that the tasks of a cluster write their shards' rows side by side into the
    output, none through the client. Its rows of result `name` are rows places[name][1] on of
    places[name][0] (see _Hdf5Sink.rows_of_shards); those that no block covers get their fill
    as the writer finishes. Nothing else of the file is touched; `target` names the output in
    errors."""

    def __init__(self, path, target, places):
        self.path, self.target, self._places = os.fspath(path), target, places
        self._results = {}  # name -> its RowsPlace, the rows of this writer only
        self._written = {}
        self._fd = None

    def __enter__(self):
        try:
            self._fd = os.open(self.path, os.O_WRONLY)
        except OSError as err:
            raise DataError(f"{self.target}: cannot write there ({err.strerror})") from err
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._fill_unwritten()
        finally:
            os.close(self._fd)

    def set_n_atoms(self, n_atoms):
        """Nothing: the file's creator stores them."""

    def create(self, name, shape, dtype, attrs, fill=None, placed=True):
        """Take /results/<name>'s rows, `shape` its rows of the dataset the file has (`attrs`
        and `placed` are its creator's)."""
        (place, first), dtype = self._places[name], np.dtype(dtype)
        if (shape[1:] != place.shape[1:] or first + shape[0] > place.shape[0]
                or dtype != np.dtype(place.dtype) or (fill is None) != (place.fillvalue is None)):
            raise ValueError(f"/results/{name}: rows {first}..+{shape} of {dtype} do not fit "
                             f"the dataset {place}")
        self._results[name] = place._replace(offset=place.offset + first * _row_bytes(place),
                                             shape=tuple(shape))
        if fill is not None:
            self._written[name] = []

    def _write_block(self, place, start_row, array):
        data = memoryview(np.ascontiguousarray(array, place.dtype)).cast("B")
        at = place.offset + start_row * _row_bytes(place)
        try:
            while len(data):
                done = os.pwrite(self._fd, data, at)
                data, at = data[done:], at + done
        except OSError as err:
            raise DataError(f"{self.target}: {err.strerror}") from err


def _row_bytes(place):
    return int(np.prod(place.shape[1:], dtype=np.int64)) * np.dtype(place.dtype).itemsize


JOIN_HINT = ("; `--to-ase-units` converts each input to ASE's units, `--units NAME=UNIT` "
             "states those of an input that states none")


class BatchWriter:
    """Appends chunks of structures to a new segcli HDF5 file, in resizable chunked datasets.

    With `fill` (NaN), a field that some structures lack is filled there (see `fill_value`, also
    stored as the dataset's attribute `fill_value`), and /present/<name> records which
    structures have it. Results (see `append`) go to /results/<name>, which every structure
    must have. Each field's units (see `append`) become its dataset's attribute `units`."""

    def __init__(self, h5, compression=None, fill=None):
        _set_attrs(h5, {"format": FORMAT, "version": VERSION})
        for group in ("structures", "atoms"):
            h5.create_group(group)
        self._h5 = h5
        self._fill = fill
        self._filters = {"compression": compression, "shuffle": compression is not None}
        self.schema = Schema()
        self.n_structures = 0
        self.n_atoms = 0
        self._first_path = None
        self._results = {}
        self._units = {}

    def append(self, path, pieces, results=MappingProxyType({}), units=MappingProxyType({})):
        """Append consecutive structures of `path` (the pieces of one chunk); `results` maps
        the names of the pieces' fields that are results in `path` to their attributes,
        `units` those of its fields whose units are stated to them (see units.join)."""
        from segcli.io.units import join

        self._first_path = self._first_path or path
        for name, attrs in results.items():
            self._results.setdefault(name, {k: v for k, v in attrs.items() if k != "structures"})
        first_seen = {}
        for p in pieces:
            for per, data in (("atom", p.atoms), ("structure", p.structures)):
                for name in data:
                    first_seen.setdefault(name, (per, p))
        late = [name for name in first_seen if name not in self.schema and self.n_structures]
        for name in late:
            check_fill(self._first_path, 0, name, self._fill)
        for name, (per, p) in first_seen.items():
            unit = units.get(name)
            self._units[name] = (join(path, name, p.start, self._units[name], unit, JOIN_HINT)
                                 if name in self._units else unit)
            array = (p.atoms if per == "atom" else p.structures)[name]
            self.schema.add(path, FieldInfo(name, per, array.shape[1:], array.dtype), p.start,
                            result=name in self._results)
        chunk = merge_pieces(path, pieces, self.schema, self._fill)
        self._extend("structures", "n_atoms", self.n_structures, chunk.n_atoms)
        for name, info in list(self.schema.items()):
            array = (chunk.atoms if info.per == "atom" else chunk.structures)[name]
            self.schema.add(path, info._replace(dtype=array.dtype), chunk.start)
            rows = self.n_atoms if info.per == "atom" else self.n_structures
            self._extend(self._group(name), name, rows, array)
            self._mark(name, chunk.present.get(name), name in late)
        self.n_structures += len(chunk.n_atoms)
        self.n_atoms += int(chunk.n_atoms.sum())

    def finish(self):
        """Give a file without structures its empty /structures/n_atoms, and each field its
        units."""
        if "n_atoms" not in self._h5["structures"]:
            self._h5["structures"].create_dataset("n_atoms", data=np.zeros(0, np.int64))
        for name, unit in self._units.items():
            if unit:
                self._dataset(name).attrs["units"] = unit

    def _fill_of(self, dtype):
        """The fill of a field of `dtype` (NaN for floats without `fill`: what a converted input
        that records which structures have its fields was filled with)."""
        return fill_value(dtype, np.nan if self._fill is None else self._fill)

    def _group(self, name):
        if name in self._results:
            return "results"
        return "atoms" if self.schema[name].per == "atom" else "structures"

    def _dataset(self, name):
        return self._h5[self._group(name)][name]

    def _mark(self, name, mask, late):
        """Record which structures of the chunk just written have field `name` (mask None:
        all), creating /present/<name> at its first gap: earlier structures all had the field,
        unless it is `late` (new in this chunk)."""
        present = self._h5.get(f"present/{name}")
        rows = len(self._h5["structures/n_atoms"])
        if present is None:
            if mask is None and not late:
                return
            if name in self._results:
                raise DataError(f"{self._first_path}: result '{name}' is not in every input; "
                                f"leave it out (--drop {name})")
            present = self._h5.require_group("present").create_dataset(
                name, shape=(self.n_structures,), maxshape=(None,), dtype=bool,
                chunks=(int(np.clip(rows, 1, CHUNK_BYTES)),), fillvalue=not late, **self._filters)
            self._dataset(name).attrs["fill_value"] = self._fill_of(self.schema[name].dtype)
        present.resize(rows, axis=0)
        present[self.n_structures:rows] = True if mask is None else mask

    def _extend(self, group, name, rows, array):
        ds = self._h5.require_group(group).get(name)
        if ds is None:
            ds = self._create(group, name, array.dtype, array.shape[1:], len(array))
            ds.resize(rows, axis=0)
            if name in self._results:
                _set_attrs(ds, {**self._results[name], "per": self.schema[name].per})
        elif ds.dtype != array.dtype:
            ds = self._promote(ds, array.dtype)
        self._ensure_room(array)
        ds.resize(rows + len(array), axis=0)
        ds[rows:] = array

    def _ensure_room(self, array):
        """ensure_room for `array`, compressed as the file's filters will compress it (an
        estimate, made only when `array` as it is would not fit)."""
        try:
            ensure_room(self._h5, array)
        except DataError:
            if self._filters["compression"] is None or array.dtype == STRING:
                raise
            ensure_room(self._h5, _compressed_size(array, self._filters["compression"]))

    def _create(self, group, name, dtype, trailing, rows_hint):
        import h5py

        row_bytes = max(1, int(np.prod(trailing)) * dtype.itemsize)
        rows = int(np.clip(rows_hint, 1, max(1, CHUNK_BYTES // row_bytes)))
        string = dtype == STRING
        fill = None if self._fill is None or string else self._fill_of(dtype)
        return self._h5[group].create_dataset(
            name, shape=(0, *trailing), maxshape=(None, *trailing),
            dtype=h5py.string_dtype() if string else dtype, chunks=(rows, *trailing),
            fillvalue=fill, **self._filters)

    def _promote(self, ds, dtype):
        """Rewrite a dataset with a wider dtype (a field that was integer, then float), its
        filled rows holding the new dtype's fill."""
        group, name = ds.parent, ds.name.rsplit("/", 1)[1]
        new = self._create(group.name, f"{name}.promoted", dtype, ds.shape[1:], ds.chunks[0])
        _set_attrs(new, dict(ds.attrs))
        ensure_room(self._h5, ds.size * np.dtype(dtype).itemsize)
        new.resize(len(ds), axis=0)
        step = ds.chunks[0] * 64
        for lo in range(0, len(ds), step):
            new[lo:lo + step] = ds[lo:lo + step]
        partial = "fill_value" in ds.attrs
        del group[name]
        group.move(f"{name}.promoted", name)
        if partial:
            self._refill(group[name], self._h5[f"present/{name}"])
        return group[name]

    def _refill(self, ds, present):
        """Put the fill of `ds`'s dtype where the structures that `present` marks absent are."""
        fill = self._fill_of(ds.dtype)
        ds.attrs["fill_value"] = fill
        counts = self._h5["structures/n_atoms"]
        row, step = 0, 1 << 16
        for lo in range(0, len(present), step):
            absent = ~present[lo:lo + step]
            if ds.parent.name == "/atoms":
                absent = np.repeat(absent, counts[lo:lo + len(absent)])
            block = ds[row:row + len(absent)]
            block[absent] = fill
            ds[row:row + len(absent)] = block
            row += len(absent)


_COMPRESSION_ESTIMATES = {"gzip": (4, 1.1), "lzf": (1, 2.0)}
"""Per filter: the zlib level that estimates its output's size, and a factor of safety."""


def _compressed_size(array, compression):
    """About the bytes `array` takes on disk with `compression` after HDF5's shuffle filter
    (zlib's size for bytes shuffled the same way, times a factor of safety), and a page per
    HDF5 chunk of index and headers."""
    import zlib

    level, factor = _COMPRESSION_ESTIMATES[compression]
    data = np.ascontiguousarray(array)
    shuffled = data.view(np.uint8).reshape(-1, data.dtype.itemsize).T
    chunks = data.nbytes // CHUNK_BYTES + 1
    return int(len(zlib.compress(shuffled.tobytes(), level)) * factor) + 4096 * chunks


def _cast(path, index, name, array, dtype):
    """`array` (field `name` of the piece from structure `index`) as `dtype` (a NumPy dtype's
    name, or "str" for strings), or DataError where a value would change (a fraction cast to
    an integer, an overflow, text that is no number)."""
    if dtype == "str":
        if array.dtype == STRING:
            return array
        if array.ndim != 1:
            raise DataError(f"{path}: field '{name}' has shape {array.shape[1:]}; only one "
                            "value per row can be cast to str")
        return np.array([str(v) for v in array.tolist()], STRING)
    try:
        with np.errstate(invalid="ignore", over="ignore"):  # NaN, inf, too large: compared next
            cast = np.asarray(array.tolist() if array.dtype == STRING else array).astype(dtype)
        same = array.dtype == STRING or np.array_equal(cast, array, equal_nan=True)
    except (ValueError, TypeError, OverflowError):
        same = False
    if not same:
        raise DataError(f"{path}: --cast {name}={dtype}: field '{name}' of structures from "
                        f"{index} cannot be cast to {dtype} without changing its values")
    return cast


class FieldChoice:
    """The fields a conversion writes, their names and units: `fields` keeps only those, `drop`
    leaves those out (names as read, results included); `rename` maps old names to new,
    `cast` names (as renamed) to dtypes (see _cast), `units` names (as renamed) to the units
    of an input that states none (see segcli.io.units); `to_ase_units` converts the fields of
    known units to ASE's, putting those of units it does not know into `left` (name -> unit)."""

    def __init__(self, fields=None, drop=None, rename=None, cast=None, units=None,
                 to_ase_units=False, left=None):
        if fields is not None and drop is not None:
            raise ValueError("give at most one of fields and drop")
        if drop is not None and "n_atoms" in drop:
            raise ValueError("n_atoms is always kept")
        self._fields, self._drop = fields, drop
        self._rename, self._cast = dict(rename or {}), dict(cast or {})
        self._units, self._to_ase = dict(units or {}), to_ase_units
        self.left = {} if left is None else left
        self._seen = set()

    @property
    def keep(self):
        """The `keep` of Batch.stream: None for every field."""
        return None if self._fields is None and self._drop is None else self._keeps

    def _keeps(self, name):
        self._seen.add(name)
        return name in self._fields if self._fields is not None else name not in self._drop

    def units(self, batch):
        """name (as renamed) -> units of the fields of `batch` this choice keeps, as read: as
        the batch states them, else as `units` gives them; DataError where both do and
        differ."""
        keep = self.keep
        units = self.renamed({n: u for n, u in batch.units.items() if keep is None or keep(n)})
        for name, unit in self._units.items():
            if units.get(name, unit) != unit:
                raise DataError(f"{batch.path}: field '{name}' is in {units[name]}, which the "
                                f"file states; --units {name}={unit} states the units of an "
                                "input that states none")
        return {**self._units, **units}

    def written(self, units):
        """The units (see `units`) of the fields as this choice writes them."""
        from segcli.io.units import ase_units

        return ase_units(units) if self._to_ase else units

    def apply(self, path, pieces, units=None):
        """The pieces (of the file `path`) with their fields renamed, cast, and with
        `to_ase_units`, converted from `units` (see `units`)."""
        from segcli.io.units import to_ase

        for piece in pieces:
            self._seen.update(piece.atoms, piece.structures)
        if self._rename or self._cast:
            pieces = [self._renamed(path, p) for p in pieces]
        if self._to_ase and units:
            pieces = [to_ase(path, p, units, self.left) for p in pieces]
        return pieces

    def _renamed(self, path, piece):
        rename = self._rename
        fields = [*piece.atoms, *piece.structures]
        names = [rename.get(k, k) for k in fields]
        if len(set(names)) < len(names):  # per atom and per structure alike
            new = next(n for n in names if names.count(n) > 1)
            olds = [k for k in fields if k != new and rename.get(k) == new]
            why = f"both name a field '{new}'" if len(olds) > 1 else \
                f"structure {piece.start} has a field '{new}' already"
            raise DataError(f"{path}: {' and '.join(f'--rename {o}={new}' for o in olds)}: "
                            f"{why}")
        atoms, structures = ({n: _cast(path, piece.start, n, v, self._cast[n])
                              if n in self._cast else v
                              for n, v in zip((rename.get(k, k) for k in data), data.values())}
                             for data in (piece.atoms, piece.structures))
        present = {rename.get(k, k): v for k, v in piece.present.items()}
        return piece._replace(atoms=atoms, structures=structures, present=present)

    def renamed(self, attrs):
        """`attrs` (name -> attributes) with the names renamed."""
        return {self._rename.get(n, n): a for n, a in attrs.items()}

    def check(self, inputs):
        """DataError for the first name an option gives that no input has."""
        renamed = {self._rename.get(n, n) for n in self._seen}
        options = [("--fields", self._fields, self._seen), ("--drop", self._drop, self._seen),
                   ("--rename", self._rename, self._seen), ("--cast", self._cast, renamed),
                   ("--units", self._units, renamed)]
        for option, names, known in options:
            unknown = sorted(set(names or ()) - known - {"n_atoms"})
            if unknown:
                raise DataError(f"{', '.join(map(os.fspath, inputs))}: no field "
                                f"'{unknown[0]}' ({option}); the fields are: "
                                f"{', '.join(sorted(known)) or '(none)'}")


def convert(inputs, output, *, compression=None, chunk_atoms=100_000, fill_missing=None,
            fields=None, drop=None, rename=None, cast=None, units=None, to_ase_units=False,
            left=None, force=False, progress=None, input_format=None):
    """Write the structures of `inputs` (any files open_batch reads, in `input_format` if
    given), concatenated in order, to a new segcli HDF5 file `output`, streaming
    `chunk_atoms` atoms at a time.

    `fill_missing` (NaN) fills fields that some structures lack (floats with NaN, integers and
    booleans with 0, strings with ""; /present/<name> says which structures have them);
    without it they raise DataError. `fields` (names) keeps only those fields, `drop` (names)
    leaves those out; `rename` (old name -> new) renames fields, `cast` (name, as renamed ->
    a NumPy dtype's name or "str") converts them; `units` (name, as renamed -> unit) states
    the units of inputs that state none, and `to_ase_units` converts the fields of known
    units to ASE's, a gradient into forces, putting the others into `left` (see FieldChoice);
    a name that no input has raises DataError. Units that inputs state differently raise
    DataError (see units.join).
    Stored results (/results/NAME) are written as fields. `progress.update(n)` is called with
    the structures of each chunk written (see segcli.cli.common.progress), after
    `progress.reset(total)` where the inputs' sizes are known without reading them through.
    Returns (structures, atoms, fields) written.
    """
    import h5py

    from segcli.io import open_batch

    choice = FieldChoice(fields, drop, rename, cast, units, to_ase_units, left)
    output = os.fspath(output)
    refuse_overwrite(output, force)
    with ExitStack() as stack:
        batches = [stack.enter_context(open_batch(path, input_format)) for path in inputs]
        tmp = stack.enter_context(new_output(output, force))
        h5 = stack.enter_context(h5py.File(tmp, "w"))
        writer = BatchWriter(h5, compression, fill_missing)
        counts = [batch.counted for batch in batches]
        if progress is not None and None not in counts:
            progress.reset(sum(counts))
        for batch in batches:
            results = choice.renamed(batch.streamed_results)
            stated = choice.units(batch)
            written = choice.written(stated)
            for pieces in batch.stream(chunk_atoms, choice.keep):
                writer.append(batch.path, choice.apply(batch.path, pieces, stated), results,
                              written)
                if progress is not None:
                    progress.update(sum(len(p.n_atoms) for p in pieces))
        choice.check(inputs)
        writer.finish()
    return writer.n_structures, writer.n_atoms, dict(writer.schema)
