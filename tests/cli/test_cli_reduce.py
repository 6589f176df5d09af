"""`segcli reduce` and `segcli ops` through click's CliRunner and as real processes, against an
independent NumPy float64 reference (batch_reference) and ASE."""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import ase.io
import h5py
import numpy as np
import pytest
from batch_reference import (
    assert_reduced,
    fields_for,
    random_batch,
    reduce_reference,
    write_batch,
)
from click.testing import CliRunner

from segcli import __version__
from segcli.cli import main
from segcli.registry import OPS

SAMPLES = Path(__file__).resolve().parents[2] / "sample_data"
METALS = SAMPLES / "metals.h5"
METAL_CHOICES = {
    ("atom", None, "float"): [("forces", "velocities"), ("momenta", "forces")],
    ("atom", (3,), "float"): [("scaled_positions",)],
    ("structure", (), "float"): [("energy",)],
    ("structure", (3, 3), "float"): [("cell",)],
    ("atom", (), "labels"): [("numbers",)],
}
METAL_FIELDS = {name: fields_for(op, METAL_CHOICES, k) for k, (name, op) in enumerate(OPS.items())}
RANDOM_FIELDS = {name: fields_for(op, turn=k + 1) for k, (name, op) in enumerate(OPS.items())}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def table(text):
    """(header, rows as float64) of CSV text."""
    lines = text.splitlines()
    rows = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
    return lines[0].split(","), rows.reshape(len(lines) - 1, -1)


def assert_data_error(result, *needles):
    """Exit 1, one or two lines on stderr naming the problem, no traceback, no stdout."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def dataset_digests(path):
    """sha256 of the bytes and the attributes of every dataset in an HDF5 file."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(
            name, (hashlib.sha256(obj[()].tobytes()).hexdigest(), obj.dtype.str, obj.shape,
                   sorted((k, str(v)) for k, v in obj.attrs.items())))
            if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.fixture(scope="module")
def metals():
    """n_atoms and fields of the sample structures, from ASE's own accessors."""
    images = ase.io.read(SAMPLES / "metals.extxyz", ":")
    per_atom = {"forces": lambda a: a.get_forces(), "momenta": lambda a: a.get_momenta(),
                "numbers": lambda a: a.numbers,
                "velocities": lambda a: a.get_velocities(), "positions": lambda a: a.positions,
                "scaled_positions": lambda a: a.get_scaled_positions(wrap=False)}
    data = {name: np.concatenate([get(a) for a in images]) for name, get in per_atom.items()}
    data["energy"] = np.array([a.get_potential_energy() for a in images])
    data["cell"] = np.stack([a.cell.array for a in images])
    return np.array([len(a) for a in images]), data


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reduce") / "random.h5"
    return path, *random_batch(path, seed=5, n_structures=60)


@pytest.mark.parametrize("op, precision", [
    pytest.param(op, precision, marks=() if (k + j) % 2 else pytest.mark.slow)
    for k, op in enumerate(OPS) for j, precision in enumerate(["float64", "float32"])])
def test_every_op_on_the_sample_data_matches_the_reference(metals, op, precision):
    n_atoms, data = metals
    fields = METAL_FIELDS[op]
    result = run("reduce", METALS, op, *fields, "--precision", precision, "--chunk-atoms", 300)
    assert result.exit_code == 0, result.output
    header, rows = table(result.stdout)
    expected = reduce_reference(op, n_atoms, *(data[f] for f in fields))
    name = "_".join([op, *fields])
    keys = ["structure", "atom"] if OPS[op].output_per == "atom" else ["structure"]
    assert header[:len(keys)] == keys and len(header) == len(keys) + expected[0].size
    if expected.ndim <= 2:
        assert header[len(keys):] == ([name] if expected.ndim == 1 else
                                      [f"{name}_{i}" for i in range(expected.shape[1])])
    np.testing.assert_array_equal(rows[:, 0], np.repeat(np.arange(len(n_atoms)), n_atoms)
                                  if len(keys) == 2 else np.arange(len(n_atoms)))
    if len(keys) == 2:
        np.testing.assert_array_equal(rows[:, 1], np.concatenate([np.arange(n) for n in n_atoms]))
    got = rows[:, len(keys):].reshape(expected.shape)
    assert_reduced(got, op, n_atoms, [data[f] for f in fields], precision)


