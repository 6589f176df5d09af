"""What the system or a format refuses is one line and exit 1, never a traceback, a signal's
death, a partial output or memory used without bound: exports to ASE formats that cannot
hold the data, compressed names, bincount's --length, RLIMIT_AS, RLIMIT_FSIZE and /dev/full
mid-write, schedulers that are no Dask scheduler."""

import bz2
import gzip
import http.server
import json
import lzma
import os
import resource
import socket
import subprocess
import sys
import threading

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.singlepoint import SinglePointCalculator
from ase.io.formats import ioformats
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main
from segcli.io.export import _NEEDS_CELL, _UNWRITABLE


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, *names):
    """The result is exit 1 with one line on stderr naming each of `names`."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, (result.exit_code, result.stderr)
    assert lines[0].startswith("Error: ") and all(str(n) in lines[0] for n in names), lines
    return lines[0]


@pytest.fixture(scope="module")
def structures(tmp_path_factory):
    """A molecule without a cell, two molecules, and two crystals of different sizes."""
    where = tmp_path_factory.mktemp("structures")
    water = molecule("H2O")
    water.calc = SinglePointCalculator(water, energy=-1.5, forces=np.ones((3, 3)))
    crystal = bulk("Cu") * (2, 1, 1)
    ase.io.write(where / "water.extxyz", water)
    ase.io.write(where / "molecules.extxyz", [molecule("H2O"), molecule("CH4")])
    ase.io.write(where / "crystals.extxyz", [crystal, bulk("Al")])
    return where


def _suffix(fmt):
    extensions = ioformats[fmt].extensions
    return extensions[0] if extensions else fmt


WRITABLE = sorted(name for name, io in ioformats.items() if io.can_write)


@pytest.mark.parametrize("fmt", WRITABLE)
def test_every_ase_writer_exports_or_refuses_in_one_line(tmp_path, structures, fmt):
    """Every format ASE writes, given a molecule without a cell and two crystals of different
    sizes: a file ASE reads back with the same atoms, or one line naming the output and the
    format, exit 1, and nothing left in the output's directory."""
    out = tmp_path / "out"
    out.mkdir()
    for source in ("water", "crystals"):
        target = out / f"{source}.{_suffix(fmt)}"
        result = run("convert", structures / f"{source}.extxyz", "-o", target, "--quiet")
        if result.exit_code:
            one_line_error(result, target, fmt)
            assert not os.listdir(out), os.listdir(out)
            if fmt in _UNWRITABLE or (source == "water" and fmt in _NEEDS_CELL):
                assert "segcli cannot export" in result.stderr or "cell" in result.stderr
            continue
        assert result.stderr == "" and os.listdir(out) == [target.name], os.listdir(out)
        assert fmt not in _UNWRITABLE and not (source == "water" and fmt in _NEEDS_CELL)
        if fmt in ("extxyz", "traj", "json", "db"):
            expected = ase.io.read(structures / f"{source}.extxyz", ":")
            got = ase.io.read(target, ":")
            assert [a.get_chemical_formula() for a in got] == [
                a.get_chemical_formula() for a in expected]
            for a, b in zip(got, expected):
                np.testing.assert_allclose(a.positions, b.positions, atol=1e-8)
        target.unlink()
    if ioformats[fmt].single:  # two structures to a format of one
        target = out / f"two.{_suffix(fmt)}"
        result = run("convert", structures / "crystals.extxyz", "-o", target)
        one_line_error(result, target, fmt)
        assert not os.listdir(out)


@pytest.mark.parametrize("suffix", [".extxyz.gz", ".xyz.bz2", ".traj.xz", ".json.gz",
                                    ".vasp.gz", ".cif.bz2", ".res.xz", ".db.gz"])
def test_a_compressed_name_is_compressed_or_refused(tmp_path, structures, suffix):
    """Written compressed (read back through gzip/bz2/lzma, and by ASE), or one line."""
    target = tmp_path / f"out{suffix}"
    source = structures / "crystals.extxyz"
    single = ioformats[ase.io.formats.filetype(str(target), read=False)].single
    if single:
        ase.io.write(tmp_path / "one.extxyz", ase.io.read(source, 0))
        source = tmp_path / "one.extxyz"
    result = run("convert", source, "-o", target, "--quiet")
    if suffix.startswith((".db", ".res")):  # ASE reads these only by name
        one_line_error(result, target, "not compressed")
        assert sorted(os.listdir(tmp_path)) == (["one.extxyz"] if single else [])
        return
    assert result.exit_code == 0, result.stderr
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[os.path.splitext(suffix)[1]]
    with opener(target, "rb") as f:
        assert f.read(1)  # a compressed stream of something
    expected = ase.io.read(source, ":")
    got = ase.io.read(target, ":")
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.get_chemical_formula() == b.get_chemical_formula()
        np.testing.assert_allclose(a.cell.cellpar(), b.cell.cellpar(), rtol=1e-6)
    assert sorted(os.listdir(tmp_path)) == sorted([target.name] + (["one.extxyz"] if single
                                                                    else []))


