"""Datasets as functions: open (a Batch to read), describe (what `segcli info` shows),
convert (to segcli HDF5 or an ASE format) and merge (shard outputs into one file), with the
options, results and refusals of the commands of the same names.

    import segcli
    with segcli.open("data.extxyz") as batch:
        len(batch), batch.n_atoms, batch.atoms(0)
    segcli.convert("data.extxyz", "data.h5")
"""

import math
import os
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from segcli.api.common import names_hdf5, refuse_output_among_inputs, structure_slice
from segcli.api.curate import COMMAND_NAMES, tell, units_left
from segcli.errors import ArgumentError, DataError, literal
from segcli.progress import tracked

MOST_COMMON = 20
"""The values of a string field that `describe` lists (the most common)."""


class Batch:
    """Structures read from files (see `open`): `len()` structures, `n_atoms` (S,) their
    atom counts, `fields` (name -> FieldInfo: per, shape, dtype, units), `chunks()` of NumPy
    arrays and `atoms(i)` as ase.Atoms. Close it (or use `with`) to release its files.

        with segcli.open("data.h5") as batch:
            for chunk in batch.chunks(100_000, ["forces"]):
                chunk["forces"]  # (atoms of the chunk's structures, 3)
    """

    def __init__(self, batch):
        self._batch = batch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._batch.close()

    def __len__(self):
        return self._batch.n_structures

    def __repr__(self):
        return f"<segcli.Batch {self.path}: {len(self)} structures, {self.n_atoms.sum()} atoms>"

    @property
    def path(self):
        """What the batch's files are called (one path, or those of many joined)."""
        return self._batch.path

    @property
    def format(self):
        """The format the files were read as (`multi` for many files)."""
        return self._batch.format

    @property
    def n_atoms(self):
        """(S,) int64: each structure's atom count."""
        return self._batch.n_atoms

    @property
    def fields(self):
        """name -> segcli.io.FieldInfo (per "atom" or "structure", shape, dtype, units) of
        every field, stored results included."""
        return dict(self._batch.fields)

    def present(self, name):
        """(S,) bool: the structures that have field `name` (None: all have it)."""
        return self._batch.present(name)

    def chunks(self, chunk_atoms=1_000_000, fields=None, *, structures=slice(None)):
        """Chunk after Chunk of whole structures (at most `chunk_atoms` atoms, a bigger
        structure alone, of the slice `structures`) holding `fields` (default: all): each maps
        a field's name (and "n_atoms") to a NumPy array of the chunk's atoms or structures."""
        names = list(self.fields) if fields is None else [fields] if isinstance(
            fields, str) else list(fields)
        if not isinstance(chunk_atoms, (int, np.integer)) or chunk_atoms < 1:
            raise ArgumentError(f"{{chunk_atoms}} must be a positive integer, got "
                                f"{literal(repr(chunk_atoms))}")
        structures = structure_slice(structures) or slice(None)
        for chunk in self._batch.iter_chunks(names, chunk_atoms=int(chunk_atoms),
                                             structures=structures):
            yield Chunk(chunk)

    def atoms(self, index):
        """Structure `index` (negative counts from the end) as an ase.Atoms: positions,
        numbers, cell, pbc, energy, forces, stress as a SinglePointCalculator, other fields
        as arrays and info, `fixed` as FixAtoms (as `segcli convert` exports it)."""
        from segcli.io.export import structure_atoms

        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index takes an integer, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"structure {index} of {len(self)}")
        index = int(index) % len(self)
        stored = [n for n in self.fields if n not in self._batch.derived]
        (chunk,) = self._batch.iter_chunks(stored, structures=slice(index, index + 1))
        return structure_atoms(self._batch.path, index, chunk)


class Chunk(Mapping):
    """Consecutive whole structures of a Batch: field name (or "n_atoms") -> NumPy array, a
    per-atom field's rows those of the chunk's atoms, a per-structure field's (and n_atoms)
    one per structure; `.atoms` and `.structures` hold each kind, `.start` is the number of
    the first structure, `.structure_numbers` those of all, and `.present` maps a field that
    only some structures have to (S_c,) bool, True where one has it.

        chunk["forces"][:chunk["n_atoms"][0]]  # the forces of the chunk's first structure
    """

    def __init__(self, chunk):
        self._chunk = chunk
        self.start, self.n_atoms, self.present = chunk.start, chunk.n_atoms, chunk.present
        self.atoms, self.structures = chunk.atoms, chunk.structures

    @property
    def structure_numbers(self):
        return self._chunk.structure_numbers

    def __getitem__(self, name):
        if name == "n_atoms":
            return self.n_atoms
        return self.atoms[name] if name in self.atoms else self.structures[name]

    def __iter__(self):
        yield from self.atoms
        yield from self.structures
        yield "n_atoms"

    def __len__(self):
        return len(self.atoms) + len(self.structures) + 1


