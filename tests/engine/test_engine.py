"""segcli.engine: planning and checking a job, padding to buckets, prefetching, chunked
evaluation against an independent NumPy float64 reference."""

import inspect
import threading
import time

import h5py
import jax
import numpy as np
import pytest
from batch_reference import (
    assert_reduced,
    fields_for,
    random_batch,
    reduce_jax,
    reduce_reference,
    write_batch,
)

from segcli import engine, ops
from segcli.engine import pipeline
from segcli.engine import program as programs
from segcli.errors import DataError
from segcli.io import open_batch, open_inputs
from segcli.io.core import Chunk, FieldInfo
from segcli.registry import OPS

DEVICE = jax.devices()[0]  # the CPU in CI, a GPU where JAX has one
FIELDS = {name: fields_for(op, turn=k) for k, (name, op) in enumerate(OPS.items())}


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "random.h5"
    return path, *random_batch(path, seed=11)


def run_all(path, job, **kwargs):
    """Every chunk's outputs of a job over a file, concatenated."""
    with open_batch(path) as batch:
        parts = [outputs for _, (outputs,) in engine.run(batch, [job], DEVICE, **kwargs)]
    return {label: np.concatenate([p[label] for p in parts]) for label in parts[0]}


def plan(path, op, names, **kwargs):
    with open_batch(path) as batch:
        return engine.plan(str(path), OPS[op], names, batch.fields, **kwargs)


@pytest.mark.parametrize("op", list(OPS))
def test_sorted_promise_goes_to_the_ops_that_take_it(op):
    parameters = inspect.signature(OPS[op].function).parameters
    assert OPS[op].takes_sorted == ("indices_are_sorted" in parameters)


def test_bucket_sizes():
    assert [engine.bucket(n) for n in (0, 1, 1024, 1025, 2048, 3000, 1 << 21)] == \
        [1024, 1024, 1024, 2048, 2048, 4096, 1 << 21]


@pytest.mark.parametrize("op, precision", [
    pytest.param(op, precision, marks=() if (k + j) % 2 else pytest.mark.slow)
    for k, op in enumerate(OPS) for j, precision in enumerate(["float64", "float32"])])
def test_every_op_matches_the_reference_in_chunks_of_any_size(batch_file, op, precision):
    path, n_atoms, data = batch_file
    job = plan(path, op, FIELDS[op], precision=precision)
    for chunk_atoms in (1, 23, engine.DEFAULT_CHUNK_ATOMS):
        got = run_all(path, job, chunk_atoms=chunk_atoms)[""]
        assert got.dtype == (np.int64 if OPS[op].output_dtype == "count" else np.dtype(precision))
        assert_reduced(got, op, n_atoms, [data[name] for name in FIELDS[op]], precision)


def test_selected_structures_and_a_float32_field(batch_file):
    path, n_atoms, data = batch_file
    job = plan(path, "sum", ["x32"])
    got = run_all(path, job, chunk_atoms=17, structures=slice(5, 31))[""]
    first = n_atoms[:5].sum()
    assert_reduced(got, "sum", n_atoms[5:31], [data["x32"][first:first + n_atoms[5:31].sum()]],
                   "float64")


@pytest.mark.parametrize("op", [
    pytest.param(name, marks=() if name in ("sum", "mean") or k % 2 else pytest.mark.slow)
    for k, (name, op) in enumerate(OPS.items()) if op.inputs and op.inputs[0].shape in (None, ())])
def test_integer_fields_stay_integers_where_the_op_reduces_integers(batch_file, op):
    """sum, max, min of an integer field give int64 exactly; mean etc. compute in floats."""
    path, n_atoms, data = batch_file
    fields = ["z"] + FIELDS[op][1:]
    got = run_all(path, plan(path, op, fields, precision="float32"))[""]
    expected = reduce_reference(op, n_atoms, *(data[f] for f in fields))
    keeps = OPS[op].integers or OPS[op].inputs[0].kind == "labels"
    counts = OPS[op].output_dtype == "count"  # int64 in the engine, as every count it gives
    assert got.dtype == (np.int64 if counts else expected.dtype if keeps else np.float32)
    np.testing.assert_allclose(got, expected, rtol=0 if keeps else 1e-6)


