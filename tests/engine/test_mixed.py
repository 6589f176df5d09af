"""Mixed datasets (bulk cells, surfaces, molecules with and without a box) written by ASE as
extxyz, traj and db, converted and compared with ASE's own reading of the same files; string
fields, presence, --fields/--drop; stored results read as fields."""

import json
import os

import ase.db
import ase.io
import h5py
import numpy as np
import pytest
from ase.build import bulk, fcc100, fcc110, fcc111, molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from test_cli_data import assert_data_error, python_m_segcli, run

from segcli.errors import DataError
from segcli.io import ResultWriter, convert, open_batch

BULK = [bulk("Cu", cubic=True), bulk("Al"), bulk("Ni", orthorhombic=True), bulk("Au"),
        bulk("Ag", cubic=True), bulk("Pd"), bulk("Pt", a=3.95), bulk("Cu").repeat((2, 1, 1)),
        bulk("Al", cubic=True), bulk("Ni")]
SURFACES = [fcc111("Cu", (2, 2, 2), vacuum=5.0), fcc111("Al", (1, 1, 3)),
            fcc100("Au", (1, 1, 3), vacuum=4.0), fcc100("Ni", (2, 2, 2)),
            fcc110("Pt", (1, 2, 2), vacuum=6.0), fcc110("Ag", (1, 1, 4), vacuum=3.0),
            fcc111("Pd", (1, 1, 4), vacuum=5.0), fcc100("Cu", (1, 1, 2), vacuum=7.0),
            fcc110("Cu", (1, 1, 3)), fcc111("Au", (2, 1, 2), vacuum=4.0)]
MOLECULES = ["H2O", "CH4", "N2", "CO", "NH3", "O2", "H2", "C2H6", "CH3OH", "HCN"]


def mixed_images():
    """30 structures, a molecule first (no cell, stress or tags), then bulk, surface, molecule
    in turn: EMT energy and forces everywhere, stress for bulk cells only; `config_type` on
    all, `miller` (int) on the fcc111 surfaces, `strain` (float) on every other bulk cell."""
    out = []
    for i in range(10):
        mol = molecule(MOLECULES[i])
        if i % 2:
            mol.center(vacuum=3.0)  # a box, still not periodic
        mol.info["config_type"] = "molecule"
        cell = BULK[i].copy()
        cell.info["config_type"] = "bulk"
        if i % 2 == 0:
            cell.info["strain"] = 0.01 * i
        slab = SURFACES[i].copy()
        slab.info = {"config_type": "surface"}
        if i in (0, 1, 6, 9):
            slab.info["miller"] = 111
        out += [mol, cell, slab] if i == 0 else [cell, slab, mol]
    for i, atoms in enumerate(out):
        atoms.rattle(0.02, seed=i)
        atoms.calc = EMT()
        results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
        if atoms.pbc.all():
            results["stress"] = atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, **results)
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The mixed set written with ase.io.write as extxyz, traj and db: format -> path."""
    directory = tmp_path_factory.mktemp("mixed")
    images = mixed_images()
    paths = {fmt: directory / f"mixed.{fmt}" for fmt in ("extxyz", "traj", "db")}
    for path in paths.values():
        ase.io.write(path, images)
    return paths


def ase_fields(path):
    """name -> (per, [value of each structure, None where it has none]), from
    ase.io.read(path, ":"): every array, cell, pbc, calculator result and number or string
    info entry; for a database also each row's id and unique_id."""
    images = ase.io.read(path, ":")
    fields = {}

    def put(name, per, s, value):
        fields.setdefault(name, (per, [None] * len(images)))[1][s] = value

    for s, atoms in enumerate(images):
        for name, array in atoms.arrays.items():
            put(name, "atom", s, array)
        put("cell", "structure", s, atoms.cell.array)
        put("pbc", "structure", s, atoms.pbc)
        for name, value in atoms.calc.results.items():
            put(name, "atom" if name == "forces" else "structure", s, value)
        for name, value in atoms.info.items():
            if isinstance(value, (str, int, float, np.number)):
                put(name, "structure", s, value)
    if str(path).endswith(".db"):
        with ase.db.connect(path) as db:
            for s, row in enumerate(db.select()):
                put("id", "structure", s, row.id)
                put("unique_id", "structure", s, row.unique_id)
    return fields


