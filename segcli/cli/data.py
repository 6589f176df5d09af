"""Commands: info (what a file holds) and convert (any input to segcli HDF5)."""

import json

import click

from segcli.cli.common import (
    CHUNK_ATOMS,
    input_format,
    input_format_option,
    note,
    notes,
    output_format_options,
    output_name,
    table,
    to_ase_units_option,
    usage_errors,
)


def _notes(summary, f):
    """The last column of a field's row in `info`'s table."""
    notes = [note for note in ("derived", "result") if f[note]]
    if f["present"] < summary["structures"]:
        notes.append(f"present in {f['present']} of {summary['structures']}")
    if "fill_value" in f:
        fill = f["fill_value"]
        notes.append(f"filled with {json.dumps(fill) if fill != 'nan' else fill}")
    return ", ".join(notes)


@click.command()
@click.argument("file")
@input_format_option()
@output_format_options("table", "json")
def info(file, fmt, as_json):
    """Show what a file holds.

    The structures, atoms, fields (per atom or per structure, shape, dtype, units where the
    file states them or, for a conformer file, its dataset's convention) and stored results
    of FILE. A field computed from others is marked `derived`, a stored result usable as a
    field (by its name, e.g. in `segcli reduce`) `result`, and a field that only some
    structures have `present in K of S` (with what fills the others in a converted file).
    Then the elements (atoms of each, and structures holding it) and, for each per-structure
    string field, its 20 most common values with their counts, counted in one streamed pass.

    FILE is a segcli HDF5 file, an HDF5 file in the conformer layout of ANI-1x, SPICE or
    Transition1x, an ASE database (.db, .json, OMat24/OMol25 .aselmdb) or any file ASE reads
    (extxyz, traj, cif, POSCAR, ...; these are read once in full). The first line names the
    format, which segcli tells by the file's content.

    FILE, wherever a command takes it, may also be many files read in order as one batch
    (structure numbers run across them; results say where each structure came from): a
    directory (its regular, non-hidden files that segcli reads, in sorted name order), a
    quoted glob pattern ('shards/*.h5', expanded by segcli and sorted), or @LIST (a text file
    with one path per line, relative to the list's directory; blank lines and # comments
    skipped; @- reads the list from stdin). Their fields must agree in shape; a field that
    only some files have is present in their structures only.

    \b
    Example:
      segcli info sample_data/metals.h5
      segcli info --json sample_data/metals.extxyz
      segcli info 'shards/*.h5'
    """
    from segcli.api.data import describe
    from segcli.io.text import finite_json

    summary = describe(file, format=input_format())
    if as_json or fmt == "json":
        click.echo(finite_json(summary))
        return
    _print_summary(summary)


def _print_summary(summary):
    """Print what `describe` found, as `info`'s text."""
    from segcli.io.formats import DESCRIPTIONS

    descriptions = {**DESCRIPTIONS, "multi": "files read as one batch"}
    click.echo(f"{summary['path']}: {descriptions[summary['format']]}")
    if "members" in summary:
        click.echo(f"files: {len(summary['members'])}")
        rows = [(m["path"], descriptions[m["format"]], f"{m['structures']} structures",
                 f"{m['atoms']} atoms") for m in summary["members"]]
        for line in table(rows):
            click.echo(f"  {line}")
    click.echo(f"structures: {summary['structures']}")
    click.echo(f"atoms: {summary['atoms']}")
    rows = [("name", "per", "shape", "dtype", "units", "")] + [
        (name, f["per"], str(tuple(f["shape"])), f["dtype"], f["units"] or "", _notes(summary, f))
        for name, f in summary["fields"].items()]
    if not any(f["units"] for f in summary["fields"].values()):  # no column where none is stated
        rows = [row[:4] + row[5:] for row in rows]
    click.echo("fields:" + ("" if len(rows) > 1 else " none"))
    for line in table(rows) if len(rows) > 1 else []:
        click.echo(f"  {line}")
    if summary["conflicts"]:
        click.echo("not fields (the files disagree):")
        for why in summary["conflicts"].values():
            click.echo(f"  {why}")
    click.echo("results:" + ("" if summary["results"] else " none"))
    for name, attrs in summary["results"].items():
        described = "  ".join(
            f"{k}={','.join(map(str, attrs[k])) if isinstance(attrs[k], list) else attrs[k]}"
            for k in ("op", "fields", "per") if k in attrs)
        click.echo(f"  {name}  {described}".rstrip())
    if summary["elements"] is not None:
        rows = [("element", "Z", "atoms", "structures")] + [
            (e["symbol"], str(e["number"]), str(e["atoms"]), str(e["structures"]))
            for e in summary["elements"]]
        click.echo("elements:" + ("" if len(rows) > 1 else " none"))
        for line in table(rows) if len(rows) > 1 else []:
            click.echo(f"  {line}")
    for name, values in summary["values"].items():
        click.echo(f"values of {name}: {values['distinct']} distinct")
        rows = [(json.dumps(v, ensure_ascii=False), str(n))
                for v, n in values["most_common"].items()]
        for line in table(rows) if rows else []:
            click.echo(f"  {line}")
        if values["distinct"] > len(values["most_common"]):
            click.echo(f"  … and {values['distinct'] - len(values['most_common'])} more")


