"""The curation API (segcli.stats, fit_e0, select, convert, merge, open): values against NumPy
float64 and ASE, and the same results and refusals as the commands."""

import json

import ase.io
import h5py
import numpy as np
import pytest
from ase.calculators.singlepoint import SinglePointCalculator
from click.testing import CliRunner

import segcli
from segcli.cli import main
from segcli.errors import DataError, Note


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """An extxyz file of 12 structures of H, C and O (energies linear in the composition plus
    noise, random forces, a config_type), its frames as ASE reads them, and its HDF5 copy."""
    rng = np.random.default_rng(7)
    e0 = {1: -13.6, 6: -1030.0, 8: -2040.0}
    frames = []
    for s in range(12):
        numbers = rng.choice([1, 6, 8], size=int(rng.integers(1, 6)))
        atoms = ase.Atoms(numbers=numbers, positions=rng.normal(size=(len(numbers), 3)) * 2,
                          cell=np.eye(3) * 9, pbc=True)
        atoms.info["config_type"] = ["bulk", "surface"][s % 2]
        energy = sum(e0[int(z)] for z in numbers) + rng.normal() * 0.1
        atoms.calc = SinglePointCalculator(atoms, energy=energy,
                                           forces=rng.normal(size=(len(numbers), 3)))
        frames.append(atoms)
    folder = tmp_path_factory.mktemp("api")
    path, h5 = folder / "set.extxyz", folder / "set.h5"
    ase.io.write(path, frames, format="extxyz")
    assert segcli.convert(path, h5) == str(h5)
    return path, ase.io.read(path, ":"), h5


def contents(path):
    """Every dataset's values and every attribute of an HDF5 file, but `created`."""
    out = {}

    def visit(name, obj):
        attrs = {k: np.asarray(v).tolist() for k, v in obj.attrs.items() if k != "created"}
        value = obj[()].tolist() if isinstance(obj, h5py.Dataset) else None
        out[name] = (value, attrs)

    with h5py.File(path, "r") as h5:
        visit("/", h5)
        h5.visititems(visit)
    return out


