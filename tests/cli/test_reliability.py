"""Never losing data (SPEC §3d) with real processes: signals mid-write, concurrent in-place
writers, full disks (RLIMIT_FSIZE, /dev/full), temporaries of killed runs, outputs that are
not regular files."""

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import ase.io
import h5py
import numpy as np
import pytest
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from batch_reference import write_batch

from segcli.errors import DataError
from segcli.io.outputs import atomic_output, scratch_directory

ELEMENTS = np.array([1, 6, 8])


def segcli(*args, limit=None, **kwargs):
    """A real `python -m segcli` process; `limit` caps the size of files it writes (bytes,
    RLIMIT_FSIZE, set by util-linux's prlimit)."""
    cap = [shutil.which("prlimit"), f"--fsize={limit}"] if limit else []
    return subprocess.Popen([*cap, sys.executable, "-m", "segcli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def finish(process):
    out, err = process.communicate(timeout=300)
    return process.returncode, out.decode(), err.decode()


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def litter(directory):
    """Files a run may leave by mistake: temporaries and locks."""
    return [n for n in os.listdir(directory) if n.endswith((".tmp", ".lock"))]


def wait_for_temporary(directory, process):
    """Return once the process's temporary output exists in `directory`."""
    while not [n for n in os.listdir(directory) if n.endswith(".tmp")]:
        assert process.poll() is None, process.communicate()
        time.sleep(0.001)


def signal_while_writing(directory, process, signum):
    """Stop the process once its temporary output exists, send it `signum`, let it go on."""
    wait_for_temporary(directory, process)
    process.send_signal(signal.SIGSTOP)
    process.send_signal(signum)
    process.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def composition_file(tmp_path_factory):
    """500 000 structures of H, C and O with linear energies: (path, counts, energies)."""
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 4, (500_000, 3))
    counts[:, 1] += 1
    numbers = np.repeat(np.tile(ELEMENTS, len(counts)), counts.ravel())
    energies = counts @ np.array([-13.6, -1029.8, -2041.2]) + rng.normal(0, 0.1, len(counts))
    path = tmp_path_factory.mktemp("big") / "big.h5"
    write_batch(path, counts.sum(axis=1), {"numbers": numbers}, {"energy": energies})
    return path, counts, energies


def test_sigterm_during_an_in_place_write_changes_nothing(tmp_path, composition_file):
    source, _, _ = composition_file
    path = tmp_path / "big.h5"
    path.write_bytes(source.read_bytes())
    before = digest(path)
    process = segcli("fit-e0", path, "--in-place", "--chunk-atoms", 20_000)
    signal_while_writing(tmp_path, process, signal.SIGTERM)
    code, out, err = finish(process)
    assert (code, err) == (143, "Interrupted (SIGTERM)\n"), out
    assert digest(path) == before and litter(tmp_path) == []


def test_sigint_during_a_conversion_leaves_no_output(tmp_path):
    frames = [Atoms("H2O", positions=np.random.default_rng(i).normal(size=(3, 3)))
              for i in range(4000)]
    for i, atoms in enumerate(frames):
        atoms.calc = SinglePointCalculator(atoms, energy=float(i), forces=np.zeros((3, 3)))
    ase.io.write(tmp_path / "water.extxyz", frames)
    process = segcli("convert", tmp_path / "water.extxyz", "-o", tmp_path / "water.h5",
                     "--chunk-atoms", 300)
    signal_while_writing(tmp_path, process, signal.SIGINT)
    code, _, err = finish(process)
    assert (code, err) == (130, "Interrupted (SIGINT)\n")
    assert sorted(os.listdir(tmp_path)) == ["water.extxyz"]


def test_a_signal_during_an_import_waits_for_the_module_then_interrupts(tmp_path):
    """A real SIGINT arriving while the main thread imports a module (as a command's lazy
    imports may, after its output exists) lets the import finish, then raises Interrupted;
    an import in the cleanup after an Interrupted does not raise it again."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(1000): pass\n"
        "DONE = True\n")
    (tmp_path / "plain_module.py").write_text("DONE = True\n")
    child = f"""
import os, signal, sys
sys.path.insert(0, {str(tmp_path)!r})
from segcli.errors import Interrupted, interruptible
with interruptible():
    try:
        import slow_module
        print("not interrupted")
    except Interrupted:
        print("interrupted after the import:", sys.modules["slow_module"].DONE)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000): pass
        print("not interrupted")
    except Interrupted:
        import plain_module
        print("cleanup import:", plain_module.DONE)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["interrupted after the import: True",
                                        "cleanup import: True"]


