"""segcli.io.text (CSV and JSON lines of result tables) against Python's own per-row text
(repr, json.dumps) and read back with the csv and json modules; then `segcli reduce` and
`segcli grad` printing csv and json, against their npy output."""

import csv
import io
import json

import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.io import text

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -2.2250738585072014e-308,
           1.7976931348623157e308, 1e-10, 9.99e-10, 1e-9, 3.5e-7, -1e-5, 1e-5, 2.5e-5, -1e-4,
           9.999999999999999e-05, 1e-4, 0.1, 1e15, 1e16, -1.2345678901234567e16, 1e22]


def numbers(rng, shape, dtype):
    """Random values of every magnitude the dtype holds, a third of them from SPECIAL."""
    with np.errstate(over="ignore"):
        x = rng.standard_normal(shape) * 10.0 ** rng.integers(-330, 309, shape)
        special = rng.random(shape) < 1 / 3
        x[special] = rng.choice(SPECIAL, int(special.sum()))
        return x.astype(dtype)


def spelled(array):
    """The float64 values that Python writes for `array` (float32: its shortest text's)."""
    return array.astype(str).astype(np.float64) if array.dtype == np.float32 else array


def strict(value):
    """A row's value as strict JSON has it: non-finite floats as None (null)."""
    if isinstance(value, list):
        return [strict(v) for v in value]
    return None if isinstance(value, float) and not np.isfinite(value) else value


def per_row(fmt, columns):
    """The text Python writes row by row: repr of each number, NaN as an empty cell (CSV),
    json.dumps of the row with its non-finite numbers null (JSON)."""
    lists = [spelled(a).tolist() for a in columns.values()]
    if fmt == "json":
        return "".join(json.dumps(dict(zip(columns, map(strict, row))), allow_nan=False) + "\n"
                       for row in zip(*lists))
    flat = [spelled(a).reshape(len(a), int(np.prod(a.shape[1:]))).tolist()
            for a in columns.values()]
    return "".join(",".join("" if v != v else repr(v) for cells in row for v in cells) + "\n"
                   for row in zip(*flat))


def same(got, want):
    """Equal as numbers, NaN to NaN and -0.0 to -0.0."""
    got, want = np.asarray(got, want.dtype), np.asarray(want)
    return np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got),
                                                                        np.signbit(want))


def read_back(fmt, body, columns):
    """The columns of `body` as arrays shaped like `columns`, read by the csv or json module."""
    if fmt == "json":
        rows = [json.loads(line) for line in body.splitlines()]
        assert all(list(row) == list(columns) for row in rows)
        return {name: np.reshape(np.array([row[name] for row in rows], dtype=a.dtype), a.shape)
                for name, a in columns.items()}
    rows = list(csv.reader(io.StringIO(body)))
    out, k = {}, 0
    for name, a in columns.items():
        width = int(np.prod(a.shape[1:]))
        kind = int if a.dtype.kind in "iu" else lambda v: float(v or "nan")
        cells = [[kind(v) for v in row[k:k + width]] for row in rows]
        out[name] = np.reshape(cells, a.shape)
        k += width
    return out


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 64 numbers, so that a test's rows span many blocks."""
    monkeypatch.setattr(text, "_BLOCK_CELLS", 64)


@pytest.fixture(params=["C", "NumPy"])
def both_paths(request, monkeypatch):
    """The text made in C (_text.c) and, where it cannot be built, in NumPy passes."""
    monkeypatch.setenv("SEGCLI_NATIVE_TEXT", "1" if request.param == "C" else "0")
    text._native_text.cache_clear()
    assert (text._native_text() is not None) == (request.param == "C")
    yield request.param
    text._native_text.cache_clear()


