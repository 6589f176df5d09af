"""`segcli grad` through click's CliRunner and as a real process, against jax.grad and jax.jvp
of an independent plain-JAX reference (batch_reference)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import jax
import numpy as np
import pytest
from batch_reference import (
    RANDOM_FIELDS,
    fields_for,
    objective_jax,
    random_batch,
    write_batch,
)
from click.testing import CliRunner

from segcli._jax import enable_x64
from segcli.cli import main
from segcli.registry import OPS

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"
CHOICES = {**RANDOM_FIELDS, ("atom", None, "float"): [("x", "y"), ("t", "t"), ("v", "v")]}
FIELDS = {name: fields_for(op, CHOICES, k)
          for k, (name, op) in enumerate(OPS.items()) if op.differentiable}
DIRECTIONS = {"t": "t2", "x": "y", "y": "y", "v": "v2"}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grad") / "random.h5"
    n_atoms, data = random_batch(path, seed=9, n_structures=30)
    rng = np.random.default_rng(10)
    extra = {"t2": rng.normal(size=data["t"].shape), "v2": rng.normal(size=data["v"].shape)}
    with h5py.File(path, "r+") as f:
        for name, array in extra.items():
            f[f"atoms/{name}"] = array
    return path, n_atoms, {**data, **extra}


def reference(op, fields, n_atoms, data, weights, order, direction=None):
    """{d_FIELD: array} from jax.grad (order 1) or jax.jvp of jax.grad (order 2) of the
    weighted objective over the distinct per-atom fields, the others held fixed."""
    wrt = list(dict.fromkeys(f for f in fields if len(data[f]) == sum(n_atoms)))
    with enable_x64(True):
        def objective(moving):
            values = {**data, **dict(zip(wrt, moving))}
            return objective_jax(op, n_atoms, weights, *(values[f] for f in fields))

        primal = tuple(data[f] for f in wrt)
        if order == 1:
            grads = jax.grad(objective)(primal)
        else:
            tangent = tuple(data[direction] for _ in wrt)
            grads = jax.jvp(jax.grad(objective), (primal,), (tangent,))[1]
        return {f"d_{f}": np.asarray(g) for f, g in zip(wrt, grads)}


def assert_grads(got, expected, precision):
    rtol = {"float64": 1e-11, "float32": 2e-5}[precision]
    assert got.keys() == expected.keys()
    for label, value in expected.items():
        assert got[label].dtype == np.dtype(precision)
        scale = max(1.0, float(np.abs(value).max()))
        np.testing.assert_allclose(got[label], value, rtol=rtol, atol=rtol * scale, err_msg=label)


def stored(path, name):
    with h5py.File(path, "r") as f:
        return {label: ds[()] for label, ds in f[f"results/{name}"].items()}


@pytest.mark.parametrize("op, precision", [
    pytest.param(op, precision, marks=() if (k + j) % 2 else pytest.mark.slow)
    for k, op in enumerate(FIELDS) for j, precision in enumerate(["float64", "float32"])])
def test_gradients_and_hessian_vector_products_match_jax(tmp_path, random_file, op, precision):
    path, n_atoms, data = random_file
    fields = FIELDS[op]
    direction = DIRECTIONS[fields[0]]
    common = ["--precision", precision, "--chunk-atoms", 11, "-q"]
    cases = [([], np.ones(len(n_atoms)), 1, None),
             (["--weights", "w"], data["w"], 1, None),
             (["--weights", "w", "--order", 2, "--direction", direction], data["w"], 2, direction)]
    for k, (extra, weights, order, along) in enumerate(cases):
        out = tmp_path / f"{k}.h5"
        result = run("grad", path, op, *fields, *extra, *common, "-o", out)
        assert result.exit_code == 0 and result.output == "", result.output
        got = stored(out, "_".join([op, *fields]))
        assert_grads(got, reference(op, fields, n_atoms, data, weights, order, along), precision)


def test_a_field_used_twice_gets_its_total_derivative(tmp_path, random_file):
    path, n_atoms, data = random_file
    out = tmp_path / "g.h5"
    assert run("grad", path, "dot", "x", "x", "--weights", "w", "-o", out).exit_code == 0
    got = stored(out, "dot_x_x")
    np.testing.assert_allclose(got["d_x"], 2 * np.repeat(data["w"], n_atoms)[:, None] * data["x"],
                               rtol=1e-14)
    assert got.keys() == {"d_x"}


def test_gradient_on_the_sample_data_in_place(tmp_path, device_label):
    import ase.io

    images = ase.io.read(SAMPLES / "metals.extxyz", ":")
    n_atoms = np.array([len(a) for a in images])
    forces = np.concatenate([a.get_forces() for a in images])
    energy = np.array([a.get_potential_energy() for a in images])
    copy = tmp_path / "metals.h5"
    copy.write_bytes((SAMPLES / "metals.h5").read_bytes())
    result = run("grad", copy, "rms_norm", "forces", "--in-place", "--weights", "energy",
                 "--device", "auto")
    assert result.exit_code == 0, result.output
    assert result.stderr == f"{copy}: /results/rms_norm_forces/d_forces (199 structures, " \
                            f"{n_atoms.sum()} atoms)\n"
    expected = reference("rms_norm", ["forces"], n_atoms, {"forces": forces}, energy, 1)
    with h5py.File(copy, "r") as f:
        ds = f["results/rms_norm_forces/d_forces"]
        np.testing.assert_allclose(ds[()], expected["d_forces"], rtol=1e-11, atol=1e-14)
        attrs = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in ds.attrs.items()}
    assert {k: attrs[k] for k in ("op", "fields", "per", "precision", "device", "order",
                                  "weights")} == {
        "op": "rms_norm", "fields": ["forces"], "per": "atom", "precision": "float64",
        "device": device_label, "order": 1, "weights": "energy"}
    assert "direction" not in attrs and "created" in attrs and "segcli_version" in attrs


def test_stdout_formats(random_file):
    path, n_atoms, data = random_file
    result = run("grad", path, "dot", "x", "y", "--structures", "2:6")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "structure,atom,d_x_0,d_x_1,d_x_2,d_y_0,d_y_1,d_y_2"
    rows = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
    first = n_atoms[:2].sum()
    atoms = slice(first, first + n_atoms[2:6].sum())
    np.testing.assert_array_equal(rows[:, 0], np.repeat(np.arange(2, 6), n_atoms[2:6]))
    np.testing.assert_array_equal(rows[:, 2:], np.hstack([data["y"][atoms], data["x"][atoms]]))

    result = run("grad", path, "dot", "x", "y", "--format", "npy")
    got = np.load(io.BytesIO(result.stdout_bytes))
    assert got.dtype.names == ("d_x", "d_y") and got.shape == (n_atoms.sum(),)
    np.testing.assert_array_equal(got["d_x"], data["y"])
    np.testing.assert_array_equal(got["d_y"], data["x"])
    result = run("grad", path, "mul", "v", "s", "--format", "npy")
    np.testing.assert_array_equal(np.load(io.BytesIO(result.stdout_bytes)),
                                  np.repeat(data["s"], n_atoms))


@pytest.mark.parametrize("args, code, needle", [
    (["count"], 2, "count is not differentiable (choose from sum, mean, dot, mul, rms_norm,"),
    (["sum", "x", "--order", "2"], 2, "--order 2 needs --direction FIELD"),
    (["sum", "x", "--direction", "y"], 2, "--direction is for --order 2"),
    (["sum", "x", "--order", "3", "--direction", "y"], 2, "3 is not in the range 1<=x<=2"),
    (["sum", "x", "--order", "2", "--direction", "v"], 1,
     "field 'v' has shape (N,), but --direction (the shape of 'x') must be (N, 3)"),
    (["sum", "x", "--weights", "m"], 1,
     "field 'm' has shape (S, 3, 3), but --weights must be (S,)"),
    (["sum", "x", "--weights", "nope"], 1, "no field 'nope'; its fields are: m, s, t, t2, v,"),
    (["sum", "z"], 1, "field 'z' holds int64 values, but sum must be floating-point"),
    (["mul", "s", "v"], 1,
     "field 's' is per structure (S,), but mul's first field must be per atom"),
])
def test_errors(tmp_path, random_file, args, code, needle):
    out = tmp_path / "out.h5"
    result = run("grad", random_file[0], *args, "-o", out)
    assert result.exit_code == code, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= (2 if code == 1 else 5)
    assert os.listdir(tmp_path) == []


def test_nan_in_the_weights(tmp_path):
    w = np.ones(4)
    w[2] = np.nan
    path = write_batch(tmp_path / "b.h5", [1, 2, 3, 4], {"x": np.ones((10, 3))}, {"w": w})
    result = run("grad", path, "sum", "x", "--weights", "w", "-o", tmp_path / "o.h5")
    assert result.exit_code == 1
    assert result.stderr == f"Error: {path}: field 'w' holds 1 NaN value(s), the first in " \
                            "structure 2\n"
    assert os.listdir(tmp_path) == ["b.h5"]


def test_grad_subprocess(tmp_path):
    x = np.arange(12.0).reshape(4, 3)
    path = write_batch(tmp_path / "b.h5", [1, 3], {"x": x})
    result = subprocess.run([sys.executable, "-m", "segcli", "grad", str(path), "max_norm", "x",
                             "--format", "json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["structure"], line["atom"]) for line in lines] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    expected = np.zeros((4, 3))
    expected[[0, 3]] = x[[0, 3]] / np.linalg.norm(x[[0, 3]], axis=1)[:, None]
    np.testing.assert_allclose([line["d_x"] for line in lines], expected, rtol=1e-15, atol=0)
