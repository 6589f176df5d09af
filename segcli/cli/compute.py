"""Commands: reduce (one op per structure over a whole file), grad (its per-atom derivatives)
and ops (the table of ops)."""

import contextlib
import functools
import itertools
import os
import sys

import click

# Shared option parsing, for now imported from the commands that defined it first.
from segcli.cli import common
from segcli.cli.common import (
    check_cluster_usage,
    cluster_options,
    note,
    on_cluster,
    progress,
    refuse_output_among_inputs,
    refuse_structures_in_place,
    shard_output,
    shard_selection,
    structure_range,
    table,
    where_option,
    where_selection,
)
from segcli.errors import DataError
from segcli.registry import OPS

_PARAMS = {name: [op for op in OPS.values() if name in op.params]
           for name in dict.fromkeys(p for op in OPS.values() for p in op.params)}
"""Each static param of some op -> the ops that take it (an option of reduce)."""


def _op_table():
    """Each op with its fields and shapes, for the help of reduce."""
    rows = [(" ".join([op.name, *("FIELD", "FIELD2")[:len(op.inputs)]]),
             " ".join([*(i.describe() for i in op.inputs), "->", op.describe_output()]))
            for op in OPS.values()]
    return "\n".join(" " * 6 + line for line in table(rows))


def _with_op_lists(command):
    """The command with its docstring's {op_table} and {not_differentiable} filled in from
    the registry (before click reads the docstring)."""
    command.__doc__ = command.__doc__.replace("{op_table}", _op_table()).replace(
        "{not_differentiable}", ", ".join(n for n, op in OPS.items() if not op.differentiable))
    return command


def _param_options(command):
    """An option --NAME for each static param of some op (bincount's --length)."""
    for name, ops in reversed(_PARAMS.items()):
        defaults = ", ".join(f"{op.params[name]} for {op.name}" for op in ops)
        command = click.option(f"--{name}", type=click.IntRange(min=1), metavar="N",
                               help=f"The {name} of {', '.join(op.name for op in ops)} "
                                    f"(default {defaults}).")(command)
    return command


def _params(ops, options):
    """The static params given as options (removed from `options`); UsageError for one that
    none of `ops` takes."""
    params = {name: options.pop(name) for name in _PARAMS}
    params = {name: value for name, value in params.items() if value is not None}
    for name in params:
        if not any(name in spec.params for spec, _ in ops):
            raise click.UsageError(f"--{name} is for {', '.join(op.name for op in _PARAMS[name])}")
    return params


def _op_list(ctx, param, words):
    """OP [FIELD [FIELD2]] [+ OP [FIELD [FIELD2]] ...] as ((registry.Op, fields), ...)."""
    groups = [[]]
    for word in words:
        if word == "+":
            groups.append([])
        else:
            groups[-1].append(word)
    ops = []
    for group in groups:
        if not group:
            raise click.BadParameter("'+' joins two ops: OP [FIELD...] + OP [FIELD...]")
        op, *fields = group
        if op not in OPS:
            raise click.BadParameter(f"unknown op {op!r} (choose from {', '.join(OPS)})")
        ops.append((OPS[op], tuple(fields)))
    return tuple(ops)


def output_options(*names):
    """The options `names` (see _OUTPUT_OPTIONS) of the commands that compute per structure."""
    def decorate(command):
        for name in reversed(names):
            command = _OUTPUT_OPTIONS[name](command)
        return command

    return decorate


