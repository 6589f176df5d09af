"""ASE databases (SQLite `.db`, JSON, and LMDB `.aselmdb` as OMat24 and OMol25 ship them) read
row by row, never all at once."""

import operator

import numpy as np

from segcli.errors import DataError
from segcli.io.asefiles import StreamedBatch, structure_piece

PAGE_ROWS = 100
CONNECT_OPTIONS = {"aselmdb": {"readonly": True}, "db": {"serial": True},
                   "json": {"serial": True}}
"""ase.db.connect's options per database type: read only, no locks, no parallel scheme."""


def connect(path, kind):
    """A read-only connection to the ASE database `path` of type `kind`; DataError (naming the
    extra to install) when its backend is missing."""
    import ase.db

    if kind == "aselmdb":
        try:
            import ase_db_backends.aselmdb  # noqa: F401
        except ImportError as err:
            raise DataError(f"{path}: reading .aselmdb files needs the ase-db-backends and lmdb "
                            f"packages: pip install 'segcli[lmdb]' ({err})") from err
    return ase.db.connect(path, type=kind, **CONNECT_OPTIONS[kind])


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
                           info, results, row.get("data", {}))


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
