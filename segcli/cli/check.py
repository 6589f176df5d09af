"""Command: gradcheck (values and derivatives of every op against finite differences and a
reference): segcli.check_ops with the command's options, its report printed."""

import click

from segcli.cli import common
from segcli.cli.common import note, parse_pair, structure_range
from segcli.registry import OPS

MAX_ORDER = 8
"""The highest --order, as segcli.api.check.MAX_ORDER (not imported: it loads NumPy)."""


def _argument(name, option, check, value):
    """`check(value)`, its ArgumentError as click's BadParameter of `option`."""
    from segcli.errors import ArgumentError

    try:
        return check(value)
    except ArgumentError as err:
        raise click.BadParameter(err.for_command({name: option}).removeprefix(f"{option}: ")) \
            from None


def _random_size(ctx, param, text):
    if text is None:
        return None
    from segcli.api.check import check_random_size

    size = parse_pair(text, "ATOMS:STRUCTURES", allow_open=False)
    _argument("random", "--random", check_random_size, size)
    return size


def _op_names(ctx, param, text):
    if text is None:
        return None
    from segcli.api.compute import op_spec

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise click.BadParameter(f"unknown op {text!r} (choose from {', '.join(OPS)})")
    for name in names:
        _argument("op", "--op", op_spec, name)
    return names


@click.command(short_help="Check the ops' values and derivatives.")
@click.argument("file", required=False)
@common.input_format_option()
@click.option("--op", "op_names", callback=_op_names, metavar="OP[,OP...]",
              help=f"Ops to check (default: all): {', '.join(OPS)}.")
@click.option("--order", type=click.IntRange(1, MAX_ORDER), default=2, show_default=True,
              help="Highest derivative order checked.")
@click.option("--structures", callback=structure_range, metavar="START:STOP",
              help="Structures of FILE to check, a Python slice (-5:, :10, 7; default "
                   "0:16, which bounds the cost).")
@click.option("--field", metavar="NAME",
              help="Per-atom field of FILE for the first input (default: forces, else positions; "
                   "scaled_positions for matvec).")
@click.option("--random", "random_size", callback=_random_size, metavar="ATOMS:STRUCTURES",
              help="Without FILE: random data of this size (default 64:8).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto",
              show_default=True, help="Where to compute (auto: a GPU when JAX sees one).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True,
              help="Seed of the random directions and data.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (every check) instead of the table.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors and failed checks.")
@click.pass_context
def gradcheck(ctx, file, op_names, order, structures, field, random_size, device, seed, as_json,
              quiet):
    """Check the values and derivatives of the ops on FILE's data or on random data.

    For each op and each order up to --order, JVP and VJP products (of the op and of its
    directional derivatives) are compared, in float64, with central finite differences
    along random directions, and values, JVPs and VJPs with segcli.reference, an independent
    pure-JAX implementation. One row per op and order shows the worst check: its error,
    tolerance and result (order 0: values). Exit status 0 only if every check passes.

    FILE's own fields and structures are used: forces (else positions; --field picks
    another) for an op's first per-atom input, positions for a second, scaled_positions
    beside a (S, 3, 3) cell, energy (else another per-structure scalar) for a per-structure
    scalar, numbers for labels; ops whose fields FILE lacks are skipped, or an error if
    named in --op. Only --structures (default 0:16, about 40 s on two CPU cores for the
    bundled metals.h5 at order 2) are read. Structures where an op is not differentiable
    (zero norms or spread, tied extremes) are left out of the finite differences but still
    compared with the reference; those where its value is not finite (the max of an empty
    one, or of NaN data) are left out of both. Without FILE, random data of
    --random atoms and structures, with sorted ids and some empty structures.

    \b
    Example:
      segcli gradcheck sample_data/metals.h5 --order 2
      segcli gradcheck --random 256:16 --op rms_norm,max_norm --order 3 --json
    """
    from segcli.api.check import check_ops
    from segcli.io.text import finite_json

    with common.usage_errors(inputs="FILE", random="--random", field="--field", seed="--seed"):
        checked = check_ops(file, op=op_names, order=order, structures=structures, field=field,
                            random=random_size, device=device, seed=seed,
                            input_format=common.input_format(),
                            progress=not (quiet or as_json))
    if as_json:
        click.echo(finite_json(checked.to_dict()))
    elif not quiet:
        click.echo(str(checked))
    elif not checked.summary.passed:
        from segcli.gradcheck import Report

        note(str(Report(checked.summary.failures)))
    ctx.exit(0 if checked.passed else 1)


COMMANDS = [gradcheck]
