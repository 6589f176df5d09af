"""Writing structures to the files ASE writes (extxyz, traj, db, ...), streamed a chunk at a
time: the inverse of reading one (see segcli.io.asefiles.structure_piece)."""

import os
from contextlib import ExitStack

import numpy as np

from segcli.errors import DataError
from segcli.io.writers import new_output

HDF5_SUFFIXES = (".h5", ".hdf5")
_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
_DATABASES = ("db", "json")
"""Formats written through ase.db, a row per structure (ASE's own writers of these need a
file name that says the format, which a temporary's does not)."""


def export_format(path):
    """The ASE format that the name `path` asks for; None for a segcli HDF5 file (a name
    ending .h5 or .hdf5, or with no suffix); DataError when ASE writes no format of that
    name."""
    from ase.io.formats import UnknownFileTypeError, filetype, ioformats

    name = os.fspath(path)
    suffix = os.path.splitext(os.path.basename(name))[1].lower()
    if suffix in ("", *HDF5_SUFFIXES):
        return None
    try:
        fmt = filetype(name, read=False)
    except UnknownFileTypeError:
        fmt = None
    if fmt not in ioformats or not ioformats[fmt].can_write:
        raise DataError(f"{name}: no format to write by that name; name a segcli HDF5 file "
                        "(.h5, .hdf5) or a file ASE writes (.extxyz, .traj, .db, .xyz, ...)")
    return fmt


def exported_fields(batch, fields=None, drop=None):
    """The fields of `batch` that an export writes: its stored fields and results (not the
    derived ones), those of `fields` only, or without those of `drop`."""
    names = [n for n in batch.fields if n not in batch.derived]
    if fields is not None:
        return [n for n in names if n in fields]
    return [n for n in names if n not in (drop or ())]


def export(inputs, output, fmt, *, chunk_atoms=100_000, fields=None, drop=None, force=False,
           progress=None):
    """Write the structures of `inputs` (files open_batch reads), in order, to the new file
    `output` in ASE's format `fmt` (see export_format), compressed as its name says (.gz,
    .bz2, .xz), streaming `chunk_atoms` atoms at a time: per structure, positions, numbers,
    cell and pbc as the Atoms', calculator results (energy, forces, stress, ...) as a
    SinglePointCalculator's, a per-atom bool field `fixed` as a FixAtoms constraint, the
    other per-atom fields as arrays and per-structure ones as info (or, in a database, as
    key-value pairs where ASE allows, else data); a structure without a field leaves it out.
    `fields`/`drop` choose fields as convert's do. Returns (structures, atoms) written."""
    from ase.io import write
    from ase.io.formats import ioformats

    from segcli.io import open_batch

    output = os.fspath(output)
    counts = [0, 0]
    with ExitStack() as stack:
        batches = [stack.enter_context(open_batch(path)) for path in inputs]
        tmp = stack.enter_context(new_output(output, force))
        if progress is not None and None not in (b.counted for b in batches):
            progress.reset(sum(b.counted for b in batches))
        images = _images(batches, fields, drop, chunk_atoms, counts, progress)
        if fmt in _DATABASES:
            _write_database(tmp, fmt, images)
        elif ioformats[fmt].single:
            write(tmp, _only_one(output, fmt, images), format=fmt)
        else:
            with _open(tmp, output, ioformats[fmt].isbinary) as fd:
                write(fd, images, format=fmt)
    return tuple(counts)


def _open(tmp, output, binary):
    """The temporary `tmp` opened for writing, compressed as `output`'s suffix says."""
    import bz2
    import gzip
    import lzma

    mode = "wb" if binary else "wt"
    opener = {"gzip": gzip.open, "bz2": bz2.open, "lzma": lzma.open}.get(
        _COMPRESSED.get(os.path.splitext(output)[1].lower()), open)
    return opener(tmp, mode)


def _only_one(output, fmt, images):
    first = next(images, None)
    if first is None or next(images, None) is not None:
        raise DataError(f"{output}: the format {fmt} holds one structure; give one "
                        "(e.g. select --structures I:I+1)")
    return first


def _write_database(tmp, fmt, images):
    import ase.db
    from ase.db.core import reserved_keys

    with ase.db.connect(tmp, type=fmt, serial=True, append=False) as db:
        for atoms in images:
            pairs, data = {}, {}
            for key, value in atoms.info.items():
                scalar = isinstance(value, (str, bool, int, float, np.generic))
                if scalar and key not in reserved_keys and key.isidentifier():
                    pairs[key] = value.item() if isinstance(value, np.generic) else value
                else:
                    data[key] = value
            atoms.info = {}
            db.write(atoms, key_value_pairs=pairs, data=data)


def _images(batches, fields, drop, chunk_atoms, counts, progress):
    """Each structure of the batches as an ase.Atoms, counted into `counts` (structures,
    atoms) and `progress`."""
    for batch in batches:
        names = set(exported_fields(batch, fields, drop))
        per = {name: info.per for name, info in batch.fields.items()}
        stored = _each_structure(batch.stream(chunk_atoms, names.__contains__))
        results = sorted(names & batch.result_fields)
        if results:
            chunks = batch.iter_chunks(results, chunk_atoms=chunk_atoms)
            stored = (({**values, **more}, n) for (values, n), (more, _) in
                      zip(stored, _each_structure([chunk] for chunk in chunks)))
        for values, n in stored:
            yield _atoms(values, per, n)
            counts[0] += 1
            counts[1] += n
            if progress is not None:
                progress.update(1)


def _each_structure(groups):
    """(values, n_atoms) of each structure of groups of Chunks: values maps each field that
    the structure has to its rows (per atom) or its value (per structure)."""
    for group in groups:
        for chunk in group:
            ends = np.cumsum(chunk.n_atoms)
            for s, (n, end) in enumerate(zip(chunk.n_atoms.tolist(), ends.tolist())):
                values = {name: rows[end - n:end] for name, rows in chunk.atoms.items()}
                values.update((name, rows[s]) for name, rows in chunk.structures.items())
                yield ({k: v for k, v in values.items()
                        if k not in chunk.present or chunk.present[k][s]}, n)


def _atoms(values, per, n):
    """An ase.Atoms of n atoms from one structure's field values (name -> array)."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.constraints import FixAtoms
    from ase.outputs import all_outputs

    atoms = Atoms(numbers=values.pop("numbers", np.zeros(n, int)),
                  positions=values.pop("positions", None), cell=values.pop("cell", None),
                  pbc=values.pop("pbc", None))
    fixed = values.pop("fixed", None)
    if fixed is not None and fixed.dtype == bool:
        if fixed.any():
            atoms.set_constraint(FixAtoms(mask=fixed))
    elif fixed is not None:
        values["fixed"] = fixed
    results = {}
    for name, value in values.items():
        prop = all_outputs.get(name)
        if prop is not None and (prop.shapespec[:1] == ("natoms",)) == (per[name] == "atom"):
            results[name] = value
        elif per[name] == "atom":
            atoms.set_array(name, value)
        else:
            atoms.info[name] = value if isinstance(value, str) else value[()]
    if results:
        atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms
