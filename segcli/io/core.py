"""What every reader shares: field descriptions, chunks of whole structures, derived fields."""

from typing import NamedTuple

import numpy as np

from segcli.errors import DataError

FORMAT = "segcli-batch"
VERSION = 1
NUMERIC_KINDS = "biufc"


class FieldInfo(NamedTuple):
    """A field: per "atom" or "structure", its trailing shape and dtype."""

    name: str
    per: str
    shape: tuple
    dtype: np.dtype


class Chunk(NamedTuple):
    """Consecutive whole structures from `start`: per-atom arrays (N_c, ...) and per-structure
    arrays (S_c, ...)."""

    start: int
    n_atoms: np.ndarray
    atoms: dict
    structures: dict


def check_fill(path, index, info, fill):
    """Raise DataError unless a field that structure `index` lacks can be filled with `fill`."""
    if fill is None:
        raise DataError(f"{path}: structure {index} has no field '{info.name}', which other "
                        "structures have (`segcli convert --fill-missing nan` fills the gaps)")
    if np.isnan(fill) and info.dtype.kind not in "fc":
        raise DataError(f"{path}: structure {index} has no field '{info.name}', and its dtype "
                        f"{info.dtype} cannot hold NaN")


def plan_chunks(n_atoms, chunk_atoms):
    """Bounds [b0, b1, ...] of runs of whole structures holding at most `chunk_atoms` atoms.

    A structure bigger than the bound forms a run of its own.
    """
    cum = np.concatenate([[0], np.cumsum(n_atoms, dtype=np.int64)])
    bounds = [0]
    while bounds[-1] < len(n_atoms):
        a = bounds[-1]
        b = int(np.searchsorted(cum, cum[a] + chunk_atoms, side="right")) - 1
        bounds.append(max(b, a + 1))
    return bounds


def split_piece(piece, k):
    """The first `k` structures of a piece and the rest."""
    cut = int(piece.n_atoms[:k].sum())
    head = Chunk(piece.start, piece.n_atoms[:k],
                 {n: a[:cut] for n, a in piece.atoms.items()},
                 {n: a[:k] for n, a in piece.structures.items()})
    tail = Chunk(piece.start + k, piece.n_atoms[k:],
                 {n: a[cut:] for n, a in piece.atoms.items()},
                 {n: a[k:] for n, a in piece.structures.items()})
    return head, tail


def rechunk(pieces, chunk_atoms):
    """Group a stream of pieces (consecutive structures) into lists forming chunks of whole
    structures with at most `chunk_atoms` atoms; the same runs as `plan_chunks`."""
    group, room = [], chunk_atoms
    for piece in pieces:
        total = int(piece.n_atoms.sum())
        if total <= room and len(piece.n_atoms):  # the common case: the whole piece fits
            group.append(piece)
            room -= total
            continue
        while len(piece.n_atoms):
            k = int(np.searchsorted(np.cumsum(piece.n_atoms), room, side="right"))
            if k == 0 and group:
                yield group
                group, room = [], chunk_atoms
                continue
            head, piece = split_piece(piece, max(k, 1))
            group.append(head)
            room -= int(head.n_atoms.sum())
            if k == 0 or len(piece.n_atoms):
                yield group
                group, room = [], chunk_atoms
    if group:
        yield group


def merge_pieces(path, pieces, schema, fill=None):
    """One Chunk from consecutive pieces, with every field of `schema` (name -> FieldInfo), in
    the schema's dtype or a wider one that the pieces need.

    A piece without a field raises DataError naming its first structure, or, given `fill`
    (NaN), gets the field filled with it.
    """
    n_atoms = np.concatenate([p.n_atoms for p in pieces]) if len(pieces) > 1 else pieces[0].n_atoms
    out = {"atom": {}, "structure": {}}
    for name, info in schema.items():
        parts = [(p.atoms if info.per == "atom" else p.structures).get(name) for p in pieces]
        for i in [i for i, part in enumerate(parts) if part is None]:
            check_fill(path, pieces[i].start, info, fill)
            rows = int(pieces[i].n_atoms.sum()) if info.per == "atom" else len(pieces[i].n_atoms)
            parts[i] = np.full((rows, *info.shape), fill, info.dtype)
        shapes = {part.shape[1:] for part in parts}
        if shapes != {info.shape}:
            i = next(i for i, part in enumerate(parts) if part.shape[1:] != info.shape)
            raise DataError(f"{path}: field '{name}' has shape {parts[i].shape[1:]} per "
                            f"{info.per} in structure {pieces[i].start}, {info.shape} elsewhere")
        merged = parts[0] if len(parts) == 1 else np.concatenate(parts)
        out[info.per][name] = merged.astype(np.result_type(info.dtype, merged.dtype), copy=False)
    return Chunk(pieces[0].start, n_atoms, out["atom"], out["structure"])


class Schema(dict):
    """Fields seen so far (name -> FieldInfo); dtypes promote as NumPy does, shapes must agree."""

    def add(self, path, info, index):
        """Add a field found in structure `index` of `path`."""
        known = self.get(info.name)
        if known is None:
            self[info.name] = info
        elif (known.per, known.shape) != (info.per, info.shape):
            raise DataError(
                f"{path}: field '{info.name}' is per {info.per} with shape {info.shape} in "
                f"structure {index}, per {known.per} with shape {known.shape} before")
        elif known.dtype != info.dtype:
            self[info.name] = known._replace(dtype=np.result_type(known.dtype, info.dtype))

    def add_piece(self, path, piece):
        for per, data in (("atom", piece.atoms), ("structure", piece.structures)):
            for name, array in data.items():
                self.add(path, FieldInfo(name, per, array.shape[1:], array.dtype), piece.start)


