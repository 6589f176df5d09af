"""The fuzz targets: each takes the fuzzed bytes, calls segcli's own library entry points on a
file made of them, and returns, or raises DataError (the one outcome segcli documents for bad
input). Any other exception is a finding; `WrongResult` is one that segcli would have passed
off as data."""

import atexit
import functools
import os
import shutil
import sys
import tempfile
from typing import NamedTuple

import ase.io
import numpy as np

import segcli.api.data
import segcli.io
import segcli.io.asedb
import segcli.io.asefiles
import segcli.io.core
import segcli.io.formats
import segcli.io.hdf5
import segcli.io.merge
import segcli.io.statsfile
from segcli.errors import DataError

CHUNK_ATOMS = 7  # small chunks: every field is streamed through several chunk boundaries
NAMES = ("data.extxyz", "data.xyz", "data.h5", "data.hdf5", "data.db", "data.json",
         "data.aselmdb", "data.traj", "data.cif", "POSCAR", "data.vasp", "data.pdb",
         "data.xyz.gz", "data.extxyz.bz2", "OUTCAR", "data", "data.txt", "data.npz")
"""The file names the `formats` target gives the content: its first byte picks one."""

_scratch = tempfile.mkdtemp(prefix="segcli-fuzz-")
atexit.register(shutil.rmtree, _scratch, ignore_errors=True)


class WrongResult(Exception):
    """segcli's outcome is wrong though nothing raised: data that differs from what ASE reads,
    a field name `info` cannot print, a traceback printed from a destructor."""


def no_printed_tracebacks(function):
    """`function`, raising WrongResult when an exception rose where Python can only print it
    (a `__del__`): the user would see a traceback besides segcli's answer."""

    @functools.wraps(function)
    def checked(data):
        reports = []
        previous, sys.unraisablehook = sys.unraisablehook, reports.append
        try:
            try:
                return function(data)
            except DataError as err:  # let go of here, with the frames its traceback holds, so
                refusal = DataError(*err.args)  # that their objects' destructors run now
        finally:
            sys.unraisablehook = previous
            if reports:
                raise WrongResult(f"traceback printed from {reports[0].object!r}: "
                                  f"{reports[0].exc_type.__name__}: {reports[0].exc_value}")
        raise refusal

    return checked


