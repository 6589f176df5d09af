"""Text and ASE inputs that must never lose a result: reserved or invalid names, blank lines
between frames, float atomic numbers, NUL bytes, text that is not UTF-8, streams as FILE,
truncated compressed files and file names that are not UTF-8."""

import bz2
import gzip
import io
import lzma
import os
import subprocess
import sys

import ase.db
import ase.io
import h5py
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from click.testing import CliRunner

from segcli.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *needles):
    """Exit 1 with one line on stderr holding each needle, nothing on stdout, no traceback."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("Error: "), \
        result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def two_molecules():
    """Two structures, the first with a calculator's energy, as ASE builds them."""
    first = Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])
    first.calc = SinglePointCalculator(first, energy=-14.2)
    second = Atoms("CH4", positions=np.arange(15.0).reshape(5, 3) / 7)
    second.calc = SinglePointCalculator(second, energy=-24.0)
    return [first, second]


def database(path, *, data=None, **pairs):
    """An ASE SQLite database of `two_molecules`, the second row with key-value `pairs` and
    `data`."""
    with ase.db.connect(path) as db:
        first, second = two_molecules()
        db.write(first)
        db.write(second, data=data or {}, **pairs)
    return path


def trajectory(path, info):
    """`two_molecules` written by ASE as a trajectory, the second with `info` entries."""
    structures = two_molecules()
    structures[1].info.update(info)
    ase.io.write(path, structures, format="traj")
    return path


def extxyz_with(path, second_comment=" ", properties=None, columns=None):
    """`two_molecules` written by ASE, the second frame's comment line extended by
    `second_comment`, or its Properties and atom columns replaced by `properties` and
    `columns` (one string per atom)."""
    ase.io.write(path, two_molecules(), format="extxyz")
    lines = path.read_text().splitlines(keepends=True)
    lines[6] = lines[6].rstrip("\n") + second_comment + "\n"
    if properties:
        lines[6] = lines[6].replace("Properties=species:S:1:pos:R:3", properties)
        lines[7:12] = [line.rstrip("\n") + f" {extra}\n" for line, extra in zip(lines[7:12],
                                                                                columns)]
    path.write_bytes("".join(lines).encode())
    return path


NAMES = {  # file -> (what the message names, the option that leaves it out or None)
    "comment_n_atoms": (lambda p: extxyz_with(p, " n_atoms=7"), "'n_atoms'", "--fields"),
    "column_n_atoms": (lambda p: extxyz_with(p, properties="Properties=species:S:1:pos:R:3:"
                                             "n_atoms:I:1", columns="12345"), "'n_atoms'",
                       "--fields"),
    "comment_slash": (lambda p: extxyz_with(p, " a/b=1.5"), "'a/b'", "--drop"),
    "column_slash": (lambda p: extxyz_with(p, properties="Properties=species:S:1:pos:R:3:"
                                           "q/e:R:1", columns="12345"), "'q/e'", "--drop"),
    "comment_nul": (lambda p: extxyz_with(p, " a\0b=2"), "'a\\x00b'", "--fields"),
    "comment_dot": (lambda p: extxyz_with(p, " ..=2"), "'..'", "--drop"),
    "db_key_n_atoms": (lambda p: database(p, n_atoms=7), "'n_atoms'", "--fields"),
    "db_data_slash": (lambda p: database(p, data={"x/y": np.ones(5)}), "'x/y'", "--drop"),
    "db_data_empty": (lambda p: database(p, data={"": 1.0}), "''", "--fields"),
    "traj_integer_key": (lambda p: trajectory(p, {3: 1.5}), "field name 3 is not a string",
                         "--fields"),
    "comment_cell": (lambda p: extxyz_with(p, ' Lattice="9 0 0 0 9 0 0 0 9" cell=3'),
                     "two different 'cell'", None),
    "db_data_energy": (lambda p: database(p, data={"energy": 3.0}), "two different 'energy'",
                       None),
}