def expected_array(per, values, n_atoms):
    """One field over all structures as segcli fills it: NaN (floats), 0 (integers, booleans)
    or "" (strings) where a structure has none; and the (S,) mask of those that have it."""
    given = [v for v in values if v is not None]
    if isinstance(given[0], str):
        dtype, fill = np.dtype(object), ""
    else:
        dtype = np.result_type(*[np.asarray(v).dtype for v in given])
        fill = np.nan if dtype.kind == "f" else 0
    trailing = np.shape(given[0])[1:] if per == "atom" else np.shape(given[0])
    parts = [np.full((n if per == "atom" else 1, *trailing), fill, dtype) if v is None
             else np.array(v if per == "atom" else [v], dtype) for v, n in zip(values, n_atoms)]
    return np.concatenate(parts), np.array([v is not None for v in values])


def read_everything(path):
    """(n_atoms, fields, name -> values, name -> present mask or None, name -> fill_value) of a
    file, as segcli reads it (stored fields only)."""
    with open_batch(path) as batch:
        names = [n for n in batch.fields if n not in batch.derived]
        chunks = list(batch.iter_chunks(names, chunk_atoms=50))
        values = {n: np.concatenate([c.atoms.get(n, c.structures.get(n)) for c in chunks])
                  for n in names}
        return (batch.n_atoms, batch.fields, values, {n: batch.present(n) for n in names},
                {n: batch.fill_value(n) for n in names})


def partial(reference):
    """The fields of `ase_fields` that some structures lack."""
    return {n for n, (_, values) in reference.items() if any(v is None for v in values)}


def assert_matches_ase(converted, source):
    """Every field of `converted` equals ASE's reading of `source`, filled where absent, and
    no field is missing or extra; partial fields have /present and fill_value."""
    n_atoms, fields, got, present, fills = read_everything(converted)
    reference = ase_fields(source)
    assert np.array_equal(n_atoms, [len(a) for a in ase.io.read(source, ":")])
    assert set(got) == set(reference)
    for name, (per, values) in reference.items():
        expected, mask = expected_array(per, values, n_atoms)
        assert fields[name].per == per, name
        assert got[name].dtype == expected.dtype, (name, got[name].dtype, expected.dtype)
        assert got[name].shape == expected.shape, name
        if expected.dtype == object:
            assert got[name].tolist() == expected.tolist(), name
            assert all(type(v) is str for v in got[name]), name
        else:
            assert np.array_equal(got[name], expected, equal_nan=True), name
        if mask.all():
            assert present[name] is None and fills[name] is None, name
        else:
            assert np.array_equal(present[name], mask), name
            fill = {"f": np.nan, "O": ""}.get(expected.dtype.kind, 0)
            assert fills[name] == fill or (np.isnan(fill) and np.isnan(fills[name])), name
    with h5py.File(converted) as h5:
        assert set(h5.get("present", {})) == partial(reference)
    return reference


@pytest.mark.parametrize("fmt", ["extxyz", "traj", "db"])
def test_convert_matches_ase(mixed, tmp_path, fmt):
    out = tmp_path / "mixed.h5"
    result = run("convert", mixed[fmt], "-o", out, "--fill-missing", "nan", "--chunk-atoms", 20)
    assert result.exit_code == 0, result.output
    reference = assert_matches_ase(out, mixed[fmt])
    assert {"stress", "tags", "initial_magmoms"} <= partial(reference)
    if fmt == "db":
        assert reference.keys() >= {"id", "unique_id"}
    else:
        assert reference["config_type"][1][:3] == ["molecule", "bulk", "surface"]
    with open_batch(out) as batch:
        stress = next(batch.iter_chunks(["stress"], chunk_atoms=10**6)).structures["stress"]
        assert np.isnan(stress[0]).all() and not np.isnan(stress[1]).any()
        assert batch.present("stress").sum() == 10