@pytest.mark.parametrize("stored", [np.int32, np.int64, np.uint16])
def test_labels_are_read_as_stored_when_int32_and_counted_beside_a_sum(tmp_path, stored):
    """bincount's labels stay int32 as the file stores them, unless another job of the pass
    reduces the field as integers (sum: int64, exactly); out-of-range labels are dropped."""
    rng = np.random.default_rng(5)
    n_atoms = rng.integers(0, 30, 70)
    labels = rng.integers(-2, 9, int(n_atoms.sum())).astype(stored, casting="unsafe")
    path = tmp_path / "labels.h5"
    write_batch(path, n_atoms, {"z": labels}, {})
    count = plan(path, "bincount", ["z"], params={"length": 6})
    total = plan(path, "sum", ["z"])
    wide = np.int32 if stored == np.int32 else np.int64
    assert engine.field_dtypes([count]) == {"z": np.dtype(wide)}
    assert engine.field_dtypes([count, total]) == {"z": np.dtype(np.int64)}
    starts = np.concatenate([[0], np.cumsum(n_atoms)])
    want = np.zeros((len(n_atoms), 6), np.int64)
    for s in range(len(n_atoms)):
        seen = labels[starts[s]:starts[s + 1]].astype(np.int64)
        want[s] = np.bincount(seen[(seen >= 0) & (seen < 6)], minlength=6)
    sums = np.add.reduceat(np.append(labels.astype(np.int64), 0), starts[:-1]) * (n_atoms > 0)
    for jobs in ([count], [count, total]):
        with open_batch(path) as batch:
            parts = [outputs for _, outputs in engine.run(batch, jobs, DEVICE, chunk_atoms=64)]
        np.testing.assert_array_equal(np.concatenate([p[0][""] for p in parts]), want)
        if len(jobs) == 2:
            got = np.concatenate([p[1][""] for p in parts])
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, sums)


def test_params_flow_to_the_op(batch_file):
    path, n_atoms, data = batch_file
    got = run_all(path, plan(path, "bincount", ["z"], params={"length": 5, "other": 1}))[""]
    assert got.shape == (len(n_atoms), 5)
    np.testing.assert_array_equal(got, reduce_reference("bincount", n_atoms, data["z"], length=5))


def test_one_compilation_per_run_however_the_chunks_vary(tmp_path):
    rng = np.random.default_rng(3)
    n_atoms = rng.integers(1, 40, 600)
    x = rng.normal(size=(n_atoms.sum(), 3))
    path = write_batch(tmp_path / "b.h5", n_atoms, {"x": x})
    job = plan(path, "rms_norm", ["x"])
    with open_batch(path) as batch:
        chunks = list(batch.iter_chunks(["x"], chunk_atoms=1500))
    sizes = {(engine.bucket(int(c.n_atoms.sum())), engine.bucket(len(c.n_atoms))) for c in chunks}
    assert len(chunks) > 4 and len(sizes) == 2  # chunks in two buckets: the last one is small
    assert engine.padded_size(n_atoms, 1500) == (2048, 1024)
    programs._compiled.cache_clear()
    for chunk_atoms in (1500, 1400, 3000):
        assert_reduced(run_all(path, job, chunk_atoms=chunk_atoms)[""], "rms_norm", n_atoms, [x],
                       "float64")
    program = programs._compiled((job.program(job.read),), DEVICE.platform != "cpu",
                                programs._pinned_outputs(DEVICE))
    assert program._cache_size() == 2  # 2048 and 4096 rows


def test_prefetch_runs_exactly_one_item_ahead():
    produced = []

    def items():
        for i in range(5):
            produced.append(i)
            yield i

    seen = []
    for item in engine.prefetch(items()):
        ahead = min(item + 2, 5)
        deadline = time.monotonic() + 10
        while len(produced) < ahead and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)
        seen.append((item, list(produced)))
    assert seen == [(k, list(range(min(k + 2, 5)))) for k in range(5)]


def test_prefetch_raises_the_producers_error_and_stops_when_the_caller_does():
    def failing():
        yield 1
        raise DataError("bad chunk")

    got = []
    with pytest.raises(DataError, match="bad chunk"):
        for item in engine.prefetch(failing()):
            got.append(item)  # noqa: PERF402  (keeps what came before the error)
    assert got == [1]
    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]

    items = engine.prefetch(endless())
    assert next(items) == 0
    items.close()
    assert not any(t.name == "segcli-prefetch" for t in threading.enumerate())
    assert len(produced) <= 2


