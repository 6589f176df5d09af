"""`segcli neighbors` (SPEC §3e) against ASE's and vesin's neighbour lists: random cells of
every shape (tiny, skewed, thinner than the cutoff, partly periodic, none), an atom pair
exactly at the cutoff, empty structures; counts exactly, distances to 1e-12."""

import io
import json

import ase
import ase.io
import h5py
import numpy as np
import pytest
import vesin
from ase.build import bulk, molecule
from ase.neighborlist import neighbor_list
from batch_reference import write_batch
from test_cli_data import assert_data_error, run


def random_structures(seed=0):
    """Structures of every kind of cell, each rattled: bulk supercells, the primitive fcc cell
    (thinner than the cutoff), random skewed cells under each pbc mix, a slab whose third
    vector is zero, molecules without a cell, an empty cell and an empty molecule."""
    rng = np.random.default_rng(seed)
    frames = [bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 2, 2), bulk("Cu", "fcc", a=3.61),
              bulk("Si", "diamond", a=5.43), bulk("Fe", "bcc", a=2.87) * (3, 1, 2)]
    for k in range(10):
        cell = np.diag(rng.uniform(1.0, 7.0, 3)) + np.triu(rng.uniform(-2.0, 2.0, (3, 3)), 1)
        cell = cell[rng.permutation(3)] if k % 3 == 0 else cell
        n = int(rng.integers(1, 12))
        pbc = [bool(b) for b in rng.integers(0, 2, 3)] if k > 1 else [True] * 3
        positions = rng.uniform(-0.3, 1.3, (n, 3)) @ cell  # some outside the cell
        frames.append(ase.Atoms(numbers=rng.integers(1, 30, n), positions=positions,
                                cell=cell, pbc=pbc))
    slab = ase.Atoms("C6", positions=rng.uniform(0, 6, (6, 3)),
                     cell=[[6.0, 0, 0], [1.0, 5.5, 0], [0, 0, 0]], pbc=[True, True, False])
    frames += [slab, molecule("CH3CH2OH"), molecule("C6H6"),
               ase.Atoms(cell=np.eye(3) * 3, pbc=True), ase.Atoms()]
    for k, atoms in enumerate(frames[:4]):
        atoms.rattle(0.05, seed=k)
    return frames


def write_frames(path, frames):
    """A segcli HDF5 file of the frames (positions, numbers, cell, pbc), written with h5py."""
    positions = [a.positions for a in frames]
    return write_batch(path, [len(a) for a in frames],
                       {"positions": np.concatenate(positions) if positions else np.zeros((0, 3)),
                        "numbers": np.concatenate([a.numbers for a in frames])},
                       {"cell": np.stack([a.cell.array for a in frames]),
                        "pbc": np.stack([a.pbc for a in frames])})


def results(path):
    with h5py.File(path) as f:
        return {name: ds[()] for name, ds in f["results"].items()}


def expected(atoms, cutoff):
    """ASE's pairs (i, j, d) within the cutoff, checked against vesin's count."""
    i, j, d = neighbor_list("ijd", atoms, cutoff)
    if len(atoms):
        vi, = vesin.NeighborList(cutoff=cutoff, full_list=True).compute(
            atoms.positions, atoms.cell.array, atoms.pbc, "i")
        assert len(vi) == len(i)
    return i, j, d


def assert_matches(out, frames, cutoff, k=None):
    """The results `out` of one run agree with ASE's neighbour list at `cutoff` (column k of
    several cutoffs, named NAME_cutoff, or the plain names)."""
    suffix = "" if k is None else f"_{cutoff:g}"
    first = 0
    for s, atoms in enumerate(frames):
        i, j, d = expected(atoms, cutoff)
        assert out["n_pairs" + suffix][s] == len(i)
        mean = out["mean_neighbors" + suffix][s]
        assert np.isnan(mean) if not len(atoms) else mean == len(i) / len(atoms)
        counts = out["n_neighbors" + suffix][first:first + len(atoms)]
        np.testing.assert_array_equal(counts, np.bincount(i, minlength=len(atoms)))
        first += len(atoms)
        if k is not None:
            continue
        if not len(i):
            assert out["min_distance"][s] == np.inf
            assert out["min_pair_i"][s] == out["min_pair_j"][s] == -1
            continue
        assert abs(out["min_distance"][s] - d.min()) <= 1e-12
        pair_i, pair_j = out["min_pair_i"][s], out["min_pair_j"][s]
        ties = np.abs(d - d.min()) <= 1e-12
        assert pair_i == i[ties].min()
        assert pair_j == j[ties & (i == pair_i)].min()


