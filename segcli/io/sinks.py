"""Where results go, one entry each in SINKS: a new segcli HDF5 file (rows per structure or
atom, /results/NAME), the input itself (in place), a table (csv, json lines, npy) into a new
file or a stream, or arrays kept in memory. The entry is chosen once (`choose`), from the
format asked for or the output's suffix, and opened for a computation by `open_sink`.

A sink is a context manager with `write(chunk, arrays)`: a chunk of whole structures
(io.core.Chunk) and dataset -> its rows for the chunk. A table sink writes rows only for the
structures computed (those a selection keeps); an HDF5 sink writes a row for every structure
of the range, NaN where a selection leaves one out.
"""

import contextlib
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from segcli.errors import ArgumentError, DataError, literal
from segcli.io import text
from segcli.io.core import spread
from segcli.io.outputs import new_output
from segcli.io.writers import ResultWriter, RowsInto
from segcli.memory import offsets_of


class IntoFile:
    """A table sink (TextSink, NpySink) that writes the new file `path` (see
    outputs.new_output): it appears only when complete."""

    def __init__(self, sink, path, force):
        self._sink, self._path, self._force = sink, path, force

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(new_output(self._path, self._force))
            self._sink.out = stack.enter_context(open(tmp, "wb"))
            stack.enter_context(self._sink)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def write(self, chunk, arrays):
        try:
            self._sink.write(chunk, arrays)
        except OSError as err:
            raise DataError(f"{self._path}: {err.strerror}") from err


class Hdf5Sink:
    """Results into /results/<dataset> of a new file or, in place, of the input (ResultWriter),
    a row for each of the `n_atoms` structures from structure `first` (or for their atoms);
    with `selected`, NaN in the rows that no chunk writes (see _selected_outputs). A new file
    also says where its structures come from (`sources`: the input paths and the batch's
    source_of, see ResultWriter.set_sources). With `placed`, its results' rows can be written
    by other processes (see rows_of_shards)."""

    def __init__(self, writer, outputs, n_atoms, attrs, sources=None, first=0, selected=False,
                 placed=False):
        self._writer, self._attrs, self._first = writer, attrs, first
        self._outputs = _selected_outputs(outputs) if selected else outputs
        self._fill = np.nan if selected else None
        self._n_atoms, self._sources, self._placed = n_atoms, sources, placed
        per_atom = any(per == "atom" for per, _, _ in self._outputs.values())
        self._atom_offsets = offsets_of(n_atoms) if per_atom else None

    def __enter__(self):
        self._writer.__enter__()
        try:
            self._writer.set_n_atoms(self._n_atoms)
            if self._sources:
                paths, source_of = self._sources
                self._writer.set_sources(paths, source_of, self._first,
                                         self._first + len(self._n_atoms))
            rows = {"atom": int(self._n_atoms.sum()), "structure": len(self._n_atoms)}
            for dataset, (per, shape, dtype) in self._outputs.items():
                self._writer.create(dataset, (rows[per], *shape), dtype,
                                    {**self._attrs[dataset], "per": per}, self._fill,
                                    placed=self._placed)
        except BaseException:
            self._writer.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        return self._writer.__exit__(*exc)

    def write(self, chunk, arrays):
        from segcli.engine.checks import check_float64

        numbers = chunk.structure_numbers - self._first
        lo, hi = int(numbers[0]), int(numbers[-1]) + 1
        for dataset, array in arrays.items():
            if self._outputs[dataset][2].kind == "f" and self._outputs[dataset][0] == "structure":
                check_float64(self._writer.path, f"result '{dataset}'", array,
                              chunk.structure_numbers)
            if chunk.selected is None:
                row = self._row(dataset, lo)
            else:  # the rows of the structures between, filled
                starts = self._row(dataset, np.arange(lo, hi + 1))
                row = int(starts[0])
                _, array = spread(array, numbers - lo, starts - row, self._fill)
            self._writer.write(dataset, row, array)

    def _row(self, dataset, structure):
        """The row of `dataset` where structure `first + structure` begins (an int), or where
        each of the structures `first + structure` begin (an array of them)."""
        if self._outputs[dataset][0] == "structure":
            return structure
        starts = self._atom_offsets[structure]
        return int(starts) if isinstance(structure, int) else starts

    def rows_of_shards(self, bounds):
        """For each shard [a, b) of `bounds` (structures from `first`), a RowsInto of its rows
        of every result, for a task to write them into this sink's file (made `placed`)."""
        places = self._writer.places()
        return [RowsInto(self._writer.temporary, self._writer.path,
                         {d: (place, self._row(d, int(a))) for d, place in places.items()})
                for a in bounds[:-1]]

    def written_elsewhere(self, a, b):
        """Structures [a, b) (from `first`) were written by a RowsInto: no fill there."""
        for dataset in self._outputs:
            self._writer.written_elsewhere(dataset, self._row(dataset, a), self._row(dataset, b))

    def add_attrs(self, attrs):
        """Set attributes of every result."""
        for dataset in self._outputs:
            self._writer.add_attrs(dataset, attrs)


def _selected_outputs(outputs):
    """`outputs` (dataset -> (per, shape, dtype)) as stored for a selection: integer results
    as float64, so that the rows of structures not selected can hold NaN."""
    from segcli.engine.jobs import nan_dtype

    return {d: (per, shape, nan_dtype(dtype)) for d, (per, shape, dtype) in outputs.items()}


class TextSink:
    """Results on stdout as CSV (a header line, then one line per structure or atom) or JSON
    lines (segcli.io.text), with the structure index first, then (given `source_of`, see
    Batch.source_of, for many files) its file and its index there, and the atom index within
    it; into the binary stream `out` (IntoFile gives it one)."""

    def __init__(self, fmt, outputs, columns, source_of=None, out=None):
        self._fmt, self._columns, self._source_of = fmt, columns, source_of
        self._per = next(iter(outputs.values()))[0]
        keys = (["structure"] + (["source", "source_index"] if source_of else [])
                + (["atom"] if self._per == "atom" else []))
        self._shapes = {**dict.fromkeys(keys, ()),
                        **{columns[label]: shape for label, (_, shape, _) in outputs.items()}}
        self.out = out

    def __enter__(self):
        if self._fmt == "csv":
            self.out.write(text.header(self._shapes))
        return self

    def __exit__(self, *exc):
        self.out.flush()

    def write(self, chunk, arrays):
        numbers = chunk.structure_numbers
        index = {"structure": numbers}
        if self._source_of:
            span = self._source_of(slice(numbers[0], numbers[-1] + 1))
            index["source"], index["source_index"] = (c[numbers - numbers[0]] for c in span)
        if self._per == "atom":
            first = np.repeat(np.cumsum(chunk.n_atoms) - chunk.n_atoms, chunk.n_atoms)
            index = {key: np.repeat(i, chunk.n_atoms) for key, i in index.items()}
            index["atom"] = np.arange(len(first)) - first
        values = {self._columns[label]: array for label, array in arrays.items()}
        self.out.writelines(text.lines(self._fmt, {**index, **values}))


class NpySink:
    """Results on stdout as one .npy array: (rows, *shape), or with several outputs one
    structured array with a field per output; into the binary stream `out`."""

    def __init__(self, outputs, columns, n_atoms, out=None):
        per = next(iter(outputs.values()))[0]
        rows = int(n_atoms.sum()) if per == "atom" else len(n_atoms)
        if len(outputs) == 1:
            (_, shape, dtype), = outputs.values()
            self._dtype, self._shape = np.dtype(dtype), (rows, *shape)
        else:
            self._dtype = np.dtype([(columns[label], dtype, shape)
                                    for label, (_, shape, dtype) in outputs.items()])
            self._shape = (rows,)
        self._columns = columns
        self.out = out

    def __enter__(self):
        header = {"descr": np.lib.format.dtype_to_descr(self._dtype), "fortran_order": False,
                  "shape": self._shape}
        np.lib.format.write_array_header_2_0(self.out, header)
        return self

    def __exit__(self, *exc):
        self.out.flush()

    def write(self, chunk, arrays):
        if len(arrays) == 1:
            (array,), = [arrays.values()]
            self.out.write(np.ascontiguousarray(array, self._dtype))
            return
        out = np.empty(len(next(iter(arrays.values()))), self._dtype)
        for label, array in arrays.items():
            out[self._columns[label]] = array
        self.out.write(out)


