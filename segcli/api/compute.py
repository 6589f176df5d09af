"""reduce, grad and neighbors: computations per structure (and per atom) over a batch, as the
commands of the same names run them, returning Results.

A Computation says what a run gives (its datasets under /results: per structure or atom,
trailing shape, dtype, attributes, table columns) and computes it chunk by chunk;
`compute_into` runs one over a range of structures into a sink (segcli.io.sinks): ops
through segcli.engine, neighbour statistics through segcli.neighborlist. A run is units of
structures mapped by `compute_unit` here, or by `run_shard` as tasks of a cluster, their
rows written in structure order by segcli.executor.write_rows.
"""

import contextlib
import itertools
import os
import warnings
from collections.abc import Mapping

import numpy as np

from segcli import devices, engine, executor, neighborlist
from segcli.api import common
from segcli.errors import ArgumentError, DataError, literal
from segcli.io import sinks
from segcli.progress import tracked
from segcli.registry import OPS
from segcli.shards import shard_of

DEVICES = ("auto", "cpu", "gpu")


class Computation:
    """What a run computes: `outputs`, dataset -> (per, trailing shape, dtype); the op and
    fields that make each (`made_by`); the column of each on a table (`columns`). Subclasses
    give `chunks`."""

    def __init__(self, outputs, made_by, columns):
        self.outputs, self.made_by, self.columns = outputs, made_by, columns

    @property
    def datasets(self):
        return tuple(self.outputs)

    def attrs(self, shared):
        """Each dataset's attributes: `shared` and its op and fields."""
        return {d: {**shared, "op": op, "fields": list(fields)}
                for d, (op, fields) in self.made_by.items()}

    def check_table(self, sink):
        """ArgumentError if `sink` writes a table and these results have rows of structures
        and of atoms at once."""
        per = {d: o[0] for d, o in self.outputs.items()}
        if sink.table and len(set(per.values())) > 1:
            raise ArgumentError(
                "the rows of a table are per structure or per atom, and these results are both ("
                + literal(", ".join(f"{d}: per {p}" for d, p in per.items()))
                + "); write them to HDF5 ({0} OUT.h5 or {1}), or run the ops separately",
                "output", "in_place")


class Ops(Computation):
    """Ops over fields (engine.Job, one each), named `names`: each op's outputs are datasets
    NAME, or NAME/d_FIELD for derivatives."""

    def __init__(self, jobs, names):
        self.jobs, self.names = tuple(jobs), tuple(names)
        self._labels = {_dataset(name, label): (k, label)
                        for k, (job, name) in enumerate(zip(jobs, names))
                        for label in job.outputs}
        if len(self._labels) < sum(len(job.outputs) for job in jobs):
            raise ArgumentError("two ops give the same result: " + literal(
                ", ".join(f"/results/{d}" for d in self._labels)))
        single = len(jobs) == 1
        super().__init__(
            {d: jobs[k].outputs[label] for d, (k, label) in self._labels.items()},
            {d: (jobs[k].spec.name, jobs[k].fields) for d, (k, _) in self._labels.items()},
            {d: (label or names[k]) if single else d.replace("/", "_")
             for d, (k, label) in self._labels.items()})

    def chunks(self, batch, device, *, structures, chunk_atoms, keep):
        for chunk, outputs in engine.run(batch, self.jobs, device, structures=structures,
                                         chunk_atoms=chunk_atoms, keep=keep):
            yield chunk, {d: outputs[k][label] for d, (k, label) in self._labels.items()}


def _dataset(name, label):
    return f"{name}/{label}" if label else name


