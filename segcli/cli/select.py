"""Command: select (a new file with only the chosen structures)."""


import click

from segcli.cli.common import (
    input_format,
    input_format_option,
    note,
    notes,
    output_name,
    to_ase_units_option,
    usage_errors,
    where_conditions,
)


@click.command()
@click.argument("file")
@input_format_option()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              callback=output_name,
              help="The new segcli HDF5 file.")
@click.option("--where", "conditions", multiple=True, metavar="'NAME OP VALUE'",
              callback=where_conditions,
              help="Keep structures where a per-structure field or result compares true; OP is "
                   "< <= > >= == or !=. Repeat it: all must hold.")
@click.option("--structures-from", metavar="LIST|-", type=click.Path(dir_okay=False,
              allow_dash=True),
              help="Keep the structures numbered in LIST (- : stdin), one number per line.")
@to_ase_units_option
@click.option("--allow-empty", is_flag=True,
              help="Write OUTPUT even when no structure is selected (an empty file).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def select(file, output, conditions, structures_from, to_ase_units, allow_empty, force, quiet):
    """Copy chosen structures to a new segcli file (or export them).

    Writes to OUTPUT the structures of FILE that pass every --where condition and, with
    --structures-from, are listed, in FILE's order (a structure listed twice is taken once):
    all their fields, string fields and presence masks, per-structure and per-atom results,
    with their attributes. OUTPUT's root attribute selected_from names FILE. FILE may be any
    file segcli reads; results exist only in segcli HDF5 files. Memory stays bounded however
    large FILE is; OUTPUT appears only once complete. An OUTPUT named for a format ASE
    writes (out.extxyz, out.traj, ...) gets the structures as `segcli convert` exports them.
    When no structure is selected, a line on stderr says so and OUTPUT is not written
    (unless --allow-empty).

    VALUE is a number (nan and inf too) or, for a string field, a string (quoted or bare) for
    == and !=. A structure without the field (see `segcli info`), or whose value is NaN, never
    satisfies a condition, not even !=; NAME == nan keeps the NaN ones, NAME != nan drops
    them. To select on a per-atom field, reduce it first (segcli reduce FILE max_norm forces
    --in-place) and select on the result (--where 'max_norm_forces < 10').

    \b
    Example:
      segcli select sample_data/metals.h5 --where 'energy < 1' -o low.h5
      segcli select sample_data/metals.h5 --where 'energy < 1' -o low.extxyz
      segcli select spice.hdf5 --where 'formation_energy < 0' -o low.extxyz --to-ase-units
      segcli select batch.h5 --where 'config_type == bulk' --where 'max_norm_forces < 10' -o ok.h5
      segcli reduce batch.h5 max_norm forces | awk -F, 'NR>1 && $2 < 10 {print $1}' \\
        | segcli select batch.h5 --structures-from - -o clean.h5
    """
    from segcli.api.curate import selected

    with usage_errors(), notes(quiet):
        written = selected(file, output, where=conditions, structures_from=structures_from,
                           to_ase_units=to_ase_units, allow_empty=allow_empty, force=force,
                           input_format=input_format(), progress=not quiet)
    if not quiet and (written.structures or allow_empty):
        note(f"{output}: {written.structures} of {written.total} structures, {written.atoms} "
             "atoms")


COMMANDS = [select]