_OUTPUT_OPTIONS = {
    "output": click.option(
        "-o", "--output", type=click.Path(dir_okay=False), callback=common.output_name,
        help="Write a new file instead of printing to stdout: segcli HDF5 (.h5, .hdf5) holding "
             "/structures/n_atoms and /results/NAME, or the table stdout would get (.csv, "
             ".json, .jsonl, .npy)."),
    "in_place": click.option(
        "--in-place", is_flag=True,
        help="Add /results/NAME to FILE itself (a segcli HDF5 file); FILE is replaced only "
             "once the result is complete."),
    "fmt": click.option(
        "--format", "fmt", type=click.Choice(["csv", "json", "npy"]),
        help="Stdout format (default csv): csv with a header line, json (one object per line) "
             "or npy (binary)."),
    "name": click.option("--name", callback=common.result_name,
                         help="Result name (default OP_FIELD[_FIELD2])."),
    "force": click.option("--force", is_flag=True,
                          help="Overwrite an existing output file or result."),
    "structures": click.option(
        "--structures", callback=structure_range, metavar="START:STOP",
        help="Only these structures, a Python slice: START:STOP, -5: (the last five), :10 or "
             "one index (default: all; not with --in-place)."),
    "chunk_atoms": click.option(
        "--chunk-atoms", type=common.CHUNK_ATOMS,
        help="Atoms read and computed at a time (whole structures; default 2 Mi = 2097152): "
             "bounds memory."),
    "device": click.option(
        "--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto",
        show_default=True, help="Where to compute (auto: a GPU when JAX sees one)."),
    "precision": click.option(
        "--precision", type=click.Choice(["float32", "float64"]), default="float64",
        show_default=True, help="Floating-point type of the computation and the results."),
    "quiet": click.option("-q", "--quiet", is_flag=True,
                          help="Print nothing but errors and results."),
    "strict": click.option(
        "--strict", is_flag=True,
        help="Refuse (exit 1) structures whose matrix is singular or zero, such as a "
             "cell-less molecule's cell for matvec, rather than warn."),
}


def _shared_options(command):
    """The options reduce and grad share (SPEC §3)."""
    command = output_options(*_OUTPUT_OPTIONS)(command)
    return where_option(cluster_options(command))


def _check_usage(ops, name, output, in_place, fmt, structures):
    """UsageError (exit 2) for a command line that cannot be run."""
    for spec, fields in ops:
        if len(fields) != len(spec.inputs):
            wanted = " and ".join(f"a per-{i.per} {i.describe()}" for i in spec.inputs)
            raise click.UsageError(f"{spec.name} takes {len(spec.inputs) or 'no'} field(s)"
                                   f"{': ' + wanted if wanted else ''}; got {len(fields)}")
    if name and len(ops) > 1:
        raise click.UsageError("--name names one op's result; several ops are each named "
                               "OP_FIELD[_FIELD2]")
    check_output_usage(output, in_place, fmt, structures)


def check_output_usage(output, in_place, fmt, structures):
    """UsageError (exit 2) for output options that cannot go together."""
    if output and in_place:
        raise click.UsageError("give -o/--output or --in-place, not both")
    if fmt and (output or in_place):
        raise click.UsageError("--format is for stdout; -o writes the format its name says "
                               "and --in-place HDF5")
    refuse_structures_in_place(in_place, structures)
    file_format(output)
    if fmt == "npy" and sys.stdout.isatty():
        raise click.UsageError("--format npy writes binary data; redirect stdout to a file")


class Results:
    """What a command computes: its jobs (engine.Job, one per op) and their outputs, each named
    by its dataset under /results: NAME, or NAME/d_FIELD for derivatives."""

    def __init__(self, jobs, names):
        self.jobs = tuple(jobs)
        self.datasets = {_dataset(name, label): (k, label)
                         for k, (job, name) in enumerate(zip(jobs, names))
                         for label in job.outputs}
        if len(self.datasets) < sum(len(job.outputs) for job in jobs):
            raise click.UsageError("two ops give the same result: "
                                   + ", ".join(f"/results/{d}" for d in self.datasets))
        self.outputs = {d: jobs[k].outputs[label] for d, (k, label) in self.datasets.items()}
        self.names = tuple(names)
        single = len(jobs) == 1
        self.columns = {d: (label or names[k]) if single else d.replace("/", "_")
                        for d, (k, label) in self.datasets.items()}

    def attrs(self, common):
        """Each dataset's attributes: `common` and its op and fields."""
        return {d: {**common, "op": self.jobs[k].spec.name, "fields": list(self.jobs[k].fields)}
                for d, (k, _) in self.datasets.items()}

    def of(self, outputs):
        """Dataset -> array, from engine.run's outputs of one chunk (one dict per job)."""
        return {d: outputs[k][label] for d, (k, label) in self.datasets.items()}

    def check_rows(self, output, in_place):
        """UsageError if stdout would need rows of structures and of atoms at once."""
        per = {d: o[0] for d, o in self.outputs.items()}
        if not (output or in_place) and len(set(per.values())) > 1:
            raise click.UsageError(
                "the rows of a table are per structure or per atom, and these results are "
                "both (" + ", ".join(f"{d}: per {p}" for d, p in per.items())
                + "); write them to HDF5 (-o OUT.h5 or --in-place), or run the ops separately")