def test_behind_calls_in_order_while_the_caller_goes_on():
    done, release = [], threading.Event()

    def consume(k):
        release.wait(10)
        done.append((k, threading.current_thread().name))

    with engine.behind(consume) as hand_over:
        hand_over(0)  # taken by the thread at once
        hand_over(1)  # waits in the queue: the caller goes on
        assert done == []
        release.set()
        for k in range(2, 6):
            hand_over(k)
    assert done == [(k, "segcli-behind") for k in range(6)]
    assert not any(t.name == "segcli-behind" for t in threading.enumerate())


def test_behind_raises_the_consumers_error_and_stops_on_the_callers():
    done = []

    def consume(k):
        if k == 1:
            raise BrokenPipeError("closed")
        done.append(k)

    with pytest.raises(BrokenPipeError, match="closed"), engine.behind(consume) as hand_over:
        for k in range(100):
            hand_over(k)
            time.sleep(0.001)
    assert done == [0]  # nothing after the failed call
    done.clear()
    with pytest.raises(DataError, match="caller"), engine.behind(done.append) as hand_over:
        hand_over(0)
        time.sleep(0.05)
        raise DataError("caller")
    assert done == [0]
    assert not any(t.name == "segcli-behind" for t in threading.enumerate())


def test_nan_is_counted_over_every_chunk_and_the_first_structure_named(tmp_path):
    n_atoms = np.full(40, 5)
    x = np.ones((200, 3))
    x[[26, 27], 1] = np.nan  # structure 5
    x[151, :] = np.nan  # structure 30
    s = np.ones(40)
    s[33] = np.nan
    path = write_batch(tmp_path / "nan.h5", n_atoms, {"x": x}, {"s": s})
    for chunk_atoms in (10, 1000):
        with pytest.raises(DataError, match=r"nan.h5: field 'x' holds 5 NaN value\(s\), the "
                                            r"first in structure 5$"):
            run_all(path, plan(path, "rms_norm", ["x"]), chunk_atoms=chunk_atoms)
    with pytest.raises(DataError, match=r"field 's' holds 1 NaN value\(s\), the first in "
                                        r"structure 33$"):
        run_all(path, plan(path, "mul", ["x", "s"]), structures=slice(31, 40))
    got = run_all(path, plan(path, "sum", ["x"]), structures=slice(6, 30))[""]
    np.testing.assert_array_equal(got, np.full((24, 3), 5.0))


@pytest.mark.parametrize("op, names, kwargs, message", [
    ("sum", ["nope"], {}, "no field 'nope'; its fields are: c, e, m, s, t, x, y, z"),
    ("sum", ["e"], {}, "field 'e' is per structure (S,), but sum must be per atom (N, *F)"),
    ("mul", ["x", "y"], {}, "field 'y' is per atom (N, 3), but mul's second field must be "
                            "per structure (S,)"),
    ("matvec", ["t", "m"], {}, "field 't' has shape (N, 2, 2), but matvec's first field must "
                               "be (N, 3)"),
    ("matvec", ["x", "s"], {}, "field 's' has shape (S, 3), but matvec's second field must "
                               "be (S, 3, 3)"),
    ("dot", ["x", "t"], {}, "dot needs fields of the same shape, but 'x' is (N, 3) and "
                            "'t' is (N, 2, 2)"),
    ("bincount", ["x"], {}, "field 'x' has shape (N, 3), but bincount must be (N,) labels"),
    ("bincount", ["e"], {}, "field 'e' is per structure (S,), but bincount must be per atom (N,) "
                            "labels"),
    ("sum", ["c"], {}, "field 'c' holds complex128 values, but sum must be real numbers"),
    ("sum", ["z"], {"order": 1}, "field 'z' holds int64 values, but sum must be "
                                 "floating-point to be differentiated"),
    ("sum", ["x"], {"order": 1, "weights": "x"}, "field 'x' is per atom (N, 3), but --weights "
                                                 "must be per structure (S,)"),
    ("sum", ["x"], {"order": 2, "direction": "t"}, "field 't' has shape (N, 2, 2), but "
                                                   "--direction (the shape of 'x') must be (N, 3)"),
])
def test_plan_refuses_fields_that_do_not_fit(tmp_path, op, names, kwargs, message):
    rng = np.random.default_rng(0)
    path = write_batch(tmp_path / "b.h5", [2, 1],
                       {"x": rng.normal(size=(3, 3)), "y": rng.normal(size=(3, 3)),
                        "t": np.zeros((3, 2, 2)), "z": np.arange(3), "c": np.zeros(3, complex)},
                       {"e": np.zeros(2), "s": np.zeros((2, 3)), "m": np.zeros((2, 3, 3))})
    with pytest.raises(DataError) as error:
        plan(path, op, names, **kwargs)
    assert str(error.value) == f"{path}: {message}"


