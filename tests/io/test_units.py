"""Units: what files state, the conformer datasets' conventions, convert --units and
--to-ase-units, info, and units kept through convert and select."""

import json

import ase.io
import h5py
import numpy as np
import pytest
from ase.units import Bohr, Hartree, kcal, mol
from test_cli_data import assert_data_error, run

GROUPS = {"ions/methane": [6, 1, 1, 1, 1], "water": [8, 1, 1]}
"""Molecules in file order (HDF5 lists a group's members by name)."""


def write_spice(path, dipole_units="e*Bohr"):
    """A file in SPICE's layout (atomic units, stated by no attribute) holding, per molecule,
    the datasets SPICE has; `xtb_energy` states kcal/mol, `scf_dipole` `dipole_units`.
    Returns the values written, concatenated over the conformers."""
    rng = np.random.default_rng(3)
    values = {}
    with h5py.File(path, "w") as h5:
        for name, numbers in GROUPS.items():
            n, c = len(numbers), 3
            group = h5.create_group(name)
            group["atomic_numbers"] = np.array(numbers, np.int16)
            group["smiles"] = np.array([name.encode()])
            data = {"conformations": rng.normal(0, 2, (c, n, 3)),
                    "formation_energy": rng.normal(0, 0.1, c),
                    "dft_total_energy": rng.normal(-40, 1, c),
                    "dft_total_gradient": rng.normal(0, 0.02, (c, n, 3)),
                    "mbis_charges": rng.normal(0, 0.3, (c, n, 1)),
                    "xtb_energy": rng.normal(-5, 1, c), "scf_dipole": rng.normal(0, 1, (c, 3))}
            for key, array in data.items():
                group[key] = array
                values.setdefault(key, []).append(array.reshape(-1, *array.shape[2:])
                                                  if array.ndim == 3 else array)
            group["xtb_energy"].attrs["units"] = "kcal/mol"
            group["scf_dipole"].attrs["units"] = dipole_units
    return {key: np.concatenate(parts) for key, parts in values.items()}


def test_spice_to_ase_units(tmp_path):
    spice, out, traj = tmp_path / "spice.h5", tmp_path / "ase.h5", tmp_path / "ase.traj"
    values = write_spice(spice, dipole_units="furlong")
    expected = {"positions": (values["conformations"] * Bohr, "Ang"),
                "forces": (-values["dft_total_gradient"] * (Hartree / Bohr), "eV/Ang"),
                "formation_energy": (values["formation_energy"] * Hartree, "eV"),
                "dft_total_energy": (values["dft_total_energy"] * Hartree, "eV"),
                "xtb_energy": (values["xtb_energy"] * (kcal / mol), "eV"),
                "mbis_charges": (values["mbis_charges"], "e"),
                "scf_dipole": (values["scf_dipole"], "furlong")}
    described = json.loads(run("info", "--json", spice).stdout)["fields"]
    assert {name: f["units"] for name, f in described.items()} == {
        "numbers": None, "positions": "Bohr", "dft_total_gradient": "Hartree/Bohr",
        "formation_energy": "Hartree", "dft_total_energy": "Hartree", "xtb_energy": "kcal/mol",
        "mbis_charges": "e", "scf_dipole": "furlong"}

    refused = run("convert", spice, "-o", traj)
    assert_data_error(refused, f"{spice}: field 'positions' is in Bohr, not ASE's Ang",
                      "--to-ase-units")
    assert not traj.exists()

    result = run("convert", spice, "-o", out, "--to-ase-units")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("'scf_dipole'") == 1 and "'furlong'" in result.stderr
    with h5py.File(out) as h5:
        assert "dft_total_gradient" not in h5["atoms"]
        for name, (value, unit) in expected.items():
            group = "atoms" if name in ("positions", "forces", "mbis_charges") else "structures"
            ds = h5[group][name]
            np.testing.assert_allclose(ds[()], value, rtol=1e-12, atol=0, err_msg=name)
            assert ds.attrs["units"] == unit, name
    rows = {line.split()[0]: line.split()[1:] for line in run("info", out).stdout.splitlines()}
    assert rows["name"][-1] == "units" and rows["forces"] == ["atom", "(3,)", "float64", "eV/Ang"]

    assert run("convert", spice, "-o", traj, "--to-ase-units").exit_code == 0
    images = ase.io.read(traj, ":")
    np.testing.assert_allclose(np.concatenate([a.get_forces() for a in images]),
                               expected["forces"][0], rtol=1e-12, atol=0)
    np.testing.assert_allclose(np.concatenate([a.positions for a in images]),
                               expected["positions"][0], rtol=1e-12, atol=0)


