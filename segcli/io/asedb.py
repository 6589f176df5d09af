"""ASE databases (SQLite `.db`, JSON, and LMDB `.aselmdb` as OMat24 and OMol25 ship them) read
row by row, never all at once."""

import contextlib
import functools
import mmap
import operator
import os
import sqlite3
import struct
import urllib.parse

import numpy as np

from segcli.errors import DataError
from segcli.io.asefiles import StreamedBatch, structure_piece
from segcli.io.core import file_stamp

PAGE_ROWS = 100
CONNECT_OPTIONS = {"aselmdb": {"readonly": True}, "json": {}}
"""ase.db.connect's options for JSON and LMDB databases besides serial=True and
use_lock_file=False (no parallel scheme, no lock file): LMDB read only and lock-free."""

SQLITE_READ_VERSION = 19  # the header's byte of its read version: 2 has SQLite open the WAL
SQLITE_WAL = 2
LMDB_MAGICS = (b"\xde\xc0\xef\xbe", b"\xbe\xef\xc0\xde")  # 0xBEEFC0DE, either byte order
LMDB_MAGIC_OFFSET = 16  # after the page header of LMDB's first meta page
LMDB_MAGIC = 0xBEEFC0DE
LMDB_META = struct.Struct("=IIQQI44x40xQQQ")
"""An LMDB meta page after its 16-byte page header (64-bit build, native byte order): magic,
version, address, map size, the free-page tree (whose first field holds the page size, then
the rest of it), the main tree (up to its root page), the last page used, the transaction
id."""
LMDB_NO_PAGE = (1 << 64) - 1  # the root of an empty tree
LMDB_PAGE_HEADER = 16
LMDB_PAGE = struct.Struct("=10xHHH")
"""A page's flags, then the start and end of its nodes (an overflow page: its page count, as
the low and high half)."""
LMDB_NODE = struct.Struct("=HHHH")
"""A node: its data size (a branch node: child page) low and high half, flags (a branch node:
the child page's bits 32 to 47), key size; the key and data follow."""
LMDB_INDEX = struct.Struct("=H")  # a node's offset in its page, from the page's node table
LMDB_PAGE_NUMBER = struct.Struct("=Q")
LMDB_BRANCH, LMDB_LEAF, LMDB_OVERFLOW, LMDB_DIRTY = 0x01, 0x02, 0x04, 0x10
LMDB_BIGDATA = 0x01  # a node whose data is in overflow pages, the first one's number inline


def connect(path, kind):
    """A read-only connection to the ASE database `path` of type `kind`, which never writes to
    the file or beside it; DataError (naming the extra to install) when its backend is missing,
    when an SQLite file is not ASE's, or when LMDB would read an LMDB file past its end."""
    import ase.db

    if kind == "aselmdb":
        lmdb_backend(path)
        check_lmdb(path)
    if kind == "db":
        return read_only_sqlite(path)
    if kind == "json" and (text := _decompressed(path)) is not None:
        from ase.db.jsondb import JSONDatabase

        return JSONDatabase(text, serial=True, use_lock_file=False)
    return ase.db.connect(path, type=kind, serial=True, use_lock_file=False,
                          **CONNECT_OPTIONS[kind])


def _decompressed(path):
    """The text of a JSON database compressed as `segcli convert -o NAME.json.gz` writes it
    (gzip, bzip2, xz: its content, detected decompressed, says JSON), as a file object that
    ASE's JSON backend reads from; None for a file not compressed."""
    import importlib
    import io

    from segcli.io.asefiles import DECOMPRESSION_ERRORS
    from segcli.io.formats import COMPRESSIONS, decompression_error

    with open(path, "rb") as f:
        start = f.read(8)
    module = next((m for magic, m in COMPRESSIONS.items() if start.startswith(magic)), None)
    if module is None:
        return None
    try:
        with importlib.import_module(module).open(path, "rt", encoding="utf-8") as f:
            return io.StringIO(f.read())
    except DECOMPRESSION_ERRORS as err:
        raise decompression_error(path, err) from None