def test_outputs_of_each_op_and_order(batch_file):
    """Each op's output: per structure or atom, trailing shape and dtype as its reference
    gives them (floats in the precision, counts in int64)."""
    path, n_atoms, data = batch_file
    for op, names in FIELDS.items():
        (per, shape, dtype), = plan(path, op, names, precision="float32").outputs.values()
        expected = jax.eval_shape(lambda *a, op=op: reduce_jax(op, n_atoms, *a),
                                  *(data[f] for f in names))
        rows = {"structure": len(n_atoms), "atom": sum(n_atoms)}[per]
        assert (rows, *shape) == expected.shape, op
        assert dtype == {"f": np.float32, "i": np.int64}[expected.dtype.kind], op
    job = plan(path, "dot", ["x", "x"], order=1, precision="float32")
    assert job.wrt == ("x",) and job.outputs == {"d_x": ("atom", (3,), np.float32)}
    job = plan(path, "dot", ["x", "y"], order=2, weights="w", direction="x")
    assert job.read == ("x", "y", "w") and list(job.outputs) == ["d_x", "d_y"]


def test_pad_uses_a_read_buffer_only_for_exactly_the_rows_read_into_it():
    ring = pipeline.BufferRing()
    piece = ring.lend(("read", "x"), (8, 3), np.float64, 6)
    piece[:] = np.arange(18.0).reshape(6, 3)
    assert ring.holding(piece) is not None
    # a chunk made of part of a piece (as when a piece is split) is copied, not padded in place
    head, tail = piece[:4], piece[4:]
    assert ring.holding(head) is None and ring.holding(tail) is None
    chunk = Chunk(0, np.array([4]), {"x": head}, {})
    padded = pipeline._pad({"x": np.dtype(np.float64)}, chunk, (8, 1024), ring)
    assert padded.arrays["x"].ctypes.data != piece.ctypes.data
    np.testing.assert_array_equal(piece[4:], np.arange(12.0, 18.0).reshape(2, 3))  # untouched
    np.testing.assert_array_equal(padded.arrays["x"][:4], np.arange(12.0).reshape(4, 3))
    assert not padded.arrays["x"][4:].any()


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    """A file of about 7000 atoms, its fields contiguous (h5py's default): chunks of 500 atoms,
    padded to 1024 rows, are mostly left in its pages (segcli.memory.Window); the atoms of structure
    700 are 1e100 (which would show in any other structure whose result took them in)."""
    path = tmp_path_factory.mktemp("windows") / "long.h5"
    n_atoms, data = random_batch(path, seed=5, n_structures=1500)
    first = int(n_atoms[:700].sum())
    for name in ("x", "y", "v"):
        data[name][first:first + n_atoms[700]] = 1e100
    with h5py.File(path, "r+") as f:
        for name in ("x", "y", "v"):
            f[f"atoms/{name}"][first:first + n_atoms[700]] = 1e100
    return path, n_atoms, data


def test_rows_left_in_the_files_pages_compute_as_rows_read(long_file):
    """Every op, its gradient and Hessian-vector product, over chunks that a CPU computes from
    the file's pages (their padding rows the file's next rows, their first row not the
    window's) and over chunks read, give the reference's values, whatever rows lie around."""
    path, n_atoms, data = long_file
    mapped = []
    with open_batch(path) as batch:
        for op in OPS:
            for order in (0, 1, 2) if OPS[op].differentiable else (0,):
                job = engine.plan(str(path), OPS[op], FIELDS[op], batch.fields, order=order,
                                  direction=FIELDS[op][0] if order == 2 else None)
                runs = {}
                for on_device in (False, True):  # (on the device: no windows)
                    chunks = list(engine.run(batch, [job], DEVICE, chunk_atoms=500,
                                             on_device=on_device))
                    runs[on_device] = {label: np.concatenate([o[label] for _, (o,) in chunks])
                                       for label in job.outputs}
                    if not on_device and DEVICE.platform == "cpu":
                        mapped += [c.atoms["x"] for c, _ in chunks if "x" in c.atoms
                                   and not c.atoms["x"].flags.writeable]
                for label, value in runs[True].items():
                    np.testing.assert_allclose(runs[False][label], value, rtol=1e-12,
                                               atol=1e-300, err_msg=f"{op} {order} {label}")
                if order == 0:
                    assert_reduced(runs[False][""], op, n_atoms, [data[f] for f in FIELDS[op]],
                                   "float64")
    if DEVICE.platform == "cpu":
        assert len(mapped) > 100  # most chunks of x: of the 15 runs of 14 chunks reading x
        assert any(rows.ctypes.data % 64 for rows in mapped)  # rows ahead in the window


