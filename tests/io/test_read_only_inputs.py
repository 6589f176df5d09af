"""Reading never writes: every reader leaves its input, and the directory around it, exactly as
it was (bytes, modification time, no journal, WAL or lock file beside it); an SQLite file that
is not an ASE database is refused untouched; a truncated LMDB file is refused before it is
mapped (a page past its end would be a SIGBUS)."""

import hashlib
import mmap
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import ase.db
import ase.io
import h5py
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from click.testing import CliRunner

from segcli.cli import main
from segcli.io import convert


def structures(count=3):
    """Small molecules with energies, as ASE builds them."""
    rng = np.random.default_rng(7)
    images = []
    for i in range(count):
        atoms = Atoms(numbers=rng.integers(1, 9, 2 + i), positions=rng.normal(size=(2 + i, 3)))
        atoms.calc = SinglePointCalculator(atoms, energy=float(-i))
        images.append(atoms)
    return images


def ase_database(path, kind, images):
    with ase.db.connect(path, type=kind) as db:
        for atoms in images:
            db.write(atoms)
    if kind == "aselmdb":
        os.remove(f"{path}-lock")  # ASE's writer leaves LMDB's lock file; a reader needs none


def conformers(path):
    """A conformer-layout file (ANI-1x style): one molecule, four conformations; its sums of
    positions per conformation."""
    coordinates = np.random.default_rng(3).normal(size=(4, 3, 3))
    with h5py.File(path, "w") as h5:
        h5["H2O/atomic_numbers"] = np.array([8, 1, 1], np.uint8)
        h5["H2O/coordinates"] = coordinates
        h5["H2O/energies"] = np.arange(4.0)
    return coordinates.sum(axis=1)


def sums(images):
    return np.array([atoms.positions.sum(axis=0) for atoms in images])


def make_input(kind, directory):
    """An input of `kind` alone in `directory`: (the path to give segcli, the sums of positions
    per structure that `reduce` must give; None: the input is refused)."""
    images = structures()
    if kind == "segcli-hdf5":
        ase.io.write(directory.parent / f"{kind}.extxyz", images)
        convert([str(directory.parent / f"{kind}.extxyz")], str(directory / "data.h5"))
        return directory / "data.h5", sums(images)
    if kind == "conformers":
        return directory / "data.h5", conformers(directory / "data.h5")
    if kind in ("extxyz", "traj"):
        ase.io.write(directory / f"data.{kind}", images)
        return directory / f"data.{kind}", sums(images)
    if kind in ("db", "json", "aselmdb"):
        ase_database(directory / f"data.{kind}", kind, images)
        return directory / f"data.{kind}", sums(images)
    if kind == "foreign-sqlite":
        with sqlite3.connect(directory / "other.db") as con:
            con.execute("CREATE TABLE notes (body TEXT)")
            con.execute("INSERT INTO notes VALUES ('not molecules')")
        con.close()
        return directory / "other.db", None
    if kind == "foreign-sqlite-read-version-2":  # a header that has SQLite look for a WAL file
        path, _ = make_input("foreign-sqlite", directory)
        data = bytearray(path.read_bytes())
        data[19] = 2  # its read version; the write version (data[18]) left at 1 (fuzz finding)
        path.write_bytes(bytes(data))
        return path, None
    if kind == "foreign-sqlite-wal":
        con = sqlite3.connect(directory / "other.db")
        con.execute("PRAGMA journal_mode=wal")
        con.execute("CREATE TABLE notes (body TEXT)")
        con.commit()
        con.close()
        return directory / "other.db", None
    assert kind == "directory"
    ase.io.write(directory / "a.extxyz", images[:1])
    ase_database(directory / "b.db", "db", images[1:2])
    ase_database(directory / "c.aselmdb", "aselmdb", images[2:])
    return directory, sums(images)


def snapshot(directory):
    """Every entry under `directory`: its content's hash (files), size and modification time."""
    entries = {}
    for path in sorted(Path(directory).rglob("*")):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        entries[str(path.relative_to(directory))] = (digest, stat.st_size, stat.st_mtime_ns)
    return entries


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


