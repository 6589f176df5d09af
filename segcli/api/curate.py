"""Curation as functions: statistics of fields (`stats`), per-element reference energies
(`fit_e0`) and the structures a condition chooses (`select`), with the options, results and
refusals of the commands of the same names.

    import segcli
    table = segcli.stats("data.h5", "forces", "energy", per_element=True)
    e0 = segcli.fit_e0("data.h5", fixed={"H": -13.6})
    segcli.select("data.h5", "low.h5", where="energy < 0")
"""

import contextlib
import functools
import io
import math
import os
from typing import NamedTuple

import numpy as np

from segcli.api.common import (
    check_cluster_usage,
    input_name,
    input_paths,
    names_hdf5,
    on_cluster,
    read_inputs,
    refuse_output_among_inputs,
    refuse_structures_in_place,
    selection,
    shard_output,
    shard_pair,
    shard_selection,
    structure_slice,
    where_conditions,
    where_selection,
)
from segcli.errors import ArgumentError, DataError, Note, literal
from segcli.progress import tracked

STAT_COLUMNS = ("count", "mean", "std", "rms", "min", "max")
"""The statistics of each row of a Statistics (and columns of `segcli stats`'s table)."""
COMMAND_NAMES = {"inputs": "FILE", "fields": "FIELDs", "output": "-o"}
"""How the command line names the arguments it takes by position or by a short option."""


def _symbol(z):
    from ase.data import chemical_symbols

    return chemical_symbols[z]


def number_text(value):
    """A statistic as the commands print it: 7 significant digits, `-` for none or NaN."""
    return "-" if value is None or math.isnan(value) else f"{value:.7g}"


class Statistics:
    """What `segcli stats` computes: one row per (field, group, component) with `count`,
    `mean`, `std` (population), `rms`, `min` and `max` (None where count is 0); a group is an
    element (`element`, `symbol`) with per_element, a value (`group`) with by. `str()` is the
    table the command prints, `to_dict()` what `--json` prints.

        s = segcli.stats("data.h5", "energy")
        s.rows[0]["mean"], s["energy"][0]["std"], s.to_dict()["structures"]
    """

    def __init__(self, fields, summary, attrs, by=None, output=None):
        self.fields = fields  # name -> segcli.moments.FieldStats
        self.summary = summary
        self.attrs = attrs  # what `output` holds as its root attributes
        self.by = by
        self.output = output  # the file written, if any
        self.rows = [row for s in fields.values() for row in s.rows()]
        for row in self.rows:
            if "element" in row:
                row["symbol"] = _symbol(row["element"])

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, name):
        """The rows of field `name`."""
        if name not in self.fields:
            raise KeyError(name)
        return [row for row in self.rows if row["field"] == name]

    def to_dict(self):
        """The summary (path, structures, atoms or files) and the rows, as `--json` prints."""
        return {**self.summary, **({"by": self.by} if self.by else {}), "stats": self.rows}

    def __str__(self):
        from segcli.tables import table

        group = self.by or ("element" if any("element" in row for row in self.rows) else None)
        header = ("field", *((group,) if group else ()), "component", *STAT_COLUMNS)
        lines = [header] + [
            (row["field"], *((str(row.get("group", row.get("symbol", ""))),) if group else ()),
             row["component"] or "-", str(row["count"]),
             *(number_text(row[c]) for c in STAT_COLUMNS[1:]))
            for row in self.rows]
        return "\n".join(table(lines))

    def __repr__(self):
        return f"<Statistics of {', '.join(self.fields)}: {len(self.rows)} rows>"


