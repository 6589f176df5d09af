"""The registry of input formats (content detection, `info`'s descriptions) and ASE databases
(LMDB `.aselmdb`, SQLite `.db`, JSON) read row by row, against what ASE's own rows hold."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ase.db
import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.singlepoint import SinglePointCalculator
from click.testing import CliRunner

from segcli.cli import main
from segcli.errors import DataError
from segcli.io import open_batch, reads
from segcli.io.asedb import PAGE_ROWS, rows
from segcli.io.formats import FORMATS

DATABASES = ["aselmdb", "db", "json"]
PER_ATOM_DATA = {"charges"}  # the data arrays written below with one entry per atom


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def structures():
    """(atoms, key-value pairs, data) of a mixed dataset: bulk cells with stress, molecules
    without a cell or stress, and a structure without atoms."""
    rng = np.random.default_rng(7)
    copper = bulk("Cu", cubic=True) * (2, 1, 1)
    salt = bulk("NaCl", "rocksalt", a=5.64)
    water, methane = molecule("H2O"), molecule("CH4")
    water.set_momenta(rng.normal(size=(3, 3)))
    methane.set_tags([1, 0, 0, 2, 0])
    methane.set_initial_magnetic_moments(rng.normal(size=5))
    methane.set_initial_charges(rng.normal(size=5))
    methane.set_masses(rng.uniform(1, 2, size=5))
    out = []
    for atoms in (copper, water, salt, methane):
        results = {"energy": rng.normal(), "forces": rng.normal(size=(len(atoms), 3))}
        if atoms.pbc.all():
            results["stress"] = rng.normal(size=6)
        atoms.calc = SinglePointCalculator(atoms, **results)
    out.append((copper, {"config_type": "bulk", "layers": 2, "relaxed": True},
                {"charges": rng.normal(size=8), "dipole": rng.normal(size=3)}))
    out.append((water, {"config_type": "molecule", "charge": 0.5}, {}))
    empty = Atoms()
    empty.calc = SinglePointCalculator(empty, energy=0.25)
    out.append((empty, {"config_type": "empty"}, {}))
    out.append((salt, {"config_type": "bulk", "layers": 1, "relaxed": False},
                {"charges": rng.normal(size=2), "dipole": rng.normal(size=3)}))
    out.append((methane, {"config_type": "molecule", "charge": -1.0}, {}))
    return out


@pytest.fixture(params=DATABASES)
def database(request, tmp_path):
    """An ASE database of each kind holding `structures()`."""
    kind = request.param
    path = tmp_path / f"mixed.{kind}"
    with ase.db.connect(path, type=kind) as db:
        for atoms, pairs, data in structures():
            db.write(atoms, data=data, **pairs)
    for leftover in tmp_path.glob("*-lock"):
        leftover.unlink()
    return path, kind


def ase_rows(path, kind):
    """Every field of every row, per atom and per structure, as ASE's rows give them."""
    options = {"readonly": True} if kind == "aselmdb" else {}
    out = []
    for row in ase.db.connect(path, type=kind, **options).select():
        atoms = row.toatoms()
        per_atom = {name: atoms.arrays[name] for name in atoms.arrays}
        per_structure = {"cell": atoms.cell.array, "pbc": atoms.pbc, "id": row.id,
                         "unique_id": row.unique_id, **row.key_value_pairs}
        results = atoms.calc.results if atoms.calc else {}
        for name, value in {**row.get("data", {}), **results}.items():
            per = per_atom if name in PER_ATOM_DATA | {"forces"} else per_structure
            per[name] = value
        out.append((len(atoms), per_atom, per_structure))
    return out


def assert_equal(got, expected, where):
    if isinstance(expected, str):
        assert isinstance(got, str) and got == expected, where
    else:
        assert np.array_equal(got, expected), where


def test_every_field_of_every_row(database):
    path, kind = database
    expected = ase_rows(path, kind)
    with open_batch(path) as batch:
        assert batch.format == kind
        assert batch.n_atoms.tolist() == [n for n, _, _ in expected] == [8, 3, 0, 2, 5]
        pieces = [p for group in batch.stream(chunk_atoms=4) for p in group]
    assert len(pieces) == len(expected)
    for index, (piece, (n, per_atom, per_structure)) in enumerate(zip(pieces, expected)):
        assert piece.start == index and piece.n_atoms.tolist() == [n]
        assert set(piece.atoms) == set(per_atom), index
        assert set(piece.structures) == set(per_structure), index
        for name, value in per_atom.items():
            assert_equal(piece.atoms[name], value, (index, name))
        for name, value in per_structure.items():
            assert_equal(piece.structures[name][0], value, (index, name))


