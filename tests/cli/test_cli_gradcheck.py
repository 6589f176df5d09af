"""The gradcheck command: tables, JSON, exit codes, files and random data, wrong ops caught."""

import json
from pathlib import Path

import h5py
import jax
import numpy as np
import pytest
from click.testing import CliRunner
from terminal import BAR, final_screen, on_terminal

from segcli import ops
from segcli.cli import main
from segcli.registry import OPS

ROOT = Path(__file__).resolve().parents[2]
METALS = ROOT / "sample_data" / "metals.h5"


def run(*args):
    return CliRunner().invoke(main, ["gradcheck", *map(str, args)])


def table_rows(output):
    """(op, order, result) for each row of the printed table."""
    rows = []
    for line in output.splitlines():
        words = line.split()
        if len(words) > 2 and words[0] in OPS and words[1].isdigit():
            rows.append((words[0], int(words[1]), "FAIL" if "FAIL" in words else "pass"))
    return rows


def failing(data):
    return {(row["function"], row["order"]) for row in data["summary"] if not row["passed"]}


@pytest.mark.slow  # order 2: about 16 s
def test_random_data_table_has_one_passing_row_per_op_and_order():
    result = run("--random", "40:5", "--op", "sum,max_norm,count", "--order", "2", "--seed", "3")
    assert result.exit_code == 0, result.output
    assert table_rows(result.output) == [
        ("sum", 0, "pass"), ("sum", 1, "pass"), ("sum", 2, "pass"),
        ("max_norm", 0, "pass"), ("max_norm", 1, "pass"), ("max_norm", 2, "pass"),
        ("count", 0, "pass"),
    ]
    assert "random data: 40 atoms in 5 structures, order 2" in result.output


