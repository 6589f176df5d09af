"""Files that ASE reads (extxyz, xyz, traj, cif, POSCAR, ...), streamed a structure at a time:
with ase.io.iread, and extended XYZ with segcli's own reader where it can."""

import lzma
import os
import zlib
from array import array
from functools import cached_property

import numpy as np

from segcli.errors import DataError
from segcli.fields import NUMERIC_KINDS, STRING
from segcli.io.core import Batch, Chunk, FieldConflict, FieldInfo, Schema, integral_numbers, rechunk

DECOMPRESSION_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError)
"""What reading gzip, bzip2 or xz data that is cut short or corrupt raises (see
decompression_error)."""


def decompression_error(path, err):
    """What to raise for `err`, raised reading `path`: a DataError where compressed data is cut
    short or corrupt, `err` itself where it is the system's OSError (one with an errno)."""
    if isinstance(err, OSError) and err.errno is not None:
        return err
    if isinstance(err, EOFError):
        return DataError(f"{path}: truncated: its compressed data ends before the end of the "
                         "stream")
    return DataError(f"{path}: corrupt compressed data ({err})")


def ase_format(path):
    """ASE's name for the format of a file, or None when ASE knows none; a database's name
    (.db, .aselmdb) is none, as databases are recognised by their content."""
    from ase.io.formats import UnknownFileTypeError, filetype, ioformats

    try:
        fmt = filetype(path)
    except UnknownFileTypeError:
        fmt = None
    except DECOMPRESSION_ERRORS as err:  # a compressed file's name on data that is not
        raise decompression_error(path, err) from err
    return fmt if fmt in ioformats and ioformats[fmt].can_read and fmt != "db" else None


def _numeric(value):
    array = np.asarray(value)
    return array if array.dtype.kind in NUMERIC_KINDS else None


def _field_value(value):
    """An info entry as a field's value: a str as a string, else numbers (None: neither)."""
    return np.array(str(value), STRING) if isinstance(value, str) else _numeric(value)


def only(piece, keep):
    """A piece with only the fields for which `keep(name)` is true."""
    return piece._replace(atoms={k: v for k, v in piece.atoms.items() if keep(k)},
                          structures={k: v for k, v in piece.structures.items() if keep(k)})


def atoms_piece(path, atoms, index):
    """One structure as a Chunk (see `structure_piece`)."""
    return structure_piece(path, index, len(atoms), atoms.arrays, atoms.cell.array, atoms.pbc,
                           atoms.info, getattr(atoms.calc, "results", {}),
                           constraints=atoms.constraints)


def structure_piece(path, index, n, arrays, cell, pbc, info, results, data=None,
                    constraints=()):
    """One structure of n atoms as a Chunk: its numeric atoms.arrays and per-atom calculator
    results and `data` entries (an ASE database row's) per atom; cell, pbc, numeric and
    string atoms.info entries and the other results and data per structure; the atoms that
    `constraints` (or an extxyz move_mask) hold still as booleans (see constraint_fields).
    DataError for
    atomic numbers that are not integers, a string holding a NUL byte, and a name given twice
    with different values (`cell=3` beside a Lattice in an extxyz comment, a key both per
    atom and in info, ...)."""
    from ase.outputs import all_outputs

    per_atom = {k: v for k, v in arrays.items() if v.dtype.kind in NUMERIC_KINDS}
    for key, values in per_atom.items():
        _check_atoms(path, index, n, key, values, "per-atom array")
    per_atom.update(constraint_fields(n, constraints, per_atom.pop("move_mask", None)))
    if "numbers" in per_atom:
        per_atom["numbers"] = integral_numbers(
            per_atom["numbers"], lambda atom: f"{path}: structure {index}: atom {atom}")
    per_structure = {"cell": cell[np.newaxis], "pbc": pbc[np.newaxis]}
    sources = {**dict.fromkeys(per_atom, "per-atom array"), "cell": "cell", "pbc": "pbc"}

    def add(key, array, atom, source):
        where = per_atom if atom else per_structure
        array = array if atom else array[np.newaxis]
        if key in sources:
            if key in where and np.array_equal(where[key], array):
                return
            raise DataError(f"{path}: structure {index} has two different '{key}': its "
                            f"{sources[key]} and its {source}")
        if array.dtype == STRING and "\0" in array.item():
            raise DataError(f"{path}: structure {index}: {source} '{key}' holds a NUL byte")
        sources[key] = source
        where[key] = array

    for key, value in info.items():
        array = _field_value(value)
        if array is not None:
            add(key, array, False, "comment or info entry")
    for source, entries in (("data entry", data or {}), ("calculator result", results)):
        for key, value in entries.items():
            array = _numeric(value)
            if array is not None:
                prop = all_outputs.get(key)
                atom = prop.shapespec[:1] == ("natoms",) if prop else array.shape[:1] == (n,)
                if atom:
                    _check_atoms(path, index, n, key, array, source)
                add(key, array, atom, source)
    return Chunk(index, np.array([n], np.int64), per_atom, per_structure)


def _check_atoms(path, index, n, key, values, source):
    """DataError unless the per-atom `values` have a row for each of a structure's n atoms (as
    many as its atomic numbers), so that no row is taken for another structure's."""
    if values.shape[:1] != (n,):
        raise DataError(f"{path}: structure {index}: {source} '{key}' has "
                        f"{values.shape[0] if values.ndim else 'no'} rows, but the structure has "
                        f"{n} atoms (its atomic numbers)")