_TEXT_SUFFIXES = {".csv": "csv", ".json": "json", ".jsonl": "json", ".npy": "npy"}


def file_format(output):
    """The format of the file -o names: "csv", "json" or "npy" by its suffix, or None for
    HDF5 (.h5, .hdf5, no suffix); UsageError for another suffix."""
    if common.names_hdf5(output):
        return None
    suffix = os.path.splitext(os.path.basename(output))[1].lower()
    if suffix not in _TEXT_SUFFIXES:
        raise click.UsageError(f"-o {output}: name a segcli HDF5 file (.h5, .hdf5) or a "
                               "table (.csv, .json, .jsonl, .npy)")
    return _TEXT_SUFFIXES[suffix]


class _IntoFile:
    """A _TextSink or _NpySink that writes the new file `path` (see new_output): it appears
    only when complete."""

    def __init__(self, sink, path, force):
        self._sink, self._path, self._force = sink, path, force

    def __enter__(self):
        from segcli.io.writers import new_output

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


class _Hdf5Sink:
    """Results into /results/<dataset> of a new file or, in place, of the input (ResultWriter),
    a row for each of the `n_atoms` structures from structure `first` (or for their atoms);
    with `selected`, NaN in the rows that no chunk writes (see _selected_outputs). A new file
    also says where its structures come from (`sources`: the input paths and the batch's
    source_of, see ResultWriter.set_sources). With `placed`, its results' rows can be written
    by other processes (see rows_of_shards)."""

    def __init__(self, writer, outputs, n_atoms, attrs, sources=None, first=0, selected=False,
                 placed=False):
        import numpy as np

        from segcli.io.core import offsets_of

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
        import numpy as np

        from segcli.engine import check_float64
        from segcli.io.core import spread

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
        from segcli.io.writers import RowsInto

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
    from segcli.engine import nan_dtype

    return {d: (per, shape, nan_dtype(dtype)) for d, (per, shape, dtype) in outputs.items()}


class _TextSink:
    """Results on stdout as CSV (a header line, then one line per structure or atom) or JSON
    lines (segcli.io.text), with the structure index first, then (given `source_of`, see
    Batch.source_of, for many files) its file and its index there, and the atom index within
    it."""

    def __init__(self, fmt, outputs, columns, source_of=None):
        self._fmt, self._columns, self._source_of = fmt, columns, source_of
        self._per = next(iter(outputs.values()))[0]
        keys = (["structure"] + (["source", "source_index"] if source_of else [])
                + (["atom"] if self._per == "atom" else []))
        self._shapes = {**dict.fromkeys(keys, ()),
                        **{columns[label]: shape for label, (_, shape, _) in outputs.items()}}
        self.out = sys.stdout.buffer

    def __enter__(self):
        from segcli.io import text

        if self._fmt == "csv":
            self.out.write(text.header(self._shapes))
        return self

    def __exit__(self, *exc):
        self.out.flush()

    def write(self, chunk, arrays):
        import numpy as np

        from segcli.io import text

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


