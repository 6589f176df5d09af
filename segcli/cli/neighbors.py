"""Command: neighbors (per-structure neighbour statistics at cutoffs)."""

import types
from typing import NamedTuple

import click

from segcli.cli import common
from segcli.cli.common import note, progress, where_option, where_selection
from segcli.cli.compute import (
    Results,
    check_output_usage,
    compute_into,
    file_format,
    open_sink,
    output_options,
)

_NEIGHBORS = types.SimpleNamespace(name="neighbors")


class _Statistic(NamedTuple):
    """One result of `neighbors`, as compute.Results takes a job: label -> (per, shape,
    dtype), the op and the fields that made it."""

    outputs: dict
    spec: object = _NEIGHBORS
    fields: tuple = ("positions",)


def _results(cutoffs, per_atom, table, partial):
    """(Results, names (see neighbors.result_names)): the per-structure statistics,
    and with `per_atom` each atom's neighbours; only the latter on a table (stdout, csv, json,
    npy) with `per_atom`, whose rows are atoms. `partial`: some structures lack positions, so
    integer results are float64 (NaN there)."""
    import numpy as np

    from segcli import neighbors
    from segcli.engine import nan_dtype

    names = neighbors.result_names(cutoffs, per_atom)
    if per_atom and table:
        names = {n: v for n, v in names.items() if v[1] == "atom"}
    statistics = [_Statistic({"": (per, (), nan_dtype(np.dtype(dtype)) if partial
                                   else np.dtype(dtype))})
                  for _, per, dtype, _ in names.values()]
    return Results(statistics, list(names)), names


def _summary_lines(summary, file):
    """A neighbors.Summary as lines of text."""
    from segcli.neighbors import cutoff_label

    values = summary.as_dict()
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


def _runner(cutoffs, names, summary, histogram_bins):
    """A run for compute.compute_into: each chunk's results (one dict per result of `names`)
    from segcli.neighbors.run, its statistics added to `summary`."""
    from segcli import neighbors

    def run(batch, jobs, device, *, structures, chunk_atoms, keep):
        per_atom = any(per == "atom" for _, per, _, _ in names.values())
        for chunk, statistics in neighbors.run(batch, cutoffs, device, chunk_atoms=chunk_atoms,
                                               structures=structures, keep=keep,
                                               histogram_bins=histogram_bins,
                                               per_atom=per_atom):
            summary.add(chunk, statistics)
            yield chunk, tuple({"": statistics[base] if k is None else statistics[base][:, k]}
                               for base, _, _, k in names.values())

    return run


def _checked_cutoffs(ctx, param, cutoffs):
    """The --cutoff values ascending (see neighbors.checked_cutoffs), or a usage error."""
    from segcli.neighbors import checked_cutoffs

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

    from segcli.neighbors import Summary

    histogram_bins = histogram_bins or 0
    check_output_usage(output, in_place, fmt, structures)
    paths = common.input_paths(file, in_place)
    common.refuse_output_among_inputs(output, paths, "use --in-place to add to it")
    common.check_output_place(output)
    table = not (output or in_place) or file_format(output) is not None
    with common.read_inputs(paths, file, in_place) as batch:
        batch.check_fields(["positions"])
        results, names = _results(cutoffs, per_atom, table,
                                  batch.present("positions") is not None)
        selected = common.selection(batch, file, structures)
        lo, hi = selected.start, selected.stop
        keep = where_selection(batch, file, where, selected, quiet=quiet)
        target = common.device(device)
        attrs = {"cutoffs": cutoffs, "device": common.device_label(target)}
        if where:
            attrs["where"] = [condition.text for condition in where]
        sink = open_sink(results, batch, lo, hi, output=output, in_place=in_place, file=paths[0],
                         fmt=fmt, force=force, attrs=attrs, keep=keep)
        summary = Summary(cutoffs, histogram_bins)
        total = hi - lo if keep is None else int(keep[lo:hi].sum())
        with progress(not quiet, f"neighbours of {file}", total) as bar:
            compute_into(batch, results, sink, target, lo, hi, chunk_atoms, bar, keep=keep,
                         run=_runner(cutoffs, names, summary, histogram_bins))
    if quiet:
        return
    if fmt == "json":
        note(json.dumps(summary.as_dict()))
        return
    for line in _summary_lines(summary, file):
        note(line)
    if output or in_place:
        written = (results.columns.values() if file_format(output)
                   else (f"/results/{d}" for d in results.datasets))
        note(f"{output or file}: {', '.join(written)}")


COMMANDS = [neighbors]