@pytest.mark.parametrize("name", NAMES)
def test_reserved_invalid_or_twice_given_names_are_refused(tmp_path, name):
    """Such a name, which would overwrite the atom counts, the cell or a result or make an
    HDF5 group, is refused naming the file, the structure and the name, and the option that
    leaves it out leaves it out."""
    write, named, option = NAMES[name]
    suffix = name.split("_")[0] if name.startswith(("db", "traj")) else "extxyz"
    path = write(tmp_path / f"{name}.{suffix}")
    out = tmp_path / "out.h5"
    for command in (["info", path], ["convert", path, "-o", out]):
        assert_one_line_error(run(*command), f"{path}: structure 1", named,
                              *[f"`{option}" if option == "--drop" else
                                f"`segcli convert {option}"] if option else [])
    assert not out.exists()
    if option is None:
        return
    leave_out = ["--fields", "numbers,positions,energy"] if option == "--fields" else [
        "--drop", named.strip("'")]
    result = run("convert", path, "-o", out, *leave_out)
    assert result.exit_code == 0, result.output
    if option == "--drop":
        result = run("convert", path, "-o", tmp_path / "renamed.h5", "--rename",
                     f"{named.strip(chr(39))}=renamed", "--fill-missing", "nan")
        assert result.exit_code == 0 and "renamed" in result.output, result.output
    with h5py.File(out) as h5:
        assert h5["structures/n_atoms"][:].tolist() == [3, 5]
        assert h5["structures/energy"][:].tolist() == [-14.2, -24.0]
        assert np.array_equal(h5["atoms/positions"][:],
                              np.concatenate([a.positions for a in ase.io.read(path, ":")]))


def test_grouped_results_of_many_files_are_not_field_names(tmp_path):
    """A result GROUP/NAME (/results/GROUP/NAME) is no field name: many files read it."""
    from batch_reference import write_batch

    from segcli.io import open_inputs

    for i, values in enumerate(([1.5, 2.5], [3.5])):
        path = write_batch(tmp_path / f"part{i}.h5", [1] * len(values), {"numbers": [1] * len(
            values)})
        with h5py.File(path, "a") as h5:
            h5["results/g/x"] = values
            h5["results/g/x"].attrs["per"] = "structure"
    with open_inputs(str(tmp_path / "part*.h5")) as batch:
        chunk, = batch.iter_chunks(["g/x"])
    assert chunk.structures["g/x"].tolist() == [1.5, 2.5, 3.5]


def frame(atoms, vectors=False):
    """One structure's extxyz text as ASE writes it (`vectors`: its cell as VEC lines, which
    only ASE's reader reads)."""
    text = io.StringIO()
    ase.io.write(text, atoms, format="extxyz")
    if not vectors:
        return text.getvalue()
    lines = text.getvalue().splitlines(keepends=True)
    lines[1] = lines[1][lines[1].index("Properties"):]
    return "".join(lines) + "".join(f"VEC{i + 1} {' '.join(map(str, v))}\n"
                                    for i, v in enumerate(atoms.cell))


@pytest.mark.parametrize("separator", ["\n", "\n  \t\n\n", "\r\n"])
def test_blank_lines_between_frames_are_read_past(tmp_path, separator):
    """Every frame is read, also one that only ASE reads after a blank line (ASE's own reader
    stops at the first blank line), each as ASE reads it alone (with VEC lines, ASE keeps the
    comment line as a string)."""
    structures = [*two_molecules(), Atoms("Si2", positions=[[0, 0, 0], [1.4, 1.4, 1.4]],
                                          cell=np.eye(3) * 5.4, pbc=True)]
    texts = [frame(structures[0]), frame(structures[1]), frame(structures[2], vectors=True)]
    path = tmp_path / "blank.extxyz"
    path.write_bytes(separator.join(texts).encode() + b"\n\n")
    out = tmp_path / "out.h5"
    result = run("convert", path, "-o", out, "--fill-missing", "nan")
    assert result.exit_code == 0, result.output
    expected = [ase.io.read(io.StringIO(text), format="extxyz") for text in texts]
    with h5py.File(out) as h5:
        assert h5["structures/n_atoms"][:].tolist() == [3, 5, 2]
        assert np.array_equal(h5["atoms/positions"][:],
                              np.concatenate([a.positions for a in expected]))
        assert np.array_equal(h5["structures/cell"][:], [a.cell.array for a in expected])
        assert h5["atoms/numbers"][:].tolist() == [1, 1, 8, 6, 1, 1, 1, 1, 14, 14]
        assert np.array_equal(h5["structures/energy"][:], [-14.2, -24.0, np.nan], equal_nan=True)
        assert h5["structures/comment"].asstr()[:].tolist() == ["", "", expected[2].info[
            "comment"]]


