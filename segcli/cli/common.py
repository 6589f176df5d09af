"""Helpers shared by the commands: option parsing, device choice, progress bars."""

import atexit
import contextlib
import gc
import os
import sys

import click

from segcli import keep_freed_buffers
from segcli.devices import device_label, mark_program  # noqa: F401  (the commands' too)
from segcli.errors import ArgumentError
from segcli.progress import progress, stderr_is_terminal  # noqa: F401  (the commands' too)
from segcli.tables import table  # noqa: F401  (the commands' tables)


def result_name(ctx, param, name):
    """Click callback: a result name (see segcli.api.common.check_result_name)."""
    from segcli.api import common

    if name is not None:
        try:
            common.check_result_name(name)
        except ArgumentError as err:
            raise click.BadParameter(err.for_command({"name": "--name"}).removeprefix("--name: ")) \
                from None
    return name


def output_name(ctx, param, output):
    """Click callback: an -o that names a file (not an empty name, nor a directory's, nor `-`,
    which would make a file that `-` as FILE never reads)."""
    if output is not None and (not output or output.endswith(os.sep)):
        raise click.BadParameter(f"{output!r} names no file")
    if output == "-":
        raise click.BadParameter("'-' names no file (leave -o out to print; ./- names a file "
                                 "called -)")
    return output


def hdf5_output(ctx, param, output):
    """Click callback: an -o that names a segcli HDF5 file (see names_hdf5)."""
    output = output_name(ctx, param, output)
    from segcli.api.common import names_hdf5

    if not names_hdf5(output):
        raise click.BadParameter(f"{output}: {ctx.command.name} writes segcli HDF5; name it "
                                 ".h5 or .hdf5")
    return output


CHUNK_ATOMS = click.IntRange(min=1, max=1 << 62)
"""--chunk-atoms: at least one atom, at most what a chunk's atom count can hold."""


def parse_pair(text, name, allow_open):
    """(a, b) from "A:B"; with allow_open, A defaults to 0 and B to None (the end)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise click.BadParameter(f"expected {name}, got {text!r}")
    try:
        values = [int(part) if part.strip() or not allow_open else None for part in parts]
    except ValueError:
        raise click.BadParameter(f"expected {name} (integers), got {text!r}") from None
    start, stop = values
    if any(value is not None and value < 0 for value in values):
        raise click.BadParameter(f"expected {name} (non-negative integers), got {text!r}")
    return start or 0, stop


def structure_range(ctx, param, text):
    """Click callback: --structures as a Python slice of the structures, START:STOP (either
    may be left out, and a negative one counts from the end: -5: is the last five) or one
    index I (I:I+1)."""
    if text is None:
        return None
    parts = text.split(":")
    try:
        values = [int(part) if part.strip() else None for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or values == [None]:
        raise click.BadParameter(f"expected START:STOP or an index (integers, as a Python slice: "
                                 f"-5:, :10, 7), got {text!r}")
    if len(values) == 1:
        return slice(values[0], values[0] + 1 or None)
    start, stop = values
    if start is not None and stop is not None and (start < 0) == (stop < 0) and stop <= start:
        raise click.BadParameter(f"STOP must be greater than START, got {text!r}")
    return slice(start, stop)


def check_output_place(output):
    """See segcli.api.common.check_output_place."""
    from segcli.api import common

    common.check_output_place(output)


def where_conditions(ctx, param, texts):
    """Click callback: the segcli.curate.selection.Condition of each --where 'NAME OP VALUE'."""
    from segcli.curate.selection import parse_condition

    try:
        return tuple(parse_condition(text) for text in texts)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def where_option(command):
    """--where 'NAME OP VALUE' (repeatable), the conditions of `segcli select`."""
    return click.option(
        "--where", multiple=True, metavar="'NAME OP VALUE'", callback=where_conditions,
        help="Only the structures where a per-structure field or result compares true, as "
             "`segcli select --where` chooses them (OP: < <= > >= == !=). Repeat it: all "
             "must hold.")(command)


def where_selection(batch, file, where, structures, needed=False, quiet=False):
    """See segcli.api.common.where_selection: what it is told goes to stderr (unless
    `quiet`)."""
    from segcli.api import common

    return common.where_selection(batch, file, where, structures, needed,
                                  None if quiet else note)


@contextlib.contextmanager
def notes(quiet=False):
    """The segcli.errors.Note warnings of the block told on stderr as they come (see `note`),
    none with `quiet`; other warnings as Python shows them."""
    import warnings

    from segcli.errors import Note

    with warnings.catch_warnings():
        warnings.simplefilter("always", Note)
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if not issubclass(category, Note):
                shown(message, category, *args, **kwargs)
            elif not quiet:
                note(str(message))

        warnings.showwarning = show
        yield


def input_paths(file, in_place=False):
    """The files FILE stands for (see segcli.api.common.input_paths)."""
    from segcli.api import common

    with usage_errors():
        return common.input_paths(file, in_place)


def _remember_format(ctx, param, name):
    from segcli.errors import DataError
    from segcli.io.formats import named

    if name is not None:
        try:
            named(name)
        except DataError as err:
            raise click.BadParameter(str(err).removeprefix("--input-format ")) from None
        ctx.meta["segcli.input_format"] = name


def input_format_option(*names):
    """--input-format NAME (or `names`), which forces the format of every input file, whatever
    its content (see input_format)."""
    return click.option(*(names or ("--input-format",)), metavar="NAME",
                        expose_value=False, callback=_remember_format,
                        help="Read every input as format NAME, whatever its content: segcli, "
                             "conformers, extxyz, db, json, aselmdb, or any format ASE reads "
                             "(vasp-out, lammps-data, ...).")


class _OutputFormat(click.Choice):
    """--format's choices; a name of an input format is told to go to --input-format."""

    def convert(self, value, param, ctx):
        from segcli.errors import DataError
        from segcli.io.formats import named

        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as err:
            try:
                named(value)
            except DataError:
                raise err from None
            self.fail(f"{value!r} is not one of {', '.join(self.choices)}: --format is what the "
                      f"command prints; to read the input as {value}, give --input-format "
                      f"{value}", param, ctx)