def _file(name, data):
    """`data` written to a scratch file called `name`; its path."""
    path = os.path.join(_scratch, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def read_through(batch):
    """What `segcli info` says of a batch (whose field names must be text), then every field
    streamed in small chunks: those that every structure has together, then each of the
    others alone (which a format without fill values refuses, with DataError)."""
    segcli.api.data.described(batch)
    names = [name for name in batch.fields if not isinstance(name, str)]
    if names:
        raise WrongResult(f"field name {names[0]!r} is not text (info cannot print it)")
    everywhere = [name for name in sorted(batch.fields) if batch.present(name) is None]
    partial = sorted(set(batch.fields).difference(everywhere))
    for names in [everywhere, *([name] for name in partial)]:
        for _ in batch.iter_chunks(names, chunk_atoms=CHUNK_ATOMS):
            pass


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc" and b.dtype.kind in "fc":
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


@no_printed_tracebacks
def extxyz(data):
    """segcli's extended XYZ reader (its own fast path, ASE for the rest): where ASE reads the
    whole file too, each structure must equal what ASE reads; then info and every field."""
    path = _file("data.extxyz", data)
    with segcli.io.asefiles.ExtxyzBatch(path) as batch:
        pieces = list(batch.structures(0, None))
        _compare_with_ase(path, pieces)
        read_through(batch)


def _compare_with_ase(path, pieces):
    """WrongResult unless `pieces` equal what ASE reads from `path`, where ASE reads it."""
    try:
        images = ase.io.read(path, ":", format="extxyz")
    except Exception:  # noqa: BLE001 -- ASE refuses the file, so there is nothing to compare
        return
    if len(images) != len(pieces):
        raise WrongResult(f"segcli reads {len(pieces)} structures, ASE {len(images)}")
    for index, (piece, atoms) in enumerate(zip(pieces, images)):
        expected = segcli.io.asefiles.atoms_piece(path, atoms, index)
        for per in ("atoms", "structures"):
            got, want = getattr(piece, per), getattr(expected, per)
            if got.keys() != want.keys():
                raise WrongResult(f"structure {index}: {per} fields {sorted(got)}, ASE's "
                                  f"{sorted(want)}")
            for name in got:
                if not _same(got[name], want[name]):
                    raise WrongResult(f"structure {index}: '{name}' is {got[name]!r}, ASE "
                                      f"reads {want[name]!r}")


@no_printed_tracebacks
def hdf5(data):
    """open_batch on an HDF5 file (detected as whatever it is), info, every field."""
    path = _file("data.h5", data)
    with segcli.io.open_batch(path) as batch:
        read_through(batch)


@no_printed_tracebacks
def conformers(data):
    """The conformer-layout reader on an HDF5 file, info, every field."""
    path = _file("data.h5", data)
    with segcli.io.hdf5.open_file(path, segcli.io.hdf5.ConformerBatch) as batch:
        read_through(batch)


@no_printed_tracebacks
def formats(data):
    """Format detection (`detect`, `recognised`, `reads`) of content under a file name that
    the first byte picks; detection and recognition must agree."""
    if not data:
        return
    path = _file(NAMES[data[0] % len(NAMES)], data[1:])
    fmt = segcli.io.formats.detect(path)
    known = segcli.io.formats.recognised(path)
    if known and fmt is None:
        raise WrongResult(f"{path}: recognised, yet detect finds no format")
    if segcli.io.reads(path) != (known and os.path.getsize(path) > 0):
        raise WrongResult(f"{path}: reads() disagrees with recognised()")


def _unchanged(name):
    """A target `function(path)` given the fuzzed bytes as the file `name`, alone in a
    directory of its own; WrongResult when reading changed the file or added one beside it."""

    def decorate(function):
        @functools.wraps(function)
        def checked(data):
            directory = os.path.join(_scratch, f"alone-{name}")
            shutil.rmtree(directory, ignore_errors=True)
            os.mkdir(directory)
            path = os.path.join(directory, name)
            with open(path, "wb") as f:
                f.write(data)
            try:
                return function(path)
            finally:
                after = sorted(os.listdir(directory))
                if after != [name]:
                    raise WrongResult(f"reading {name} left {after} in its directory")
                with open(path, "rb") as f:
                    if f.read() != data:
                        raise WrongResult(f"reading {name} changed it")

        return checked

    return decorate


@no_printed_tracebacks
@_unchanged("data.db")
def asedb(path):
    """segcli's reader of ASE SQLite databases: info and every field; the file unchanged, no
    journal beside it."""
    with segcli.io.asedb.DatabaseBatch(path, "db") as batch:
        read_through(batch)


@no_printed_tracebacks
@_unchanged("data.aselmdb")
def aselmdb(path):
    """segcli's reader of LMDB `.aselmdb` databases: info and every field; the file unchanged,
    no lock file beside it."""
    with segcli.io.asedb.DatabaseBatch(path, "aselmdb") as batch:
        read_through(batch)


@no_printed_tracebacks
def merge(data):
    """A part of a sharded job (results or statistics) checked as `segcli merge` checks it,
    merged alone into a new file, and its results read back as `reduce --scheduler` does."""
    path = _file("part.h5", data)
    parts = segcli.io.merge.check_parts([path])
    segcli.io.merge.merge_parts(parts, os.path.join(_scratch, "merged.h5"), force=True)
    if parts[0].kind == segcli.io.core.FORMAT:
        for _ in segcli.io.merge.part_rows(parts, list(parts[0].datasets), atoms_per_block=5):
            pass


@no_printed_tracebacks
def statsfile(data):
    """A statistics file (`segcli stats -o`) recognised, read, and merged with itself as
    `segcli stats FILE FILE` does; then every row it prints."""
    path = _file("stats.h5", data)
    segcli.io.statsfile.is_stats_file(path)
    stats, _ = segcli.io.statsfile.read_stats(path)
    merged, _ = segcli.io.statsfile.merge_stats_files([path, path])
    for s in [*stats.values(), *merged.values()]:
        s.rows()


class Target(NamedTuple):
    """A target: its function, and whether its input is a binary file whose offsets matter
    (HDF5: mutated mostly in place) rather than text."""

    function: object
    binary: bool


TARGETS = {"extxyz": Target(extxyz, False), "hdf5": Target(hdf5, True),
           "conformers": Target(conformers, True), "formats": Target(formats, False),
           "asedb": Target(asedb, True), "aselmdb": Target(aselmdb, True),
           "merge": Target(merge, True), "statsfile": Target(statsfile, True)}
