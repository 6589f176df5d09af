"""Commands: reduce (one op per structure over a whole file), grad (its per-atom derivatives)
and ops (the table of ops): their options, parsed and handed to segcli.api, and what they
report."""

import sys

import click

from segcli.cli import common
from segcli.cli.common import cluster_options, note, structure_range, table, where_option
from segcli.registry import OPS

_PARAMS = {name: [op for op in OPS.values() if name in op.params]
           for name in dict.fromkeys(p for op in OPS.values() for p in op.params)}
"""Each static param of some op -> the ops that take it (an option of reduce)."""


def _op_table():
    """Each op with its fields and shapes, for the help of reduce."""
    rows = [(" ".join([op.name, *("FIELD", "FIELD2")[:len(op.inputs)]]),
             " ".join([*(i.describe() for i in op.inputs), "->", op.describe_output()]))
            for op in OPS.values()]
    return "\n".join(" " * 6 + line for line in table(rows))


def _with_op_lists(command):
    """The command with its docstring's {op_table} and {not_differentiable} filled in from
    the registry (before click reads the docstring)."""
    command.__doc__ = command.__doc__.replace("{op_table}", _op_table()).replace(
        "{not_differentiable}", ", ".join(n for n, op in OPS.items() if not op.differentiable))
    return command


def _param_options(command):
    """An option --NAME for each static param of some op (bincount's --length)."""
    for name, ops in reversed(_PARAMS.items()):
        defaults = ", ".join(f"{op.params[name]} for {op.name}" for op in ops)
        command = click.option(f"--{name}", type=click.IntRange(min=1), metavar="N",
                               help=f"The {name} of {', '.join(op.name for op in ops)} "
                                    f"(default {defaults}).")(command)
    return command


def _op_list(ctx, param, words):
    """OP [FIELD [FIELD2]] [+ OP [FIELD [FIELD2]] ...] as [(op, field, ...), ...]."""
    groups = [[]]
    for word in words:
        if word == "+":
            groups.append([])
        else:
            groups[-1].append(word)
    if not all(groups):
        raise click.BadParameter("'+' joins two ops: OP [FIELD...] + OP [FIELD...]")
    return [tuple(group) for group in groups]


def output_options(*names):
    """The options `names` (see _OUTPUT_OPTIONS) of the commands that compute per structure."""
    def decorate(command):
        for name in reversed(names):
            command = _OUTPUT_OPTIONS[name](command)
        return command

    return decorate


_OUTPUT_OPTIONS = {
    "output": click.option(
        "-o", "--output", type=click.Path(dir_okay=False), callback=common.output_name,
        help="Write a new file instead of printing to stdout: segcli HDF5 (.h5, .hdf5) holding "
             "/structures/n_atoms and /results/NAME, or the table stdout would get (.csv, "
             ".json, .jsonl, .npy)."),
    "in_place": click.option(
        "--in-place", is_flag=True,
        help="Add /results/NAME to FILE itself (a segcli HDF5 file); FILE is replaced only "
             "once the result is complete."),
    "fmt": click.option(
        "--format", "fmt", type=click.Choice(["csv", "json", "npy"]),
        help="Stdout format (default csv): csv with a header line, json (one object per line) "
             "or npy (binary)."),
    "name": click.option("--name", callback=common.result_name,
                         help="Result name (default OP_FIELD[_FIELD2])."),
    "force": click.option("--force", is_flag=True,
                          help="Overwrite an existing output file or result."),
    "structures": click.option(
        "--structures", callback=structure_range, metavar="START:STOP",
        help="Only these structures, a Python slice: START:STOP, -5: (the last five), :10 or "
             "one index (default: all; not with --in-place)."),
    "chunk_atoms": click.option(
        "--chunk-atoms", type=common.CHUNK_ATOMS,
        help="Atoms read and computed at a time (whole structures; default 2 Mi = 2097152): "
             "bounds memory."),
    "device": click.option(
        "--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto",
        show_default=True, help="Where to compute (auto: a GPU when JAX sees one)."),
    "precision": click.option(
        "--precision", type=click.Choice(["float32", "float64"]), default="float64",
        show_default=True, help="Floating-point type of the computation and the results."),
    "quiet": click.option("-q", "--quiet", is_flag=True,
                          help="Print nothing but errors and results."),
    "strict": click.option(
        "--strict", is_flag=True,
        help="Refuse (exit 1) structures whose matrix is singular or zero, such as a "
             "cell-less molecule's cell for matvec, rather than warn."),
}


