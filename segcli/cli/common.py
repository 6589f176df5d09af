"""Helpers shared by the commands: option parsing, device choice, progress bars."""

import atexit
import contextlib
import gc
import os
import sys

import click

from segcli import cache_directory, keep_freed_buffers
from segcli.tables import table  # noqa: F401  (the commands' tables)


def result_name(ctx, param, name):
    """Click callback: a result name, NAME or GROUP/NAME, none of its parts empty, `.`, `..`
    or holding a NUL."""
    if name is not None and (not name or any(part in ("", ".", "..") or "\0" in part
                                             for part in name.split("/"))):
        raise click.BadParameter(f"{name!r} is not a result name (NAME or GROUP/NAME)")
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


def names_hdf5(output):
    """Whether the file name `output` (None: none) is a segcli HDF5 file's (see
    segcli.api.curate.names_hdf5)."""
    from segcli.api.curate import names_hdf5 as hdf5

    return hdf5(output)

def hdf5_output(ctx, param, output):
    """Click callback: an -o that names a segcli HDF5 file (see names_hdf5)."""
    output = output_name(ctx, param, output)
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
    """DataError, before any computation, when -o names a file in a directory that is missing
    or not writable (the writer would find it only at the end of the setup)."""
    from segcli.errors import DataError

    if output is None:
        return
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        reason = "Not a directory" if os.path.exists(directory) else "No such file or directory"
        raise DataError(f"{output}: cannot write there ({reason})")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(f"{output}: cannot write there (Permission denied)")


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
    """segcli.curate.selection.where_selection, its note on stderr (unless `quiet`)."""
    from segcli.curate.selection import where_selection as selected

    with notes(quiet):
        return selected(batch, file, where, structures, needed)


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
    """The files FILE stands for (segcli.api.curate.in_place_paths: a usage error where
    --in-place cannot store results)."""
    from segcli.api.curate import in_place_paths

    with usage_errors():
        return in_place_paths(file, in_place)

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


@contextlib.contextmanager
def usage_errors():
    """The block's segcli.errors.ArgumentError as click's usage error (exit 2), its message
    naming the options as the command line spells them."""
    from segcli.errors import ArgumentError

    try:
        yield
    except ArgumentError as err:
        raise click.UsageError(err.for_command()) from None


to_ase_units_option = click.option(
    "--to-ase-units", is_flag=True,
    help="Convert every field of known units to ASE's (eV, Ang, eV/Ang, eV/Ang^3), and a "
         "gradient field (dft_total_gradient) into forces, its negative.")
"""The option of the commands that write fields (convert, select)."""


def input_format():
    """The input format the running command was given (see input_format_option), or None."""
    ctx = click.get_current_context(silent=True)
    return None if ctx is None else ctx.meta.get("segcli.input_format")


def read_inputs(paths, file, in_place=False):
    """The batch of `paths` in the format input_format forces (segcli.api.curate.read_inputs:
    with --in-place, read under the lock of the file the results go into)."""
    from segcli.api.curate import read_inputs as read

    return read(paths, file, in_place, input_format())

def refuse_output_among_inputs(output, inputs, hint):
    """UsageError when the file -o names is one of the inputs (`hint` says what to do)."""
    from segcli.api.curate import refuse_output_among_inputs as refuse

    with usage_errors():
        refuse(output, inputs, hint)

def refuse_structures_in_place(in_place, structures):
    """UsageError when --in-place (a result for every structure) meets --structures."""
    from segcli.api.curate import refuse_structures_in_place as refuse

    with usage_errors():
        refuse(in_place, structures)


# Whether this process is the segcli program, which exits after one command (see as_program),
# rather than a caller of the commands such as a test runner.
_program = False


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
    global _program
    _program = True
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


@contextlib.contextmanager
def _loading():
    """In the program, no cyclic garbage collection while the block imports, and what it made
    kept out of later collections: the modules of JAX and Warp stay for the whole run, and
    full collections traversing their objects take 0.1 s of start-up."""
    if not _program:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _use_compilation_cache(jax):
    """Keep every compiled program, however small, in $SEGCLI_COMPILATION_CACHE (by default
    $XDG_CACHE_HOME/segcli/jax, that is ~/.cache/segcli/jax; `off`: nowhere), so that a later
    run skips XLA's compilation; unless JAX was given a cache of its own
    (JAX_COMPILATION_CACHE_DIR), and silently not where the directory cannot be written."""
    path = os.environ.get("SEGCLI_COMPILATION_CACHE") or os.path.join(cache_directory(), "jax")
    if path == "off" or jax.config.jax_compilation_cache_dir is not None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    if os.access(path, os.W_OK | os.X_OK):
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _start_gpu_backend(jax):
    """Start JAX's GPU backend (where there is one) while Warp imports: the backend's start
    waits on the CUDA driver, not on Python, so the two overlap (on an H200 VM, 0.5 s and
    1.0 s, which took 1.5 s one after the other)."""
    import threading

    def start():
        with contextlib.suppress(Exception):  # no GPU: the caller asks again and is told
            jax.devices("gpu")

    starting = threading.Thread(target=start, name="segcli-gpu-start", daemon=True)
    starting.start()
    with _loading():
        import warp  # noqa: F401  (what the kernels need next)
    starting.join()


