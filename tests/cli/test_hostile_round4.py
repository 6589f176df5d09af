"""Hostile round 4 (merges, shards, integers, neighbours): what it found, kept found.

A `merge --virtual` output reads its parts by path; a part rewritten since the merge by
another job (another op under the same name, another input) is refused, not read silently."""

import json

import h5py
import numpy as np
import pytest
from batch_reference import write_batch
from invoke import ok, run


@pytest.fixture(scope="module")
def virtual(tmp_path_factory):
    """data.h5 (12 structures), other.h5 (the same sizes, other forces), the two parts of
    `reduce rms_norm forces --shard I/2` of data.h5, and v.h5, their virtual merge."""
    here = tmp_path_factory.mktemp("virtual")
    rng = np.random.default_rng(4)
    n_atoms = rng.integers(1, 6, 12)
    n = int(n_atoms.sum())
    write_batch(here / "data.h5", n_atoms, {"forces": rng.normal(size=(n, 3))})
    write_batch(here / "other.h5", n_atoms, {"forces": rng.normal(size=(n, 3))})
    for i in range(2):
        ok("reduce", here / "data.h5", "rms_norm", "forces", "--shard", f"{i}/2", "-o",
           here / "parts" / "r-{shard}.h5", "-q")
    ok("merge", here / "parts" / "r-0.h5", here / "parts" / "r-1.h5", "-o", here / "v.h5",
       "--virtual", "-q")
    return here


def rewrite_part(here, *args):
    """Part 1 rewritten by another job, `reduce ARGS --shard 1/2 -o parts/r-1.h5 --force`."""
    ok("reduce", *args, "--shard", "1/2", "-o", here / "parts" / "r-1.h5", "--force", "-q")


@pytest.mark.parametrize("job, needle", [
    (("max_norm", "forces", "--name", "rms_norm_forces"), "op 'max_norm'"),
    (("rms_norm", "forces"), "source_fingerprint"),
], ids=["other-op", "other-input"])
def test_virtual_merge_refuses_a_rewritten_part(virtual, job, needle):
    before = ok("stats", virtual / "v.h5", "rms_norm_forces", "--json").output
    source = virtual / ("data.h5" if job[0] == "max_norm" else "other.h5")
    try:
        rewrite_part(virtual, source, *job)
        result = run("stats", virtual / "v.h5", "rms_norm_forces", "--json")
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "r-1.h5" in lines[0] and needle in lines[0], lines
        assert "merge the parts again" in lines[0]
    finally:  # the job's own part back: the virtual file reads it as before
        rewrite_part(virtual, virtual / "data.h5", "rms_norm", "forces")
    assert ok("stats", virtual / "v.h5", "rms_norm_forces", "--json").output == before


def test_virtual_merge_of_gradients_reads_its_parts(tmp_path):
    """Gradient parts keep their identity on the group /results/NAME: an intact virtual
    merge reads them, bit for bit what one run writes."""
    rng = np.random.default_rng(2)
    n_atoms = np.array([2, 0, 3, 1])
    write_batch(tmp_path / "d.h5", n_atoms, {"forces": rng.normal(size=(6, 3))})
    for i in range(2):
        ok("grad", tmp_path / "d.h5", "rms_norm", "forces", "--shard", f"{i}/2", "-o",
           tmp_path / "p" / "g-{shard}.h5", "-q")
    ok("merge", tmp_path / "p" / "g-0.h5", tmp_path / "p" / "g-1.h5", "-o", tmp_path / "v.h5",
       "--virtual", "-q")
    ok("grad", tmp_path / "d.h5", "rms_norm", "forces", "-o", tmp_path / "whole.h5", "-q")
    ok("stats", tmp_path / "v.h5", "rms_norm_forces/d_forces", "-q")
    with h5py.File(tmp_path / "v.h5") as v, h5py.File(tmp_path / "whole.h5") as w:
        name = "results/rms_norm_forces/d_forces"
        assert np.array_equal(v[name][()], w[name][()])


@pytest.mark.parametrize("text", ["1_0", "\u0661"])
def test_neighbors_cutoff_is_a_plain_number(tmp_path, text):
    """--cutoff takes a plain decimal number: Python's float reads '1_0' as 10 and Arabic-Indic
    digits as digits, which would give another cutoff's results with exit 0."""
    write_batch(tmp_path / "d.h5", [2], {"positions": np.array([[0, 0, 0], [1.5, 0, 0.0]]),
                                         "numbers": np.array([1, 1])})
    result = run("neighbors", tmp_path / "d.h5", "--cutoff", text)
    assert result.exit_code == 2, result.output
    assert f"cutoff {text!r} is not a number" in result.output
    ok("neighbors", tmp_path / "d.h5", "--cutoff", " 2.5", "-o", tmp_path / "n.h5", "-q")
    with h5py.File(tmp_path / "n.h5") as f:
        assert f["results/n_pairs"][()].tolist() == [2]


@pytest.mark.parametrize("text", ["0_5", "\u0660.5"])
def test_numbers_of_where_and_fixed_are_plain_numbers(tmp_path, text):
    """--where VALUE and fit-e0 --fixed SYMBOL=VALUE take plain decimal numbers too: '0_5'
    would be 5 and '٠.5' 0.5 to Python's float, fitting or choosing with another number."""
    path = write_batch(tmp_path / "d.h5", [2, 1], {"numbers": np.array([1, 1, 8])},
                       {"energy": np.array([-27.0, -75.0])})
    result = run("select", path, "--where", f"energy < {text}", "-o", tmp_path / "s.h5")
    assert result.exit_code == 2 and "is not one" in result.output, result.output
    result = run("fit-e0", path, "--fixed", f"H={text}")
    assert result.exit_code == 2 and f"'H={text}'" in result.output, result.output
    assert not (tmp_path / "s.h5").exists()
    fitted = json.loads(ok("fit-e0", path, "--fixed", "H=-13.5", "--json").stdout)
    assert {row["element"]: row["e0"] for row in fitted["e0"]} == {"H": -13.5, "O": -75.0}