@pytest.mark.parametrize("order", [0, 1])
def test_ids_expanded_and_nan_checked_on_the_device_give_the_same_bits(batch_file, order):
    path = batch_file[0]
    with open_batch(path) as batch:
        jobs = [engine.plan(str(path), OPS[op], FIELDS[op], batch.fields, order=order)
                for op in OPS if order == 0 or OPS[op].differentiable]
        for chunk_atoms in (1, 23, 1000):
            runs = [list(engine.run(batch, jobs, DEVICE, chunk_atoms=chunk_atoms,
                                    on_device=on_device)) for on_device in (False, True)]
            for (_, host), (_, device) in zip(*runs):
                for a, b in zip(host, device):
                    assert a.keys() == b.keys()
                    for label in a:
                        np.testing.assert_array_equal(a[label], b[label])


def test_segments_of_offsets_put_padding_rows_out_of_range():
    offsets = np.array([0, 2, 2, 5, 6, 6, 6, 6, 6], np.int32)  # 4 structures, 4 padding ones
    of = jax.jit(lambda o, rows: ops.segments_of_offsets(o, rows).ids, static_argnums=1)
    np.testing.assert_array_equal(of(offsets, 10), [0, 0, 2, 2, 2, 3, 8, 8, 8, 8])
    # rows ahead of the first segment (a window's skip) in -1
    np.testing.assert_array_equal(of(offsets + 2, 10), [-1, -1, 0, 0, 2, 2, 2, 3, 8, 8])
    np.testing.assert_array_equal(of(np.array([0, 3], np.int32), 3), [0, 0, 0])
    assert of(np.zeros(4, np.int32), 0).shape == (0,)
    rng = np.random.default_rng(7)
    for _ in range(20):  # against the number of offsets at or before each row, less one
        rows = int(rng.integers(0, 300))
        offsets = np.sort(rng.integers(0, rows + 1, int(rng.integers(1, 60)))).astype(np.int32)
        np.testing.assert_array_equal(
            of(offsets, rows), np.searchsorted(offsets, np.arange(rows), side="right") - 1)


def test_pad_takes_a_window_whole_and_puts_every_field_where_its_rows_are():
    """A field left in a window (see segcli.memory.Window) is padded by the window's own rows; the
    chunk's rows of the others are copied to the same rows, `skip` on; offsets and ids follow,
    rows ahead in segment -1; a field the structures lack in part is copied."""
    ring = pipeline.BufferRing()
    n_atoms = np.array([2, 0, 3])
    window = ring.window(("read", "x"), (1024, 3), np.float64, 5)  # the least bucket
    window.array = np.arange(3072.0).reshape(1024, 3)
    window.array.flags.writeable = False
    window.skip, window.given = 2, 5
    y = np.arange(5.0) + 100
    chunk = Chunk(0, n_atoms, {"x": window.array[2:7], "y": y}, {"w": np.ones(3)})
    dtypes = {name: np.dtype(np.float64) for name in ("x", "y", "w")}
    padded = pipeline._pad(dtypes, chunk, (1024, 1024), ring)
    assert padded.arrays["x"] is window.array and padded.skip == 2
    np.testing.assert_array_equal(padded.arrays["y"], np.r_[0, 0, y, np.zeros(1017)])
    np.testing.assert_array_equal(padded.arrays["w"], np.r_[1, 1, 1, np.zeros(1021)])
    np.testing.assert_array_equal(padded.offsets, np.r_[2, 4, 4, np.full(1022, 7)])
    np.testing.assert_array_equal(ops.segments_of_offsets(padded.offsets, padded.rows).ids,
                                  np.r_[-1, -1, 0, 0, 2, 2, 2, np.full(1017, 1024)])
    partial = chunk._replace(present={"x": np.array([True, True, False])})
    padded = pipeline._pad(dtypes, partial, (1024, 1024), ring)
    assert padded.skip == 0 and padded.arrays["x"] is not window.array
    np.testing.assert_array_equal(padded.arrays["x"][:5], np.r_[window.array[2:4],
                                                                np.zeros((3, 3))])


