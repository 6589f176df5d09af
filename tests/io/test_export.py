"""Export: `segcli convert … -o out.extxyz|.traj|.db|…` writes what ASE wrote, read back by ASE
itself."""

import ase.db
import ase.io
import h5py
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, fcc111, molecule
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms, FixCartesian
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def mixed_frames():
    """Bulk cells with stress, a surface with FixAtoms and tags, molecules without a cell,
    some with a config_type, half with an extra per-atom array."""
    rng = np.random.default_rng(3)
    frames = []
    for i in range(6):
        if i % 3 == 0:
            atoms = bulk("Cu", cubic=True) * (1, 1, 2)
            results = {"stress": rng.normal(size=6)}
        elif i % 3 == 1:
            atoms = fcc111("Cu", (2, 2, 2), vacuum=4.0)
            atoms.set_constraint(FixAtoms(indices=[0, 1, 2, 3]))
            del atoms.info["adsorbate_info"]
            results = {}
        else:
            atoms = molecule("H2O")
            results = {}
        atoms.rattle(0.05, seed=i)
        if i % 2:
            atoms.info["config_type"] = f"kind{i % 3}"
            atoms.set_array("charge", rng.normal(size=len(atoms)))
        atoms.info["temperature"] = 300.0 + i
        atoms.calc = SinglePointCalculator(atoms, energy=float(rng.normal()),
                                           forces=rng.normal(size=(len(atoms), 3)), **results)
        frames.append(atoms)
    return frames


def assert_same(expected, got, constraints=True):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a.numbers, b.numbers)
        np.testing.assert_allclose(a.positions, b.positions, rtol=1e-12)
        np.testing.assert_allclose(a.cell.array, b.cell.array, rtol=1e-12)
        np.testing.assert_array_equal(a.pbc, b.pbc)
        results = getattr(a.calc, "results", {})
        assert set(results) == set(getattr(b.calc, "results", {}))
        for key in results:
            np.testing.assert_allclose(results[key], b.calc.results[key], rtol=1e-12)
        assert set(a.arrays) == set(b.arrays)
        for key in a.arrays:
            np.testing.assert_allclose(a.arrays[key], b.arrays[key], rtol=1e-12)
        assert a.info == b.info
        if constraints:
            assert [c.todict() for c in a.constraints] == [c.todict() for c in b.constraints]


@pytest.mark.parametrize("suffix", [".extxyz", ".traj", ".extxyz.gz"])
def test_a_mixed_dataset_exported_is_what_ase_wrote(tmp_path, suffix):
    frames = mixed_frames()
    ase.io.write(tmp_path / "in.extxyz", frames)
    h5 = tmp_path / "in.h5"
    assert run("convert", tmp_path / "in.extxyz", "-o", h5, "--fill-missing", "nan",
               "--quiet").exit_code == 0
    with h5py.File(h5) as f:  # the constraints as a field, in the structures that have them
        surfaces = [a for a in frames if a.constraints]
        np.testing.assert_array_equal(f["present/fixed"][()], [bool(a.constraints)
                                                               for a in frames])
        start = np.cumsum([0] + [len(a) for a in frames])
        rows = np.concatenate([np.arange(start[i], start[i + 1])
                               for i, a in enumerate(frames) if a.constraints])
        np.testing.assert_array_equal(f["atoms/fixed"][()][rows], np.concatenate(
            [np.isin(np.arange(len(a)), a.constraints[0].index) for a in surfaces]))
    out = tmp_path / f"out{suffix}"
    result = run("convert", h5, "-o", out)
    assert result.exit_code == 0, result.output
    assert "6 structures, 38 atoms" in result.output
    expected = ase.io.read(tmp_path / "in.extxyz", ":")
    for atoms in expected:
        atoms.set_constraint([FixAtoms(indices=atoms.constraints[0].index)]
                             if atoms.constraints else None)
    assert_same(expected, ase.io.read(out, ":"))


def test_a_database_export_keeps_info_as_key_value_pairs(tmp_path):
    frames = mixed_frames()
    ase.io.write(tmp_path / "in.traj", frames)
    out = tmp_path / "out.db"
    assert run("convert", tmp_path / "in.traj", "-o", out, "--drop", "tags",
               "--quiet").exit_code == 0
    with ase.db.connect(out) as db:
        rows = list(db.select())
    assert len(rows) == len(frames)
    for row, atoms in zip(rows, frames):
        np.testing.assert_allclose(row.positions, atoms.positions, rtol=1e-12)
        assert row.energy == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
        assert row.key_value_pairs["temperature"] == atoms.info["temperature"]
        assert row.get("config_type") == atoms.info.get("config_type")
        assert not row.toatoms().get_tags().any()


@pytest.mark.parametrize("suffix", [".db", ".aselmdb", ".json"])
def test_a_database_read_exports_to_a_database_again(tmp_path, suffix):
    """A database written from a database (the rows' own `id` and `unique_id` left to the new
    one) holds the same structures; `.aselmdb` is LMDB, as ase-db-backends reads it."""
    frames = mixed_frames()
    first, second = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    import ase_db_backends.aselmdb  # noqa: F401  (ASE's type aselmdb)

    with ase.db.connect(first) as db:
        for atoms in frames:
            db.write(atoms)
    result = run("convert", first, "-o", second, "--quiet")
    assert result.exit_code == 0, result.output
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("b", "."))
                and p != second]  # no temporary, lock or journal left
    if suffix == ".aselmdb":
        assert not second.read_bytes().startswith(b"SQLite format 3")
    with ase.db.connect(second) as db:
        rows = list(db.select())
    assert [row.id for row in rows] == list(range(1, len(frames) + 1))
    for row, atoms in zip(rows, frames):
        np.testing.assert_array_equal(row.numbers, atoms.numbers)
        np.testing.assert_allclose(row.positions, atoms.positions, rtol=1e-12)
        np.testing.assert_allclose(row.forces, atoms.calc.results["forces"], rtol=1e-12)
        assert row.energy == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
        assert "id" not in row.data and "unique_id" not in row.data