def test_bincount_length_beyond_memory_is_one_line_and_padding_does_not_multiply(tmp_path):
    from segcli import engine

    path = write_batch(tmp_path / "b.h5", [2, 1], {"numbers": np.array([1, 8, 6])})
    result = run("reduce", path, "bincount", "numbers", "--length", 10**12, "-o",
                 tmp_path / "out.h5")
    one_line_error(result, path, "--length 1000000000000", "memory")
    assert sorted(os.listdir(tmp_path)) == ["b.h5"]
    # 3 structures with wide rows are padded to 3, not to a bucket of 1024
    wide = engine.PADDING_BYTES // 100
    assert engine.padded_size(np.array([2, 1, 0]), 1000, wide)[1] == 3
    assert engine.padded_size(np.array([2, 1, 0]), 1000, 8)[1] == engine.MIN_BUCKET
    result = run("reduce", path, "bincount", "numbers", "--length", 10**5)
    assert result.exit_code == 0, result.stderr
    rows = [line.split(",") for line in result.stdout.splitlines()[1:]]
    counts = np.array([[int(v) for v in row[1:]] for row in rows])
    expected = np.zeros((2, 10**5), int)
    np.add.at(expected, ([0, 0, 1], [1, 8, 6]), 1)
    np.testing.assert_array_equal(counts, expected)


def _closing_server():
    """A TCP server that accepts each connection and closes it at once."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            connection, _ = server.accept()
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{server.getsockname()[1]}"


def _http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"tcp://127.0.0.1:{server.server_address[1]}", server


def test_a_scheduler_that_is_no_dask_scheduler_is_one_line_soon(tmp_path):
    import time

    import dask

    path = write_batch(tmp_path / "f.h5", [2] * 2, {"forces": np.ones((4, 3))})
    http_address, server = _http_server()
    with dask.config.set({"distributed.comm.timeouts.connect": "0.3s"}):
        for address in (_closing_server(), http_address, "inproc://nowhere"):
            start = time.monotonic()
            result = run("stats", path, "forces", "--scheduler", address, "-o",
                         tmp_path / "s.h5")
            one_line_error(result, address)
            assert time.monotonic() - start < 5
    server.shutdown()
    assert sorted(os.listdir(tmp_path)) == ["f.h5"]


def test_a_non_utf8_file_name_is_one_line_or_works(tmp_path):
    path = write_batch(tmp_path / "f.h5", [2, 1], {"forces": np.arange(9.).reshape(3, 3)})
    missing = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff.h5")
    one_line_error(run("stats", missing, "forces"), "no such file")
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xfe.extxyz")
    result = run("convert", path, "-o", odd, "--quiet")
    assert result.exit_code == 0, result.stderr
    assert os.fsencode(odd) in [os.path.join(os.fsencode(str(tmp_path)), n)
                               for n in os.listdir(os.fsencode(str(tmp_path)))]


# --- real limits, in subprocesses: each runs several cases in one process

DRIVER = """
import json, os, sys
from click.testing import CliRunner
from segcli.cli import main
out = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    out.append([result.exit_code, result.stderr])
print(json.dumps(out))
"""


def _driver(cases, limit, value, cwd):
    """Run the CLI cases (argument lists) in one process whose `limit` (a resource.RLIMIT_*)
    is `value`: [(exit code, stderr)]."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=cwd, env=env,
                          preexec_fn=lambda: resource.setrlimit(limit, (value, value)),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """A segcli file of 6000 four-atom structures (2.5 MB as extended XYZ)."""
    rng = np.random.default_rng(0)
    n_atoms = np.full(6000, 4)
    n = int(n_atoms.sum())
    return write_batch(tmp_path_factory.mktemp("large") / "large.h5", n_atoms,
                       {"numbers": rng.integers(1, 9, n), "positions": rng.normal(size=(n, 3)),
                        "forces": rng.normal(size=(n, 3))}, {"energy": rng.normal(size=6000)})


def _fsize_cases(tmp_path, cases):
    """Run `cases` (target, CLI arguments) under RLIMIT_FSIZE of 1.15 MB: each fails in one line
    naming its target and the limit, and the output directory stays empty."""
    out = tmp_path / "out"
    out.mkdir()
    results = _driver([args for _, args in cases], resource.RLIMIT_FSIZE, 1_150_000, tmp_path)
    for (target, _), (code, stderr) in zip(cases, results):
        lines = stderr.strip().splitlines()
        assert code == 1 and len(lines) == 1 and f"out/{target}" in lines[0], (target, stderr)
        assert "File too large" in lines[0], lines
    assert os.listdir(out) == []


@pytest.mark.filterwarnings("ignore:os.fork")
def test_the_file_size_limit_reached_mid_write_is_one_line_and_leaves_nothing(tmp_path, large):
    """RLIMIT_FSIZE (SIGXFSZ ignored, so EFBIG is an error) reached by exports streamed past
    the check made before writing: extended XYZ by select, ASE's trajectory by convert."""
    _fsize_cases(tmp_path, [
        ("sel.xyz", ["select", str(large), "--where", "energy < 100", "-o", "out/sel.xyz"]),
        ("x.traj", ["convert", str(large), "-o", "out/x.traj"])])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork")
