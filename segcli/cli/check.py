"""Command: gradcheck (values and derivatives of every op against finite differences and a reference)."""

import json

import click

from segcli.cli import common
from segcli.cli.common import parse_pair, progress_bar, structure_range

DEFAULT_STRUCTURES = "0:16"
DEFAULT_RANDOM = "64:8"
MAX_NORM_GAP = 1e-3
"""Relative gap below which two atoms tie for a structure's max_norm (the finite differences,
which move each entry by ~1e-5 relative, could cross it)."""


def _random_size(ctx, param, text):
    if text is None:
        return None
    atoms, structures = parse_pair(text, "ATOMS:STRUCTURES", allow_open=False)
    if atoms < 1 or structures < 1:
        raise click.BadParameter(f"ATOMS and STRUCTURES must be at least 1, got {text!r}")
    return atoms, structures


def _op_names(ctx, param, text):
    from segcli.engine import OPS

    if text is None:
        return list(OPS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OPS]
    if unknown or not names:
        raise click.BadParameter(f"unknown op {', '.join(map(repr, unknown)) or repr(text)} "
                                 f"(choose from {', '.join(OPS)})")
    return list(dict.fromkeys(names))


def _parameter_names(spec):
    """The names of the op's array parameters (x, y, v, m), from the reference's signature."""
    import inspect

    from segcli import reference

    parameters = inspect.signature(getattr(reference, spec.function)).parameters
    return list(parameters)[: len(spec.inputs)]


def _default_fields(spec, field, available):
    """Field names for each input: --field, else forces (else positions), for the first per-atom
    input, positions for a second, energy (else the first per-structure float scalar) for a
    per-structure scalar, scaled_positions × cell for matvec."""
    scalars = sorted(name for name, info in available.items()
                     if info.per == "structure" and info.shape == () and info.dtype.kind == "f")
    names = []
    for position, wanted in enumerate(spec.inputs):
        if wanted.per == "structure":
            names.append("cell" if wanted.shape == (3, 3)
                         else "energy" if "energy" in available or not scalars else scalars[0])
        elif position > 0:
            names.append("positions")
        else:
            names.append(field or ("scaled_positions" if wanted.shape == (3,)
                                   else "forces" if "forces" in available else "positions"))
    return names


def _file_inputs(path, specs, field, structures, skip_unfit):
    """(n_atoms, {op: (labels, arrays)}, {op: why skipped}) read from the file's
    structures[0]:structures[1]. An op whose fields the file lacks or cannot fit raises
    DataError, or with skip_unfit is skipped."""
    import numpy as np

    from segcli.engine import plan
    from segcli.errors import DataError
    from segcli.io import open_inputs

    with open_inputs(path) as batch:
        total = batch.n_structures
        start, stop = structures
        stop = total if stop is None else min(stop, total)
        if start >= stop:
            raise DataError(f"{path}: --structures {start}:{stop} selects no structure "
                            f"(the file has {total})")
        fields = batch.fields
        chosen, skipped = {}, {}
        for spec in specs:
            names = _default_fields(spec, field, fields)
            try:
                plan(path, spec, names, fields, order=int(spec.differentiable))
            except DataError as error:
                if not skip_unfit:
                    raise
                skipped[spec.name] = str(error)
                continue
            chosen[spec.name] = names
        needed = sorted({name for names in chosen.values() for name in names})
        n_atoms = np.asarray(batch.n_atoms[start:stop], np.int64)
        data = {name: [] for name in needed}
        for chunk in batch.iter_chunks(needed, chunk_atoms=max(int(n_atoms.sum()), 1),
                                       structures=slice(start, stop)):
            for name in needed:
                data[name].append({**chunk.atoms, **chunk.structures}[name])
    arrays = {name: np.concatenate(parts) for name, parts in data.items()}
    inputs = {}
    for spec in specs:
        if spec.name in chosen:
            labels = [f"{parameter}={name}" for parameter, name in zip(_parameter_names(spec), chosen[spec.name])]
            inputs[spec.name] = (labels, [arrays[name] for name in chosen[spec.name]])
    return n_atoms, inputs, skipped