@pytest.mark.parametrize("on_device", [False, True])
def test_nan_is_counted_over_every_chunk_and_named_either_way(tmp_path, on_device):
    rng = np.random.default_rng(4)
    n_atoms = rng.integers(1, 6, 50)
    x = rng.normal(size=(n_atoms.sum(), 3))
    first = int(n_atoms[:7].sum())
    x[first, 2] = np.nan
    x[-1] = np.nan  # 3 more, in the last chunk
    path = write_batch(tmp_path / "nan.h5", n_atoms, {"x": x})
    with open_batch(path) as batch:
        job = engine.plan(str(path), OPS["sum"], ["x"], batch.fields)
        with pytest.raises(DataError, match=r"field 'x' holds 4 NaN value\(s\), the first in "
                                            r"structure 7$"):
            list(engine.run(batch, [job], DEVICE, chunk_atoms=20, on_device=on_device))


@pytest.mark.parametrize("on_device", [False, True])
def test_a_selection_computed_whole_or_taken_gives_the_same_results_and_errors(
        tmp_path, monkeypatch, on_device):
    """Chunks whose kept structures hold at least engine.WHOLE of the atoms are computed whole
    and the others' results left out; the rest are taken (copied). Whichever way each chunk
    goes, the kept structures' results are the same bits, against NumPy, their numbers the
    kept ones; a NaN in a structure left out is no error, one in a kept structure is counted
    over the kept ones only."""
    rng = np.random.default_rng(11)
    n_atoms = rng.integers(0, 7, 120)
    x = rng.normal(size=(int(n_atoms.sum()), 3))
    keep = rng.random(120) < 0.6
    keep[:20], keep[20:40], keep[40:60] = True, False, np.arange(20) % 7 == 0  # all, none, few
    first = np.cumsum(n_atoms) - n_atoms
    dropped = np.flatnonzero(~keep & (n_atoms > 0))
    x[first[dropped[:5]]] = np.nan  # NaN only where left out
    path = write_batch(tmp_path / "x.h5", n_atoms, {"x": x})
    ops_ = ["rms_norm", "max_norm", "sum", "count"]

    def run(whole):
        monkeypatch.setattr(pipeline, "WHOLE", whole)
        with open_batch(path) as batch:
            jobs = [engine.plan(str(path), OPS[op], [] if op == "count" else ["x"],
                                batch.fields) for op in ops_]
            assert engine.whole_selection(jobs, keep) is keep
            chunks = list(engine.run(batch, jobs, DEVICE, chunk_atoms=30, keep=keep,
                                     on_device=on_device))
        numbers = np.concatenate([c.structure_numbers for c, _ in chunks])
        return numbers, [np.concatenate([o[k][""] for _, o in chunks]) for k in range(4)]

    numbers, taken = run(2.0)  # every chunk taken
    np.testing.assert_array_equal(numbers, np.flatnonzero(keep))
    for whole in (0.0, 0.25):  # every chunk whole; some of each
        again, results = run(whole)
        np.testing.assert_array_equal(again, numbers)
        for got, expected in zip(results, taken):
            np.testing.assert_array_equal(got, expected)
    rows = np.split(x, np.cumsum(n_atoms)[:-1])
    norms = [np.linalg.norm(rows[s], axis=1) for s in numbers]
    np.testing.assert_allclose(taken[0], [np.sqrt(np.mean(n ** 2)) if len(n) else 0
                                          for n in norms], rtol=1e-12)
    np.testing.assert_allclose(taken[1], [n.max(initial=0) for n in norms], rtol=1e-12)
    np.testing.assert_allclose(taken[2], [rows[s].sum(axis=0) for s in numbers], atol=1e-12)
    np.testing.assert_array_equal(taken[3], n_atoms[keep])
    kept_row = first[np.flatnonzero(keep & (n_atoms > 0))[3]]
    x[kept_row, 1] = np.nan
    write_batch(tmp_path / "x.h5", n_atoms, {"x": x})
    structure = int(np.searchsorted(np.cumsum(n_atoms), kept_row, side="right"))
    for whole in (2.0, 0.0):
        with pytest.raises(DataError, match=rf"field 'x' holds 1 NaN value\(s\), the first in "
                                            rf"structure {structure}$"):
            run(whole)


