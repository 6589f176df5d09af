"""Checks of segcli's own ops, as `segcli gradcheck` runs them: each op's values against
segcli.reference (an independent pure-JAX implementation) and its derivatives against
finite differences, on a file's structures or on random data. Structures where an op is not
differentiable (its kink rule, registry.KINKS) are left out of the finite differences,
those where its value is not finite out of every check.

    import segcli
    checked = segcli.check_ops("sample_data/metals.h5", op="rms_norm", order=1)
    checked.passed, checked.summary, checked.to_dict()

For any other JAX function: segcli.gradcheck.check_gradients.
"""

import inspect
from dataclasses import dataclass, replace

import numpy as np

from segcli import devices
from segcli.api.common import input_name, input_paths, read_inputs, selection, structure_slice
from segcli.api.compute import DEVICES, op_spec
from segcli.errors import ArgumentError, DataError, literal
from segcli.moments import as_rows
from segcli.progress import tracked
from segcli.registry import OPS

DEFAULT_STRUCTURES = slice(0, 16)
"""The structures of a file checked unless `structures` says (which bounds the cost)."""
DEFAULT_RANDOM = (64, 8)
"""Atoms and structures of the random data checked unless `random` says."""
MAX_RANDOM = 10**7
"""The most atoms, and structures, of random data (held in memory several times over)."""
MAX_ORDER = 8
"""The highest order: each order multiplies the cost (order 8 of one op: minutes)."""


@dataclass(frozen=True)
class OpsCheck:
    """What `segcli gradcheck` finds: `report`, a segcli.gradcheck.Report of every check
    (rows of op, order, argument and mode); `summary`, its worst row per op and order (the
    command's table); the data checked (`source`: {"file": inputs, "structures": [start,
    stop]} or {"random": [atoms, structures]}, and `atoms`), `order`, `device` (its label)
    and `skipped` (op -> why: the ops whose fields the file lacks). `passed` only if every
    check passed; `str()` is what the command prints, `to_dict()` what `--json` prints.

        checked = segcli.check_ops(random=(40, 5), op="max_norm", order=1)
        checked.passed, [row.note for row in checked.summary.rows]
    """

    report: object
    source: dict
    order: int
    device: str
    atoms: int
    skipped: dict

    @property
    def passed(self):
        return self.report.passed

    @property
    def summary(self):
        return self.report.summary()

    def to_dict(self):
        return {**self.source, "order": self.order, "device": self.device, "atoms": self.atoms,
                **self.report.to_dict(), "summary": self.summary.to_dict()["rows"],
                "skipped": self.skipped}

    def __str__(self):
        if "file" in self.source:
            start, stop = self.source["structures"]
            data = f"{self.source['file']}: structures {start}:{stop} ({self.atoms} atoms)"
        else:
            data = "random data: {} atoms in {} structures".format(*self.source["random"])
        skipped = [f"skipped {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join([f"{data}, order {self.order}, device {self.device}",
                          str(self.summary), *skipped])


def check_ops(inputs=None, *, op=None, order=2, structures=None, field=None, random=None,
              device="auto", seed=0, input_format=None, progress=False):
    """Check the values and derivatives of segcli's ops, as `segcli gradcheck`: on the
    structures of `inputs` (a path, glob, directory or @LIST; `structures` a slice, default
    0:16) or, without `inputs`, on `random` data (atoms, structures), default (64, 8), with
    sorted ids and some empty structures. For each op (`op`: a name or a list; default all,
    leaving out those whose fields the file lacks) and each order up to `order`, in float64:
    values, JVPs and VJPs against segcli.reference, and JVP and VJP products against central
    finite differences along random directions (`seed`). A file's fields: `field` (else
    forces, else positions) for an op's first per-atom input, positions for a second,
    scaled_positions beside a cell, energy for a per-structure scalar, numbers for labels.
    Returns an OpsCheck; bad data raises DataError, bad arguments ArgumentError.

        checked = segcli.check_ops("sample_data/metals.h5", op=["dot", "mul"], order=1)
        assert checked.passed
        print(segcli.check_ops(random=(256, 16), op="rms_norm", order=3))
    """
    specs, skip_unfit = _specs(op)
    _check_arguments(inputs, order, structures, field, random, device, seed)
    if inputs is not None:
        name = input_name(inputs)
        start, n_atoms, data, skipped = _file_inputs(
            input_paths(inputs), name, specs, field,
            DEFAULT_STRUCTURES if structures is None else structure_slice(structures),
            skip_unfit, input_format)
        source = {"file": name, "structures": [start, start + len(n_atoms)]}
    else:
        random = tuple(int(n) for n in random or DEFAULT_RANDOM)
        n_atoms, data = _random_inputs(random, specs, seed)
        skipped, source = {}, {"random": list(random)}
    target = devices.device(device)  # JAX loads only now, the inputs read and checked
    import jax

    from segcli.gradcheck import Report

    report = Report(())
    with jax.default_device(target), tracked(progress, "gradcheck", len(data), unit="op") as bar:
        for op_name, (labels, arrays) in data.items():
            report += _check_op(OPS[op_name], labels, arrays, n_atoms, order, seed)
            if bar is not None:
                bar.update(1)
    return OpsCheck(report, source, order, devices.device_label(target), int(n_atoms.sum()),
                    skipped)