def _shared_options(command):
    """The options reduce and grad share (SPEC §3)."""
    command = output_options(*_OUTPUT_OPTIONS)(command)
    return where_option(cluster_options(command))


def check_output_usage(output, in_place, fmt):
    """UsageError for --format with a file to write, or npy on a terminal."""
    if fmt and (output or in_place):
        raise click.UsageError("--format is for stdout; -o writes the format its name says "
                               "and --in-place HDF5")
    if fmt == "npy" and sys.stdout.isatty():
        raise click.UsageError("--format npy writes binary data; redirect stdout to a file")


def run(function, file, *args, output, in_place, fmt, quiet, **options):
    """`function` (a function of segcli.api) on FILE with the command's options, its results
    printed on stdout unless -o or --in-place says where; UsageError for a bad argument."""
    check_output_usage(output, in_place, fmt)
    into = output if output or in_place else sys.stdout.buffer
    with common.usage_errors(**{name: f"--{name}" for name in _PARAMS}):
        return function(file, *args, output=into, in_place=in_place, format=fmt,
                        progress=not quiet, notify=(lambda _: None) if quiet else note,
                        input_format=common.input_format(), **options)


def report(results, file, where):
    """Say on stderr which results went into which file (-o, --in-place): nothing for stdout."""
    from segcli.io.sinks import SINKS

    if results.path is None:
        return
    written = (", ".join(results.columns.values()) if SINKS[results.format].table
               else ", ".join(f"/results/{d}" for d in results))
    chosen = f" selected of {results.selection.stop - results.selection.start}" if where else ""
    note(f"{file if results.format == 'in_place' else results.path}: {written} "
         f"({len(results.n_atoms)} structures{chosen}, {int(results.n_atoms.sum())} atoms)")


_OPS_ARGUMENT = click.argument("ops", nargs=-1, required=True, callback=_op_list,
                               metavar="OP [FIELD [FIELD2]] [+ OP ...]")


@click.command(short_help="Run ops per structure over a file.")
@click.argument("file")
@common.input_format_option("--input-format")
@_OPS_ARGUMENT
@_shared_options
@_param_options
@_with_op_lists
def reduce(file, ops, **options):
    """Run OP on FIELD [FIELD2] of every structure of FILE; several ops joined by `+` run in
    one pass over the file (each result named OP_FIELD[_FIELD2]).

    \b
    OP, its fields and their shapes (N rows per atom, S per structure, *F any
    trailing shape, one per op; what each computes: `segcli ops`):
{op_table}

    FILE is a segcli HDF5 file or any file ASE reads, or many files read as one batch: a
    directory, a quoted glob pattern ('shards/*.h5') or @LIST (see `segcli info --help`);
    csv output then has the columns source,source_index after structure, and -o files say
    where each structure came from. It is read in chunks of whole
    structures (--chunk-atoms), the next chunk while this one computes, so files larger than
    memory work. Results go to stdout (csv: `structure` first, `structure,atom` for per-atom
    results, vector entries as NAME_0, NAME_1, ...), to a new file (-o) or into FILE
    (--in-place); see `segcli ops`. Fields holding NaN are refused; a structure that lacks a
    field (`segcli info`: present in K of S) gets NaN (csv: empty cells). --shard runs one of N
    ranges of structures (join the parts with `segcli merge`), --scheduler all of them on a
    Dask cluster; either gives the bits of one run. --where computes only the structures
    that `segcli select --where` would keep: stdout gets their rows (under their numbers in
    FILE), -o OUT.h5 and --in-place NaN in the rows of the others (integer results then as
    float64).

    \b
    Example:
      segcli reduce sample_data/metals.h5 rms_norm forces | sort -t, -k2 -g | tail -3
      segcli reduce sample_data/metals.h5 matvec scaled_positions cell -o positions.h5
      segcli reduce sample_data/metals.h5 rms_norm forces + max_norm forces + count
      segcli reduce batch.h5 dot forces velocities --in-place --name power
      segcli reduce data.h5 rms_norm forces --shard auto -o 'parts/r-{shard}.h5'
      segcli reduce data.h5 rms_norm forces --scheduler local:4 -o rms.h5
      segcli reduce sample_data/metals.h5 bincount numbers -o composition.h5
      segcli reduce data.h5 rms_norm forces --where 'config_type == bulk' --where 'energy < 0'
    """
    from segcli import api

    params = {name: options.pop(name) for name in _PARAMS}
    results = run(api.reduce, file, ops, **options,
                  **{name: value for name, value in params.items() if value is not None})
    if not options["quiet"]:
        report(results, file, options["where"])


@click.command(short_help="Per-atom gradients of ops over a file.")
@click.argument("file")
@common.input_format_option("--input-format")
@_OPS_ARGUMENT
@click.option("--weights", metavar="FIELD",
              help="Per-structure scalar field w_s weighting each structure (default: 1).")
@click.option("--order", type=click.IntRange(1, 2), default=1, show_default=True,
              help="1: the gradient; 2: the Hessian-vector product along --direction.")
@click.option("--direction", metavar="FIELD",
              help="Per-atom field, the shape of the differentiated fields (--order 2).")
@_shared_options
@_with_op_lists
def grad(file, ops, weights, order, direction, **options):
    """Per-atom derivatives of Σ_s w_s · OP(FIELD [FIELD2])_s over the structures of FILE.

    Writes, for each per-atom input field F, the gradient of the weighted sum (over every
    entry of each structure's result) with respect to F, as /results/NAME/d_F with -o or
    --in-place, or as columns d_F_0, d_F_1, ... on stdout (npy: one array, or a structured
    array with a field per d_F). Per-structure inputs (mul's scalar, matvec's matrix) are
    held fixed. With --order 2 --direction V, writes instead the Hessian-vector product: the
    derivative of that gradient as every per-atom input moves along V. OPs and fields are
    as for `segcli reduce`, several joined by `+` (columns then OP_FIELD_d_F_0, ...); not
    differentiable: {not_differentiable}. FILE may be many files, and --where selects
    structures, as for `segcli reduce`.

    \b
    Example:
      segcli grad sample_data/metals.h5 rms_norm forces -o grad.h5
      segcli grad sample_data/metals.h5 dot forces positions --weights energy
      segcli grad sample_data/metals.h5 max_norm forces --order 2 --direction momenta
      segcli grad data.h5 rms_norm forces --where 'config_type == bulk' -o grad.h5
    """
    from segcli import api

    results = run(api.grad, file, ops, order=order, weights=weights, direction=direction,
                  **options)
    if not options["quiet"]:
        report(results, file, options["where"])


@click.command(short_help="List the ops, their inputs and outputs.")
def ops():
    """List the ops: their inputs (per atom: N rows; per structure: S rows) and output.

    \b
    Example:
      segcli ops
    """
    rows = [("op", "inputs", "output", "derivatives", "")] + [
        (op.name, " ".join(i.describe() for i in op.inputs) or "-", op.describe_output(),
         "yes" if op.differentiable else "no", op.summary) for op in OPS.values()]
    click.echo("\n".join(table(rows)))


COMMANDS = [reduce, grad, ops]