def output_format_options(*choices):
    """--format CHOICE (default the first), what the command prints, and --json, the same as
    --format json; the command takes them as `fmt` and `as_json`."""
    def decorate(command):
        command = click.option("--json", "as_json", is_flag=True,
                               help="The same as --format json.")(command)
        return click.option("--format", "fmt", type=_OutputFormat(choices), default=choices[0],
                            show_default=True,
                            help=f"What to print: {' or '.join(choices)} (one JSON object).")(
            command)
    return decorate


to_ase_units_option = click.option(
    "--to-ase-units", is_flag=True,
    help="Convert every field of known units to ASE's (eV, Ang, eV/Ang, eV/Ang^3), and a "
         "gradient field (dft_total_gradient) into forces, its negative.")
"""The option of the commands that write fields (convert, select)."""


def note_units_left(output, left):
    """Name on stderr the fields (name -> units) that --to-ase-units left as they are."""
    for name, unit in left.items():
        note(f"{output}: --to-ase-units left field '{name}' as it is: its units, {unit!r}, are "
             "not ones segcli knows")


def input_format():
    """The input format the running command was given (see input_format_option), or None."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else ctx.meta.get("segcli.input_format")


def read_inputs(paths, file, in_place=False):
    """The batch of `paths` (see segcli.api.common.read_inputs), in the format input_format
    forces."""
    from segcli.api import common

    return common.read_inputs(paths, file, in_place, input_format())


def refuse_output_among_inputs(output, inputs, hint):
    """UsageError when the file -o names is one of the inputs (`hint` says what to do)."""
    from segcli.api import common

    with usage_errors():
        common.refuse_output_among_inputs(output, inputs, hint)


def refuse_structures_in_place(in_place, structures):
    """UsageError when --in-place (a result for every structure) meets --structures."""
    from segcli.api import common

    with usage_errors():
        common.refuse_structures_in_place(in_place, structures)


def selection(batch, file, structures):
    """See segcli.api.common.selection."""
    from segcli.api import common

    return common.selection(batch, file, structures)


def as_program():
    """Mark this process as the segcli program: it then keeps compiled programs across runs
    (see `device`) and freed blocks of memory for reuse (segcli.keep_freed_buffers), and at
    exit the cyclic garbage collector leaves what remains to the operating system instead of
    traversing it (0.25 s once JAX and Warp are loaded; see _leave_to_the_system). A closed stdin, stdout or stderr
    (`<&-`, `>&-`, `2>&-`) is given /dev/null opened the wrong way for stdin and stdout
    (reading or writing them fails as on a closed one) and the right way for stderr
    (messages are lost, see `note`): no file the command opens takes the place of one and
    receives what was meant for it. A file name that is not UTF-8 (its bytes held
    as surrogates) prints as its own bytes on stdout, even where stdout's encoding was made
    strict (PYTHONIOENCODING=utf-8)."""
    mark_program()
    keep_freed_buffers()
    atexit.register(_leave_to_the_system)
    if sys.stdout is not None and sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="surrogateescape")
    for fd, mode in ((0, os.O_WRONLY), (1, os.O_RDONLY), (2, os.O_WRONLY)):
        if not _is_open(fd):
            null = os.open(os.devnull, mode)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _leave_to_the_system():
    """At exit, leave what remains to the operating system (gc.freeze), once the cycles are
    collected where a virtual HDF5 dataset was read: HDF5's own exit handler would close what
    such cycles hold (a virtual layout's property lists) through callbacks into a finalized
    Python (SIGSEGV)."""
    hdf5 = sys.modules.get("segcli.io.hdf5")
    if hdf5 is not None and hdf5.VIRTUAL_READ:
        gc.collect()
    gc.freeze()


def _is_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def note(message):
    """Tell the user `message` on stderr (a stream's temporary copy named as the user named the
    stream); the command's work never depends on it: a closed or full stderr (`2>&-`,
    `2>/dev/full`) loses the message, not the result."""
    from segcli.errors import for_user

    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            click.echo(for_user(message), file=sys.stderr)


def device(choice):
    """The JAX device for --device (see segcli.devices.device); a usage error where there is
    none such."""
    from segcli.devices import device as chosen

    try:
        return chosen(choice)
    except ArgumentError as err:
        raise click.BadParameter(err.for_command({"device": "--device"}).removeprefix("--device: "),
                                 param_hint="--device") from None



def _shard(ctx, param, text):
    """Click callback: (I, N) from --shard I/N or auto (see segcli.shards.parse_shard)."""
    if text is None:
        return None
    from segcli.shards import parse_shard

    try:
        return parse_shard(text)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _scheduler(ctx, param, text):
    """Click callback: ADDRESS ([SCHEME://]HOST:PORT), local:K (K from 1 to 4 per CPU core) or
    local:gpus from --scheduler (or DASK_SCHEDULER_ADDRESS). For local:..., the server that
    forks the workers starts now (see segcli.cluster.start_worker_server)."""
    if not text:
        return text
    most = 4 * (os.cpu_count() or 1)
    if text.startswith("local:"):
        count = text.split(":", 1)[1]
        if count != "gpus" and not (count.isdigit() and 1 <= int(count) <= most):
            raise click.BadParameter(f"expected ADDRESS, local:K (K workers, 1 <= K <= {most}) "
                                     f"or local:gpus, got {text!r}")
        from segcli.cluster import start_worker_server

        start_worker_server()
    elif not _scheduler_address(text):
        raise click.BadParameter(f"expected ADDRESS ([SCHEME://]HOST:PORT, e.g. "
                                 f"tcp://10.0.0.5:8786), local:K or local:gpus, got {text!r}")
    return text


def _scheduler_address(text):
    """Whether `text` can name a dask scheduler: [SCHEME://]HOST:PORT, or inproc://..."""
    from urllib.parse import urlsplit

    try:
        url = urlsplit(text if "://" in text else f"tcp://{text}")
        return url.scheme == "inproc" or (bool(url.hostname) and url.port is not None)
    except ValueError:  # a port out of range, unbalanced brackets
        return False


def _threads(ctx, param, value):
    """--threads: set for the command, and unset when it ends."""
    if value is not None:
        from segcli import threads

        threads.set_count(value)
        ctx.call_on_close(lambda: threads.set_count(None))
    return value


class EnvironmentOption(click.Option):
    """An option that may come from an environment variable, whose bad value is named as that
    variable's when it came from there (not as the option, which was not given)."""

    def process_value(self, ctx, value):
        try:
            return super().process_value(ctx, value)
        except click.BadParameter as err:
            if ctx.get_parameter_source(self.name) is not click.core.ParameterSource.ENVIRONMENT:
                raise
            raise click.BadParameter(err.message, ctx, param_hint=f"'{self.opts[0]}' (from "
                                     f"{self.envvar})") from None


def cluster_options(command):
    """--shard, --scheduler (SPEC §3b) and --threads, for reduce, grad and stats."""
    command = click.option(
        "--threads", cls=EnvironmentOption, type=click.IntRange(1), envvar="SEGCLI_THREADS",
        callback=_threads,
        expose_value=False, metavar="K",
        help="Threads that read (and inflate) an HDF5 file's chunks at once (default: the "
             "cores, at most 8; a local cluster's worker: its share). Also SEGCLI_THREADS.")(
        command)
    command = click.option(
        "--scheduler", cls=EnvironmentOption, envvar="DASK_SCHEDULER_ADDRESS",
        metavar="ADDRESS|local:K|local:gpus",
        callback=_scheduler,
        help="Run the job as shards on a dask.distributed cluster: its scheduler's address, "
             "local:K to start K worker processes here, or local:gpus for one worker per "
             "visible GPU; the output is the same as without. Also DASK_SCHEDULER_ADDRESS.")(
        command)
    return click.option(
        "--shard", callback=_shard, metavar="I/N|auto",
        help="Do only range I of the N ranges of whole structures with nearly equal atom "
             "counts (auto: from a SLURM or SGE job array, srun, Open MPI or PMI); "
             "{shard} in -o becomes I. Join the parts with `segcli merge`.")(command)


def shard_output(output, shard):
    """-o for shard (I, N) (see segcli.api.common.shard_output)."""
    from segcli.api import common

    with usage_errors():
        return common.shard_output(output, shard)


def shard_selection(batch, file, structures, shard):
    """See segcli.api.common.shard_selection."""
    from segcli.api import common

    return common.shard_selection(batch, file, structures, shard)


def check_cluster_usage(shard, scheduler, in_place):
    """UsageError for --shard with --scheduler or --in-place."""
    from segcli.api import common

    with usage_errors():
        common.check_cluster_usage(shard, scheduler, in_place)


@contextlib.contextmanager
def on_cluster(scheduler):
    """A dask.distributed Client for --scheduler (see segcli.api.common.on_cluster)."""
    from segcli.api import common

    with usage_errors(), common.on_cluster(scheduler) as client:
        yield client


OPTIONS = {"output": "-o", "in_place": "--in-place", "inputs": "FILE", "name": "--name",
           "structures": "--structures", "shard": "--shard", "scheduler": "--scheduler",
           "where": "--where", "device": "--device", "precision": "--precision",
           "chunk_atoms": "--chunk-atoms", "format": "--format", "order": "--order",
           "direction": "--direction", "weights": "--weights", "op": "OP", "fields": "FIELD",
           "cutoff": "--cutoff", "histogram": "--histogram", "per_atom": "--per-atom"}
"""How the command line names the arguments of segcli's functions (see ArgumentError)."""


@contextlib.contextmanager
def usage_errors(**names):
    """The block's ArgumentError as a usage error (exit 2), naming each argument as OPTIONS
    (and `names`, argument -> option, for a command's own) does."""
    try:
        yield
    except ArgumentError as err:
        raise click.UsageError(err.for_command({**OPTIONS, **names})) from None