def open(inputs, *, format=None):
    """The structures of `inputs` (a path, glob pattern, directory, @LIST, or a list of
    those) as one Batch, each file in the format segcli tells by its content, or in `format`
    (segcli, conformers, extxyz, db, aselmdb, or any format ASE reads).

        with segcli.open("sample_data/metals.extxyz") as batch:
            print(len(batch), batch.n_atoms.sum(), sorted(batch.fields))
            atoms = batch.atoms(0)
    """
    from segcli.io import open_inputs
    from segcli.io.formats import named

    if format is not None:
        try:
            named(format)
        except DataError as err:
            raise ArgumentError(f"{{format}} {literal(str(err).removeprefix('--input-format '))}") \
                from None
    return Batch(open_inputs(inputs, input_format=format))


def describe(inputs, *, format=None):
    """What `segcli info` shows of `inputs`, as the dict `--json` prints (a NaN fill_value
    as the string "nan"): path, format, structures, atoms, sources, fields, conflicts,
    results, elements and the most common values of string fields.

        segcli.api.data.describe("sample_data/metals.h5")["fields"]["forces"]["shape"]
    """
    with open(inputs, format=format) as opened:
        return described(opened._batch)


def described(batch):
    """describe's dict of an open batch (a segcli.io Batch)."""
    from segcli.curate.statistics import census
    from segcli.errors import for_user

    def field(f):
        present = batch.present(f.name)
        out = {"per": f.per, "shape": list(f.shape),
               "dtype": "str" if f.dtype == object else str(f.dtype), "units": f.units,
               "derived": f.name in batch.derived, "result": f.name in batch.result_fields,
               "present": batch.n_structures if present is None else int(present.sum())}
        fill = batch.fill_value(f.name) if present is not None else None
        if fill is not None:
            fill = fill.item() if hasattr(fill, "item") else fill  # NumPy's as Python's
            out["fill_value"] = "nan" if isinstance(fill, float) and math.isnan(fill) \
                else fill
        return out

    fields = sorted(batch.fields.values(), key=lambda f: f.per != "atom")
    elements, strings = census(batch)
    members = [{**m, "path": for_user(m["path"])} for m in batch.members] \
        if batch.format == "multi" else None
    return {
        "path": for_user(batch.path),
        "format": batch.format,
        "structures": batch.n_structures,
        "atoms": int(batch.n_atoms.sum()),
        "sources": [for_user(source) for source in batch.sources],
        **({"members": members} if members else {}),
        "fields": {f.name: field(f) for f in fields},
        "conflicts": dict(batch.fields.conflicts),
        "results": batch.results,
        "elements": None if elements is None else _elements(elements),
        "values": {name: {"distinct": len(counts), "most_common": dict(
            sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MOST_COMMON])}
                   for name, counts in strings.items()},
    }


def _elements(counts):
    """Each element present: its symbol, atomic number, atoms and structures holding it, from
    `counts` (see segcli.curate.statistics.census)."""
    from ase.data import chemical_symbols

    return [{"symbol": chemical_symbols[z], "number": int(z), "atoms": int(counts[0, z]),
             "structures": int(counts[1, z])} for z in counts[0].nonzero()[0]]


CASTS = ("float64", "float32", "int64", "int32", "int16", "int8", "uint8", "bool", "str")
"""The dtypes `cast` takes."""


def checked_casts(casts):
    """`casts` (name -> dtype name), each dtype one of CASTS."""
    for dtype in (casts or {}).values():
        if dtype not in CASTS:
            raise ArgumentError(f"{{cast}} {literal(repr(dtype))} is not one of "
                                f"{', '.join(CASTS)}")
    return casts


def checked_units(units):
    """`units` (name -> unit) with each unit as segcli spells it (see segcli.io.units)."""
    from segcli.io.units import canonical, known

    out = {}
    for name, unit in (units or {}).items():
        if canonical(unit) is None:
            raise ArgumentError(f"{{units}} {literal(repr(unit))} is not a unit segcli knows: "
                                f"{', '.join(known())}")
        out[name] = canonical(unit)
    return out


class Converted(NamedTuple):
    """What `converted` wrote: structures, atoms, and the fields (None for an ASE format)."""

    structures: int
    atoms: int
    fields: list | None


