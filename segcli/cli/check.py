"""Command: gradcheck (values and derivatives of every op against finite differences and a
reference)."""

import click

from segcli.cli import common
from segcli.cli.common import note, parse_pair, progress, selection, structure_range
from segcli.registry import OPS

DEFAULT_STRUCTURES = "0:16"
DEFAULT_RANDOM = "64:8"
MAX_RANDOM = 10**7
"""The most atoms, and structures, of --random data (held in memory several times over)."""
MAX_ORDER = 8
"""The highest --order: each order multiplies the cost (order 8 of one op: minutes)."""
TIE_GAP = 1e-3
"""Relative gap below which two values tie (or a spread is zero) for the kink rules (the
finite differences, which move each entry by ~1e-5 relative, could cross it)."""


def _random_size(ctx, param, text):
    if text is None:
        return None
    atoms, structures = parse_pair(text, "ATOMS:STRUCTURES", allow_open=False)
    if not (1 <= atoms <= MAX_RANDOM and 1 <= structures <= MAX_RANDOM):
        raise click.BadParameter(f"ATOMS and STRUCTURES must be at least 1 and at most "
                                 f"{MAX_RANDOM}, got {text!r}")
    return atoms, structures


def _op_names(ctx, param, text):
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

    return list(inspect.signature(spec.reference).parameters)[: len(spec.inputs)]


def _default_fields(spec, field, available):
    """Field names for each input: numbers for labels; --field, else forces (else positions),
    for the first per-atom input, positions for a second, energy (else the first per-structure
    float scalar) for a per-structure scalar, cell for a (3, 3) one and scaled_positions for
    a first (3,) input beside it (matvec)."""
    scalars = sorted(name for name, info in available.items()
                     if info.per == "structure" and info.shape == () and info.dtype.kind == "f")
    names = []
    for position, wanted in enumerate(spec.inputs):
        if wanted.kind == "labels":
            names.append("numbers")
        elif wanted.per == "structure":
            names.append("cell" if wanted.shape == (3, 3)
                         else "energy" if "energy" in available or not scalars else scalars[0])
        elif position > 0:
            names.append("positions")
        else:
            names.append(field or ("scaled_positions" if wanted.shape == (3,)
                                   else "forces" if "forces" in available else "positions"))
    return names


def _file_inputs(path, specs, field, structures, skip_unfit):
    """(first structure, n_atoms, {op: (labels, arrays)}, {op: why skipped}) read from the
    file's `structures` (a slice). An op whose fields the file lacks or cannot fit raises
    DataError, or with skip_unfit is skipped."""
    import numpy as np

    from segcli.engine import plan
    from segcli.errors import DataError
    from segcli.io import open_inputs

    with open_inputs(path, input_format=common.input_format()) as batch:
        if not batch.n_structures:
            raise DataError(f"{path}: the file holds no structures, so there is nothing to check")
        start, stop, _ = selection(batch, path, structures).indices(batch.n_structures)
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
            labels = [f"{parameter}={name}"
                      for parameter, name in zip(_parameter_names(spec), chosen[spec.name])]
            inputs[spec.name] = (labels, [arrays[name] for name in chosen[spec.name]])
    return start, n_atoms, inputs, skipped