class _NpySink:
    """Results on stdout as one .npy array: (rows, *shape), or with several outputs one
    structured array with a field per output."""

    def __init__(self, outputs, columns, n_atoms):
        import numpy as np

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
        self.out = sys.stdout.buffer

    def __enter__(self):
        import numpy as np

        header = {"descr": np.lib.format.dtype_to_descr(self._dtype), "fortran_order": False,
                  "shape": self._shape}
        np.lib.format.write_array_header_2_0(self.out, header)
        return self

    def __exit__(self, *exc):
        self.out.flush()

    def write(self, chunk, arrays):
        import numpy as np

        if len(arrays) == 1:
            (array,), = [arrays.values()]
            self.out.write(np.ascontiguousarray(array, self._dtype))
            return
        out = np.empty(len(next(iter(arrays.values()))), self._dtype)
        for label, array in arrays.items():
            out[self._columns[label]] = array
        self.out.write(out)


def _into_hdf5(output, in_place, fmt, **_):
    """Whether results go into an HDF5 file (-o OUT.h5, --in-place), not out as a stream."""
    return bool(in_place or (output and not (fmt or file_format(output))))


def open_sink(results, batch, lo, hi, *, output, in_place, file, fmt, force, attrs, keep=None,
              placed=False):
    """Where the results (a Results) of structures [lo, hi) of `batch` go: a new file (-o),
    FILE itself (--in-place) or stdout (fmt); `keep` ((S,) bool), if given, marks the
    structures computed (the others get NaN rows in HDF5, no rows elsewhere); `placed`, for
    HDF5, lets other processes write the rows (see _Hdf5Sink.rows_of_shards)."""
    from segcli.io import ResultWriter

    n_atoms = batch.n_atoms[lo:hi]
    fmt = fmt or file_format(output)
    if _into_hdf5(output, in_place, fmt):
        writer = (ResultWriter(output_path=output, force=force) if output
                  else ResultWriter(in_place_of=file, force=force, names=results.datasets))
        sources = (batch.sources, batch.source_of) if output else None
        return _Hdf5Sink(writer, results.outputs, n_atoms, results.attrs(attrs), sources, lo,
                         keep is not None, placed)
    if fmt == "npy":
        sink = _NpySink(results.outputs, results.columns,
                        n_atoms if keep is None else n_atoms[keep[lo:hi]])
    else:
        sink = _TextSink(fmt or "csv", results.outputs, results.columns,
                         batch.source_of if len(batch.sources) > 1 else None)
    return _IntoFile(sink, output, force) if output else sink


def _dataset(name, label):
    return f"{name}/{label}" if label else name


def compute_into(batch, results, sink, device, lo, hi, chunk_atoms, progress=None, notes=(),
                 keep=None, run=None):
    """Compute the results' jobs over structures [lo, hi) of `batch` (those `keep` marks, if
    given) on `device`, in one pass, by `run` (default engine.run, whose signature it has),
    into `sink`, each chunk's results written while the next computes; the `notes` go to
    stderr once the first chunk is computed."""
    from segcli import engine

    chunks = (run or engine.run)(batch, results.jobs, device, structures=slice(lo, hi),
                                 chunk_atoms=chunk_atoms or engine.DEFAULT_CHUNK_ATOMS,
                                 keep=keep)

    def write(chunk, outputs):
        sink.write(chunk, outputs)
        if progress is not None:
            progress.update(len(chunk.n_atoms))

    with contextlib.closing(chunks):
        first = next(chunks, None)  # what fails at once fails before any output
        for message in notes:
            note(message)
        with sink, engine.behind(write) as write_behind:  # written while the next computes
            for chunk, outputs in itertools.chain([first] if first else [], chunks):
                write_behind(chunk, results.of(outputs))


def _plan(batch, path, ops, names, plan):
    """The Results of `ops` ((registry.Op, fields), ...) named `names` over `batch`."""
    from segcli import engine

    return Results([engine.plan(path, spec, fields, batch.fields, present=batch.present, **plan)
                    for spec, fields in ops], names)