def test_an_interrupt_that_a_library_turns_into_another_error_is_an_interrupt(tmp_path):
    """A real SIGINT whose Interrupted a library's callback turned into another exception (as
    h5py's conversions make a TypeError of it) exits 130 saying so, not with a traceback;
    the same exception with no signal before it is still a traceback (a bug to show)."""
    child = """
import os, signal, sys
import click
from segcli.cli import main
from segcli.errors import Interrupted

@click.command()
@click.option("--signal", "send", is_flag=True)
def fails(send):
    try:
        if send:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000): pass
        raise TypeError("operation not defined for data type class")
    except Interrupted as err:
        raise TypeError("operation not defined for data type class") from err

main.add_command(fails)
main(["fails", *sys.argv[1:]])
"""
    interrupted = subprocess.run([sys.executable, "-c", child, "--signal"], capture_output=True,
                                 text=True, timeout=120, cwd=tmp_path)
    assert (interrupted.returncode, interrupted.stderr) == (130, "Interrupted (SIGINT)\n")
    bug = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bug.returncode == 1 and bug.stderr.startswith("Traceback"), bug.stderr
    assert "TypeError: operation not defined" in bug.stderr


def test_concurrent_in_place_writers_all_land(tmp_path, composition_file):
    """Three runs storing results in one file at once: each exits 0 and each result is there."""
    source, counts, energies = composition_file
    path = tmp_path / "big.h5"
    path.write_bytes(source.read_bytes())
    runs = [segcli("fit-e0", path, "--in-place", "--name", f"r{i}", "--fixed", f"H={-13 - i}")
            for i in range(3)]
    for process in runs:
        code, _, err = finish(process)
        assert code == 0, err
    with h5py.File(path) as f:
        for i in range(3):
            free = np.linalg.lstsq(counts[:, 1:].astype(float),
                                   energies - counts[:, 0] * (-13 - i), rcond=None)[0]
            e0 = np.array([-13 - i, *free])
            np.testing.assert_allclose(f[f"results/r{i}"][()], energies - counts @ e0,
                                       rtol=1e-9, atol=1e-8)
    assert litter(tmp_path) == []


def holds_open(process, name):
    """Whether `process` has a file called `name` open (read from /proc)."""
    fds = f"/proc/{process.pid}/fd"
    with_names = []
    for fd in os.listdir(fds) if os.path.isdir(fds) else ():
        with contextlib.suppress(OSError):
            with_names.append(os.path.basename(os.readlink(os.path.join(fds, fd))))
    return name in with_names


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_a_compressed_output_that_fits_is_written_and_one_that_does_not_is_refused(
        tmp_path, compression):
    """A structure of 250 000 atoms (6 MB of positions) under a 4 MB file-size limit: zeros
    compress to almost nothing and are written; random numbers are refused."""
    n = 250_000
    for kind, positions in (("zeros", np.zeros((n, 3))),
                            ("random", np.random.default_rng(0).normal(size=(n, 3)))):
        source = write_batch(tmp_path / f"{kind}.h5", [n], {"positions": positions})
        out = tmp_path / f"{kind}-{compression}.h5"
        code, _, err = finish(segcli("convert", source, "-o", out, "--compression", compression,
                                     "--quiet", limit=4 << 20))
        if kind == "zeros":
            assert code == 0, err
            with h5py.File(out) as f:
                assert f["atoms/positions"].compression == compression
                np.testing.assert_array_equal(f["atoms/positions"][()], positions)
        else:
            assert code == 1 and len(err.splitlines()) == 1 and "File too large" in err, err
            assert not out.exists()
    assert litter(tmp_path) == []


def test_writers_of_one_file_take_turns_through_any_name(tmp_path, composition_file):
    """`convert -o F --force` is stopped while it writes; `fit-e0 --in-place` through a link
    to F starts meanwhile, and must wait for it: then both land (the in-place result is in
    convert's new file) and the link is still a link."""
    source, counts, energies = composition_file
    path = write_batch(tmp_path / "data.h5", [1], {"numbers": [1]}, {"energy": [-13.0]})
    link = tmp_path / "link.h5"
    link.symlink_to(path.name)
    convert = segcli("convert", source, "-o", path, "--force")
    wait_for_temporary(tmp_path, convert)
    convert.send_signal(signal.SIGSTOP)
    in_place = segcli("fit-e0", link, "--in-place", "--name", "e", "--fixed", "H=-13.6")
    while not holds_open(in_place, ".data.h5.lock") and in_place.poll() is None:
        time.sleep(0.01)
    time.sleep(0.5)
    convert.send_signal(signal.SIGCONT)
    for process in (convert, in_place):
        code, _, err = finish(process)
        assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == "data.h5"
    with h5py.File(path) as f:
        np.testing.assert_array_equal(f["structures/n_atoms"][()], counts.sum(axis=1))
        free = np.linalg.lstsq(counts[:, 1:].astype(float), energies - counts[:, 0] * -13.6,
                               rcond=None)[0]
        np.testing.assert_allclose(f["results/e"][()], energies - counts @ [-13.6, *free],
                                   rtol=1e-9, atol=1e-8)
    assert litter(tmp_path) == []


