"""Hostile readers, fourth round: what segcli reads from damaged and odd files is what h5py
and ASE read from them, or one line naming the file and exit 1."""

import json

import h5py
import numpy as np
from batch_reference import write_batch
from click.testing import CliRunner

from segcli.cli import main

N_ATOMS = [3, 2, 4]
POSITIONS = np.arange(27.0).reshape(9, 3) / 7


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sums(result, key):
    assert result.exit_code == 0, result.output
    return np.array([json.loads(line)[key] for line in result.stdout.splitlines()])


def assert_one_line(result, path, *needles):
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and str(path) in lines[0], result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_field_through_an_external_link_is_read_from_the_file_it_lies_in(tmp_path):
    """The direct reader mapped a linked dataset's offset in its own file onto the linking
    file's bytes: garbage sums, exit 0."""
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f["pad"] = np.full(300, 7.0)  # the data lies at another offset than in the link file
        f["p"] = POSITIONS
    path = write_batch(tmp_path / "linked.h5", N_ATOMS, {"numbers": np.ones(9, np.int64)})
    with h5py.File(path, "a") as f:
        f["atoms/positions"] = h5py.ExternalLink("target.h5", "/p")
    want = [POSITIONS[0:3].sum(0), POSITIONS[3:5].sum(0), POSITIONS[5:9].sum(0)]
    got = sums(run("reduce", path, "sum", "positions", "--format", "json"), "sum_positions")
    np.testing.assert_allclose(got, want)
    stats = run("stats", path, "positions", "--json")
    assert stats.exit_code == 0, stats.output
    rows = [r for r in json.loads(stats.stdout)["stats"] if r["component"] in ("0", "1", "2")]
    np.testing.assert_allclose([r["max"] for r in rows], POSITIONS.max(0))
    np.testing.assert_allclose([r["mean"] for r in rows], POSITIONS.mean(0))


def test_fields_not_shaped_as_ase_s_derive_nothing(tmp_path):
    """A cell stored as (S, 3) or masses as (N, 3) made scaled_positions and velocities a
    traceback (AxisError, broadcasting); now they are no field, named in one line."""
    path = write_batch(tmp_path / "cell.h5", N_ATOMS,
                       {"positions": POSITIONS, "momenta": POSITIONS, "masses": POSITIONS},
                       {"cell": np.ones((3, 3))})
    for field in ("scaled_positions", "velocities"):
        assert_one_line(run("reduce", path, "sum", field), path, field)
    info = run("info", "--json", path)
    assert info.exit_code == 0 and "scaled_positions" not in info.stdout, info.output