def test_stored_results_are_exported_as_info_and_arrays(tmp_path):
    path = write_batch(tmp_path / "d.h5", [2, 1], {"numbers": [1, 8, 6],
                                                   "positions": np.arange(9.).reshape(3, 3)},
                       {"energy": [-1.0, -2.0]})
    assert run("reduce", path, "sum", "positions", "--in-place", "--quiet").exit_code == 0
    assert run("reduce", path, "mul", "positions", "energy", "--in-place", "--name", "scaled",
               "--quiet").exit_code == 0
    out = tmp_path / "out.extxyz"
    assert run("convert", path, "-o", out, "--quiet").exit_code == 0
    first, second = ase.io.read(out, ":")
    np.testing.assert_allclose(first.info["sum_positions"], [3, 5, 7])
    np.testing.assert_allclose(second.info["sum_positions"], [6, 7, 8])
    np.testing.assert_allclose(first.arrays["scaled"], -np.arange(6.).reshape(2, 3))
    np.testing.assert_allclose(second.arrays["scaled"], [[-12, -14, -16]])
    assert first.get_potential_energy() == -1.0 and not first.pbc.any()


def test_export_refusals_leave_nothing(tmp_path):
    path = write_batch(tmp_path / "d.h5", [1, 1], {"numbers": [1, 8]})
    cases = [(["-o", tmp_path / "out.vasp"], 1, "the format vasp holds one structure"),
             (["-o", tmp_path / "out.weird"], 1, "out.weird: no format to write by that name"),
             (["-o", tmp_path / "out.extxyz", "--compression", "gzip"], 2,
              "--compression applies to a segcli HDF5 output, not to extxyz")]
    for args, code, message in cases:
        result = run("convert", path, *args)
        assert result.exit_code == code and message in result.output, result.output
        assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]
    assert run("convert", path, "--structures", "1:2", "-o", tmp_path / "one.vasp").exit_code == 2
    one = Atoms("O", positions=[[0, 0, 0]], cell=[2, 2, 2], pbc=True)
    ase.io.write(tmp_path / "one.extxyz", one)
    assert run("convert", tmp_path / "one.extxyz", "-o", tmp_path / "POSCAR.vasp",
               "--quiet").exit_code == 0
    assert_same([one], [ase.io.read(tmp_path / "POSCAR.vasp")], constraints=False)


def cartesian_masks(atoms):
    """(n, 3) bool: the coordinates that FixAtoms or FixCartesian hold still."""
    held = np.zeros((len(atoms), 3), bool)
    for c in atoms.constraints:
        held[c.index] |= np.asarray(getattr(c, "mask", (True, True, True)), bool)
    return held


@pytest.mark.parametrize("suffix", [".extxyz", ".traj"])
def test_fix_atoms_and_fix_cartesian_survive_convert_and_export(tmp_path, suffix):
    frames = []
    for i in range(3):
        atoms = Atoms("H5", positions=np.random.default_rng(i).normal(size=(5, 3)))
        atoms.set_constraint([FixAtoms([i]), FixCartesian([3, 4], (True, False, i == 1))])
        frames.append(atoms)
    source = tmp_path / f"in{suffix}"
    ase.io.write(source, frames)
    h5 = tmp_path / "in.h5"
    assert run("convert", source, "-o", h5, "--quiet").exit_code == 0
    with h5py.File(h5) as f:
        held = f["atoms/fixed_cartesian"][()].reshape(3, 5, 3)
        if "fixed" in f["atoms"]:  # a trajectory keeps FixAtoms as it is
            held |= f["atoms/fixed"][()].reshape(3, 5, 1)
    np.testing.assert_array_equal(held, [cartesian_masks(a) for a in frames])
    out = tmp_path / f"out{suffix}"
    assert run("convert", h5, "-o", out, "--quiet").exit_code == 0
    np.testing.assert_array_equal([cartesian_masks(a) for a in ase.io.read(out, ":")],
                                  [cartesian_masks(a) for a in frames])


@pytest.mark.parametrize("bad", [-1, -3, 119, 200, 2**40])
@pytest.mark.parametrize("suffix", [".extxyz", ".traj"])
def test_a_number_that_is_no_element_is_refused_not_exported_as_another(tmp_path, bad, suffix):
    numbers = np.array([1, 8, 1, bad, 1, 1])
    path = write_batch(tmp_path / "in.h5", np.array([2, 2, 2]),
                       {"numbers": numbers, "positions": np.zeros((6, 3))})
    out = tmp_path / f"out{suffix}"
    result = run("convert", path, "-o", out)
    assert result.exit_code == 1
    assert result.output == (f"Error: {path}: field 'numbers' holds {bad} in structure 1, not "
                             "an atomic number (0 to 118)\n")
    assert not out.exists()
