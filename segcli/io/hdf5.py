"""HDF5 files: the segcli-batch layout, and the conformer-group layout of ANI-1x, SPICE and
Transition1x, read in place."""

import itertools

import h5py
import numpy as np

from segcli.errors import DataError
from segcli.io.core import (
    FORMAT,
    NUMERIC_KINDS,
    STRING,
    VERSION,
    Batch,
    Chunk,
    FieldInfo,
    Schema,
    plan_chunks,
)

POSITION_NAMES = ("coordinates", "conformations", "positions")
NUMBER_NAMES = ("atomic_numbers", "species")


def read_rows(path, ds, lo, hi, out=None):
    """Rows [lo, hi) of a dataset (of strings: an object array of str), read into `out` when it
    is an array of their shape and dtype (else a new array); DataError if the file cannot give
    them."""
    try:
        if h5py.check_string_dtype(ds.dtype):
            return ds.asstr()[lo:hi]
        if (out is None or hi <= lo or out.shape != (hi - lo, *ds.shape[1:])
                or out.dtype != ds.dtype):
            return ds[lo:hi]
        ds.read_direct(out, np.s_[lo:hi])
        return out
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read {ds.name} rows {lo}:{hi} ({err})") from err


def plain(value):
    """An HDF5 attribute as a JSON-friendly Python value."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    return value.decode() if isinstance(value, bytes) else value


def open_file(path, batch_class):
    """An HDF5 file opened as `batch_class` (SegcliBatch or ConformerBatch); DataError when
    HDF5 cannot read it."""
    try:
        h5 = h5py.File(path, "r", rdcc_nbytes=0)
    except OSError as err:
        if "unable to lock file" in str(err):
            raise DataError(f"{path}: busy: another program has it open for writing (HDF5's "
                            "file lock); try again once it is done") from err
        raise DataError(f"{path}: truncated or corrupt HDF5 file ({err})") from err
    try:
        return batch_class(path, h5)
    except (OSError, KeyError) as err:
        h5.close()
        raise DataError(f"{path}: corrupt HDF5 file ({err})") from err
    except BaseException:
        h5.close()
        raise


class SegcliBatch(Batch):
    """A segcli-batch HDF5 file (SPEC §4)."""

    format = "segcli"

    def __init__(self, path, h5):
        super().__init__(path)
        self._h5 = h5
        if plain(h5.attrs["format"]) != FORMAT:
            raise DataError(f"{path}: attribute format is {plain(h5.attrs['format'])!r}, "
                            f"not {FORMAT!r}")
        if h5.attrs.get("version") != VERSION:
            raise DataError(f"{path}: version {h5.attrs.get('version')} of {FORMAT} is not "
                            f"supported (this segcli reads version {VERSION})")
        counts = h5.get("structures/n_atoms")
        if not isinstance(counts, h5py.Dataset):
            raise DataError(f"{path}: /structures/n_atoms is missing")
        if counts.ndim != 1 or counts.dtype.kind not in "iu":
            raise DataError(f"{path}: /structures/n_atoms must be a 1-D integer array, "
                            f"not {counts.dtype} of shape {counts.shape}")
        self.n_atoms = read_rows(path, counts, 0, len(counts)).astype(np.int64)
        negative = np.flatnonzero(self.n_atoms < 0)
        if len(negative):
            s = negative[0]
            raise DataError(f"{path}: /structures/n_atoms[{s}] is {self.n_atoms[s]}; "
                            "atom counts cannot be negative")
        self._offsets = np.concatenate([[0], np.cumsum(self.n_atoms)])
        rows = {"atom": self._offsets[-1], "structure": len(self.n_atoms)}
        self._stored, self._datasets = {}, {}
        for per, group in (("atom", "atoms"), ("structure", "structures")):
            for name, ds in h5.get(group, {}).items():
                is_string = isinstance(ds, h5py.Dataset) and h5py.check_string_dtype(ds.dtype)
                if (not isinstance(ds, h5py.Dataset) or (group, name) == ("structures", "n_atoms")
                        or not (is_string or ds.dtype.kind in NUMERIC_KINDS)):
                    continue
                self._check_rows(f"/{group}/{name}", ds, per, rows[per])
                if name in self._stored:
                    raise DataError(f"{path}: '{name}' is both in /atoms and in /structures")
                self._stored[name] = FieldInfo(name, per, ds.shape[1:],
                                               STRING if is_string else ds.dtype)
                self._datasets[name] = ds
        self._masks = {}
        for name, ds in h5.get("present", {}).items():
            if name in self._stored:
                if not isinstance(ds, h5py.Dataset) or ds.shape != (len(self.n_atoms),) or \
                        ds.dtype != bool:
                    raise DataError(f"{path}: /present/{name} must be a ({len(self.n_atoms)},) "
                                    f"bool array, one entry per structure")
                self._masks[name] = ds
        self._result_fields = {}
        for name in self._result_names():
            ds = h5["results"][name]
            per = plain(ds.attrs.get("per"))
            if per is None or ds.dtype.kind not in NUMERIC_KINDS:
                continue
            if per not in rows:
                raise DataError(f"{path}: /results/{name} has per={per!r}, neither 'atom' nor "
                                "'structure'")
            self._check_rows(f"/results/{name}", ds, per, rows[per])
            if name not in self._stored:
                self._result_fields[name] = FieldInfo(name, per, ds.shape[1:], ds.dtype)
                self._datasets[name] = ds

    def _check_rows(self, where, ds, per, rows):
        """DataError unless dataset `ds` (at `where`), per `per`, has `rows` rows and, if it
        is virtual, the files it reads exist (HDF5 would read zeros for a missing one)."""
        if ds.is_virtual:
            import os

            here = os.path.dirname(os.path.abspath(self.path))
            for source in ds.virtual_sources():
                name = source.file_name
                if name != "." and not os.path.exists(os.path.join(here, name)):
                    raise DataError(f"{self.path}: {where} is a virtual dataset reading "
                                    f"{name}, which is missing (keep the parts of `segcli "
                                    "merge --virtual` beside it)")
        if ds.ndim == 0 or ds.shape[0] != rows:
            length = ds.shape[0] if ds.ndim else "no"
            expected = ("/structures/n_atoms sums to" if per == "atom"
                        else "/structures/n_atoms has")
            raise DataError(f"{self.path}: {where} has {length} rows, but {expected} {rows}")

    def close(self):
        self._h5.close()

    def _result_names(self):
        """Names of the datasets under /results (NAME or NAME/d_FIELD), in file order."""
        out = []
        if isinstance(self._h5.get("results"), h5py.Group):
            self._h5["results"].visititems(
                lambda name, obj: out.append(name) if isinstance(obj, h5py.Dataset) else None)
        return out

    @property
    def results(self):
        return {name: {k: plain(v) for k, v in self._h5["results"][name].attrs.items()}
                for name in self._result_names()}

    def _present(self, name):
        ds = self._masks.get(name)
        return None if ds is None else read_rows(self.path, ds, 0, len(ds))

    def fill_value(self, name):
        if name in self._masks and "fill_value" in self._datasets[name].attrs:
            return plain(self._datasets[name].attrs["fill_value"])
        return None

    def _pieces(self, start, stop, names, chunk_atoms, into=None):
        stop = self.n_structures if stop is None else stop
        names = list(self._stored) if names is None else names
        bounds = start + np.array(plan_chunks(self.n_atoms[start:stop], chunk_atoms))
        per = {**self._result_fields, **self._stored}
        for a, b in itertools.pairwise(bounds):
            lo, hi = self._offsets[a], self._offsets[b]
            data = {"atom": {}, "structure": {}}
            present = {}
            for name in names:
                ds = self._datasets[name]
                if per[name].per == "atom":
                    out = into(name, hi - lo) if into else None
                    data["atom"][name] = read_rows(self.path, ds, lo, hi, out)
                else:
                    data["structure"][name] = read_rows(self.path, ds, a, b)
                if name in self._masks:
                    present[name] = read_rows(self.path, self._masks[name], a, b)
            yield Chunk(int(a), self.n_atoms[a:b], data["atom"], data["structure"], present)


class Molecule:
    """One group of the conformer layout: C conformers of the same n atoms."""

    def __init__(self, path, group):
        self.name = group.name
        ds = next(group[k] for k in NUMBER_NAMES if k in group)
        numbers = ds[()]
        if numbers.ndim != 1:
            raise DataError(f"{path}: {ds.name} must be 1-D, not of shape {numbers.shape}")
        if numbers.dtype.kind in "SUO":
            from ase.data import atomic_numbers
            try:
                numbers = [atomic_numbers[s.decode() if isinstance(s, bytes) else s]
                           for s in numbers]
            except KeyError as err:
                raise DataError(f"{path}: {ds.name} holds {err}, not a chemical symbol") from err
        self.numbers = np.asarray(numbers, np.int64)
        n = len(self.numbers)
        found = [k for k in POSITION_NAMES if k in group]
        if len(found) != 1:
            raise DataError(f"{path}: group {group.name} must hold exactly one of "
                            f"{', '.join(POSITION_NAMES)}; it holds {found or 'none'}")
        positions = group[found[0]]
        if positions.ndim != 3 or positions.shape[1:] != (n, 3):
            raise DataError(f"{path}: {positions.name} has shape {positions.shape}, "
                            f"not (conformers, {n}, 3) for the {n} atomic numbers")
        self.n_conformers = positions.shape[0]
        self.n_atoms = n
        self.datasets = {"positions": (found[0], positions.shape[1:], positions.dtype)}
        for key, ds in group.items():
            if (key not in NUMBER_NAMES + POSITION_NAMES and isinstance(ds, h5py.Dataset)
                    and ds.dtype.kind in NUMERIC_KINDS and ds.ndim
                    and ds.shape[0] == self.n_conformers):
                self.datasets[key] = (key, ds.shape[1:], ds.dtype)


def find_molecules(path, h5):
    """Groups holding atomic numbers, at any depth, in file order (links not followed)."""
    molecules = []

    def walk(group):
        if any(isinstance(group.get(k), h5py.Dataset) for k in NUMBER_NAMES):
            molecules.append(Molecule(path, group))
        for key in group:
            if isinstance(group.get(key, getlink=True), h5py.HardLink) and isinstance(
                    group[key], h5py.Group):
                walk(group[key])

    walk(h5)
    return molecules


class ConformerBatch(Batch):
    """The conformer-group layout: each conformer of each molecule group is one structure."""

    format = "conformers"

    def __init__(self, path, h5):
        super().__init__(path)
        self._h5 = h5
        self._molecules = find_molecules(path, h5)
        if not self._molecules:
            raise DataError(f"{path}: HDF5 file with neither the {FORMAT} layout (no format "
                            "attribute) nor conformer groups (no atomic_numbers or species)")
        self.n_atoms = np.repeat([m.n_atoms for m in self._molecules],
                                 [m.n_conformers for m in self._molecules]).astype(np.int64)
        self._first = np.cumsum([0] + [m.n_conformers for m in self._molecules])
        # (C, n, ...) is per atom, unless the same name has another shape in another group
        per_atom = {}
        for m in self._molecules:
            for name, (_, shape, _) in m.datasets.items():
                per_atom[name] = per_atom.get(name, True) and shape[:1] == (m.n_atoms,)
        schema = Schema()
        for m, first in zip(self._molecules, self._first):
            schema.add(path, FieldInfo("numbers", "atom", (), np.dtype(np.int64)), first)
            for name, (_, shape, dtype) in m.datasets.items():
                info = (FieldInfo(name, "atom", shape[1:], dtype) if per_atom[name]
                        else FieldInfo(name, "structure", shape, dtype))
                schema.add(path, info, first)
        self._stored = dict(schema)

    def close(self):
        self._h5.close()

    def _present(self, name):
        have = np.repeat([name == "numbers" or name in m.datasets for m in self._molecules],
                         [m.n_conformers for m in self._molecules])
        return None if have.all() else have

    def _pieces(self, start, stop, names, chunk_atoms, into=None):
        stop = self.n_structures if stop is None else stop
        m = int(np.searchsorted(self._first, start, side="right")) - 1
        while start < stop:
            mol, first = self._molecules[m], self._first[m]
            group = self._h5[mol.name]
            step = max(1, chunk_atoms // max(mol.n_atoms, 1))
            end = min(stop, first + mol.n_conformers)
            for a in range(start - first, end - first, step):
                b = min(a + step, end - first)
                data = {"atom": {}, "structure": {}}
                if names is None or "numbers" in names:
                    data["atom"]["numbers"] = np.tile(mol.numbers, b - a)
                for name, (key, _, _) in mol.datasets.items():
                    if names is None or name in names:
                        array = read_rows(self.path, group[key], a, b)
                        per = self._stored[name].per
                        data[per][name] = (array.reshape(-1, *array.shape[2:]) if per == "atom"
                                           else array)
                yield Chunk(int(first + a), np.full(b - a, mol.n_atoms, np.int64),
                            data["atom"], data["structure"])
            start, m = end, m + 1
