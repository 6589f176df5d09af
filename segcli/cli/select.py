"""Command: select (a new file with only the chosen structures)."""


import click

from segcli.cli.common import (
    input_format,
    input_format_option,
    note,
    note_units_left,
    output_name,
    progress,
    refuse_output_among_inputs,
    to_ase_units_option,
    where_conditions,
)


def _listed(path, n_structures):
    """The --structures-from mask, read from the file `path` or stdin (`-`)."""
    from segcli.errors import DataError
    from segcli.io.core import open_for_reading, standard_input
    from segcli.select import listed_mask

    if path == "-":
        return listed_mask(standard_input().buffer, "stdin", n_structures)
    try:
        with open_for_reading(path) as lines:
            return listed_mask(lines, path, n_structures)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from err


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
    import numpy as np

    from segcli.cli.common import input_paths
    from segcli.io import open_inputs
    from segcli.io.core import path_text
    from segcli.io.export import export, export_format
    from segcli.io.subset import write_subset
    from segcli.io.writers import FieldChoice, refuse_overwrite
    from segcli.select import where_mask

    if not conditions and structures_from is None:
        raise click.UsageError("give --where 'NAME OP VALUE' or --structures-from LIST (or both)")
    fmt = export_format(output)
    paths = input_paths(file)
    refuse_output_among_inputs(output, paths, "select writes a new file")
    refuse_overwrite(output, force)
    with open_inputs(paths, name=file, input_format=input_format()) as batch:
        keep = np.ones(batch.n_structures, bool)
        if structures_from is not None:
            keep &= _listed(structures_from, batch.n_structures)
        if conditions:
            keep &= where_mask(batch, conditions)
        if not keep.any() and not allow_empty:
            note(f"{file}: no structure of {len(keep)} is selected; {output} is not written "
                 "(--allow-empty writes an empty file)")
            return
        left = {}
        with progress(not quiet, f"writing {output}", len(keep)) as bar:
            if fmt is None:
                choice = FieldChoice(to_ase_units=True, left=left) if to_ase_units else None
                kept, atoms = write_subset(batch, keep, output,
                                           {"selected_from": path_text(file)}, bar, force,
                                           choice)
            else:
                kept, atoms = export(paths, output, fmt, keep=keep, force=force, progress=bar,
                                     input_format=input_format(), to_ase_units=to_ase_units,
                                     left=left)
    if not quiet:
        note_units_left(output, left)
        note(f"{output}: {kept} of {len(keep)} structures, {atoms} atoms")


COMMANDS = [select]
