"""Command: neighbors (per-structure neighbour statistics at cutoffs)."""

import click

from segcli.cli import common
from segcli.cli.common import note, where_option
from segcli.cli.compute import output_options, report, run


def _summary_lines(values, file):
    """A neighbour summary (Results.summary) as lines of text."""
    from segcli.neighborlist import cutoff_label

    lines = []
    for cutoff, pairs, mean, most in zip(values["cutoffs"], values["pairs"],
                                         values["mean_neighbors"], values["max_neighbors"]):
        per_atom = "no atoms" if mean is None else f"{mean:.6g} per atom on average"
        lines.append(f"{file}: within {cutoff_label(cutoff)} Å, {pairs} ordered pairs over "
                     f"{values['atoms']} atoms: {per_atom}, at most {most}")
    if values["min_pair"] is None:
        lines.append(f"{file}: no pair within {cutoff_label(values['cutoffs'][-1])} Å")
    else:
        pair = values["min_pair"]
        lines.append(f"{file}: nearest pair {values['min_distance']:.6g} Å, atoms "
                     f"{pair['i']} and {pair['j']} of structure {pair['structure']}")
    if "histogram" in values:
        edges, counts = values["histogram"]["edges"], values["histogram"]["counts"]
        lines.append("distance from (Å)  to (Å)  pairs")
        lines += [f"{a:.6g}  {b:.6g}  {n}" for a, b, n in zip(edges, edges[1:], counts)]
    return lines


def _checked_cutoffs(ctx, param, cutoffs):
    """The --cutoff values ascending (see neighbors.checked_cutoffs), or a usage error."""
    from segcli.neighborlist import checked_cutoffs

    try:
        return checked_cutoffs(cutoffs).tolist()
    except ValueError as err:
        raise click.BadParameter(str(err), ctx, param) from None


@click.command(short_help="Neighbour statistics at cutoffs, per structure.")
@click.argument("file")
@common.input_format_option("--input-format")
@click.option("--cutoff", "cutoffs", multiple=True, required=True, metavar="R",
              callback=_checked_cutoffs,
              help="Distance in Å below which two atoms are neighbours (at most 1e6); repeat "
                   "it for several cutoffs (results then named NAME_R, R as exactly as it "
                   "reads back: n_pairs_5, mean_neighbors_4.5).")
@click.option("--per-atom", is_flag=True,
              help="Also each atom's number of neighbours (n_neighbors): alone on stdout, "
                   "beside the per-structure results with -o OUT.h5 or --in-place.")
@click.option("--histogram", "histogram_bins", type=click.IntRange(1, 1 << 20),
              metavar="BINS", help="Count the pairs' distances in BINS equal bins from 0 to "
                                   "the largest cutoff (in the summary).")
@output_options("output", "in_place", "fmt", "force", "structures", "chunk_atoms", "device",
                "quiet")
@where_option
def neighbors(file, cutoffs, per_atom, histogram_bins, output, in_place, fmt, force,
              structures, chunk_atoms, device, quiet, where):
    """Per structure of FILE, the ordered pairs of atoms closer than R (n_pairs), with periodic
    images as ASE's neighbor_list counts them (an atom with its own image counts; images
    beyond the nearest when the cell is thinner than R; pbc per axis; no images without a
    cell), n_pairs per atom (mean_neighbors, NaN if empty), the smallest distance among them
    (min_distance, inf if none) and its pair (min_pair_i, min_pair_j: atom indices in the
    structure, the lowest i then j on a tie; -1 if none).

    FILE and the output options are as for `segcli reduce`: csv (columns structure,
    n_pairs, mean_neighbors, min_distance, min_pair_i, min_pair_j), json, npy, -o, or
    --in-place, which stores the results as fields that `select --where`, `stats` and
    `reduce` read. stderr gets the dataset's summary: pairs and mean and largest neighbours
    per atom, the nearest pair, and with --histogram the distances' histogram (a JSON
    object with --format json). Positions stated in bohr or nm are converted; memory is
    bounded by --chunk-atoms: a cell list per chunk, no pair list.

    \b
    Example:
      segcli neighbors sample_data/metals.h5 --cutoff 5
      segcli neighbors data.h5 --cutoff 5 --cutoff 6 --histogram 50 -o neighbours.h5
      segcli neighbors data.h5 --cutoff 3 --in-place
      segcli select data.h5 --where 'min_distance < 0.5' -o suspicious.h5
    """
    import json

    from segcli import api

    results = run(api.neighbors, file, cutoffs, per_atom=per_atom, histogram=histogram_bins,
                  output=output, in_place=in_place, fmt=fmt, quiet=quiet, force=force,
                  structures=structures, chunk_atoms=chunk_atoms, device=device, where=where)
    if quiet:
        return
    if fmt == "json":
        note(json.dumps(results.summary))
        return
    for line in _summary_lines(results.summary, file):
        note(line)
    report(results, file, None)


COMMANDS = [neighbors]