class Neighbors(Computation):
    """Neighbour statistics at `cutoffs` (see neighborlist.result_names), with `per_atom` each
    atom's neighbours (alone on a `table`, whose rows are atoms); `partial`: some structures
    lack positions, so integer results are float64 (NaN there). Each run adds its chunks to
    `summary` (a neighborlist.Summary)."""

    def __init__(self, cutoffs, per_atom, table, partial, histogram_bins=0):
        names = neighborlist.result_names(cutoffs, per_atom)
        if per_atom and table:
            names = {n: v for n, v in names.items() if v[1] == "atom"}
        self.cutoffs, self.names, self.histogram_bins = cutoffs, names, histogram_bins
        self.summary = neighborlist.Summary(cutoffs, histogram_bins)
        super().__init__(
            {n: (per, (), engine.nan_dtype(dtype) if partial else np.dtype(dtype))
             for n, (_, per, dtype, _) in names.items()},
            dict.fromkeys(names, ("neighbors", ("positions",))), {n: n for n in names})

    def chunks(self, batch, device, *, structures, chunk_atoms, keep):
        per_atom = any(per == "atom" for _, per, _, _ in self.names.values())
        for chunk, statistics in neighborlist.run(
                batch, self.cutoffs, device, chunk_atoms=chunk_atoms, structures=structures,
                keep=keep, histogram_bins=self.histogram_bins, per_atom=per_atom):
            self.summary.add(chunk, statistics)
            yield chunk, {n: statistics[base] if k is None else statistics[base][:, k]
                          for n, (base, _, _, k) in self.names.items()}


def compute_into(batch, computation, sink, device, lo, hi, chunk_atoms, progress=None,
                 notes=(), keep=None, notify=None):
    """Compute `computation` over structures [lo, hi) of `batch` (those `keep` marks, if
    given) on `device`, in one pass, into `sink`, each chunk's results written while the
    next computes; `notify` is told the `notes` once the first chunk is computed."""
    chunks = computation.chunks(batch, device, structures=slice(lo, hi),
                                chunk_atoms=chunk_atoms or engine.DEFAULT_CHUNK_ATOMS, keep=keep)

    def write(chunk, outputs):
        sink.write(chunk, outputs)
        if progress is not None:
            progress.update(len(chunk.n_atoms))

    with contextlib.closing(chunks):
        first = next(chunks, None)  # what fails at once fails before any output
        for message in notes:
            notify(message)
        with sink, engine.behind(write) as write_behind:  # written while the next computes
            for chunk, outputs in itertools.chain([first] if first else [], chunks):
                write_behind(chunk, outputs)


class Results(Mapping):
    """What reduce, grad or neighbors computed: result name (its dataset under /results, as
    the command names it: `rms_norm_forces`, `rms_norm_forces/d_forces`, `n_pairs`) -> a
    NumPy array, rows in the order of the selected structures (per-atom results: their
    atoms). `structures`: their numbers in the inputs; `n_atoms`: their atoms; `source`,
    `source_index`: for many files, each one's file (an index into `sources`) and its number
    there (else None); `attrs`: each result's attributes, as the output file holds them;
    `path`: the file written (None in memory), whose arrays are read from it when asked for;
    `summary`: neighbors' dataset summary (see neighborlist.Summary.as_dict)."""

    def __init__(self, computation, target, batch, selected, keep, attrs, arrays=None):
        lo, hi = selected.start, selected.stop
        self.structures = (np.arange(lo, hi) if keep is None
                           else np.flatnonzero(keep[lo:hi]) + lo)
        self.n_atoms = batch.n_atoms[self.structures]
        self.sources = list(batch.sources)
        self.source = self.source_index = None
        if len(self.sources) > 1:
            source, index = batch.source_of(selected)
            self.source, self.source_index = (np.asarray(a)[self.structures - lo]
                                              for a in (source, index))
        self.attrs = computation.attrs(attrs)
        for dataset, (per, _, _) in computation.outputs.items():
            self.attrs[dataset]["per"] = per
        self.selection, self.format = selected, target.sink.name
        self.path = target.path
        self.columns = computation.columns
        self.summary = (computation.summary.as_dict() if isinstance(computation, Neighbors)
                        else None)
        self._outputs, self._arrays, self._stream = computation.outputs, arrays, target.stream

    def __getitem__(self, name):
        if name not in self._outputs:
            raise KeyError(name)
        if self._arrays is not None:
            return self._arrays[name]
        if self._stream is not None:
            raise ValueError(f"result {name!r} was written to a stream, not kept: give output= "
                             "a file, or leave it out")
        return sinks.SINKS[self.format].reads(self.path, name, self.columns[name],
                                              self._outputs[name], self.structures,
                                              self.selection.start)

    def __iter__(self):
        return iter(self._outputs)

    def __len__(self):
        return len(self._outputs)

    def __repr__(self):
        return (f"Results({', '.join(self._outputs)}; {len(self.structures)} structures"
                f"{'' if self.path is None else f', in {self.path}'})")