def test_convert_in_a_subprocess_and_again(mixed, tmp_path):
    out = tmp_path / "mixed.h5"
    result = python_m_segcli("convert", mixed["traj"], "-o", out, "--fill-missing", "nan")
    assert result.returncode == 0, result.stderr
    assert_matches_ase(out, mixed["traj"])
    again = tmp_path / "again.h5"  # a segcli file to segcli: strings, presence and fills kept
    assert run("convert", out, "-o", again, "--chunk-atoms", 7).exit_code == 0
    assert_matches_ase(again, mixed["traj"])


def test_info_shows_partial_fields(mixed, tmp_path):
    out = tmp_path / "mixed.h5"
    convert([mixed["extxyz"]], out, fill_missing=np.nan)
    for path, fill in ((mixed["extxyz"], ""), (out, ", filled with nan")):
        result = run("info", path)
        assert result.exit_code == 0, result.output
        rows = {line.split()[0]: line for line in result.stdout.splitlines()}
        assert rows["stress"].endswith(f"float64  present in 10 of 30{fill}")
        assert "present in 10 of 30" in rows["tags"] and "present" not in rows["energy"]
        assert rows["config_type"].split()[1:] == ["structure", "()", "str"]
    assert rows["tags"].endswith("present in 10 of 30, filled with 0")
    summary = json.loads(run("info", "--json", out).stdout)
    assert summary["fields"]["stress"] == {
        "per": "structure", "shape": [6], "dtype": "float64", "derived": False,
        "result": False, "present": 10, "fill_value": "nan", "units": None}
    assert summary["fields"]["miller"]["present"] == 4
    assert summary["fields"]["miller"]["fill_value"] == 0
    assert summary["fields"]["energy"]["present"] == 30
    assert "fill_value" not in summary["fields"]["energy"]
    summary = json.loads(run("info", "--json", mixed["extxyz"]).stdout)
    assert summary["fields"]["tags"]["present"] == 10
    assert "fill_value" not in summary["fields"]["tags"]


def test_unconverted_batches_know_what_is_present(mixed):
    reference = ase_fields(mixed["traj"])
    for fmt in ("extxyz", "traj", "db"):
        with open_batch(mixed[fmt]) as batch:
            assert np.array_equal(batch.present("stress"),
                                  [v is not None for v in reference["stress"][1]])
            assert batch.present("energy") is None and batch.fill_value("stress") is None
            chunk, = batch.iter_chunks(["tags"])  # filled and marked, as convert fills them
            tags, have = expected_array(*reference["tags"], batch.n_atoms)
            assert np.array_equal(chunk.atoms["tags"], tags)
            assert np.array_equal(chunk.present["tags"], have)
            with pytest.raises(DataError, match="no field 'nope'"):
                batch.present("nope")