SHOWING = [(op, k) for op in OPS for k, arg in enumerate(OPS[op].inputs)
           if OPS[op].output_per == "structure" and arg.per == "atom" and arg.kind == "float"]
"""Each per-atom float input of each op with a result per structure: their values show a
NaN of that input (Job.shows_nan), so the host looks for NaN in it only where one is NaN."""


@pytest.mark.parametrize("op, k", SHOWING)
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_a_nan_in_any_input_of_a_value_per_structure_is_refused(tmp_path, op, k, precision):
    """A NaN in one row (one entry of it) of input k, in the middle chunk of three: its
    structure's value is NaN (not hidden by a max, a root or a tie), so the run is refused,
    naming the field, the count over every chunk and the first structure."""
    rng = np.random.default_rng(k)
    n_atoms = rng.integers(1, 6, 30)
    n_atoms[17] = 3
    names = [f"a{j}" for j in range(len(OPS[op].inputs))]
    arrays = {name: rng.normal(size=(int(n_atoms.sum()), 3)) for name in names}
    row = int(n_atoms[:17].sum()) + 1
    arrays[names[k]][row, 1] = np.nan
    path = write_batch(tmp_path / "nan.h5", n_atoms, arrays)
    with open_batch(path) as batch:
        job = engine.plan(str(path), OPS[op], names, batch.fields, precision=precision)
        assert job.shows_nan
        assert engine.shown_nan([job], batch.fields) == set(names)
        with pytest.raises(DataError, match=rf"field '{names[k]}' holds 1 NaN value\(s\), the "
                                            r"first in structure 17$"):
            list(engine.run(batch, [job], DEVICE, chunk_atoms=40, on_device=False))


def test_a_nan_value_of_infinities_is_kept_and_every_chunk_given(tmp_path):
    """sum of +inf and -inf is NaN with no NaN in the input: no error, and the chunks after it
    are all computed (none taken by a search for the NaN)."""
    n_atoms = np.full(12, 2)
    x = np.ones((24, 3))
    x[4, 0], x[5, 0] = np.inf, -np.inf  # structure 2
    path = write_batch(tmp_path / "inf.h5", n_atoms, {"x": x})
    with open_batch(path) as batch:
        job = engine.plan(str(path), OPS["sum"], ["x"], batch.fields)
        got = [out[""] for _, (out,) in engine.run(batch, [job], DEVICE, chunk_atoms=6,
                                                   on_device=False)]
    got = np.concatenate(got)
    assert got.shape == (12, 3) and np.isnan(got[2, 0])
    np.testing.assert_array_equal(np.delete(got, 2, axis=0), 2.0)


def test_jobs_that_do_not_show_nan_keep_the_hosts_check():
    """A gradient (of sum: 1 whatever the input) and a result per atom do not show a NaN of
    their inputs: a field they read is checked as it is read, even beside a value that
    shows it."""
    path_fields = {"x": FieldInfo("x", "atom", (3,), np.dtype(np.float64)),
                   "s": FieldInfo("s", "structure", (), np.dtype(np.float64))}
    jobs = {name: engine.plan("f.h5", OPS[op], names, path_fields, order=order)
            for name, (op, names, order) in {"sum": ("sum", ["x"], 0),
                                             "grad": ("sum", ["x"], 1),
                                             "mul": ("mul", ["x", "s"], 0)}.items()}
    assert engine.shown_nan([jobs["sum"]], path_fields) == {"x"}
    assert engine.shown_nan([jobs["sum"], jobs["grad"]], path_fields) == set()
    assert engine.shown_nan([jobs["sum"], jobs["mul"]], path_fields) == set()