def _part(layout, ops, names, plan, device, chunk_atoms, where, lo, hi, into, attrs):
    """One shard of a command run on a cluster: structures [lo, hi) of the batch `layout`
    describes (see segcli.io.open_inputs), those where the --where conditions `where` hold,
    into the new part file `into` (replaced whole if a retried task wrote it before), or into
    the output's own rows `into` (a RowsInto; rewritten alike). `ops` are (op name, fields)
    pairs. Returns the label of the device it computed on."""
    from segcli.curate.selection import where_mask
    from segcli.io import open_inputs

    target = common.device(device)
    label = common.device_label(target)
    with open_inputs(layout) as batch:
        results = _plan(batch, batch.path, [(OPS[op], fields) for op, fields in ops], names,
                        plan)
        keep = where_mask(batch, where, structures=slice(lo, hi)) if where else None
        if isinstance(into, str):
            sink = open_sink(results, batch, lo, hi, output=into, in_place=False, file=None,
                             fmt=None, force=True, keep=keep,
                             attrs={**attrs, "structures": f"{lo}:{hi}", "device": label})
        else:  # the client's file: n_atoms, sources and attributes are its own
            sink = _Hdf5Sink(into, results.outputs, batch.n_atoms[lo:hi], results.attrs(attrs),
                             None, lo, keep is not None)
        compute_into(batch, results, sink, target, lo, hi, chunk_atoms, keep=keep)
    return label


def _singular_matrices(batch, file, ops, lo, hi, strict, quiet, keep=None):
    """Warn on stderr (not when quiet), or with `strict` raise DataError, when an op's
    invertible per-structure matrix (see registry.Arg) is singular in some of the structures
    [lo, hi) (those `keep` marks, if given): a structure without a cell, say, whose matvec
    gives 0."""
    import numpy as np

    from segcli import engine

    for spec, fields in ops:
        for arg, name in zip(spec.inputs, fields):
            if not arg.invertible:
                continue
            singular = sum(int(np.count_nonzero(
                engine.singular(chunk.structures[name]) & chunk.present.get(name, True)))
                for chunk in batch.iter_chunks([name], structures=slice(lo, hi), keep=keep))
            if not singular:
                continue
            total = hi - lo if keep is None else int(keep.sum())
            message = (f"{file}: '{name}' is singular or zero in {singular} of {total} "
                       f"structure(s) (no cell, say); {spec.name} gives 0 there for a zero "
                       f"matrix")
            if strict:
                raise DataError(f"{message} (--strict)")
            if not quiet:
                note(f"warning: {message} (--strict refuses them)")


def _absent(batch, file, results, selected, lo, hi, keep=None):
    """What to say on stderr, a line per result, of how many of the structures [lo, hi) (those
    `keep` marks, if given) lack a field that its job reads (their rows are NaN); DataError
    when none of the `selected` structures (a slice or a mask) has one."""
    import numpy as np

    from segcli import engine

    partial = [(name, job, have) for name, job in zip(results.names, results.jobs)
               if (have := engine.job_present(batch.present, job)) is not None]
    lacking = {name: [n for n in job.read if batch.present(n) is not None]
               for name, job, _ in partial}
    for name, _, have in partial:
        if not have[selected].any():
            raise DataError(f"{file}: no selected structure has "
                            f"{' and '.join(map(repr, lacking[name]))}")
    counted = slice(lo, hi) if keep is None else np.flatnonzero(keep[lo:hi]) + lo
    missing = {name: int(np.count_nonzero(~have[counted])) for name, _, have in partial}
    total = hi - lo if keep is None else int(keep[lo:hi].sum())
    return [f"{file}: {missing[name]} of {total} structure(s) lack "
            f"{' or '.join(map(repr, lacking[name]))}: their rows of {name} are NaN"
            for name in missing if missing[name]]


