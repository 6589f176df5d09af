"""Command: merge (the parts of a job run as shards, joined into what one run writes)."""

import click

from segcli.cli.common import hdf5_output, note, notes, usage_errors


@click.command(short_help="Join shard outputs into one file.")
@click.argument("parts", metavar="PART...", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              callback=hdf5_output, help="The segcli HDF5 file to write.")
@click.option("--virtual", is_flag=True,
              help="Map the results onto the parts as HDF5 virtual datasets (by paths relative "
                   "to OUTPUT) instead of copying them.")
@click.option("--partial", is_flag=True,
              help="Join the parts there are, though structures or shards of the job lack: "
                   "OUTPUT's root attribute `missing` names the lacking ranges.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def merge(parts, output, virtual, partial, force, quiet):
    """Join the parts of one job into the file one run writes.

    PARTs are outputs of `segcli reduce`, `grad` or `stats` with --shard (or of one input over
    disjoint --structures ranges), in any order; each may be a glob pattern ('parts/*.h5'),
    a directory or @LIST (every file in it a part). OUTPUT equals, dataset by dataset and
    bit for bit, what one run over all their structures writes (but for the attribute
    `created`). Parts are refused, naming them, before anything is written, when their ranges
    overlap, when a part or shard is given twice, when they differ in op, fields, precision
    or input (its fingerprint), and when they lack structures of the job: every shard I of N
    must be there, and parts of other runs must cover all of the input. --partial joins an
    incomplete set on purpose.

    With --virtual, OUTPUT holds no copy: its results are HDF5 virtual datasets reading the
    parts, found by their paths relative to OUTPUT; keep the parts beside it (moving them
    together is fine), or the results can no longer be read.

    \b
    Example:
      segcli reduce data.h5 rms_norm forces --shard 0/2 -o 'parts/r-{shard}.h5'
      segcli reduce data.h5 rms_norm forces --shard 1/2 -o 'parts/r-{shard}.h5'
      segcli merge 'parts/r-*.h5' -o rms.h5
    """
    from segcli.api.data import merged

    with usage_errors(), notes(quiet):
        written = merged(parts, output, virtual=virtual, partial=partial, force=force)
    if not quiet:
        how = "virtual datasets over" if virtual else "copied from"
        note(f"{output}: structures {written.start}:{written.stop}, {how} {written.parts} "
             "part(s)")


COMMANDS = [merge]