@pytest.mark.parametrize("source", ["metals.h5", "metals.extxyz"])
def test_matvec_of_scaled_positions_and_cell_gives_ases_positions(metals, source):
    result = run("reduce", SAMPLES / source, "matvec", "scaled_positions", "cell",
                 "--format", "npy")
    assert result.exit_code == 0, result.stderr
    positions = np.load(io.BytesIO(result.stdout_bytes))
    np.testing.assert_allclose(positions, metals[1]["positions"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("precision", [pytest.param("float64", marks=pytest.mark.slow),
                                       "float32"])
def test_every_op_on_random_data_in_small_chunks_to_a_file(tmp_path, random_file, precision):
    path, n_atoms, data = random_file
    turn = ["float64", "float32"].index(precision)
    for op, fields in list(RANDOM_FIELDS.items())[turn::2]:  # each op in one precision
        out = tmp_path / f"{op}.h5"
        result = run("reduce", path, op, *fields, "-o", out, "--chunk-atoms", 7,
                     "--precision", precision, "--quiet")
        assert result.exit_code == 0 and result.output == "", result.output
        name = "_".join([op, *fields])
        with h5py.File(out, "r") as f:
            got = f[f"results/{name}"][()]
            np.testing.assert_array_equal(f["structures/n_atoms"][()], n_atoms)
        assert got.dtype == (np.int64 if OPS[op].output_dtype == "count" else np.dtype(precision))
        assert_reduced(got, op, n_atoms, [data[f] for f in fields], precision)


def test_the_program_takes_turns_at_the_chunks_on_every_cpu_device(tmp_path, random_file):
    """The segcli program with XLA's CPU split into 3 devices and 3 threads, whose chunks take
    turns at them (several in flight): the bits this process's one device gives, for every op
    in one pass and for gradients; a NaN in a later chunk counted over all of them, as here;
    with 2 threads, 2 of the devices."""
    path, n_atoms, data = random_file
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
           "SEGCLI_THREADS": "3"}
    peers = subprocess.run([sys.executable, "-c", "import jax; from segcli import engine; "
                            "print(len(engine.peers(jax.devices('cpu')[0])))"], env=env,
                           capture_output=True, text=True)
    assert peers.stdout.split()[-1] == "3", peers.stderr
    two = subprocess.run([sys.executable, "-c", "import jax; from segcli import engine; "
                          "print(len(engine.peers(jax.devices('cpu')[0])))"],
                         env={**env, "SEGCLI_THREADS": "2"}, capture_output=True, text=True)
    assert two.stdout.split()[-1] == "2", two.stderr
    nan = tmp_path / "nan.h5"
    x = data["x"].copy()
    x[[40, 41, len(x) - 1], 1] = np.nan
    write_batch(nan, n_atoms, {"x": x})
    passes = {"reduce": [w for op, fields in RANDOM_FIELDS.items() for w in ("+", op, *fields)],
              "grad": ["+", "rms_norm", "x", "+", "dot", "x", "y", "+", "max_norm", "t"]}
    for command, words in passes.items():
        outputs = []
        for where in ("here", "program"):
            out = tmp_path / f"{command}-{where}.h5"
            argv = [command, path, *words[1:], "-o", out, "--chunk-atoms", 30, "--quiet"]
            if where == "here":
                result = run(*argv)
                assert result.exit_code == 0, result.output
            else:
                done = subprocess.run([sys.executable, "-m", "segcli", *map(str, argv)], env=env,
                                      capture_output=True, text=True)
                assert done.returncode == 0, done.stderr
            outputs.append({name: d[:3] for name, d in dataset_digests(out).items()})  # bits
        assert outputs[0] == outputs[1], command
    errors = [run("reduce", nan, "sum", "x", "--chunk-atoms", 30).stderr,
              subprocess.run([sys.executable, "-m", "segcli", "reduce", str(nan), "sum", "x",
                              "--chunk-atoms", "30"], env=env, capture_output=True,
                             text=True).stderr]
    assert errors[0] == errors[1] and "holds 3 NaN value(s)" in errors[0], errors


def test_selected_structures_name_json_and_npy(random_file):
    path, n_atoms, data = random_file
    first = n_atoms[:10].sum()
    rows = slice(first, first + n_atoms[10:25].sum())
    expected = reduce_reference("sum", n_atoms[10:25], data["x"][rows])
    result = run("reduce", path, "sum", "x", "--structures", "10:25", "--format", "json",
                 "--name", "total")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["structure"] for line in lines] == list(range(10, 25))
    assert all(list(line) == ["structure", "total"] for line in lines)
    np.testing.assert_allclose([line["total"] for line in lines], expected, rtol=1e-12)

    result = run("reduce", path, "mul", "x", "s", "--structures", "10:25", "--format", "json")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["structure"], line["atom"]) for line in lines] == [
        (s, a) for s in range(10, 25) for a in range(n_atoms[s])]
    np.testing.assert_allclose([line["mul_x_s"] for line in lines],
                               reduce_reference("mul", n_atoms[10:25], data["x"][rows],
                                            data["s"][10:25]), rtol=1e-12)

    result = run("reduce", path, "rms_norm", "x", "--structures", "10:", "--format", "npy",
                 "--precision", "float32")
    got = np.load(io.BytesIO(result.stdout_bytes))
    assert got.dtype == np.float32 and got.shape == (50,)
    assert_reduced(got, "rms_norm", n_atoms[10:], [data["x"][first:]], "float32")