def stats(inputs, *fields, per_element=False, per_atom=False, by=None, where=None,
          structures=None, output=None, force=False, partial=False, shard=None, scheduler=None,
          chunk_atoms=1 << 21, input_format=None, progress=False):
    """Count, mean, std (population), rms, min and max of each of `fields` of `inputs`, as
    `segcli stats` computes them: a per-atom field over all atoms, a per-structure one over
    all structures, per component and, for vector fields, of the norm; `per_element` groups
    per-atom fields by element, `by` every field by a per-structure field's value; `per_atom`
    divides per-structure fields by the atom count first. `where` (conditions such as
    'energy < 0'), `structures` (a slice) and `shard` ("I/N") choose structures; `scheduler`
    runs shards on a Dask cluster. `inputs` holding statistics (`output` of an earlier call)
    are merged exactly. With `output`, the statistics are also written there (HDF5).

        s = segcli.stats("sample_data/metals.h5", "forces", "energy")
        print(s)  # the table `segcli stats` prints
        segcli.stats("sample_data/metals.h5", "forces", per_element=True).to_dict()
    """
    from segcli.io import expand_inputs
    from segcli.io.coverage import refuse_skipped
    from segcli.io.statsfile import is_stats_file, write_stats

    where, structures = where_conditions(where), structure_slice(structures)
    shard = shard_pair(shard)
    check_cluster_usage(shard, scheduler, False)
    if by is not None and per_element:
        raise ArgumentError("{per_element} groups by element and {by} by a field: give one")
    if output is not None:
        output = os.fspath(output)
        if not names_hdf5(output):
            raise ArgumentError(f"{{output}} {literal(output)}: stats writes segcli HDF5; "
                                "name it .h5 or .hdf5", commands=COMMAND_NAMES)
    output = shard_output(output, shard)
    file = input_name(inputs)
    skipped = []
    paths = expand_inputs(inputs, skipped)
    refuse_output_among_inputs(output, paths, "stats writes a new file")
    if all(map(is_stats_file, paths)):
        given = [name for name, value in (("per_element", per_element), ("per_atom", per_atom),
                                          ("by", by), ("where", where),
                                          ("structures", structures), ("shard", shard),
                                          ("scheduler", scheduler)) if value]
        if given:
            raise ArgumentError(f"{literal(file)} holds statistics, computed already: "
                                f"{{{given[0]}}} applies to data")
        refuse_skipped(skipped)
        result, summary, attrs = _merged_stats(paths, file, fields, partial)
        if "missing" in attrs:
            tell(f"{file}: lacks structures {attrs['missing']} of its input(s) (--partial)")
        parts = None
    else:
        if partial:
            raise ArgumentError("{partial} merges statistics files; {inputs} holds data",
                                commands=COMMAND_NAMES)
        if not fields:
            raise ArgumentError("give the {fields} of {inputs} to compute statistics of",
                                commands=COMMAND_NAMES)
        result, summary, parts, attrs = _field_stats(
            paths, file, fields, per_element, per_atom, by, where, structures, shard, scheduler,
            chunk_atoms, input_format, progress)
        attrs.update(source=os.path.abspath(file), per_element=per_element, per_atom=per_atom)
        if where:
            attrs["where"] = [condition.text for condition in where]
    if output:
        write_stats(output, result, attrs, force=force, leaves=parts if shard else None)
    return Statistics(result, summary, attrs, by, output)


def tell(message):
    """`message` as a segcli.errors.Note: what the command tells on stderr."""
    import warnings

    warnings.warn(message, Note, stacklevel=3)


def _merged_stats(paths, file, fields, partial):
    """(name -> FieldStats, summary, the output's attributes) of `fields` (default: all) of
    the statistics files `paths` merged (segcli.io.statsfile.merge_stats_files); with
    `partial`, they may lack structures (the attribute `missing`)."""
    from segcli.io.statsfile import merge_stats_files

    result, count, covered = merge_stats_files(paths, partial)
    missing = [name for name in fields if name not in result]
    if missing or not result:
        raise DataError(f"{file}: no statistics of {', '.join(missing) or 'any field'} in "
                        f"every file; they hold {', '.join(result) or 'none in common'}")
    summary = {"path": file, "structures": count, "files": len(paths)}
    attrs = {"merged_from": [os.path.abspath(p) for p in paths], **covered}
    return {name: result[name] for name in fields or result}, summary, attrs


