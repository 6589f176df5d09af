"""`segcli neighbors` on hostile input: no structure changes another's answer (NaN, infinite,
huge positions or cells beside good structures, each good one as computed alone and as ASE
counts it), cutoffs checked before any work and named exactly, and no death by signal."""

import json
import subprocess
import sys

import ase
import h5py
import jax
import numpy as np
import pytest
from ase.build import bulk, molecule
from ase.neighborlist import neighbor_list
from test_cli_data import assert_data_error, run
from test_neighbors import expected, results, write_frames

from segcli import neighborlist as neighbors
from segcli.io.core import Chunk

# ASE's own overflow at 1e300 Å, where its answers are still exact
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _atoms(positions, cell=None, pbc=False):
    return ase.Atoms(numbers=[1] * len(positions), positions=positions,
                     cell=np.zeros((3, 3)) if cell is None else cell, pbc=pbc)


def _good():
    """Structures of every kind of cell, rattled, with an atom pair 1 Å apart beside one at
    1e300 Å (a span that bins must not overflow)."""
    cu = bulk("Cu", "fcc", a=3.61, cubic=True) * (2, 1, 1)
    cu.rattle(0.05, seed=1)
    far_apart = _atoms([[0, 0, 0], [1e300, -1e300, 1e300], [1, 0, 0]])
    slab = _atoms(np.random.default_rng(2).uniform(0, 5, (7, 3)),
                  [[5.0, 0, 0], [1.0, 4.5, 0], [0, 0, 30]], [True, True, False])
    return [cu, molecule("CH3CH2OH"), far_apart, slab, bulk("Si", "diamond", a=5.43)]


def _bad():
    """(structure, its fault): NaN, +inf and -inf positions, and an atom 10⁹ Å from a 3 Å
    periodic cell."""
    water = molecule("H2O")
    out = []
    for value in (np.nan, np.inf, -np.inf):
        atoms = water.copy()
        atoms.positions[1, 0] = value
        out.append((atoms, 1))
    out.append((_atoms([[0, 0, 0], [1e9, 0.5, 0.5]], np.eye(3) * 3, True), 2))
    return out


def _statistics(frames, least=(0, 0)):
    """neighbors.compute of one chunk of `frames` at cutoffs 2.5 and 3.7, on the CPU."""
    n_atoms = np.array([len(a) for a in frames])
    chunk = Chunk(0, n_atoms, {"positions": np.concatenate([a.positions for a in frames])}, {})
    cells = np.stack([a.cell.array for a in frames])
    pbc = np.stack([a.pbc for a in frames])
    prepared = neighbors.prepare("batch.h5", chunk, cells, pbc, least=least)
    return neighbors.compute(prepared, [2.5, 3.7], jax.devices("cpu")[0], histogram_bins=4)


def test_a_faulty_structure_changes_no_other_answer():
    """Bad structures first, in the middle and last: each good structure's every statistic
    is what it gets alone and what ASE counts; the bad ones have their fault and NaN rows, and
    count in neither the largest neighbour count nor the histogram."""
    good, bad = _good(), _bad()
    frames, faults = [bad[0][0]], [bad[0][1]]
    for k, atoms in enumerate(good):
        frames.append(atoms)
        faults.append(0)
        if k + 1 < len(bad):
            frames.append(bad[k + 1][0])
            faults.append(bad[k + 1][1])
    frames.append(bad[1][0])
    faults.append(1)
    together = _statistics(frames)
    np.testing.assert_array_equal(together["fault"], faults)
    first = np.concatenate([[0], np.cumsum([len(a) for a in frames])])
    least = (len(together["n_neighbors"]), len(frames))
    for s, atoms in enumerate(frames):
        if faults[s]:
            assert np.isnan(together["n_pairs"][s]).all() and np.isnan(
                together["min_distance"][s])
            assert np.isnan(together["n_neighbors"][first[s]:first[s + 1]]).all()
            continue
        alone = _statistics([atoms], least)
        for name in ("n_pairs", "mean_neighbors", "min_distance", "min_pair_i", "min_pair_j"):
            np.testing.assert_array_equal(together[name][s], alone[name][0])
        np.testing.assert_array_equal(together["n_neighbors"][first[s]:first[s + 1]],
                                      alone["n_neighbors"])
        for k, cutoff in enumerate([2.5, 3.7]):
            i, _, d = expected(atoms, cutoff)
            assert together["n_pairs"][s, k] == len(i)
            np.testing.assert_array_equal(together["n_neighbors"][first[s]:first[s + 1], k],
                                          np.bincount(i, minlength=len(atoms)))
        assert abs(together["min_distance"][s] - d.min()) <= 1e-12
    distances = np.concatenate([neighbor_list("d", a, 3.7) for a in good])
    np.testing.assert_array_equal(together["histogram"],
                                  np.histogram(distances, bins=4, range=(0, 3.7))[0])
    most = [max(np.bincount(neighbor_list("i", a, c)).max() for a in good) for c in (2.5, 3.7)]
    np.testing.assert_array_equal(together["max_neighbors"], most)