def test_a_writer_waits_its_turn_and_if_interrupted_leaves_nothing(tmp_path):
    """The test holds the lock of a file; an in-place run waits for it. Interrupted while it
    waits, the run leaves the file and the lock as they were. Another run waits until the lock
    file is removed and released, then makes its own and lands."""
    import fcntl

    path = write_batch(tmp_path / "d.h5", [1, 2], {"numbers": [1, 1, 1]}, {"energy": [-1., -2.]})
    before = digest(path)
    lock = tmp_path / ".d.h5.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = segcli("fit-e0", path, "--in-place", "--quiet")
        while not holds_open(waiter, lock.name):
            assert waiter.poll() is None, waiter.communicate()
            time.sleep(0.01)
        waiter.send_signal(signal.SIGTERM)
        assert finish(waiter)[::2] == (143, "Interrupted (SIGTERM)\n")
        assert digest(path) == before and litter(tmp_path) == [lock.name]
        waiter = segcli("fit-e0", path, "--in-place", "--quiet")
        while not holds_open(waiter, lock.name):
            assert waiter.poll() is None, waiter.communicate()
            time.sleep(0.01)
        time.sleep(0.2)
        assert waiter.poll() is None
        lock.unlink()
    code, _, err = finish(waiter)
    assert code == 0, err
    with h5py.File(path) as f:
        np.testing.assert_allclose(f["results/residual_energy"][()], [0, 0], atol=1e-12)
    assert litter(tmp_path) == []