PAGE = mmap.PAGESIZE  # LMDB's page size: the memory page size of the machine that wrote the file
KINDS = ["segcli-hdf5", "conformers", "extxyz", "traj", "db", "json", "aselmdb",
         "foreign-sqlite", "foreign-sqlite-read-version-2", "foreign-sqlite-wal", "directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_reading_leaves_the_input_and_its_directory_unchanged(tmp_path, kind):
    directory = tmp_path / "input"
    directory.mkdir()
    path, expected = make_input(kind, directory)
    before = snapshot(directory)
    info, reduced = run("info", path), run("reduce", path, "sum", "positions")
    assert snapshot(directory) == before
    if expected is None:
        for result in (info, reduced):
            assert result.exit_code == 1, result.output
            assert result.stderr.splitlines() == [
                f"Error: {path}: an SQLite database, but not ASE's (no 'systems' table)"]
        return
    assert info.exit_code == 0, info.output
    assert reduced.exit_code == 0, reduced.output
    rows = np.loadtxt(reduced.stdout.splitlines()[1:], delimiter=",", ndmin=2)
    np.testing.assert_allclose(rows[:, -3:], expected, rtol=1e-6, atol=1e-6)


def truncated(data):
    """Cut at a page boundary: the file lacks pages its header counts."""
    return data[:len(data) // 2 // PAGE * PAGE], "truncated: "


def overflow_node_claiming_16_mb(data):
    """The root leaf's node whose row lies in overflow pages, its size made 16 MB more: LMDB
    would copy the row from past the file's end."""
    data = bytearray(data)
    metas = [struct.unpack_from("=QQQ", data, number * PAGE + 128) for number in (0, 1)]
    root = max(metas, key=lambda meta: meta[2])[0]
    lower = struct.unpack_from("=H", data, root * PAGE + 12)[0]
    for index in range((lower - 16) // 2):
        node = root * PAGE + struct.unpack_from("=H", data, root * PAGE + 16 + 2 * index)[0]
        if struct.unpack_from("=H", data, node + 4)[0] & 1:  # F_BIGDATA
            struct.pack_into("=H", data, node + 2, 0x100)
            return bytes(data), "damaged LMDB file: page "
    raise AssertionError("no row in overflow pages")


@pytest.mark.parametrize("damage", [truncated, overflow_node_claiming_16_mb])
def test_an_lmdb_file_read_past_its_end_is_refused_before_it_is_mapped(tmp_path, damage):
    """LMDB maps the file and trusts its header and nodes: a page read past the end of the file
    would kill the process with SIGBUS."""
    whole = tmp_path / "whole.aselmdb"
    rows = np.random.default_rng(0).random((12, 1000))  # each row past half a page: overflow
    with ase.db.connect(whole, type="aselmdb") as db:
        for atoms, spectrum in zip(structures(12), rows):
            db.write(atoms, data={"spectrum": spectrum})
    cut = tmp_path / "cut.aselmdb"
    data, message = damage(whole.read_bytes())
    cut.write_bytes(data)
    child = subprocess.run([sys.executable, "-m", "segcli", "info", cut], capture_output=True,
                           text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert child.returncode == 1, (child.returncode, child.stderr)
    assert len(child.stderr.splitlines()) == 1, child.stderr
    assert child.stderr.startswith(f"Error: {cut}: {message}"), child.stderr
    assert child.stdout == ""
    assert sorted(os.listdir(tmp_path)) == ["cut.aselmdb", "whole.aselmdb", "whole.aselmdb-lock"]


@pytest.mark.parametrize("size", [100, 4100])
def test_an_lmdb_file_shorter_than_its_two_header_pages_is_refused(tmp_path, size):
    whole = tmp_path / "whole.aselmdb"
    ase_database(whole, "aselmdb", structures())
    cut = tmp_path / "cut.aselmdb"
    cut.write_bytes(whole.read_bytes()[:size])
    result = run("info", cut)
    assert result.exit_code == 1, result.output
    assert len(result.stderr.splitlines()) == 1
    assert f"{cut}: an LMDB file of {size} bytes, shorter than its" in result.stderr