def _field_stats(paths, file, fields, per_element, per_atom, by, where, structures, shard,
                 scheduler, chunk_atoms, input_format, progress):
    """(name -> FieldStats, summary, the leaves' statistics, the output's attributes) of the
    `fields` of the data files `paths` (named `file`), as `segcli stats` computes them."""
    from segcli import executor
    from segcli.curate.statistics import group_values, join_leaves, merge_stats, refuse_overflow
    from segcli.io import open_inputs

    options = {"per_element": per_element, "per_atom": per_atom, "chunk_atoms": chunk_atoms}
    with (open_inputs(paths, name=file, input_format=input_format) as batch,
          np.errstate(over="ignore", invalid="ignore")):
        _check_grouping(batch, fields, per_element, per_atom)
        leaves, attrs = shard_selection(batch, file, structures, shard)
        chosen = slice(int(leaves[0]), int(leaves[-1]))
        keep = where_selection(batch, file, where, chosen, needed=not shard, notify=tell)
        if by is not None:  # the groups of the whole selection: the same in every shard
            options.update(by=by, groups=group_values(batch, by, selection(batch, file,
                                                                           structures)))
        counted = np.ones(chosen.stop - chosen.start, bool) if keep is None else keep[chosen]
        summary = {"path": file, "structures": int(counted.sum()),
                   "atoms": int(batch.n_atoms[chosen][counted].sum())}
        label = f"statistics of {file}" + " (shards)" * bool(scheduler)
        with on_cluster(scheduler) as client, \
                tracked(progress, label, summary["structures"]) as bar:
            units = executor.plan(batch.n_atoms, leaves, client, keep)
            parts = executor.run(units, stats_of_unit, (batch, list(fields), keep, options),
                                 client=client, progress=bar, combine=join_leaves)
        result = merge_stats([parts])
        refuse_overflow(file, result)
    return result, summary, parts, attrs


def stats_of_unit(source, names, keep, options, unit, progress):
    """The leaf statistics (segcli.curate.statistics.leaf_stats) of the fields `names` over
    the structures of `unit` (a segcli.executor.Unit) of `source` (a batch, or its layout)
    that `keep` ((S,) bool), if given, marks: stats's work, here or as a task.

        stats_of_unit(batch, ["energy"], None, {}, executor.plan(n_atoms, leaves)[0], None)
    """
    from segcli.curate.statistics import leaf_stats
    from segcli.executor import reading

    with reading(source) as batch, np.errstate(over="ignore", invalid="ignore"):
        return leaf_stats(batch, names, unit.leaves, keep=keep, progress=progress, **options)


def _check_grouping(batch, fields, per_element, per_atom):
    """ArgumentError when per_element or per_atom applies to none of `fields` (those of
    `batch` only: an unknown one is named later)."""
    pers = {batch.fields[name].per for name in fields if name in batch.fields}
    for name, given, per in (("per_element", per_element, "atom"),
                             ("per_atom", per_atom, "structure")):
        if given and pers and per not in pers:
            raise ArgumentError(f"{{{name}}} applies to per-{per} fields; "
                                f"{literal(', '.join(fields))} "
                                f"{'is' if len(fields) == 1 else 'are'} not")


class E0(dict):
    """Element symbol -> reference energy E0 (fitted and fixed), what `segcli fit-e0` prints,
    with `residuals` (S,) (E − Σ c·E0 of each structure of the inputs; NaN for those not
    fitted; computed in one more pass when first asked for), `rmse_per_atom` and
    `mae_per_atom` of the residual per atom, `structures` (the number fitted) and `fixed`
    (the symbols held)."""

    def __init__(self, e0, residuals_of, rmse, mae, structures, fixed):
        super().__init__(e0)
        self._residuals_of = residuals_of
        self.rmse_per_atom, self.mae_per_atom = rmse, mae
        self.structures, self.fixed = structures, fixed

    @functools.cached_property
    def residuals(self):
        return self._residuals_of()


def fixed_numbers(fixed):
    """{Z: E0} of `fixed`: a mapping of element symbols (any case) or atomic numbers to
    finite energies."""
    from ase.data import atomic_numbers, chemical_symbols

    if fixed is None:
        return {}
    if not hasattr(fixed, "items"):
        raise TypeError(f"fixed= takes a mapping symbol -> E0, got {type(fixed).__name__}")
    out = {}
    for key, value in fixed.items():
        z = key if isinstance(key, int) else atomic_numbers.get(str(key).strip().capitalize())
        if z is None or not 0 < z < len(chemical_symbols):
            raise ArgumentError(f"{{fixed}} {literal(repr(key))} is not an element's symbol")
        if not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise ArgumentError(f"{{fixed}} the energy must be finite, got "
                                f"{literal(repr(value))} for {literal(repr(key))}")
        if z in out:
            raise ArgumentError(f"{{fixed}} {chemical_symbols[z]} is fixed twice")
        out[z] = float(value)
    return out


