"""Commands: stats (count, mean, std, rms, min and max of fields) and fit-e0 (per-element
reference energies), streamed over files of any size."""

import click

from segcli.cli.common import (
    CHUNK_ATOMS,
    cluster_options,
    hdf5_output,
    input_format,
    input_format_option,
    note,
    notes,
    output_format_options,
    result_name,
    structure_range,
    table,
    usage_errors,
    where_option,
)


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
@output_format_options("table", "json")
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=hdf5_output,
              help="Write the statistics to a new HDF5 file instead (/stats/FIELD: count, "
                   "mean, m2, min, max, std, rms).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("--partial", is_flag=True,
              help="Statistics files that lack structures of their inputs are merged anyway "
                   "(the output's attribute `missing` names them).")
@cluster_options
@_streaming_options
def stats(file, fields, per_element, per_atom, by, where, fmt, as_json, output, force, partial,
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
    from segcli.api.curate import stats as statistics
    from segcli.io.text import finite_json

    with usage_errors(), notes(quiet):
        result = statistics(file, *fields, per_element=per_element, per_atom=per_atom, by=by,
                            where=where, structures=structures, output=output, force=force,
                            partial=partial, shard=shard, scheduler=scheduler,
                            chunk_atoms=chunk_atoms, input_format=input_format(),
                            progress=not quiet)
    if output:
        if not quiet:
            summary = result.summary
            counts = (f"{summary['files']} files" if "files" in summary else
                      f"{summary['structures']} structures, {summary['atoms']} atoms")
            note(f"{result.output}: statistics of {', '.join(result.fields)} "
                 f"({counts})")
        return
    click.echo(finite_json(result.to_dict()) if as_json or fmt == "json" else str(result))


def _fixed(ctx, param, values):
    """{Z: E0} from --fixed SYMBOL=VALUE options (the symbol in any case: cu, CU, Cu; see
    segcli.api.curate.fixed_numbers)."""
    from ase.data import chemical_symbols

    from segcli.api.curate import fixed_numbers
    from segcli.errors import ArgumentError
    from segcli.numbers import plain_number

    out = {}
    for text in values:
        symbol, _, value = text.partition("=")
        try:
            (z, energy), = fixed_numbers({symbol: plain_number(value)}).items()
        except ValueError as err:
            reason = err.for_command().removeprefix("--fixed ") \
                if isinstance(err, ArgumentError) else "expected SYMBOL=VALUE (e.g. H=-13.6)"
            raise click.BadParameter(f"{text!r}: {reason}") from None
        if z in out:
            raise click.BadParameter(f"{text!r}: {chemical_symbols[z]} is fixed twice")
        out[z] = energy
    return out


@click.command("fit-e0", short_help="Fit per-element reference energies.")
@click.argument("file")
@input_format_option()
@click.option("--energy", default="energy", show_default=True, metavar="FIELD",
              help="Per-structure energy field (or result) to fit.")
@click.option("--fixed", multiple=True, callback=_fixed, metavar="SYMBOL=VALUE",
              help="Hold an element's reference energy at VALUE (repeatable).")
@output_format_options("table", "json")
@click.option("--in-place", is_flag=True,
              help="Store the residual energies E - Σ c·E0 in FILE as a per-structure result.")
@click.option("--name", callback=result_name,
              help="Name of the stored residual (default: residual_FIELD).")
@click.option("--force", is_flag=True, help="Replace an existing result of that name.")
@where_option
@_streaming_options
def fit_e0(file, energy, fixed, fmt, as_json, in_place, name, force, where, structures,
           chunk_atoms, quiet):
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
    from ase.data import atomic_numbers

    from segcli.api.curate import fit_e0 as fitted
    from segcli.api.curate import number_text
    from segcli.io.text import finite_json

    with usage_errors(), notes(quiet):
        e0 = fitted(file, energy=energy, fixed=fixed, where=where, structures=structures,
                    in_place=in_place, name=name, force=force, chunk_atoms=chunk_atoms,
                    input_format=input_format(), progress=not quiet)
    elements = [{"element": symbol, "number": atomic_numbers[symbol], "e0": value,
                 "fixed": symbol in e0.fixed} for symbol, value in e0.items()]
    if as_json or fmt == "json":
        click.echo(finite_json({"path": file, "energy": energy, "structures": e0.structures,
                                "e0": elements, "rmse_per_atom": e0.rmse_per_atom,
                                "mae_per_atom": e0.mae_per_atom}))
    else:
        lines = [("element", "Z", "E0", "")] + [
            (e["element"], str(e["number"]), f"{e['e0']:.10g}", "fixed" if e["fixed"] else "")
            for e in elements]
        click.echo("\n".join(table(lines)))
        click.echo(f"structures: {e0.structures}; residual per atom: RMSE "
                   f"{number_text(e0.rmse_per_atom)}, MAE {number_text(e0.mae_per_atom)}")
    if in_place and not quiet:
        note(f"{file}: /results/{name or f'residual_{energy}'} ({len(e0.residuals)} "
             "structures)")


COMMANDS = [stats, fit_e0]