def _names(ctx, param, text):
    """Click callback: the names of a comma-separated list (None if not given)."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise click.BadParameter(f"expected field names separated by commas, got {text!r}")
    if param.name == "drop" and "n_atoms" in names:
        raise click.BadParameter("n_atoms is always kept")
    return names


def _pairs(ctx, param, texts):
    """Click callback: {A: B} from repeated "A=B" (a name given twice is a usage error)."""
    pairs = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not (sep and key and value):
            raise click.BadParameter(f"expected {param.metavar}, got {text!r}")
        if key in pairs:
            raise click.BadParameter(f"{key} is given twice")
        pairs[key] = value
    if param.name in ("casts", "units"):
        from segcli.api.data import checked_casts, checked_units
        from segcli.errors import ArgumentError

        try:
            return (checked_casts if param.name == "casts" else checked_units)(pairs)
        except ArgumentError as err:
            raise click.BadParameter(err.for_command().removeprefix(f"{param.opts[0]} ")) \
                from None
    return pairs


@click.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              callback=output_name,
              help="The file to write: segcli HDF5 (.h5, .hdf5), or any format ASE writes, "
                   "by its name (.extxyz, .traj, .db, ...; .gz, .bz2, .xz compress).")
@click.option("--compression", type=click.Choice(["gzip", "lzf"]),
              help="Compress the datasets (default: none, fastest to read).")
@click.option("--chunk-atoms", type=CHUNK_ATOMS, default=100_000, show_default=True,
              help="Atoms held in memory at a time (whole structures).")
@click.option("--fill-missing", type=click.Choice(["nan"]),
              help="Fill the fields that some structures lack instead of failing: floats with "
                   "NaN, integers and booleans with 0, strings with \"\" (OUTPUT records which "
                   "structures have each field).")
@click.option("--fields", callback=_names, metavar="A,B,...",
              help="Keep only these fields (and n_atoms).")
@click.option("--drop", callback=_names, metavar="A,B,...", help="Leave these fields out.")
@click.option("--rename", "renames", multiple=True, callback=_pairs, metavar="OLD=NEW",
              help="Write field OLD (as read) as NEW. Repeatable.")
@click.option("--cast", "casts", multiple=True, callback=_pairs, metavar="NAME=DTYPE",
              help="Write field NAME (as renamed) as DTYPE: float64, float32, int64, int32, "
                   "int16, int8, uint8, bool or str; a value "
                   "that would change (1.5 as int64, text that is no number) is an error. "
                   "Repeatable.")
@click.option("--units", "units", multiple=True, callback=_pairs, metavar="NAME=UNIT",
              help="Field NAME (as renamed) is in UNIT (eV, Hartree, Ang, Bohr, eV/Ang, "
                   "Hartree/Bohr, amu, e, ...) in the inputs that state no units for it. "
                   "Repeatable.")
@to_ase_units_option
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@input_format_option()
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def convert(inputs, output, compression, chunk_atoms, fill_missing, fields, drop, renames, casts,
            units, to_ase_units, force, quiet):
    """Convert files to one segcli HDF5 file, or export to ASE formats.

    The INPUT files are concatenated in order. Each is any file ASE reads (extxyz, xyz, traj,
    db, cif, POSCAR, ...), a segcli HDF5 file or a
    conformer-layout HDF5 file; an INPUT may also be many files (a directory, a quoted glob
    pattern or @LIST, see `segcli info --help`). Every per-atom array, cell, pbc, numeric
    or string info entry (an ASE database's id, unique_id and key-value pairs), calculator
    result (energy, forces, stress, ...) and stored result (/results/NAME, as a field) is
    kept, under its own name, unless --fields, --drop or --rename say otherwise.
    A field that only some structures have (a molecule has no stress, a bulk cell no tags) is
    an error unless --fill-missing fills it. Memory stays bounded by --chunk-atoms however
    large the input; OUTPUT appears only when the whole conversion succeeded.

    An OUTPUT named for another format (out.extxyz, out.traj, out.db) gets every structure
    as ASE writes it: positions, numbers, cell and pbc, calculator results (energy, forces,
    stress, ...), constraints from `fixed` (FixAtoms) and `fixed_cartesian` (FixCartesian),
    which convert keeps them as, other per-atom fields as arrays and per-structure ones as
    info (key-value pairs in a database), stored results included; a structure without a
    field is written without it.

    A field's units (what its file states; a conformer file's by its dataset's convention,
    SPICE's and ANI-1x's in Hartree and Bohr) are kept, and --units states them where an
    input states none. Inputs whose units differ are refused, and so is an OUTPUT of an ASE
    format with a field in known units that are not ASE's, unless --to-ase-units converts
    them (a field in units segcli does not know is left as it is, and named on stderr).

    \b
    Example:
      segcli convert sample_data/metals.extxyz -o metals.h5
      segcli convert mixed.extxyz -o mixed.h5 --fill-missing nan --drop initial_magmoms
      segcli convert run1.traj run2.extxyz -o runs.h5 --compression gzip --force
      segcli convert surf.traj bulk.extxyz -o all.h5 --cast miller=str --rename energies=e
      segcli convert sample_data/metals.h5 -o metals-again.extxyz
      segcli convert spice.hdf5 -o spice.h5 --to-ase-units
    """
    from segcli.api.data import converted

    if fields is not None and drop is not None:
        raise click.UsageError("--fields and --drop cannot be used together")
    with usage_errors(), notes(quiet):
        written = converted(inputs, output, compression=compression, chunk_atoms=chunk_atoms,
                            fill_missing=fill_missing, fields=fields, drop=drop, rename=renames,
                            cast=casts, units=units, to_ase_units=to_ase_units, force=force,
                            input_format=input_format(), progress=not quiet)
    if not quiet:
        what = f", fields: {', '.join(written.fields) or 'none'}" \
            if written.fields is not None else ""
        note(f"{output}: {written.structures} structures, {written.atoms} atoms{what}")


COMMANDS = [info, convert]
