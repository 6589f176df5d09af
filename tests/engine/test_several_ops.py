"""Several ops in one pass (`segcli reduce FILE OP FIELD + OP FIELD ...`, engine.run with
several jobs): the same bits as each op run alone, and values against the NumPy float64
reference."""

import h5py
import numpy as np
import pytest
from batch_reference import (
    RANDOM_FIELDS,
    assert_reduced,
    fields_for,
    random_batch,
    reduce_reference,
)
from click.testing import CliRunner
from test_engine import DEVICE

from segcli import engine
from segcli.cli import main
from segcli.engine import program as programs
from segcli.io import open_batch
from segcli.registry import OPS

STRUCTURE_OPS = [(name, fields_for(op, turn=k)) for k, (name, op) in enumerate(OPS.items())
                 if op.output_per == "structure"]
VECTOR_FIELDS = {**RANDOM_FIELDS, ("atom", None, "float"): [("x", "y")]}
"""Fields for derivatives along one direction y (N, 3): every per-atom field (N, 3)."""


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def joined(ops):
    """OP FIELD ... + OP FIELD ... as command-line words."""
    words = []
    for op, fields in ops:
        words += ["+", op, *fields] if words else [op, *fields]
    return words


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("several") / "random.h5"
    return path, *random_batch(path, seed=21, n_structures=70)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_one_pass_gives_each_jobs_bits_alone(random_file, order):
    path, n_atoms, data = random_file
    ops = [(name, fields_for(op, VECTOR_FIELDS if order else RANDOM_FIELDS, k))
           for k, (name, op) in enumerate(OPS.items())
           if k % 3 == order and (order == 0 or op.differentiable)]
    plan = {"order": order, "weights": "w" if order else None,
            "direction": "y" if order == 2 else None}
    with open_batch(path) as batch:
        jobs = [engine.plan(str(path), OPS[op], fields, batch.fields, **plan)
                for op, fields in ops]

        def outputs(jobs):
            parts = [out for _, out in engine.run(batch, jobs, DEVICE, chunk_atoms=29)]
            return [{label: np.concatenate([p[k][label] for p in parts]) for label in parts[0][k]}
                    for k in range(len(jobs))]

        together = outputs(jobs)
        for job, got in zip(jobs, together):
            alone, = outputs([job])
            assert got.keys() == alone.keys() == job.outputs.keys()
            for label in got:
                np.testing.assert_array_equal(got[label], alone[label])
    if order == 0:
        for (op, fields), got in zip(ops, together):
            assert_reduced(got[""], op, n_atoms, [data[f] for f in fields], "float64")


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_reductions_of_one_field_go_together_with_each_jobs_bits(random_file, precision):
    """sum, mean, rms_norm and max_norm of x (and of x32, of t) in one pass: each field's
    reductions one segcli_reductions in the chunk's program (the integers of z summed apart),
    and the bits of each job run alone."""
    import jax

    from segcli._jax import enable_x64

    path = random_file[0]
    ops = [("rms_norm", ["x"]), ("sum", ["z"]), ("max_norm", ["x"]), ("mean", ["x"]),
           ("sum", ["x"]), ("max_norm", ["x32"]), ("mean", ["x32"]), ("rms_norm", ["t"]),
           ("max_norm", ["t"]), ("mean", ["v"])]
    with open_batch(path) as batch:
        jobs = [engine.plan(str(path), OPS[op], fields, batch.fields, precision=precision)
                for op, fields in ops]
        read = engine.reads(jobs)
        function = programs._compiled(tuple(job.program(read) for job in jobs))
        n = 16
        values = tuple(np.zeros((n, *batch.fields[name].shape), batch.fields[name].dtype)
                       for name in read)
        with enable_x64(True):
            program = jax.make_jaxpr(lambda v, o: function(v, o, rows=n, num_segments=2))(
                values, np.array([0, 9, n], np.int32))
        assert str(program).count("segcli_reductions") == 3  # x, x32, t

        def outputs(jobs):
            parts = [out for _, out in engine.run(batch, jobs, DEVICE, chunk_atoms=37)]
            return [np.concatenate([p[k][""] for p in parts]) for k in range(len(jobs))]

        for job, got in zip(jobs, outputs(jobs)):
            np.testing.assert_array_equal(got, outputs([job])[0])


def test_jobs_of_one_pass_share_one_precision(random_file):
    path = random_file[0]
    with open_batch(path) as batch:
        jobs = [engine.plan(str(path), OPS["sum"], ["x"], batch.fields, precision=p)
                for p in ("float32", "float64")]
        with pytest.raises(ValueError, match="one precision"):
            list(engine.run(batch, jobs, DEVICE))