@pytest.mark.parametrize("seed", [0, 1])
def test_counts_and_nearest_pairs_are_those_of_ase(tmp_path, seed):
    frames = random_structures(seed)
    path = write_frames(tmp_path / "cells.h5", frames)
    out = tmp_path / "out.h5"
    result = run("neighbors", path, "--cutoff", 3.7, "--per-atom", "-o", out)
    assert result.exit_code == 0, result.output
    assert_matches(results(out), frames, 3.7)


def test_a_chunk_of_many_files_holds_each_files_own_positions(tmp_path):
    """One file per structure, all in one chunk: each file's positions are read into a buffer
    of their own, and the counts are ASE's."""
    frames = random_structures(3)
    (tmp_path / "in").mkdir()
    for k, atoms in enumerate(frames):
        write_frames(tmp_path / "in" / f"{k:02d}.h5", [atoms])
    out = tmp_path / "out.h5"
    result = run("neighbors", tmp_path / "in", "--cutoff", 3.7, "--per-atom", "-o", out)
    assert result.exit_code == 0, result.output
    assert_matches(results(out), frames, 3.7)


def test_several_cutoffs_small_chunks_and_the_histogram(tmp_path):
    frames = random_structures(2)
    path = write_frames(tmp_path / "cells.h5", frames)
    out = tmp_path / "out.h5"
    result = run("neighbors", path, "--cutoff", 5, "--cutoff", 2.5, "--per-atom",
                 "--histogram", 8, "--chunk-atoms", 7, "--format", "json", "-o", out)
    assert result.exit_code == 2  # --format is for stdout
    result = run("neighbors", path, "--cutoff", 5, "--cutoff", 2.5, "--per-atom",
                 "--histogram", 8, "--chunk-atoms", 7, "-o", out)
    assert result.exit_code == 0, result.output
    got = results(out)
    for k, cutoff in enumerate([2.5, 5]):
        assert_matches(got, frames, cutoff, k)
    distances = np.concatenate([neighbor_list("d", a, 5.0) for a in frames])
    lines = result.stderr.splitlines()
    table = lines[lines.index("distance from (Å)  to (Å)  pairs") + 1:][:8]
    counts = [int(line.split()[2]) for line in table]
    np.testing.assert_array_equal(counts, np.histogram(distances, bins=8, range=(0, 5))[0])
    assert f"within 5 Å, {len(distances)} ordered pairs" in result.stderr


def test_a_pair_exactly_at_the_cutoff_is_not_a_neighbour(tmp_path):
    frames = [ase.Atoms("H2", positions=[[0, 0, 0], [2.5, 0, 0]]),
              ase.Atoms("H", cell=[2.5, 9, 9], pbc=[True, False, False]),
              ase.Atoms("H2", positions=[[0, 0, 0], [np.nextafter(2.5, 0), 0, 0]])]
    path = write_frames(tmp_path / "edge.h5", frames)
    result = run("neighbors", path, "--cutoff", 2.5, "--format", "json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["n_pairs"] for r in rows] == [len(neighbor_list("i", a, 2.5)) for a in frames]
    assert [r["n_pairs"] for r in rows] == [0, 0, 2]
    summary = json.loads(result.stderr.strip().splitlines()[-1])
    assert summary["pairs"] == [2] and summary["min_pair"] == {"structure": 2, "i": 0, "j": 1}


def test_an_extxyz_written_by_ase_streams_as_the_same_numbers(tmp_path):
    frames = [a for a in random_structures(3) if len(a) and a.pbc.any() == a.pbc.all()]
    path = tmp_path / "cells.extxyz"
    ase.io.write(path, frames)
    result = run("neighbors", path, "--cutoff", 4.0)
    assert result.exit_code == 0, result.output
    table = np.genfromtxt(io.StringIO(result.stdout), delimiter=",", names=True)
    assert table.dtype.names == ("structure", "n_pairs", "mean_neighbors", "min_distance",
                                 "min_pair_i", "min_pair_j")
    np.testing.assert_array_equal(table["n_pairs"],
                                  [len(neighbor_list("i", a, 4.0)) for a in frames])


def test_results_in_place_are_fields_for_select_and_stats(tmp_path):
    frames = [bulk("Cu", "fcc", a=3.61, cubic=True), molecule("H2O"),
              ase.Atoms("H2", positions=[[0, 0, 0], [0.3, 0, 0]])]
    path = write_frames(tmp_path / "b.h5", frames)
    assert run("neighbors", path, "--cutoff", 3, "--in-place").exit_code == 0
    selected = tmp_path / "close.h5"
    result = run("select", path, "--where", "min_distance < 0.5", "-o", selected)
    assert result.exit_code == 0, result.output
    with h5py.File(selected) as f:
        np.testing.assert_array_equal(f["structures/n_atoms"][()], [2])
    result = run("stats", path, "n_pairs", "--json")
    assert result.exit_code == 0, result.output
    want = [len(neighbor_list("i", a, 3.0)) for a in frames]
    assert json.loads(result.stdout)["stats"][0]["max"] == max(want)
    result = run("neighbors", path, "--cutoff", 1, "--where", "min_distance < 0.5", "--format",
                 "json", "-q")
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["structure"] for line in result.stdout.splitlines()] == [2]