def _absent(batch, name, computation, selected, lo, hi, keep=None):
    """What to tell, a line per result, of how many of the structures [lo, hi) (those `keep`
    marks, if given) lack a field that its job reads (their rows are NaN); DataError when none
    of the `selected` structures (a slice or a mask) has one."""
    partial = [(result, job, have) for result, job in zip(computation.names, computation.jobs)
               if (have := engine.job_present(batch.present, job)) is not None]
    lacking = {result: [n for n in job.read if batch.present(n) is not None]
               for result, job, _ in partial}
    for result, _, have in partial:
        if not have[selected].any():
            raise DataError(f"{name}: no selected structure has "
                            f"{' and '.join(map(repr, lacking[result]))}")
    counted = slice(lo, hi) if keep is None else np.flatnonzero(keep[lo:hi]) + lo
    missing = {result: int(np.count_nonzero(~have[counted])) for result, _, have in partial}
    total = hi - lo if keep is None else int(keep[lo:hi].sum())
    return [f"{name}: {missing[result]} of {total} structure(s) lack "
            f"{' or '.join(map(repr, lacking[result]))}: their rows of {result} are NaN"
            for result in missing if missing[result]]


def _singular_matrices(batch, name, ops, lo, hi, strict, notify, keep=None):
    """Tell `notify`, or with `strict` raise DataError, when an op's invertible
    per-structure matrix (see registry.Arg) is singular in some of the structures [lo, hi)
    (those `keep` marks, if given): a structure without a cell, say, whose matvec gives 0."""
    for spec, fields in ops:
        for arg, field in zip(spec.inputs, fields):
            if not arg.invertible:
                continue
            singular = sum(int(np.count_nonzero(
                engine.singular(chunk.structures[field]) & chunk.present.get(field, True)))
                for chunk in batch.iter_chunks([field], structures=slice(lo, hi), keep=keep))
            if not singular:
                continue
            total = hi - lo if keep is None else int(keep.sum())
            message = (f"{name}: '{field}' is singular or zero in {singular} of {total} "
                       f"structure(s) (no cell, say); {spec.name} gives 0 there for a zero "
                       f"matrix")
            if strict:
                raise DataError(f"{message} (--strict)")
            notify(f"warning: {message} (--strict refuses them)")


def op_spec(name):
    """The registry.Op named `name`; ArgumentError naming `op` for an unknown one."""
    if name not in OPS:
        raise ArgumentError(f"{{0}}: unknown op {literal(repr(name))} (choose from "
                            f"{', '.join(OPS)})", "op")
    return OPS[name]