def fit_e0(inputs, *, energy="energy", fixed=None, where=None, structures=None,
           in_place=False, name=None, force=False, chunk_atoms=1 << 21, input_format=None,
           progress=False):
    """The per-element reference energies E0 minimising Σ_s (E_s − Σ_Z c_sZ E0_Z)² over the
    structures of `inputs` (c_sZ: atoms of element Z in structure s; `energy` the field E),
    as `segcli fit-e0` fits them: elements absent from the data left out, those of `fixed`
    (symbol -> E0) held, `where` and `structures` choosing the structures. `in_place` stores
    the residuals in the (one) input as the result `name` (default residual_ENERGY).

        e0 = segcli.fit_e0("sample_data/metals.h5")
        e0["Cu"], e0.rmse_per_atom, e0.residuals[:3]
        segcli.fit_e0("data.h5", fixed={"H": -13.6}, where="config_type == bulk")
    """
    from segcli.curate.statistics import residual_errors, solve_e0
    from segcli.io import ResultWriter
    from segcli.io.core import spread

    where, structures = where_conditions(where), structure_slice(structures)
    fixed = fixed_numbers(fixed)
    if name is not None and not in_place:
        raise ArgumentError("{name} names the result that {in_place} stores")
    refuse_structures_in_place(in_place, structures)
    paths = input_paths(inputs, in_place)
    file, name = input_name(inputs), name or f"residual_{energy}"
    with contextlib.ExitStack() as stack:
        batch = stack.enter_context(read_inputs(paths, file, in_place, input_format))
        stack.enter_context(np.errstate(over="ignore", invalid="ignore"))  # overflow: DataError
        chosen = selection(batch, file, structures)
        keep = where_selection(batch, file, where, chosen, needed=True, notify=tell)
        total = chosen.stop - chosen.start if keep is None else int(keep.sum())
        bar = stack.enter_context(tracked(progress, f"fitting E0 of {file} (2 passes)",
                                            2 * total))
        options = {"chunk_atoms": chunk_atoms, "structures": chosen, "keep": keep,
                   "progress": bar}
        e0, used = solve_e0(batch, energy, fixed=fixed, **options)
        everything = {**e0, **fixed}
        rows = np.arange(batch.n_structures + 1)
        if in_place:
            writer = stack.enter_context(ResultWriter(in_place_of=paths[0], force=force,
                                                      names=[name]))
            writer.set_n_atoms(batch.n_atoms)
            writer.create(name, (batch.n_structures,), "float64", {
                "op": "fit-e0", "fields": [energy, "numbers"], "per": "structure",
                "elements": sorted(everything),
                "e0": [everything[z] for z in sorted(everything)],
                **({"where": [c.text for c in where]} if where else {})}, np.nan)
        rmse, mae = residual_errors(
            batch, energy, everything,
            on_chunk=in_place and (lambda chunk, values: writer.write(
                name, *spread(values, chunk.structure_numbers, rows, np.nan))),
            **options)

    def residuals():
        with (read_inputs(paths, file, False, input_format) as batch,
              np.errstate(over="ignore", invalid="ignore")):
            out = np.full(batch.n_structures, np.nan)

            def store(chunk, values):
                out[chunk.structure_numbers] = values

            residual_errors(batch, energy, everything, on_chunk=store,
                            **{**options, "progress": None})
        return out

    return E0({_symbol(z): everything[z] for z in sorted(everything)}, residuals, rmse, mae,
              used, sorted(_symbol(z) for z in fixed))


class Selected(NamedTuple):
    """What `selected` wrote: structures and atoms, of how many structures in all."""

    structures: int
    atoms: int
    total: int