def test_missing_field_without_fill_is_one_line(mixed, tmp_path):
    out = tmp_path / "mixed.h5"
    for fmt, name in (("extxyz", "strain"), ("traj", "strain"), ("db", "stress")):
        assert_data_error(run("convert", mixed[fmt], "-o", out),
                          f"Error: {mixed[fmt]}: structure 0 has no field '{name}', which other "
                          "structures have", "--fill-missing nan")
    assert_data_error(run("convert", mixed["extxyz"], "-o", out, "--drop", "stress,strain"),
                      f"Error: {mixed['extxyz']}: structure 0 has no field 'tags'")
    path = tmp_path / "bulk_first.extxyz"  # a gap after the field was written
    ase.io.write(path, ase.io.read(mixed["extxyz"], "1:"))
    assert_data_error(run("convert", path, "-o", out, "--chunk-atoms", 5),
                      f"Error: {path}: structure 0 has no field 'tags'")  # new in structure 1
    assert_data_error(run("convert", path, "-o", out, "--chunk-atoms", 5, "--drop", "tags,miller"),
                      f"Error: {path}: structure 1 has no field 'strain'")
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_fields_and_drop(mixed, tmp_path):
    out = tmp_path / "out.h5"
    result = run("convert", mixed["extxyz"], "-o", out, "--fields", "energy,forces,config_type")
    assert result.exit_code == 0, result.output
    with h5py.File(out) as h5:
        assert sorted(h5["structures"]) == ["config_type", "energy", "n_atoms"]
        assert sorted(h5["atoms"]) == ["forces"] and "present" not in h5
    partial = "stress,tags,initial_magmoms,miller,strain"
    result = run("convert", mixed["traj"], "-o", out, "--drop", f"{partial},cell", "--force")
    assert result.exit_code == 0, result.output  # no gaps left: no --fill-missing needed
    with h5py.File(out) as h5:
        assert sorted(h5["structures"]) == ["config_type", "energy", "n_atoms", "pbc"]
        assert sorted(h5["atoms"]) == ["forces", "numbers", "positions"]
    result = run("convert", mixed["db"], "-o", out, "--fields", "n_atoms,unique_id", "--force")
    assert result.exit_code == 0, result.output
    with h5py.File(out) as h5:
        assert sorted(h5["structures"]) == ["n_atoms", "unique_id"] and len(h5["atoms"]) == 0
    for option in ("--fields", "--drop"):
        result = run("convert", mixed["extxyz"], "-o", tmp_path / "no.h5", option, "energy,nope",
                     "--fill-missing", "nan")
        assert_data_error(result, f"{mixed['extxyz']}: no field 'nope' ({option})")
    assert not (tmp_path / "no.h5").exists()
    for args in (["--fields", "energy", "--drop", "forces"], ["--fields", ","],
                 ["--drop", "n_atoms"]):
        result = run("convert", mixed["extxyz"], "-o", tmp_path / "no.h5", *args)
        assert result.exit_code == 2, result.output
    with pytest.raises(ValueError):
        convert([mixed["extxyz"]], tmp_path / "no.h5", fields=["energy"], drop=["forces"])


def test_a_dropped_field_may_be_inconsistent(tmp_path):
    images = mixed_images()[:6]
    for i, atoms in enumerate(images):
        atoms.info["vector"] = np.arange(2 + i % 2, dtype=float)
    path = tmp_path / "odd.extxyz"
    ase.io.write(path, images)
    assert_data_error(run("convert", path, "-o", tmp_path / "a.h5", "--fill-missing", "nan"),
                      "field 'vector' has shape (3,) per structure in structure 1")
    result = run("convert", path, "-o", tmp_path / "a.h5", "--fill-missing", "nan",
                 "--drop", "vector")
    assert result.exit_code == 0, result.output
    assert "vector" not in open_batch(tmp_path / "a.h5").fields


