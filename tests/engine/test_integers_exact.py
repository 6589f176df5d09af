"""Integers are exact or refused: integer sums, maxima and minima near the ends of int64 and
uint64 against Python's own integers, through `segcli reduce` (HDF5, csv, json) and the
library; large integers in csv and json text; atomic numbers that are no integers, in every
reader."""

import json

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli import ops
from segcli.cli import main
from segcli.io import text

TOP = 2 ** 63
# structures of values near the ends of each dtype whose sums fit (those of int64 wrap on the
# way), and one whose sum does not (BAD)
GOOD = {
    np.int64: [[TOP - 1, 1, -1], [-TOP, 5, -5], [TOP - 1, -TOP], [], [TOP // 2, TOP // 2 - 1],
               [-TOP // 2, -TOP // 2]],
    np.uint64: [[2 * TOP - 1, 0], [TOP + 1, TOP - 2], [], [TOP, TOP - 1], [1, 2, 3]],
    np.int32: [[2 ** 31 - 1] * 3, [-2 ** 31] * 3, [], [7, -9]],
}
BAD = {np.int64: [TOP - 1, 1], np.uint64: [TOP, TOP], np.int32: None}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def integer_file(path, dtype, structures):
    """A file whose per-atom field `k` holds `structures` (lists of Python ints) as `dtype`."""
    values = np.array([v for s in structures for v in s], dtype)
    return write_batch(path, [len(s) for s in structures], {"k": values})


def from_text(fmt, body, column):
    """The column's values as Python ints, read from csv or json lines."""
    if fmt == "json":
        return [json.loads(line)[column] for line in body.splitlines()]
    header, *rows = body.splitlines()
    at = header.split(",").index(column)
    return [int(row.split(",")[at]) for row in rows]


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32], ids=lambda d: d.__name__)
def test_integer_sums_are_exact_or_refused(tmp_path, dtype):
    """sum, max, min of an integer field equal Python's integers (int32 summed in int64,
    uint64 in uint64) in -o files, csv and json; a structure whose sum leaves the result's
    range, among good ones and in a later chunk, is refused, named, with no output."""
    good = GOOD[dtype]
    path = integer_file(tmp_path / "good.h5", dtype, good)
    result = np.uint64 if dtype == np.uint64 else np.int64
    for op, python in (("sum", sum), ("max", max), ("min", min)):
        want = [python(s) for s in good if s]
        out = tmp_path / f"{op}.h5"
        assert invoke("reduce", path, op, "k", "-o", out, "--chunk-atoms", 3).exit_code == 0
        with h5py.File(out) as f:
            got = f[f"results/{op}_k"][:]
        assert got.dtype == result
        assert [int(v) for v, s in zip(got, good) if s] == want
        for fmt in ("csv", "json"):
            run = invoke("reduce", path, op, "k", "--format", fmt)
            assert run.exit_code == 0
            texts = from_text(fmt, run.stdout, f"{op}_k")
            assert [v for v, s in zip(texts, good) if s] == want
    if BAD[dtype] is None:
        return
    bad = integer_file(tmp_path / "bad.h5", dtype, [*good, BAD[dtype], [1]])
    out = tmp_path / "out.h5"
    run = CliRunner().invoke(main, ["reduce", str(bad), "sum", "k", "-o", str(out),
                                    "--chunk-atoms", "3"])
    assert run.exit_code == 1 and not out.exists()
    assert run.output.strip().splitlines() == [
        f"Error: {bad}: the sum of field 'k' over structure {len(good)} does not fit in "
        f"{np.dtype(result)} (it would wrap around)"]
    chosen = invoke("reduce", bad, "sum", "k", "--structures", f"0:{len(good)}")
    assert chosen.exit_code == 0  # the structures selected are summed, the bad one is not


@pytest.mark.usefixtures("x64")
def test_the_library_sums_integers_as_jax_does():
    """segcli.ops reduces int64 in int64, wrapping as jax.ops.segment_sum (the commands
    refuse instead, above); it takes no uint64."""
    x = np.array([TOP - 1, 1, -TOP, -1, 3], np.int64)
    ids = np.array([0, 0, 1, 1, 2], np.int32)
    got = ops.segmented_sum(jnp.asarray(x), jnp.asarray(ids), 3)
    want = jax.ops.segment_sum(jnp.asarray(x), jnp.asarray(ids), 3)
    assert got.dtype == jnp.int64
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert [int(v) for v in got] == [-TOP, TOP - 1, 3]  # wrapped both ways
    with pytest.raises(TypeError, match="uint64"):
        ops.segmented_sum(jnp.asarray(x.view(np.uint64)), jnp.asarray(ids), 3)


@pytest.mark.parametrize("native", ["1", "0"], ids=["C", "NumPy"])
@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_large_integers_are_printed_exactly(monkeypatch, native, fmt):
    """int64 and uint64 at their ends and past 2**53 are written as the integers they are,
    the text made in C and without it, beside floats as Python writes them."""
    monkeypatch.setenv("SEGCLI_NATIVE_TEXT", native)
    text._native_text.cache_clear()
    columns = {"structure": np.arange(3),
               "u": np.array([2 * TOP - 1, TOP + 1, 0], np.uint64),
               "i": np.array([[TOP - 1, -TOP], [2 ** 53 + 1, -2 ** 53 - 1], [-1, 0]], np.int64),
               "f": np.array([0.1, np.nan, 1e-7])}
    try:
        body = b"".join(text.lines(fmt, columns)).decode()
    finally:
        text._native_text.cache_clear()
    rows = [[r, u, *i, f] for r, u, i, f in zip(*(c.tolist() for c in columns.values()))]
    if fmt == "json":
        want = "".join(json.dumps({"structure": r, "u": u, "i": [i, j],
                                   "f": None if f != f else f}) + "\n"
                       for r, u, i, j, f in rows)
    else:
        want = "".join(",".join("" if v != v else repr(v) for v in row) + "\n" for row in rows)
    assert body == want


def segcli_numbers(path, numbers):
    """A segcli HDF5 file holding the structures' atomic numbers as floats."""
    return write_batch(path, [len(z) for z in numbers],
                       {"numbers": np.array([z for s in numbers for z in s], float),
                        "positions": np.zeros((sum(map(len, numbers)), 3))})


def conformer_numbers(path, numbers):
    """A conformer-layout file: a group per structure (one conformer each) holding its atomic
    numbers as floats."""
    with h5py.File(path, "w") as f:
        for k, z in enumerate(numbers):
            f[f"mol{k}/atomic_numbers"] = np.array(z, float)
            f[f"mol{k}/coordinates"] = np.zeros((1, len(z), 3))
    return path


def database_numbers(path, numbers):
    """An ASE JSON database (written by ASE) whose rows' numbers are then stored as floats."""
    import ase
    import ase.db

    with ase.db.connect(path, append=False) as db:
        for z in numbers:
            db.write(ase.Atoms(numbers=[1] * len(z), positions=np.zeros((len(z), 3))))
    rows = json.loads(path.read_text())
    for k, z in enumerate(numbers):
        rows[str(k + 1)]["numbers"] = {"__ndarray__": [[len(z)], "float64", z]}
    path.write_text(json.dumps(rows))
    return path


def extxyz_numbers(path, numbers):
    """An extxyz file whose atomic numbers are a float column."""
    path.write_text("".join(f"{len(z)}\nProperties=Z:R:1:pos:R:3\n"
                            + "".join(f"{v!r} {i} 0 0\n" for i, v in enumerate(z))
                            for z in numbers))
    return path


@pytest.mark.parametrize("reader, suffix, where", [
    (segcli_numbers, "h5", "/atoms/numbers: structure 1: atom 2"),
    (conformer_numbers, "h5", "/mol1/atomic_numbers (every conformer of group /mol1): atom 2"),
    (database_numbers, "json", "structure 1: atom 2"),
    (extxyz_numbers, "extxyz", "structure 1: atom 2"),
])
def test_atomic_numbers_that_are_not_integers_are_refused_by_every_reader(tmp_path, reader,
                                                                          suffix, where):
    """Atomic numbers stored as floats are their integers where they are integers, and a 1.7
    among them is refused in one line naming the file, the field and the structure, never cut
    to 1."""
    good = [[1.0, 8.0, 1.0], [6.0, 1.0, 7.0, 118.0], [0.0]]
    path = reader(tmp_path / f"good.{suffix}", good)
    run = invoke("reduce", path, "bincount", "numbers", "--format", "json")
    assert run.exit_code == 0
    counts = [json.loads(line)["bincount_numbers"] for line in run.stdout.splitlines()]
    assert counts == [np.bincount(np.array(z, int), minlength=119).tolist() for z in good]
    bad = reader(tmp_path / f"bad.{suffix}", [good[0], [6.0, 1.0, 1.7, 8.0], good[2]])
    for command in (["reduce", bad, "sum", "numbers"], ["convert", bad, "-o", tmp_path / "o.h5"]):
        run = CliRunner().invoke(main, [str(a) for a in command])
        assert run.exit_code == 1 and not (tmp_path / "o.h5").exists()
        assert run.output.strip().splitlines() == [
            f"Error: {bad}: {where} has atomic number 1.7, not an integer"]
    huge = reader(tmp_path / f"huge.{suffix}", [good[0], [6.0, 1.0, 1e20, 8.0], good[2]])
    run = CliRunner().invoke(main, ["reduce", str(huge), "sum", "numbers"])
    assert run.exit_code == 1
    assert run.output.strip().splitlines() == [
        f"Error: {huge}: {where} has atomic number 1e+20, beyond int64"]


def test_an_integer_result_beside_nan_rows_is_exact_or_refused(tmp_path):
    """Where an integer result becomes float64 to hold NaN rows (a structure lacking the
    field, or one --where leaves out of an -o file), its values come out exact, and one that
    float64 does not hold (2**53 + 1) is refused, named, leaving no output."""
    (tmp_path / "in").mkdir()
    k = np.array([2 ** 53 + 1, 2 ** 60, 4], np.int64)
    write_batch(tmp_path / "in/a.h5", [1, 1, 1], {"k": k}, {"e": np.array([1.0, 2.0, 3.0])})
    write_batch(tmp_path / "in/b.h5", [2], {"x": np.zeros(2)})
    out = tmp_path / "out.h5"
    for args, want in (([tmp_path / "in", "sum", "k", "-o", out], [2 ** 60, 4, np.nan]),
                       ([tmp_path / "in/a.h5", "sum", "k", "--where", "e < 2.5", "-o", out],
                        [2 ** 60, np.nan])):
        run = CliRunner().invoke(main, ["reduce", *map(str, args)])
        assert run.exit_code == 1 and not out.exists()
        assert run.output.strip().splitlines()[-1].endswith(
            "in structure 0 is 9007199254740993, which a float64 result (NaN where a structure "
            "has no value) does not hold exactly")
        assert invoke("reduce", *args, "--structures", "1:").exit_code == 0
        with h5py.File(out) as f:
            got = f["results/sum_k"][:]
        out.unlink()
        assert got.dtype == np.float64  # 2**60 exactly: a power of two
        np.testing.assert_array_equal(got, want)