def _random_inputs(size, specs, seed):
    """(n_atoms, {op: (labels, arrays)}) of random data: sorted ids, about a quarter of the
    structures empty (at least one when there are two or more)."""
    import numpy as np

    atoms, structures = size
    rng = np.random.default_rng(seed)
    empty = rng.choice(structures, size=max(structures // 4, 1 if structures > 1 else 0), replace=False)
    weights = np.ones(structures)
    weights[empty] = 0
    n_atoms = rng.multinomial(atoms, weights / weights.sum()).astype(np.int64)
    inputs = {}
    for spec in specs:
        arrays = [rng.normal(size=((atoms,) if wanted.per == "atom" else (structures,)) +
                             (wanted.shape if wanted.shape is not None else (3,)))
                  for wanted in spec.inputs]
        inputs[spec.name] = (_parameter_names(spec), arrays)
    return n_atoms, inputs


def _differentiable_structures(name, arrays, n_atoms):
    """Which structures the op is differentiable at: rms_norm not where all of a structure's
    entries are 0, max_norm not where the largest norm is 0 or tied (within MAX_NORM_GAP)."""
    import numpy as np

    keep = np.ones(len(n_atoms), bool)
    if name not in ("rms_norm", "max_norm"):
        return keep
    x = arrays[0].reshape(len(arrays[0]), -1)
    norms = np.linalg.norm(x, axis=1)
    for s, (lo, hi) in enumerate(zip(np.cumsum(n_atoms) - n_atoms, np.cumsum(n_atoms))):
        if hi == lo:
            continue
        ranked = np.sort(norms[lo:hi])[::-1]
        if ranked[0] == 0:
            keep[s] = False
        elif name == "max_norm" and len(ranked) > 1:
            keep[s] = ranked[1] < ranked[0] * (1 - MAX_NORM_GAP)
    return keep


def _select_structures(spec, arrays, n_atoms, keep):
    """The op's arrays and n_atoms restricted to the structures where `keep` is True."""
    import numpy as np

    atom_rows = np.repeat(keep, n_atoms)
    chosen = [array[atom_rows] if wanted.per == "atom" else array[keep] for array, wanted in zip(arrays, spec.inputs)]
    return chosen, n_atoms[keep]


def _bound(spec, n_atoms):
    """The op and its reference as functions of the op's arrays, for structures of n_atoms."""
    from segcli import reference
    from segcli.ops import segment_ids

    idx = segment_ids(n_atoms)
    expected = getattr(reference, spec.function)
    return (lambda *arrays: spec.apply(*arrays, idx=idx, num_segments=len(n_atoms)),
            lambda *arrays: expected(*arrays, idx, len(n_atoms)))


def _check_op(spec, labels, arrays, n_atoms, order, seed):
    """The rows for one op: finite differences (where it is differentiable) and the reference."""
    from dataclasses import replace

    from segcli.gradcheck import Report, check_gradients, compare_functions

    report = compare_functions(*_bound(spec, n_atoms), arrays, order=order, seed=seed, argnames=labels,
                               name=spec.name)
    if not spec.differentiable:
        return report
    keep = _differentiable_structures(spec.name, arrays, n_atoms)
    left_out = int((~keep).sum())
    if left_out:
        arrays, n_atoms = _select_structures(spec, arrays, n_atoms, keep)
    checked = check_gradients(_bound(spec, n_atoms)[0], arrays, order=order, seed=seed, argnames=labels,
                              name=spec.name)
    if left_out:
        note = (f"finite differences leave out {left_out} structure(s) where {spec.name} is not "
                "differentiable (zero or tied norms)")
        checked = Report(tuple(replace(row, note="; ".join(filter(None, (row.note, note)))) for row in checked.rows))
    return report + checked


@click.command(short_help="Check the ops' values and derivatives.")
@click.argument("file", required=False)
@click.option("--op", "op_names", callback=_op_names, metavar="OP[,OP...]",
              help="Ops to check (default: all): sum, mean, dot, mul, rms_norm, max_norm, matvec, count.")
@click.option("--order", type=click.IntRange(min=1), default=2, show_default=True,
              help="Highest derivative order checked.")
@click.option("--structures", callback=structure_range, metavar="START:STOP",
              help=f"Structures of FILE to check (default {DEFAULT_STRUCTURES}, which bounds the cost).")
@click.option("--field", metavar="NAME",
              help="Per-atom field of FILE for the first input (default: forces, else positions; "
                   "scaled_positions for matvec).")
@click.option("--random", "random_size", callback=_random_size, metavar="ATOMS:STRUCTURES",
              help=f"Without FILE: random data of this size (default {DEFAULT_RANDOM}).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Where to compute (auto: a GPU when JAX sees one).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random directions and data.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (every check) instead of the table.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors and failed checks.")
@click.pass_context
def gradcheck(ctx, file, op_names, order, structures, field, random_size, device, seed, as_json, quiet):
    """Check the values and derivatives of the ops on FILE's data or on random data.

    For each op and each order up to --order, JVP and VJP products (of the op and of its
    directional derivatives) are compared, in float64, with central finite differences
    along random directions, and values, JVPs and VJPs with segcli.reference, an independent
    pure-JAX implementation. One row per op and order shows the worst check: its error,
    tolerance and result (order 0: values). Exit status 0 only if every check passes.

    FILE's own fields and structures are used: forces (else positions) for sum, mean,
    rms_norm and max_norm (--field picks another per-atom field), forces·positions for dot,
    forces × energy (else another per-structure scalar) for mul, scaled_positions × cell
    for matvec; ops whose fields FILE lacks are skipped, or an error if named in --op.
    Only --structures (default 0:16, about 30 s on two CPU cores for the bundled
    metals.h5 at order 2) are read. Where rms_norm or max_norm is not differentiable (a structure of zero
    vectors, two atoms tied for the largest norm) those structures are left out of the
    finite differences but still compared with the reference. Without FILE, random data of
    --random atoms and structures, with sorted ids and some empty structures.

    \b
    Example:
      segcli gradcheck sample_data/metals.h5 --order 2
      segcli gradcheck --random 256:16 --op rms_norm,max_norm --order 3 --json
    """
    if file is not None and random_size is not None:
        raise click.UsageError("give FILE or --random, not both")
    if file is None and (structures is not None or field is not None):
        raise click.UsageError("--structures and --field need FILE")
    target = common.device(device)
    import jax

    from segcli.engine import OPS
    from segcli.gradcheck import Report

    specs = [OPS[name] for name in op_names]
    if file is not None:
        structures = structures or structure_range(ctx, None, DEFAULT_STRUCTURES)
        all_ops = ctx.get_parameter_source("op_names") == click.core.ParameterSource.DEFAULT
        n_atoms, inputs, skipped = _file_inputs(file, specs, field, structures, skip_unfit=all_ops)
        source = {"file": file, "structures": [structures[0], structures[0] + len(n_atoms)]}
    else:
        random_size = random_size or _random_size(ctx, None, DEFAULT_RANDOM)
        n_atoms, inputs = _random_inputs(random_size, specs, seed)
        skipped = {}
        source = {"random": list(random_size)}
    report = Report(())
    with jax.default_device(target), progress_bar(not (quiet or as_json), "gradcheck") as bar:
        for name, (labels, arrays) in inputs.items():
            report += _check_op(OPS[name], labels, arrays, n_atoms, order, seed)
            if bar:
                bar.update(1)
    summary = report.summary()
    if as_json:
        click.echo(json.dumps({**source, "order": order, "device": str(target), "atoms": int(n_atoms.sum()),
                               **report.to_dict(), "summary": summary.to_dict()["rows"], "skipped": skipped}))
    elif not quiet:
        described = (f"{file}: structures {source['structures'][0]}:{source['structures'][1]} "
                     f"({int(n_atoms.sum())} atoms)" if file
                     else f"random data: {random_size[0]} atoms in {random_size[1]} structures")
        click.echo(f"{described}, order {order}, device {target}")
        click.echo(str(summary))
        for name, reason in skipped.items():
            click.echo(f"skipped {name}: {reason}")
    elif not summary.passed:
        click.echo(str(Report(summary.failures)), err=True)
    ctx.exit(0 if report.passed else 1)


COMMANDS = [gradcheck]
