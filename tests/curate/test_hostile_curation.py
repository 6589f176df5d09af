"""select, stats, fit-e0 and gradcheck on hostile input: fields reached through HDF5 links,
integer thresholds at the limits of their dtypes, non-finite and overflowing values, empty
structures and odd arguments; each against h5py, NumPy or exact Python arithmetic."""

import json
import operator
from fractions import Fraction

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from test_multi import assert_one_line_error, run
from test_select import write_rich

from segcli.io import open_batch

# --- select: fields reached through links ------------------------------------------------


def test_select_keeps_fields_reached_through_hard_soft_and_external_links(tmp_path):
    """Each name a field, mask or result has (hard link, soft link, external link, a link to a
    dataset outside the four groups) is in the output as a dataset of the kept rows; outside
    them, a dangling link and a link cycle are kept as links and a group under two names is
    one group."""
    path = tmp_path / "linked.h5"
    n_atoms, data, present = write_rich(path)
    s, n = len(n_atoms), int(n_atoms.sum())
    rng = np.random.default_rng(5)
    elsewhere, external = rng.normal(size=s), rng.normal(size=(n, 2))
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["charges2"] = external
    with h5py.File(path, "a") as f:
        f["atoms/forces_hard"] = f["atoms/forces"]
        f["atoms/forces_soft"] = h5py.SoftLink("/atoms/forces")
        f["atoms/q2"] = h5py.ExternalLink("other.h5", "/charges2")
        f["extra/temperature"] = elsewhere
        f["structures/t_elsewhere"] = h5py.SoftLink("/extra/temperature")
        f["structures/energy_soft"] = h5py.SoftLink("/structures/energy")
        f["structures/spin2"] = f["structures/spin"]
        f["present/spin2"] = h5py.SoftLink("/present/spin")
        f["results/score_hard"] = f["results/score"]
        f["results/norm_soft"] = h5py.SoftLink("/results/max_norm_forces")
        f["extra/loop"] = h5py.SoftLink("/extra")
        f["extra/dangling"] = h5py.SoftLink("/nowhere")
        f["more/extra"] = f["extra"]
    out = tmp_path / "out.h5"
    result = run("select", path, "--where", "energy <= 0.5", "-o", out)
    assert result.exit_code == 0, result.output
    kept = np.flatnonzero(data["energy"] <= 0.5)
    atoms = np.repeat(np.isin(np.arange(s), kept), n_atoms)
    expected = {
        "atoms/forces": data["forces"][atoms], "atoms/forces_hard": data["forces"][atoms],
        "atoms/forces_soft": data["forces"][atoms], "atoms/q2": external[atoms],
        "structures/t_elsewhere": elsewhere[kept], "extra/temperature": elsewhere,
        "structures/energy_soft": data["energy"][kept], "structures/spin2": data["spin"][kept],
        "present/spin": present["spin"][kept], "present/spin2": present["spin"][kept],
        "results/score": data["score"][kept], "results/score_hard": data["score"][kept],
        "results/norm_soft": data["max_norm_forces"][kept],
    }
    with h5py.File(out) as f:
        for name, values in expected.items():
            assert isinstance(f.get(name, getlink=True), h5py.HardLink), name
            np.testing.assert_array_equal(f[name][()], values, err_msg=name)
        assert f.get("extra/loop", getlink=True).path == "/extra"
        assert f["more/extra"] == f["extra"]  # one group under two names
        assert f.get("extra/dangling", getlink=True).path == "/nowhere"
    with open_batch(out) as batch:
        fields = batch.fields
        assert {"forces_hard", "forces_soft", "q2", "t_elsewhere", "spin2"} <= set(fields)
        chunk = next(batch.iter_chunks(["spin2"]))
        np.testing.assert_array_equal(chunk.present["spin2"], present["spin"][kept])


# --- select: integers compared exactly ---------------------------------------------------

LIMITS = {
    "u": np.array([2**64 - 1, 2**64 - 2, 2**63, 2**63 - 1, 2**53 + 1, 3, 2, 0], np.uint64),
    "i": np.array([2**63 - 1, 2**63 - 2, -2**63, -2**63 + 1, 2**53 + 1, 3, 2, -1], np.int64),
    "i8": np.array([127, -128, 3, 2, 0, -1, -3, 1], np.int8),
    "b": np.array([True, False, True, True, False, False, True, False]),
}


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    path = tmp_path_factory.mktemp("limits") / "limits.h5"
    s = len(LIMITS["u"])
    return write_batch(path, np.ones(s, np.int64), {"positions": np.zeros((s, 3))},
                       {**LIMITS, "index": np.arange(s)})