def test_positions_in_bohr_are_converted(tmp_path):
    water = molecule("H2O")
    path = tmp_path / "conformers.h5"
    with h5py.File(path, "w") as f:
        group = f.create_group("water")
        group["atomic_numbers"] = water.numbers
        group["conformations"] = (water.positions / ase.units.Bohr)[None]
        group["conformations"].attrs["units"] = "bohr"
    result = run("neighbors", path, "--cutoff", 1.2, "--format", "json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["n_pairs"] == len(neighbor_list("i", water, 1.2)) == 4
    assert abs(row["min_distance"] - neighbor_list("d", water, 1.2).min()) <= 1e-12


@pytest.mark.parametrize(("cell", "pbc", "needle"), [
    ([[3, 0, 0], [6, 0, 0], [0, 0, 3]], [True, True, True], "singular along its periodic axes"),
    ([[0, 0, 0], [0, 4, 0], [0, 0, 4]], [True, False, False], "singular along its periodic"),
    ([[1e-6, 0, 0], [0, 4, 0], [0, 0, 4]], [True, True, True], "thin"),
])
def test_cells_that_cannot_be_searched_are_refused_in_one_line(tmp_path, cell, pbc, needle):
    frames = [molecule("H2O"), ase.Atoms("H", cell=cell, pbc=pbc)]
    path = write_frames(tmp_path / "bad.h5", frames)
    out = tmp_path / "out.h5"
    assert_data_error(run("neighbors", path, "--cutoff", 3, "-o", out), "structure 1", needle)
    assert not out.exists()


def test_usage_errors(tmp_path):
    path = write_frames(tmp_path / "b.h5", [molecule("H2O")])
    assert run("neighbors", path).exit_code == 2
    assert run("neighbors", path, "--cutoff", 0).exit_code == 2
    assert run("neighbors", path, "--cutoff", -1).exit_code == 2
    assert run("neighbors", path, "--cutoff", 2, "-o", tmp_path / "o.h5", "--in-place"
               ).exit_code == 2
    no_positions = write_batch(tmp_path / "x.h5", [2], {"x": np.zeros((2, 3))})
    assert_data_error(run("neighbors", no_positions, "--cutoff", 2), "no field 'positions'")


def test_structures_without_positions_get_nan_rows(tmp_path):
    """A structure that lacks positions (/present/positions) has NaN results and is left out
    of the summary; the others are as ASE counts them, whatever the chunks."""
    frames = [molecule("H2O"), ase.Atoms(), molecule("CH4"), bulk("Cu", "fcc", a=3.61)]
    path = write_frames(tmp_path / "b.h5", frames)
    have = np.array([True, True, False, True])
    with h5py.File(path, "a") as f:
        f["present/positions"] = have
        f["atoms/positions"][3:8] = np.nan  # the methane's rows
    out = tmp_path / "out.h5"
    result = run("neighbors", path, "--cutoff", 3, "--per-atom", "--chunk-atoms", 4,
                 "--histogram", 3, "-o", out)
    assert result.exit_code == 0, result.output
    got = results(out)
    for s, atoms in enumerate(frames):
        if have[s]:
            assert got["n_pairs"][s] == len(neighbor_list("i", atoms, 3.0))
        else:
            assert np.isnan(got["n_pairs"][s]) and np.isnan(got["min_distance"][s])
    assert np.isnan(got["n_neighbors"][3:8]).all() and not np.isnan(got["n_neighbors"][:3]).any()
    pairs = sum(len(neighbor_list("i", a, 3.0)) for a, h in zip(frames, have) if h)
    assert f"{pairs} ordered pairs over 4 atoms" in result.stderr
    most = max(np.bincount(neighbor_list("i", a, 3.0)).max() for a, h in zip(frames, have)
               if h and len(a))
    assert f"at most {most}\n" in result.stderr  # the zeroed methane counts nowhere
    distances = np.concatenate([neighbor_list("d", a, 3.0) for a, h in zip(frames, have) if h])
    lines = result.stderr.splitlines()
    table = lines[lines.index("distance from (Å)  to (Å)  pairs") + 1:][:3]
    np.testing.assert_array_equal([int(line.split()[2]) for line in table],
                                  np.histogram(distances, bins=3, range=(0, 3))[0])