@pytest.mark.parametrize("tail, line, found", [
    ("garbage after the frames\n", 13, "'garbage after the frames'"),
    ("\n\n-3\nH 0 0 0\n", 15, "'-3'"),
    ("2.5\n\nH 0 0 0\nH 0 0 1\n", 13, "'2.5'"),
])
def test_anything_but_a_count_where_a_frame_begins_is_named(tmp_path, tail, line, found):
    path = tmp_path / "tail.extxyz"
    path.write_text("".join(map(frame, two_molecules())) + tail)
    for command in ("info", "convert"):
        assert_one_line_error(run(command, path, "-o", tmp_path / "out.h5")
                              if command == "convert" else run(command, path),
                              f"{path}: line {line}: expected the atom count of structure 2, "
                              f"found {found}")
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize("column, values, message", [
    ("Z:R:1", "1.9 1 8", "atom 0 has atomic number 1.9, not an integer"),
    ("Z:R:1", "1 1 nan", "atom 2 has atomic number nan, not an integer"),
    ("Z:R:1", "1.0 1.0 8.0", None),
    ("numbers:R:1", "1 1.000001 8", "atom 1 has atomic number 1.000001, not an integer"),
])
def test_atomic_numbers_that_are_not_integers_are_refused(tmp_path, column, values, message):
    """ASE would cut 1.9 to 1; an integral float is its integer."""
    rows = "".join(f"{z} {i} 0 0\n" for i, z in enumerate(values.split()))
    path = tmp_path / "z.extxyz"
    path.write_text(f"1\n\nHe 0 0 0\n3\nProperties={column}:pos:R:3\n{rows}")
    out = tmp_path / "out.h5"
    result = run("convert", path, "-o", out)
    if message:
        assert_one_line_error(result, f"{path}: structure 1: {message}")
        assert not out.exists()
    else:
        assert result.exit_code == 0, result.output
        with h5py.File(out) as h5:
            assert h5["atoms/numbers"][:].tolist() == [2, 1, 1, 8]


@pytest.mark.parametrize("text, named", [
    ('1\nlabel="ab\0cd"\nH 0 0 0\n', "comment or info entry 'label' holds a NUL byte"),
    ("1\nk\0=1\nH 0 0 0\n", "'k\\x00' holds a NUL byte"),
    ("1\n\nH\0 0 0 0\n", "ASE cannot read structure 0 as extxyz"),
])
def test_nul_bytes_in_text_are_one_line(tmp_path, text, named):
    path = tmp_path / "nul.extxyz"
    path.write_text(text)
    assert_one_line_error(run("convert", path, "-o", tmp_path / "out.h5"), f"{path}: ", named)
    assert not (tmp_path / "out.h5").exists()


def test_text_that_is_not_utf8_names_its_line(tmp_path):
    """The line is named exactly, even far beyond the block of text first decoded."""
    molecule = frame(two_molecules()[0])
    path = tmp_path / "latin1.extxyz"
    path.write_bytes((molecule * 400).encode() + molecule.replace(
        "pbc", "caf\xe9=1 pbc").encode("latin-1"))
    assert_one_line_error(run("info", path), f"{path}: line 2002 is not UTF-8 text (byte "
                                             "0xe9: invalid continuation byte)")


@pytest.mark.parametrize("module", [gzip, bz2, lzma])
@pytest.mark.parametrize("cut", [40, -20])
def test_truncated_compressed_text_is_named(tmp_path, module, cut):
    """Cut early (its head does not decompress) or late (reading it fails)."""
    text = "".join(frame(a) for a in two_molecules() * 150).encode()
    packed = module.compress(text)
    suffix = {gzip: "gz", bz2: "bz2", lzma: "xz"}[module]
    path = tmp_path / f"cut.extxyz.{suffix}"
    path.write_bytes(packed[:cut])
    out = tmp_path / "out.h5"
    for command in (["info", path], ["convert", path, "-o", out]):
        assert_one_line_error(run(*command), f"{path}: truncated: its compressed data ends "
                                             "before the end of the stream")
    assert not out.exists()