def constraint_fields(n, constraints, move_mask=None):
    """The per-atom boolean fields that hold ASE's constraints of a structure of n atoms:
    `fixed` (n,), True where FixAtoms holds an atom, and `fixed_cartesian` (n, 3), True where
    FixCartesian holds a coordinate; from an extxyz `move_mask` column (True where an atom or
    coordinate moves) when the file was read without ASE. Other constraints are not kept."""
    from ase.constraints import FixAtoms, FixCartesian

    out = {}
    if move_mask is not None:
        out["fixed" if move_mask.ndim == 1 else "fixed_cartesian"] = ~move_mask.astype(bool)
    for constraint in constraints:
        if isinstance(constraint, FixAtoms):
            out.setdefault("fixed", np.zeros(n, bool))[constraint.index] = True
        elif isinstance(constraint, FixCartesian):
            out.setdefault("fixed_cartesian", np.zeros((n, 3), bool))[constraint.index] |= \
                np.asarray(constraint.mask, bool)
    return out


class StreamedBatch(Batch):
    """Structures read in order, one piece each, by `structures(start, stop)` (stop None: the
    end). `n_atoms`, `fields` and `present` cost one pass over the file that keeps only counts
    and field names (cached); `iter_chunks` another."""

    def structures(self, start, stop):
        """A piece per structure from `start` to `stop`, with every field it has."""
        raise NotImplementedError

    @cached_property
    def _scan(self):
        """(n_atoms, schema, the distinct sets of field names, each structure's set's index,
        conflicts): a name that structures hold per atom and per structure, or in different
        shapes (a database row's `data` array as long as one row's atoms, not another's), is
        no field but a conflict (see core.Fields), so that the other fields stay readable."""
        n_atoms, schema, name_sets, which = array("q"), Schema(), {}, array("q")
        conflicts = {}
        for piece in self.structures(0, None):  # 8 bytes a structure, no Python object each
            n_atoms.append(int(piece.n_atoms[0]))
            for per, data in (("atom", piece.atoms), ("structure", piece.structures)):
                for name, values in data.items():
                    if name in conflicts:
                        continue
                    try:
                        schema.add(self.path, FieldInfo(name, per, values.shape[1:],
                                                        values.dtype), piece.start)
                    except FieldConflict as err:
                        schema.pop(name)
                        conflicts[name] = (f"{str(err).removeprefix(f'{self.path}: ')}, so the "
                                           "file has no such field")
            names = frozenset(piece.atoms.keys() | piece.structures.keys())
            which.append(name_sets.setdefault(names, len(name_sets)))
        return (np.frombuffer(n_atoms, np.int64), dict(schema), list(name_sets),
                np.frombuffer(which, np.int64), conflicts)

    @property
    def _conflicts(self):
        return self._scan[4]

    @property
    def n_atoms(self):
        return self._scan[0]

    @property
    def counted(self):
        return self.n_structures if "_scan" in self.__dict__ else None

    @property
    def _stored(self):
        return self._scan[1]

    def _present(self, name):
        _, _, name_sets, which, _ = self._scan
        have = np.isin(which, [i for i, names in enumerate(name_sets) if name in names])
        return None if have.all() else have

    def stream(self, chunk_atoms, keep=None):
        pieces = self.structures(0, None)
        if keep is not None:
            pieces = (only(piece, keep) for piece in pieces)
        return rechunk(pieces, chunk_atoms)

    def _pieces(self, start, stop, names, chunk_atoms, into=None, bounds=None):
        for piece in self.structures(start, stop):
            yield piece if names is None else only(piece, names.__contains__)


class AseBatch(StreamedBatch):
    """Structures of a file that ASE reads, in ASE format `ase_format`, with ase.io.iread."""

    format = "ase"

    def __init__(self, path, ase_format):
        import ase.io  # noqa: F401 - loaded as the file opens, before any output exists: not
        #                 mid-run, where a signal could break off the import

        super().__init__(path)
        self.ase_format = ase_format

    def structures(self, start, stop):
        """Pieces of the structures from `start` to `stop` (ASE checks every frame header
        first, and reports a bad one at `start`). A file with content but no structure is a
        DataError, not an empty batch."""
        import ase.io
        from ase.io.formats import ioformats

        single = ioformats[self.ase_format].single
        frames = ase.io.iread(self.path, index=slice(None) if single else slice(start, stop),
                              format=self.ase_format, do_not_split_by_at_sign=True)
        index = 0 if single else start
        while stop is None or index < stop:
            try:
                atoms = next(frames)
            except StopIteration:
                if index == 0 and os.path.getsize(self.path):
                    raise DataError(f"{self.path}: ASE reads no structure from it as "
                                    f"{self.ase_format} (not a structure file?)") from None
                return
            except Exception as err:
                raise DataError(f"{self.path}: ASE cannot read structure {index} as "
                                f"{self.ase_format} ({type(err).__name__}: {err})") from err
            if index >= start:
                yield atoms_piece(self.path, atoms, index)
            index += 1


class ExtxyzBatch(AseBatch):
    """An extended XYZ file, read by segcli's reader (see segcli.io.extxyz)."""

    format = "extxyz"

    def __init__(self, path):
        super().__init__(path, "extxyz")

    def structures(self, start, stop):
        from segcli.io.extxyz import pieces

        return pieces(self.path, start, stop)
