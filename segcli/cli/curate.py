"""Commands: stats (count, mean, std, rms, min and max of fields) and fit-e0 (per-element
reference energies), streamed over files of any size."""

import contextlib
import math
import os

import click

from segcli.cli.common import (
    CHUNK_ATOMS,
    check_cluster_usage,
    cluster_options,
    hdf5_output,
    input_format,
    input_format_option,
    input_paths,
    note,
    on_cluster,
    progress,
    read_inputs,
    refuse_output_among_inputs,
    refuse_structures_in_place,
    result_name,
    selection,
    shard_output,
    shard_selection,
    structure_range,
    table,
    where_option,
    where_selection,
)
from segcli.errors import DataError

STAT_COLUMNS = ("count", "mean", "std", "rms", "min", "max")


def _streaming_options(command):
    """--structures, --chunk-atoms and --quiet."""
    for option in (
        click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors and results."),
        click.option("--chunk-atoms", type=CHUNK_ATOMS, default=1 << 21,
                     help="Atoms read at a time (whole structures; default 2097152): bounds "
                          "memory."),
        click.option("--structures", callback=structure_range, metavar="START:STOP",
                     help="Only these structures, a Python slice: START:STOP, -5: (the last "
                          "five), :10 or one index (default: all)."),
    ):
        command = option(command)
    return command


def _number(value):
    return "-" if value is None or math.isnan(value) else f"{value:.7g}"


def _element(z):
    from ase.data import chemical_symbols

    return chemical_symbols[z]


@click.command(short_help="Count, mean, std, rms, min, max of fields.")
@click.argument("file")
@input_format_option()
@click.argument("fields", metavar="[FIELD]...", nargs=-1)
@click.option("--per-element", is_flag=True,
              help="Per-atom fields by element (atomic number from `numbers`; structures "
                   "without numbers are left out).")
@click.option("--per-atom", is_flag=True,
              help="Per-structure fields divided by each structure's atom count first "
                   "(energy per atom; structures without atoms are left out).")
@click.option("--by", metavar="FIELD",
              help="Every field grouped by the value of FIELD, a per-structure integer or "
                   "string field such as config_type (structures without it are left out).")
@where_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=hdf5_output,
              help="Write the statistics to a new HDF5 file instead (/stats/FIELD: count, "
                   "mean, m2, min, max, std, rms).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("--partial", is_flag=True,
              help="Statistics files that lack structures of their inputs are merged anyway "
                   "(the output's attribute `missing` names them).")
@cluster_options
@_streaming_options
def stats(file, fields, per_element, per_atom, by, where, as_json, output, force, partial,
          structures, chunk_atoms, quiet, scheduler, shard):
    """Count, mean, std, rms, min and max of each FIELD of FILE.

    A per-atom field is taken over all atoms, a per-structure field over all structures,
    each component on its own and, for vector fields, the norm of each row too. The
    standard deviation is the population one (divided by the count). Structures that lack
    a field (see `segcli info`) are left out of its statistics; NaN and infinite values are
    refused (an error naming the field and the first structure holding one), as are values
    so large that their statistics overflow float64.
    The file is streamed in chunks of whole structures, so its size does not matter, and
    the partial results combine in one fixed tree (Chan's pairwise formulas), so shards
    (--shard, joined by `segcli merge`) and --scheduler give the bits of one run. FIELD may
    be a stored result (`segcli reduce ... --in-place`). --where takes only the structures
    that `segcli select --where` would keep; --by FIELD gives each value of FIELD (at most
    256 distinct ones) its own statistics, as --per-element does each element.
    FILE may also be statistics that `stats -o` wrote (several: a pattern, directory or
    @LIST): they are merged exactly (Chan's formulas), every FIELD by default, as if
    computed over all their data at once (up to rounding), whatever they were computed
    over. Each must count once: a file given twice, files of one input over overlapping
    structures, and files that lack structures (or shards) of an input are refused;
    --partial merges those that lack some on purpose.

    \b
    Example:
      segcli stats sample_data/metals.h5 forces energy
      segcli stats sample_data/metals.h5 forces --per-element --json
      segcli stats sample_data/metals.h5 energy --per-atom
      segcli stats data.h5 energy forces --by config_type --where 'energy < 0'
      segcli stats sample_data/metals.h5 forces --scheduler local:2
      segcli stats data.h5 forces --shard auto -o 'parts/stats-{shard}.h5'
      segcli stats 'parts/stats-*.h5' forces
    """
    from segcli.io import expand_inputs
    from segcli.io.coverage import refuse_skipped
    from segcli.io.statsfile import is_stats_file, write_stats
    from segcli.io.text import finite_json

    check_cluster_usage(shard, scheduler, False)
    if by is not None and per_element:
        raise click.UsageError("--per-element groups by element and --by by a field: give one")
    output = shard_output(output, shard)
    skipped = []
    paths = expand_inputs(file, skipped)
    refuse_output_among_inputs(output, paths, "stats writes a new file")
    if all(map(is_stats_file, paths)):
        given = [flag for flag, value in (("--per-element", per_element), ("--per-atom", per_atom),
                                          ("--by", by), ("--where", where),
                                          ("--structures", structures), ("--shard", shard),
                                          ("--scheduler", scheduler)) if value]
        if given:
            raise click.UsageError(f"{file} holds statistics, computed already: {given[0]} "
                                   "applies to data")
        refuse_skipped(skipped)
        result, summary, attrs = _merged_stats(paths, file, fields, partial)
        if "missing" in attrs and not quiet:
            note(f"{file}: lacks structures {attrs['missing']} of its input(s) (--partial)")
        parts = None
    else:
        if partial:
            raise click.UsageError("--partial merges statistics files; FILE holds data")
        if not fields:
            raise click.UsageError("give the FIELDs of FILE to compute statistics of")
        result, summary, parts, attrs = _field_stats(
            paths, file, fields, per_element, per_atom, by, where, structures, shard, scheduler,
            chunk_atoms, quiet)
        attrs.update(source=os.path.abspath(file), per_element=per_element, per_atom=per_atom)
        if where:
            attrs["where"] = [condition.text for condition in where]
    rows = [row for s in result.values() for row in s.rows()]
    for row in rows:
        if "element" in row:
            row["symbol"] = _element(row["element"])
    if output:
        write_stats(output, result, attrs, force=force, leaves=parts if shard else None)
        if not quiet:
            counts = (f"{summary['files']} files" if "files" in summary else
                      f"{summary['structures']} structures, {summary['atoms']} atoms")
            note(f"{output}: statistics of {', '.join(result)} ({counts})")
        return
    if as_json:
        click.echo(finite_json({**summary, **({"by": by} if by else {}), "stats": rows}))
        return
    group = by or ("element" if any("element" in row for row in rows) else None)
    header = ("field", *((group,) if group else ()), "component", *STAT_COLUMNS)
    lines = [header] + [
        (row["field"], *((str(row.get("group", row.get("symbol", ""))),) if group else ()),
         row["component"] or "-", str(row["count"]), *(_number(row[c]) for c in STAT_COLUMNS[1:]))
        for row in rows]
    click.echo("\n".join(table(lines)))


def _merged_stats(paths, file, fields, partial):
    """(name -> FieldStats, summary, the output's attributes) of FIELDs (default: all) of the
    statistics files `paths` (FILE `file`) merged (segcli.io.statsfile.merge_stats_files);
    with `partial`, they may lack structures (the attribute `missing`)."""
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
                 scheduler, chunk_atoms, quiet):
    """(name -> FieldStats, summary, the leaves' statistics, the output's attributes) of the
    FIELDs of the data files `paths` (FILE `file`), as `segcli stats` computes them."""
    import numpy as np

    from segcli.cluster import leaf_stats_sharded
    from segcli.io import open_inputs
    from segcli.stats import group_values, merge_stats, refuse_overflow

    options = {"per_element": per_element, "per_atom": per_atom, "chunk_atoms": chunk_atoms}
    with (open_inputs(paths, name=file, input_format=input_format()) as batch,
          np.errstate(over="ignore", invalid="ignore")):
        _check_grouping(batch, fields, per_element, per_atom)
        leaves, attrs = shard_selection(batch, file, structures, shard)
        chosen = slice(int(leaves[0]), int(leaves[-1]))
        keep = where_selection(batch, file, where, chosen, needed=not shard, quiet=quiet)
        if by is not None:  # the groups of the whole selection: the same in every shard
            options.update(by=by, groups=group_values(batch, by, selection(batch, file,
                                                                           structures)))
        counted = np.ones(chosen.stop - chosen.start, bool) if keep is None else keep[chosen]
        summary = {"path": file, "structures": int(counted.sum()),
                   "atoms": int(batch.n_atoms[chosen][counted].sum())}
        label = f"statistics of {file}" + " (shards)" * bool(scheduler)
        with on_cluster(scheduler) as client, \
                progress(not quiet, label, summary["structures"]) as bar:
            parts = leaf_stats_sharded(client, batch, fields, leaves, progress=bar, where=where,
                                       keep=keep, **options)
        result = merge_stats([parts])
        refuse_overflow(file, result)
    return result, summary, parts, attrs


def _check_grouping(batch, fields, per_element, per_atom):
    """UsageError when --per-element or --per-atom applies to none of `fields` (those of
    `batch` only: an unknown one is named later)."""
    pers = {batch.fields[name].per for name in fields if name in batch.fields}
    for flag, given, per in (("--per-element", per_element, "atom"),
                             ("--per-atom", per_atom, "structure")):
        if given and pers and per not in pers:
            raise click.UsageError(f"{flag} applies to per-{per} fields; {', '.join(fields)} "
                                   f"{'is' if len(fields) == 1 else 'are'} not")


def _fixed(ctx, param, values):
    """{Z: E0} from --fixed SYMBOL=VALUE options (the symbol in any case: cu, CU, Cu)."""
    from ase.data import atomic_numbers

    out = {}
    for text in values:
        symbol, _, value = text.partition("=")
        symbol = symbol.strip().capitalize()
        try:
            energy = float(value)
        except ValueError:
            raise click.BadParameter(
                f"expected SYMBOL=VALUE (e.g. H=-13.6), got {text!r}") from None
        if symbol not in atomic_numbers or symbol == "X":
            raise click.BadParameter(f"{text!r}: {symbol!r} is not an element's symbol")
        if not math.isfinite(energy):
            raise click.BadParameter(f"{text!r}: the energy must be finite")
        if atomic_numbers[symbol] in out:
            raise click.BadParameter(f"{text!r}: {symbol} is fixed twice")
        out[atomic_numbers[symbol]] = energy
    return out


@click.command("fit-e0", short_help="Fit per-element reference energies.")
@click.argument("file")
@input_format_option()
@click.option("--energy", default="energy", show_default=True, metavar="FIELD",
              help="Per-structure energy field (or result) to fit.")
@click.option("--fixed", multiple=True, callback=_fixed, metavar="SYMBOL=VALUE",
              help="Hold an element's reference energy at VALUE (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--in-place", is_flag=True,
              help="Store the residual energies E - Σ c·E0 in FILE as a per-structure result.")
@click.option("--name", callback=result_name,
              help="Name of the stored residual (default: residual_FIELD).")