def test_streams_are_read_through_a_temporary_that_is_removed(tmp_path):
    """A FIFO is read as the file it streams (but not given to --in-place); so are bash's
    `<(...)` and a /proc file, which stat calls empty: that one holds no structure, an error
    naming it, and the temporaries are gone when the process ends."""
    import threading

    path = tmp_path / "two.extxyz"
    ase.io.write(path, two_molecules(), format="extxyz")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(path.read_bytes()))
    writer.start()
    out = tmp_path / "out.h5"
    result = run("convert", fifo, "-o", out)
    writer.join(timeout=10)
    if writer.is_alive():  # nothing read the FIFO: let the writer finish
        fifo.read_bytes()
    assert result.exit_code == 0, result.output
    with h5py.File(out) as h5:
        assert h5["structures/n_atoms"][:].tolist() == [3, 5]
        assert h5["structures/energy"][:].tolist() == [-14.2, -24.0]
    for stream in (fifo, "-"):  # results stored in its copy would be lost
        result = CliRunner().invoke(main, ["reduce", str(stream), "sum", "positions",
                                           "--in-place"], input=out.read_bytes())
        assert result.exit_code == 2 and f"--in-place stores results in FILE itself; {stream} " \
            "is a stream" in result.stderr, result.output
    spool = tmp_path / "tmp"
    spool.mkdir()
    result = subprocess.run(["bash", "-c", f"{sys.executable} -m segcli convert "
                             f"<(cat {path}) /proc/self/status -o {tmp_path / 'new.h5'}"],
                            capture_output=True, text=True, env={**os.environ, "TMPDIR": spool})
    assert result.returncode == 1
    assert result.stderr == ("Error: /proc/self/status: neither HDF5 nor a file format that "
                             "ASE can read (`--input-format NAME` names its format)\n")
    assert os.listdir(spool) == [] and not (tmp_path / "new.h5").exists()


def test_file_names_that_are_not_utf8_are_read_and_printed(tmp_path):
    """A name with byte 0xff: read by info, convert and reduce, printed as its bytes on
    stdout (by a real process whose stdout encoding is strict) and escaped in messages."""
    directory = os.fsencode(tmp_path)
    path = os.fsdecode(directory + b"/f\xff.extxyz")
    ase.io.write(path, two_molecules(), format="extxyz")
    expected = ase.io.read(path, ":")
    result = run("convert", path, "-o", os.fsdecode(directory + b"/o\xff.h5"))
    assert result.exit_code == 0, result.output
    with h5py.File(os.fsdecode(directory + b"/o\xff.h5")) as h5:
        assert h5["structures/n_atoms"][:].tolist() == [3, 5]
    result = run("reduce", path, "max", "positions")
    assert result.exit_code == 0, result.output
    got = np.loadtxt(io.StringIO(result.stdout), delimiter=",", skiprows=1)
    assert np.allclose(got[:, 1:], [a.positions.max(axis=0) for a in expected], rtol=1e-6)
    converted = os.fsdecode(directory + b"/o\xff.h5")
    for args in (["reduce", converted, "sum", "positions", "-o", tmp_path / "r.h5"],
                 ["select", converted, "--where", "energy < 0", "-o", tmp_path / "s.h5"]):
        result = run(*args)
        assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "r.h5") as r, h5py.File(tmp_path / "s.h5") as s:
        assert r.attrs["sources"].tolist() == [f"{tmp_path}/o\\xff.h5"]
        assert s.attrs["selected_from"] == f"{tmp_path}/o\\xff.h5"
    result = run("info", os.fsdecode(directory + b"/missing\xff.h5"))
    assert_one_line_error(result, f"{tmp_path}/missing\\udcff.h5: no such file")
    result = subprocess.run([sys.executable, "-m", "segcli", "info", path], capture_output=True,
                            env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(directory + b"/f\xff.extxyz: extended XYZ file\n")