def _op_list(op, fields):
    """(registry.Op, fields) of each op: `op` a name and `fields` its fields, or a list of
    (op, field, ...) tuples (and no `fields`); ArgumentError for a wrong count of fields."""
    if isinstance(op, str):
        ops = [(op, *fields)]
    elif fields:
        raise ArgumentError("{0} is a list of (op, field, ...) tuples, which hold the fields; "
                            "give no other {1}", "op", "fields")
    else:
        ops = [(entry,) if isinstance(entry, str) else tuple(entry) for entry in op]
    if not ops:
        raise ArgumentError("{0}: no op given", "op")
    pairs = [(op_spec(name), tuple(map(str, rest))) for name, *rest in ops]
    for spec, given in pairs:
        if len(given) != len(spec.inputs):
            wanted = " and ".join(f"a per-{i.per} {i.describe()}" for i in spec.inputs)
            raise ArgumentError(literal(
                f"{spec.name} takes {len(spec.inputs) or 'no'} field(s)"
                f"{': ' + wanted if wanted else ''}; got {len(given)}"))
    return pairs


def _check_params(ops, params):
    """ArgumentError for a static param (bincount's length) that no op of `ops` takes, or
    that is not a positive integer."""
    for name, value in params.items():
        takers = [op.name for op in OPS.values() if name in op.params]
        if not takers:
            raise TypeError(f"unexpected keyword argument {name!r}")
        if not any(name in spec.params for spec, _ in ops):
            raise ArgumentError(f"{{0}} is for {', '.join(takers)}", name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{{0}} must be a positive integer, not {literal(repr(value))}",
                                name)


def _check_run_options(device, precision, chunk_atoms):
    if device not in DEVICES:
        raise ArgumentError(f"{{0}} must be one of {', '.join(DEVICES)}, not "
                            f"{literal(repr(device))}", "device")
    if precision not in engine.PRECISIONS:
        raise ArgumentError(f"{{0}} must be one of {', '.join(engine.PRECISIONS)}, not "
                            f"{literal(repr(precision))}", "precision")
    if chunk_atoms is not None and (isinstance(chunk_atoms, bool) or not isinstance(
            chunk_atoms, int) or not 1 <= chunk_atoms <= 1 << 62):
        raise ArgumentError(f"{{0}} must be a positive integer, not "
                            f"{literal(repr(chunk_atoms))}", "chunk_atoms")


def _notifier(notify):
    """Where remarks go: `notify`, or Python's warnings."""
    return notify if notify is not None else (lambda message: warnings.warn(message,
                                                                            stacklevel=4))


def reduce(inputs, op, *fields, output=None, in_place=False, name=None, where=None,
           structures=None, shard=None, scheduler=None, device="auto", precision=None,
           chunk_atoms=None, progress=False, format=None, force=False, strict=False,
           input_format=None, notify=None, **op_params):
    """Run `op` on `fields` of every selected structure of `inputs`, as `segcli reduce`.

    `inputs`: a path, glob, directory or @LIST, or a list of them. `op` a name (see `segcli
    ops`) with its fields, or a list of (op, field, ...) tuples run in one pass. `output`: a
    new file (.h5, .csv, .json, .npy; `format` forces one) or a binary stream (a table), or
    `in_place=True` adds the results to `inputs`; neither keeps them in memory. `where`:
    conditions 'NAME OP VALUE' (one or a list); `structures` an index or slice; `shard` (I,
    N) or "I/N"; `scheduler` a Dask scheduler's address or "local:K"; `op_params` static
    params (bincount's `length`). `progress`: True for a bar on stderr, or a function called
    with (done, total). `notify` gets each remark (a structure lacking a field; default:
    warnings.warn). Bad data raises DataError, a bad argument ArgumentError (a ValueError).

    >>> r = segcli.reduce("sample_data/metals.h5", "rms_norm", "forces")
    >>> r["rms_norm_forces"].shape == (len(r.structures),)
    True
    >>> both = segcli.reduce("sample_data/metals.h5", [("max_norm", "forces"), ("count",)])
    >>> sorted(both)
    ['count', 'max_norm_forces']
    """
    return _run_ops(inputs, op, fields, order=0, weights=None, direction=None, **_options(
        locals()))


