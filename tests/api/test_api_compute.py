"""segcli.reduce, segcli.grad and segcli.neighbors (SPEC §1c): values against NumPy float64
and ASE, equal to what the commands print and write, and the commands' refusals."""

import csv
import io
import itertools
import json
import subprocess
import sys
from pathlib import Path

import ase.io
import h5py
import numpy as np
import pytest
from ase.neighborlist import neighbor_list
from batch_reference import random_batch
from click.testing import CliRunner

import segcli
from segcli.cli import main

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"
METALS = SAMPLES / "metals.h5"


def command(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def csv_columns(text):
    """Column name -> float64 array (an empty cell NaN) of a csv table."""
    rows = list(csv.reader(io.StringIO(text)))
    return {name: np.array([float(r[k]) if r[k] else np.nan for r in rows[1:]])
            for k, name in enumerate(rows[0])}


def per_structure(n_atoms, values, reduce):
    """reduce(rows of each structure) for each structure, in float64."""
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    return np.array([reduce(values[a:b]) for a, b in itertools.pairwise(offsets)])


def rms(rows):
    return np.sqrt((rows**2).sum() / len(rows)) if len(rows) else 0.0


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "batch.h5"
    n_atoms, arrays = random_batch(path, seed=7, n_structures=30)
    return path, n_atoms, arrays


def test_several_ops_against_numpy_and_the_commands_csv(batch):
    path, n_atoms, arrays = batch
    ops = [("rms_norm", "x"), ("max_norm", "x"), ("sum", "v"), ("count",)]
    results = segcli.reduce(path, ops, where="s > 0")
    keep = np.flatnonzero(arrays["s"] > 0)
    expected = {
        "rms_norm_x": per_structure(n_atoms, arrays["x"], rms),
        "max_norm_x": per_structure(n_atoms, arrays["x"], lambda r: np.linalg.norm(
            r, axis=1).max() if len(r) else 0.0),
        "sum_v": per_structure(n_atoms, arrays["v"], np.sum),
        "count": n_atoms}
    assert sorted(results) == sorted(expected)
    np.testing.assert_array_equal(results.structures, keep)
    np.testing.assert_array_equal(results.n_atoms, n_atoms[keep])
    assert results.source is None and results.summary is None
    for name, values in expected.items():
        np.testing.assert_allclose(results[name], values[keep], rtol=1e-12, atol=1e-14)
    assert results["count"].dtype == np.int64
    assert results.attrs["sum_v"]["op"] == "sum" and results.attrs["sum_v"]["where"] == ["s > 0"]

    printed = command("reduce", path, "rms_norm", "x", "+", "max_norm", "x", "+", "sum", "v",
                      "+", "count", "--where", "s > 0", "-q")
    assert printed.exit_code == 0, printed.output
    table = csv_columns(printed.stdout)
    np.testing.assert_array_equal(table["structure"], keep)
    for name in expected:
        np.testing.assert_array_equal(table[name], results[name])


def test_grad_against_numpy_and_the_commands_json(batch):
    path, n_atoms, arrays = batch
    results = segcli.grad(path, "rms_norm", "x", weights="w")
    owner = np.repeat(np.arange(len(n_atoms)), n_atoms)
    norms = per_structure(n_atoms, arrays["x"], rms)
    scale = np.where(norms > 0, arrays["w"] / (np.maximum(n_atoms, 1) * np.where(
        norms > 0, norms, 1)), 0.0)
    expected = arrays["x"] * scale[owner, None]
    gradient = results["rms_norm_x/d_x"]
    assert gradient.shape == (n_atoms.sum(), 3)
    np.testing.assert_allclose(gradient, expected, rtol=1e-12, atol=1e-14)

    printed = command("grad", path, "rms_norm", "x", "--weights", "w", "--format", "json", "-q")
    assert printed.exit_code == 0, printed.output
    rows = [json.loads(line) for line in printed.stdout.splitlines()]
    np.testing.assert_array_equal(np.array([r["d_x"] for r in rows]), gradient)
    np.testing.assert_array_equal([r["structure"] for r in rows], owner)


def test_neighbors_against_ase_and_the_commands_csv():
    frames = ase.io.read(SAMPLES / "metals.extxyz", ":6")
    results = segcli.neighbors(METALS, [3.0, 4.5], structures=slice(0, 6))
    for s, atoms in enumerate(frames):
        for cutoff in (3.0, 4.5):
            i, d = neighbor_list("id", atoms, cutoff)
            label = f"{cutoff:g}".removesuffix(".0")
            assert results[f"n_pairs_{label}"][s] == len(i)
            assert results[f"mean_neighbors_{label}"][s] == len(i) / len(atoms)
        np.testing.assert_allclose(results["min_distance"][s], d.min(), rtol=1e-12)
    assert results.summary["cutoffs"] == [3.0, 4.5]

    printed = command("neighbors", METALS, "--cutoff", 3, "--cutoff", 4.5, "--structures",
                      "0:6", "-q")
    table = csv_columns(printed.stdout)
    for name in ("n_pairs_3", "n_pairs_4.5", "mean_neighbors_4.5", "min_distance",
                 "min_pair_i", "min_pair_j"):
        np.testing.assert_array_equal(table[name], results[name])


def _contents(path):
    """Every dataset and attribute of an HDF5 file, but when it was made."""
    found = {}

    def visit(name, item):
        attrs = {k: np.asarray(v) for k, v in item.attrs.items() if k != "created"}
        found[name] = (attrs, item[()] if isinstance(item, h5py.Dataset) else None)

    with h5py.File(path) as h5:
        found["/"] = ({k: np.asarray(v) for k, v in h5.attrs.items()}, None)
        h5.visititems(visit)
    return found


@pytest.mark.parametrize("suffix", [".h5", ".csv"])
def test_output_is_the_file_the_command_writes(tmp_path, batch, suffix):
    path = batch[0]
    mine, theirs = tmp_path / f"mine{suffix}", tmp_path / f"theirs{suffix}"
    kept = segcli.reduce(path, "dot", "x", "y", where="w < 1.5")
    written = segcli.reduce(path, "dot", "x", "y", where="w < 1.5", output=mine)
    printed = command("reduce", path, "dot", "x", "y", "--where", "w < 1.5", "-o", theirs)
    assert printed.exit_code == 0, printed.output
    if suffix == ".h5":
        np.testing.assert_equal(_contents(mine), _contents(theirs))
    else:
        assert mine.read_bytes() == theirs.read_bytes()
    assert written.path == str(mine) and list(written) == ["dot_x_y"]
    np.testing.assert_array_equal(written["dot_x_y"], kept["dot_x_y"])
    np.testing.assert_array_equal(written.structures, kept.structures)


def test_bad_data_raises_the_commands_data_error(batch):
    path, _, _ = batch
    with pytest.raises(segcli.DataError) as raised:
        segcli.reduce(path, "sum", "nope")
    printed = command("reduce", path, "sum", "nope")
    assert printed.exit_code == 1
    assert printed.stderr.strip() == f"Error: {raised.value}"


@pytest.mark.parametrize("call, argument", [
    (lambda p: segcli.reduce(p, "summ", "x"), "op: unknown op 'summ'"),
    (lambda p: segcli.reduce(p, "sum", "x", output="out.txt"), "output out.txt: name a segcli"),
    (lambda p: segcli.reduce(p, "sum", "x", output="o.h5", in_place=True), "give output or"),
    (lambda p: segcli.reduce(p, "sum", "x", length=4), "length is for bincount"),
    (lambda p: segcli.reduce(p, "sum", "x", device="tpu"), "device must be one of"),
    (lambda p: segcli.reduce(p, "sum", "x", in_place=True, structures=2), "in_place stores"),
    (lambda p: segcli.grad(p, "sum", "x", order=2), "order 2 needs direction"),
    (lambda p: segcli.grad(p, "count"), "op: count is not differentiable"),
    (lambda p: segcli.neighbors(p, -1.0), "cutoff: cutoff -1 must be positive"),
])
def test_bad_arguments_are_value_errors_naming_them(batch, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(batch[0])


def test_progress_is_told_done_and_total(batch):
    path, n_atoms, _ = batch
    calls = []
    segcli.reduce(path, "sum", "v", chunk_atoms=20, progress=lambda *a: calls.append(a))
    assert len(calls) > 2 and calls[-1] == (len(n_atoms), len(n_atoms))
    done = [d for d, _ in calls]
    assert done == sorted(done) and {t for _, t in calls} == {len(n_atoms)}


def test_import_segcli_loads_the_functions_only_when_asked_for():
    code = """
import sys
import segcli
assert "numpy" not in sys.modules and "segcli.api" not in sys.modules
import segcli.neighborlist
print(segcli.neighbors.__module__, segcli.Results.__name__, segcli.DataError.__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["segcli.api.compute", "Results", "DataError"]
