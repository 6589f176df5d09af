"""Commands: info (what a file holds) and convert (any input to segcli HDF5)."""

import json

import click

from segcli.cli.common import (
    CHUNK_ATOMS,
    input_format,
    input_format_option,
    note,
    note_units_left,
    output_name,
    progress,
    refuse_output_among_inputs,
    table,
    to_ase_units_option,
)

MOST_COMMON = 20
"""The values of a string field that `info` lists (the most common)."""


def describe(batch):
    """What `info` prints, as one JSON-friendly dict (a NaN fill_value as the string "nan")."""
    import math

    from segcli.errors import for_user
    from segcli.stats import census

    def field(f):
        present = batch.present(f.name)
        out = {"per": f.per, "shape": list(f.shape),
               "dtype": "str" if f.dtype == object else str(f.dtype), "units": f.units,
               "derived": f.name in batch.derived, "result": f.name in batch.result_fields,
               "present": batch.n_structures if present is None else int(present.sum())}
        fill = batch.fill_value(f.name) if present is not None else None
        if fill is not None:
            fill = fill.item() if hasattr(fill, "item") else fill  # a NumPy scalar as Python's
            out["fill_value"] = "nan" if isinstance(fill, float) and math.isnan(fill) else fill
        return out

    fields = sorted(batch.fields.values(), key=lambda f: f.per != "atom")
    elements, strings = census(batch)
    members = [{**m, "path": for_user(m["path"])} for m in batch.members] \
        if batch.format == "multi" else None
    return {
        "path": for_user(batch.path),
        "format": batch.format,
        "structures": batch.n_structures,
        "atoms": int(batch.n_atoms.sum()),
        "sources": [for_user(source) for source in batch.sources],
        **({"members": members} if members else {}),
        "fields": {f.name: field(f) for f in fields},
        "conflicts": dict(batch.fields.conflicts),
        "results": batch.results,
        "elements": None if elements is None else _elements(elements),
        "values": {name: {"distinct": len(counts), "most_common": dict(
            sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MOST_COMMON])}
                   for name, counts in strings.items()},
    }


def _elements(counts):
    """Each element present: its symbol, atomic number, atoms and structures holding it, from
    `counts` (see segcli.stats.census)."""
    from ase.data import chemical_symbols

    return [{"symbol": chemical_symbols[z], "number": int(z), "atoms": int(counts[0, z]),
             "structures": int(counts[1, z])} for z in counts[0].nonzero()[0]]


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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(file, as_json):
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
    from segcli.io import open_inputs
    from segcli.io.formats import DESCRIPTIONS
    from segcli.io.text import finite_json

    descriptions = {**DESCRIPTIONS, "multi": "files read as one batch"}

    with open_inputs(file, input_format=input_format()) as batch:
        summary = describe(batch)
    if as_json:
        click.echo(finite_json(summary))
        return
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


CASTS = ("float64", "float32", "int64", "int32", "int16", "int8", "uint8", "bool", "str")
"""The dtypes --cast takes."""


def _pairs(ctx, param, texts):
    """Click callback: {A: B} from repeated "A=B" (a name given twice is a usage error)."""
    pairs = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not (sep and key and value):
            raise click.BadParameter(f"expected {param.metavar}, got {text!r}")
        if key in pairs:
            raise click.BadParameter(f"{key} is given twice")
        if param.name == "casts" and value not in CASTS:
            raise click.BadParameter(f"{value!r} is not one of {', '.join(CASTS)}")
        if param.name == "units":
            from segcli.io.units import canonical, known

            if canonical(value) is None:
                raise click.BadParameter(f"{value!r} is not a unit segcli knows: "
                                         f"{', '.join(known())}")
            value = canonical(value)
        pairs[key] = value
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
              help=f"Write field NAME (as renamed) as DTYPE, one of {', '.join(CASTS)}; a value "
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
    import numpy as np

    from segcli.io import convert as convert_files
    from segcli.io import expand_inputs
    from segcli.io.export import export, export_format

    if fields is not None and drop is not None:
        raise click.UsageError("--fields and --drop cannot be used together")
    fmt = export_format(output)
    if fmt is not None and (compression or fill_missing):
        option = "--compression" if compression else "--fill-missing"
        raise click.UsageError(f"{option} applies to a segcli HDF5 output, not to {fmt}")
    paths = expand_inputs(inputs)
    refuse_output_among_inputs(output, paths, "convert writes a new file")
    left = {}
    choice = {"fields": fields, "drop": drop, "rename": renames, "cast": casts, "units": units,
              "to_ase_units": to_ase_units, "left": left}
    with progress(not quiet, f"converting to {output}") as bar:
        if fmt is not None:
            structures, atoms = export(paths, output, fmt, chunk_atoms=chunk_atoms, force=force,
                                       progress=bar, input_format=input_format(), **choice)
            written = None
        else:
            structures, atoms, written = convert_files(
                paths, output, compression=compression, chunk_atoms=chunk_atoms,
                fill_missing=np.nan if fill_missing else None, force=force, progress=bar,
                input_format=input_format(), **choice)
    if not quiet:
        note_units_left(output, left)
        what = f", fields: {', '.join(written) or 'none'}" if written is not None else ""
        note(f"{output}: {structures} structures, {atoms} atoms{what}")


COMMANDS = [info, convert]