def test_float32_csv_prints_the_shortest_float32_text(tmp_path):
    x = np.array([[0.1], [0.2], [1e-8]])
    path = write_batch(tmp_path / "b.h5", [1, 1, 1], {"x": x})
    result = run("reduce", path, "sum", "x", "--precision", "float32")
    assert result.stdout == "structure,sum_x_0\n0,0.1\n1,0.2\n2,1e-08\n"
    result = run("reduce", path, "sum", "x")
    assert result.stdout == "structure,sum_x_0\n0,0.1\n1,0.2\n2,1e-08\n"
    result = run("reduce", path, "count", "--format", "json")
    assert result.stdout == "".join(f'{{"structure": {s}, "count": 1}}\n' for s in range(3))


def test_output_file_attributes_force_and_in_place(tmp_path, random_file, device_label):
    path, n_atoms, data = random_file
    out = tmp_path / "out.h5"
    result = run("reduce", path, "dot", "x", "y", "-o", out, "--structures", "3:9", "--device",
                 "auto")
    assert result.exit_code == 0, result.output
    assert result.stderr == f"{out}: /results/dot_x_y (6 structures, {n_atoms[3:9].sum()} atoms)\n"
    with h5py.File(out, "r") as f:
        assert {k: v for k, v in f.attrs.items() if k != "sources"} == {
            "format": "segcli-batch", "version": 1}
        assert f.attrs["sources"].tolist() == [str(path)]
        np.testing.assert_array_equal(f["structures/n_atoms"][()], n_atoms[3:9])
        np.testing.assert_array_equal(f["structures/source"][()], np.zeros(6))
        np.testing.assert_array_equal(f["structures/source_index"][()], np.arange(3, 9))
        attrs = {k: v.tolist() if isinstance(v, np.ndarray) else v
                 for k, v in f["results/dot_x_y"].attrs.items()}
    created = attrs.pop("created")
    digest = hashlib.sha256(json.dumps([[os.path.realpath(path), os.path.getsize(path),
                                         os.stat(path).st_mtime_ns]]).encode())
    digest.update(np.asarray(n_atoms, np.int64).tobytes())
    assert attrs == {"op": "dot", "fields": ["x", "y"], "per": "structure", "precision": "float64",
                     "device": device_label, "segcli_version": __version__, "structures": "3:9",
                     "source_fingerprint": digest.hexdigest()[:32],
                     "source_structures": len(n_atoms)}
    assert abs(datetime.now(timezone.utc) - datetime.fromisoformat(created)) < timedelta(hours=1)
    before = out.read_bytes()
    assert_data_error(run("reduce", path, "dot", "x", "y", "-o", out), "already exists",
                      "--force")
    assert out.read_bytes() == before
    assert run("reduce", path, "count", "-o", out, "--force").exit_code == 0
    with h5py.File(out, "r") as f:
        assert list(f["results"]) == ["count"]

    copy = tmp_path / "copy.h5"
    copy.write_bytes(Path(path).read_bytes())
    digests = dataset_digests(copy)
    assert run("reduce", copy, "rms_norm", "x", "--in-place", "-q").exit_code == 0
    after = dataset_digests(copy)
    assert {k: v for k, v in after.items() if not k.startswith("results/")} == digests
    with h5py.File(copy, "r") as f:
        np.testing.assert_allclose(f["results/rms_norm_x"][()],
                                   reduce_reference("rms_norm", n_atoms, data["x"]), rtol=1e-12)
        assert f["results/rms_norm_x"].attrs["per"] == "structure"
    assert_data_error(run("reduce", copy, "rms_norm", "x", "--in-place"),
                      "result 'rms_norm_x' already exists")
    assert run("reduce", copy, "rms_norm", "y", "--in-place", "--name", "rms_norm_x",
               "--force").exit_code == 0
    with h5py.File(copy, "r") as f:
        np.testing.assert_allclose(f["results/rms_norm_x"][()],
                                   reduce_reference("rms_norm", n_atoms, data["y"]), rtol=1e-12)
    assert sorted(os.listdir(tmp_path)) == ["copy.h5", "out.h5"]


