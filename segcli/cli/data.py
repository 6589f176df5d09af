"""Commands: info (what a file holds) and convert (any input to segcli HDF5)."""

import json

import click

from segcli.cli.common import progress_bar

FORMAT_NAMES = {"segcli": "segcli HDF5", "ase": "ASE-readable file", "conformers":
                "conformer-layout HDF5", "empty": "empty file"}


def describe(batch):
    """What `info` prints, as one JSON-friendly dict."""
    fields = sorted(batch.fields.values(), key=lambda f: f.per != "atom")
    return {
        "path": batch.path,
        "format": batch.format,
        "structures": batch.n_structures,
        "atoms": int(batch.n_atoms.sum()),
        "fields": {f.name: {"per": f.per, "shape": list(f.shape), "dtype": str(f.dtype),
                            "derived": f.name in batch.derived} for f in fields},
        "results": batch.results,
    }


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(file, as_json):
    """Show the structures, atoms, fields and stored results of FILE.

    FILE is a segcli HDF5 file, an HDF5 file in the conformer layout of ANI-1x, SPICE or
    Transition1x, or any file ASE reads (extxyz, traj, db, cif, POSCAR, ...; these are read
    once in full).

    \b
    Example:
      segcli info sample_data/metals.h5
      segcli info --json sample_data/metals.extxyz
    """
    from segcli.io import open_batch

    with open_batch(file) as batch:
        summary = describe(batch)
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(f"{summary['path']}: {FORMAT_NAMES[summary['format']]}")
    click.echo(f"structures: {summary['structures']}")
    click.echo(f"atoms: {summary['atoms']}")
    rows = [("name", "per", "shape", "dtype", "")] + [
        (name, f["per"], str(tuple(f["shape"])), f["dtype"], "derived" if f["derived"] else "")
        for name, f in summary["fields"].items()]
    click.echo("fields:" + ("" if len(rows) > 1 else " none"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows if len(rows) > 1 else []:
        click.echo("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    click.echo("results:" + ("" if summary["results"] else " none"))
    for name, attrs in summary["results"].items():
        described = "  ".join(
            f"{k}={','.join(map(str, attrs[k])) if isinstance(attrs[k], list) else attrs[k]}"
            for k in ("op", "fields", "per") if k in attrs)
        click.echo(f"  {name}  {described}".rstrip())


@click.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True,
                type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The segcli HDF5 file to write.")
@click.option("--compression", type=click.Choice(["gzip", "lzf"]),
              help="Compress the datasets (default: none, fastest to read).")
@click.option("--chunk-atoms", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Atoms held in memory at a time (whole structures).")
@click.option("--fill-missing", type=click.Choice(["nan"]),
              help="Fill fields that some structures lack with NaN instead of failing.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def convert(inputs, output, compression, chunk_atoms, fill_missing, force, quiet):
    """Convert INPUT files, concatenated in order, to one segcli HDF5 file.

    Each INPUT is any file ASE reads (extxyz, xyz, traj, db, cif, POSCAR, ...), a segcli HDF5
    file (its stored results are not copied) or a conformer-layout HDF5 file. Every per-atom
    array, cell, pbc, numeric info entry and calculator result (energy, forces, stress, ...)
    is kept, under ASE's names. Memory stays bounded by --chunk-atoms however large the
    input; OUTPUT appears only when the whole conversion succeeded.

    \b
    Example:
      segcli convert sample_data/metals.extxyz -o metals.h5
      segcli convert run1.traj run2.extxyz -o runs.h5 --compression gzip --force
    """
    import numpy as np

    from segcli.io import convert as convert_files

    with progress_bar(not quiet, f"converting to {output}") as bar:
        structures, atoms, fields = convert_files(
            inputs, output, compression=compression, chunk_atoms=chunk_atoms,
            fill_missing=np.nan if fill_missing else None, force=force,
            progress=bar.update if bar else None)
    if not quiet:
        click.echo(f"{output}: {structures} structures, {atoms} atoms, fields: "
                   f"{', '.join(fields) or 'none'}", err=True)


COMMANDS = [info, convert]