@pytest.mark.parametrize("fmt", ["csv", "json"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows", [0, 1, 7, 500])
@pytest.mark.usefixtures("both_paths")
def test_lines_are_pythons_text_and_read_back_exactly(fmt, dtype, rows):
    rng = np.random.default_rng(rows)
    structure = np.arange(rows) + 10 ** 9
    tables = [
        {"structure": structure, "rms_norm_x": numbers(rng, (rows,), dtype)},
        {"structure": structure, "sum_x": numbers(rng, (rows, 3), dtype)},
        {"structure": structure, "source": np.arange(rows, dtype=np.int32) % 3,
         "source_index": structure // 7, "atom": np.arange(rows) % 5,
         "d_x": numbers(rng, (rows, 3), dtype), "d_v": numbers(rng, (rows,), dtype)},
        {"structure": structure, "matvec": numbers(rng, (rows, 3, 3), dtype)},
        {"structure": structure, "count": rng.integers(-5, 2 ** 31, rows, dtype=np.int32)},
        {"structure": structure.astype(np.uint32),  # integers of every length
         "n": rng.choice([0, 1, -1, 9, 10, -10, 2 ** 53 - 1, 1 - 2 ** 53], (rows, 2)),
         "v": numbers(rng, (rows,), dtype)},
    ]
    for columns in tables:
        body = b"".join(text.lines(fmt, columns)).decode()
        assert body == per_row(fmt, columns)
        for name, got in read_back(fmt, body, columns).items():
            want = columns[name]
            if fmt == "json" and want.dtype.kind == "f":  # null: no number, read back as NaN
                want = np.where(np.isfinite(want), want, np.nan).astype(want.dtype)
            assert same(got, want) if want.dtype != np.float32 else \
                same(np.asarray(got, np.float64).astype(np.float32), want), name


@pytest.mark.usefixtures("both_paths")
def test_every_float64_class_of_notation_matches_repr():
    """Bit patterns from all over float64 (subnormals, both notations, both exponent signs,
    one- to three-digit exponents), one block each."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2 ** 64, 20_000, dtype=np.uint64).view(np.float64)
    x = np.concatenate([x, 10.0 ** np.arange(-323, 309), -(10.0 ** np.arange(-20, 20) * 1.5)])
    columns = {"structure": np.arange(len(x)), "v": x}
    for fmt in ("csv", "json"):
        assert b"".join(text.lines(fmt, columns)).decode() == per_row(fmt, columns)


@pytest.mark.usefixtures("both_paths")
def test_empty_and_zero_size_columns():
    assert list(text.lines("csv", {"structure": np.zeros(0, int), "v": np.zeros((0, 3))})) == []
    columns = {"structure": np.arange(2), "e": np.zeros((2, 0)), "v": np.ones((2, 2, 0))}
    assert b"".join(text.lines("json", columns)).decode() == per_row("json", columns)
    assert text.header({"structure": (), "e": (0,), "v": (2,), "m": (2, 2)}) == \
        b"structure,v_0,v_1,m_0_0,m_0_1,m_1_0,m_1_1\n"


@pytest.mark.usefixtures("both_paths")
def test_names_are_json_strings():
    columns = {"structure": np.arange(3), 'a "b", c\n\x00\x7f\u00e9': np.ones(3)}
    assert b"".join(text.lines("json", columns)).decode() == per_row("json", columns)


def test_refuses_columns_that_are_not_numbers():
    with pytest.raises(TypeError, match="not a number type"):
        list(text.lines("csv", {"structure": np.arange(2), "source": np.array(["a", "b"])}))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run(*args):
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def npy(*args):
    return np.load(io.BytesIO(run(*args, "--format", "npy").stdout_bytes))


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_cli_csv_and_json_are_the_npy_results(tmp_path, precision):
    """reduce (scalar and vector per structure, vector per atom, a float and an integer op in
    one pass) and grad (one and two outputs per atom), over two files (source columns), with
    values of every magnitude, printed as csv and json: Python's text of the npy output."""
    rng = np.random.default_rng(3)
    n_atoms = [[3, 0, 5, 1], [2, 4]]
    for k, n in enumerate(n_atoms):
        x = rng.standard_normal((sum(n), 3)) * 10.0 ** rng.integers(-12, 12, (sum(n), 3))
        x[0] = [1e-5, -0.0, 3e-7]
        write_batch(tmp_path / f"{k}.h5", n, {"x": x, "y": rng.standard_normal((sum(n), 3))},
                    {"s": rng.standard_normal(len(n))})
    counts = np.concatenate(n_atoms)
    first = np.concatenate([np.zeros(4, int), np.full(2, 4)])
    index = {"structure": np.arange(6), "source": np.repeat([0, 1], [4, 2]),
             "source_index": np.arange(6) - first}
    per_atom = {key: np.repeat(i, counts) for key, i in index.items()}
    per_atom["atom"] = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    for args, rows, name in [(["reduce", tmp_path, "rms_norm", "x"], index, "rms_norm_x"),
                             (["reduce", tmp_path, "sum", "x"], index, "sum_x"),
                             (["reduce", tmp_path, "mul", "x", "s"], per_atom, "mul_x_s"),
                             (["grad", tmp_path, "rms_norm", "x"], per_atom, "d_x"),
                             (["grad", tmp_path, "dot", "x", "y"], per_atom, None),
                             (["reduce", tmp_path, "rms_norm", "x", "+", "count"], index, None)]:
        args += ["--precision", precision, "--chunk-atoms", 4]
        values = npy(*args)  # a structured array for several outputs (d_x, d_y; two ops)
        named = {name: values} if name else {n: values[n] for n in values.dtype.names}
        columns = {**rows, **named}
        shapes = {key: a.shape[1:] for key, a in columns.items()}
        assert run(*args, "--format", "csv").stdout == text.header(shapes).decode() + \
            per_row("csv", columns)
        assert run(*args, "--format", "json").stdout == per_row("json", columns)


def strict_json(line):
    """A JSON document parsed as strict JSON: NaN and Infinity tokens refused."""
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def test_every_json_output_is_strict_json_with_null_for_non_finite_numbers(tmp_path):
    """max of an empty structure (-inf), statistics of an infinite value (inf and NaN), fit-e0
    with no usable structure (NaN errors): null."""
    path = write_batch(tmp_path / "f.h5", [2, 0, 1], {"x": np.array([[1.0], [np.inf], [2.0]]),
                                                      "numbers": np.array([1, 1, 8])},
                       {"energy": np.array([np.nan, 1.0, 2.0])})
    rows = [strict_json(line) for line in run("reduce", path, "max", "x", "--format",
                                              "json").stdout.splitlines()]
    assert [row["max_x"] for row in rows] == [[None], [None], [2.0]]
    stats = strict_json(run("stats", path, "x", "--structures", "1:2", "--json").stdout)
    assert (stats["stats"][0]["count"], stats["stats"][0]["mean"]) == (0, None)
    info = strict_json(run("info", path, "--json").stdout)
    assert info["structures"] == 3
    fit = strict_json(run("fit-e0", path, "--structures", "1:2", "--json").stdout)
    assert fit["structures"] == 1 and fit["rmse_per_atom"] is None


def test_csv_header_quotes_names_holding_commas_quotes_or_line_breaks(tmp_path):
    """Field names are the file's: the csv module reads the header back to them."""
    names = ['a,b "c"', "e\nx"]
    path = write_batch(tmp_path / "odd.h5", [2, 1], {names[0]: np.arange(3.0)},
                       {names[1]: np.array([2.0, 3.0])})
    result = run("reduce", path, "mul", *names)
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert rows == [["structure", "atom", f"mul_{names[0]}_{names[1]}"], ["0", "0", "0.0"],
                    ["0", "1", "2.0"], ["1", "0", "6.0"]]


def test_an_output_named_csv_json_or_npy_holds_what_stdout_gets(tmp_path):
    rng = np.random.default_rng(4)
    path = write_batch(tmp_path / "f.h5", [3, 0, 2], {"x": rng.standard_normal((5, 3))},
                       {"s": rng.standard_normal(3)})
    for args in (["reduce", path, "rms_norm", "x", "+", "sum", "x"],
                 ["grad", path, "dot", "x", "x"]):
        for suffix, fmt in ((".csv", "csv"), (".json", "json"), (".jsonl", "json"),
                            (".NPY", "npy")):
            out = tmp_path / f"out{suffix}"
            run(*args, "-o", out)
            assert out.read_bytes() == run(*args, "--format", fmt).stdout_bytes
            out.unlink()
    cases = [(["-o", tmp_path / "out.txt"], 2, "name a segcli HDF5 file (.h5, .hdf5) or a table"),
             (["+", "mul", "x", "s", "-o", tmp_path / "out.csv"], 2,
              "the rows of a table are per structure or per atom"),
             (["-o", path.parent / "f.h5.csv", "--format", "csv"], 2, "--format is for stdout")]
    for args, code, message in cases:
        result = invoke("reduce", path, "sum", "x", *args)
        assert result.exit_code == code and message in result.output, result.output
    (tmp_path / "kept.csv").write_text("mine")
    result = invoke("reduce", path, "sum", "x", "-o", tmp_path / "kept.csv")
    assert result.exit_code == 1 and "already exists; use --force" in result.output
    assert (tmp_path / "kept.csv").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.h5", "kept.csv"]


@pytest.mark.parametrize("command", [["stats", "{f}", "x"], ["merge", "{f}"]])
def test_commands_that_write_hdf5_refuse_another_suffix(tmp_path, command):
    path = write_batch(tmp_path / "f.h5", [1], {"x": np.ones((1, 3))})
    for name, code in (("out.csv", 2), ("out.JSON", 2)):
        result = invoke(*[part.format(f=path) for part in command], "-o", tmp_path / name)
        assert result.exit_code == code and f"{command[0]} writes segcli HDF5" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.h5"]


@pytest.mark.parametrize("command", [["reduce", "{f}", "sum", "x"], ["convert", "{f}"],
                                     ["select", "{f}", "--where", "e < 1"],
                                     ["stats", "{f}", "x"]])
def test_an_empty_output_name_is_a_usage_error(tmp_path, command):
    path = write_batch(tmp_path / "f.h5", [1], {"x": np.ones((1, 3))}, {"e": [0.0]})
    result = invoke(*[part.format(f=path) for part in command], "-o", "")
    assert result.exit_code == 2 and "'' names no file" in result.output, result.output


@pytest.mark.usefixtures("both_paths")
def test_every_float32_class_of_notation_matches_pythons_text():
    """float32 bit patterns from all over (subnormals, the powers of two, both notations):
    the repr of the float64 that each one's shortest text reads back as."""
    rng = np.random.default_rng(1)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 20_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(4096, dtype=np.uint32), (np.arange(255, dtype=np.uint32)
                                                              << 23)])
    x = bits.view(np.float32)
    columns = {"structure": np.arange(len(x)), "v": x}
    for fmt in ("csv", "json"):
        assert b"".join(text.lines(fmt, columns)).decode() == per_row(fmt, columns)


@pytest.mark.parametrize("count", [1, 3])
def test_text_made_by_threads_is_in_order(count):
    """Many blocks, made by `count` threads: the rows in order, as one thread makes them."""
    from segcli import threads

    rng = np.random.default_rng(2)
    columns = {"structure": np.arange(5000), "v": numbers(rng, (5000, 3), np.float64)}
    threads.set_count(count)
    try:
        assert b"".join(text.lines("csv", columns)).decode() == per_row("csv", columns)
    finally:
        threads.set_count(None)