def _specs(op):
    """(the registry.Op of each op `op` names, whether ops that do not fit a file are
    skipped: only when `op` is None, all ops)."""
    if op is None:
        return list(OPS.values()), True
    names = [op] if isinstance(op, str) else list(op)
    if not names:
        raise ArgumentError("{0}: no op given", "op")
    return [op_spec(name) for name in dict.fromkeys(names)], False


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_arguments(inputs, order, structures, field, random, device, seed):
    """ArgumentError for an argument check_ops cannot take."""
    if inputs is not None and random is not None:
        raise ArgumentError("give {inputs} or {random}, not both")
    if inputs is None and (structures is not None or field is not None):
        raise ArgumentError("{structures} and {field} need {inputs}")
    if not (_is_int(order) and 1 <= order <= MAX_ORDER):
        raise ArgumentError(f"{{0}} must be an integer from 1 to {MAX_ORDER}, not "
                            f"{literal(repr(order))}", "order")
    if not (_is_int(seed) and 0 <= seed < 2**63):
        raise ArgumentError(f"{{0}} must be an integer from 0 to 2**63 - 1, not "
                            f"{literal(repr(seed))}", "seed")
    if field is not None and not isinstance(field, str):
        raise ArgumentError(f"{{0}} must be a field's name, not {literal(repr(field))}", "field")
    if device not in DEVICES:
        raise ArgumentError(f"{{0}} must be one of {', '.join(DEVICES)}, not "
                            f"{literal(repr(device))}", "device")
    if random is not None:
        check_random_size(random)


def check_random_size(random):
    """ArgumentError naming `random` unless it is (atoms, structures), each from 1 to
    MAX_RANDOM."""
    if not (isinstance(random, (tuple, list)) and len(random) == 2
            and all(_is_int(n) for n in random)):
        raise ArgumentError(f"{{0}} must be (atoms, structures), not {literal(repr(random))}",
                            "random")
    atoms, structures = random
    if not (1 <= atoms <= MAX_RANDOM and 1 <= structures <= MAX_RANDOM):
        raise ArgumentError(f"{{0}}: ATOMS and STRUCTURES must be at least 1 and at most "
                            f"{MAX_RANDOM}, got {atoms} atoms in {structures} structures",
                            "random")


def _parameter_names(spec):
    """The names of the op's array parameters (x, y, v, m), from the reference's signature."""
    return list(inspect.signature(spec.reference).parameters)[: len(spec.inputs)]


def _default_fields(spec, field, available):
    """Field names for each input: numbers for labels; `field`, else forces (else positions),
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


def _file_inputs(paths, name, specs, field, structures, skip_unfit, input_format):
    """(first structure, n_atoms, {op: (labels, arrays)}, {op: why skipped}) read from the
    `structures` (a slice) of the files `paths` (named `name`). An op whose fields the files
    lack or cannot fit raises DataError, or with skip_unfit is skipped."""
    from segcli.engine import plan

    with read_inputs(paths, name, input_format=input_format) as batch:
        if not batch.n_structures:
            raise DataError(f"{name}: the file holds no structures, so there is nothing to check")
        start, stop, _ = selection(batch, name, structures).indices(batch.n_structures)
        fields = batch.fields
        chosen, skipped = {}, {}
        for spec in specs:
            names = _default_fields(spec, field, fields)
            try:
                plan(name, spec, names, fields, order=int(spec.differentiable))
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


def _smooth_structures(spec, first, n_atoms):
    """(S,) bool: the structures (of n_atoms) where the op is differentiable at its first
    input `first`, by its kink rule (registry.KINKS; all without one)."""
    rows = as_rows(first)
    ends = np.cumsum(n_atoms)
    return np.array([not spec.at_kink(rows[end - n:end]) for n, end in zip(n_atoms, ends)],
                    bool)


def _finite_structures(spec, arrays, n_atoms):
    """Which structures the reference gives finite values for (max, min and logsumexp of an
    empty structure are infinite, and NaN or infinite data gives such values, which neither
    differences nor compares)."""
    from segcli._jax import enable_x64

    with enable_x64(True):
        out = np.asarray(_bound(spec, n_atoms)[1](*arrays))
    bad = ~np.isfinite(as_rows(out)).all(axis=1)
    if spec.output_per == "atom":
        bad = np.repeat(np.arange(len(n_atoms)), n_atoms)[bad]
    keep = np.ones(len(n_atoms), bool)
    keep[bad] = False
    return keep


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
    return type(report)(tuple(replace(row, note="; ".join(filter(None, (row.note, note))))
                              for row in report.rows))


def _restricted(spec, arrays, n_atoms, keep, why):
    """(arrays, n_atoms, note): the op's data restricted to the structures where `keep` is
    True, and a note saying how many were left out and `why` ("" if none)."""
    if keep.all():
        return arrays, n_atoms, ""
    atom_rows = np.repeat(keep, n_atoms)
    arrays = [array[atom_rows] if wanted.per == "atom" else array[keep]
              for array, wanted in zip(arrays, spec.inputs)]
    return arrays, n_atoms[keep], f"leave out {int((~keep).sum())} structure(s) where {why}"


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
                                          _smooth_structures(spec, arrays[0], n_atoms),
                                          f"{spec.name} is not differentiable ({spec.kinks})")
    checked = check_gradients(_bound(spec, n_atoms)[0], arrays, order=order, seed=seed,
                              argnames=labels, name=spec.name)
    return report + _noted(checked, f"finite differences {kinked}" if kinked else infinite)