@pytest.mark.parametrize("pinned", [False, True])
def test_the_ring_reuses_a_buffer_only_once_nothing_refers_to_it(pinned):
    """A buffer comes back only when no view of it lives (a chunk, a device array, a result
    on its way to a file hold one); it keeps its memory, alignment and contents."""
    import gc

    ring = pipeline.BufferRing(pinned=pinned)
    a = ring.take("x", (1000, 3), np.float64)
    a[:] = 7.0
    address = a.ctypes.data
    b = ring.take("x", (1000, 3), np.float64)
    assert b.ctypes.data != address  # a is still held
    held = b[10:20]  # a view of b, as a chunk's field or a device array holds it
    del b
    gc.collect()
    c = ring.take("x", (1000, 3), np.float64)
    assert c.ctypes.data not in (address, held.base.ctypes.data)
    del a
    gc.collect()
    again = ring.take("x", (1000, 3), np.float64)
    assert again.ctypes.data == address and address % 64 == 0 and (again == 7.0).all()
    lent = ring.lend(("read", "x"), (8, 3), np.float64, 5)
    whole = ring.holding(lent)
    del lent
    assert ring.lend(("read", "x"), (8, 3), np.float64, 5).ctypes.data != whole.ctypes.data


def test_results_are_right_however_late_the_device_reads_its_inputs(tmp_path, monkeypatch):
    """Each chunk's program runs asynchronously, reading its host buffers whenever the device
    gets to it. Run at the latest moment the engine allows (when its outputs are asked for),
    over chunks of one file and chunks that join several files' pieces (which the readers
    put into buffers of their own), every result is the one of a single large chunk."""
    rng = np.random.default_rng(9)
    for k in range(7):
        n_atoms = rng.integers(1, 5, 3)
        write_batch(tmp_path / f"{k}.h5", n_atoms, {"x": rng.normal(size=(n_atoms.sum(), 3))},
                    {"s": rng.normal(size=3)})
    def results(chunk_atoms):
        with open_inputs([str(tmp_path)]) as batch:
            jobs = [engine.plan(str(tmp_path), OPS[op], names, batch.fields)
                    for op, names in (("mul", ["x", "s"]), ("rms_norm", ["x"]))]
            return [{label: a.copy() for out in outputs for label, a in out.items()}
                    for _, outputs in engine.run(batch, jobs, DEVICE, chunk_atoms=chunk_atoms)]

    want = results(10_000)[0]
    launch, finish = engine.launch, engine.finish
    monkeypatch.setattr(engine, "launch", lambda jobs, padded, device: (jobs, padded, device))
    monkeypatch.setattr(engine, "finish", lambda late, *rest: finish(launch(*late), *rest))
    for chunk_atoms in (1, 4, 9):
        got = results(chunk_atoms)
        for label in want:
            np.testing.assert_array_equal(np.concatenate([g[label] for g in got]), want[label],
                                          err_msg=f"{label}, chunks of {chunk_atoms} atoms")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_singular_says_what_matrix_rank_says(dtype):
    """engine.singular against np.linalg.matrix_rank(np.nan_to_num(m)) < 3: random and
    permuted cells, zero matrices and vectors, rank-2 and rank-1 cells, cells a step from
    singular either side of matrix_rank's threshold, huge, tiny, NaN and infinite entries."""
    rng = np.random.default_rng(7)
    eps = np.finfo(dtype).eps
    cells = [rng.normal(size=(3, 3)) * 10.0 ** rng.integers(-3, 4), np.zeros((3, 3)),
             np.diag([5.0, 5.0, 0.0]), np.diag([4.0, 0.0, 0.0]), np.eye(3)[[2, 0, 1]] * 3,
             np.array([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]]),  # rank 2, exactly
             np.array([[2.0, 0, 0], [0, 3, 0], [np.nan, np.nan, np.nan]]),
             np.array([[np.inf, 0, 0], [0, 1, 0], [0, 0, 1]]), np.eye(3) * 1e-30,
             np.eye(3) * 1e30]
    for step in (0.5, 2, 10, 1e3, 1e6, 1e9):  # smallest singular value `step` eps of the largest
        u, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        v, _ = np.linalg.qr(rng.normal(size=(3, 3)))
        cells.append(u @ np.diag([7.0, 3.0, 7 * step * eps]) @ v)
    cells = np.array(cells, dtype)
    expected = np.linalg.matrix_rank(np.nan_to_num(cells)) < 3
    assert expected[[1, 2, 3, 5, 6]].all() and not expected[[4, 8, 9]].any()
    assert np.array_equal(engine.singular(cells), expected)
    assert engine.singular(np.zeros((0, 3, 3), dtype)).shape == (0,)