class Collect:
    """Results kept in memory: each dataset's rows of the structures computed, in order (see
    `arrays`)."""

    def __init__(self, outputs):
        self._outputs = outputs
        self._parts = {d: [] for d in outputs}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def write(self, chunk, arrays):
        for dataset, array in arrays.items():
            self._parts[dataset].append(np.array(array, self._outputs[dataset][2]))

    def arrays(self):
        """Dataset -> its rows, one array each."""
        return {d: np.concatenate(parts) if parts else np.empty((0, *shape), dtype)
                for (d, parts), (_, shape, dtype) in zip(self._parts.items(),
                                                         self._outputs.values())}


class Target(NamedTuple):
    """Where results go: a sink's entry, and its file (`path`: a new file, or the input for
    in place) or its binary stream; `force` replaces an existing file or result."""

    sink: "Sink"
    path: str | None = None
    stream: object = None
    force: bool = False


class Sink(NamedTuple):
    """An entry of SINKS: its name (a --format), the suffixes of files it writes, whether it
    writes a table (rows of one kind, per structure or per atom, of the structures computed
    only) or a segcli HDF5 file's /results (whose rows other processes may write, see
    Hdf5Sink.rows_of_shards); how it opens: `opens(target, results, batch, lo, hi, attrs,
    keep, placed)` (see open_sink) -> a sink; and how a result is read back from its file:
    `reads(path, dataset, column, (per, shape, dtype), structures, start)` -> the rows of
    the `structures` (numbers in the input) of a run over the structures from `start`."""

    name: str
    suffixes: tuple
    table: bool
    hdf5: bool
    opens: Callable
    reads: Callable | None = None


def _hdf5(target, results, batch, lo, hi, attrs, keep, placed):
    writer = ResultWriter(output_path=target.path, force=target.force)
    return Hdf5Sink(writer, results.outputs, batch.n_atoms[lo:hi], results.attrs(attrs),
                    (batch.sources, batch.source_of), lo, keep is not None, placed)


def _in_place(target, results, batch, lo, hi, attrs, keep, placed):
    writer = ResultWriter(in_place_of=target.path, force=target.force, names=results.datasets)
    return Hdf5Sink(writer, results.outputs, batch.n_atoms[lo:hi], results.attrs(attrs), None,
                    lo, keep is not None, placed)


def _table(make):
    """A table sink's `opens`: the sink `make(results, batch, n_atoms computed, out)`, into
    the target's stream or new file."""
    def opens(target, results, batch, lo, hi, attrs, keep, placed):
        n_atoms = batch.n_atoms[lo:hi] if keep is None else batch.n_atoms[lo:hi][keep[lo:hi]]
        sink = make(results, batch, n_atoms, target.stream)
        return sink if target.path is None else IntoFile(sink, target.path, target.force)

    return opens


def _text(fmt):
    return _table(lambda results, batch, n_atoms, out: TextSink(
        fmt, results.outputs, results.columns,
        batch.source_of if len(batch.sources) > 1 else None, out))


def _hdf5_rows(in_place):
    """`reads` of an HDF5 sink: a new file's rows begin at the run's first structure, the
    input's at its structure 0."""
    def reads(path, dataset, column, output, structures, start):
        import h5py

        rows = structures - (0 if in_place else start)
        with h5py.File(path, "r") as h5:
            data = h5["results"][dataset]
            if output[0] == "atom":
                offsets = offsets_of(h5["structures"]["n_atoms"][:])
                rows = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in rows]
                                      or [np.zeros(0, np.int64)])
            if not len(rows):
                return np.empty((0, *output[1]), data.dtype)
            return data[rows[0]:rows[-1] + 1][rows - rows[0]]

    return reads


def _npy_rows(path, dataset, column, output, structures, start):
    array = np.load(path)
    return array if array.dtype.names is None else array[column]