def grad(inputs, op, *fields, order=1, weights=None, direction=None, output=None,
         in_place=False, name=None, where=None, structures=None, shard=None, scheduler=None,
         device="auto", precision=None, chunk_atoms=None, progress=False, format=None,
         force=False, strict=False, input_format=None, notify=None, **op_params):
    """Per-atom derivatives of Σ_s w_s · op(fields)_s over the structures of `inputs`, as
    `segcli grad`: for each per-atom input field F, result NAME/d_F; `weights` a
    per-structure field (default 1); `order=2` with `direction` (a per-atom field) the
    Hessian-vector product. The other arguments are reduce's.

    >>> r = segcli.grad("sample_data/metals.h5", "rms_norm", "forces")
    >>> r["rms_norm_forces/d_forces"].shape == (r.n_atoms.sum(), 3)
    True
    """
    if order not in (1, 2):
        raise ArgumentError(f"{{0}} must be 1 or 2, not {literal(repr(order))}", "order")
    if order == 2 and direction is None:
        raise ArgumentError("{0} 2 needs {1} FIELD", "order", "direction")
    if order == 1 and direction is not None:
        raise ArgumentError("{0} is for {1} 2", "direction", "order")
    return _run_ops(inputs, op, fields, order=order, weights=weights, direction=direction,
                    **_options(locals()))


_OPTIONS = ("output", "in_place", "name", "where", "structures", "shard", "scheduler",
            "device", "precision", "chunk_atoms", "progress", "format", "force", "strict",
            "input_format", "notify", "op_params")


def _options(arguments):
    return {k: arguments[k] for k in _OPTIONS}


def _run_ops(inputs, op, fields, *, order, weights, direction, output, in_place, name, where,
             structures, shard, scheduler, device, precision, chunk_atoms, progress, format,
             force, strict, input_format, notify, op_params):
    """reduce (order 0) and grad: check, plan, compute every op in one pass (here, one shard
    of it, or as shards on a cluster) and write the results."""
    ops = _op_list(op, fields)
    if order:
        for spec, _ in ops:
            if not spec.differentiable:
                raise ArgumentError(f"{{0}}: {spec.name} is not differentiable (choose from "
                                    f"{', '.join(n for n, s in OPS.items() if s.differentiable)})",
                                    "op")
    _check_params(ops, op_params)
    precision = precision or "float64"
    _check_run_options(device, precision, chunk_atoms)
    if name is not None:
        common.check_result_name(name)
    if name and len(ops) > 1:
        raise ArgumentError("{0} names one op's result; several ops are each named "
                            "OP_FIELD[_FIELD2]", "name")
    structures, shard = common.structure_slice(structures), common.shard_pair(shard)
    where = common.where_conditions(where)
    common.refuse_structures_in_place(in_place, structures)
    common.check_cluster_usage(shard, scheduler, in_place)
    target, paths, label = _destination(inputs, output, in_place, format, force, shard)
    names = [name] if name else ["_".join((spec.name, *fields)) for spec, fields in ops]
    plan = {"precision": precision, "order": order, "weights": weights, "direction": direction,
            "params": op_params}
    notify = _notifier(notify)
    with common.read_inputs(paths, label, in_place, input_format) as batch:
        computation = plan_ops(batch, label, ops, names, plan)
        computation.check_table(target.sink)
        leaves, part = common.shard_selection(batch, label, structures, shard)
        lo, hi = int(leaves[0]), int(leaves[-1])
        keep = common.where_selection(batch, label, where, slice(lo, hi), notify=notify)
        selected = common.selection(batch, label, structures) if keep is None else keep
        notes = _absent(batch, label, computation, selected, lo, hi, keep)
        _singular_matrices(batch, label, ops, lo, hi, strict, notify, keep)
        attrs = {"precision": precision, **part}
        if where:
            attrs["where"] = [condition.text for condition in where]
        if order:
            attrs.update(order=order, weights=weights, direction=direction)
        verb = "reducing" if not order else "differentiating"
        if not scheduler:
            return _run_here(batch, computation, target, leaves, keep, attrs, device,
                             chunk_atoms, (progress, f"{verb} {label}"), notes, notify)
        for message in notes:
            notify(message)
        recipe = ([(spec.name, list(f)) for spec, f in ops], names, plan, device, chunk_atoms)
        with (common.on_cluster(scheduler) as client,
              tracked(progress, f"{verb} {label} (shards)", _counted(keep, lo, hi)) as bar):
            units = executor.plan(batch.n_atoms, leaves, client, keep)
            ran_on, arrays = executor.write_rows(
                units, run_shard, (batch, *recipe, keep, attrs), target, computation, batch,
                attrs, keep, client, bar)
        return Results(computation, target, batch, slice(lo, hi), keep,
                       {**attrs, "device": ran_on}, arrays)