def test_reduce_several_ops_to_stdout(random_file):
    """The same ops to stdout as CSV, JSON lines and NumPy: each format's values against the
    reference (the three runs in one test compile the ops' programs once)."""
    path, n_atoms, data = random_file
    names = ["_".join([op, *fields]) for op, fields in STRUCTURE_OPS]
    for fmt in ("csv", "json", "npy"):
        result = run("reduce", path, *joined(STRUCTURE_OPS), "--format", fmt, "--chunk-atoms", 50)
        assert result.exit_code == 0, (fmt, result.output)
        if fmt == "csv":
            lines = result.stdout.splitlines()
            header = lines[0].split(",")
            rows = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
            np.testing.assert_array_equal(rows[:, 0], np.arange(len(n_atoms)))
            got, start = [], 1
            for (op, fields), name in zip(STRUCTURE_OPS, names):
                shape = reduce_reference(op, n_atoms, *(data[f] for f in fields)).shape
                first = "_".join([name, *"0" * (len(shape) - 1)])
                assert header[start] == first
                got.append(rows[:, start:start + int(np.prod(shape[1:]))].reshape(shape))
                start += int(np.prod(shape[1:]))
            assert start == len(header)
        elif fmt == "json":
            import json

            objects = [json.loads(line) for line in result.stdout.splitlines()]
            assert [o["structure"] for o in objects] == list(range(len(n_atoms)))
            got = [np.array([o[name] for o in objects], float) for name in names]  # null: NaN
            for k, (op, fields) in enumerate(STRUCTURE_OPS):
                reference = reduce_reference(op, n_atoms, *(data[f] for f in fields))
                assert np.array_equal(np.isnan(got[k]), ~np.isfinite(reference))  # -inf: empty
                got[k] = np.where(np.isfinite(reference), got[k], reference)
        else:
            import io

            array = np.load(io.BytesIO(result.stdout_bytes))
            assert array.dtype.names == tuple(names)
            got = [array[name] for name in names]
        for (op, fields), values in zip(STRUCTURE_OPS, got):
            assert_reduced(values, op, n_atoms, [data[f] for f in fields], "float64")


def test_reduce_several_ops_per_atom_and_per_structure_to_a_file(tmp_path, random_file):
    path, n_atoms, data = random_file
    ops = [("rms_norm", ["x"]), ("mul", ["v", "s"]), ("count", [])]
    out = tmp_path / "several.h5"
    result = run("reduce", path, *joined(ops), "-o", out)
    assert result.exit_code == 0, result.output
    assert "/results/rms_norm_x, /results/mul_v_s, /results/count" in result.stderr
    with h5py.File(out, "r") as f:
        for op, fields in ops:
            name = "_".join([op, *fields])
            assert f["results"][name].attrs["op"] == op
            assert list(f["results"][name].attrs["fields"]) == fields
            assert_reduced(f["results"][name][()], op, n_atoms, [data[k] for k in fields],
                           "float64")


def test_grad_several_ops_in_place(tmp_path, random_file):
    path = tmp_path / "grad.h5"
    path.write_bytes(random_file[0].read_bytes())
    ops = [("rms_norm", ["x"]), ("dot", ["x", "y"])]
    assert run("grad", path, *joined(ops), "--in-place", "--weights", "w").exit_code == 0
    for op, fields in ops:
        alone = tmp_path / f"{op}.h5"
        assert run("grad", path, op, *fields, "-o", alone, "--weights", "w").exit_code == 0
        with h5py.File(path, "r") as f, h5py.File(alone, "r") as g:
            name = "_".join([op, *fields])
            assert set(f["results"][name]) == {f"d_{k}" for k in dict.fromkeys(fields)}
            for label in f["results"][name]:
                np.testing.assert_array_equal(f["results"][name][label][()],
                                              g["results"][name][label][()])
    result = run("grad", path, "rms_norm", "x", "+", "dot", "x", "y", "--format", "csv")
    header = result.stdout.splitlines()[0].split(",")
    assert header[:3] == ["structure", "atom", "rms_norm_x_d_x_0"]
    assert header[-1] == "dot_x_y_d_y_2"


def test_shards_of_several_ops_merge_to_one_run(tmp_path, random_file):
    path = random_file[0]
    words = joined(STRUCTURE_OPS)
    assert run("reduce", path, *words, "-o", tmp_path / "whole.h5").exit_code == 0
    for shard in ("0/3", "1/3", "2/3"):
        result = run("reduce", path, *words, "--shard", shard, "-o", tmp_path / "p-{shard}.h5")
        assert result.exit_code == 0, result.output
    parts = sorted(tmp_path.glob("p-*.h5"))
    assert run("merge", *parts, "-o", tmp_path / "merged.h5").exit_code == 0
    with h5py.File(tmp_path / "whole.h5", "r") as f, h5py.File(tmp_path / "merged.h5") as g:
        for op, fields in STRUCTURE_OPS:
            name = "results/" + "_".join([op, *fields])
            np.testing.assert_array_equal(f[name][()], g[name][()])


@pytest.mark.parametrize("words, needle", [
    (["rms_norm", "x", "+"], "'+' joins two ops"),
    (["+", "count"], "'+' joins two ops"),
    (["rms_norm", "x", "+", "+", "count"], "'+' joins two ops"),
    (["rms_norm", "x", "+", "frobnicate"], "unknown op 'frobnicate'"),
    (["rms_norm", "x", "+", "dot", "x"], "dot takes 2 field(s)"),
    (["rms_norm", "x", "+", "rms_norm", "x"], "two ops give the same result"),
    (["rms_norm", "x", "+", "count", "--name", "n"], "--name names one op's result"),
    (["rms_norm", "x", "+", "mul", "v", "s"], "the rows of a table are per structure or per atom"),
])
def test_usage_errors_of_several_ops_exit_2(random_file, words, needle):
    result = run("reduce", random_file[0], *words)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_grad_refuses_a_non_differentiable_op_among_several(random_file):
    result = run("grad", random_file[0], "rms_norm", "x", "+", "count")
    assert result.exit_code == 2 and "count is not differentiable" in result.stderr
