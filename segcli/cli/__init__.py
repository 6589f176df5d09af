"""The `segcli` command line: a thin click layer over segcli.io, segcli.engine and segcli.ops.

Command modules import only click at start-up; jax, warp, h5py and ase are imported inside
the commands, so `segcli --help` stays fast.
"""

import errno
import io
import os
import sys

import click

from segcli import __version__
from segcli.cli.common import as_program, note
from segcli.errors import (
    DataError,
    Interrupted,
    for_user,
    interruptible,
    interrupting_signal,
    memory_shortage,
)


def _silence_stdout():
    """Point stdout at /dev/null, so that nothing left in its buffer fails again at exit (a
    caller's stand-in for stdout, without a file descriptor, is left as it is)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


class _Stdout(io.RawIOBase):
    """File descriptor 1, its write errors (but a closed pipe's) naming stdout."""

    def writable(self):
        return True

    def fileno(self):
        return 1

    def write(self, data):
        try:
            return os.write(1, data)
        except BrokenPipeError:
            raise
        except OSError as err:
            reason = "closed, nothing can be printed" if err.errno == errno.EBADF else err.strerror
            raise OSError(err.errno, reason, "stdout") from None


def _name_stdout():
    """Replace the process's stdout (not a test runner's stand-in; None where it was closed) by
    one whose errors name it."""
    if sys.stdout is None:
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Stdout()), encoding="utf-8")
        return
    try:
        if sys.stdout.fileno() != 1:
            return
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout.flush()
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Stdout()), encoding=sys.stdout.encoding,
                                  errors=sys.stdout.errors,
                                  line_buffering=sys.stdout.line_buffering)


def _fail_on_stdout(err):
    """Exit for an OSError writing stdout: 141 quietly for a closed pipe, else 1 saying why."""
    _silence_stdout()
    if isinstance(err, BrokenPipeError):
        sys.exit(141)
    note(f"Error: {err.filename or 'stdout'}: {err.strerror}")
    sys.exit(1)


_CONTROLS = {code: f"\\x{code:02x}" for code in range(32)} | {10: "\\n", 13: "\\r", 9: "\\t"}


def _one_line(text):
    """`text` with its control characters (a newline in a file name) escaped: one line."""
    return text.translate(_CONTROLS)


def _interrupted(err):
    """Exit 128 + the signal's number, saying which (the cleanup has run as the error unwound)."""
    note(f"Interrupted ({err})")
    sys.exit(err.exit_code)


class SegcliGroup(click.Group):
    """Every command's errors as one line on stderr and an exit code (a traceback only with
    --debug): 1 for bad data and for what the system refuses (a full disk, a missing
    permission, too little memory), 128 + N for signal N (SIGINT, SIGTERM, or a closed
    stdout: 141, quietly)."""

    def main(self, args=None, **kwargs):
        if args is None:  # arguments from sys.argv: run as the program, not by a caller
            as_program()
        _name_stdout()
        try:
            return super().main(args, **kwargs)
        except OSError as err:  # printing --help or --version failed
            _fail_on_stdout(err)

    def parse_args(self, ctx, args):
        """Parse, printing --help or --version on the way: a closed stdout there exits as it
        does in a command (141 for a closed pipe), not as click's own handler would (1)."""
        try:
            return super().parse_args(ctx, args)
        except OSError as err:
            _fail_on_stdout(err)

    def invoke(self, ctx):
        with interruptible():
            try:
                result = super().invoke(ctx)
                sys.stdout.flush()
                return result
            except BrokenPipeError as err:
                _fail_on_stdout(err)
            except (DataError, OSError, Interrupted) as err:
                if ctx.meta.get("segcli.debug"):
                    raise
                if isinstance(err, Interrupted):
                    _interrupted(err)
                if isinstance(err, OSError):
                    err = f"{err.filename}: {err.strerror}" if err.filename else err
                    _silence_stdout()
                note(f"Error: {_one_line(for_user(str(err)))}")
                sys.exit(1)
            except Exception as err:  # a library's rendering of an Interrupted, or of no memory
                if ctx.meta.get("segcli.debug"):
                    raise
                if interrupting_signal() is not None:
                    _interrupted(Interrupted(interrupting_signal()))
                if memory_shortage(err) is None:
                    raise
                note(f"Error: {memory_shortage(err)}")
                sys.exit(1)


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


# The command modules, whose commands are added here.
from segcli.cli import (  # noqa: E402  (they use main)
    check,
    compute,
    curate,
    data,
    merge,
    neighbors,
    select,
)

for _module in (data, compute, neighbors, curate, select, merge, check):
    for _command in _module.COMMANDS:
        main.add_command(_command)