def test_select_to_ase_units(tmp_path):
    """select --to-ase-units converts the chosen structures as convert does, into a segcli
    file from a segcli file (otherwise copied dataset by dataset) and into an export."""
    spice, stored = tmp_path / "spice.h5", tmp_path / "stored.h5"
    values = write_spice(spice, dipole_units="furlong")
    assert run("convert", spice, "-o", stored).exit_code == 0
    keep = values["formation_energy"] < 0
    rows = np.repeat(keep, [n for n in (5, 3) for _ in range(3)])
    for source in (spice, stored):
        subset, traj = tmp_path / f"{source.stem}-subset.h5", tmp_path / f"{source.stem}.traj"
        refused = run("select", source, "--where", "formation_energy < 0", "-o", traj)
        assert_data_error(refused, "not ASE's", "(--to-ase-units converts them)")
        assert not traj.exists()
        for out in (subset, traj):
            result = run("select", source, "--where", "formation_energy < 0", "-o", out,
                         "--to-ase-units")
            assert result.exit_code == 0, result.output
            assert result.stderr.count("'scf_dipole'") == 1 and "'furlong'" in result.stderr
        with h5py.File(subset) as h5:
            assert "dft_total_gradient" not in h5["atoms"]
            np.testing.assert_allclose(h5["atoms/forces"][()], -values["dft_total_gradient"][rows]
                                       * (Hartree / Bohr), rtol=1e-12, atol=0)
            np.testing.assert_allclose(h5["structures/formation_energy"][()],
                                       values["formation_energy"][keep] * Hartree, rtol=1e-12,
                                       atol=0)
            assert h5["atoms/forces"].attrs["units"] == "eV/Ang"
            assert h5["atoms/positions"].attrs["units"] == "Ang"
            assert h5["structures/scf_dipole"].attrs["units"] == "furlong"
        images = ase.io.read(traj, ":")
        np.testing.assert_allclose(np.concatenate([a.positions for a in images]),
                                   values["conformations"][rows] * Bohr, rtol=1e-12, atol=0)


def units_of(path):
    with h5py.File(path) as h5:
        return {name: h5[group][name].attrs.get("units") for group in ("atoms", "structures")
                for name in h5[group] if name != "n_atoms"}


def test_units_kept_through_convert_and_select(tmp_path, extxyz):
    stated, again = tmp_path / "stated.h5", tmp_path / "again.h5"
    result = run("convert", extxyz, "-o", stated, "--units", "energy=Hartree",
                 "--units", "forces=hartree/Å", "--units", "positions=Ang")
    assert result.exit_code == 0, result.output
    expected = {"energy": "Hartree", "forces": "Hartree/Ang", "positions": "Ang"}
    assert {k: v for k, v in units_of(stated).items() if v} == expected
    info = json.loads(run("info", "--json", stated).stdout)["fields"]
    assert {k: f["units"] for k, f in info.items() if f["units"]} == expected

    for command in (["convert", stated], ["select", stated, "--where", "energy < 100"]):
        assert run(*command, "-o", again, "--force").exit_code == 0
        assert {k: v for k, v in units_of(again).items() if v} == expected

    spice, subset = tmp_path / "spice.h5", tmp_path / "subset.h5"
    write_spice(spice)
    assert run("select", spice, "--where", "formation_energy < 1", "-o", subset).exit_code == 0
    assert units_of(subset)["positions"] == "Bohr"
    assert units_of(subset)["dft_total_gradient"] == "Hartree/Bohr"

    ase_units = tmp_path / "ase.h5"
    assert run("convert", stated, "-o", ase_units, "--to-ase-units").exit_code == 0
    with h5py.File(stated) as before, h5py.File(ase_units) as after:
        np.testing.assert_allclose(after["structures/energy"][()],
                                   before["structures/energy"][()] * Hartree, rtol=1e-12)
        np.testing.assert_allclose(after["atoms/forces"][()],
                                   before["atoms/forces"][()] * Hartree, rtol=1e-12)
        assert after["atoms/forces"].attrs["units"] == "eV/Ang"


@pytest.mark.parametrize("case", ["unknown unit", "no field", "stated otherwise", "mixed inputs",
                                  "groups disagree"])
def test_units_refused(tmp_path, extxyz, case):
    spice, out = tmp_path / "spice.h5", tmp_path / "out.h5"
    write_spice(spice)
    if case == "unknown unit":
        result = run("convert", extxyz, "-o", out, "--units", "energy=furlong")
        assert result.exit_code == 2 and "'furlong' is not a unit segcli knows" in result.stderr
        assert "Hartree/Bohr" in result.stderr
    elif case == "no field":
        assert_data_error(run("convert", extxyz, "-o", out, "--units", "nosuch=eV"),
                          "no field 'nosuch' (--units)")
    elif case == "stated otherwise":
        assert_data_error(run("convert", spice, "-o", out, "--units", "positions=Ang"),
                          f"{spice}: field 'positions' is in Bohr, which the file states")
    elif case == "mixed inputs":
        args = ["convert", spice, extxyz, "--fill-missing", "nan", "-o"]
        assert_data_error(run(*args, out), f"{extxyz}: field 'positions' is without units in "
                          "structure 0, in Bohr before", "--to-ase-units")
        mixed = tmp_path / "mixed.h5"
        assert run(*args, mixed, "--to-ase-units").exit_code == 0
        assert units_of(mixed)["positions"] == "Ang"
    else:
        with h5py.File(spice, "a") as h5:
            h5["water/dft_total_energy"].attrs["units"] = "eV"
        assert_data_error(run("info", spice), "field 'dft_total_energy' is in eV in "
                          "structure 3, in Hartree before")
    assert not out.exists()
