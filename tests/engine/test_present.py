"""One meaning of "present" in every command (SPEC §3c): a structure that lacks a field is left
out of that field's reductions, statistics, fits and --where conditions, whether the file was
converted or not; reduce and grad give it NaN rows and say how many on stderr. Files written
by ASE itself, values against NumPy float64 over the structures that have the field."""

import io
import json

import ase.io
import h5py
import numpy as np
import pytest
from ase.build import bulk, fcc111, molecule
from ase.calculators.emt import EMT
from ase.constraints import FixAtoms
from test_cli_data import assert_data_error, run

from segcli import engine
from segcli.io import open_inputs
from segcli.registry import OPS


def mixed_frames():
    """Bulk Cu (stress; `extra` per atom in two of three), Cu(111) slabs (FixAtoms, layer
    `tags`), water and H2O2 (no cell; a water without any calculator, holding `extra`)."""
    rng = np.random.default_rng(5)
    cells = [bulk("Cu", "fcc", a=3.6, cubic=True) for _ in range(3)]
    slabs = [fcc111("Cu", (1, 2, 3), vacuum=4.0) for _ in range(2)]
    waters = [molecule(name) for name in ("H2O", "H2O2", "H2O")]
    frames = [cells[0], waters[0], slabs[0], cells[1], waters[2], slabs[1], cells[2], waters[1]]
    for i, atoms in enumerate(frames):
        atoms.rattle(0.05, seed=i)
    for i, atoms in enumerate(cells):
        atoms.calc = EMT()
        atoms.get_stress()
        if i != 1:
            atoms.arrays["extra"] = rng.normal(size=len(atoms))
    for slab in slabs:
        slab.set_constraint(FixAtoms(indices=[0, 1]))
        slab.info["config_type"] = "surface"
    for atoms in slabs + waters[:2]:
        atoms.calc = EMT()
        atoms.get_forces()
    waters[2].arrays["extra"] = rng.normal(size=3)
    return frames


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The frames as extxyz and traj (ase.io.write), the extxyz converted with --fill-missing
    nan, and @LIST naming the extxyz and the traj: name -> path."""
    directory = tmp_path_factory.mktemp("present")
    frames = mixed_frames()
    paths = {fmt: directory / f"mixed.{fmt}" for fmt in ("extxyz", "traj")}
    for path in paths.values():
        ase.io.write(path, frames)
    paths["h5"] = directory / "mixed.h5"
    assert run("convert", paths["extxyz"], "-o", paths["h5"], "--fill-missing", "nan"
               ).exit_code == 0
    (directory / "list.txt").write_text(f"{paths['extxyz']}\n{paths['traj']}\n")
    paths["multi"] = f"@{directory / 'list.txt'}"
    return paths


def per_structure(path, name):
    """The value of field `name` in each structure as ASE reads `path` (None where absent)."""
    images = ase.io.read(path, ":")
    if name == "energy":
        return [a.calc.results.get("energy") if a.calc else None for a in images]
    return [a.arrays.get(name) for a in images]


def reference(values, reduce):
    """(S,) float64: `reduce` of each structure's value, NaN where it has none."""
    return np.array([np.nan if v is None else reduce(np.asarray(v, np.float64)) for v in values])


def npy(result):
    assert result.exit_code == 0, result.output
    return np.load(io.BytesIO(result.stdout_bytes))


def lack_line(path, missing, total, name, result):
    return f"{path}: {missing} of {total} structure(s) lack '{name}': their rows of {result} " \
           "are NaN\n"


@pytest.mark.parametrize("source", ["extxyz", "traj", "h5", "multi"])
def test_sum_of_integer_tags_is_nan_where_absent_not_zero(files, source):
    """Integer fills (0) never count: sum tags is float64, NaN in exactly the structures
    without tags; one stderr line says how many."""
    values = per_structure(files["extxyz"], "tags")
    if source == "multi":
        values += per_structure(files["traj"], "tags")
    expected = reference(values, np.sum)
    result = run("reduce", files[source], "sum", "tags", "--format", "npy")
    got = npy(result)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)  # NaN positions too
    missing = sum(v is None for v in values)
    assert result.stderr == lack_line(files[source], missing, len(values), "tags", "sum_tags")