def test_chunks_hold_whole_structures_within_the_bound(database):
    path, kind = database
    expected = ase_rows(path, kind)
    fields = ["positions", "numbers", "cell", "pbc", "energy", "id", "unique_id", "config_type"]
    with open_batch(path) as batch:
        chunks = list(batch.iter_chunks(fields, chunk_atoms=5))
        middle = list(batch.iter_chunks(["positions", "id"], chunk_atoms=3,
                                        structures=slice(1, 4)))
    assert [c.n_atoms.tolist() for c in chunks] == [[8], [3, 0, 2], [5]]
    assert all(c.n_atoms.sum() <= 5 or len(c.n_atoms) == 1 for c in chunks)
    for name in ("positions", "numbers"):
        got = np.concatenate([c.atoms[name] for c in chunks])
        assert np.array_equal(got, np.concatenate([a[name] for _, a, _ in expected]))
    for name in fields[2:]:
        got = np.concatenate([c.structures[name] for c in chunks])
        assert got.tolist() == [np.asarray(s[name]).tolist() for _, _, s in expected], name
    assert [c.n_atoms.tolist() for c in middle] == [[3, 0], [2]]
    assert np.concatenate([c.structures["id"] for c in middle]).tolist() == [
        s["id"] for _, _, s in expected[1:4]]


def test_info_and_reduce_on_the_command_line(database):
    path, kind = database
    expected = ase_rows(path, kind)
    result = run("info", path)
    assert result.exit_code == 0, result.output
    description = next(f.description for f in FORMATS if f.name == kind)
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"{path}: {description}", "structures: 5", "atoms: 18"]
    rows = {line.split()[0]: line.split(maxsplit=4)[1:] for line in lines[4:] if line[:2] == "  "}
    assert rows["forces"][:3] == ["atom", "(3,)", "float64"]
    assert "present in 4 of 5" in rows["forces"][-1]
    assert "present in 2 of 5" in rows["stress"][-1]
    assert rows["unique_id"][:3] == ["structure", "()", "str"]
    summary = json.loads(run("info", "--json", path).stdout)
    assert summary["format"] == kind and summary["fields"]["charges"]["present"] == 2

    for structures in ("0:2", "3:5"):  # around the structure without atoms nor forces
        result = run("reduce", path, "sum", "forces", "--structures", structures,
                     "--format", "json", "--chunk-atoms", "4")
        assert result.exit_code == 0, result.output
        got = [json.loads(line) for line in result.stdout.splitlines()]
        first, stop = map(int, structures.split(":"))
        assert [line["structure"] for line in got] == list(range(first, stop))
        for line, (_, per_atom, _) in zip(got, expected[first:stop]):
            np.testing.assert_allclose(line["sum_forces"], per_atom["forces"].sum(axis=0),
                                       rtol=1e-12, atol=1e-12)


def test_convert_keeps_every_field(database, tmp_path):
    path, kind = database
    out = tmp_path / "out.h5"
    result = run("convert", path, "-o", out, "--fill-missing", "nan", "--chunk-atoms", "3")
    assert result.exit_code == 0, result.output
    expected = ase_rows(path, kind)
    with open_batch(out) as batch:
        chunk = next(batch.iter_chunks(["energy", "config_type", "stress"]))
        assert batch.present("stress").tolist() == ["stress" in s for _, _, s in expected]
    assert chunk.structures["energy"].tolist() == [s["energy"] for _, _, s in expected]
    assert chunk.structures["config_type"].tolist() == [s["config_type"] for _, _, s in expected]
    assert np.array_equal(chunk.structures["stress"][[0, 3]],
                          [expected[0][2]["stress"], expected[3][2]["stress"]])


def test_reading_leaves_the_database_as_it_was(database):
    path, _ = database
    before = sorted(p.name for p in path.parent.iterdir()), path.read_bytes()
    with open_batch(path) as batch:
        list(batch.iter_chunks(["positions"], chunk_atoms=2))
    assert (sorted(p.name for p in path.parent.iterdir()), path.read_bytes()) == before