@pytest.mark.parametrize("where", [
    "u == 18446744073709551614", "u != 18446744073709551614", "u >= 18446744073709551615",
    "u > 9223372036854775807.5", "u < -1", "u <= 1e30", "u < 1e-400", "u == nan", "i > 2.5",
    "i <= -0.5", "i == 9223372036854775806.0", "i > -9223372036854775809", "i8 > 1e30",
    "i8 > 126.99", "i8 < inf", "b > 0.5",
])
def test_where_compares_integers_exactly(limits, tmp_path, where):
    """Each condition against exact rational arithmetic on the values as Python ints."""
    name, op, text = where.split()
    number = float(text) if text.lstrip("+-") in ("inf", "nan") else Fraction(text)
    compare = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
               "==": operator.eq, "!=": operator.ne}[op]
    want = [i for i, v in enumerate(LIMITS[name].tolist())
            if (op == "!=" if number != number else compare(v, number))]
    out = tmp_path / "out.h5"
    result = run("select", limits, "--where", where, "-o", out, "--allow-empty")
    assert result.exit_code == 0, result.output
    with h5py.File(out) as f:
        assert f["structures/index"][()].tolist() == want


# --- stats and fit-e0: non-finite and overflowing values ---------------------------------

E0_ATOMS = np.array([2, 1, 3, 0, 2, 1])
E0_NUMBERS = np.array([1, 8, 1, 1, 8, 8, 1, 6, 6])


def e0_file(path, energy, forces=None, present=None):
    forces = np.ones((9, 3)) if forces is None else forces
    path = write_batch(path, E0_ATOMS, {"numbers": E0_NUMBERS, "forces": forces},
                       {"energy": np.asarray(energy, float)})
    if present is not None:
        with h5py.File(path, "a") as f:
            f["present/energy"] = present
    return path


def _forces_with(row, value):
    forces = np.ones((9, 3))
    forces[row, 1] = value
    return forces


@pytest.mark.parametrize("energy, forces, args, needles", [
    ([1, 2, np.inf, 4, 5, 6], None, ["fit-e0"], ["'energy' is inf in structure 2", "fit-e0"]),
    ([1, -np.inf, np.nan, 4, 5, 6], None, ["fit-e0", "--in-place"],
     ["'energy' is -inf in structure 1"]),
    ([1, 2, 3, 4, np.nan, 6], None, ["fit-e0"], ["'energy' holds 1 NaN", "structure 4"]),
    ([1, 2, 3, np.inf, 5, 6], None, ["stats", "energy", "--per-atom"],
     ["'energy' is inf in structure 3", "stats needs finite values"]),
    ([1, 2, 3, 4, 5, -np.inf], None, ["stats", "energy"], ["'energy' is -inf in structure 5"]),
    ([1] * 6, _forces_with(4, np.inf), ["stats", "forces", "--per-element"],
     ["'forces' is inf in structure 2"]),
    ([1] * 6, _forces_with(1, -np.inf), ["stats", "forces", "--chunk-atoms", "1"],
     ["'forces' is -inf in structure 0"]),
    ([1e300, -1e300, 1e308, 1.7e308, 1e300, 0], None, ["fit-e0"],
     ["'energy'", "too large", "float64"]),
    ([1e300, -1e300, 1e308, 1.7e308, 1e300, 0], None, ["stats", "energy"],
     ["'energy'", "too large", "float64"]),
    ([1] * 6, _forces_with(0, 1.7e308), ["stats", "forces"], ["'forces'", "too large"]),
])
def test_non_finite_or_overflowing_values_are_refused_naming_the_structure(
        tmp_path, energy, forces, args, needles):
    path = e0_file(tmp_path / "e.h5", energy, forces)
    before = path.read_bytes()
    command, *rest = args
    assert_one_line_error(run(command, path, *rest), 1, str(path), *needles)
    assert path.read_bytes() == before