def lmdb_backend(path):
    """Load ase-db-backends, which gives ase.db the type aselmdb; DataError naming the extra to
    install where it is missing (`path`, the file to read or write)."""
    try:
        import ase_db_backends.aselmdb  # noqa: F401
    except ImportError as err:
        raise DataError(f"{path}: .aselmdb files need the ase-db-backends and lmdb packages: "
                        f"pip install 'segcli[lmdb]' ({err})") from err


def read_only_sqlite(path):
    """ASE's SQLite database `path` over read-only connections (ASE's own would add its tables
    to any SQLite file, and may leave a journal beside it); DataError when the file is an SQLite
    database without ASE's `systems` table, or SQLite cannot read it."""
    from ase.db.sqlite import SQLite3Database

    uri = read_only_uri(path)
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as con:
            tables = {name for (name,) in con.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.Error as err:
        raise DataError(f"{path}: SQLite cannot read it ({err})") from None
    if "systems" not in tables:
        raise DataError(f"{path}: an SQLite database, but not ASE's (no 'systems' table)")
    db = SQLite3Database(path, serial=True)
    db._connect = lambda: sqlite3.connect(uri, uri=True, timeout=20)  # each one ASE opens
    return db


def read_only_uri(path):
    """The URI that opens the SQLite file `path` read-only; also immutable where the file is in
    WAL mode with no WAL file beside it, for which SQLite would otherwise create an empty one
    and its index (whatever the header's write version says)."""
    with open(path, "rb") as f:
        header = f.read(SQLITE_READ_VERSION + 1)
    immutable = header[SQLITE_READ_VERSION:] == bytes([SQLITE_WAL]) and \
        not os.path.exists(f"{path}-wal")
    return (f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
            f"{'&immutable=1' if immutable else ''}")


def check_lmdb(path):
    """DataError unless LMDB can read the file `path` without touching a byte past its end:
    LMDB maps the file and trusts its page numbers and sizes, and a read past the end is a
    SIGBUS, not an error. Checked once per version of the file (see file_stamp)."""
    _check_lmdb(path, file_stamp(path))


@functools.lru_cache(maxsize=256)
def _check_lmdb(path, stamp):
    """See check_lmdb; then LMDB opens the file here, not first in ase_db_backends, whose
    destructor would open it again and print that error's traceback."""
    import lmdb

    _check_pages(path, stamp[2])
    try:
        lmdb.open(path, subdir=False, readonly=True, lock=False).close()
    except lmdb.Error as err:
        reason = str(err).removeprefix(f"{path}: ")
        raise DataError(f"{path}: LMDB cannot open it ({reason})") from None


def _check_pages(path, size):
    """The file `path` of `size` bytes is as long as its newest meta page says, and every page
    that its main tree reaches, and every node on them, lies inside it (see _walk_lmdb). A
    file whose magic is not this machine's byte order is left to LMDB, which refuses it."""
    header = LMDB_MAGIC_OFFSET + LMDB_META.size
    with open(path, "rb") as f:
        first = f.read(header)
        if len(first) < header:
            raise DataError(f"{path}: an LMDB file of {size} bytes, shorter than its header")
        meta = LMDB_META.unpack_from(first, LMDB_MAGIC_OFFSET)
        if meta[0] != LMDB_MAGIC:
            return
        page = meta[4]
        if page < 512 or page & (page - 1):
            raise DataError(f"{path}: LMDB header gives a page size of {page} bytes")
        f.seek(page)
        second = f.read(header)
        if len(second) < header:
            raise DataError(f"{path}: an LMDB file of {size} bytes, shorter than its two "
                            f"header pages of {page} bytes: truncated")
        *_, root, last_page, _ = max(meta, LMDB_META.unpack_from(second, LMDB_MAGIC_OFFSET),
                                     key=lambda m: m[-1])
        if size < (last_page + 1) * page:
            raise DataError(f"{path}: truncated: {size} bytes, where its LMDB header counts "
                            f"{last_page + 1} pages of {page} bytes ({(last_page + 1) * page} "
                            "bytes)")
        if root != LMDB_NO_PAGE:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _walk_lmdb(path, data, page, root, last_page)


def _walk_lmdb(path, data, page, root, last_page):
    """DataError unless each page of the LMDB tree from page `root` is a page of the file
    (`data`, pages of `page` bytes, the last `last_page`) reached once, and each node on them,
    and each overflow page run a node points to, lies inside its page or run."""

    def damaged(number, what):
        return DataError(f"{path}: damaged LMDB file: page {number} {what}")

    pending, seen = [root], set()
    while pending:
        number = pending.pop()
        if not 2 <= number <= last_page or number in seen:
            raise damaged(number, f"is reached twice or is not among pages 2 to {last_page}")
        seen.add(number)
        at = number * page
        flags, lower, upper = LMDB_PAGE.unpack_from(data, at)
        if flags & ~LMDB_DIRTY not in (LMDB_BRANCH, LMDB_LEAF) or not (
                LMDB_PAGE_HEADER <= lower <= upper <= page):
            raise damaged(number, f"has flags {flags:#x}, nodes from {lower} to {upper}: not a "
                                  "page of a tree of .aselmdb rows")
        for index in range((lower - LMDB_PAGE_HEADER) // 2):
            node = LMDB_INDEX.unpack_from(data, at + LMDB_PAGE_HEADER + 2 * index)[0]
            if node + LMDB_NODE.size > page:
                raise damaged(number, f"node {index} starts past the page")
            low, high, node_flags, key = LMDB_NODE.unpack_from(data, at + node)
            end = node + LMDB_NODE.size + key
            if flags & LMDB_BRANCH:
                pending.append(low | high << 16 | node_flags << 32)
            elif node_flags & ~LMDB_BIGDATA:
                raise damaged(number, f"node {index} has flags {node_flags:#x}: a named or "
                                      "duplicate-key database, which .aselmdb files never hold")
            elif node_flags & LMDB_BIGDATA:
                end += LMDB_PAGE_NUMBER.size
                if end <= page:
                    first = LMDB_PAGE_NUMBER.unpack_from(data, at + end - LMDB_PAGE_NUMBER.size)[0]
                    _check_overflow(data, page, first, low | high << 16, last_page, damaged)
            else:
                end += low | high << 16
            if end > page:
                raise damaged(number, f"node {index} ends past the page ({end} of {page} "
                                      "bytes)")


def _check_overflow(data, page, first, size, last_page, damaged):
    """`damaged(...)` unless the overflow pages from `first` hold `size` bytes in the file."""
    if not 2 <= first <= last_page:
        raise damaged(first, f"(an overflow page) is not among pages 2 to {last_page}")
    flags, lower, upper = LMDB_PAGE.unpack_from(data, first * page)
    count = lower | upper << 16
    if not flags & LMDB_OVERFLOW or first + count - 1 > last_page or (
            size > count * page - LMDB_PAGE_HEADER):
        raise damaged(first, f"(overflow, flags {flags:#x}) holds {count} pages up to page "
                             f"{last_page}, not {size} bytes")


ROW_ARRAYS = {"numbers": (int, ()), "positions": (float, (3,)), "initial_magmoms": (float, None),
              "initial_charges": (float, ()), "tags": (int, ()), "masses": (float, ()),
              "momenta": (float, (3,))}
"""The per-atom arrays a row may hold, with the dtype and trailing shape (None: as stored)
ase.Atoms gives them; a row holding floats where ints belong (numbers of 1.7) keeps them as
floats, which structure_piece refuses for atomic numbers, rather than cutting them."""

SCALAR_RESULTS = {"energy", "free_energy", "magmom"}
"""The calculator results ASE's SinglePointCalculator keeps as they are (the others become float
arrays)."""


def row_piece(path, index, row):
    """One database row as a piece: its atoms and calculator results, its numeric `data`
    arrays (per atom where their first axis has an entry per atom), and its `id`, `unique_id`
    and key-value pairs per structure; the arrays and results that `row.toatoms()` would give,
    taken from the row without building Atoms and a calculator (half the time of a read)."""
    from ase.calculators.calculator import all_properties

    arrays = {}
    for name, (dtype, shape) in ROW_ARRAYS.items():
        value = row.get(name)
        if value is not None:
            value = np.asarray(value)  # floats where ints belong kept, not cut (see ROW_ARRAYS)
            value = value if dtype is int and value.dtype.kind == "f" else value.astype(dtype)
            arrays[name] = value if shape is None else value.reshape(-1, *shape)
    results = {name: row[name] if name in SCALAR_RESULTS else np.array(row[name], float)
               for name in all_properties if name in row and row[name] is not None}
    info = {"id": row.id, "unique_id": row.unique_id, **row.key_value_pairs}
    return structure_piece(path, index, len(arrays["numbers"]), arrays,
                           np.array(row.cell, float).reshape(3, 3), np.array(row.pbc, bool),
                           info, results, row.get("data", {}),
                           # FixAtoms and FixCartesian as `fixed` and `fixed_cartesian`,
                           # as from a .traj; decoded only for a row that has any
                           constraints=row.constraints if row._constraints else ())


class DatabaseBatch(StreamedBatch):
    """The rows of an ASE database of type `kind` ("db", "json" or "aselmdb"), in id order."""

    def __init__(self, path, kind):
        super().__init__(path)
        self.format = kind

    def structures(self, start, stop):
        index = start
        try:
            for row in rows(self.path, self.format, start, stop):
                yield row_piece(self.path, index, row)
                index += 1
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"{self.path}: ASE cannot read structure {index} as "
                            f"{self.format} ({type(err).__name__}: {err})") from err


def rows(path, kind, start, stop):
    """Rows `start` to `stop` (None: the end) of the database `path` of type `kind`, in id
    order, no transaction or connection held between rows (the consumer may be another
    thread). An LMDB database's are fetched one by one by id (it knows them all); a JSON
    database's in the order of its ids (ascending as ASE writes them) from one select, as ASE
    decodes the whole file for any select; an SQLite database's a page at a time over one
    connection (ASE's SQLite backend otherwise connects again for each row: 2.2 times
    slower), each page the rows among the next PAGE_ROWS ids, sorted here: for ASE's
    sort="id", SQLite would sort all the rows left, for each page."""
    db = connect(path, kind)
    stop = db.count() if stop is None else min(stop, db.count())
    if start >= stop:
        return
    if kind == "aselmdb":
        try:
            yield from (db.get(i) for i in db.ids[start:stop])
        finally:
            db.close()
        return
    if kind == "json":
        yield from db.select(offset=start, limit=stop - start)
        return
    with db:
        last = 0 if start == 0 else _nth_row(db, start - 1).id
    while start < stop:
        with db:  # one connection for the page's queries, closed before its rows go on
            page = sorted(db.select(f"id>{last},id<={last + PAGE_ROWS}"),
                          key=operator.attrgetter("id"))
            if not page:  # a gap of PAGE_ROWS ids or more: the next row
                page = [_nth_row(db, 0, f"id>{last}")]
        page = page[:stop - start]
        yield from page
        start += len(page)
        last = page[-1].id


def _nth_row(db, n, selection=None):
    """Row `n` in id order of those `selection` selects (ASE's sort="id" orders by `id IS
    NULL` first, which makes SQLite sort every selected row: once a database, or a gap)."""
    return next(iter(db.select(selection, offset=n, limit=1, sort="id")))