@pytest.mark.parametrize("chunk_atoms", [1, 1000])
def test_gaps_in_an_integer_field_that_turns_float(tmp_path, chunk_atoms):
    images = mixed_images()[:7]
    for i, value in {1: 4, 2: 7, 4: 2.5, 6: 1}.items():
        images[i].info["x"] = value
    path = tmp_path / "widen.extxyz"
    ase.io.write(path, images)
    out = tmp_path / "widen.h5"
    convert([path], out, fill_missing=np.nan, chunk_atoms=chunk_atoms)
    with open_batch(out) as batch:
        x = next(batch.iter_chunks(["x"])).structures["x"]
        assert x.dtype == np.float64
        assert np.array_equal(x, [np.nan, 4, 7, np.nan, 2.5, np.nan, 1], equal_nan=True)
        assert np.isnan(batch.fill_value("x"))
        assert batch.present("x").tolist() == [False, True, True, False, True, False, True]
        tags = next(batch.iter_chunks(["tags"])).atoms["tags"]  # int, absent in structure 0
        offsets = np.cumsum(batch.n_atoms)
        assert tags.dtype.kind == "i" and not tags[:offsets[0]].any()
        assert batch.fill_value("tags") == 0
    assert_matches_ase(out, path)


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.extxyz"
    empty.touch()
    result = run("convert", empty, "-o", tmp_path / "e.h5", "--fill-missing", "nan")
    assert result.exit_code == 0, result.output
    with open_batch(tmp_path / "e.h5") as batch:
        assert batch.n_structures == 0 and batch.fields == {}
    assert_data_error(run("convert", empty, "-o", tmp_path / "f.h5", "--fields", "energy"),
                      "no field 'energy' (--fields); the fields are: (none)")


def test_database_keys_are_fields(tmp_path):
    images = mixed_images()[:5]
    path = tmp_path / "keys.db"
    with ase.db.connect(path) as db:
        for i, atoms in enumerate(images):
            pairs = {"config_type": atoms.info["config_type"], "flag": i % 2 == 0}
            if i > 1:
                pairs["rank"] = i
            db.write(atoms, **pairs)
    out = tmp_path / "keys.h5"
    assert run("convert", path, "-o", out, "--fill-missing", "nan").exit_code == 0
    _, fields, got, present, _ = read_everything(out)
    with ase.db.connect(path) as db:
        rows = list(db.select())
    assert got["id"].tolist() == [row.id for row in rows]
    assert got["unique_id"].tolist() == [row.unique_id for row in rows]
    assert fields["unique_id"].dtype == object
    assert got["config_type"].tolist() == [row.config_type for row in rows]
    assert got["flag"].dtype == bool and got["flag"].tolist() == [True, False, True, False, True]
    assert got["rank"].tolist() == [0, 0, 2, 3, 4]
    assert present["rank"].tolist() == [False, False, True, True, True]


def test_numeric_ops_refuse_strings(mixed, tmp_path):
    out = tmp_path / "mixed.h5"
    convert([mixed["extxyz"]], out, fill_missing=np.nan)
    assert_data_error(run("reduce", out, "mul", "forces", "config_type", "--device", "cpu"),
                      f"{out}: field 'config_type' holds strings, but mul's second field must "
                      "be real numbers")


# --- stored results read as fields ----------------------------------------------------------