def test_stats_match_numpy_and_the_command(dataset):
    path, frames, h5 = dataset
    forces = np.concatenate([a.get_forces() for a in frames]).astype(np.float64)
    energies = np.array([a.get_potential_energy() for a in frames])
    result = segcli.stats(h5, "forces", "energy")
    assert isinstance(result, segcli.Statistics)
    rows = {(r["field"], r["component"]): r for r in result}
    norms = np.linalg.norm(forces, axis=1)
    for component, values in [("0", forces[:, 0]), ("2", forces[:, 2]), ("norm", norms)]:
        row = rows["forces", component]
        assert row["count"] == len(values)
        np.testing.assert_allclose([row[k] for k in ("mean", "std", "min", "max", "rms")],
                                   [values.mean(), values.std(), values.min(), values.max(),
                                    np.sqrt((values ** 2).mean())], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(rows["energy", ""]["mean"], energies.mean(), rtol=1e-14)
    assert result.to_dict() == json.loads(run("stats", h5, "forces", "energy", "--json").stdout)
    assert str(result) + "\n" == run("stats", h5, "forces", "energy").stdout
    by_element = segcli.stats(path, "forces", per_element=True, where="energy < -1500")
    cli = run("stats", path, "forces", "--per-element", "--where", "energy < -1500",
              "--format", "json")
    assert by_element.to_dict() == json.loads(cli.stdout)
    kept = [a for a in frames if a.get_potential_energy() < -1500]
    numbers = np.concatenate([a.numbers for a in kept])
    f = np.concatenate([a.get_forces() for a in kept])
    for row in by_element["forces"]:
        if row["component"] == "1":
            np.testing.assert_allclose(row["mean"], f[numbers == row["element"], 1].mean(),
                                       rtol=1e-12)


def test_fit_e0_matches_lstsq_and_the_command(dataset, tmp_path):
    path, frames, h5 = dataset
    counts = np.array([[np.sum(a.numbers == z) for z in (1, 6, 8)] for a in frames], float)
    energies = np.array([a.get_potential_energy() for a in frames])
    expected = np.linalg.lstsq(counts, energies, rcond=None)[0]
    calls = []
    e0 = segcli.fit_e0(path, progress=lambda done, total: calls.append((done, total)))
    np.testing.assert_allclose([e0["H"], e0["C"], e0["O"]], expected, rtol=1e-9)
    np.testing.assert_allclose(e0.residuals, energies - counts @ expected, atol=1e-8)
    assert calls[-1] == (24, 24)  # two passes over 12 structures
    cli = json.loads(run("fit-e0", path, "--json").stdout)
    assert {e["element"]: e["e0"] for e in cli["e0"]} == dict(e0)
    assert cli["rmse_per_atom"] == e0.rmse_per_atom and cli["structures"] == 12
    held = segcli.fit_e0(path, fixed={"h": -13.6})
    assert held["H"] == -13.6 and held.fixed == ["H"]
    copy = tmp_path / "copy.h5"
    copy.write_bytes(h5.read_bytes())
    stored = segcli.fit_e0(copy, in_place=True, name="interaction")
    with h5py.File(copy) as f:
        np.testing.assert_array_equal(f["results/interaction"][()], stored.residuals)


def test_select_writes_what_the_command_writes(dataset, tmp_path):
    _, frames, h5 = dataset
    mine, theirs = tmp_path / "mine.h5", tmp_path / "theirs.h5"
    count = segcli.select(h5, mine, where=["energy < -1500", "config_type == bulk"])
    assert count == sum(a.get_potential_energy() < -1500 and a.info["config_type"] == "bulk"
                        for a in frames) > 0
    result = run("select", h5, "-o", theirs, "--where", "energy < -1500", "--where",
                 "config_type == bulk")
    assert result.exit_code == 0, result.output
    assert contents(mine) == contents(theirs)
    listed = segcli.select(h5, tmp_path / "listed.extxyz", structures=[0, 3, 3, 5])
    assert listed == 3
    got = ase.io.read(tmp_path / "listed.extxyz", ":")
    np.testing.assert_array_equal(got[1].positions, frames[3].positions)
    with pytest.warns(Note, match="no structure of 12 is selected"):
        assert segcli.select(h5, tmp_path / "none.h5", where="energy > 0") == 0
    assert not (tmp_path / "none.h5").exists()


def test_convert_and_merge_return_paths_and_write_what_the_commands_write(dataset, tmp_path):
    path, _, _ = dataset
    mine = segcli.convert([path], tmp_path / "mine.h5", drop=["config_type"])
    assert mine == str(tmp_path / "mine.h5")
    assert run("convert", path, "-o", tmp_path / "theirs.h5", "--drop", "config_type") \
        .exit_code == 0
    assert contents(mine) == contents(tmp_path / "theirs.h5")
    for i in range(2):
        segcli.stats(path, "forces", shard=f"{i}/2", output=tmp_path / "parts/s-{shard}.h5")
    merged = segcli.merge(str(tmp_path / "parts/s-*.h5"), tmp_path / "merged.h5")
    assert merged == str(tmp_path / "merged.h5")
    assert run("merge", tmp_path / "parts/s-*.h5", "-o", tmp_path / "cli.h5").exit_code == 0
    assert contents(merged) == contents(tmp_path / "cli.h5")
    assert segcli.stats(merged).to_dict()["stats"] == segcli.stats(path, "forces").rows


def test_open_reads_what_ase_reads(dataset):
    path, frames, _ = dataset
    with segcli.open(path) as batch:
        assert len(batch) == len(frames)
        np.testing.assert_array_equal(batch.n_atoms, [len(a) for a in frames])
        assert {"positions", "numbers", "forces", "energy", "config_type"} <= set(batch.fields)
        assert batch.fields["forces"].per == "atom" and batch.fields["forces"].shape == (3,)
        chunks = list(batch.chunks(10, ["forces", "energy"]))
        assert all(chunk["n_atoms"].sum() <= 10 or len(chunk.n_atoms) == 1 for chunk in chunks)
        assert sorted(chunks[0]) == ["energy", "forces", "n_atoms"]
        np.testing.assert_array_equal(np.concatenate([c["forces"] for c in chunks]),
                                      np.concatenate([a.get_forces() for a in frames]))
        np.testing.assert_array_equal(np.concatenate([c["energy"] for c in chunks]),
                                      [a.get_potential_energy() for a in frames])
        assert [c.start for c in chunks] == np.cumsum([0] + [len(c.n_atoms) for c in
                                                             chunks[:-1]]).tolist()
        for i in (0, 5, -1):
            atoms, expected = batch.atoms(i), frames[i]
            np.testing.assert_array_equal(atoms.numbers, expected.numbers)
            np.testing.assert_array_equal(atoms.positions, expected.positions)
            np.testing.assert_array_equal(atoms.cell[:], expected.cell[:])
            np.testing.assert_array_equal(atoms.get_forces(), expected.get_forces())
            assert atoms.get_potential_energy() == expected.get_potential_energy()
            assert atoms.info["config_type"] == expected.info["config_type"]


def test_bad_data_raises_the_commands_error(dataset, tmp_path):
    _, _, h5 = dataset
    with pytest.raises(DataError) as raised:
        segcli.stats(h5, "stress")
    cli = run("stats", h5, "stress")
    assert cli.exit_code == 1 and cli.stderr == f"Error: {raised.value}\n"
    with pytest.raises(DataError, match="missing.h5: no such file"):
        segcli.open(tmp_path / "missing.h5")


@pytest.mark.parametrize("call, argument", [
    (lambda h5: segcli.stats(h5, "forces", per_element=True, by="config_type"), "per_element="),
    (lambda h5: segcli.stats(h5, per_atom=True), "fields"),
    (lambda h5: segcli.stats(h5, "forces", shard="3/2"), "^shard: "),
    (lambda h5: segcli.stats(h5, "forces", where="energy <"), "^where: "),
    (lambda h5: segcli.fit_e0(h5, fixed={"Xx": 1.0}), "fixed="),
    (lambda h5: segcli.fit_e0(h5, name="r"), "name="),
    (lambda h5: segcli.select(h5, h5.with_name("o.h5")), "where="),
    (lambda h5: segcli.convert(h5, h5.with_name("o.h5"), cast={"energy": "complex"}), "cast="),
    (lambda h5: segcli.open(h5, format="poscarx"), "format="),
])
def test_bad_arguments_raise_value_errors_naming_them(dataset, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(dataset[2])


def test_format_names_the_output_and_input_format_the_input(dataset):
    path, _, _ = dataset
    result = run("stats", path, "energy", "--format", "extxyz")
    assert result.exit_code == 2
    assert "give --input-format extxyz" in result.stderr
    assert run("stats", path, "energy", "--input-format", "extxyz", "--format", "json").stdout \
        == run("stats", path, "energy", "--json").stdout