def test_a_missing_lmdb_package_names_the_extra(tmp_path):
    """Run in a fresh interpreter where `lmdb` cannot be imported."""
    path = tmp_path / "shard.aselmdb"
    with ase.db.connect(path, type="aselmdb") as db:
        db.write(molecule("H2O"))
    code = ("import sys; sys.modules['lmdb'] = None; from segcli.cli import main; "
            f"main(['info', {str(path)!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert "pip install 'segcli[lmdb]'" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_content_decides_the_format(tmp_path, extxyz, batch_h5):
    renamed = tmp_path / "frames.data"  # a name ASE gives to another format (runnerdata)
    shutil.copy(extxyz, renamed)
    lmdb = tmp_path / "shard.bin"
    with ase.db.connect(tmp_path / "shard.aselmdb", type="aselmdb") as db:
        db.write(molecule("H2O"), config_type="molecule")
    shutil.copy(tmp_path / "shard.aselmdb", lmdb)
    hdf5 = tmp_path / "batch.extxyz"
    shutil.copy(batch_h5, hdf5)
    for path, kind in ((renamed, "extxyz"), (lmdb, "aselmdb"), (hdf5, "segcli")):
        assert reads(path), path
        with open_batch(path) as batch:
            assert batch.format == kind
    with open_batch(renamed) as batch:
        chunks = batch.iter_chunks("positions", chunk_atoms=20)
        positions = np.concatenate([c.atoms["positions"] for c in chunks])
    reference = ase.io.read(extxyz, ":")
    assert np.array_equal(positions, np.concatenate([a.positions for a in reference]))


def test_text_files_are_not_structures(tmp_path, extxyz):
    readme = tmp_path / "README.md"  # ASE's name for it: castep-md
    readme.write_text("# shards\n\nOMat24 validation split.\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("3 structures\n")
    not_hdf5 = tmp_path / "data.h5"
    not_hdf5.write_text("this is not HDF5\n")
    settings = tmp_path / "settings.json"  # JSON, not an ASE database
    settings.write_text('{"cutoff": 5.0, "elements": ["H", "O"]}\n')
    for path in (readme, notes, not_hdf5, settings):
        assert not reads(path), path
    assert reads(extxyz) and not reads(tmp_path / "missing.xyz") and not reads(tmp_path)
    result = run("info", not_hdf5)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (f"Error: {not_hdf5}: neither HDF5 nor a file format that "
                                     "ASE can read (`--input-format NAME` names its format)")
    with pytest.raises(DataError, match="neither HDF5 nor a file format that ASE can read"):
        open_batch(notes)


def test_by_name_when_content_cannot_tell(tmp_path, frames):
    """A POSCAR has no signature: its name says what it is."""
    path = tmp_path / "POSCAR"
    ase.io.write(path, frames[0], format="vasp")
    assert reads(path)
    with open_batch(path) as batch:
        assert batch.format == "ase" and batch.ase_format == "vasp"
        assert batch.n_atoms.tolist() == [len(frames[0])]


def test_info_describes_every_format(tmp_path, extxyz, batch_h5, frames):
    """One file of each registered format, and `info`'s first line for it."""
    files = {"empty": tmp_path / "empty.xyz", "segcli": batch_h5,
             "conformers": Path(__file__).parents[2] / "sample_data" / "conformers.h5",
             "extxyz": extxyz, "ase": tmp_path / "frames.traj"}
    files["empty"].touch()
    ase.io.write(files["ase"], frames)
    for kind in ("aselmdb", "db", "json"):
        files[kind] = tmp_path / f"frames.{kind}"
        with ase.db.connect(files[kind], type=kind) as db:
            for atoms in frames:
                db.write(atoms)
    assert set(files) == {f.name for f in FORMATS}
    for fmt in FORMATS:
        result = run("info", files[fmt.name])
        assert result.exit_code == 0, (fmt.name, result.output)
        assert result.stdout.splitlines()[0] == f"{files[fmt.name]}: {fmt.description}"


@pytest.mark.parametrize("kind", ["db", "json"])
def test_rows_of_a_database_with_gaps_in_id_order(tmp_path, kind):
    """Rows of every slice, in id order, where deleted rows left gaps of one id and of more
    than a page of ids (SQLite's pages are ranges of ids)."""
    path = tmp_path / f"gaps.{kind}"
    with ase.db.connect(path, type=kind) as db:
        for i in range(2 * PAGE_ROWS + 60):
            db.write(Atoms("H" * (i % 4)), step=i)
    gone = [*range(20, 40, 3), *range(50, 50 + PAGE_ROWS + 30), 2 * PAGE_ROWS + 59]
    ase.db.connect(path, type=kind).delete([i + 1 for i in gone])
    ids = sorted(row.id for row in ase.db.connect(path, type=kind).select())
    assert len(ids) == 2 * PAGE_ROWS + 60 - len(gone)
    for start, stop in [(0, None), (0, 5), (3, 40), (25, 26), (30, 31), (31, None),
                        (len(ids) - 1, None), (len(ids), None), (len(ids) + 5, None),
                        (10, 10 ** 6)]:
        got = [row.id for row in rows(path, kind, start, stop)]
        assert got == ids[start:stop], (start, stop)
        assert [row.step for row in rows(path, kind, start, stop)] == [i - 1 for i in got]


@pytest.mark.parametrize("array", ["numbers", "positions", "forces"])
def test_a_row_whose_arrays_disagree_on_its_atoms_is_refused_not_shifted(tmp_path, array):
    """A database row whose atomic numbers, positions or per-atom results have different
    lengths (edited by another program) is refused, naming the structure: its extra or missing
    rows would otherwise be taken from, or given to, the structures after it."""
    import sqlite3

    path = tmp_path / "x.db"
    rng = np.random.default_rng(3)
    with ase.db.connect(path) as db:
        for n in (2, 1, 3):
            atoms = Atoms(numbers=[1] * n, positions=rng.normal(size=(n, 3)))
            atoms.calc = SinglePointCalculator(atoms, energy=1.0, forces=rng.normal(size=(n, 3)))
            db.write(atoms)
    column = {"numbers": np.array([1, 1], np.int32), "positions": np.zeros((2, 3)),
              "forces": np.zeros((2, 3))}[array]
    with sqlite3.connect(path) as sql:  # structure 1 (one atom) made to hold two rows of `array`
        sql.execute(f"update systems set {array} = ? where id = 2", (column.tobytes(),))
    sql.close()
    result = CliRunner().invoke(main, ["reduce", str(path), "sum", "forces"])
    assert result.exit_code == 1, result.output
    assert result.output.count("\n") == 1
    assert f"{path}: structure 1: " in result.output
    assert "rows, but the structure has" in result.output