@pytest.mark.parametrize("args, needles", [
    (["sum", "forcez"],
     ["metals.h5: no field 'forcez'; its fields are: cell, config_type, energies, energy,"]),
    (["sum", "energy"], ["field 'energy' is per structure (S,), but sum must be per atom"]),
    (["mul", "forces", "positions"], ["field 'positions' is per atom (N, 3), but mul's second"]),
    (["matvec", "forces", "stress"], ["field 'stress' has shape (S, 6), but matvec's second "
                                      "field must be (S, 3, 3)"]),
    (["dot", "forces", "energies"], ["dot needs fields of the same shape"]),
    (["sum", "forces", "--structures", "500:600"], ["selects no structure (the file has 199)"]),
    (["sum", "forces", "--structures", "-500:-300"],
     ["--structures -500:-300 selects no structure"]),
    (["sum", "forces", "--structures", "199"], ["--structures 199:200 selects no structure"]),
])
def test_data_errors_exit_1_and_write_nothing(tmp_path, args, needles):
    out = tmp_path / "out.h5"
    assert_data_error(run("reduce", METALS, *args, "-o", out), *needles)
    assert os.listdir(tmp_path) == []
    assert_data_error(run("reduce", METALS, *args), *needles)


@pytest.mark.parametrize("given, same_as", [("-5:", "194:"), ("7", "7:8"), ("190:-5", "190:194")])
def test_structures_are_python_slices(given, same_as):
    got = run("reduce", METALS, "count", "--structures", given)
    assert got.exit_code == 0, got.output
    assert got.stdout == run("reduce", METALS, "count", "--structures", same_as).stdout


def test_nan_and_bad_files_exit_1(tmp_path):
    x = np.ones((30, 3))
    x[[7, 8, 20]] = np.nan
    path = write_batch(tmp_path / "nan.h5", [5] * 6, {"x": x})
    out = tmp_path / "out.h5"
    assert_data_error(run("reduce", path, "rms_norm", "x", "-o", out, "--chunk-atoms", 5),
                      "nan.h5: field 'x' holds 9 NaN value(s), the first in structure 1")
    copy = tmp_path / "copy.h5"
    copy.write_bytes(path.read_bytes())
    assert_data_error(run("reduce", copy, "rms_norm", "x", "--in-place"), "holds 9 NaN")
    assert copy.read_bytes() == path.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["copy.h5", "nan.h5"]
    assert_data_error(run("reduce", SAMPLES / "metals.extxyz", "count", "--in-place"),
                      "results can only be stored in a segcli HDF5 file")
    assert_data_error(run("reduce", tmp_path / "missing.h5", "count"), "missing.h5: no such file")
    result = run("--debug", "reduce", path, "sum", "x")
    assert result.exit_code == 1 and "NaN" in str(result.exception)
    assert type(result.exception).__name__ == "DataError"