def test_an_output_through_a_link_writes_the_file_it_points_to(tmp_path):
    from click.testing import CliRunner

    from segcli.cli import main

    source = write_batch(tmp_path / "in.h5", [2], {"numbers": [1, 8]}, {"energy": [-1.0]})
    (tmp_path / "real.h5").write_bytes(b"old")
    link = tmp_path / "link.h5"
    link.symlink_to("real.h5")
    result = CliRunner().invoke(main, ["convert", str(source), "-o", str(link), "--force"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and values(tmp_path / "real.h5") == values(source)
    assert sorted(os.listdir(tmp_path)) == ["in.h5", "link.h5", "real.h5"]


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, composition_file):
    source, _, _ = composition_file
    path = tmp_path / "big.h5"
    path.write_bytes(source.read_bytes())
    before = digest(path)
    outputs = [(["select", path, "--where", "energy < 0", "-o", tmp_path / "out.h5"], 4096),
               (["select", path, "--where", "energy < 0", "-o", tmp_path / "out.h5"], 3 << 20),
               (["fit-e0", path, "--in-place"], 4096),
               (["fit-e0", path, "--in-place"], path.stat().st_size + (2 << 20)),
               (["stats", path, "numbers", "--per-element", "-o", tmp_path / "s.h5"], 4096)]
    for args, limit in outputs:
        code, _out, err = finish(segcli(*args, limit=limit))
        name = (args[0], limit)
        assert code == 1 and err.startswith("Error: ") and len(err.splitlines()) == 1, (name, err)
        assert "File too large" in err and "Traceback" not in err, (name, err)
    assert digest(path) == before
    assert sorted(os.listdir(tmp_path)) == ["big.h5"]
    with open("/dev/full", "w") as full:
        process = subprocess.run([sys.executable, "-m", "segcli", "stats", path, "energy"],
                                 stdout=full, stderr=subprocess.PIPE, text=True)
    assert (process.returncode, process.stderr) == (
        1, "Error: stdout: No space left on device\n")


def test_a_killed_runs_temporary_is_removed_by_the_next(tmp_path, composition_file):
    source, _, _ = composition_file
    out = tmp_path / "out.h5"
    process = segcli("select", source, "--where", "energy < 0", "-o", out)
    signal_while_writing(tmp_path, process, signal.SIGKILL)
    process.wait()
    assert litter(tmp_path) and not out.exists()
    from click.testing import CliRunner

    from segcli.cli import main

    result = CliRunner().invoke(main, ["select", str(source), "--where", "energy < 0", "-o",
                                       str(out)])  # the next run: in this process
    assert result.exit_code == 0, result.output
    assert litter(tmp_path) == []


def test_only_regular_files_are_replaced_and_never_a_new_one(tmp_path, composition_file):
    source, _, _ = composition_file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = finish(segcli("stats", source, "energy", "-o", fifo, "--force"))
    assert code == 1 and "not a regular file" in err
    assert fifo.is_fifo()
    target = tmp_path / "new.h5"
    with pytest.raises(DataError, match="made while this run worked"):
        with atomic_output(target, replace=False) as tmp:
            open(tmp, "w").write("mine")  # noqa: SIM115
            target.write_text("theirs")
    assert target.read_text() == "theirs" and sorted(os.listdir(tmp_path)) == ["fifo", "new.h5"]


@pytest.mark.parametrize("command", [["stats", "{f}", "energy", "-o", "{f}", "--force"],
                                     ["convert", "{f}", "-o", "{f}", "--force"],
                                     ["select", "{f}", "--where", "energy < 0", "-o", "{f}",
                                      "--force"]])
def test_an_output_that_is_the_input_is_refused(tmp_path, command):
    from click.testing import CliRunner

    from segcli.cli import main

    path = write_batch(tmp_path / "in.h5", [2], {"numbers": [1, 8]}, {"energy": [-1.0]})
    before = digest(path)
    result = CliRunner().invoke(main, [part.format(f=path) for part in command])
    assert result.exit_code == 2 and "is FILE itself" in result.output, result.output
    assert digest(path) == before


def values(path):
    """Every dataset's values (bytes; strings as a list), dtype and shape (not the attributes:
    they hold the time)."""
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            data = obj[()]
            out[name] = (data.tolist() if data.dtype.kind == "O" else data.tobytes(),
                         obj.dtype.str, obj.shape)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


@pytest.mark.parametrize("stderr", ["closed", pytest.param("/dev/full", marks=pytest.mark.slow)])
def test_a_closed_or_full_stderr_loses_messages_not_results(tmp_path, stderr):
    """convert, reduce (JAX and Warp loaded), select and stats -o, each run as a program with
    stderr closed (`2>&-`) or on a full device: exit 0 and the outputs of a plain run (in
    this process)."""
    metals = os.path.join(os.path.dirname(__file__), "..", "..", "sample_data", "metals")
    commands = {
        "converted.h5": ["convert", f"{metals}.extxyz", "-o"],
        "reduced.h5": ["reduce", f"{metals}.h5", "rms_norm", "forces", "--chunk-atoms", "500",
                       "-o"],
        "selected.h5": ["select", f"{metals}.h5", "--where", "energy < 1", "-o"],
        "stats.h5": ["stats", f"{metals}.h5", "forces", "-o"],
    }
    from click.testing import CliRunner

    from segcli.cli import main

    redirect = "2>&-" if stderr == "closed" else "2>/dev/full"
    for directory in ("plain", "hampered"):
        (tmp_path / directory).mkdir()
    for name, args in commands.items():  # the plain runs need no process of their own
        result = CliRunner().invoke(main, [*args, str(tmp_path / "plain" / name)])
        assert result.exit_code == 0, (name, result.output)
    script = "\n".join(
        f"{sys.executable} -m segcli {' '.join(map(shlex.quote, args))} hampered/{name} "
        f"{redirect}; echo {name} $?" for name, args in commands.items())
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.splitlines() == [f"{name} 0" for name in commands]
    for name in commands:
        assert values(tmp_path / "hampered" / name) == values(tmp_path / "plain" / name), name


def test_closed_stdin_or_stdout_and_a_full_stdout_are_one_line(tmp_path):
    """Commands started with stdin or stdout closed (`<&-`, `>&-`), or printing --help and
    --version to a full device: one line naming the stream, exit 1, and no file written in
    the place of the closed one."""
    metals = os.path.join(os.path.dirname(__file__), "..", "..", "sample_data", "metals.h5")
    closed_stdout = "Error: stdout: closed, nothing can be printed"
    closed_stdin = "Error: stdin: closed, nothing to read"
    cases = [
        (f"info {metals} >&-", closed_stdout),
        (f"reduce {metals} sum forces >&-", closed_stdout),
        (f"stats {metals} forces --json >&-", closed_stdout),
        ("ops >&-", closed_stdout),
        (f"select {metals} --structures-from - -o out.h5 <&-", closed_stdin),
        ("info - <&-", closed_stdin),
        ("info @- <&-", closed_stdin),
        ("--help >/dev/full", "Error: stdout: No space left on device"),
        ("--version >/dev/full", "Error: stdout: No space left on device"),
    ]
    script = "\n".join(f"{sys.executable} -m segcli {line} 2>>err; echo $? >> codes"
                       for line, _ in cases)
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True)
    assert (tmp_path / "err").read_text().splitlines() == [message for _, message in cases]
    assert (tmp_path / "codes").read_text().split() == ["1"] * len(cases)
    assert sorted(os.listdir(tmp_path)) == ["codes", "err"]
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m segcli reduce {metals} rms_norm "
                                         "forces -o out.h5 -q >&-"], cwd=tmp_path)
    assert done.returncode == 0 and os.path.getsize(tmp_path / "out.h5") > 0


