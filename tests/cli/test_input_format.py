"""`--input-format NAME` (every command's; --format is what a command writes or prints):
files whose content no reader recognises are read as the format named, by every command,
one file or many, against ASE's own reading of them."""

import io
import json

import ase.io
import numpy as np
import pytest
from ase.build import bulk
from click.testing import CliRunner

from segcli.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def poscars(tmp_path, count=2):
    """POSCAR files named .dat (VASP's format has no magic: only its name tells ASE), written
    by ASE; returns their paths and the Atoms ASE reads back from them."""
    paths, frames = [], []
    for i in range(count):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, i + 1))
        atoms.rattle(0.1, seed=i)
        path = tmp_path / f"cell{i}.dat"
        ase.io.write(path, atoms, format="vasp")
        paths.append(path)
        frames.append(ase.io.read(path, format="vasp"))
    return paths, frames


def test_a_file_no_reader_recognises_is_read_as_the_format_named(tmp_path):
    paths, frames = poscars(tmp_path, 1)
    refused = run("info", paths[0])  # ASE guesses GAMESS-US from the name
    assert refused.exit_code == 1
    assert f"{paths[0]}: ASE cannot read structure 0 as gamess-us-punch" in refused.stderr
    for option in ("--input-format",):
        result = run("info", "--json", option, "vasp", paths[0])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["structures"] == 1
    result = run("reduce", paths[0], "sum", "positions", "--input-format", "vasp",
                 "--format", "json")
    assert result.exit_code == 0, result.output
    sums = [json.loads(line)["sum_positions"] for line in result.stdout.splitlines()]
    np.testing.assert_allclose(sums, [frames[0].positions.sum(axis=0)], rtol=1e-14)


@pytest.mark.parametrize("command", ["reduce", "stats", "convert", "select"])
def test_many_files_are_read_as_the_format_named(tmp_path, command):
    """Every member of a batch of files, opened again while streaming, is read as forced."""
    paths, frames = poscars(tmp_path)
    positions = np.concatenate([a.positions for a in frames])
    pattern, out = tmp_path / "cell*.dat", tmp_path / "out.h5"
    if command == "reduce":
        result = run("reduce", pattern, "max_norm", "positions", "--input-format", "vasp")
        assert result.exit_code == 0, result.output
        rows = np.loadtxt(io.StringIO(result.stdout), delimiter=",", skiprows=1, ndmin=2)
        np.testing.assert_allclose(
            rows[:, -1], [np.linalg.norm(a.positions, axis=1).max() for a in frames], rtol=1e-14)
    elif command == "stats":
        result = run("stats", pattern, "positions", "--json", "--input-format", "vasp")
        assert result.exit_code == 0, result.output
        rows = json.loads(result.stdout)["stats"]
        means = [row["mean"] for row in rows if row["component"] in "012"]
        np.testing.assert_allclose(means, positions.mean(axis=0), rtol=1e-13)
    else:
        (tmp_path / "second.txt").write_text("1\n")
        inputs, kept = (([pattern, "--structures-from", tmp_path / "second.txt"], frames[1:])
                        if command == "select" else (paths, frames))
        result = run(command, *inputs, "-o", out, "--input-format", "vasp")
        assert result.exit_code == 0, result.output
        read = run("reduce", out, "sum", "positions", "--format", "json")
        expected = [a.positions.sum(axis=0) for a in kept]
        sums = [json.loads(line)["sum_positions"] for line in read.stdout.splitlines()]
        np.testing.assert_allclose(sums, expected, rtol=1e-14)


@pytest.mark.parametrize("command", [["info"], ["reduce", "sum", "positions"]])
def test_an_unknown_format_is_a_usage_error(tmp_path, command):
    paths, _ = poscars(tmp_path, 1)
    result = run(command[0], paths[0], *command[1:], "--input-format", "poscarx")
    assert result.exit_code == 2
    assert "poscarx: no such input format; segcli's are segcli, conformers" in result.stderr


def test_a_file_of_another_format_says_what_it_was_read_as(tmp_path):
    paths, _ = poscars(tmp_path, 1)
    result = run("info", "--input-format", "traj", paths[0])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {paths[0]}: ASE cannot read structure 0 as traj")