@pytest.mark.parametrize("args, needle", [
    (["frobnicate", "forces"], "unknown op 'frobnicate' (choose from sum, mean, dot,"),
    (["sum"], "sum takes 1 field(s): a per-atom (N, *F); got 0"),
    (["dot", "forces"], "dot takes 2 field(s)"),
    (["count", "forces"], "count takes no field(s); got 1"),
    (["sum", "forces", "-o", "a.h5", "--in-place"], "not both"),
    (["sum", "forces", "-o", "a.h5", "--format", "json"], "--format is for stdout"),
    (["sum", "forces", "--in-place", "--structures", "0:5"], "--structures cannot be used"),
    (["sum", "forces", "--structures", "5:2"], "STOP must be greater than START"),
    (["sum", "forces", "--structures", "1:2:3"], "expected START:STOP or an index"),
    (["sum", "forces", "--structures", "a"], "expected START:STOP or an index"),
    (["sum", "forces", "--format", "xml"], "'xml' is not one of"),
    (["sum", "forces", "--chunk-atoms", "0"], "0 is not in the range 1<=x<="),
    (["sum", "forces", "--chunk-atoms", str(10**20)], "not in the range 1<=x<=4611686018427387904"),
    (["sum", "forces", "--name", "a//b"], "is not a result name"),
    (["sum", "forces", "--name", "."], "'.' is not a result name"),
    (["sum", "forces", "--name", "a/../b"], "is not a result name"),
    (["sum", "forces", "--name", "a\0b"], "is not a result name"),
    (["sum", "forces", "--length", "5"], "--length is for bincount"),
    (["bincount", "numbers", "--length", "0"], "0 is not in the range x>=1"),
])
def test_usage_errors_exit_2(args, needle):
    result = run("reduce", METALS, *args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_ops_lists_every_op():
    result = run("ops")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["op", "inputs", "output", "derivatives"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == list(OPS)
    assert rows["matvec"][:4] == ["(N,", "3)", "(S,", "3,"]
    assert rows["count"][:3] == ["-", "(S,)", "no"]
    assert rows["bincount"][:5] == ["(N,)", "labels", "(S,", "length)", "no"]


def segcli_process(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "segcli", *map(str, args)], **kwargs)


def test_subprocess_pipelines(metals, tmp_path):
    command = (f"{sys.executable} -m segcli reduce {METALS} rms_norm forces "
               "| sort -t, -k2 -g | tail -3")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    expected = reduce_reference("rms_norm", metals[0], metals[1]["forces"])
    top = np.argsort(expected)[-3:]
    lines = result.stdout.splitlines()
    assert [int(line.split(",")[0]) for line in lines] == list(top)
    np.testing.assert_allclose([float(line.split(",")[1]) for line in lines], expected[top],
                               rtol=1e-12)
    command = (f"{sys.executable} -m segcli reduce {METALS} mul forces energy | head -1; "
               "echo ${PIPESTATUS[0]}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert result.stdout.splitlines()[1] == "141" and "Traceback" not in result.stderr


def test_in_place_survives_sigkill_at_any_moment(tmp_path):
    """SIGKILL at several moments of an in-place run (start-up, copy, compute, write) never
    damages the input; a later run succeeds."""
    rng = np.random.default_rng(1)
    n_atoms = rng.integers(1, 16, 150_000)
    path = write_batch(tmp_path / "big.h5", n_atoms,
                       {"forces": rng.normal(size=(n_atoms.sum(), 3))},
                       {"energy": np.zeros(150_000)})
    digests = dataset_digests(path)
    command = ["reduce", path, "rms_norm", "forces", "--in-place", "--force", "--chunk-atoms", 4096]

    def temporary():
        return [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]

    outcomes = []
    for moment in (0.5, 1.5, "copy", "write"):
        process = segcli_process(*command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started, seen = time.monotonic(), len(temporary())
        if isinstance(moment, float):
            time.sleep(moment)
        else:
            while len(temporary()) == seen and process.poll() is None:
                time.sleep(0.002)
            time.sleep(0 if moment == "copy" else 0.3)
        during = len(temporary()) > seen
        process.send_signal(signal.SIGKILL)
        outcomes.append((moment, process.wait(), during, round(time.monotonic() - started, 2)))
        current = dataset_digests(path)
        assert {k: v for k, v in current.items() if not k.startswith("results/")} == digests, \
            outcomes
    assert any(code == -signal.SIGKILL and during for _, code, during, _ in outcomes), outcomes
    result = run(*command)  # the later run: in this process
    assert result.exit_code == 0, result.output
    with h5py.File(path, "r") as f:
        np.testing.assert_allclose(f["results/rms_norm_forces"][()],
                                   reduce_reference("rms_norm", n_atoms, f["atoms/forces"][()]),
                                   rtol=1e-12)
    assert {k: v for k, v in dataset_digests(path).items() if not k.startswith("results")} == \
        digests


def test_matvec_on_structures_without_a_cell_warns_once_or_refuses(tmp_path):
    import ase.build

    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, [ase.build.bulk("Cu", cubic=True), ase.build.molecule("H2O"),
                        ase.build.molecule("CH4")], format="extxyz")
    command = ["reduce", path, "matvec", "scaled_positions", "cell"]
    warned = run(*command)
    assert warned.exit_code == 0 and len(table(warned.stdout)[1]) == 4 + 3 + 5
    assert warned.stderr.count("warning:") == 1
    assert "'cell' is singular or zero in 2 of 3 structure(s)" in warned.stderr
    quiet = run(*command, "-q")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == warned.stdout
    out = tmp_path / "out.h5"
    assert_data_error(run(*command, "--strict", "-o", out), "singular or zero in 2 of 3",
                      "--strict")
    assert not out.exists()
    grad = run("grad", path, "matvec", "scaled_positions", "cell", "--strict")
    assert_data_error(grad, "singular or zero")


@pytest.mark.parametrize("op, precision", [("var", "float64"), ("std", "float64"),
                                           ("sum", "float64"), ("dot", "float32")])
def test_a_value_that_overflows_its_precision_is_refused_not_inf(tmp_path, op, precision):
    """Finite values whose result leaves the precision's range (in the structure between
    others) are refused naming that structure; the same op over the others is exact."""
    big = np.finfo(precision).max / 2
    forces = np.array([[1.0, 2, 3], [big, big, 0], [big, -big, 0], [big, big, 0], [4, 5, 6]])
    n_atoms = np.array([1, 3, 1])
    path = write_batch(tmp_path / "b.h5", n_atoms, {"forces": forces})
    fields = ["forces", "forces"] if op == "dot" else ["forces"]
    result = CliRunner().invoke(main, ["reduce", str(path), op, *fields,
                                       "--precision", precision])
    assert result.exit_code == 1, result.output
    assert result.output == (f"Error: {path}: the {op} of 'forces' over structure 1 overflows "
                             f"{precision} (its values are finite, the result is not)\n")
    result = CliRunner().invoke(main, ["reduce", str(path), op, *fields, "--structures", "2:",
                                       "--precision", precision, "--format", "json"])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    last = forces[-1].astype(np.float64)
    expected = {"var": [0, 0, 0], "std": [0, 0, 0], "sum": last, "dot": [last @ last]}[op]
    got = [v for k, v in row.items() if k != "structure"]
    assert row["structure"] == 2
    np.testing.assert_allclose(np.ravel(got), expected, rtol=1e-6)
