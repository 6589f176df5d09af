"""Hostile paths: a FIFO as FILE, @LIST or --structures-from, a symbolic link or FIFO planted
where a lock file goes, --help and --version into a closed pipe, a member changed while a
many-file run reads it, a read-only --in-place input, and messages that name the real cause
(symbolic link loops, dangling links, stdin, names with newlines, empty names, outputs with
no place to go, the --rename, --cast or --to-ase-units at fault), with no NumPy warning."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.errors import DataError
from segcli.io import core, open_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, stdin=None):
    """The command in this process, with every warning an error (none may reach stderr)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return CliRunner().invoke(main, [str(a) for a in args], input=stdin)


def assert_one_line_error(result, *needles):
    """Exit 1 with one line on stderr holding each needle, never a temporary copy's path."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("Error: "), \
        result.stderr
    assert "segcli-spool" not in result.stderr and ".tmp" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


@pytest.fixture
def batch(tmp_path):
    """in.h5: 3 structures, per-atom x (6, 3), per-structure e and s."""
    x = np.random.default_rng(1).normal(size=(6, 3))
    return write_batch(tmp_path / "in.h5", [2, 3, 1], {"x": x},
                       {"e": [1.0, 2.0, 3.0], "s": [0.5, 1.0, np.nan]}), x


def freed(fifo):
    """Let go a writer blocked opening `fifo` (its reader never came): open it for reading and
    close it at once."""
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("command, writer", [
    (["stats", "{fifo}", "x", "--json"], True), (["stats", "{fifo}", "x", "--json"], False),
    (["info", "@{fifo}"], False),
    (["select", "{source}", "--structures-from", "{fifo}", "-o", "{out}"], False)])
def test_a_fifo_as_file_is_read_once_or_refused_never_waited_on_for_ever(tmp_path, batch,
                                                                         monkeypatch, command,
                                                                         writer):
    source, x = batch
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(core, "WRITER_WAIT_S", 0.2)

    def write():  # once: a second open by segcli would find no writer and fail
        try:
            with open(fifo, "wb") as stream:
                stream.write(source.read_bytes())
        except BrokenPipeError:
            pass

    writing = threading.Thread(target=write, daemon=True)
    if writer:
        writing.start()
    started = time.monotonic()
    result = run(*(part.format(fifo=fifo, source=source, out=tmp_path / "out.h5")
                   for part in command))
    assert time.monotonic() - started < 5
    if writer:
        assert result.exit_code == 0, result.output
        stats = json.loads(result.stdout)
        assert stats["path"] == str(fifo) and stats["atoms"] == 6
        assert np.isclose(stats["stats"][0]["mean"], x[:, 0].mean(), rtol=1e-12)
        writing.join(5)
        if writing.is_alive():
            freed(fifo)
        assert not writing.is_alive()
    else:
        assert_one_line_error(result, f"{fifo}: a FIFO that no process wrote to within 0.2 s")
        assert sorted(os.listdir(tmp_path)) == ["fifo", "in.h5"]


def digest(path):
    return path.read_bytes()


@pytest.mark.parametrize("planted, in_place", [("symlink", True), ("symlink", False),
                                               ("fifo", False)])
def test_what_is_planted_where_a_lock_file_goes_is_never_followed(tmp_path, batch, planted,
                                                                  in_place):
    source, _ = batch
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = source if in_place else tmp_path / "out.h5"
    lock = tmp_path / f".{target.name}.lock"
    if planted == "symlink":
        lock.symlink_to(victim)
    else:
        os.mkfifo(lock)
    before = digest(source)
    if in_place:
        result = run("reduce", source, "sum", "x", "--in-place")
    else:
        result = run("convert", source, "-o", target)
    kind = "a symbolic link" if planted == "symlink" else "not a regular file"
    assert_one_line_error(result, f"{target}: cannot lock it for writing: {lock} is {kind}")
    assert digest(victim) == b"precious" and digest(source) == before
    assert (lock.is_symlink() if planted == "symlink" else lock.is_fifo())
    assert sorted(os.listdir(tmp_path)) == sorted(["in.h5", "victim", lock.name])


@pytest.mark.parametrize("args", [["--help"], ["--version"]])
def test_help_and_version_into_a_closed_pipe_exit_141_quietly(args):
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run([sys.executable, "-m", "segcli", *args], stdout=write,
                                 stderr=subprocess.PIPE, timeout=120,
                                 env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        os.close(write)
    assert process.returncode == 141 and process.stderr == b""


@pytest.mark.parametrize("change, members", [("replaced", 2), ("appended to", 2),
                                             ("replaced", 1)])
def test_a_file_changed_while_a_run_reads_it_is_refused(tmp_path, change, members):
    rng = np.random.default_rng(2)
    a = write_batch(tmp_path / "a.h5", [2, 3, 1], {"x": rng.normal(size=(6, 3))})
    b = write_batch(tmp_path / "b.h5", [1, 2], {"x": rng.normal(size=(3, 3))})
    other = write_batch(tmp_path / "other.h5", [2, 3, 1], {"x": rng.normal(size=(6, 3))})
    with open_inputs([a, b][:members]) as batch:
        chunks = batch.iter_chunks(["x"], chunk_atoms=2)
        assert next(chunks).n_atoms.tolist() == [2]
        if change == "replaced":
            os.replace(other, a)
        else:
            with open(a, "ab") as member:
                member.write(b"\0" * 64)
        with pytest.raises(DataError, match=f"^{a}: changed while this run read it"):
            list(chunks)


def as_a_plain_user():
    """The command prefix that runs a command without root's right to read and write any file
    (capabilities DAC_OVERRIDE, DAC_READ_SEARCH and FOWNER dropped by util-linux's setpriv),
    so that file modes hold for it as for any user; none for a user that has no such right."""
    if os.geteuid():
        return []
    return [shutil.which("setpriv"), "--bounding-set=-dac_override,-dac_read_search,-fowner"]


RUN_EACH = """
import json, sys
from click.testing import CliRunner
from segcli.cli import main
results = [CliRunner().invoke(main, args) for args in json.loads(sys.argv[1])]
print(json.dumps([[r.exit_code, r.stderr] for r in results]))
"""


def test_what_this_user_may_not_read_or_write_is_named_not_a_temporary(tmp_path, batch):
    source, _ = batch
    before = digest(source)
    (tmp_path / "noread.h5").write_bytes(before)
    (tmp_path / "shut").mkdir()
    (tmp_path / "shut" / "a.h5").write_bytes(before)
    (tmp_path / "rodir").mkdir()
    (tmp_path / "rodir" / "w.h5").write_bytes(before)
    for path, mode in (("in.h5", 0o444), ("noread.h5", 0), ("shut", 0o600), ("rodir", 0o555)):
        (tmp_path / path).chmod(mode)
    cases = [(["reduce", "in.h5", "sum", "x", "--in-place"],
              "in.h5: cannot store results in it (Permission denied: it is read-only"),
             (["info", "noread.h5"], "noread.h5: cannot read (Permission denied)"),
             (["info", "shut"], "shut: cannot list the directory (Permission denied)"),
             (["convert", "in.h5", "-o", "rodir/out.h5"],
              "rodir/out.h5: cannot write there (Permission denied)"),
             (["reduce", "rodir/w.h5", "sum", "x", "--in-place"],
              "rodir/w.h5: cannot write there (Permission denied)")]
    try:
        process = subprocess.run(
            [*as_a_plain_user(), sys.executable, "-c", RUN_EACH,
             json.dumps([args for args, _ in cases])],
            cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT},
            timeout=120)
        assert process.returncode == 0, process.stderr
        for (code, stderr), (args, needle) in zip(json.loads(process.stdout), cases):
            assert code == 1 and stderr.startswith("Error: ") and needle in stderr, (args, stderr)
            assert len(stderr.splitlines()) == 1 and ".tmp" not in stderr, stderr
    finally:
        for path in ("shut", "rodir"):
            (tmp_path / path).chmod(0o755)
    assert digest(source) == before and digest(tmp_path / "rodir" / "w.h5") == before
    assert sorted(os.listdir(tmp_path)) == ["in.h5", "noread.h5", "rodir", "shut"]
    assert os.listdir(tmp_path / "rodir") == ["w.h5"]


def test_messages_name_the_real_cause_and_no_warning_comes_first(tmp_path, batch, monkeypatch):
    source, _ = batch
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("gone.h5")
    (tmp_path / "list").write_text(f"{source}\nloop\n")
    (tmp_path / "two\nlines.h5").write_bytes(b"junk\0")
    hartree = write_batch(tmp_path / "hartree.h5", [1, 1], {}, {"e": [-1.0, 1e307]})
    with h5py.File(hartree, "a") as h5:
        h5["structures/e"].attrs["units"] = "Hartree"
    out = tmp_path / "out.h5"
    cases = [
        (["info", tmp_path / "loop"], "loop: too many levels of symbolic links"),
        (["info", tmp_path / "dangling"], "dangling: a symbolic link to gone.h5, which does "
                                          "not exist"),
        (["info", f"@{tmp_path / 'list'}"], "loop: too many levels of symbolic links"),
        (["info", "-"], "Error: -: ASE cannot read structure 0 as extxyz"),
        (["info", tmp_path / "two\nlines.h5"], "two\\nlines.h5: neither HDF5 nor"),
        (["info", ""], "'': an empty name names no file"),
        (["convert", hartree, "-o", out, "--to-ase-units"],
         "field 'e' of structure 1 holds a value too large for float64 once converted"),
        (["convert", "-", "@-", "-o", out], "-: stdin is given more than once"),
        (["stats", source, "e", "-o", tmp_path / "no" / "out.h5"],
         "out.h5: cannot write there (No such file or directory)"),
        (["stats", source, "e", "-o", source / "out.h5"],
         "out.h5: cannot write there (Not a directory)"),
        (["convert", source, "-o", out, "--rename", "e=t", "--rename", "s=t"],
         "--rename e=t and --rename s=t: both name a field 't'"),
        (["convert", source, "-o", out, "--rename", "x=e"],
         "--rename x=e: structure 0 has a field 'e' already"),
        (["convert", source, "-o", out, "--cast", "e=int64", "--cast", "s=int64"],
         "--cast s=int64: field 's' of structures from 0 cannot be cast to int64"),
        (["convert", source, "-o", out, "--cast", "x=float32", "--cast", "e=bool"],
         "--cast x=float32: field 'x'"),
    ]
    for args, needle in cases:
        assert_one_line_error(run(*args, stdin="garbage\n"), needle)
        assert not out.exists()
    monkeypatch.chdir(tmp_path)
    result = run("stats", source, "e", "-o", "-")
    assert result.exit_code == 2 and "'-' names no file" in result.stderr, result.output
    assert not os.path.lexists("-")


def test_extreme_coordinates_are_answered_or_refused_without_a_warning(tmp_path):
    """Atoms 1e200 Å apart (a close pair among them) and a cell 1e-200 Å thin: the pairs as
    NumPy counts them, and one line; no crash, no NumPy warning."""
    positions = np.array([[0.0, 0, 0], [1e200, 0, 0], [1e200, 1.5, 0]])
    far = write_batch(tmp_path / "far.h5", [3], {"positions": positions, "numbers": [1, 1, 1]},
                      {"cell": np.zeros((1, 3, 3)), "pbc": np.zeros((1, 3), bool)})
    result = run("neighbors", far, "--cutoff", 2, "--format", "json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    apart = np.hypot.reduce(positions[:, None] - positions[None], axis=2)
    close = (apart < 2) & ~np.eye(3, dtype=bool)
    assert row["n_pairs"] == close.sum() == 2 and row["min_distance"] == apart[close].min()
    thin = write_batch(tmp_path / "thin.h5", [2], {"positions": np.zeros((2, 3)),
                                                   "numbers": [1, 1]},
                       {"cell": np.eye(3)[None] * 1e-200, "pbc": np.ones((1, 3), bool)})
    assert_one_line_error(run("neighbors", thin, "--cutoff", 2),
                          "its cell is 1e-200 Å thin, and a cutoff of 2 Å would visit inf")


def test_a_stream_that_cannot_be_copied_is_named_with_where_and_why(tmp_path):
    """stdin larger than the file-size limit (RLIMIT_FSIZE) allows its temporary copy."""
    text = b"".join(b"2\nProperties=species:S:1:pos:R:3\nH 0 0 0\nH 0 0 0.74\n" for _ in range(99))
    process = subprocess.run(
        [shutil.which("prlimit"), "--fsize=1000", sys.executable, "-m", "segcli", "info", "-"],
        input=text, capture_output=True, timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)})
    assert process.returncode == 1 and process.stdout == b""
    where = re.escape(str(tmp_path))
    assert re.fullmatch(f"Error: -: cannot copy it to a temporary file in {where}"
                        r"/segcli-spool-\w+, which a stream is read through \(File too large; "
                        r"TMPDIR chooses where\)\n", process.stderr.decode()), process.stderr
    assert os.listdir(tmp_path) == []