def test_results_are_fields(batch_h5):
    n_atoms = open_batch(batch_h5).n_atoms
    s, n = len(n_atoms), int(n_atoms.sum())
    values = {"per_structure": np.arange(s * 2.0).reshape(s, 2),
              "grad/d_forces": np.arange(n * 3.0).reshape(n, 3),
              "energy": np.full(s, 7.0), "untyped": np.zeros(s)}
    with ResultWriter(in_place_of=batch_h5) as w:
        w.set_n_atoms(n_atoms)
        for name, array in values.items():
            per = {"grad/d_forces": "atom", "untyped": None}.get(name, "structure")
            w.create(name, array.shape, array.dtype, {"op": "sum", "per": per})
            w.write(name, 0, array)
    with open_batch(batch_h5) as batch:
        fields = batch.fields
        assert fields["per_structure"] == ("per_structure", "structure", (2,), np.float64, None)
        assert fields["grad/d_forces"] == ("grad/d_forces", "atom", (3,), np.float64, None)
        assert fields["energy"].shape == ()  # the stored field, not the result
        assert "untyped" not in fields  # no per: not a field
        assert batch.result_fields == {"per_structure", "grad/d_forces"}
        assert batch.present("grad/d_forces") is None
        chunks = list(batch.iter_chunks(["grad/d_forces", "per_structure", "energy"],
                                        chunk_atoms=9))
        got = {k: np.concatenate([c.atoms.get(k, c.structures.get(k)) for c in chunks])
               for k in ("grad/d_forces", "per_structure", "energy")}
        energy = next(batch.iter_chunks(["energy"])).structures["energy"]
    assert np.array_equal(got["grad/d_forces"], values["grad/d_forces"])
    assert np.array_equal(got["per_structure"], values["per_structure"])
    assert np.array_equal(got["energy"], energy) and not (energy == 7).all()
    out = batch_h5.with_name("copy.h5")  # convert copies results as results
    convert([batch_h5], out)
    with h5py.File(out) as h5, h5py.File(batch_h5) as original:
        for name in ("per_structure", "grad/d_forces"):
            np.testing.assert_array_equal(h5[f"results/{name}"][()], values[name])
            assert dict(h5[f"results/{name}"].attrs) == dict(original[f"results/{name}"].attrs)
        assert "untyped" not in h5["results"] and "energy" not in h5["results"]
    text = run("info", batch_h5).stdout
    fields = text.split("fields:\n")[1].split("results:")[0]
    rows = {line.split()[0]: line.split()[1:] for line in fields.splitlines()}
    assert rows["grad/d_forces"] == ["atom", "(3,)", "float64", "result"]
    summary = json.loads(run("info", "--json", batch_h5).stdout)
    assert summary["fields"]["per_structure"]["result"] is True
    assert summary["fields"]["energy"]["result"] is False
    assert set(summary["results"]) == set(values)


@pytest.mark.parametrize("bad,message", [
    ("rows", "/results/bad has 3 rows, but /structures/n_atoms has 7"),
    ("atom_rows", "/results/bad has 7 rows, but /structures/n_atoms sums to 61"),
    ("per", "/results/bad has per='molecule', neither 'atom' nor 'structure'"),
])
def test_a_bad_result_is_one_line(batch_h5, bad, message):
    with h5py.File(batch_h5, "a") as h5:
        ds = h5.create_dataset("results/bad", data=np.zeros(3 if bad == "rows" else 7))
        ds.attrs["per"] = {"atom_rows": "atom", "per": "molecule"}.get(bad, "structure")
    with pytest.raises(DataError, match=f"^{batch_h5}: {message}$"):
        open_batch(batch_h5)
    assert_data_error(run("info", batch_h5), f"Error: {batch_h5}: {message}")


def test_results_stored_in_place_are_fields_of_reduce_and_grad(batch_h5):
    for command in (["reduce", batch_h5, "max_norm", "forces"],
                    ["grad", batch_h5, "rms_norm", "forces"]):
        result = run(*command, "--in-place", "--device", "cpu", "-q")
        assert result.exit_code == 0, result.output
    with h5py.File(batch_h5) as h5:
        max_norm = h5["results/max_norm_forces"][()]
        gradient = h5["results/rms_norm_forces/d_forces"][()]
        forces = h5["atoms/forces"][()]
        n_atoms = h5["structures/n_atoms"][()]
    result = run("reduce", batch_h5, "mul", "forces", "max_norm_forces", "--format", "json",
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    expected = forces * np.repeat(max_norm, n_atoms)[:, None]
    assert np.array_equal([line["mul_forces_max_norm_forces"] for line in lines], expected)
    result = run("reduce", batch_h5, "sum", "rms_norm_forces/d_forces", "--format", "json",
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    sums = [json.loads(line)["sum_rms_norm_forces/d_forces"] for line in result.stdout.splitlines()]
    expected = [gradient[a:b].sum(axis=0) for a, b in zip(np.cumsum(n_atoms) - n_atoms,
                                                            np.cumsum(n_atoms))]
    np.testing.assert_allclose(sums, expected, rtol=1e-12, atol=1e-15)