def derivable(stored):
    """Derived fields (name -> FieldInfo) that the stored fields allow and do not hold."""
    out = {}
    if "velocities" not in stored and "momenta" in stored and (
            "masses" in stored or "numbers" in stored):
        mass = stored["masses"].dtype if "masses" in stored else np.float64
        out["velocities"] = FieldInfo("velocities", "atom", stored["momenta"].shape,
                                      np.result_type(stored["momenta"].dtype, mass))
    if "scaled_positions" not in stored and "positions" in stored and "cell" in stored:
        out["scaled_positions"] = FieldInfo("scaled_positions", "atom", (3,), np.dtype(np.float64))
    return out


def needs(name, stored):
    """Stored fields that a requested field is read from."""
    if name in stored:
        return [name]
    if name == "velocities":
        return ["momenta", "masses" if "masses" in stored else "numbers"]
    return ["positions", "cell"]


def derive(name, chunk):
    """Compute a derived field of a chunk exactly as ASE's Atoms methods do."""
    atoms = chunk.atoms
    if name == "velocities":
        if "masses" in atoms:
            masses = atoms["masses"]
        else:
            from ase.data import atomic_masses
            masses = atomic_masses[atoms["numbers"]]
        return atoms["momenta"] / masses[:, np.newaxis]
    return scaled_positions(atoms["positions"], chunk.structures["cell"], chunk.n_atoms)


def scaled_positions(positions, cells, n_atoms):
    """Positions in the basis of each structure's cell (zero cell vectors completed as ASE does);
    structures of equal size are solved together."""
    from ase.geometry.cell import complete_cell

    cells = np.array(cells, dtype=np.float64)
    for s in np.flatnonzero((~cells.any(axis=2)).any(axis=1)):
        cells[s] = complete_cell(cells[s])
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    out = np.empty(positions.shape, np.float64)
    for n in np.unique(n_atoms):
        which = np.flatnonzero(n_atoms == n)
        rows = offsets[which][:, None] + np.arange(n)
        block = np.linalg.solve(cells[which].transpose(0, 2, 1), positions[rows].transpose(0, 2, 1))
        out[rows] = block.transpose(0, 2, 1)
    return out


class Batch:
    """The structures of one file, read as chunks of whole structures.

    Subclasses provide `n_atoms`, `_stored` (name -> FieldInfo of the fields in the file) and
    `_pieces(start, stop, names, chunk_atoms, into=None)`, which yields Chunks of consecutive
    structures from `start` to `stop` (None: the end) holding those of `names` (None: all) they
    have, reading a stored per-atom field into `into(name, rows)` where they can (see iter_chunks).
    """

    format = ""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Release the file."""

    @property
    def n_structures(self):
        return len(self.n_atoms)

    @property
    def fields(self):
        """name -> FieldInfo: the stored fields and those derivable from them."""
        return {**self._stored, **derivable(self._stored)}

    @property
    def derived(self):
        """Names of the fields that are computed, not stored."""
        return set(derivable(self._stored))

    @property
    def results(self):
        """name -> attrs of the results stored in the file."""
        return {}

    def iter_chunks(self, fields, *, chunk_atoms=1_000_000, structures=slice(None), into=None):
        """Yield Chunks of whole structures, at most `chunk_atoms` atoms each (a bigger structure
        alone), holding the requested per-atom and per-structure fields.

        `into(name, rows)`, if given, may return an array to read a chunk's stored per-atom field
        into (or None); a format that can read in place (segcli HDF5, when the array has the
        field's shape and dtype) then returns that array in the Chunk, saving a copy."""
        if isinstance(fields, str):
            fields = [fields]
        fields = list(dict.fromkeys(fields))
        available = self.fields
        for name in fields:
            if name not in available:
                raise DataError(f"{self.path}: no field '{name}'; its fields are: "
                                f"{', '.join(sorted(available)) or '(none)'}")
        if chunk_atoms < 1:
            raise ValueError(f"chunk_atoms must be at least 1, got {chunk_atoms}")
        start, stop, step = structures.indices(self.n_structures)
        if step != 1:
            raise ValueError(f"structures must be a slice with step 1, got {structures}")
        stored = self._stored
        read = {n: stored[n] for name in fields for n in needs(name, stored)}
        pieces = self._pieces(start, max(start, stop), list(read), chunk_atoms, into)
        for group in rechunk(pieces, chunk_atoms):
            chunk = merge_pieces(self.path, group, read)
            out = {"atom": {}, "structure": {}}
            for name in fields:
                data = chunk.atoms if available[name].per == "atom" else chunk.structures
                out[available[name].per][name] = data[name] if name in data else derive(name, chunk)
            yield Chunk(chunk.start, chunk.n_atoms, out["atom"], out["structure"])

    def stream(self, chunk_atoms):
        """Groups of pieces, each group one chunk, with every stored field each structure has;
        one pass over the file, even for ASE files (used by convert)."""
        return rechunk(self._pieces(0, None, None, chunk_atoms), chunk_atoms)


class EmptyBatch(Batch):
    """A file of zero bytes: zero structures."""

    format = "empty"
    n_atoms = np.zeros(0, np.int64)
    _stored = {}

    def _pieces(self, start, stop, names, chunk_atoms, into=None):
        return iter(())