def _counted(keep, lo, hi):
    """How many of the structures [lo, hi) are computed: those `keep` marks, if given."""
    return hi - lo if keep is None else int(np.count_nonzero(keep[lo:hi]))


def _destination(inputs, output, in_place, format, force, shard=None):
    """(the sinks.Target of the results, the input files, how messages name them), checked:
    `output` with {shard} filled in, not one of the inputs, in a directory that takes it."""
    if output is not None and not sinks.is_stream(output):
        output = common.shard_output(os.fspath(output), shard)
    target = sinks.choose(output, in_place, format, force)
    paths = common.input_paths(inputs, in_place)
    if in_place:
        target = target._replace(path=paths[0])
    elif target.path is not None:
        common.refuse_output_among_inputs(target.path, paths, "use --in-place to add to it")
        common.check_output_place(target.path)
    return target, paths, common.input_name(inputs)


def _run_here(batch, computation, target, leaves, keep, attrs, device, chunk_atoms, progress,
              notes, notify):
    """Results of `computation` over the structures between the leaf boundaries `leaves`
    (those `keep` marks, if given) of `batch`, computed in this process on `device` (a
    --device choice) into `target`, their datasets' attributes `attrs` and the device's
    label; progress (how, label) as `tracked` takes them."""
    lo, hi = int(leaves[0]), int(leaves[-1])
    placed = devices.device(device)  # JAX loads only now
    attrs = {**attrs, "device": devices.device_label(placed)}
    with tracked(*progress, _counted(keep, lo, hi)) as bar:
        _, arrays = executor.write_rows(
            executor.plan(batch.n_atoms, leaves, keep=keep), compute_unit,
            (batch, computation, placed, chunk_atoms, keep, notes, notify), target, computation,
            batch, attrs, keep, progress=bar)
    return Results(computation, target, batch, slice(lo, hi), keep, attrs, arrays)


def compute_unit(batch, computation, device, chunk_atoms, keep, notes, notify, unit, progress):
    """The work of reduce, grad and neighbors in this process: `computation` over the
    structures of `unit` (a segcli.executor.Unit) of `batch` that `keep`, if given, marks, on
    the placed `device`, into the sink `unit.into`; `notify` told the `notes` once the first
    chunk is computed. Returns the device's label.

        compute_unit(batch, computation, devices.device("cpu"), None, None, (), print,
                     unit._replace(into=sink), None)
    """
    compute_into(batch, computation, unit.into, device, unit.lo, unit.hi, chunk_atoms,
                 progress, notes, keep, notify)
    return devices.device_label(device)


def plan_ops(batch, name, ops, names, plan):
    """The Ops computation of `ops` ((registry.Op, fields), ...) named `names` over `batch`."""
    return Ops([engine.plan(name, spec, fields, batch.fields, present=batch.present, **plan)
                for spec, fields in ops], names)