def convert(inputs, output, **options):
    """Write the structures of `inputs` (files, patterns, directories, @LISTs) to `output`, as
    `segcli convert` does: segcli HDF5 (.h5, .hdf5), or any format ASE writes, by its name.
    `options`: compression ("gzip", "lzf"), chunk_atoms, fill_missing ("nan"), fields, drop
    (lists of names), rename ({old: new}), cast ({name: dtype}), units ({name: unit}),
    to_ase_units, force, input_format, progress. Returns `output`'s path.

        segcli.convert("sample_data/metals.extxyz", "metals.h5")
        segcli.convert(["a.traj", "b.extxyz"], "ab.h5", fill_missing="nan", drop=["tags"])
    """
    converted(inputs, output, **options)
    return os.fspath(output)


def converted(inputs, output, *, compression=None, chunk_atoms=100_000, fill_missing=None,
              fields=None, drop=None, rename=None, cast=None, units=None, to_ase_units=False,
              force=False, input_format=None, progress=False):
    """`convert`, returning what it wrote (Converted: structures, atoms, fields).

        converted("data.extxyz", "data.h5").fields  # the fields written
    """
    from segcli.io import convert as convert_files
    from segcli.io import expand_inputs
    from segcli.io.export import export, export_format

    if fields is not None and drop is not None:
        raise ArgumentError("{fields} and {drop} cannot be used together",
                            commands={"fields": "--fields"})
    if compression not in (None, "gzip", "lzf"):
        raise ArgumentError(f"{{compression}} is gzip or lzf, got {literal(repr(compression))}")
    if fill_missing is not None and not (fill_missing == "nan" or (isinstance(
            fill_missing, float) and math.isnan(fill_missing))):
        raise ArgumentError(f"{{fill_missing}} is 'nan' or None, got "
                            f"{literal(repr(fill_missing))}")
    if drop is not None and "n_atoms" in drop:
        raise ArgumentError("{drop} n_atoms is always kept")
    output = os.fspath(output)
    fmt = export_format(output)
    if fmt is not None and (compression or fill_missing is not None):
        option = "{compression}" if compression else "{fill_missing}"
        raise ArgumentError(f"{option} applies to a segcli HDF5 output, not to {fmt}")
    paths = expand_inputs(inputs)
    refuse_output_among_inputs(output, paths, "convert writes a new file")
    left = {}
    choice = {"fields": fields, "drop": drop, "rename": dict(rename or {}),
              "cast": checked_casts(dict(cast or {})), "units": checked_units(units),
              "to_ase_units": to_ase_units, "left": left}
    with tracked(progress, f"converting to {output}") as bar:
        if fmt is not None:
            structures, atoms = export(paths, output, fmt, chunk_atoms=chunk_atoms, force=force,
                                       progress=bar, input_format=input_format, **choice)
            written = None
        else:
            structures, atoms, written = convert_files(
                paths, output, compression=compression, chunk_atoms=chunk_atoms,
                fill_missing=None if fill_missing is None else np.nan, force=force,
                progress=bar, input_format=input_format, **choice)
    units_left(output, left)
    return Converted(structures, atoms, written)


def merge(parts, output, *, virtual=False, partial=False, force=False):
    """Join `parts` (outputs of reduce, grad or stats with a shard, or of one input over
    disjoint structure ranges; paths, patterns, directories or @LISTs) into `output`, the
    file one run over all their structures writes, as `segcli merge` does; `virtual` maps
    the results onto the parts instead of copying them; `partial` joins an incomplete set
    (a segcli.errors.Note names what lacks). Returns `output`'s path.

        segcli.merge("parts/r-*.h5", "rms.h5")
    """
    return merged(parts, output, virtual=virtual, partial=partial, force=force).path


class Merged(NamedTuple):
    """What `merged` wrote: its path, the range of structures, and how many parts."""

    path: str
    start: int
    stop: int
    parts: int


def merged(parts, output, *, virtual=False, partial=False, force=False):
    """`merge`, returning what it wrote (Merged: path, start, stop, parts).

        merged("parts/r-*.h5", "rms.h5").parts  # how many parts were joined
    """
    from segcli.io import expand_inputs
    from segcli.io.coverage import ranges_text, refuse_skipped
    from segcli.io.merge import check_parts, lacking, merge_parts

    output = os.fspath(output)
    if not names_hdf5(output):
        raise ArgumentError(f"{{output}} {literal(output)}: merge writes segcli HDF5; name it "
                            ".h5 or .hdf5", commands=COMMAND_NAMES)
    skipped = []
    paths = expand_inputs(parts, skipped)
    refuse_skipped(skipped)
    refuse_output_among_inputs(output, paths, "merge writes a new file")
    checked = check_parts(paths, partial)
    merge_parts(checked, output, virtual=virtual, force=force)
    if lacking(checked):
        tell(f"{output}: lacks structures {ranges_text(lacking(checked))} (--partial)")
    return Merged(output, checked[0].start, checked[-1].stop, len(checked))