BACKEND_ADDRESS_SPACE = 1_800_000_000
"""Bytes of address space that JAX and Warp take as they start (1.65 GB on a 2-core CPU
machine): under a tighter limit (ulimit -v) XLA aborts the process when it cannot create its
threads, rather than raise."""


def _check_address_space():
    """DataError when the limit on address space leaves too little for JAX and Warp."""
    from segcli.errors import DataError
    from segcli.io.core import address_space_left

    left = address_space_left()
    if left is not None and left < BACKEND_ADDRESS_SPACE:
        raise DataError(f"out of memory: JAX and Warp need about {BACKEND_ADDRESS_SPACE} bytes "
                        f"of address space, and the limit on memory (ulimit -v) leaves {left}")


def device(choice):
    """The JAX device for --device auto|cpu|gpu (auto: a GPU when JAX sees one).

    Called before JAX starts, it leaves GPU memory to Warp's own allocations (no
    preallocation) and lets XLA capture even a small program, such as one chunk's kernels,
    into one CUDA graph; in the program (see `as_program`), compiled programs are kept across
    runs, and XLA has a CPU device for each thread segcli uses (threads.count(): the cores,
    or SEGCLI_THREADS; up to engine.HOST_DEVICES), which a run's chunks take turns at."""
    from segcli import threads
    from segcli.engine import HOST_DEVICES, runs_on

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_graph_min_graph_size" not in flags:
        flags = f"{flags} --xla_gpu_graph_min_graph_size=1"
    if _program and "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={min(threads.count(), HOST_DEVICES)}"
    os.environ["XLA_FLAGS"] = flags.strip()
    _check_address_space()
    with _loading():
        import jax
    if _program:
        _use_compilation_cache(jax)
    if choice != "cpu":
        _start_gpu_backend(jax)
    if choice == "cpu":
        target = jax.devices("cpu")[0]
    else:
        try:
            target = jax.devices("gpu")[0]
        except RuntimeError:
            if choice == "gpu":
                raise click.BadParameter("no GPU is visible to JAX", param_hint="--device") from None
            target = jax.devices("cpu")[0]
    if not runs_on(target):
        raise click.BadParameter("this Warp installation has no CPU backend (warp-clang), so its "
                                 "kernels run on a GPU only; choose --device gpu",
                                 param_hint="--device")
    return target


def device_label(device):
    """How every command names a JAX device, in --device's words: `cpu`, or e.g.
    `gpu:0 (NVIDIA H200)`."""
    if device.platform == "cpu":
        return "cpu"
    return f"{device.platform}:{device.id} ({device.device_kind})"


def stderr_is_terminal():
    """Whether stderr is open and a terminal (see segcli.api.progress)."""
    from segcli.api.progress import stderr_is_terminal as is_terminal

    return is_terminal()


def progress(enabled, label, total=None, unit="structure"):
    """segcli.api.progress.bar: the command's progress bar on stderr (when `enabled` and stderr
    is a terminal), else None."""
    from segcli.api.progress import bar

    return bar(enabled, label, total, unit)


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
    """-o for shard (I, N) (see segcli.api.curate.shard_output)."""
    from segcli.api.curate import shard_output as part

    with usage_errors():
        return part(output, shard)

def selection(batch, file, structures):
    """segcli.curate.selection.selection, for the commands that import it from here."""
    from segcli.curate.selection import selection as selected

    return selected(batch, file, structures)


def shard_selection(batch, file, structures, shard):
    """segcli.curate.selection.shard_selection, for the commands that import it from here."""
    from segcli.curate.selection import shard_selection as selected

    return selected(batch, file, structures, shard)


def check_cluster_usage(shard, scheduler, in_place):
    """UsageError for --shard with --scheduler or --in-place."""
    from segcli.api.curate import check_cluster_usage as check

    with usage_errors():
        check(shard, scheduler, in_place)


@contextlib.contextmanager
def on_cluster(scheduler):
    """A dask.distributed Client for --scheduler (None without it; see
    segcli.api.curate.on_cluster), closed afterwards; a missing cluster extra is a usage
    error."""
    from segcli.api.curate import on_cluster as cluster

    with contextlib.ExitStack() as stack:
        with usage_errors():
            client = stack.enter_context(cluster(scheduler))
        yield client
