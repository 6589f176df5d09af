"""Files that ASE reads (extxyz, xyz, traj, cif, POSCAR, ...), streamed a structure at a time:
with ase.io.iread, and extended XYZ with segcli's own reader where it can."""

import os
from array import array
from functools import cached_property

import numpy as np

from segcli.errors import DataError
from segcli.io.core import NUMERIC_KINDS, STRING, Batch, Chunk, Schema, rechunk


def ase_format(path):
    """ASE's name for the format of a file, or DataError when ASE knows none."""
    from ase.io.formats import UnknownFileTypeError, filetype, ioformats

    try:
        fmt = filetype(path)
    except UnknownFileTypeError:
        fmt = None
    return fmt if fmt in ioformats and ioformats[fmt].can_read else None


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
                           atoms.info, getattr(atoms.calc, "results", {}))


def structure_piece(path, index, n, arrays, cell, pbc, info, results):
    """One structure of n atoms as a Chunk: its numeric atoms.arrays and per-atom calculator
    results per atom; cell, pbc, numeric and string atoms.info entries and the other
    calculator results per structure."""
    from ase.outputs import all_outputs

    per_atom = {k: v for k, v in arrays.items() if v.dtype.kind in NUMERIC_KINDS}
    per_structure = {"cell": cell[np.newaxis], "pbc": pbc[np.newaxis]}
    for key, value in info.items():
        array = _field_value(value)
        if array is not None:
            per_structure[key] = array[np.newaxis]
    for key, value in results.items():
        array = _numeric(value)
        if array is None:
            continue
        prop = all_outputs.get(key)
        if (prop.shapespec[:1] == ("natoms",)) if prop else (array.shape[:1] == (n,)):
            per_atom[key] = array
        else:
            per_structure[key] = array[np.newaxis]
    both = per_atom.keys() & per_structure.keys()
    if both:
        raise DataError(f"{path}: structure {index} has '{min(both)}' both per atom "
                        "and per structure")
    return Chunk(index, np.array([n], np.int64), per_atom, per_structure)


class StreamedBatch(Batch):
    """Structures read in order, one piece each, by `structures(start, stop)` (stop None: the
    end). `n_atoms`, `fields` and `present` cost one pass over the file that keeps only counts
    and field names (cached); `iter_chunks` another."""

    def structures(self, start, stop):
        """A piece per structure from `start` to `stop`, with every field it has."""
        raise NotImplementedError

    @cached_property
    def _scan(self):
        """(n_atoms, schema, the distinct sets of field names, each structure's set's index)."""
        n_atoms, schema, name_sets, which = array("q"), Schema(), {}, array("q")
        for piece in self.structures(0, None):  # 8 bytes a structure, no Python object each
            n_atoms.append(int(piece.n_atoms[0]))
            schema.add_piece(self.path, piece)
            names = frozenset(piece.atoms.keys() | piece.structures.keys())
            which.append(name_sets.setdefault(names, len(name_sets)))
        return (np.frombuffer(n_atoms, np.int64), dict(schema), list(name_sets),
                np.frombuffer(which, np.int64))

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
        _, _, name_sets, which = self._scan
        have = np.isin(which, [i for i, names in enumerate(name_sets) if name in names])
        return None if have.all() else have

    def stream(self, chunk_atoms, keep=None):
        pieces = self.structures(0, None)
        if keep is not None:
            pieces = (only(piece, keep) for piece in pieces)
        return rechunk(pieces, chunk_atoms)

    def _pieces(self, start, stop, names, chunk_atoms, into=None):
        for piece in self.structures(start, stop):
            yield piece if names is None else only(piece, names.__contains__)


class AseBatch(StreamedBatch):
    """Structures of a file that ASE reads, in ASE format `ase_format`, with ase.io.iread."""

    format = "ase"

    def __init__(self, path, ase_format):
        super().__init__(path)
        self.ase_format = ase_format

    def structures(self, start, stop):
        return self._ase_pieces(start, stop, start)
    def _ase_pieces(self, start, stop, resume):
        """Pieces of the structures from `resume` to `stop`, reading with ASE from `start`
        (ASE checks every frame header first, and reports a bad one at `start`). A file with
        content but no structure is a DataError, not an empty batch."""
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
            if index >= resume:
                yield atoms_piece(self.path, atoms, index)
            index += 1


class ExtxyzBatch(AseBatch):
    """An extended XYZ file: segcli's reader, and ASE from the first structure it leaves to
    ASE."""

    format = "extxyz"

    def __init__(self, path):
        super().__init__(path, "extxyz")

    def structures(self, start, stop):
        from segcli.io.extxyz import Unsupported, pieces

        try:
            yield from pieces(self.path, start, stop)
        except Unsupported as exc:
            yield from self._ase_pieces(start, stop, exc.index)