def _execute(file, ops, *, output, in_place, fmt, name, force, structures, chunk_atoms,
             device, precision, quiet, shard, scheduler, where, strict=False, order=0,
             weights=None, direction=None, params=None):
    """Run one reduce or grad command: check, plan, compute every op in one pass (here, one
    shard of it, or as shards on a cluster) and write the results."""
    _check_usage(ops, name, output, in_place, fmt, structures)
    check_cluster_usage(shard, scheduler, in_place)
    output = shard_output(output, shard)
    paths = common.input_paths(file, in_place)
    refuse_output_among_inputs(output, paths, "use --in-place to add to it")
    common.check_output_place(output)
    names = [name] if name else ["_".join((spec.name, *fields)) for spec, fields in ops]
    plan = {"precision": precision, "order": order, "weights": weights, "direction": direction,
            "params": params}
    with common.read_inputs(paths, file, in_place) as batch:
        results = _plan(batch, file, ops, names, plan)
        results.check_rows(output and not file_format(output), in_place)
        leaves, part = shard_selection(batch, file, structures, shard)
        lo, hi = int(leaves[0]), int(leaves[-1])
        keep = where_selection(batch, file, where, slice(lo, hi), quiet=quiet)
        selected = common.selection(batch, file, structures) if keep is None else keep
        notes = _absent(batch, file, results, selected, lo, hi, keep)
        notes = [] if quiet else notes
        _singular_matrices(batch, file, ops, lo, hi, strict, quiet, keep)
        target = None if scheduler else common.device(device)  # JAX loads only now
        n_atoms = batch.n_atoms[lo:hi] if keep is None else batch.n_atoms[lo:hi][keep[lo:hi]]
        attrs = {"precision": precision, **part}
        if where:
            attrs["where"] = [condition.text for condition in where]
        if order:
            attrs.update(order=order, weights=weights, direction=direction)
        verb = "reducing" if not order else "differentiating"
        into = {"output": output, "in_place": in_place, "file": paths[0], "fmt": fmt,
                "force": force, "keep": keep}
        if scheduler:
            ops = [(spec.name, list(fields)) for spec, fields in ops]
            for message in notes:
                note(message)
            _on_cluster(scheduler, None if quiet else f"{verb} {file}", batch, results, lo, hi,
                        (batch.layout, ops, names, plan, device, chunk_atoms, where), attrs,
                        into)
        else:
            sink = open_sink(results, batch, lo, hi,
                             attrs={**attrs, "device": common.device_label(target)}, **into)
            with progress(not quiet, f"{verb} {file}", len(n_atoms)) as bar:
                compute_into(batch, results, sink, target, lo, hi, chunk_atoms, bar, notes,
                             keep)
    if not quiet and (output or in_place):
        written = (", ".join(results.columns.values()) if file_format(output)
                   else ", ".join(f"/results/{d}" for d in results.datasets))
        chosen = "" if keep is None else f" selected of {hi - lo}"
        note(f"{output or file}: {written} ({len(n_atoms)} structures{chosen}, "
             f"{int(n_atoms.sum())} atoms)")


def _on_cluster(scheduler, label, batch, results, lo, hi, call, attrs, into):
    """The job over structures [lo, hi) as shards on the dask cluster at `scheduler`, as one
    run writes it (`into`: the arguments of open_sink), with a progress bar `label`ed (None:
    none). Into an HDF5 file, this process makes the output and each task writes its rows
    straight into it; into a stream, each task writes a part file into a temporary directory
    beside the output, passed on in structure order as it comes, while the others compute."""
    from segcli.cluster import shard_count, shards_as_done, shared
    from segcli.io.writers import scratch_directory
    from segcli.shards import shard_bounds

    beside = into["output"] or (into["file"] if into["in_place"] else None)
    into_file = _into_hdf5(**into)
    with contextlib.ExitStack() as opened:
        if not into_file:
            parts_dir = opened.enter_context(scratch_directory(
                os.path.dirname(os.path.abspath(beside)) if beside else os.getcwd()))
        client = opened.enter_context(on_cluster(scheduler))
        n_atoms = batch.n_atoms[lo:hi]
        bounds = shard_bounds(n_atoms, shard_count(client, len(n_atoms)))
        if into_file:
            sink = opened.enter_context(open_sink(results, batch, lo, hi, attrs=attrs,
                                                  placed=True, **into))
            places = sink.rows_of_shards(bounds)
            receive = functools.partial(_rows_written, sink, bounds)
        else:
            places = [os.path.join(parts_dir, f"part-{k}.h5") for k in range(len(bounds) - 1)]
            receive = functools.partial(_parts_passed_on, places, results, into["keep"],
                                        lambda device: opened.enter_context(open_sink(
                                            results, batch, lo, hi,
                                            attrs={**attrs, "device": device}, **into)))
        call = (shared(client, call[0]), *call[1:])
        calls = [(*call, lo + int(a), lo + int(b), place, attrs)
                 for (a, b), place in zip(itertools.pairwise(bounds), places)]
        sizes = [int(b - a) for a, b in itertools.pairwise(bounds)]
        with (progress(label is not None, f"{label} (shards)", hi - lo) as bar,
              contextlib.closing(shards_as_done(client, _part, calls, bar, sizes)) as done):
            receive(done)


def _rows_written(sink, bounds, done):
    """Each shard of `done` ((k, device label) as each ends) wrote its rows into the file of
    `sink` (an _Hdf5Sink): they get no fill; the results' attribute `device` is the first's."""
    for n, (k, device) in enumerate(done):
        if n == 0:
            sink.add_attrs({"device": device})
        sink.written_elsewhere(int(bounds[k]), int(bounds[k + 1]))


def _parts_passed_on(places, results, keep, open_stream, done):
    """Each part file places[k] of `done` ((k, device label) as each ends), checked, written
    in structure order into the stream `open_stream(device)` opens as the first comes, while
    the others compute; the rows of structures `keep` leaves out dropped."""
    from segcli.cluster import in_order
    from segcli.io.core import Chunk
    from segcli.io.merge import check_cover, describe_part, part_rows

    parts, stream = [None] * len(places), None
    for k, device in in_order(done):
        parts[k] = describe_part(places[k], like=parts[0])
        if stream is None:
            stream = open_stream(device)
        for start, counts, rows in part_rows([parts[k]], list(results.datasets)):
            chunk = Chunk(start, counts, {}, {})
            if keep is not None:
                chunk, rows = _kept_rows(chunk, rows, results.outputs, keep)
            if len(chunk.n_atoms):
                stream.write(chunk, rows)
    check_cover(parts)


def _kept_rows(chunk, rows, outputs, keep):
    """(the chunk's structures that `keep` ((S,) bool) marks, their rows of each dataset of
    `rows`, in its dtype of `outputs`): a part's NaN rows of structures not selected left out."""
    import numpy as np

    mask = keep[chunk.start:chunk.start + len(chunk.n_atoms)]
    atoms = np.repeat(mask, chunk.n_atoms)
    return chunk.take(mask), {d: r[mask if outputs[d][0] == "structure" else atoms].astype(
        outputs[d][2], copy=False) for d, r in rows.items()}


_OPS_ARGUMENT = click.argument("ops", nargs=-1, required=True, callback=_op_list,
                               metavar="OP [FIELD [FIELD2]] [+ OP ...]")


@click.command(short_help="Run ops per structure over a file.")
@click.argument("file")
@common.input_format_option("--input-format")
@_OPS_ARGUMENT
@_shared_options
@_param_options
@_with_op_lists
def reduce(file, ops, **options):
    """Run OP on FIELD [FIELD2] of every structure of FILE; several ops joined by `+` run in
    one pass over the file (each result named OP_FIELD[_FIELD2]).

    \b
    OP, its fields and their shapes (N rows per atom, S per structure, *F any
    trailing shape, one per op; what each computes: `segcli ops`):
{op_table}

    FILE is a segcli HDF5 file or any file ASE reads, or many files read as one batch: a
    directory, a quoted glob pattern ('shards/*.h5') or @LIST (see `segcli info --help`);
    csv output then has the columns source,source_index after structure, and -o files say
    where each structure came from. It is read in chunks of whole
    structures (--chunk-atoms), the next chunk while this one computes, so files larger than
    memory work. Results go to stdout (csv: `structure` first, `structure,atom` for per-atom
    results, vector entries as NAME_0, NAME_1, ...), to a new file (-o) or into FILE
    (--in-place); see `segcli ops`. Fields holding NaN are refused; a structure that lacks a
    field (`segcli info`: present in K of S) gets NaN (csv: empty cells). --shard runs one of N
    ranges of structures (join the parts with `segcli merge`), --scheduler all of them on a
    Dask cluster; either gives the bits of one run. --where computes only the structures
    that `segcli select --where` would keep: stdout gets their rows (under their numbers in
    FILE), -o OUT.h5 and --in-place NaN in the rows of the others (integer results then as
    float64).

    \b
    Example:
      segcli reduce sample_data/metals.h5 rms_norm forces | sort -t, -k2 -g | tail -3
      segcli reduce sample_data/metals.h5 matvec scaled_positions cell -o positions.h5
      segcli reduce sample_data/metals.h5 rms_norm forces + max_norm forces + count
      segcli reduce batch.h5 dot forces velocities --in-place --name power
      segcli reduce data.h5 rms_norm forces --shard auto -o 'parts/r-{shard}.h5'
      segcli reduce data.h5 rms_norm forces --scheduler local:4 -o rms.h5
      segcli reduce sample_data/metals.h5 bincount numbers -o composition.h5
      segcli reduce data.h5 rms_norm forces --where 'config_type == bulk' --where 'energy < 0'
    """
    params = _params(ops, options)
    _execute(file, ops, params=params, **options)


@click.command(short_help="Per-atom gradients of ops over a file.")
@click.argument("file")
@common.input_format_option("--input-format")
@_OPS_ARGUMENT
@click.option("--weights", metavar="FIELD",
              help="Per-structure scalar field w_s weighting each structure (default: 1).")
@click.option("--order", type=click.IntRange(1, 2), default=1, show_default=True,
              help="1: the gradient; 2: the Hessian-vector product along --direction.")
@click.option("--direction", metavar="FIELD",
              help="Per-atom field, the shape of the differentiated fields (--order 2).")
@_shared_options
@_with_op_lists
def grad(file, ops, weights, order, direction, **options):
    """Per-atom derivatives of Σ_s w_s · OP(FIELD [FIELD2])_s over the structures of FILE.

    Writes, for each per-atom input field F, the gradient of the weighted sum (over every
    entry of each structure's result) with respect to F, as /results/NAME/d_F with -o or
    --in-place, or as columns d_F_0, d_F_1, ... on stdout (npy: one array, or a structured
    array with a field per d_F). Per-structure inputs (mul's scalar, matvec's matrix) are
    held fixed. With --order 2 --direction V, writes instead the Hessian-vector product: the
    derivative of that gradient as every per-atom input moves along V. OPs and fields are
    as for `segcli reduce`, several joined by `+` (columns then OP_FIELD_d_F_0, ...); not
    differentiable: {not_differentiable}. FILE may be many files, and --where selects
    structures, as for `segcli reduce`.

    \b
    Example:
      segcli grad sample_data/metals.h5 rms_norm forces -o grad.h5
      segcli grad sample_data/metals.h5 dot forces positions --weights energy
      segcli grad sample_data/metals.h5 max_norm forces --order 2 --direction momenta
      segcli grad data.h5 rms_norm forces --where 'config_type == bulk' -o grad.h5
    """
    for op, _ in ops:
        if not op.differentiable:
            raise click.BadParameter(
                f"{op.name} is not differentiable (choose from "
                f"{', '.join(n for n, s in OPS.items() if s.differentiable)})",
                param_hint="'OP'")
    if order == 2 and direction is None:
        raise click.UsageError("--order 2 needs --direction FIELD")
    if order == 1 and direction is not None:
        raise click.UsageError("--direction is for --order 2")
    _execute(file, ops, order=order, weights=weights, direction=direction, **options)


@click.command(short_help="List the ops, their inputs and outputs.")
def ops():
    """List the ops: their inputs (per atom: N rows; per structure: S rows) and output.

    \b
    Example:
      segcli ops
    """
    rows = [("op", "inputs", "output", "derivatives", "")] + [
        (op.name, " ".join(i.describe() for i in op.inputs) or "-", op.describe_output(),
         "yes" if op.differentiable else "no", op.summary) for op in OPS.values()]
    click.echo("\n".join(table(rows)))


COMMANDS = [reduce, grad, ops]