def select(inputs, output, *, where=None, structures=None, structures_from=None,
           to_ase_units=False, allow_empty=False, force=False, input_format=None,
           progress=False):
    """Write to `output` the structures of `inputs` that pass every `where` condition and
    are among `structures` (structure numbers, a slice or a bool mask) and those listed in the
    file `structures_from` (one number a line; "-": stdin), as `segcli select` does: every
    field and result, sliced (an `output` named for an ASE format is exported). Returns the
    number of structures written; when none is chosen, nothing is written (unless
    `allow_empty`) and a segcli.errors.Note says so.

        segcli.select("sample_data/metals.h5", "low.h5", where="energy < 1")
        segcli.select("data.h5", "some.extxyz", structures=[0, 5, 7])
    """
    return selected(inputs, output, where=where, structures=structures,
                    structures_from=structures_from, to_ase_units=to_ase_units,
                    allow_empty=allow_empty, force=force, input_format=input_format,
                    progress=progress).structures


def _listed(path, n_structures):
    """The structures_from mask, read from the file `path` or stdin (`-`)."""
    from segcli.curate.selection import listed_mask
    from segcli.io.core import open_for_reading, standard_input

    if path == "-":
        return listed_mask(standard_input().buffer, "stdin", n_structures)
    try:
        with open_for_reading(path) as lines:
            return listed_mask(lines, path, n_structures)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from err


def _chosen(structures, n_structures):
    """(S,) bool of the structures `structures` chooses: a slice, an index, structure numbers
    (as --structures-from reads them) or a bool mask."""
    from segcli.curate.selection import listed_mask

    if structures is None or isinstance(structures, (slice, int, np.integer)):
        keep = np.zeros(n_structures, bool)
        keep[structure_slice(structures) or slice(None)] = True
        return keep
    chosen = np.asarray(structures)
    if chosen.dtype == bool:
        if chosen.shape != (n_structures,):
            raise ArgumentError(f"{{structures}} a mask must have one entry per structure "
                                f"({n_structures}), got shape {chosen.shape}")
        return chosen
    if chosen.dtype.kind not in "iu" or chosen.ndim != 1:
        raise TypeError("structures= takes a slice, an index, structure numbers or a bool mask")
    text = "\n".join(map(str, chosen.tolist())).encode()
    return listed_mask(io.BytesIO(text), "structures=", n_structures)


def selected(inputs, output, *, where=None, structures=None, structures_from=None,
             to_ase_units=False, allow_empty=False, force=False, input_format=None,
             progress=False):
    """`select`, returning what it wrote (Selected: structures, atoms, total).

        selected("data.h5", "low.h5", where="energy < 0").atoms
    """
    from segcli.curate.selection import where_mask
    from segcli.io import open_inputs
    from segcli.io.core import path_text
    from segcli.io.export import export, export_format
    from segcli.io.outputs import refuse_overwrite
    from segcli.io.subset import write_subset
    from segcli.io.writers import FieldChoice

    where = where_conditions(where)
    if not where and structures is None and structures_from is None:
        raise ArgumentError("give {where} 'NAME OP VALUE' or {structures_from} LIST (or both)")
    output, file = os.fspath(output), input_name(inputs)
    fmt = export_format(output)
    paths = input_paths(inputs)
    refuse_output_among_inputs(output, paths, "select writes a new file")
    refuse_overwrite(output, force)
    with open_inputs(paths, name=file, input_format=input_format) as batch:
        keep = _chosen(structures, batch.n_structures)
        if structures_from is not None:
            keep &= _listed(os.fspath(structures_from), batch.n_structures)
        if where:
            keep &= where_mask(batch, where)
        if not keep.any() and not allow_empty:
            tell(f"{file}: no structure of {len(keep)} is selected; {output} is not written "
                  "(--allow-empty writes an empty file)")
            return Selected(0, 0, len(keep))
        left = {}
        with tracked(progress, f"writing {output}", len(keep)) as bar:
            if fmt is None:
                choice = FieldChoice(to_ase_units=True, left=left) if to_ase_units else None
                kept, atoms = write_subset(batch, keep, output,
                                           {"selected_from": path_text(file)}, bar, force,
                                           choice)
            else:
                kept, atoms = export(paths, output, fmt, keep=keep, force=force, progress=bar,
                                     input_format=input_format, to_ase_units=to_ase_units,
                                     left=left)
    units_left(output, left)
    return Selected(kept, atoms, len(keep))


def units_left(output, left):
    """A Note for each field (name -> units) that to_ase_units left as it is."""
    for name, unit in left.items():
        tell(f"{output}: --to-ase-units left field '{name}' as it is: its units, {unit!r}, "
              "are not ones segcli knows")
