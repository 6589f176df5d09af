"""The `segcli` command line: a thin click layer over segcli.io, segcli.engine and segcli.ops.

Command modules import only click at start-up; jax, warp, h5py and ase are imported inside
the commands, so `segcli --help` stays fast.
"""

import sys

import click

from segcli import __version__
from segcli.errors import DataError


class SegcliGroup(click.Group):
    """Turns data errors into one line on stderr and exit code 1 (a traceback only with --debug)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DataError as err:
            if ctx.meta.get("segcli.debug"):
                raise
            click.echo(f"Error: {err}", err=True)
            sys.exit(err.exit_code)


@click.group(cls=SegcliGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="segcli")
@click.option("--debug", is_flag=True, help="Show the full Python traceback on errors.")
@click.pass_context
def main(ctx, debug):
    """Per-structure segment reductions and their derivatives over batches of atomic systems.

    \b
    Example:
      segcli convert structures.extxyz -o batch.h5
      segcli reduce batch.h5 rms_norm forces | sort -t, -k2 -g | tail -3
    """
    ctx.meta["segcli.debug"] = debug


from segcli.cli import check, compute, curate, data, select  # noqa: E402  (register the commands)

for _module in (data, compute, curate, select, check):
    for _command in _module.COMMANDS:
        main.add_command(_command)
