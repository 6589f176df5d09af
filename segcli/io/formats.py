"""The input formats segcli reads: one entry per reader, tried in order.

Adding a format means adding one `Format` to FORMATS: a name (what `Batch.format` is), what
`info` calls it, how its content is recognised and which Batch opens it.
"""

import os
import re
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from segcli.errors import DataError
from segcli.io.asedb import LMDB_MAGIC_OFFSET, LMDB_MAGICS, DatabaseBatch
from segcli.io.asefiles import (
    DECOMPRESSION_ERRORS,
    AseBatch,
    ExtxyzBatch,
    ase_format,
    decompression_error,
)
from segcli.io.core import EmptyBatch

HEAD_BYTES = 2048  # what content detection reads of a file (decompressed, as ASE reads it)
SQLITE_MAGIC = b"SQLite format 3\x00"


class Format(NamedTuple):
    """A reader: `can_open(path, head)` tells by the file's content (`head`: its first
    HEAD_BYTES) whether it is this format; `open(path)` returns the Batch (and, where
    `takes_counts`, `open(path, counts=n_atoms)` one that does not read its n_atoms again);
    `by_name(path)`, where given, claims a file that no entry recognised by content from its
    name alone, for formats whose content cannot tell (`open` then reports what is wrong)."""

    name: str
    description: str
    can_open: Callable
    open: Callable
    by_name: Callable = None
    stores_results: bool = False  # results can be written into the file in place
    copies_datasets: bool = False  # a subset is copied dataset by dataset (HDF5 to HDF5)
    takes_counts: bool = False  # open(path, counts=...) takes known n_atoms


def _hdf5(path):
    import h5py

    return h5py.is_hdf5(path)


def _has_format_attribute(path, head):
    import h5py

    from segcli.io.hdf5 import HDF5_ERRORS

    if not _hdf5(path):
        return False
    try:
        with h5py.File(path, "r") as h5:
            return "format" in h5.attrs
    except HDF5_ERRORS:
        return False  # a broken HDF5 file: the conformer reader says what is wrong


def _first_line_is_a_count(path, head):
    """ASE's own test for (extended) XYZ: a first line holding an atom count."""
    lines = head.splitlines()
    return bool(lines) and lines[0].strip().isdigit()


def _lmdb(path, head):
    return head[LMDB_MAGIC_OFFSET:LMDB_MAGIC_OFFSET + 4] in LMDB_MAGICS


def _json_db(path, head):
    """An object whose first key is a row id (ASE writes rows first) or, with no rows, "ids"."""
    return re.match(rb'\s*\{\s*("\d+"\s*:\s*\{|"ids"\s*:)', head) is not None


def _ase_content(path, head):
    """ASE knows the file by its content's magic, or ASE reads a structure from it in the
    format its name suggests."""
    from ase.io.formats import UnknownFileTypeError, match_magic

    fmt = ase_format(path)
    if fmt is None:
        return False
    try:
        return match_magic(head).name == fmt
    except UnknownFileTypeError:
        pass
    try:
        return next(AseBatch(path, fmt).structures(0, 1), None) is not None
    except DataError:
        return False


def _open_segcli(path, counts=None):
    from segcli.io.hdf5 import SegcliBatch, open_file

    return open_file(path, SegcliBatch, counts=counts)


def _open_conformers(path):
    from segcli.io.hdf5 import ConformerBatch, open_file

    return open_file(path, ConformerBatch)


def _open_ase(path):
    return AseBatch(path, ase_format(path))


FORMATS = [
    Format("empty", "empty file", lambda path, head: os.path.getsize(path) == 0, EmptyBatch),
    Format("segcli", "segcli HDF5", _has_format_attribute, _open_segcli,
           stores_results=True, copies_datasets=True, takes_counts=True),
    Format("conformers", "conformer-layout HDF5", lambda path, head: _hdf5(path),
           _open_conformers),
    Format("aselmdb", "ASE LMDB database (OMat24/OMol25 .aselmdb)", _lmdb,
           partial(DatabaseBatch, kind="aselmdb")),
    Format("db", "ASE SQLite database", lambda path, head: head.startswith(SQLITE_MAGIC),
           partial(DatabaseBatch, kind="db")),
    Format("json", "ASE JSON database", _json_db, partial(DatabaseBatch, kind="json")),
    Format("extxyz", "extended XYZ file", _first_line_is_a_count, ExtxyzBatch),
    Format("ase", "ASE-readable file", _ase_content, _open_ase,
           by_name=lambda path: ase_format(path) is not None),
]
"""Every reader, in the order they are tried: the first whose content matches opens a file."""

DESCRIPTIONS = {f.name: f.description for f in FORMATS}


COMPRESSIONS = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "lzma"}
"""Magic bytes of the compressions ASE reads through, and the module that opens each."""


def head(path):
    """The first HEAD_BYTES of a file, decompressed when its content is gzip, bzip2 or xz (as
    ASE reads such files); b"" if unreadable; DataError when its compressed data ends there
    or is corrupt."""
    import importlib

    try:
        with open(path, "rb") as f:
            start = f.read(HEAD_BYTES)
    except (OSError, ValueError):
        return b""
    module = next((m for magic, m in COMPRESSIONS.items() if start.startswith(magic)), None)
    if module is None:
        return start
    try:
        with importlib.import_module(module).open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except DECOMPRESSION_ERRORS as err:
        raise decompression_error(path, err) from None


def detect(path):
    """The Format of a regular file by its content, else by its name; None when none reads it."""
    start = head(path)
    for fmt in FORMATS:
        if fmt.can_open(path, start):
            return fmt
    return next((fmt for fmt in FORMATS if fmt.by_name and fmt.by_name(path)), None)


def named(name):
    """The Format that `--input-format NAME` forces: a reader of FORMATS by its name, or ASE's
    reader of any format ASE reads by its name (`ase.io.formats.ioformats`); DataError listing
    the names when it is neither."""
    from ase.io.formats import ioformats

    own = {fmt.name: fmt for fmt in FORMATS if fmt.name not in ("empty", "ase")}
    if name in own:
        return own[name]
    if name in ioformats and ioformats[name].can_read:
        return FORMATS[-1]._replace(name=name, open=partial(AseBatch, ase_format=name))
    raise DataError(f"--input-format {name}: no such input format; segcli's are {', '.join(own)}, "
                    "and any that ASE reads (`python -m ase info --formats` lists them)")


def recognised(path):
    """Whether some reader recognises a regular file by its content (never by name alone)."""
    start = head(path)
    return any(fmt.can_open(path, start) for fmt in FORMATS)


def capable(batch, flag):
    """Whether the format of `batch` has capability `flag` (a boolean field of Format)."""
    return any(getattr(fmt, flag) for fmt in FORMATS if fmt.name == batch.format)