def test_an_output_name_of_250_bytes_is_written(tmp_path):
    """The temporaries of a long name carry a shortened one (a file name has 255 bytes)."""
    from click.testing import CliRunner

    from segcli.cli import main

    metals = os.path.join(os.path.dirname(__file__), "..", "..", "sample_data", "metals.h5")
    written, copied = (tmp_path / (c * 123 + ".h5") for c in "éè")  # 249 bytes each
    assert len(os.fsencode(written.name)) == 249
    result = CliRunner().invoke(main, ["reduce", metals, "sum", "forces", "-o", str(written)])
    assert result.exit_code == 0, result.output
    shutil.copy(metals, copied)
    result = CliRunner().invoke(main, ["reduce", str(copied), "rms_norm", "forces",
                                       "--in-place"])
    assert result.exit_code == 0, result.output
    for path, name in ((written, "sum_forces"), (copied, "rms_norm_forces")):
        with h5py.File(path) as f:
            assert list(f["results"]) == [name]
    assert sorted(os.listdir(tmp_path)) == sorted([written.name, copied.name])


def test_a_cache_that_cannot_be_made_is_named_with_the_remedy(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WARP_CACHE_PATH"}
    metals = os.path.join(os.path.dirname(__file__), "..", "..", "sample_data", "metals.h5")
    done = subprocess.run([sys.executable, "-m", "segcli", "reduce", metals, "sum", "forces",
                           "-o", tmp_path / "out.h5"], capture_output=True, text=True,
                          env={**env, "XDG_CACHE_HOME": "/proc/nonexistent"})
    assert done.returncode == 1 and os.listdir(tmp_path) == []
    assert done.stderr == ("Error: /proc/nonexistent: cannot hold Warp's kernel cache (No such "
                           "file or directory); set WARP_CACHE_PATH or XDG_CACHE_HOME to a "
                           "writable directory\n")


def test_a_text_file_is_an_error_not_an_empty_batch(tmp_path):
    from click.testing import CliRunner

    from segcli.cli import main

    notes = tmp_path / "notes.md"  # ASE guesses castep-md from the name
    notes.write_text("# Notes\n\nnot structures\n")
    for args in (["info", notes], ["convert", notes, "-o", tmp_path / "out.h5"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 1
        assert result.stderr == (f"Error: {notes}: ASE reads no structure from it as castep-md "
                                 "(not a structure file?)\n")
    assert os.listdir(tmp_path) == ["notes.md"]


def test_a_file_another_program_writes_is_busy_not_corrupt(tmp_path):
    from click.testing import CliRunner

    from segcli.cli import main

    path = tmp_path / "held.h5"
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "..", "sample_data", "metals.h5"),
                path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, h5py; f = h5py.File(sys.argv[1], "
                               "'r+'); print('open', flush=True); sys.stdin.read()", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        result = CliRunner().invoke(main, ["info", str(path)])
    finally:
        holder.communicate("")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {path}: busy: another program has it open for writing "
                             "(HDF5's file lock); try again once it is done\n")


def test_a_killed_cluster_runs_parts_are_removed_by_the_next(tmp_path):
    """The parts directory of a --scheduler run is removed when it ends; one that a killed run
    of this host left (its process gone) by the next run beside it, one of a live run kept."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace(".", "-")
    left = tmp_path / f".segcli-parts-{dead.pid}@{host}.abc"
    live = tmp_path / f".segcli-parts-{os.getppid()}@{host}.def"
    for directory in (left, live):
        directory.mkdir()
        (directory / "part-0.h5").write_bytes(b"part")
    with scratch_directory(tmp_path) as parts:
        assert os.path.isdir(parts) and not left.exists() and live.exists()
        assert os.path.basename(parts).startswith(f".segcli-parts-{os.getpid()}@{host}.")
        open(os.path.join(parts, "part-0.h5"), "wb").close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