def test_csv_cells_and_json_nulls_of_absent_structures(files):
    """A partly-present per-atom float field beside an op on a field every structure has: csv
    empty cells and json null only in the rows of structures without it."""
    values = per_structure(files["extxyz"], "extra")
    expected = reference(values, lambda x: np.sqrt(np.mean(x ** 2)))
    counts = [len(a) for a in ase.io.read(files["extxyz"], ":")]
    args = ["reduce", files["extxyz"], "rms_norm", "extra", "+", "count"]
    result = run(*args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "structure,rms_norm_extra,count"
    for s, line in enumerate(lines[1:]):
        structure, rms, count = line.split(",")
        assert (int(structure), int(count)) == (s, counts[s])
        assert (rms == "") == (values[s] is None)
        if rms:
            np.testing.assert_allclose(float(rms), expected[s], rtol=1e-14)
    assert result.stderr == lack_line(files["extxyz"], 5, 8, "extra", "rms_norm_extra")
    rows = [json.loads(line) for line in run(*args, "--format", "json").stdout.splitlines()]
    assert [row["rms_norm_extra"] is None for row in rows] == [v is None for v in values]


@pytest.mark.parametrize("source", ["extxyz", "h5"])
def test_grad_rows_of_atoms_in_absent_structures_are_nan(files, tmp_path, source):
    """grad of Σ_s energy_s · rms_norm(extra)_s: NaN for the atoms of structures without extra
    or without energy, x / (n · rms) · energy elsewhere."""
    extra = per_structure(files["extxyz"], "extra")
    energy = per_structure(files["extxyz"], "energy")
    out = tmp_path / "grad.h5"
    result = run("grad", files[source], "rms_norm", "extra", "--weights", "energy", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (f"{files[source]}: 6 of 8 structure(s) lack "
                                             "'extra' or 'energy': their rows of rms_norm_extra "
                                             "are NaN")
    expected = np.concatenate([
        np.full(len(a), np.nan) if x is None or e is None
        else e * np.asarray(x) / (len(x) * np.sqrt(np.mean(np.square(x))))
        for a, x, e in zip(ase.io.read(files["extxyz"], ":"), extra, energy)])
    with h5py.File(out) as h5:
        np.testing.assert_allclose(h5["results/rms_norm_extra/d_extra"][()], expected,
                                   rtol=1e-12)


def test_refusals_look_only_at_present_structures(files, tmp_path):
    """A field no selected structure has is an error before any output; a NaN among the
    present values is refused with its own count, the fills not counted."""
    out = tmp_path / "none.csv"
    assert_data_error(run("reduce", files["extxyz"], "sum", "extra", "--structures", "1:3",
                          "-o", out),
                      f"{files['extxyz']}: no selected structure has 'extra'")
    assert not out.exists()
    assert_data_error(run("reduce", files["h5"], "sum", "tags", "+", "sum", "extra",
                          "--structures", "1:3"), "no selected structure has 'extra'")
    frames = ase.io.read(files["extxyz"], ":")
    frames[3].arrays["extra"] = np.array([1.0, np.nan, 2.0, 3.0])
    path = tmp_path / "nan.extxyz"
    ase.io.write(path, frames)
    assert_data_error(run("reduce", path, "sum", "extra"),
                      f"{path}: field 'extra' holds 1 NaN value(s), the first in structure 3")


def test_per_atom_rows_of_matvec_with_a_partly_present_matrix(tmp_path):
    """matvec by a per-structure matrix that some structures lack (an h5py-written file with
    /present/m): NaN atom rows there, m_sᵀ x elsewhere; the fills do not reach the check of
    singular matrices."""
    from batch_reference import write_batch

    rng = np.random.default_rng(2)
    n_atoms, have = np.array([2, 3, 1, 2]), np.array([True, False, True, False])
    x, m = rng.normal(size=(8, 3)), rng.normal(size=(4, 3, 3))
    m[~have] = np.nan
    path = write_batch(tmp_path / "m.h5", n_atoms, {"x": x}, {"m": m})
    with h5py.File(path, "a") as h5:
        h5["present/m"] = have
    got = npy(run("reduce", path, "matvec", "x", "m", "--format", "npy", "--strict"))
    expected = np.einsum("iba,ib->ia", np.repeat(m, n_atoms, axis=0), x)
    np.testing.assert_allclose(got, expected, rtol=1e-13)  # NaN rows where m is absent


@pytest.mark.parametrize("on_device", [False, True])
def test_engine_blanks_absent_rows_wherever_it_checks_for_nan(files, on_device):
    """The NaN check on the host and the one on the device (GPUs; here on the CPU) both pass
    over the fills; the library's rows of absent structures are NaN."""
    import jax

    with open_inputs(files["h5"]) as batch:
        job = engine.plan(batch.path, OPS["sum"], ["extra"], batch.fields,
                          present=batch.present)
        assert job.partial and job.outputs[""][2] == np.float64
        got = np.concatenate([out[""] for _, (out,) in engine.run(
            batch, [job], jax.devices("cpu")[0], chunk_atoms=7, on_device=on_device)])
    np.testing.assert_allclose(got, reference(per_structure(files["extxyz"], "extra"), np.sum),
                               rtol=1e-14)


def only_present(path, name, out):
    """A file (ase.io.write) of the structures of `path` that have field `name`."""
    have = [v is not None for v in per_structure(path, name)]
    ase.io.write(out, [a for a, h in zip(ase.io.read(path, ":"), have) if h])
    return out


def json_of(*args):
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return {k: v for k, v in json.loads(result.stdout).items() if k != "path"}


def test_stats_and_fit_e0_leave_absent_structures_out(files, tmp_path):
    """stats of partly-present fields and fit-e0 with energy missing in some structures: the
    same on the unconverted files, the converted copy and a file of the present structures
    only, and equal to NumPy's over the present values."""
    stats = {src: json_of("stats", files[src], "tags", "stress") for src in ("extxyz", "h5")}
    assert stats["extxyz"] == stats["h5"]
    rows = {(r["field"], r["component"]): r for r in stats["h5"]["stats"]}
    tags = np.concatenate([v for v in per_structure(files["extxyz"], "tags") if v is not None])
    assert (rows["tags", ""]["count"], rows["tags", ""]["max"]) == (len(tags), tags.max())
    np.testing.assert_allclose([rows["tags", ""]["mean"], rows["tags", ""]["std"]],
                               [tags.mean(), tags.std()], rtol=1e-14)
    stress = np.array([a.calc.results["stress"] for a in ase.io.read(files["traj"], ":")
                       if a.calc and "stress" in a.calc.results])
    assert rows["stress", "0"]["count"] == len(stress) < 8
    np.testing.assert_allclose(rows["stress", "0"]["mean"], stress[:, 0].mean(), rtol=1e-12)
    with_energy = only_present(files["extxyz"], "energy", tmp_path / "energy.extxyz")
    fits = [json_of("fit-e0", path) for path in (files["extxyz"], files["h5"], with_energy)]
    assert fits[0]["structures"] == 7 and fits[0] == fits[1]
    np.testing.assert_allclose([e["e0"] for e in fits[0]["e0"]],
                               [e["e0"] for e in fits[2]["e0"]], rtol=1e-12)
    energy = json_of("stats", files["traj"], "energy")["stats"][0]
    assert energy == json_of("stats", with_energy, "energy")["stats"][0]


@pytest.mark.parametrize("source", ["extxyz", "traj", "h5"])
def test_select_is_not_stopped_by_unrelated_partly_present_fields(files, tmp_path, source):
    """--where on energy (absent in one structure) keeps the structures that have it and
    satisfy it; the output keeps the other partly-present fields, filled and marked."""
    energy = per_structure(files["extxyz"], "energy")
    threshold = float(np.median([e for e in energy if e is not None]))
    out = tmp_path / "sel.h5"
    result = run("select", files[source], "--where", f"energy <= {threshold}", "-o", out)
    assert result.exit_code == 0, result.output
    kept = [e is not None and e <= threshold for e in energy]
    tags = per_structure(files["extxyz"], "tags")
    with h5py.File(out) as h5:
        np.testing.assert_array_equal(h5["structures/energy"][()],
                                      [e for e, k in zip(energy, kept) if k])
        np.testing.assert_array_equal(h5["present/tags"][()],
                                      [t is not None for t, k in zip(tags, kept) if k])