def test_non_finite_values_of_absent_structures_are_left_out(tmp_path):
    """inf where the energy is absent: stats and fit-e0 use the others, as NumPy does."""
    energy = np.array([1.5, -2.0, np.inf, 4.0, -np.inf, 6.0])
    present = np.isfinite(energy)
    path = e0_file(tmp_path / "e.h5", energy, present=present)
    result = run("stats", path, "energy", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["stats"][0]
    values = energy[present]
    assert row["count"] == 4 and row["max"] == 6.0 and row["min"] == -2.0
    np.testing.assert_allclose([row["mean"], row["std"]], [values.mean(), values.std()])
    assert run("fit-e0", path).exit_code == 0


# --- gradcheck: empty structures and files without structures ----------------------------


@pytest.mark.parametrize("n_atoms, structures", [([0, 0, 0], "0:3"), ([0, 2, 0, 3], "2:3")])
def test_gradcheck_runs_on_empty_structures(tmp_path, n_atoms, structures):
    """Empty structures are valid input (their values and derivatives are 0, or left out where
    infinite); all of them empty, or only empty ones chosen, still checks and passes."""
    n = sum(n_atoms)
    rng = np.random.default_rng(2)
    s = len(n_atoms)
    path = write_batch(tmp_path / "empty.h5", n_atoms,
                       {"positions": rng.normal(size=(n, 3)), "forces": rng.normal(size=(n, 3)),
                        "numbers": rng.integers(1, 9, n)},
                       {"energy": rng.normal(size=s), "cell": np.tile(np.eye(3) * 5, (s, 1, 1))})
    result = run("gradcheck", path, "--structures", structures, "--op", "max,matvec",
                 "--order", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["atoms"] == 0 and data["skipped"] == {}
    assert {row["function"] for row in data["summary"]} == {"max", "matvec"}
    assert all(row["passed"] for row in data["rows"])


def test_gradcheck_on_a_file_without_structures_is_one_line(tmp_path):
    path = write_batch(tmp_path / "none.h5", np.zeros(0, np.int64),
                       {"forces": np.zeros((0, 3))}, {"energy": np.zeros(0)})
    assert_one_line_error(run("gradcheck", path), 1, str(path), "holds no structures")


# --- odd arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--order", "99999999999999999999"], "--order"),
    (["--order", "9"], "--order"),
    (["--seed", "99999999999999999999999"], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--random", "99999999999:1"], "at most 10000000"),
    (["--random", "1:99999999999"], "at most 10000000"),
])
def test_gradcheck_odd_arguments_are_usage_errors(args, needle):
    result = run("gradcheck", "--op", "sum", *args)
    assert result.exit_code == 2 and needle in result.output, result.output


@pytest.mark.parametrize("where, code, needle", [
    ("energy\0 > 1", 1, "no field or result 'energy"),
    ("energy > 1\0", 2, "is not one"),
    ("step > " + "9" * 5000, 0, None),
    ("step > 1e" + "9" * 40, 2, "exponent"),
    ("n_atoms > 0", 1, "no field or result 'n_atoms'"),
])
def test_select_odd_conditions(tmp_path, where, code, needle):
    path = tmp_path / "rich.h5"
    write_rich(path)
    out = tmp_path / "out.h5"
    result = run("select", path, "--where", where, "-o", out, "--allow-empty")
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    if needle:
        assert needle in result.output and not out.exists()
    else:
        with h5py.File(out) as f:
            assert len(f["structures/n_atoms"]) == 0


@pytest.mark.parametrize("fill", [0, -1])
def test_structures_without_numbers_are_left_out_of_fit_e0_and_per_element(tmp_path, fill):
    """numbers present in only some structures (filled with 0, element X, or with -1): those
    structures are left out of fit-e0 and of --per-element, against numpy.linalg.lstsq and
    NumPy means over the others."""
    rng = np.random.default_rng(4)
    n_atoms = np.array([2, 3, 1, 2, 3, 2, 1])
    has = np.array([True, True, False, True, True, True, False])
    numbers = np.where(np.repeat(has, n_atoms), rng.choice([1, 6, 8], n_atoms.sum()), fill)
    forces = rng.normal(size=(n_atoms.sum(), 3))
    energy = rng.normal(size=len(n_atoms))
    path = write_batch(tmp_path / "n.h5", n_atoms, {"numbers": numbers, "forces": forces},
                       {"energy": energy})
    with h5py.File(path, "a") as f:
        f["present/numbers"] = has
    result = run("fit-e0", path, "--json")
    assert result.exit_code == 0, result.output
    fit = json.loads(result.stdout)
    starts = np.cumsum(n_atoms) - n_atoms
    counts = np.stack([np.bincount(numbers[starts[s]:starts[s] + n_atoms[s]], minlength=9)
                       [[1, 6, 8]] for s in np.flatnonzero(has)])
    expected = np.linalg.lstsq(counts, energy[has], rcond=None)[0]
    assert fit["structures"] == has.sum()
    np.testing.assert_allclose([e["e0"] for e in fit["e0"]], expected, rtol=1e-10)
    result = run("stats", path, "forces", "--per-element", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["stats"]
    atom_has = np.repeat(has, n_atoms)
    assert {row["element"] for row in rows} == {1, 6, 8}
    for row in rows:
        if row["component"] == "0":
            values = forces[atom_has & (numbers == row["element"]), 0]
            assert row["count"] == len(values)
            np.testing.assert_allclose(row["mean"], values.mean(), rtol=1e-12)


@pytest.mark.parametrize("name", ["out.extxyz", "out.xyz.gz", "out.traj"])
def test_select_to_an_ase_name_exports_the_selected_structures(tmp_path, name):
    """select to a name that asks for another format writes that format (it used to get HDF5
    bytes), read back by ASE."""
    import ase.io

    path = tmp_path / "rich.h5"
    n_atoms, data, _ = write_rich(path)
    result = run("select", path, "--where", "energy > 0", "-o", tmp_path / name)
    assert result.exit_code == 0, result.output
    chosen = np.flatnonzero(data["energy"] > 0)
    frames = ase.io.read(tmp_path / name, ":")
    assert [len(a) for a in frames] == n_atoms[chosen].tolist()
    np.testing.assert_array_equal([a.get_potential_energy() for a in frames],
                                  data["energy"][chosen])
    first = np.cumsum(n_atoms) - n_atoms
    for atoms, s in zip(frames, chosen):
        rows = slice(first[s], first[s] + n_atoms[s])
        np.testing.assert_allclose(atoms.positions, data["positions"][rows], atol=1e-8)
        # (extended XYZ as ASE writes it: per-atom floats to 8 decimals)