def test_the_file_size_limit_reached_by_sqlite_leaves_no_journal(tmp_path, large):
    _fsize_cases(tmp_path, [("x.db", ["convert", str(large), "-o", "out/x.db"])])


@pytest.mark.filterwarnings("ignore:os.fork")
def test_too_little_address_space_is_one_line_not_an_abort(tmp_path):
    """RLIMIT_AS below what JAX and Warp take: refused before XLA starts (which would abort
    the process when it cannot create its threads), one line, exit 1, no output."""
    path = write_batch(tmp_path / "f.h5", [2, 1], {"forces": np.ones((3, 3))})
    cases = [["reduce", str(path), "sum", "forces", "-o", "r.h5"],
             ["grad", str(path), "sum", "forces", "-o", "g.h5"]]
    for code, stderr in _driver(cases, resource.RLIMIT_AS, 700 << 20, tmp_path):
        lines = stderr.strip().splitlines()
        assert code == 1 and len(lines) == 1, stderr
        assert lines[0].startswith("Error: out of memory") and "ulimit -v" in lines[0], lines
    assert sorted(os.listdir(tmp_path)) == ["f.h5"]


def test_a_memory_error_is_one_line():
    from segcli.errors import memory_shortage

    with pytest.raises(MemoryError) as raised:
        np.empty(1 << 58, np.uint8)
    assert memory_shortage(RuntimeError("a library's failure")) is None
    wrapped = RuntimeError("failed to load")
    wrapped.__cause__ = raised.value
    line = memory_shortage(wrapped)
    assert line.startswith("out of memory (Unable to allocate") and "\n" not in line


def test_json_to_stdout_on_a_full_disk_is_one_line(tmp_path):
    """json lines to stdout redirected to /dev/full (test_reliability has csv)."""
    path = write_batch(tmp_path / "f.h5", [2, 1], {"forces": np.ones((3, 3))},
                       {"energy": np.array([1.0, 2.0])})
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "segcli", "stats", str(path), "energy",
                               "--json"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                              check=False,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 1 and done.stderr == "Error: stdout: No space left on device\n"


def test_a_molecule_to_a_crystal_format_names_the_reason(tmp_path, structures):
    target = tmp_path / "POSCAR.vasp"
    line = one_line_error(run("convert", structures / "water.extxyz", "-o", target), target)
    assert "cell of three vectors" in line and "vasp" in line
    target = tmp_path / "m.cfg"  # ASE's cfg writer would invent a cell of 1 Å
    one_line_error(run("convert", structures / "water.extxyz", "-o", target), "cfg", "cell")
    assert os.listdir(tmp_path) == []
    one = Atoms("O", positions=[[0, 0, 0]], cell=[2, 2, 2], pbc=True)
    ase.io.write(tmp_path / "one.extxyz", one)
    assert run("convert", tmp_path / "one.extxyz", "-o", tmp_path / "one.cfg",
               "--quiet").exit_code == 0
    np.testing.assert_allclose(ase.io.read(tmp_path / "one.cfg").cell[:], one.cell[:])


def test_a_json_database_is_written_in_linear_time_as_ase_reads_it(tmp_path):
    """ASE's JSON database writer rewrites the whole file per row (400 rows: about 25 s);
    the export streams the rows in ASE's layout."""
    import time

    import ase.db

    rng = np.random.default_rng(1)
    frames = [Atoms("H2O", positions=rng.normal(size=(3, 3)), info={"k": float(i), "tag": "m"})
              for i in range(400)]
    ase.io.write(tmp_path / "in.extxyz", frames)
    start = time.monotonic()
    result = run("convert", tmp_path / "in.extxyz", "-o", tmp_path / "out.json", "--quiet")
    assert result.exit_code == 0, result.stderr
    assert time.monotonic() - start < 10
    rows = list(ase.db.connect(tmp_path / "out.json").select())
    assert [row.id for row in rows] == list(range(1, 401))
    for row, atoms in zip(rows, frames):
        np.testing.assert_allclose(row.positions, atoms.positions, atol=1e-8)  # as extxyz
        assert row.key_value_pairs == atoms.info


def test_too_many_open_files_is_said_so_not_a_damaged_file(tmp_path):
    """RLIMIT_NOFILE reached while an export opens its inputs: the system's refusal, named."""
    for i in range(12):
        write_batch(tmp_path / f"part-{i:02d}.h5", [1], {"numbers": np.array([1])})
    open_now = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 6, hard))
    try:
        result = run("convert", tmp_path, "-o", tmp_path / "all.extxyz")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    line = one_line_error(result, "part-", "Too many open files")
    assert "damaged" not in line
    assert not (tmp_path / "all.extxyz").exists()