@pytest.mark.slow
def test_json_on_sample_file_names_the_fields_and_every_check():
    result = run(METALS, "--structures", "2:6", "--op", "dot,mul,matvec", "--order", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    with h5py.File(METALS) as h5:
        assert data["atoms"] == int(h5["structures/n_atoms"][2:6].sum())
    assert data["passed"] is True and data["structures"] == [2, 6] and data["order"] == 1
    arguments = {(row["function"], row["argument"]) for row in data["rows"] if row["order"] == 1}
    assert arguments == {("dot", "x=forces"), ("dot", "y=positions"), ("mul", "x=forces"),
                         ("mul", "y=energy"), ("matvec", "v=scaled_positions"),
                         ("matvec", "m=cell")}
    modes = {row["mode"] for row in data["rows"]}
    assert modes == {"value vs ref", "jvp vs ref", "vjp vs ref", "jvp vs fd", "vjp vs fd",
                     "vjp vs jvp"}
    for row in data["rows"]:
        assert row["passed"] and 0 <= row["abs_error"] <= row["tolerance"]
        if row["mode"].endswith("vs fd"):
            assert row["tolerance"] > 0 and row["rel_error"] < 1e-8
    assert [(row["function"], row["order"]) for row in data["summary"]] == [
        (op, k) for op in ("dot", "mul", "matvec") for k in (0, 1)]


def wrong_gradient_sum(x, idx, num_segments, **_):
    """A segment sum whose reverse-mode rule is off by 1e-3 relative."""

    @jax.custom_vjp
    def total(x):
        return jax.ops.segment_sum(x, idx, num_segments)

    total.defvjp(lambda x: (total(x), None), lambda _, ct: (ct[idx] * (1 + 1e-3),))
    return total(x)


def test_wrong_gradient_of_an_op_fails_with_exit_1(monkeypatch):
    monkeypatch.setattr(ops, "segmented_sum", wrong_gradient_sum)
    result = run("--random", "24:4", "--op", "sum,mean", "--order", "1", "--json")
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["passed"] is False
    assert failing(data) == {("sum", 1)}
    failed = {(row["argument"], row["mode"]) for row in data["rows"] if not row["passed"]}
    assert failed == {("x", "vjp vs fd"), ("x", "vjp vs ref")}
    assert any("forward mode unavailable" in row["note"]
               for row in data["rows"] if row["function"] == "sum")

    table = run("--random", "24:4", "--op", "sum", "--order", "1")
    assert table.exit_code == 1
    assert ("sum", 1, "FAIL") in table_rows(table.output) and "FAILED" in table.output

    quiet = run("--random", "24:4", "--op", "sum", "--order", "1", "--quiet")
    assert quiet.exit_code == 1 and table_rows(quiet.output) == [("sum", 1, "FAIL")]


def test_wrong_values_with_right_derivatives_fail_at_order_0_only(monkeypatch):
    correct = ops.segmented_mean
    monkeypatch.setattr(ops, "segmented_mean",
                        lambda x, idx, m, **kw: correct(x, idx, m, **kw) + 1e-6)
    result = run("--random", "24:4", "--op", "mean", "--order", "1", "--json")
    assert result.exit_code == 1
    assert failing(json.loads(result.output)) == {("mean", 0)}


def write_batch(path, n_atoms, forces, positions):
    """A segcli HDF5 file (SPEC §4) with forces and positions."""
    with h5py.File(path, "w") as h5:
        h5.attrs.update(format="segcli-batch", version=1)
        h5["structures/n_atoms"] = np.asarray(n_atoms, np.int64)
        h5["atoms/forces"] = forces
        h5["atoms/positions"] = positions


@pytest.mark.slow  # every fit op at order 1: about 27 s
def test_non_differentiable_structures_are_left_out_and_unfit_ops_skipped(tmp_path):
    rng = np.random.default_rng()
    n_atoms = [3, 4, 5, 2]
    directions = rng.normal(size=(14, 3))
    norms = 1 + 0.1 * rng.permutation(14)  # no two atoms tie
    forces = directions / np.linalg.norm(directions, axis=1, keepdims=True) * norms[:, None]
    forces[3:7] = 0  # structure 1: all zero, neither norm is differentiable there
    forces[8] = 10 * forces[0]  # structure 2: two atoms tie for the largest norm
    forces[10] = -10 * forces[0]
    path = tmp_path / "kinks.h5"
    write_batch(path, n_atoms, forces, rng.normal(size=(14, 3)))
    result = run(path, "--json", "--order", "1")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    notes = {row["function"]: row["note"] for row in data["summary"] if row["order"] == 1}
    assert "leave out 1 structure(s)" in notes["rms_norm"]
    assert "leave out 2 structure(s)" in notes["max_norm"]
    fit = {name for name, op in OPS.items()  # forces and positions fit these, nothing else
           if all((a.per, a.shape, a.kind) == ("atom", None, "float") for a in op.inputs)}
    assert {row["function"] for row in data["summary"]} == fit
    assert set(data["skipped"]) == set(OPS) - fit and "no field 'energy'" in data["skipped"]["mul"]


@pytest.mark.slow
def test_field_option_picks_the_per_atom_field():
    result = run(METALS, "--structures", ":3", "--op", "rms_norm", "--field", "velocities",
                 "--order", "1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {row["argument"] for row in data["rows"] if row["order"] == 1} == {"x=velocities"}


def test_quiet_prints_nothing_on_success():
    result = run("--random", "16:3", "--op", "count", "--quiet")
    assert result.exit_code == 0 and result.output == ""


@pytest.mark.parametrize("args, message", [
    (["--op", "sum,median"], "unknown op 'median'"),
    (["--random", "10"], "ATOMS:STRUCTURES"),
    (["--random", "0:3"], "at least 1"),
    ([METALS, "--structures", "5:3"], "STOP must be greater than START"),
    ([METALS, "--structures", "a:b"], "START:STOP"),
    ([METALS, "--random", "10:2"], "not both"),
    (["--field", "forces"], "need FILE"),
    (["--order", "0"], "--order"),
])
def test_command_line_errors_exit_2(args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize("args, message", [
    (["--field", "no_such_field", "--op", "sum"], "no field 'no_such_field'"),
    (["--field", "energy", "--op", "sum"],
     "field 'energy' is per structure (S,), but sum must be per atom"),
    (["--field", "numbers", "--op", "sum"], "field 'numbers' holds int64"),
    (["--field", "energies", "--op", "matvec"],
     "field 'energies' has shape (N,), but matvec's first field must be (N, 3)"),
    (["--structures", "500:600"], "selects no structure (the file has 199)"),
])
def test_data_errors_exit_1_with_one_line(args, message):
    result = run(METALS, *args)
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_missing_default_field_is_a_data_error(tmp_path):
    path = tmp_path / "no_energy.h5"
    write_batch(path, [2, 3], np.ones((5, 3)), np.ones((5, 3)))
    result = run(path, "--op", "mul")
    assert result.exit_code == 1
    assert "no field 'energy'; its fields are: forces, positions" in result.output


def test_device_choice():
    import warp

    result = run("--random", "8:2", "--op", "count", "--device", "cpu")
    if warp.is_cpu_available():
        assert result.exit_code == 0, result.output
    else:  # a Warp build without its CPU backend (warp-clang): a usage error, not a traceback
        assert result.exit_code == 2 and "no CPU backend" in result.output
    has_gpu = any(device.platform == "gpu" for device in jax.devices())
    result = run("--random", "8:2", "--op", "count", "--device", "gpu")
    assert result.exit_code == (0 if has_gpu else 2)


def test_a_warp_build_without_cpu_backend_refuses_the_cpu(monkeypatch):
    from segcli.ops import kernels

    monkeypatch.setattr(kernels, "cpu_available", lambda: False)
    result = run("--random", "8:2", "--op", "count", "--device", "cpu")
    assert result.exit_code == 2 and "no CPU backend (warp-clang)" in result.output
    assert "Traceback" not in result.output


def test_subprocess_entry_point_and_its_progress_bar():
    """`python -m segcli gradcheck` as a program with its stderr on a terminal: the table on
    stdout, and on the terminal one finished bar of done of total ops, its rate and ETA (the
    gradcheck case of tests/cli/test_progress.py, in the same process)."""
    code, shown, stdout = on_terminal("gradcheck", "--random", "32:4", "--op", "sum", cwd=ROOT)
    assert code == 0, shown
    assert table_rows(stdout) == [("sum", 0, "pass"), ("sum", 1, "pass"), ("sum", 2, "pass")]
    bars = [m for m in map(BAR.fullmatch, final_screen(shown)) if m]
    assert len(bars) == 1, shown
    assert (bars[0]["label"], int(bars[0]["done"]), int(bars[0]["total"]),
            bars[0]["unit"] or bars[0]["per"]) == ("gradcheck", 1, 1, "op")


def test_help_has_an_example():
    result = run("--help")
    assert result.exit_code == 0 and "Example:" in result.output
    assert "segcli gradcheck sample_data/metals.h5" in result.output