def run_shard(layout, ops, names, plan, device, chunk_atoms, keep, attrs, unit, progress):
    """The work of reduce and grad on a cluster (a task): the structures of `unit` (a
    segcli.executor.Unit) of the batch `layout` describes (see segcli.io.open_inputs), those
    `keep` ((S,) bool), if given, marks, into the new part file `unit.into` (replaced whole
    if a retried task wrote it before), or into the output's own rows `unit.into` (a
    RowsInto; rewritten alike). `ops` are (op name, fields) pairs. Returns the label of the
    device it computed on.

        run_shard(batch.layout, [("sum", ["forces"])], ["sum_forces"], plan, "cpu", None,
                  None, {}, unit._replace(into="part-0.h5"), None)
    """
    target = devices.device(device)
    label = devices.device_label(target)
    lo, hi = unit.lo, unit.hi
    with executor.reading(layout) as batch:
        computation = plan_ops(batch, batch.path, [(OPS[op], fields) for op, fields in ops],
                               names, plan)
        if isinstance(unit.into, str):
            sink = sinks.open_sink(sinks.Target(sinks.SINKS["hdf5"], unit.into, force=True),
                                   computation, batch, lo, hi,
                                   {**attrs, "structures": f"{lo}:{hi}", "device": label}, keep)
        else:  # the client's file: n_atoms, sources and attributes are its own
            sink = sinks.Hdf5Sink(unit.into, computation.outputs, batch.n_atoms[lo:hi],
                                  computation.attrs(attrs), None, lo, keep is not None)
        compute_into(batch, computation, sink, target, lo, hi, chunk_atoms, progress,
                     keep=keep)
    return label


def neighbors(inputs, cutoff, *, per_atom=False, histogram=None, output=None, in_place=False,
              where=None, structures=None, device="auto", chunk_atoms=None, progress=False,
              format=None, force=False, input_format=None, notify=None):
    """Neighbour statistics per structure of `inputs` within `cutoff` Å (a number or a list),
    as `segcli neighbors`: n_pairs, mean_neighbors, min_distance, min_pair_i, min_pair_j
    (several cutoffs: n_pairs_R, ...), with `per_atom` n_neighbors; `histogram` bins of the
    pairs' distances in `.summary`. The other arguments are reduce's.

    >>> r = segcli.neighbors("sample_data/metals.h5", 5.0)
    >>> r["n_pairs"].dtype, r.summary["cutoffs"]
    (dtype('int64'), [5.0])
    """
    cutoffs = cutoff if isinstance(cutoff, (list, tuple, np.ndarray)) else [cutoff]
    try:
        cutoffs = neighborlist.checked_cutoffs(cutoffs).tolist()
    except (TypeError, ValueError) as err:
        raise ArgumentError(f"{{0}}: {literal(err)}", "cutoff") from None
    if histogram is not None and (isinstance(histogram, bool) or not isinstance(histogram, int)
                                  or not 1 <= histogram <= 1 << 20):
        raise ArgumentError(f"{{0}} must be a number of bins from 1 to {1 << 20}, not "
                            f"{literal(repr(histogram))}", "histogram")
    _check_run_options(device, "float64", chunk_atoms)
    structures = common.structure_slice(structures)
    where = common.where_conditions(where)
    common.refuse_structures_in_place(in_place, structures)
    target, paths, label = _destination(inputs, output, in_place, format, force)
    notify = _notifier(notify)
    with common.read_inputs(paths, label, in_place, input_format) as batch:
        batch.check_fields(["positions"])
        computation = Neighbors(cutoffs, per_atom, target.sink.table,
                                batch.present("positions") is not None, histogram or 0)
        selected = common.selection(batch, label, structures)
        keep = common.where_selection(batch, label, where, selected, notify=notify)
        attrs = {"cutoffs": cutoffs}
        if where:
            attrs["where"] = [condition.text for condition in where]
        leaves = shard_of(batch.n_atoms[selected], selected.start)
        return _run_here(batch, computation, target, leaves, keep, attrs, device, chunk_atoms,
                         (progress, f"neighbours of {label}"), (), notify)