def _random_inputs(size, specs, seed):
    """(n_atoms, {op: (labels, arrays)}) of random data: sorted ids, about a quarter of the
    structures empty (at least one when there are two or more)."""
    import numpy as np

    atoms, structures = size
    rng = np.random.default_rng(seed)
    empty = rng.choice(structures, size=max(structures // 4, 1 if structures > 1 else 0),
                       replace=False)
    weights = np.ones(structures)
    weights[empty] = 0
    n_atoms = rng.multinomial(atoms, weights / weights.sum()).astype(np.int64)
    inputs = {}
    for spec in specs:
        arrays = []
        for wanted in spec.inputs:
            size = ((atoms,) if wanted.per == "atom" else (structures,)) + (
                wanted.shape if wanted.shape is not None else (3,))
            arrays.append(rng.integers(0, spec.params["length"], size)
                          if wanted.kind == "labels" else rng.normal(size=size))
        inputs[spec.name] = (_parameter_names(spec), arrays)
    return n_atoms, inputs


def _zero_norm(rows):
    return not rows.any()


def _norm_ties(rows):
    import numpy as np

    norms = np.sort(np.linalg.norm(rows, axis=1))[::-1]
    return norms[0] == 0 or (len(norms) > 1 and norms[1] >= norms[0] * (1 - TIE_GAP))


def _value_ties(rows):
    import numpy as np

    ordered = np.sort(rows, axis=0)
    gaps = np.minimum(ordered[-1] - ordered[-2], ordered[1] - ordered[0]) if len(rows) > 1 \
        else np.inf
    return bool(np.any(gaps <= TIE_GAP * np.abs(rows).max(axis=0)))


def _zero_spread(rows):
    import numpy as np

    return bool(np.any(np.ptp(rows, axis=0) <= TIE_GAP * np.abs(rows).max(axis=0)))


KINKS = {"zero_norm": _zero_norm, "norm_ties": _norm_ties, "value_ties": _value_ties,
         "zero_spread": _zero_spread}
"""Op.kinks -> whether a structure's rows (atoms x components of the first input) sit at a
kink: all entries 0; the largest norm 0 or tied (within TIE_GAP); a component's largest or
smallest value tied; a component without spread."""


def _smooth_structures(spec, arrays, n_atoms):
    """Which structures the op is differentiable at, by its kink rule (all without one)."""
    import numpy as np

    from segcli.curate.statistics import as_rows

    keep = np.ones(len(n_atoms), bool)
    if spec.kinks is None:
        return keep
    rows = as_rows(arrays[0])
    for s, (lo, hi) in enumerate(zip(np.cumsum(n_atoms) - n_atoms, np.cumsum(n_atoms))):
        keep[s] = hi == lo or not KINKS[spec.kinks](rows[lo:hi])
    return keep


def _finite_structures(spec, arrays, n_atoms):
    """Which structures the reference gives finite values for (max, min and logsumexp of an
    empty structure are infinite, and NaN or infinite data gives such values, which neither
    differences nor compares)."""
    import numpy as np

    from segcli._jax import enable_x64
    from segcli.curate.statistics import as_rows

    with enable_x64(True):
        out = np.asarray(_bound(spec, n_atoms)[1](*arrays))
    bad = ~np.isfinite(as_rows(out)).all(axis=1)
    if spec.output_per == "atom":
        bad = np.repeat(np.arange(len(n_atoms)), n_atoms)[bad]
    keep = np.ones(len(n_atoms), bool)
    keep[bad] = False
    return keep


def _select_structures(spec, arrays, n_atoms, keep):
    """The op's arrays and n_atoms restricted to the structures where `keep` is True."""
    import numpy as np

    atom_rows = np.repeat(keep, n_atoms)
    chosen = [array[atom_rows] if wanted.per == "atom" else array[keep]
              for array, wanted in zip(arrays, spec.inputs)]
    return chosen, n_atoms[keep]


def _bound(spec, n_atoms):
    """The op and its reference as functions of the op's arrays, for structures of n_atoms;
    the reference jitted (many small jnp steps, each compiled alone when eager)."""
    import jax

    from segcli.ops import segment_ids

    idx = segment_ids(n_atoms)
    return (lambda *arrays: spec.apply(*arrays, idx=idx, num_segments=len(n_atoms)),
            jax.jit(lambda *arrays: spec.reference(*arrays, idx, len(n_atoms), **spec.params)))


def _noted(report, note):
    """The report with `note` added to each row."""
    from dataclasses import replace

    from segcli.gradcheck import Report

    return Report(tuple(replace(row, note="; ".join(filter(None, (row.note, note))))
                        for row in report.rows))


def _restricted(spec, arrays, n_atoms, keep, why):
    """(arrays, n_atoms, note): the op's data restricted to the structures where `keep` is
    True, and a note saying how many were left out and `why` ("" if none)."""
    if keep.all():
        return arrays, n_atoms, ""
    arrays, n_atoms = _select_structures(spec, arrays, n_atoms, keep)
    return arrays, n_atoms, f"leave out {int((~keep).sum())} structure(s) where {why}"


def _check_op(spec, labels, arrays, n_atoms, order, seed):
    """The rows for one op: the reference (where its values are finite) and finite
    differences (where the op is also differentiable), noted with what they leave out."""
    from segcli.gradcheck import check_gradients, compare_functions

    arrays, n_atoms, infinite = _restricted(spec, arrays, n_atoms,
                                            _finite_structures(spec, arrays, n_atoms),
                                            f"{spec.name} is not finite (empty, or NaN "
                                            "or infinite data)")
    report = _noted(compare_functions(*_bound(spec, n_atoms), arrays, order=order, seed=seed,
                                      argnames=labels, name=spec.name), infinite)
    if not spec.differentiable:
        return report
    arrays, n_atoms, kinked = _restricted(spec, arrays, n_atoms,
                                          _smooth_structures(spec, arrays, n_atoms),
                                          f"{spec.name} is not differentiable ({spec.kinks})")
    checked = check_gradients(_bound(spec, n_atoms)[0], arrays, order=order, seed=seed,
                              argnames=labels, name=spec.name)
    return report + _noted(checked, f"finite differences {kinked}" if kinked else infinite)


@click.command(short_help="Check the ops' values and derivatives.")
@click.argument("file", required=False)
@common.input_format_option()
@click.option("--op", "op_names", callback=_op_names, metavar="OP[,OP...]",
              help=f"Ops to check (default: all): {', '.join(OPS)}.")
@click.option("--order", type=click.IntRange(1, MAX_ORDER), default=2, show_default=True,
              help="Highest derivative order checked.")
@click.option("--structures", callback=structure_range, metavar="START:STOP",
              help=f"Structures of FILE to check, a Python slice (-5:, :10, 7; default "
                   f"{DEFAULT_STRUCTURES}, which bounds the cost).")
@click.option("--field", metavar="NAME",
              help="Per-atom field of FILE for the first input (default: forces, else positions; "
                   "scaled_positions for matvec).")
@click.option("--random", "random_size", callback=_random_size, metavar="ATOMS:STRUCTURES",
              help=f"Without FILE: random data of this size (default {DEFAULT_RANDOM}).")
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
    if file is not None and random_size is not None:
        raise click.UsageError("give FILE or --random, not both")
    if file is None and (structures is not None or field is not None):
        raise click.UsageError("--structures and --field need FILE")
    specs = [OPS[name] for name in op_names]
    if file is not None:
        structures = structures or structure_range(ctx, None, DEFAULT_STRUCTURES)
        all_ops = ctx.get_parameter_source("op_names") == click.core.ParameterSource.DEFAULT
        start, n_atoms, inputs, skipped = _file_inputs(file, specs, field, structures,
                                                       skip_unfit=all_ops)
        source = {"file": file, "structures": [start, start + len(n_atoms)]}
    else:
        random_size = random_size or _random_size(ctx, None, DEFAULT_RANDOM)
        n_atoms, inputs = _random_inputs(random_size, specs, seed)
        skipped = {}
        source = {"random": list(random_size)}
    target = common.device(device)  # JAX loads only now, the inputs read and checked
    import jax

    from segcli.gradcheck import Report
    from segcli.io.text import finite_json

    report = Report(())
    with jax.default_device(target), \
            progress(not (quiet or as_json), "gradcheck", len(inputs), unit="op") as bar:
        for name, (labels, arrays) in inputs.items():
            report += _check_op(OPS[name], labels, arrays, n_atoms, order, seed)
            if bar is not None:
                bar.update(1)
    summary = report.summary()
    if as_json:
        click.echo(finite_json({**source, "order": order, "device": common.device_label(target),
                                "atoms": int(n_atoms.sum()), **report.to_dict(),
                                "summary": summary.to_dict()["rows"], "skipped": skipped}))
    elif not quiet:
        described = (f"{file}: structures {source['structures'][0]}:{source['structures'][1]} "
                     f"({int(n_atoms.sum())} atoms)" if file
                     else f"random data: {random_size[0]} atoms in {random_size[1]} structures")
        click.echo(f"{described}, order {order}, device {common.device_label(target)}")
        click.echo(str(summary))
        for name, reason in skipped.items():
            click.echo(f"skipped {name}: {reason}")
    elif not summary.passed:
        note(str(Report(summary.failures)))
    ctx.exit(0 if report.passed else 1)


COMMANDS = [gradcheck]
