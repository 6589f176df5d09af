"""`segcli info` and `segcli convert` through click's CliRunner and as real processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ase.io
import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from segcli.cli import main
from segcli.io import ResultWriter, convert, open_batch

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_data_error(result, *needles):
    """Exit 1 with one or two lines on stderr naming the problem, and no traceback."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def test_info_text(batch_h5):
    n_atoms = open_batch(batch_h5).n_atoms
    with ResultWriter(in_place_of=batch_h5) as w:
        w.create("sum_forces", (len(n_atoms), 3), np.float64,
                 {"op": "sum", "fields": ["forces"], "per": "structure", "device": "cpu"})
    result = run("info", batch_h5)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == [f"{batch_h5}: segcli HDF5", "structures: 7", f"atoms: {n_atoms.sum()}"]
    results = lines.index("results:")
    rows = {line.split()[0]: line.split()[1:] for line in lines[4:results]}
    assert rows["name"] == ["per", "shape", "dtype"]
    assert rows["forces"] == ["atom", "(3,)", "float64"]
    assert rows["numbers"] == ["atom", "()", "int64"]
    assert rows["velocities"] == ["atom", "(3,)", "float64", "derived"]
    assert rows["cell"] == ["structure", "(3,", "3)", "float64"]
    assert rows["pbc"] == ["structure", "(3,)", "bool"]
    assert rows["label"] == ["structure", "()", "str"]
    assert rows["sum_forces"] == ["structure", "(3,)", "float64", "result"]
    assert lines[results + 1] == "  sum_forces  op=sum  fields=forces  per=structure"


def _groups(h5):
    found = []
    h5.visititems(lambda name, obj: found.append(obj)
                  if isinstance(obj, h5py.Group) and "coordinates" in obj else None)
    return found


@pytest.mark.parametrize("kind", ["segcli", "extxyz", "conformers", "empty"])
def test_info_json_on_every_kind(tmp_path, batch_h5, extxyz, kind):
    path = {"segcli": batch_h5, "extxyz": extxyz, "conformers": SAMPLES / "conformers.h5",
            "empty": tmp_path / "empty.xyz"}[kind]
    if kind == "empty":
        path.touch()
    result = run("info", "--json", path)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    with h5py.File(SAMPLES / "conformers.h5") as h5:
        conformer_atoms = sum(g["coordinates"].shape[0] * g["coordinates"].shape[1]
                              for g in _groups(h5))
    expected_atoms = {"segcli": 61, "extxyz": 61, "conformers": conformer_atoms, "empty": 0}[kind]
    assert (summary["path"], summary["format"], summary["atoms"]) == (
        str(path), kind, expected_atoms)
    with open_batch(path) as batch:
        assert summary["structures"] == batch.n_structures
        assert summary["fields"] == {
            f.name: {"per": f.per, "shape": list(f.shape),
                     "dtype": "str" if f.name == "label" else str(f.dtype), "units": f.units,
                     "derived": f.name in ("velocities", "scaled_positions"), "result": False,
                     "present": batch.n_structures}
            for f in batch.fields.values()}
    assert summary["results"] == {}
    if kind != "empty":
        assert summary["fields"]["positions"] == {
            "per": "atom", "shape": [3], "dtype": "float64", "derived": False, "result": False,
            "present": summary["structures"], "units": "Ang" if kind == "conformers" else None}


def test_convert_round_trip(extxyz, ase_reference):
    out = extxyz.with_name("out.h5")
    result = run("convert", extxyz, "-o", out, "--chunk-atoms", 9)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"{out}: 7 structures, 61 atoms, fields: numbers, positions")
    n_atoms, per_atom, per_structure = ase_reference(extxyz)
    with open_batch(out) as batch:
        assert np.array_equal(batch.n_atoms, n_atoms)
        for chunk in batch.iter_chunks(list(per_atom) + list(per_structure)):
            got = {**chunk.atoms, **chunk.structures}
        for name, value in {**per_atom, **per_structure}.items():
            assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


def test_convert_options(extxyz, frames, tmp_path):
    out = tmp_path / "out.h5"
    result = run("convert", extxyz, "-o", out, "--compression", "lzf", "--quiet")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    with h5py.File(out) as h5:
        assert h5["atoms/positions"].compression == "lzf"
    before = out.read_bytes()
    assert_data_error(run("convert", extxyz, "-o", out), str(out), "already exists", "--force")
    assert out.read_bytes() == before
    assert run("convert", extxyz, extxyz, "-o", out, "--force", "-q").exit_code == 0
    assert open_batch(out).n_structures == 14
    frames[3].info["charge"] = 1.0
    ase.io.write(extxyz, frames)
    assert_data_error(run("convert", extxyz, "-o", tmp_path / "b.h5"), str(extxyz),
                      "structure 0 has no field 'charge'", "--fill-missing nan")
    assert run("convert", extxyz, "-o", tmp_path / "b.h5", "--fill-missing", "nan").exit_code == 0
    charge = next(open_batch(tmp_path / "b.h5").iter_chunks(["charge"])).structures["charge"]
    assert np.array_equal(charge, [np.nan] * 3 + [1.0] + [np.nan] * 3, equal_nan=True)
    assert run("convert", extxyz).exit_code == 2
    assert run("convert", extxyz, "-o", out, "--compression", "zstd").exit_code == 2
    assert run("convert", extxyz, "-o", out, "--chunk-atoms", 0).exit_code == 2


def write_bad_file(tmp_path, kind, extxyz, batch_h5):
    """A bad input of the given kind, and what its error must say."""
    path = tmp_path / f"bad_{kind}.h5"
    if kind == "missing":
        return path, "no such file"
    if kind == "junk":
        path = path.with_suffix(".bin")
        path.write_bytes(np.random.default_rng(0).bytes(3000))
        return path, "neither HDF5 nor a file format that ASE can read"
    if kind == "truncated_h5":
        data = batch_h5.read_bytes()
        path.write_bytes(data[:len(data) // 2])
        return path, "truncated or corrupt HDF5 file"
    if kind == "truncated_extxyz":
        path = path.with_suffix(".extxyz")
        lines = extxyz.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:-5]))
        return path, "structure 5 claims 7 atoms, but the file ends 6 atom line(s) later"
    path.write_bytes(batch_h5.read_bytes())
    with h5py.File(path, "a") as h5:
        n_atoms = h5["structures/n_atoms"][()]
        if kind == "n_atoms_missing":
            del h5["structures/n_atoms"]
            return path, "/structures/n_atoms is missing"
        if kind == "n_atoms_negative":
            h5["structures/n_atoms"][:2] = [n_atoms[0] + n_atoms[1] + 3, -3]
            return path, "/structures/n_atoms[1] is -3; atom counts cannot be negative"
        if kind == "n_atoms_sum":
            h5["structures/n_atoms"][0] += 1
            return path, "/atoms/forces has 61 rows, but /structures/n_atoms sums to 62"
        if kind == "atom_field_length":
            forces = h5["atoms/forces"][:-1]
            del h5["atoms/forces"]
            h5["atoms/forces"] = forces
            return path, "/atoms/forces has 60 rows, but /structures/n_atoms sums to 61"
        if kind == "structure_field_length":
            del h5["structures/energy"]
            h5["structures/energy"] = np.zeros(8)
            return path, "/structures/energy has 8 rows, but /structures/n_atoms has 7"
        if kind == "present_shape":
            h5["present/energy"] = np.ones(6, bool)
            return path, "/present/energy must be a (7,) bool array, one entry per structure"
        if kind == "wrong_format":
            h5.attrs["format"] = "something-else"
            return path, "attribute format is 'something-else', not 'segcli-batch'"
        del h5.attrs["format"]
        return path, "HDF5 file with neither the segcli-batch layout (no format attribute)"


BAD = ["missing", "junk", "truncated_h5", "truncated_extxyz", "n_atoms_missing",
       "n_atoms_negative", "n_atoms_sum", "atom_field_length", "structure_field_length",
       "present_shape", "wrong_format", "no_layout"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_files(tmp_path, extxyz, batch_h5, kind):
    path, message = write_bad_file(tmp_path, kind, extxyz, batch_h5)
    assert_data_error(run("info", path), f"Error: {path}: {message}")
    out = tmp_path / "out.h5"
    assert_data_error(run("convert", extxyz, path, "-o", out), f"Error: {path}: {message}")
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_empty_file_has_zero_structures(tmp_path):
    empty = tmp_path / "empty.extxyz"
    empty.touch()
    result = run("info", empty)
    assert result.exit_code == 0 and "structures: 0\natoms: 0\nfields: none" in result.stdout
    assert run("convert", empty, "-o", tmp_path / "empty.h5").exit_code == 0
    assert "structures: 0" in run("info", tmp_path / "empty.h5").stdout


def test_samples_are_the_conversion_of_the_extxyz(tmp_path):
    convert([SAMPLES / "metals.extxyz"], tmp_path / "metals.h5")
    with open_batch(SAMPLES / "metals.h5") as stored, open_batch(tmp_path / "metals.h5") as fresh:
        assert stored.fields == fresh.fields and 1 in stored.n_atoms
        assert np.array_equal(stored.n_atoms, fresh.n_atoms)
        names = list(stored.fields)
        for a, b in zip(stored.iter_chunks(names), fresh.iter_chunks(names)):
            for name in names:
                got = a.atoms.get(name, a.structures.get(name))
                assert np.array_equal(got, b.atoms.get(name, b.structures.get(name))), name
    assert {s for a in ase.io.read(SAMPLES / "metals.extxyz", ":") for s in a.symbols} == {
        "Cu", "Ag", "Au", "Ni", "Pd", "Pt", "Al"}
    assert sum(os.path.getsize(SAMPLES / f) for f in os.listdir(SAMPLES)) < 2_000_000


def python_m_segcli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "segcli", *map(str, args)], text=True,
                          capture_output=True, **kwargs)


def test_info_subprocess(tmp_path):
    result = python_m_segcli("info", SAMPLES / "conformers.h5")
    assert result.returncode == 0, result.stderr
    assert "conformer-layout HDF5" in result.stdout and "energies" in result.stdout
    result = python_m_segcli("info", tmp_path / "nope.h5")
    assert result.returncode == 1
    assert result.stderr == f"Error: {tmp_path / 'nope.h5'}: no such file\n"


def test_convert_subprocess_shows_no_progress_off_a_terminal(tmp_path):
    out = tmp_path / "out.h5"
    result = python_m_segcli("convert", SAMPLES / "metals.extxyz", "-o", out, "--chunk-atoms", 500)
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"{out}: 199 structures, 2781 atoms, fields: numbers, positions, " \
                            "momenta, energies, forces, cell, pbc, temperature_K, config_type, " \
                            "energy, free_energy, stress\n"
    assert open_batch(out).n_structures == 199


def test_commands_have_examples_and_import_light():
    for command in ("info", "convert"):
        assert "Example:" in run(command, "--help").stdout
    code = ("import sys, segcli.cli; "
            "print([m for m in ('h5py', 'ase', 'segcli.io') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "[]\n", result.stderr
