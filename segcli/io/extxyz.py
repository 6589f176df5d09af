"""Extended XYZ files read a structure at a time with NumPy: the same pieces, bit for bit, as
`ase.io.iread(path, format="extxyz")` followed by `atoms_piece`, in half the time.

The comment line goes through ASE's own `key_val_str_to_dict` and `parse_properties`; the atom
lines are split once and each column block converted by NumPy with Python's `float` and `int`
rules. A structure with anything else (cell vectors as VEC lines, a missing or extra column, an
unknown element, Properties that ASE maps in other ways, ...) is read by ASE alone, from its
own lines.
"""

import io
import re
import sys
from functools import lru_cache
from itertools import islice

import numpy as np

from segcli.errors import DataError
from segcli.io.asefiles import (
    DECOMPRESSION_ERRORS,
    atoms_piece,
    decompression_error,
    structure_piece,
)

DEFAULT_PROPERTIES = "species:S:1:pos:R:3"  # what ASE assumes without Properties
DTYPES = {"R": np.float64, "I": np.int32, "L": np.bool_}  # ASE's column dtypes
BOOLS = {"T": True, "F": False, "True": True, "False": False}
# Columns that ASE passes to Atoms() or makes constraints of, with the types and widths handled
SPECIAL = {"numbers": {("I", 1), ("R", 1)}, "symbols": {("S", 1)}, "positions": {("R", 3)},
           "initial_charges": {("R", 1)}, "move_mask": {("L", 1), ("L", 3)}}
RAW_RESULTS = {"energy", "magmom", "free_energy"}  # SinglePointCalculator keeps these as given


@lru_cache(maxsize=64)
def columns(properties):
    """(ASE name, type, first column, width) of each property of a Properties string, and the
    number of columns; ValueError when the fast path does not handle them."""
    from ase.calculators.calculator import all_properties
    from ase.io.extxyz import parse_properties

    props, names, _, _ = parse_properties(properties)
    out, width = [], 0
    for name, ptype in zip(names, properties.split(":")[1::3]):
        ase_name, cols = props[name]
        if cols < 1 or (ptype, cols) not in SPECIAL.get(ase_name, {(ptype, cols)}) or (
                ptype == "S" and ase_name in all_properties):
            raise ValueError(f"property {name}:{ptype}:{cols}")
        out.append((ase_name, ptype, width, cols))
        width += cols
    found = {c[0] for c in out}
    if len(found) < len(out) or "positions" not in found or not found & {"numbers", "symbols"}:
        raise ValueError(f"properties {properties}")
    return tuple(out), width


def atomic_numbers(tokens, known):
    """int64 atomic numbers of species tokens, as ASE maps them; `known` caches token -> Z."""
    from ase.data import atomic_numbers as table

    for token in set(tokens).difference(known):
        known[token] = table[token.capitalize()]
    return np.array([known[t] for t in tokens], np.int64)


def convert(block, ptype):
    """A block of tokens (object array) as ASE's column type."""
    if ptype == "L":
        return np.array([BOOLS[t] for t in block.ravel()], bool).reshape(block.shape)
    return block.astype(DTYPES[ptype])


def parse_frame(lines, n, species):
    """(arrays, cell, pbc, info, results) of one structure from its comment and atom lines,
    as the Atoms that ASE builds holds them (arrays in atoms.arrays order, results as its
    SinglePointCalculator keeps them; atomic numbers of a float column as floats, which
    `structure_piece` checks); raises on anything the fast path does not handle."""
    from ase.calculators.calculator import all_properties
    from ase.io.extxyz import key_val_str_to_dict, per_config_properties

    comment = lines[0].strip()
    info = key_val_str_to_dict(comment) if comment else {}
    pbc = np.zeros(3, bool)
    pbc[:] = info.pop("pbc") if "pbc" in info else "Lattice" in info
    cell = np.array(info.pop("Lattice").T, float) if "Lattice" in info else np.zeros((3, 3))
    layout, width = columns(info.pop("Properties", DEFAULT_PROPERTIES))
    table = np.array([line.split() for line in lines[1:]], object)
    if table.shape != (n, width):
        raise ValueError(f"atom lines of shape {table.shape}, expected {(n, width)}")

    parsed = {}
    for name, ptype, first, cols in layout:
        if ptype == "S" and name != "symbols":
            continue  # strings: kept by ASE as object arrays, which are not fields
        block = table[:, first] if cols == 1 else table[:, first:first + cols]
        parsed[name] = block if ptype == "S" else convert(block, ptype)
    numbers = parsed.pop("numbers", None)
    symbols = parsed.pop("symbols", None)
    if numbers is None:
        numbers = atomic_numbers(symbols.tolist(), species)
    arrays = {"numbers": numbers if numbers.dtype.kind == "f" else numbers.astype(np.int64),
              "positions": parsed.pop("positions")}
    for name in ("initial_charges", "move_mask"):  # move_mask: constraints, as atoms_piece
        if name in parsed:
            arrays[name] = parsed.pop(name)

    results = {}
    for name, array in parsed.items():
        if name in all_properties:
            results[name] = array
        else:
            arrays[name] = array
    for key in list(info):
        if key in per_config_properties:
            results[key] = info.pop(key)
            if key == "stress" and results[key].shape == (3, 3):
                stress = results[key]
                results[key] = np.array([stress[0, 0], stress[1, 1], stress[2, 2],
                                         stress[1, 2], stress[0, 2], stress[0, 1]])
    results = {k: v if k in RAW_RESULTS else np.array(v, float)
               for k, v in results.items() if v is not None}
    return arrays, cell, pbc, info, results


def _not_text(path):
    """DataError naming the first line of `path` (decompressed) that is not UTF-8."""
    from ase.io.formats import open_with_compression

    with open_with_compression(path, "rb") as f:
        for number, line in enumerate(f, 1):
            err = _utf8_error(line)
            if err:
                return DataError(f"{path}: line {number} is not UTF-8 text (byte "
                                 f"{err.object[err.start]:#04x}: {err.reason})")
    return DataError(f"{path}: not UTF-8 text")


def _utf8_error(data):
    """The UnicodeDecodeError of decoding `data` as UTF-8, or None."""
    try:
        data.decode()
    except UnicodeDecodeError as err:
        return err
    return None


class _Lines:
    """The lines of a text file, numbered; DataError for text that is not UTF-8 or compressed
    data that is cut short or corrupt."""

    def __init__(self, path, file):
        self.path, self._file, self.number = path, file, 0

    def read(self, count=1):
        """The next `count` lines (fewer at the end of the file)."""
        try:
            lines = list(islice(self._file, count))
        except UnicodeDecodeError:
            raise _not_text(self.path) from None
        except DECOMPRESSION_ERRORS as err:
            raise decompression_error(self.path, err) from None
        self.number += len(lines)
        return lines

    def header(self):
        """The next line that is not blank, "" at the end of the file."""
        while True:
            line = "".join(self.read())
            if not line or line.strip():
                return line


def _count(path, lines, header, index):
    """The atom count on a header line; DataError naming the line when it holds none."""
    try:
        n = int(header)
    except ValueError:
        n = -1
    if n < 0:
        raise DataError(f"{path}: line {lines.number}: expected the atom count of structure "
                        f"{index}, found {header.strip()[:60]!r}")
    if n >= sys.maxsize:
        raise DataError(f"{path}: line {lines.number}: structure {index} claims {n} atoms, "
                        "more than any file holds")
    return n


def _ase_frame(path, index, text):
    """One structure read by ASE alone from its `text`, as `atoms_piece` makes it."""
    import ase.io

    try:
        atoms = ase.io.read(io.StringIO(text), format="extxyz")
    except Exception as err:
        raise DataError(f"{path}: ASE cannot read structure {index} as extxyz "
                        f"({type(err).__name__}: {err})") from err
    return atoms_piece(path, atoms, index)


def pieces(path, start, stop):
    """Yield a piece per structure from `start` to `stop` (None: the end), as `atoms_piece`
    makes them from what ASE reads of each; a structure that the fast path does not handle
    (or that it fails on) is read by ASE alone. Blank lines between structures are skipped
    (ASE's own reader ends the file at the first); anything else where an atom count belongs
    is a DataError naming the line."""
    species = {}
    with _open_text(path) as f:
        lines, index = _Lines(path, f), 0
        header = lines.header()
        while header and (stop is None or index < stop):
            n = _count(path, lines, header, index)
            frame = lines.read(n + 1)
            if len(frame) <= n:
                raise DataError(f"{path}: structure {index} claims {n} atoms, but the file "
                                f"ends {max(len(frame) - 1, 0)} atom line(s) later")
            following, vectors = lines.header(), []
            while following.lstrip().startswith("VEC"):
                vectors.append(following)
                following = lines.header()
            if index >= start:
                yield _piece(path, index, n, [header, *frame, *vectors], species)
            header = following
            index += 1


def _open_text(path):
    """The file `path` open for reading text, decompressed as its content (not its name) says:
    gzip, bzip2 or xz, as content detection reads it (a compressed file piped to stdin, or
    named .extxyz, is extended XYZ too)."""
    import importlib

    from segcli.io.formats import COMPRESSIONS

    with open(path, "rb") as f:
        start = f.read(8)
    module = next((m for magic, m in COMPRESSIONS.items() if start.startswith(magic)), None)
    if module is None:
        return open(path)
    return importlib.import_module(module).open(path, "rt")


_PROPERTIES = re.compile(r"""Properties=["']?([^\s"']+)""")
_MOST_COLUMNS = 1 << 16


def _check_columns(path, index, text):
    """DataError when the comment line's Properties declare more columns than any reader
    should make room for (ASE makes an entry for each before it reads an atom)."""
    found = _PROPERTIES.search(text[1]) if len(text) > 1 else None
    counts = found.group(1).split(":")[2::3] if found else []
    declared = sum(int(c) if c.isdigit() and len(c) < 8 else _MOST_COLUMNS + 1 for c in counts)
    if declared > _MOST_COLUMNS:
        raise DataError(f"{path}: structure {index}: its Properties declare {declared} columns, "
                        f"more than the {_MOST_COLUMNS} segcli reads")


def _piece(path, index, n, text, species):
    """The piece of one structure from its lines: the fast path's, or ASE's where that does
    not apply (no atoms, VEC lines, ...)."""
    _check_columns(path, index, text)
    if n and len(text) == n + 2:
        try:
            return structure_piece(path, index, n, *parse_frame(text[1:], n, species))
        except DataError:
            raise
        except Exception:  # noqa: BLE001  (what the fast path does not handle: ASE reads it)
            pass
    return _ase_frame(path, index, "".join(text))