def _text_rows(fmt):
    """`reads` of a csv or json lines table: a column, an empty cell or null NaN."""
    def reads(path, dataset, column, output, structures, start):
        import csv
        import json

        _, shape, dtype = output
        with open(path, newline="") as file:
            if fmt == "csv":
                reader = csv.reader(file)
                header = next(reader)
                where = [header.index(column if not shape else
                                      f"{column}_{'_'.join(map(str, i))}")
                         for i in np.ndindex(*shape)]
                rows = [[float(row[i]) if row[i] else np.nan for i in where] for row in reader]
            else:
                rows = [np.ravel(np.array(json.loads(line)[column], dtype=float)).tolist()
                        for line in file]
        values = np.array(rows, np.float64).reshape(len(rows), *shape)
        return values if dtype.kind == "f" else values.astype(dtype)

    return reads


SINKS = {sink.name: sink for sink in [
    Sink("hdf5", (".h5", ".hdf5", ""), False, True, _hdf5, _hdf5_rows(in_place=False)),
    Sink("in_place", (), False, True, _in_place, _hdf5_rows(in_place=True)),
    Sink("csv", (".csv",), True, False, _text("csv"), _text_rows("csv")),
    Sink("json", (".json", ".jsonl"), True, False, _text("json"), _text_rows("json")),
    Sink("npy", (".npy",), True, False, _table(
        lambda results, batch, n_atoms, out: NpySink(results.outputs, results.columns, n_atoms,
                                                     out)), _npy_rows),
    Sink("memory", (), False, False, lambda target, results, *_: Collect(results.outputs)),
]}
"""Every sink, by name."""

FORMATS = tuple(name for name, sink in SINKS.items() if sink.suffixes)
"""The formats an output may be asked for in."""


def is_stream(output):
    """Whether `output` is a stream to write into (it has `write`), not a file's name."""
    return hasattr(output, "write")


def choose(output=None, in_place=False, format=None, force=False):
    """The Target of results: into the input (`in_place`; its path is the caller's to set),
    into `output` (a new file's path, or a binary stream, which gets a table) in `format`
    (one of FORMATS; default: as the file's suffix says, csv for a stream), or kept in memory
    (neither).
    ArgumentError for what cannot go together or a suffix no sink writes."""
    if output is not None and in_place:
        raise ArgumentError("give {0} or {1}, not both", "output", "in_place")
    if format is not None and format not in FORMATS:
        raise ArgumentError(f"{{0}} must be one of {', '.join(FORMATS)}, not "
                            f"{literal(repr(format))}", "format")
    if in_place:
        if format not in (None, "hdf5"):
            raise ArgumentError("{0} stores results as HDF5; {1} is for {2}", "in_place",
                                "format", "output")
        return Target(SINKS["in_place"], None, None, force)
    if output is None:
        if format is not None:
            raise ArgumentError("{0} is the format of {1}; give one", "format", "output")
        return Target(SINKS["memory"])
    if is_stream(output):
        if format == "hdf5":
            raise ArgumentError("{0}: a stream gets a table (csv, json, npy), not hdf5", "format")
        return Target(SINKS[format or "csv"], None, output, force)
    path = os.fspath(output)
    if format is None:
        suffix = os.path.splitext(os.path.basename(path))[1].lower()
        format = next((name for name in FORMATS if suffix in SINKS[name].suffixes), None)
        if format is None:
            tables = ", ".join(s for name in FORMATS if SINKS[name].table
                               for s in SINKS[name].suffixes)
            raise ArgumentError(f"{{0}} {literal(path)}: name a segcli HDF5 file (.h5, .hdf5) "
                                f"or a table ({tables})", "output")
    return Target(SINKS[format], path, None, force)


def open_sink(target, results, batch, lo, hi, attrs, keep=None, placed=False):
    """The sink of `target` for `results` (the datasets, their outputs, attributes and table
    columns of a computation) over structures [lo, hi) of `batch`, its datasets' attributes
    `attrs` and each one's own; `keep` ((S,) bool), if given, marks the structures computed;
    `placed`, for HDF5, lets other processes write the rows (see Hdf5Sink.rows_of_shards)."""
    return target.sink.opens(target, results, batch, lo, hi, attrs, keep, placed)