@click.option("--force", is_flag=True, help="Replace an existing result of that name.")
@where_option
@_streaming_options
def fit_e0(file, energy, fixed, as_json, in_place, name, force, where, structures, chunk_atoms,
           quiet):
    """Per-element reference energies E0 of FILE by least squares.

    Finds the E0 minimising Σ_s (E_s − Σ_Z c_sZ E0_Z)² over the structures, c_sZ being how
    many atoms of element Z structure s has (from `numbers`) and E_s its energy; elements
    absent from the data are left out, --fixed ones held. Prints E0 per element and the
    RMSE and MAE per atom of the residual (E − Σ c·E0) / n. Elements whose counts are
    linearly dependent (always 2 H per O) cannot be separated: that is an error naming them.
    Streamed in two passes, so the file's size does not matter; structures without an energy
    or numbers are left out, and a NaN or infinite energy is an error naming the first
    structure with one. --where fits only the structures that `segcli select --where` would
    keep; with --in-place the others' residuals are NaN.

    \b
    Example:
      segcli fit-e0 sample_data/metals.h5
      segcli fit-e0 data.h5 --fixed H=-13.6 --json
      segcli fit-e0 data.h5 --where 'config_type == bulk'
      segcli fit-e0 data.h5 --in-place --name interaction_energy
    """
    import numpy as np
    from ase.data import chemical_symbols

    from segcli.io import ResultWriter
    from segcli.io.core import spread
    from segcli.io.text import finite_json
    from segcli.stats import residual_errors, solve_e0

    if name is not None and not in_place:
        raise click.UsageError("--name names the result that --in-place stores")
    refuse_structures_in_place(in_place, structures)
    paths = input_paths(file, in_place)
    name = name or f"residual_{energy}"
    with contextlib.ExitStack() as stack:
        batch = stack.enter_context(read_inputs(paths, file, in_place))
        stack.enter_context(np.errstate(over="ignore", invalid="ignore"))  # overflow: DataError
        chosen = selection(batch, file, structures)
        keep = where_selection(batch, file, where, chosen, needed=True)
        total = chosen.stop - chosen.start if keep is None else int(keep.sum())
        bar = stack.enter_context(progress(not quiet, f"fitting E0 of {file} (2 passes)",
                                           2 * total))
        options = {"chunk_atoms": chunk_atoms, "structures": chosen, "keep": keep,
                   "progress": bar}
        e0, used = solve_e0(batch, energy, fixed=fixed, **options)
        everything = {**e0, **fixed}
        if in_place:
            writer = ResultWriter(in_place_of=paths[0], force=force, names=[name])
            with writer:
                writer.set_n_atoms(batch.n_atoms)
                writer.create(name, (batch.n_structures,), "float64", {
                    "op": "fit-e0", "fields": [energy, "numbers"], "per": "structure",
                    "elements": sorted(everything),
                    "e0": [everything[z] for z in sorted(everything)],
                    **({"where": [c.text for c in where]} if where else {})}, np.nan)
                rows = np.arange(batch.n_structures + 1)
                rmse, mae = residual_errors(
                    batch, energy, everything,
                    on_chunk=lambda chunk, values: writer.write(
                        name, *spread(values, chunk.structure_numbers, rows, np.nan)),
                    **options)
        else:
            rmse, mae = residual_errors(batch, energy, everything, **options)
    elements = [{"element": chemical_symbols[z], "number": z, "e0": everything[z],
                 "fixed": z in fixed} for z in sorted(everything)]
    if as_json:
        click.echo(finite_json({"path": file, "energy": energy, "structures": used,
                                "e0": elements, "rmse_per_atom": rmse, "mae_per_atom": mae}))
    else:
        lines = [("element", "Z", "E0", "")] + [
            (e["element"], str(e["number"]), f"{e['e0']:.10g}", "fixed" if e["fixed"] else "")
            for e in elements]
        click.echo("\n".join(table(lines)))
        click.echo(f"structures: {used}; residual per atom: RMSE {_number(rmse)}, "
                   f"MAE {_number(mae)}")
    if in_place and not quiet:
        note(f"{file}: /results/{name} ({batch.n_structures} structures)")


COMMANDS = [stats, fit_e0]