@pytest.mark.parametrize(("place", "fault", "needle"), [
    (0, "+inf", "structure 0: its positions are not finite"),
    (1, "-inf", "structure 1: its positions are not finite"),
    (2, "far", "structure 2: an atom lies more than 1048576 cell lengths outside its periodic"),
    (1, "cell", "structure 1: its cell is not finite along its periodic axes"),
    (2, "nan", "field 'positions' holds 1 NaN value(s), the first in structure 2"),
])
def test_a_faulty_structure_is_refused_by_name_and_others_alone_are_answered(
        tmp_path, place, fault, needle):
    frames = [molecule("H2O"), bulk("Cu", "fcc", a=3.61, cubic=True), molecule("CH4")]
    frames[place] = frames[place].copy()
    if fault == "far":
        frames[place] = _atoms([[0, 0, 0], [1e9, 0.5, 0.5]], np.eye(3) * 3, True)
    elif fault == "cell":
        frames[place].cell = [np.inf, 4, 4]
        frames[place].pbc = True
    else:
        frames[place].positions[0, 1] = float(fault)
    path = write_frames(tmp_path / "b.h5", frames)
    out = tmp_path / "out.h5"
    assert_data_error(run("neighbors", path, "--cutoff", 3, "-o", out), needle)
    assert not out.exists()
    others = [s for s in range(3) if s != place]
    lo, hi = (1, 3) if place == 0 else (0, place)
    result = run("neighbors", path, "--cutoff", 3, "--structures", f"{lo}:{hi}", "--format",
                 "json", "-q")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["structure"] for r in rows] == [s for s in others if lo <= s < hi]
    assert [r["n_pairs"] for r in rows] == [len(neighbor_list("i", frames[r["structure"]], 3.0))
                                            for r in rows]


@pytest.mark.parametrize(("cutoffs", "needle"), [
    (["nan"], "cutoff nan is not a number"),
    (["inf"], "cutoff inf is above the largest cutoff, 1000000 Å"),
    (["2e6"], "cutoff 2000000 is above the largest cutoff"),
    (["0"], "cutoff 0 must be positive"),
    (["-1"], "cutoff -1 must be positive"),
    (["1e-200"], "cutoff 1e-200 is below the smallest cutoff, 1.49e-154 Å (the square"),
    (["2.5", "3", "2.50"], "cutoff 2.5 is given twice"),
])
def test_cutoffs_are_checked_before_any_file_is_read(tmp_path, cutoffs, needle):
    args = [a for c in cutoffs for a in ("--cutoff", c)]
    result = run("neighbors", tmp_path / "absent.h5", *args)
    assert result.exit_code == 2 and needle in result.stderr, result.output
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1


def test_results_of_close_cutoffs_have_names_of_their_own(tmp_path):
    """2.5 and 2.5000001 Å are two results, each counting its own pairs (one pair lies
    between them)."""
    frames = [_atoms([[0, 0, 0], [2.50000005, 0, 0], [0, 1, 0]])]
    path = write_frames(tmp_path / "b.h5", frames)
    out = tmp_path / "out.h5"
    result = run("neighbors", path, "--cutoff", 2.5000001, "--cutoff", 2.5, "-o", out)
    assert result.exit_code == 0, result.output
    got = results(out)
    for cutoff, label in ((2.5, "2.5"), (2.5000001, "2.5000001")):
        assert got[f"n_pairs_{label}"][0] == len(neighbor_list("i", frames[0], cutoff))
        assert f"within {label} Å" in result.stderr
    assert got["n_pairs_2.5"][0] == 2 and got["n_pairs_2.5000001"][0] == 4
    with h5py.File(out) as f:
        assert list(f["results/n_pairs_2.5"].attrs["cutoffs"]) == [2.5, 2.5000001]


@pytest.mark.parametrize(("frames", "cutoff", "needle"), [
    ([_atoms([[0, 0, 0], [1e292, 0, 0]], np.eye(3) * 1e300, True)], 5, None),
    ([_atoms([[0, 0, 0], [1e-150, 0, 0]])], 1e-149, None),
    ([_atoms([[0, 0, 0], [3e-300, 4e-300, 0], [1, 1, 1]])], 3, None),
    ([_atoms([[-1.7e308, 0, 0], [1.7e308, 0, 0], [1, 0, 0], [1.5, 0, 0]])], 3, None),
    ([_atoms(np.zeros((2, 3)), np.eye(3) * 1e-300, True)], 3, "would visit inf periodic"),
    ([_atoms(np.random.default_rng(0).uniform(0, 20, (20000, 3)) * [0.0005, 1, 1],
             np.diag([0.01, 20, 20]), [True, False, False])], 3,
     "would visit about 3.02e+06 atoms for each of its 20000 atoms"),
])
def test_extreme_cells_get_ase_answers_or_one_line(tmp_path, frames, cutoff, needle):
    """A 1e300 Å cell, distances of 1e-150 Å and of 5e-300 Å (whose square underflows: the
    reference is hypot's), a span that overflows; a 1e-300 Å cell and a thin cell of 20000
    atoms that would take hours are refused."""
    path = write_frames(tmp_path / "b.h5", frames)
    result = run("neighbors", path, "--cutoff", cutoff, "--per-atom", "-o", tmp_path / "o.h5")
    if needle:
        assert_data_error(result, "structure 0: its cell is", needle)
        return
    assert result.exit_code == 0, result.output
    got = results(tmp_path / "o.h5")
    i, vectors = neighbor_list("iD", frames[0], cutoff)
    assert got["n_pairs"][0] == len(i)
    np.testing.assert_array_equal(got["n_neighbors"], np.bincount(i, minlength=len(frames[0])))
    nearest = np.hypot(np.hypot(vectors[:, 0], vectors[:, 1]), vectors[:, 2]).min(initial=np.inf)
    assert got["min_distance"][0] == pytest.approx(nearest, rel=1e-15, abs=0)


_ACROSS = [[1, 1, 1], [1e9 - 0.5, 1, 1], [2, 1, 1], [5e8, 5e8, 5e8]]
"""Atoms of a 10⁹ Å cubic cell: pairs 1, 1.5 (across the boundary) and 2.5 Å apart."""


@pytest.mark.parametrize(("frames", "code"), [
    ([_atoms(_ACROSS, np.eye(3) * 1e9, True)], 0),
    pytest.param([molecule("H2O"), _atoms([[0, 0, 0], [1e9, 1e9, 1e9]], np.eye(3) * 3, True)],
                 1, marks=pytest.mark.slow),
    pytest.param([_atoms(np.zeros((2, 3)), [[3, 0, 0], [3, 1e-7, 0], [0, 0, 3]], True)], 1,
                 marks=pytest.mark.slow),
])
def test_no_input_kills_the_process_by_a_signal(tmp_path, frames, code):
    """In a real process: a 10⁹ Å cell (once SIGSEGV: its bins overflowed) gets its pairs,
    positions 10⁹ Å from a 3 Å cell and a nearly singular cell one line and exit 1."""
    path = write_frames(tmp_path / "b.h5", frames)
    process = subprocess.run([sys.executable, "-m", "segcli", "neighbors", str(path),
                              "--cutoff", "3", "--format", "json", "-q"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert process.returncode == code, process.stderr
    assert len(process.stderr.splitlines()) == code
    if code == 0:
        row = json.loads(process.stdout)
        assert (row["n_pairs"], row["min_distance"]) == (6, 1.0)


def test_scaled_positions_name_the_structure_whose_cell_cannot_be_inverted(tmp_path):
    flat = bulk("Cu", "fcc", a=3.61, cubic=True)
    flat.cell[1] = flat.cell[0]
    frames = [molecule("H2O"), bulk("Cu"), flat, bulk("Cu")]
    for atoms in frames[:2]:
        atoms.cell, atoms.pbc = np.eye(3) * 5, True
    path = write_frames(tmp_path / "b.h5", frames)
    assert_data_error(run("reduce", path, "sum", "scaled_positions", "--structures", "1:4"),
                      "structures 1 to 3: a cell that cannot be inverted (structure 2's: ")
